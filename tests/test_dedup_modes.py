"""Training without dedup (embedding.dedup="auto" with plain SGD: bags pooled straight from the tables, every
occurrence's update scatter-added) equals the deduplicated path (embedding.dedup="always"), for methods that pool
first and per id, mixed dims, sum and mean pooling, duplicate ids, padding and out-of-range ids."""

import jax
import numpy as np
import pytest
from conftest import random_batch, train_steps
from test_train import tiny_config

from recjax.embedding import resolve_dedup
from recjax.sparse_optim import SGD, Adagrad, RowwiseAdagrad
from recjax.specs import DatasetSpec, FeatureSpec
from recjax.step import init_state, make_predict_step
from recjax.task import build_task

# Small vocabularies and bags of 3-4 ids over 8 examples: most ids repeat within a batch.
SPEC = DatasetSpec(num_dense=3, features=(FeatureSpec("a", 13), FeatureSpec("b", 9, bag_size=4),
                                          FeatureSpec("c", 40, bag_size=3), FeatureSpec("d", 6)))


def run(dedup: str, method: str, options: dict, pooling: str, batches, steps: int = 3):
    config = tiny_config(steps=steps)
    config.embedding.method = method
    for key, value in options.items():
        config.embedding.options[key] = value
    config.embedding.pooling = pooling
    config.embedding.dedup = dedup
    config.optimizer.sparse.name = "sgd"
    config.optimizer.sparse.learning_rate = 0.5  # large, so a wrong update shows
    return train_steps(config, SPEC, batches)


# The default suite keeps one case per path through the scatter-vs-dedup machinery: a plain table (full, mean), a
# method combining per id before pooling (qr_path: its MLP is not linear per row) and one pooling before a linear
# combine (md, sum). qr (mult: per id, like qr_path) and hashing (one table, like full) re-prove those paths: slow.
@pytest.mark.parametrize("method, options, pooling", [
    ("full", {}, "mean"),
    pytest.param("qr", {"op": "mult", "collisions": 2}, "sum", marks=pytest.mark.slow),
    ("qr_path", {"collisions": 2}, "mean"),
    ("md", {}, "sum"),
    pytest.param("hashing", {"buckets": 7}, "sum", marks=pytest.mark.slow),
])
def test_scatter_path_equals_dedup_path(method, options, pooling):
    batches = [jax.device_put(random_batch(SPEC, 8, seed=i)) for i in range(2)]
    direct_task, direct, direct_losses = run("auto", method, options, pooling, batches)
    dedup_task, dedup, dedup_losses = run("always", method, options, pooling, batches)
    assert not direct_task.collection.dedup and dedup_task.collection.dedup
    np.testing.assert_allclose(direct_losses, dedup_losses, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves((direct.tables, direct.dense_params)),
                         jax.tree_util.tree_leaves((dedup.tables, dedup.dense_params)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # The tables moved (a step that updated nothing would pass the comparison too).
    before = init_state(direct_task, jax.random.key(0), batches[0])
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree_util.tree_leaves(before.tables),
                                                     jax.tree_util.tree_leaves(direct.tables), strict=True))


def test_out_of_range_ids_read_zeros_and_get_no_update_without_dedup():
    batch = random_batch(SPEC, 8, seed=0, full_bags=True)
    batch.ids["c"][0, 0] = 40  # past the vocabulary: with bounds_check="zero" it reads zeros and is not updated
    batch.ids["c"][1, 1] = -3
    batches = [jax.device_put(batch)]
    direct_task, direct, direct_losses = run("auto", "full", {}, "sum", batches, steps=1)
    _, dedup, dedup_losses = run("always", "full", {}, "sum", batches, steps=1)
    np.testing.assert_allclose(direct_losses, dedup_losses, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(direct.tables["dim8"]), np.asarray(dedup.tables["dim8"]), rtol=1e-5,
                               atol=1e-6)
    # The row after feature c's last row (feature d's first) moved only if d's ids touched it.
    before = init_state(direct_task, jax.random.key(0), batches[0]).tables["dim8"]
    offset_d = direct_task.collection.placements["d"][0].offset
    if not (batch.ids["d"] == 0).any():
        np.testing.assert_array_equal(np.asarray(direct.tables["dim8"][offset_d]), np.asarray(before[offset_d]))


def test_predict_without_dedup_equals_the_dedup_forward():
    batch = jax.device_put(random_batch(SPEC, 8, seed=5))
    task, state, _ = run("always", "qr", {"op": "mult", "collisions": 2}, "mean", [batch], steps=1)
    probabilities = make_predict_step(task)(state, batch)  # routes with dedup=False

    @jax.jit  # the dedup forward in one compile, not an eager trace op by op
    def dedup_logits(state, batch):
        routes = task.collection.route(batch.ids, batch.lengths, dedup=True)
        assert routes.deduplicated
        rows = task.collection.gather(state.tables, routes)
        emb = task.glue.apply({"params": state.dense_params["glue"]}, rows, routes.features)
        return task.model.apply({"params": state.dense_params["model"]}, batch.dense, emb)

    logits = dedup_logits(state, batch)
    np.testing.assert_allclose(np.asarray(probabilities), np.asarray(jax.nn.sigmoid(logits)), rtol=1e-5, atol=1e-7)


def test_dedup_is_skipped_only_when_every_occurrence_can_be_scatter_added():
    assert not resolve_dedup("auto", "auto", SGD(0.1))  # CPU: the XLA path
    assert not resolve_dedup("auto", "xla", SGD(0.1))
    assert resolve_dedup("always", "xla", SGD(0.1))
    assert resolve_dedup("auto", "pallas", SGD(0.1))  # the fused update kernel works on distinct rows
    assert resolve_dedup("auto", "xla", SGD(0.1, weight_decay=1e-4))  # decay applies once per distinct row
    assert resolve_dedup("auto", "xla", Adagrad(0.1))
    assert resolve_dedup("auto", "xla", RowwiseAdagrad(0.1))
    assert resolve_dedup("auto", "xla", SGD(0.1), multi_hot=False)  # one-hot data measured faster with dedup
    with pytest.raises(ValueError, match="dedup"):
        resolve_dedup("never", "xla", SGD(0.1))


def test_touched_rows_are_the_same_set_with_and_without_dedup():
    config = tiny_config(steps=1)
    task = build_task(config, SPEC)
    collection = task.collection
    batch = random_batch(SPEC, 8, seed=3)
    sentinel = collection.group_rows["dim8"]
    with_dedup = collection.touched_rows(collection.route(batch.ids, batch.lengths, dedup=True))["dim8"]
    without = collection.touched_rows(collection.route(batch.ids, batch.lengths, dedup=False))["dim8"]
    expected = {int(collection.placements[f.name][0].offset + i) for f in SPEC.features
                for row, n in zip(batch.ids[f.name], batch.lengths[f.name], strict=True) for i in row[:n]}
    assert set(np.asarray(with_dedup).tolist()) - {sentinel} == expected
    assert set(np.asarray(without).tolist()) - {sentinel} == expected
