"""embedding.kernel and embedding.pool_from pick the implementation: a whole DLRM train step through the Pallas
kernels (interpreted on this CPU: Mosaic and Triton) equals the XLA path, for sum and mean pooling, optimizers with
[R, D] and [R] state, and both places the forward pools from; and the exported accelerator train step reads the
tables only inside the kernels."""

import re

import jax
import ml_collections
import numpy as np
import pytest
from conftest import pallas_calls, random_batch, train_steps
from test_train import tiny_config

from recjax.embedding import EmbeddingCollection, resolve_pool_from
from recjax.specs import DatasetSpec, FeatureSpec
from recjax.step import init_state, make_train_step
from recjax.task import build_task

SPEC = DatasetSpec(num_dense=3, features=(FeatureSpec("a", 13), FeatureSpec("b", 9, bag_size=3),
                                          FeatureSpec("c", 6, bag_size=2)))
TRITON = "__gpu$xla.gpu.triton"
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": TRITON}


def step_config(kernel: str, sparse: str, pooling: str = "sum", pool_from: str = "auto", steps: int = 3):
    config = tiny_config(steps=steps)
    config.embedding.kernel = kernel
    config.embedding.pooling = pooling
    config.embedding.pool_from = pool_from
    config.optimizer.sparse.name = sparse
    config.optimizer.sparse.weight_decay = 1e-3
    return config


def run_steps(kernel: str, sparse: str, pooling: str, pool_from: str = "auto", steps: int = 3):
    batches = [jax.device_put(random_batch(SPEC, 8, seed=i)) for i in range(steps)]
    return train_steps(step_config(kernel, sparse, pooling, pool_from, steps), SPEC, batches)


@pytest.mark.parametrize("kernel, sparse, pooling, pool_from", [
    ("pallas_tpu", "rowwise_adagrad", "sum", "table"),
    ("pallas_gpu", "lazy_adam", "mean", "table"),
    ("pallas_gpu", "rowwise_adagrad", "sum", "distinct_rows")])
def test_pallas_step_equals_xla_step(kernel, sparse, pooling, pool_from):
    """The Pallas step (pooling from the tables: d loss / d lookups summed into each distinct row's gradient by its
    segment of the sorted ids -- in the GPU update kernel itself --, the update kernel reading the rows itself; or
    from the gathered distinct rows) = the XLA step on the distinct rows, whose gradient autodiff sums. Asserts
    which kernels the step traced, so a mislabelled path fails."""
    _, xla_state, xla_losses = run_steps("xla", sparse, pooling)
    task, pallas_state, pallas_losses = run_steps(kernel, sparse, pooling, pool_from)
    assert task.collection.pool_from == pool_from
    np.testing.assert_allclose(pallas_losses, xla_losses, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves((pallas_state.tables, pallas_state.sparse_opt_state,
                                                    pallas_state.dense_params)),
                         jax.tree_util.tree_leaves((xla_state.tables, xla_state.sparse_opt_state,
                                                    xla_state.dense_params)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

    family, suffix = ("mosaic", "tpu") if kernel == "pallas_tpu" else ("triton", "gpu")
    batch = jax.device_put(random_batch(SPEC, 8))
    traced = pallas_calls(make_train_step(task), init_state(task, jax.random.key(0), batch), batch)
    assert {f for _, f in traced} == {family}, traced
    names = [name for name, _ in traced]
    # One update per stacked group; on the GPU the table path's update sums each row's gradient in the same kernel.
    update = "fused_backward_update_gpu" if (suffix, pool_from) == ("gpu", "table") else f"fused_row_update_{suffix}"
    assert names.count(update) == 1 and sum("update" in name for name in names) == 1, names
    assert sum(name.startswith("gather_reduce_") for name in names) == 3  # one pool batch per bag size
    # Only the distinct-rows path gathers the batch's distinct rows (one per group) before pooling them.
    assert sum(name in ("gather_mosaic", "gather_triton") for name in names) == (pool_from == "distinct_rows")


def test_auto_is_the_xla_path_on_cpu():
    _, auto_state, auto_losses = run_steps("auto", "sgd", "sum", steps=2)
    _, xla_state, xla_losses = run_steps("xla", "sgd", "sum", steps=2)
    assert auto_losses == xla_losses
    for got, want in zip(jax.tree_util.tree_leaves(auto_state.tables), jax.tree_util.tree_leaves(xla_state.tables),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_pool_from_table_equals_distinct_rows_for_per_id_methods():
    """pool_from="table" (XLA lookups from the tables; the backward sums each occurrence's gradient into its
    distinct row) trains exactly as the distinct-rows layout, whose per-row gradient autodiff sums, also for methods
    that combine per id before pooling (QR mult, signed hashing: the `per_id` gradients), with multi-hot bags, mean
    pooling and lazy Adam with weight decay -- and the update then reads the rows itself."""
    def run(pool_from: str):
        config = step_config("xla", "lazy_adam", "mean", pool_from)
        config.embedding.tables = ml_collections.ConfigDict({
            "a": {"method": "qr", "options": {"collisions": 3, "op": "mult"}},
            "b": {"method": "hashing", "options": {"buckets": 5, "sign": True}}})
        batches = [jax.device_put(random_batch(SPEC, 8, seed=i)) for i in range(3)]
        return train_steps(config, SPEC, batches)

    want_task, want_state, want_losses = run("distinct_rows")
    task, state, losses = run("table")
    assert not any(m.pools_before_combine for m in (task.collection.methods[f] for f in ("a", "b")))
    assert (task.collection.pool_from, want_task.collection.pool_from) == ("table", "distinct_rows")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    for got, want in zip(jax.tree_util.tree_leaves((state.tables, state.sparse_opt_state, state.dense_params)),
                         jax.tree_util.tree_leaves((want_state.tables, want_state.sparse_opt_state,
                                                    want_state.dense_params)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_pool_from_auto():
    """"table" wherever the step runs Pallas kernels that take every lookup, else "distinct_rows"."""
    cases = [("reduce", 1000, 64, 1), ("reduce", 1000, 64, 20), ("gather", 1000, 64, 3)]
    assert resolve_pool_from("auto", "xla", cases) == "distinct_rows"
    assert resolve_pool_from("auto", "auto", cases) == "distinct_rows"  # this CPU: the XLA path
    for kernel in ("pallas", "pallas_tpu", "pallas_gpu"):
        assert resolve_pool_from("auto", kernel, cases) == "table"
    assert resolve_pool_from("table", "xla", cases) == "table"  # asked for: the XLA lookups pool from the tables
    # Bags of 5000 ids at dim 1024 overflow the Mosaic kernel's VMEM (it hands them to XLA); Triton takes them.
    long_bags = [*cases, ("reduce", 1000, 1024, 5000)]
    assert resolve_pool_from("auto", "pallas_tpu", long_bags) == "distinct_rows"
    assert resolve_pool_from("auto", "pallas_gpu", long_bags) == "table"
    with pytest.raises(ValueError, match="unknown pool_from 'rows'"):
        EmbeddingCollection(SPEC, build_task(step_config("xla", "sgd"), SPEC).collection.table_specs.values(),
                            pool_from="rows")


def table_gathers(text: str, shapes: set[str]) -> list[str]:
    """Operand types of the StableHLO gathers in `text` that read an array of one of `shapes` (e.g. 28x8xf32)."""
    operands = re.findall(r'"stablehlo.gather"\([^)]*\)[^\n]*:\s*\(tensor<([^>]*)>', text)
    return [o for o in operands if o in shapes]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_exported_train_step_reads_tables_only_inside_kernels(platform):
    """The train step as `jax.export` lowers it for TPU / CUDA from this CPU host (kernel="pallas": the platform's
    kernels, decided when lowered; pool_from="table", lazy Adam with weight decay): the bags are pooled from the
    tables by the kernel and the fused update kernel reads and writes the touched rows and their state, so no XLA
    gather has a table or its [R, D] state as its operand. The XLA step lowered for CPU gathers from the table (the
    detector works)."""
    def traced(kernel: str):
        task = build_task(step_config(kernel, "lazy_adam", pool_from="table"), SPEC)
        assert task.collection.pool_from == "table"
        task.collection.interpret = False  # exported for an accelerator: the kernels lowered, not interpreted
        batch = jax.device_put(random_batch(SPEC, 8))
        state = init_state(task, jax.random.key(0), batch)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch))
        shapes = {f"{rows}x{task.collection.group_dims[g]}xf32" for g, rows in task.collection.group_rows.items()}
        return make_train_step(task), abstract, shapes

    step, abstract, shapes = traced("pallas")
    text = jax.export.export(step, platforms=[platform], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*abstract).mlir_module()
    assert table_gathers(text, shapes) == []
    assert text.count(f"@{KERNEL_CALL[platform]}(") == 3 + 1  # a gather-reduce per bag size, one update
    step, abstract, shapes = traced("xla")
    cpu = step.lower(*abstract).as_text()
    assert "custom_call" not in cpu and table_gathers(cpu, shapes)
