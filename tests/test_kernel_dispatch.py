"""embedding.kernel picks the implementation: a whole DLRM train step through the Pallas kernels (interpreted on
this CPU) equals the XLA path, for sum and mean pooling and optimizers with [R, D] and [R] state."""

import jax
import numpy as np
import pytest
from conftest import random_batch, train_steps
from test_train import tiny_config

from recjax.specs import DatasetSpec, FeatureSpec

SPEC = DatasetSpec(num_dense=3, features=(FeatureSpec("a", 13), FeatureSpec("b", 9, bag_size=3),
                                          FeatureSpec("c", 6, bag_size=2)))


def run_steps(kernel: str, sparse: str, pooling: str, steps: int = 3):
    config = tiny_config(steps=steps)
    config.embedding.kernel = kernel
    config.embedding.pooling = pooling
    config.optimizer.sparse.name = sparse
    config.optimizer.sparse.weight_decay = 1e-3
    batches = [jax.device_put(random_batch(SPEC, 8, seed=i)) for i in range(steps)]
    _, state, losses = train_steps(config, SPEC, batches)
    return state, losses


@pytest.mark.parametrize("sparse, pooling", [("rowwise_adagrad", "sum"), ("lazy_adam", "mean")])
def test_pallas_step_equals_xla_step(sparse, pooling):
    xla_state, xla_losses = run_steps("xla", sparse, pooling)
    pallas_state, pallas_losses = run_steps("pallas", sparse, pooling)
    np.testing.assert_allclose(pallas_losses, xla_losses, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves((pallas_state.tables, pallas_state.sparse_opt_state,
                                                    pallas_state.dense_params)),
                         jax.tree_util.tree_leaves((xla_state.tables, xla_state.sparse_opt_state,
                                                    xla_state.dense_params)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_auto_is_the_xla_path_on_cpu():
    auto_state, auto_losses = run_steps("auto", "sgd", "sum", steps=2)
    xla_state, xla_losses = run_steps("xla", "sgd", "sum", steps=2)
    assert auto_losses == xla_losses
    for got, want in zip(jax.tree_util.tree_leaves(auto_state.tables), jax.tree_util.tree_leaves(xla_state.tables),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
