r"""Embedding-stage benchmark: where a train step's time goes, how close the embedding stage is to the memory
system, and how it compares with PyTorch's EmbeddingBag on the same lookups.

    python benchmarks/kernels.py                                   # every measurement on every shape (~5 min)
    python benchmarks/kernels.py --shapes reference_random --only stages,embedding_stage --repeats 5

Prints one JSON line per measurement to stdout (progress to stderr), each with its shape, config and the machine.
Every measurement alternates its contenders repeat by repeat in this one process and reports medians and their
ratios: the machine is shared, so only side-by-side ratios are trustworthy, never a single absolute time.

Shapes (the same as benchmarks/train_step.py)
  reference_random  facebookresearch/dlrm's random-data shape: 8 tables x 1M rows x dim 64, 100 ids per bag (full
                    bags, uniform ids), batch 2048, bottom 13-512-512-64, top 1024-1024-1024-1, dot interaction, SGD.
  kaggle_b128 / kaggle_b2048
                    the 26 Criteo Kaggle cardinalities (33.8M rows), dim 16, one id per feature, bottom
                    13-512-256-64-16, top 512-256-1; batch 128 / 2048.

Measurements
  copy_bandwidth    a streaming copy of a 512 MiB f32 array (jit), GB/s = bytes read + written per second: the
                    machine's memory bandwidth as XLA sees it, the yardstick for the embedding stage.
  stages            the recjax train step cut into its stages, each jitted alone and timed on the same inputs:
                    route (integer math + dedup), gather (distinct rows; without dedup: the pooled lookups from
                    the tables), glue forward (pool + combine), glue backward (its VJP w.r.t. what gather returned),
                    dense (the model's forward + backward given the embeddings), update (sparse optimizer, donated),
                    and the whole fused step; once with embedding.dedup="auto" (SGD: no dedup, scatter-add update)
                    and once with "always". The stages sum to more than the step (XLA fuses across them); the
                    proportions are the point.
  embedding_stage   lookup + backward + update only (the dense model replaced by a fixed cotangent), side by side for
                    SGD without and with dedup and row-wise Adagrad, donated: ms per step and GB/s, where bytes = the
                    traffic the path cannot avoid (with dedup: distinct rows x dim x 4 x 3 -- gather read, update
                    read + write -- plus the optimizer state read + written; without: every id's row read by the
                    lookup and read + written by the scatter-add), and that GB/s as a fraction of copy_bandwidth.
  torch             (when torch is installed; an optional benchmark-only comparator, never a dependency) the same
                    model in PyTorch with the reference's layers: nn.EmbeddingBag(mode="sum", sparse=True) per table,
                    the same MLPs, dot interaction, SGD (torch.optim.SGD for dense, sparse gradients for the bags);
                    whole step and embedding stage (EmbeddingBag forward + backward + sparse SGD step), with the
                    recjax/torch time ratios (< 1 = recjax faster). torch uses its default intra-op threads.
  fbgemm            (when fbgemm-gpu-cpu is installed: `pip install torch==2.14.0 fbgemm-gpu-cpu==1.9.0`; optional,
                    never a dependency) FBGEMM's table-batched embedding on the CPU -- what TorchRec runs there --
                    (SplitTableBatchedEmbeddingBagsCodegen, HOST / CPU, the optimizer fused into the backward) on the
                    same lookups: the embedding stage with EXACT_SGD and EXACT_ROWWISE_ADAGRAD, and the recjax/fbgemm
                    ratios against this run's embedding_stage.
  pool_from_bytes   analytic, no timing: the HBM bytes one training step's embedding pass moves on the two
                    deduplicated paths (pallas_kernels/traffic.py) -- "distinct_rows" (gather the distinct rows, pool
                    from them) and "table" (pool from the table in the kernel, the update reads its rows) -- for the
                    shape's batch of uniform ids (the distinct count measured on it), per sparse optimizer.
  kernel_tracing    (once, not per shape) what embedding.kernel="auto" costs a CPU program: it traces every
                    platform's kernel at every call site (lax.platform_dependent decides at lowering). CPU seconds to
                    lower and compile the train and predict steps of a small DLRM (8 features, bags of 1-3, row-wise
                    Adagrad) with "xla" and "auto", alternating, in one process (the first "auto" traces the kernels'
                    shapes for the first time; later ones reuse the jitted pallas_call traces).

Accelerator (`--accelerator`; README, Benchmarks): on a GPU / TPU, every kernel against the XLA reference on the device,
then per shape (reference_random, kaggle_b2048) XLA vs the Pallas kernels -- the forward pooled from the table, the
gather of the distinct rows, the fused update (rows given or read in the kernel) -- with ms, the bytes each cannot
avoid, GB/s and the fraction of the copy bandwidth measured in the same run (and of the HBM spec on TPU), and the
whole train step per embedding.kernel / pool_from. On a CPU it prints that there is no accelerator and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SHAPES = {
    "reference_random": dict(tables=(1_000_000,) * 8, dim=64, bag=100, batch=2048, bottom=(512, 512, 64),
                             top=(1024, 1024, 1024, 1), sparse="sgd", lr=0.01),
    "kaggle_b128": dict(tables=None, dim=16, bag=1, batch=128, bottom=(512, 256, 64, 16), top=(512, 256, 1),
                        sparse="sgd", lr=0.01),
    "kaggle_b2048": dict(tables=None, dim=16, bag=1, batch=2048, bottom=(512, 256, 64, 16), top=(512, 256, 1),
                         sparse="sgd", lr=0.01),
}
MEASUREMENTS = ("copy_bandwidth", "stages", "embedding_stage", "torch", "fbgemm", "pool_from_bytes", "kernel_tracing")
NUM_DENSE = 13


def _log(message: str) -> None:
    print(f"[kernels] {message}", file=sys.stderr, flush=True)


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def machine() -> dict[str, Any]:
    import jax

    return {"cpu_count": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "load_average": os.getloadavg()[0]}


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls (after one warmup call), each blocked until ready."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def interleaved(contenders: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Time contenders round-robin (each warmed up first), so load changes hit them alike."""
    import jax

    for fn in contenders.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return times


def ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


# ------------------------------------------------------------------------------------------------ setup
def vocab_sizes(shape: dict) -> tuple[int, ...]:
    if shape["tables"] is not None:
        return tuple(shape["tables"])
    from recjax.data.synthetic import KAGGLE_VOCAB_SIZES

    return tuple(KAGGLE_VOCAB_SIZES)


def build(shape: dict, sparse: str, seed: int = 0, dedup: str = "auto", kernel: str = "auto",
          pool_from: str = "auto"):
    """(task, state, batch) for `shape` with sparse optimizer `sparse` (dense SGD), `embedding.dedup`,
    `embedding.kernel` and `embedding.pool_from`, on device."""
    import jax
    import ml_collections

    from experiments.configs.dlrm_synthetic import get_config
    from recjax.batch import Batch, validate_batch
    from recjax.specs import DatasetSpec, FeatureSpec
    from recjax.step import init_state
    from recjax.task import build_task

    sizes = vocab_sizes(shape)
    bags = shape["bag"] if isinstance(shape["bag"], tuple) else (shape["bag"],)  # per feature, cycled
    config = get_config("small")
    config.embedding.dim = shape["dim"]
    config.model.dlrm.bottom_mlp = shape["bottom"]
    config.model.dlrm.top_mlp = shape["top"]
    config.train.batch_size = shape["batch"]
    config.embedding.dedup = dedup
    config.embedding.kernel = kernel
    config.embedding.pool_from = pool_from
    config.optimizer.dense = ml_collections.ConfigDict({"name": "sgd", "learning_rate": shape["lr"],
                                                        "weight_decay": 0.0})
    config.optimizer.sparse = ml_collections.ConfigDict({"name": sparse, "learning_rate": shape["lr"],
                                                         "weight_decay": 0.0})
    spec = DatasetSpec(num_dense=NUM_DENSE, features=tuple(
        FeatureSpec(f"C{i + 1}", v, bags[i % len(bags)]) for i, v in enumerate(sizes)))
    task = build_task(config, spec)
    rng = np.random.default_rng(seed)
    b = shape["batch"]
    batch = Batch(dense=rng.standard_normal((b, NUM_DENSE), dtype=np.float32),
                  ids={f.name: rng.integers(0, f.vocab_size, (b, f.bag_size), dtype=np.int32) for f in spec.features},
                  lengths={f.name: np.full((b,), f.bag_size, np.int32) for f in spec.features},
                  labels=rng.integers(0, 2, (b,)).astype(np.float32))
    validate_batch(batch, spec)
    batch = jax.device_put(batch)
    state = init_state(task, jax.random.key(seed), batch)
    return task, state, batch


# ------------------------------------------------------------------------------------------ measurements
def copy_bandwidth(repeats: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((128 << 20,), jnp.float32)  # 512 MiB
    copy = jax.jit(lambda x: x * 1.0)
    seconds = statistics.median(timed(lambda: copy(x), repeats))
    return {"name": "copy_bandwidth", "bytes": 2 * x.nbytes, "ms": 1000 * seconds,
            "gb_per_s": 2 * x.nbytes / seconds / 1e9}


def stages(shape_name: str, shape: dict, repeats: int, dedup: str = "auto") -> dict[str, Any]:
    import jax
    import optax

    from recjax.step import make_train_step

    task, state, batch = build(shape, shape["sparse"], dedup=dedup)
    collection, glue, model = task.collection, task.glue, task.model
    copy = lambda tree: jax.tree_util.tree_map(lambda x: x.copy(), tree)  # noqa: E731  (the step donates `state`)
    glue_params, model_params = copy(state.dense_params["glue"]), copy(state.dense_params["model"])

    route = jax.jit(lambda b: collection.route(b.ids, b.lengths))
    routes = route(batch)
    gather = jax.jit(lambda t, r: collection.gather(t, r))
    rows = gather(state.tables, routes)
    glue_fwd = jax.jit(lambda rows, r: glue.apply({"params": glue_params}, rows, r.features))
    emb = glue_fwd(rows, routes)
    glue_bwd = jax.jit(lambda rows, r, g: jax.vjp(lambda x: glue.apply({"params": glue_params}, x, r.features),
                                                   rows)[1](g)[0])
    cotangent = jax.numpy.ones_like(emb)

    def dense_loss(params, emb):
        logits = model.apply({"params": params}, batch.dense, emb)
        return optax.sigmoid_binary_cross_entropy(logits, batch.labels).mean()

    dense = jax.jit(jax.grad(dense_loss, argnums=(0, 1)))
    row_grads = glue_bwd(rows, routes, cotangent)
    update = jax.jit(lambda t, s, r, rows, g: collection.sparse_update(task.sparse_optimizer, t, s, r, rows, g,
                                                                      0.01, 1), donate_argnums=(0, 1))
    tables, opt = copy((state.tables, state.sparse_opt_state))

    def run_update():
        nonlocal tables, opt
        tables, opt = update(tables, opt, routes, rows, row_grads)
        return tables

    step = make_train_step(task).lower(state, batch).compile()
    box = [state]

    def run_step():
        box[0], metrics = step(box[0], batch)
        return metrics["loss"]

    times = interleaved({
        "route": lambda: route(batch), "gather": lambda: gather(tables, routes),
        "glue_forward": lambda: glue_fwd(rows, routes), "glue_backward": lambda: glue_bwd(rows, routes, cotangent),
        "dense": lambda: dense(model_params, emb), "update": run_update, "step": run_step,
    }, repeats)
    record = {"name": "stages", "shape": shape_name, "embedding_dedup": dedup, "dedup": collection.dedup,
              **{f"{k}_ms": ms(v) for k, v in times.items()}}
    parts = [k for k in times if k != "step"]
    total = sum(record[f"{k}_ms"] for k in parts)
    record.update({f"{k}_fraction": record[f"{k}_ms"] / total for k in parts})
    record["distinct_rows"] = distinct_rows(collection, batch)
    record["ids"] = int(sum(np.size(r.weights) for r in routes.features.values()))
    return record


def distinct_rows(collection, batch) -> int:
    import jax

    routes = jax.jit(lambda b: collection.route(b.ids, b.lengths, dedup=True))(batch)
    return int(sum((u < collection.group_rows[g]).sum() for g, u in routes.unique.items()))


def embedding_stage(shape_name: str, shape: dict, contenders: tuple[tuple[str, str], ...], repeats: int,
                    bandwidth: float | None) -> list[dict[str, Any]]:
    """Lookup + backward + update with the dense model replaced by a fixed cotangent on the embeddings, for each
    (sparse optimizer, embedding.dedup) contender, timed side by side."""
    import jax
    import jax.numpy as jnp

    runs, records = {}, {}
    for sparse, dedup in contenders:
        task, state, batch = build(shape, sparse, dedup=dedup)
        collection, glue = task.collection, task.glue
        glue_params = state.dense_params["glue"]

        def stage(tables, opt, batch, collection=collection, glue=glue, glue_params=glue_params, task=task):
            routes = collection.route(batch.ids, batch.lengths)
            rows = collection.gather(tables, routes)
            emb, vjp = jax.vjp(lambda x: glue.apply({"params": glue_params}, x, routes.features), rows)
            (row_grads,) = vjp(jnp.full_like(emb, 1e-3))
            return collection.sparse_update(task.sparse_optimizer, tables, opt, routes, rows, row_grads,
                                            jnp.float32(0.01), jnp.int32(1))

        fn = jax.jit(stage, donate_argnums=(0, 1))
        box = [(state.tables, state.sparse_opt_state)]

        def run(fn=fn, box=box, batch=batch):
            box[0] = fn(*box[0], batch)
            return box[0]

        name = f"{sparse}/{dedup}"
        runs[name] = run
        distinct = distinct_rows(collection, batch)
        ids = int(sum(np.size(batch.ids[f]) for f in batch.ids))
        state_shapes = task.sparse_optimizer.state_shapes(1, shape["dim"])
        state_per_row = sum(int(np.prod(s[1:], dtype=np.int64)) for s in state_shapes.values())
        if collection.dedup:  # each distinct row: gathered, then read + written by the update, with its state
            moved = distinct * (3 * shape["dim"] + 2 * state_per_row) * 4
        else:  # each occurrence: read by the pooled lookup, read + written by the scatter-add
            moved = ids * 3 * shape["dim"] * 4
        records[name] = {"name": "embedding_stage", "shape": shape_name, "sparse_optimizer": sparse,
                         "embedding_dedup": dedup, "dedup": collection.dedup, "distinct_rows": distinct, "ids": ids,
                         "bytes_moved": moved}
        del state
    times = interleaved(runs, repeats)
    out = []
    for name, record in records.items():
        seconds = statistics.median(times[name])
        record.update({"ms": 1000 * seconds, "gb_per_s": record["bytes_moved"] / seconds / 1e9})
        if bandwidth:
            record["copy_fraction"] = record["gb_per_s"] / bandwidth
        out.append(record)
    return out


def pool_from_bytes(shape_name: str, shape: dict, seed: int = 0) -> list[dict[str, Any]]:
    """The analytic HBM bytes of the two deduplicated training paths for one batch of `shape` (numpy only)."""
    from pallas_kernels.traffic import training_pass_bytes

    rng = np.random.default_rng(seed)
    sizes = vocab_sizes(shape)
    b, bag, dim = shape["batch"], shape["bag"], shape["dim"]
    # One stacked group (every table has the same dim): distinct rows are counted per table (disjoint row ranges).
    distinct = sum(np.unique(rng.integers(0, v, b * bag)).size for v in sizes)
    ids, bags = len(sizes) * b * bag, len(sizes) * b
    records = []
    for sparse, state_floats in (("sgd", 0), ("rowwise_adagrad", 1), ("lazy_adam", 2 * dim)):
        counts = {path: training_pass_bytes(path, ids=ids, distinct=distinct, bags=bags, dim=dim,
                                            state_floats_per_row=state_floats) for path in ("distinct_rows", "table")}
        records.append({"name": "pool_from_bytes", "shape": shape_name, "sparse_optimizer": sparse, "ids": ids,
                        "distinct_rows": int(distinct), "bags": bags, **{f"{k}_bytes": v for k, v in counts.items()},
                        "table_over_distinct_rows": counts["table"] / counts["distinct_rows"]})
    return records


def kernel_tracing(repeats: int) -> dict[str, Any]:
    from recjax.step import make_predict_step, make_train_step

    shape = dict(tables=(50,) * 8, dim=8, bag=(1, 2, 3), batch=64, bottom=(32, 8), top=(32, 1),
                 sparse="rowwise_adagrad", lr=0.01)
    seconds: dict[str, list[float]] = {"xla": [], "auto": []}
    for _ in range(repeats):
        for kernel in seconds:
            task, state, batch = build(shape, "rowwise_adagrad", kernel=kernel)
            start = time.process_time()
            make_train_step(task).lower(state, batch).compile()
            make_predict_step(task).lower(state, batch).compile()
            seconds[kernel].append(time.process_time() - start)
            del task, state, batch  # jax's caches stay: a run compiles its steps in one process
    return {"name": "kernel_tracing", "cpu_s": seconds, "first_auto_over_xla": seconds["auto"][0] / seconds["xla"][0],
            "median_auto_over_xla": statistics.median(seconds["auto"]) / statistics.median(seconds["xla"])}


def torch_comparison(shape_name: str, shape: dict, repeats: int, recjax_step_ms: float | None,
                     recjax_stage_ms: float | None) -> dict[str, Any] | None:
    """The same model in PyTorch (EmbeddingBag + sparse SGD); None when torch is not installed."""
    try:
        import torch
    except ImportError:
        _log("torch not installed: skipping the torch comparator (pip install torch==2.13.0 gives the CPU build)")
        return None
    torch.manual_seed(0)
    sizes, dim, bag, b = vocab_sizes(shape), shape["dim"], shape["bag"], shape["batch"]
    bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(v, dim, mode="sum", sparse=True) for v in sizes)

    def mlp(widths, n_in, last_relu):
        layers = []
        for i, w in enumerate(widths):
            layers.append(torch.nn.Linear(n_in, w))
            if i < len(widths) - 1 or last_relu:
                layers.append(torch.nn.ReLU())
            n_in = w
        return torch.nn.Sequential(*layers)

    f = len(sizes) + 1
    bottom = mlp(shape["bottom"], NUM_DENSE, True)
    top = mlp(shape["top"], dim + f * (f - 1) // 2, False)
    li, lj = torch.tril_indices(f, f, offset=-1)
    rng = np.random.default_rng(0)
    dense = torch.from_numpy(rng.standard_normal((b, NUM_DENSE), dtype=np.float32))
    labels = torch.from_numpy(rng.integers(0, 2, (b,)).astype(np.float32))
    ids = [torch.from_numpy(rng.integers(0, v, (b * bag,)).astype(np.int64)) for v in sizes]
    offsets = torch.arange(0, b * bag, bag)
    dense_opt = torch.optim.SGD(list(bottom.parameters()) + list(top.parameters()), lr=shape["lr"])
    sparse_opt = torch.optim.SGD(bags.parameters(), lr=shape["lr"])

    def step():
        x = bottom(dense)
        ly = [e(i, offsets) for e, i in zip(bags, ids, strict=True)]
        t = torch.cat([x] + ly, dim=1).view(b, f, dim)
        z = torch.bmm(t, t.transpose(1, 2))[:, li, lj]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(top(torch.cat([x, z], 1)).squeeze(1), labels)
        dense_opt.zero_grad()
        sparse_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        sparse_opt.step()

    def stage():
        ly = [e(i, offsets) for e, i in zip(bags, ids, strict=True)]
        sparse_opt.zero_grad()
        torch.autograd.backward(ly, [torch.full_like(y, 1e-3) for y in ly])
        sparse_opt.step()

    def clock(fn):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times)

    step_ms, stage_ms = clock(step), clock(stage)
    record = {"name": "torch", "shape": shape_name, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "step_ms": step_ms, "embedding_stage_ms": stage_ms}
    if recjax_step_ms:
        record["recjax_step_ms"] = recjax_step_ms
        record["step_ratio_recjax_over_torch"] = recjax_step_ms / step_ms
    if recjax_stage_ms:
        record["recjax_embedding_stage_ms"] = recjax_stage_ms
        record["embedding_stage_ratio_recjax_over_torch"] = recjax_stage_ms / stage_ms
    return record


def fbgemm_comparison(shape_name: str, shape: dict, repeats: int, recjax_ms: dict[str, float]
                      ) -> list[dict[str, Any]]:
    """FBGEMM's CPU TBE embedding stage (forward + backward with the fused update); [] without fbgemm_gpu."""
    try:
        import torch
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError:
        _log("fbgemm_gpu not installed: skipping the FBGEMM comparator "
             "(pip install torch==2.14.0 fbgemm-gpu-cpu==1.9.0)")
        return []
    sizes, dim, bag, b = vocab_sizes(shape), shape["dim"], shape["bag"], shape["batch"]
    rng = np.random.default_rng(0)
    # Table-major: all of table 0's bags, then table 1's, ...; offsets delimit T * B bags.
    indices = torch.from_numpy(np.concatenate([rng.integers(0, v, b * bag) for v in sizes]).astype(np.int64))
    offsets = torch.arange(0, len(sizes) * b * bag + 1, bag, dtype=torch.int64)
    records = []
    for sparse, optimizer in (("sgd", EmbOptimType.EXACT_SGD), ("rowwise_adagrad", EmbOptimType.EXACT_ROWWISE_ADAGRAD)):
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(v, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for v in sizes], optimizer=optimizer,
            learning_rate=shape["lr"], device="cpu")

        def stage(tbe=tbe):
            out = tbe(indices, offsets)
            out.backward(torch.full_like(out, 1e-3))

        stage()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            stage()
            times.append(time.perf_counter() - t0)
        record = {"name": "fbgemm", "shape": shape_name, "sparse_optimizer": sparse, "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "embedding_stage_ms": 1000 * statistics.median(times)}
        if sparse in recjax_ms:
            record["recjax_embedding_stage_ms"] = recjax_ms[sparse]
            record["embedding_stage_ratio_recjax_over_fbgemm"] = recjax_ms[sparse] / record["embedding_stage_ms"]
        records.append(record)
        del tbe
    return records


# ------------------------------------------------------------------------------------------- accelerator
# `--accelerator`: the one command for the first GPU / TPU session (section "accelerator" of the module docstring).
# The kernels' impl there is "pallas" (the platform's kernel, as embedding.kernel="auto" picks it); a dry run on a
# CPU (`--accelerator_dry_run`) interprets the Mosaic kernels ("pallas_tpu") on tiny shapes to check this code runs.
ACCELERATOR_SHAPES = ("reference_random", "kaggle_b2048")
DRY_RUN_SHAPES = {
    "reference_random": dict(tables=(300,) * 2, dim=64, bag=4, batch=8, bottom=(16, 64), top=(16, 1), sparse="sgd",
                             lr=0.01),
    "kaggle_b2048": dict(tables=(50,) * 3, dim=16, bag=1, batch=16, bottom=(16, 16), top=(16, 1), sparse="sgd",
                         lr=0.01),
}


def _accelerator_target(dry_run: bool) -> tuple[str, bool]:
    """(impl, interpret) of the kernels under test."""
    return ("pallas_tpu", True) if dry_run else ("pallas", False)


def accelerator_check(dry_run: bool) -> list[dict[str, Any]]:
    """Every kernel against its XLA reference on the device: gather-reduce (VPU and MXU pooling, f32 and bf16,
    D 16 / 64 / 128 / 200, ids with padding and negatives), gather (bags, and sorted distinct ids: merged runs), and
    the fused update (every sparse optimizer, with and without the rows given). One record per case."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import gather, gather_reduce, gather_reduce_reference, gather_reference
    from recjax.sparse_optim import SPARSE_OPTIMIZERS

    impl, interpret = _accelerator_target(dry_run)
    rng = np.random.default_rng(0)
    records = []

    def record(kernel: str, case: dict, got, want, bound) -> None:
        err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
        bound = np.broadcast_to(np.asarray(bound, np.float64), err.shape)
        records.append({"name": "accelerator_check", "kernel": kernel, **case, "impl": impl, "interpret": interpret,
                        "max_abs_err": float(err.max(initial=0.0)), "ok": bool(np.all(err <= bound))})

    lookups = [(1, 16, 300), (1, 64, 300), (4, 128, 60), (20, 64, 30), (100, 200, 9)] if dry_run else [
        (1, 16, 65536), (1, 64, 65536), (4, 128, 16384), (20, 64, 8192), (100, 64, 2048), (100, 200, 512)]
    for length, dim, bags in lookups:
        for dtype in (jnp.float32, jnp.bfloat16):
            num_rows = 1000 if dry_run else 1_000_000
            table = jnp.asarray(rng.normal(size=(num_rows, dim)), dtype)
            ids = rng.integers(0, num_rows, (bags, length))
            ids[rng.random(ids.shape) < 0.1] = num_rows  # padding
            ids[rng.random(ids.shape) < 0.01] = -3  # never read
            ids = jnp.asarray(ids, jnp.int32)
            weights = jnp.asarray(rng.normal(size=ids.shape), jnp.float32)
            case = {"length": length, "dim": dim, "bags": bags, "dtype": jnp.dtype(dtype).name}
            got = jax.jit(lambda t, r, w: gather_reduce(t, r, w, impl=impl, interpret=interpret))(table, ids, weights)
            magnitude = gather_reduce_reference(jnp.abs(table), ids, jnp.abs(weights))
            record("gather_reduce", case, got, gather_reduce_reference(table, ids, weights),
                   2 * length * np.finfo(np.float32).eps * np.asarray(magnitude) + 1e-30)
            got = jax.jit(lambda t, r: gather(t, r, impl=impl, interpret=interpret))(table, ids)
            record("gather", case, got, gather_reference(table, ids), 0.0)
    # The distinct-rows gather of the training step: sorted distinct ids, many adjacent (merged DMAs).
    num_rows, dim = (1000, 64) if dry_run else (1_000_000, 64)
    table = jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.float32)
    unique = np.unique(np.concatenate([rng.integers(0, num_rows, 200 if dry_run else 100_000),
                                       np.arange(64, 64 + (64 if dry_run else 50_000))]))
    unique = jnp.asarray(np.pad(unique, (0, 40), constant_values=num_rows), jnp.int32)[:, None]
    got = jax.jit(lambda t, r: gather(t, r, impl=impl, interpret=interpret))(table, unique)
    record("gather", {"case": "sorted_distinct_rows", "dim": dim, "bags": int(unique.shape[0])}, got,
           gather_reference(table, unique), 0.0)
    # The fused update: each optimizer (with weight decay), rows given or read by the kernel.
    for name, cls in SPARSE_OPTIMIZERS.items():
        for dim in (16, 64, 128):
            for given in (True, False):
                got, want, rows = _update_case(cls(0.05, weight_decay=1e-3), dim, given, rng, dry_run)
                case = {"optimizer": name, "dim": dim, "rows": rows, "rows_given": given}
                record("fused_row_update", case, got, want, 1e-5 * np.abs(want) + 1e-6)
    return records


def _update_case(optimizer, dim: int, given: bool, rng: np.random.Generator, dry_run: bool):
    """(kernel, XLA reference, rows) of one fused update of sorted distinct rows, table and state flattened."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import fused_row_update, row_update_reference

    impl, interpret = _accelerator_target(dry_run)
    num_rows, count = (500, 300) if dry_run else (1_000_000, 200_000)
    table = jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.float32)
    state = {k: v + 0.1 for k, v in optimizer.init(num_rows, dim).items()}
    ids = np.unique(rng.integers(0, num_rows, count))
    ids = jnp.asarray(np.pad(ids, (0, 17), constant_values=num_rows), jnp.int32)
    grads = jnp.asarray(rng.normal(size=(ids.shape[0], dim)), jnp.float32)
    current = jnp.take(table, ids, axis=0, mode="fill", fill_value=0)

    def rule(rows, state_rows, grads, lr, step):
        return optimizer.update_rows(rows, state_rows, grads + optimizer.weight_decay * rows, lr, step)

    want = jax.jit(lambda t, s, c: row_update_reference(t, s, ids, c, grads, rule, jnp.float32(0.05),
                                                        jnp.int32(3)))(table, state, current)
    got = jax.jit(lambda t, s, c: fused_row_update(t, s, ids, c, grads, rule, 0.05, 3, impl=impl,
                                                   interpret=interpret))(table, state, current if given else None)
    flat = lambda tree: np.concatenate([np.ravel(tree[0])] + [np.ravel(tree[1][k]) for k in sorted(tree[1])])  # noqa: E731
    return flat(got), flat(want), int(ids.shape[0])


def _group_lookup(shape: dict, rng: np.random.Generator, dry_run: bool):
    """The engine's view of `shape`: one stacked group (all tables), ids i32[K, B, L] (stacked row ids), weights,
    and the batch's sorted distinct rows (padded with the sentinel to the ids' count, as `unique_rows` returns)."""
    import jax.numpy as jnp

    sizes = vocab_sizes(shape)
    offsets = np.cumsum((0,) + sizes)
    rows = int(offsets[-1])
    ids = np.stack([rng.integers(0, v, (shape["batch"], shape["bag"])) + o for v, o in zip(sizes, offsets,
                                                                                             strict=False)])
    unique = np.unique(ids)
    unique = np.pad(unique, (0, ids.size - unique.size), constant_values=rows)
    table = jnp.asarray(rng.uniform(-0.01, 0.01, (rows, shape["dim"])).astype(np.float32))
    return table, jnp.asarray(ids, jnp.int32), jnp.ones(ids.shape, jnp.float32), jnp.asarray(unique, jnp.int32)


def accelerator_timings(shape_name: str, shape: dict, repeats: int, bandwidth: float, spec_bandwidth: float | None,
                        dry_run: bool) -> list[dict[str, Any]]:
    """XLA vs the Pallas kernels on the engine's lookups for `shape`: the forward pooled from the table, the gather of
    the distinct rows, the fused update (SGD and row-wise Adagrad; rows given or read in the kernel). Each record:
    ms, the bytes the op cannot avoid, GB/s, its fraction of the copy bandwidth measured in this run (and of the
    chip's HBM spec when jax knows it), and the Pallas / XLA time ratio."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import gather, gather_reduce
    from recjax.sparse_optim import SGD, RowwiseAdagrad

    impl, interpret = _accelerator_target(dry_run)
    rng = np.random.default_rng(0)
    table, ids, weights, unique = _group_lookup(shape, rng, dry_run)
    dim, count = shape["dim"], int(np.sum(np.asarray(unique) < table.shape[0]))
    row = dim * 4
    kw = {"xla": {}, impl: {"interpret": interpret} if interpret else {}}
    # op -> (bytes it cannot avoid, () -> {impl: a call that runs it once}). Contenders are made per op and dropped
    # after it: each update contender owns a copy of the table and state (2 GB each at reference_random), so
    # holding every op's at once would not fit a 16 GB accelerator.
    ops = {
        "pooled_from_table": (ids.size * row + ids.shape[0] * ids.shape[1] * row, lambda: {
            i: functools.partial(jax.jit(lambda t, i=i: gather_reduce(t, ids, weights, impl=i, **kw[i])), table)
            for i in kw}),
        "distinct_rows_gather": (2 * count * row, lambda: {
            i: functools.partial(jax.jit(lambda t, i=i: gather(t, unique[:, None], impl=i, **kw[i])), table)
            for i in kw}),
    }
    grads = jnp.full((unique.shape[0], dim), 1e-3, jnp.float32)
    for name, optimizer in (("sgd", SGD(0.01)), ("rowwise_adagrad", RowwiseAdagrad(0.01))):
        state_row = sum(int(np.prod(s[1:], dtype=np.int64)) for s in optimizer.state_shapes(1, dim).values())
        for given in (True, False):
            # Rows read (the given buffer, or the table inside the kernel), grads read, rows written; state read
            # and written.
            moved = count * (3 * row + 2 * 4 * state_row)
            current = jnp.zeros((unique.shape[0], dim), jnp.float32) if given else None
            ops[f"update_{name}_rows_{'given' if given else 'read'}"] = (
                moved, lambda optimizer=optimizer, current=current: {
                    i: _donated_update(table, optimizer, unique, current, grads, i, kw[i]) for i in kw})
    records = []
    for op, (moved, make_contenders) in ops.items():
        times = interleaved(make_contenders(), repeats)
        ms_by = {i: ms(t) for i, t in times.items()}
        for i, t in ms_by.items():
            rate = moved / (t / 1000) / 1e9
            record = {"name": "accelerator_kernel", "shape": shape_name, "op": op, "impl": i,
                      "interpret": bool(interpret) and i != "xla", "ms": t, "bytes": moved, "gb_per_s": rate,
                      "copy_fraction": rate / bandwidth}
            if spec_bandwidth:
                record["hbm_spec_fraction"] = rate / spec_bandwidth
            if i != "xla":
                record["ratio_over_xla"] = t / ms_by["xla"]
            records.append(record)
    return records


def _donated_update(table, optimizer, unique, current, grads, impl: str, kw: dict):
    """A call that runs one donated fused update of `unique` on its own copy of the table and state."""
    import jax

    from pallas_kernels import fused_row_update

    fn = jax.jit(lambda t, s: fused_row_update(t, s, unique, current, grads, optimizer.update_rows, 0.01, 1,
                                               impl=impl, **kw), donate_argnums=(0, 1))
    box = [(table.copy(), optimizer.init(*table.shape))]

    def run():
        box[0] = fn(*box[0])
        return box[0]

    return run


def accelerator_steps(shape_name: str, shape: dict, repeats: int, dry_run: bool) -> list[dict[str, Any]]:
    """The whole train step with each embedding.kernel / pool_from: XLA, the kernels on the distinct rows, the
    kernels pooling from the tables, and "auto" (what a run gets); in one run, with ratios over XLA. The variants
    run one after another, each freed before the next is built: reference_random's state is 2 GB of tables, and
    four at once would not fit a 16 GB accelerator (a dedicated device times steadily; on a shared CPU host the
    round-robin `interleaved` matters more)."""
    import gc

    from recjax.step import make_train_step

    impl, _ = _accelerator_target(dry_run)
    variants = {"xla": ("xla", "auto"), "kernels_distinct_rows": (impl, "distinct_rows"),
                "kernels_table": (impl, "table"), "auto": ("auto", "auto")}
    records = []
    for name, (kernel, pool_from) in variants.items():
        task, state, batch = build(shape, shape["sparse"], kernel=kernel, pool_from=pool_from)
        step = make_train_step(task).lower(state, batch).compile()
        box = [state]
        del state

        def run(step=step, box=box, batch=batch):
            box[0], metrics = step(box[0], batch)
            return metrics["loss"]

        step_ms = ms(interleaved({name: run}, repeats)[name])
        records.append({"name": "accelerator_step", "shape": shape_name, "variant": name, "kernel": kernel,
                        "pool_from": task.collection.pool_from, "dedup": task.collection.dedup, "ms": step_ms,
                        "ratio_over_xla": step_ms / records[0]["ms"] if records else 1.0})
        del task, step, box, batch, run
        gc.collect()
    return records


def accelerator(repeats: int, dry_run: bool) -> int:
    """The `--accelerator` command: 0 when every kernel matches XLA on the device (or there is no device), else 1."""
    import jax

    from pallas_kernels.hardware import tpu_budget

    info = machine()
    if jax.default_backend() not in ("tpu", "gpu") and not dry_run:
        _log("no accelerator: jax's default backend is "
             f"{jax.default_backend()}; run this on a GPU or TPU host (nothing to check here)")
        _emit({"name": "accelerator", "status": "no accelerator", "machine": info})
        return 0
    _log("checking every kernel against XLA on the device")
    failures = 0
    for record in accelerator_check(dry_run):
        failures += not record["ok"]
        _emit({**record, "machine": info})
    budget = tpu_budget()
    spec = None  # GB/s of the chip's HBM from jax's table (per TensorCore there), TPU only
    if jax.default_backend() == "tpu" and budget.hbm_bytes_per_second:
        spec = budget.hbm_bytes_per_second * budget.num_cores / 1e9
    _log("copy bandwidth")
    bandwidth = copy_bandwidth(repeats)["gb_per_s"]
    _emit({"name": "copy_bandwidth", "gb_per_s": bandwidth, "hbm_spec_gb_per_s": spec, "machine": info})
    for name in ACCELERATOR_SHAPES:
        shape = DRY_RUN_SHAPES[name] if dry_run else SHAPES[name]
        _log(f"{name}: kernels vs XLA")
        for record in accelerator_timings(name, shape, repeats, bandwidth, spec, dry_run):
            _emit({**record, "config": shape, "machine": info})
        _log(f"{name}: train step per embedding.kernel / pool_from")
        for record in accelerator_steps(name, shape, repeats, dry_run):
            _emit({**record, "config": shape, "machine": info})
    _emit({"name": "accelerator", "status": "checked", "kernel_mismatches": failures, "machine": info})
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)}")
    parser.add_argument("--only", default=",".join(MEASUREMENTS), help=f"comma-separated, from {MEASUREMENTS}")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per contender (medians reported)")
    parser.add_argument("--accelerator", action="store_true",
                        help="the first-accelerator check: every kernel vs XLA on the device, kernel and train-step "
                             "times (reference_random, kaggle_b2048); on a CPU it says so and exits 0")
    parser.add_argument("--accelerator_dry_run", action="store_true",
                        help="run --accelerator's code on this CPU: tiny shapes, Mosaic kernels interpreted (its "
                             "times mean nothing)")
    args = parser.parse_args(argv)
    if args.accelerator or args.accelerator_dry_run:
        return accelerator(args.repeats, args.accelerator_dry_run)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    only = {m.strip() for m in args.only.split(",") if m.strip()}
    unknown = [s for s in shapes if s not in SHAPES] + sorted(only - set(MEASUREMENTS))
    if unknown:
        parser.error(f"unknown shapes or measurements {unknown}; shapes {list(SHAPES)}, measurements {MEASUREMENTS}")
    info = machine()
    if "kernel_tracing" in only:
        _log("kernel tracing: compile time with embedding.kernel xla vs auto")
        _emit({**kernel_tracing(args.repeats), "machine": info})
    bandwidth = None
    if "copy_bandwidth" in only or "embedding_stage" in only:
        _log("copy bandwidth")
        record = copy_bandwidth(args.repeats)
        bandwidth = record["gb_per_s"]
        if "copy_bandwidth" in only:
            _emit({**record, "machine": info})
    for name in shapes:
        shape = SHAPES[name]
        step_ms = stage_ms = None
        stage_by_optimizer: dict[str, float] = {}
        if "stages" in only:
            for dedup in ("auto", "always"):
                _log(f"{name}: stages, embedding.dedup={dedup}")
                record = stages(name, shape, args.repeats, dedup)
                if dedup == "auto":
                    step_ms = record["step_ms"]
                _emit({**record, "config": shape, "machine": info})
        if "embedding_stage" in only:
            _log(f"{name}: embedding stage")
            contenders = (("sgd", "auto"), ("sgd", "always"), ("rowwise_adagrad", "auto"))
            for record in embedding_stage(name, shape, contenders, args.repeats, bandwidth):
                if record["embedding_dedup"] == "auto":
                    stage_by_optimizer[record["sparse_optimizer"]] = record["ms"]
                    if record["sparse_optimizer"] == shape["sparse"]:
                        stage_ms = record["ms"]
                _emit({**record, "config": shape, "machine": info})
        if "torch" in only:
            _log(f"{name}: torch comparator")
            record = torch_comparison(name, shape, args.repeats, step_ms, stage_ms)
            if record:
                _emit({**record, "config": shape, "machine": info})
        if "pool_from_bytes" in only:
            for record in pool_from_bytes(name, shape):
                _emit({**record, "config": shape, "machine": info})
        if "fbgemm" in only:
            _log(f"{name}: FBGEMM comparator")
            for record in fbgemm_comparison(name, shape, args.repeats, stage_by_optimizer):
                _emit({**record, "config": shape, "machine": info})
    return 0


if __name__ == "__main__":
    from recjax import cli

    cli.tune_malloc()  # as the launcher does, so the benchmark measures what a run gets
    cli.use_cpu_if_no_accelerator()
    with cli.user_errors():
        sys.exit(main())
