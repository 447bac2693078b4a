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
  copy_bandwidth    a streaming pass over a 512 MiB f32 array (x + 1 in place), many passes per host sync
                    (`pallas_kernels.timing`), GB/s = bytes read + written per second: the machine's memory bandwidth
                    as XLA sees it, the yardstick for the embedding stage.
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
                    from them) and "table" (pool from the table in the kernel, the update reads its rows; and with
                    the GPU's fused backward + update) -- for the shape's batch of uniform ids (the distinct count
                    measured on it), per sparse optimizer.

Accelerator (`--accelerator`; README, Benchmarks): the one command of a GPU / TPU session, bounded: sections with
budgets (SECTION_BUDGETS, RUN_BUDGET_S: under 4 minutes on an H100 / H200 with jax's start-up), a progress line per
section on stderr, each measurement's JSON line on stdout as it finishes, a "skipped" line for what a spent budget
left out, and every thread's stack on stderr if a section runs twice its budget. Every timing is many calls per host
sync (`pallas_kernels.timing`: a jitted loop whose calls read alternating batches), so dispatch latency is out.
  check      every kernel against the XLA reference on the device, newest first: the fused backward + update (each
             sparse optimizer), gather-reduce and gather (f32 and bf16, D 16-200, bags 1-100), the fused update with
             rows given or read, the distinct-rows gather; exit status 1 if any disagrees.
  bandwidth  the device copy (as copy_bandwidth above) beside the chip's HBM spec (`hardware.hbm_spec_bytes_per_second`:
             NVIDIA's data sheets by device kind, jax's chip info on TPU).
  kernels    per shape (reference_random, kaggle_b2048): XLA vs the Pallas kernels -- the forward pooled from the
             table, the distinct-rows gather, the fused update (SGD, row-wise Adagrad; rows given / read) and the
             fused backward + update -- with ms, the bytes each cannot avoid, GB/s, the fractions of the copy and of
             the HBM spec, the kernel / XLA ratio and the compiled loop's temporary bytes.
  auto       per shape: what embedding.kernel="auto" measures and chooses on this device (kernel_measure="always",
             a throw-away cache), beside the shipped table's choice (recjax/kernel_choice.py).
  steps      per shape: the whole train step with XLA and each kernel variant, ratios over XLA, and which "auto" chose.
On a CPU it prints that there is no accelerator and exits 0; `--accelerator_dry_run` runs all of it here on tiny
shapes with the Triton kernels interpreted and no budgets (its times mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
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
MEASUREMENTS = ("copy_bandwidth", "stages", "embedding_stage", "torch", "fbgemm", "pool_from_bytes")
NUM_DENSE = 13


def _log(message: str) -> None:
    print(f"[kernels] {message}", file=sys.stderr, flush=True)


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def machine() -> dict[str, Any]:
    import jax

    return {"cpu_count": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "load_average": os.getloadavg()[0]}


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
          pool_from: str = "auto", with_state: bool = True):
    """(task, state, batch) for `shape` with sparse optimizer `sparse` (dense SGD), `embedding.dedup`,
    `embedding.kernel` and `embedding.pool_from`, on device (state None unless `with_state`)."""
    import jax
    import ml_collections

    from experiments.configs.dlrm_synthetic import get_config
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
    batch = build_batch(spec, shape["batch"], seed)
    state = init_state(task, jax.random.key(seed), batch) if with_state else None
    return task, state, batch


def build_batch(spec, batch_size: int, seed: int):
    """A validated batch of uniform ids with full bags for `spec`, on device."""
    import jax

    from recjax.batch import Batch, validate_batch

    rng = np.random.default_rng(seed)
    batch = Batch(dense=rng.standard_normal((batch_size, NUM_DENSE), dtype=np.float32),
                  ids={f.name: rng.integers(0, f.vocab_size, (batch_size, f.bag_size), dtype=np.int32)
                       for f in spec.features},
                  lengths={f.name: np.full((batch_size,), f.bag_size, np.int32) for f in spec.features},
                  labels=rng.integers(0, 2, (batch_size,)).astype(np.float32))
    validate_batch(batch, spec)
    return jax.device_put(batch)


# ------------------------------------------------------------------------------------------ measurements
def copy_bandwidth(repeats: int) -> dict[str, Any]:
    """A streaming pass over 512 MiB (`pallas_kernels.timing.copy_bandwidth`: many passes per host sync)."""
    from pallas_kernels import timing

    rate, t = timing.copy_bandwidth(512 << 20, repeats=repeats)
    return {"name": "copy_bandwidth", "bytes": 2 * (512 << 20), "ms": 1000 * t.seconds, "gb_per_s": rate / 1e9,
            "iterations": t.iterations}


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
        counts["table_fused_backward"] = training_pass_bytes("table", ids=ids, distinct=distinct, bags=bags, dim=dim,
                                                             state_floats_per_row=state_floats, fused_backward=True)
        records.append({"name": "pool_from_bytes", "shape": shape_name, "sparse_optimizer": sparse, "ids": ids,
                        "distinct_rows": int(distinct), "bags": bags, **{f"{k}_bytes": v for k, v in counts.items()},
                        "table_over_distinct_rows": counts["table"] / counts["distinct_rows"],
                        "fused_over_distinct_rows": counts["table_fused_backward"] / counts["distinct_rows"]})
    return records


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
# `--accelerator`: the one command for a GPU / TPU session (the module docstring's "Accelerator"). The kernels' impl
# there is "pallas" (the platform's kernel); a dry run on a CPU (`--accelerator_dry_run`) interprets the Triton
# kernels ("pallas_gpu", what an NVIDIA device runs) on tiny shapes, without budgets, so every line of this code runs.
ACCELERATOR_SHAPES = ("reference_random", "kaggle_b2048")
DRY_RUN_SHAPES = {
    "reference_random": dict(tables=(300,) * 2, dim=64, bag=4, batch=8, bottom=(16, 64), top=(16, 1), sparse="sgd",
                             lr=0.01),
    "kaggle_b2048": dict(tables=(50,) * 3, dim=16, bag=1, batch=16, bottom=(16, 16), top=(16, 1), sparse="sgd",
                         lr=0.01),
}
# Seconds each section may start work in, on an H100 / H200 (per shape for the last three): with jax's start-up the
# whole run stays under 4 minutes. A section that runs out skips what is left (a "skipped" line says what); a section
# still running at twice its budget dumps every thread's stack to stderr (a stall shows where it is).
SECTION_BUDGETS = {"check": 30, "bandwidth": 8, "kernels": 30, "auto": 15, "steps": 25}
RUN_BUDGET_S = 200
# What a timed loop takes per repeat (`pallas_kernels.timing`).
LOOP_SECONDS = 0.03


class Section:
    """One section of the accelerator run: its budget, a progress line at start and end, its JSON lines streamed as
    each measurement finishes."""

    def __init__(self, name: str, budget_s: float, deadline: float, info: dict, dry_run: bool):
        self.name, self.budget_s, self.info, self.records, self.skipped = name, budget_s, info, 0, 0
        self.deadline = math.inf if dry_run else min(time.monotonic() + budget_s, deadline)

    def __enter__(self) -> Section:
        import faulthandler

        self.start = time.monotonic()
        _log(f"[{self.name}] start (budget {self.budget_s} s)")
        faulthandler.dump_traceback_later(2 * self.budget_s + 30, exit=False)
        return self

    def __exit__(self, *exc) -> None:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
        _log(f"[{self.name}] done in {time.monotonic() - self.start:.1f} s: {self.records} lines, "
             f"{self.skipped} skipped")

    def has_time(self, what: str) -> bool:
        """Whether `what` may start; if not, a "skipped" line says so."""
        if time.monotonic() < self.deadline:
            return True
        self.skipped += 1
        self.emit({"name": "skipped", "what": what, "reason": f"section budget ({self.budget_s} s) spent"})
        return False

    def emit(self, record: dict) -> None:
        self.records += 1
        _emit({**record, "section": self.name, "machine": self.info})


def _accelerator_target(dry_run: bool) -> tuple[str, bool]:
    """(impl, interpret) of the kernels under test."""
    return ("pallas_gpu", True) if dry_run else ("pallas", False)


def accelerator_check(section: Section, dry_run: bool) -> int:
    """Every kernel against its XLA reference on the device, the newest first (the fused backward + update, the
    gather-reduce with f32 tables), then the fused update with rows given / read, gather, the distinct-rows gather,
    bf16 tables, more dims. One line per case; returns the number of mismatches."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import gather, gather_reduce, gather_reduce_reference, gather_reference
    from recjax.sparse_optim import SPARSE_OPTIMIZERS

    impl, interpret = _accelerator_target(dry_run)
    rng = np.random.default_rng(0)
    num_rows = 1000 if dry_run else 100_000
    failures = 0

    def record(kernel: str, case: dict, got, want, bound) -> None:
        nonlocal failures
        err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
        bound = np.broadcast_to(np.asarray(bound, np.float64), err.shape)
        ok = bool(np.all(err <= bound))
        failures += not ok
        section.emit({"name": "accelerator_check", "kernel": kernel, **case, "impl": impl, "interpret": interpret,
                      "max_abs_err": float(err.max(initial=0.0)), "ok": ok})

    def table_of(dim: int, dtype):
        return jax.random.normal(jax.random.key(dim), (num_rows, dim), jnp.float32).astype(dtype)

    def lookup(length: int, dim: int, bags: int, dtype, reduce: bool) -> None:
        table = table_of(dim, dtype)
        ids = rng.integers(0, num_rows, (bags, length))
        ids[rng.random(ids.shape) < 0.1] = num_rows  # padding
        ids[rng.random(ids.shape) < 0.01] = -3  # never read
        ids = jnp.asarray(ids, jnp.int32)
        case = {"length": length, "dim": dim, "bags": bags, "dtype": jnp.dtype(dtype).name}
        if reduce:
            weights = jnp.asarray(rng.normal(size=ids.shape), jnp.float32)
            got = jax.jit(lambda t, r, w: gather_reduce(t, r, w, impl=impl, interpret=interpret))(table, ids, weights)
            magnitude = gather_reduce_reference(jnp.abs(table), ids, jnp.abs(weights))
            record("gather_reduce", case, got, gather_reduce_reference(table, ids, weights),
                   2 * length * np.finfo(np.float32).eps * np.asarray(magnitude) + 1e-30)
        else:
            got = jax.jit(lambda t, r: gather(t, r, impl=impl, interpret=interpret))(table, ids)
            record("gather", case, got, gather_reference(table, ids), 0.0)

    def distinct_rows_gather() -> None:
        table = table_of(64, jnp.float32)
        unique = np.unique(np.concatenate([rng.integers(0, num_rows, num_rows // 5),
                                           np.arange(64, 64 + num_rows // 20)]))
        unique = jnp.asarray(np.pad(unique, (0, 40), constant_values=num_rows), jnp.int32)[:, None]
        got = jax.jit(lambda t, r: gather(t, r, impl=impl, interpret=interpret))(table, unique)
        record("gather", {"case": "sorted_distinct_rows", "dim": 64, "bags": int(unique.shape[0])}, got,
               gather_reference(table, unique), 0.0)

    def update(name: str, dim: int, mode: str) -> None:
        got, want, rows = _update_case(SPARSE_OPTIMIZERS[name](0.05, weight_decay=1e-3), dim, mode, rng, dry_run)
        record("fused_backward_update" if mode == "segments" else "fused_row_update",
               {"optimizer": name, "dim": dim, "rows": rows, "grads": mode}, got, want,
               1e-5 * np.abs(want) + 1e-6)

    lookups = [(1, 16, 300), (1, 64, 300), (4, 128, 60), (20, 64, 30), (100, 200, 9)] if dry_run else [
        (1, 16, 65536), (1, 64, 65536), (4, 128, 16384), (20, 64, 8192), (100, 64, 2048), (100, 200, 512)]
    cases = [(f"fused_backward_update {n} D64", functools.partial(update, n, 64, "segments"))
             for n in SPARSE_OPTIMIZERS]
    cases += [(f"gather_reduce f32 {c}", functools.partial(lookup, *c, jnp.float32, True)) for c in lookups]
    cases += [(f"fused_row_update {n} D64 {m}", functools.partial(update, n, 64, m))
              for n in SPARSE_OPTIMIZERS for m in ("given", "read")]
    cases += [(f"gather f32 {c}", functools.partial(lookup, *c, jnp.float32, False)) for c in lookups]
    cases += [("gather sorted distinct rows", distinct_rows_gather)]
    cases += [(f"{k} bf16 {c}", functools.partial(lookup, *c, jnp.bfloat16, k == "gather_reduce"))
              for k in ("gather_reduce", "gather") for c in lookups]
    cases += [(f"fused updates {n} D{d} {m}", functools.partial(update, n, d, m))
              for d in (16, 128) for n in SPARSE_OPTIMIZERS for m in ("segments", "given", "read")]
    for what, run in cases:
        if section.has_time(what):
            run()
    return failures


def _update_case(optimizer, dim: int, mode: str, rng: np.random.Generator, dry_run: bool):
    """(kernel, XLA reference, rows) of one fused update of sorted distinct rows, table and state flattened; `mode`
    "given" / "read" (current rows passed or read in the kernel) or "segments" (the fused backward + update: each
    row's gradient summed from its occurrences' pooled gradients)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import SegmentGrads, fused_row_update, row_update_reference, sorted_segments

    impl, interpret = _accelerator_target(dry_run)
    num_rows, count, bag = (500, 300, 4) if dry_run else (1_000_000, 200_000, 4)
    keys = jax.random.split(jax.random.key(dim), 3)  # random values drawn on the device: host RNG is slow here
    table = jax.random.normal(keys[0], (num_rows, dim), jnp.float32)
    state = {k: v + 0.1 for k, v in optimizer.init(num_rows, dim).items()}
    if mode == "segments":
        occurrences = rng.integers(0, num_rows + 1, count)  # num_rows: padding
        ids, _, starts, order = jax.jit(sorted_segments, static_argnums=1)(jnp.asarray(occurrences, jnp.int32),
                                                                          num_rows)
        bags = count // bag + 1
        grads = SegmentGrads(starts, (order // bag).astype(jnp.int32),
                             jax.random.normal(keys[1], (count,), jnp.float32)[order],
                             jax.random.normal(keys[2], (bags, dim), jnp.float32))
        current = None
    else:
        ids = np.unique(rng.integers(0, num_rows, count))
        ids = jnp.asarray(np.pad(ids, (0, 17), constant_values=num_rows), jnp.int32)
        grads = jax.random.normal(keys[1], (ids.shape[0], dim), jnp.float32)
        current = jnp.take(table, ids, axis=0, mode="fill", fill_value=0) if mode == "given" else None

    def rule(rows, state_rows, grads, lr, step):
        return optimizer.update_rows(rows, state_rows, grads + optimizer.weight_decay * rows, lr, step)

    want = jax.jit(lambda t, s: row_update_reference(t, s, ids, current, grads, rule, jnp.float32(0.05),
                                                     jnp.int32(3)))(table, state)
    got = jax.jit(lambda t, s: fused_row_update(t, s, ids, current, grads, rule, 0.05, 3, impl=impl,
                                                interpret=interpret))(table, state)
    flat = lambda tree: np.concatenate([np.ravel(tree[0])] + [np.ravel(tree[1][k]) for k in sorted(tree[1])])  # noqa: E731
    return flat(got), flat(want), int(ids.shape[0])


def accelerator_bandwidth(section: Section, dry_run: bool) -> float:
    """The device's streaming copy, timed as the kernels are, beside the chip's HBM spec; returns bytes/s."""
    from pallas_kernels import timing
    from pallas_kernels.hardware import hbm_spec_bytes_per_second

    rate, copy = timing.copy_bandwidth((4 << 20) if dry_run else (512 << 20), min_seconds=LOOP_SECONDS)
    spec, source = hbm_spec_bytes_per_second()
    section.emit({"name": "copy_bandwidth", "gb_per_s": rate / 1e9, "ms": 1000 * copy.seconds,
                  "iterations": copy.iterations, "hbm_spec_gb_per_s": spec and spec / 1e9, "hbm_spec_source": source,
                  "copy_over_spec": spec and rate / spec})
    return rate


def _group_lookups(shape: dict, batches: int, seed: int = 0):
    """The engine's view of `shape` on the device: one stacked group (all tables) f32[R, D], `batches` batches of ids
    i32[batches, K, B, L] (stacked row ids, uniform per table), and each batch's sorted distinct rows, padded with the
    sentinel to the ids' count (as `unique_rows` returns them), with the segments of its sorted ids."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import sorted_segments

    sizes = vocab_sizes(shape)
    offsets = np.cumsum((0,) + sizes)
    rows = int(offsets[-1])
    table = jax.random.uniform(jax.random.key(seed), (rows, shape["dim"]), jnp.float32, -0.01, 0.01)
    keys = jax.random.split(jax.random.key(seed + 1), len(sizes))
    ids = jnp.stack([jax.random.randint(k, (batches, shape["batch"], shape["bag"]), 0, v) + o
                     for k, v, o in zip(keys, sizes, offsets, strict=False)], axis=1).astype(jnp.int32)
    segments = jax.jit(jax.vmap(lambda x: sorted_segments(x.reshape(-1), rows)))(ids)
    return table, ids, segments  # segments: (unique, inverse, starts, order), each with a leading batch axis


def accelerator_timings(section: Section, shape_name: str, shape: dict, bandwidth: float, dry_run: bool) -> None:
    """XLA vs the Pallas kernels on the engine's lookups for `shape`, each op's contenders timed round-robin many
    calls per host sync (`pallas_kernels.timing`), consecutive calls on different batches: the forward pooled from
    the table, the gather of the distinct rows, the fused update (SGD and row-wise Adagrad; rows given or read in the
    kernel), and the fused backward + update of the table path. Each line: ms, the bytes the op cannot avoid, GB/s,
    its fraction of this run's copy bandwidth and of the chip's HBM spec, the kernel / XLA time ratio, and the
    compiled loop's temporary bytes (a hidden copy of the table would show there)."""
    import jax.numpy as jnp

    from pallas_kernels import SegmentGrads, fused_row_update, gather, gather_reduce, timing
    from pallas_kernels.hardware import hbm_spec_bytes_per_second
    from recjax.sparse_optim import SGD, RowwiseAdagrad

    impl, interpret = _accelerator_target(dry_run)
    spec, _ = hbm_spec_bytes_per_second()
    batches = 2
    table, ids, (unique, _, starts, order) = _group_lookups(shape, batches)
    dim, bag = shape["dim"], shape["bag"]
    num_rows = table.shape[0]
    count = int(jnp.sum(unique[0] < num_rows))
    row = dim * 4
    weights = jnp.ones(ids.shape[1:], jnp.float32)
    kw = {"xla": {}, impl: {"interpret": interpret} if interpret else {}}

    def lookup_ops():
        def pooled(i, acc, impl=impl):
            return acc + jnp.sum(gather_reduce(table, ids[i % batches], weights, impl=impl, **kw[impl]))

        def distinct(i, acc, impl=impl):
            return acc + jnp.sum(gather(table, unique[i % batches][:, None], impl=impl, **kw[impl]))

        yield "pooled_from_table", ids[0].size * row + ids[0].size // bag * row, {
            i: (functools.partial(pooled, impl=i), jnp.float32(0)) for i in kw}
        yield "distinct_rows_gather", 2 * count * row, {
            i: (functools.partial(distinct, impl=i), jnp.float32(0)) for i in kw}

    def update_ops():
        grads = jnp.full((unique.shape[1], dim), 1e-3, jnp.float32)
        pooled_grads = jnp.full((ids[0].size // bag, dim), 1e-3, jnp.float32)
        for name, optimizer in (("sgd", SGD(0.01)), ("rowwise_adagrad", RowwiseAdagrad(0.01))):
            state_row = sum(int(np.prod(s[1:], dtype=np.int64)) for s in optimizer.state_shapes(1, dim).values())
            for mode in ("segments", "given", "read"):  # the fused backward + update first (the newest kernel)
                def body(i, carry, impl, mode=mode, optimizer=optimizer):
                    b = i % batches
                    if mode == "segments":  # occurrence k reads its bag's pooled gradient, weight 1
                        update_grads = SegmentGrads(starts[b], order[b] // bag, jnp.ones(order.shape[1]),
                                                    pooled_grads)
                    else:
                        update_grads = grads
                    current = jnp.zeros_like(grads) if mode == "given" else None
                    return fused_row_update(*carry, unique[b], current, update_grads, optimizer.update_rows, 0.01,
                                            i + 1, impl=impl, **kw[impl])

                # Rows read (the given buffer, or the table inside the kernel) and written, grads read, state read
                # and written; the segments: each occurrence's source index and weight, the pooled gradients.
                moved = count * (2 * row + 2 * 4 * state_row) + (
                    2 * 4 * ids[0].size + pooled_grads.size * 4 if mode == "segments" else count * row)
                op = f"backward_update_{name}" if mode == "segments" else f"update_{name}_rows_{mode}"
                yield op, moved, {i: (functools.partial(body, impl=i),
                                      (table.copy(), optimizer.init(*table.shape))) for i in kw}

    for ops in (lookup_ops, update_ops):
        for op, moved, contenders in ops():
            if not section.has_time(f"{shape_name} {op}"):
                continue
            timings, _ = timing.compare(contenders, repeats=3 if dry_run else 5, min_seconds=LOOP_SECONDS)
            del contenders
            for i, t in timings.items():
                rate = moved / t.seconds
                section.emit({"name": "accelerator_kernel", "shape": shape_name, "op": op, "impl": i,
                              "interpret": bool(interpret) and i != "xla", "ms": 1000 * t.seconds,
                              "iterations": t.iterations, "bytes": moved, "gb_per_s": rate / 1e9,
                              "copy_fraction": rate / bandwidth, "hbm_spec_fraction": spec and rate / spec,
                              "temp_bytes": t.temp_bytes,
                              **({} if i == "xla" else {"ratio_over_xla": t.seconds / timings["xla"].seconds}),
                              "config": shape})


def accelerator_auto(section: Section, shape_name: str, shape: dict, dry_run: bool) -> str | None:
    """What embedding.kernel="auto" chooses for `shape` on this device when it measures (kernel_measure="always",
    a throw-away cache), beside what the shipped table says; returns the chosen variant."""
    import tempfile

    import jax

    from recjax import kernel_choice

    if not section.has_time(f"{shape_name} auto"):
        return None
    task, _, _ = build(shape, shape["sparse"], kernel="xla", with_state=False)
    probe = task.collection
    with tempfile.TemporaryDirectory() as cache:
        embedding = {"kernel": "auto", "pool_from": "auto", "dedup": "auto", "kernel_measure": "always",
                     "kernel_cache": f"{cache}/choices.json"}
        device = kernel_choice.current_device()
        if dry_run:  # as on a one-device GPU, so the measurement runs (the kernels interpreted)
            device = kernel_choice.Device("gpu", "dry run", 1, None)
        measure = functools.partial(kernel_choice.measure_variants, probe, task.sparse_optimizer, shape["batch"],
                                    "auto", repeats=3, min_seconds=LOOP_SECONDS)
        start = time.monotonic()
        with contextlib.redirect_stdout(sys.stderr):  # its progress lines; stdout carries the JSON lines only
            chosen = kernel_choice.choose_kernel(embedding, probe, task.sparse_optimizer, shape["batch"],
                                                 device=device, measure=measure)
    _log(f"{shape_name}: {kernel_choice.describe(chosen)}")
    shipped = kernel_choice.shipped_choice(device.kind, chosen.get("shape_class", ""))
    section.emit({"name": "accelerator_auto", "shape": shape_name, **chosen, "measure_s": time.monotonic() - start,
                  "shipped_variant": shipped and shipped[0], "device": jax.devices()[0].device_kind, "config": shape})
    return chosen["variant"]


def accelerator_steps(section: Section, shape_name: str, shape: dict, auto_variant: str | None,
                      dry_run: bool) -> None:
    """The whole train step with XLA and each kernel variant (`kernel_choice.VARIANTS`), many steps per host sync on
    two alternating batches, one variant after another (each compiled, timed and freed before the next: three copies
    of reference_random's state need not fit at once), with ratios over XLA and which of them "auto" measured
    fastest. The state is initialised once (its shapes do not depend on the kernels) and copied per variant."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import timing
    from recjax import kernel_choice
    from recjax.step import make_train_step

    if not section.has_time(f"{shape_name} steps"):
        return
    base, state, _ = build(shape, shape["sparse"], kernel="xla")
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *[build_batch(base.spec, shape["batch"], seed) for seed in (1, 2)])
    xla_seconds = None
    for name, (kernel, pool_from) in kernel_choice.VARIANTS.items():
        if not section.has_time(f"{shape_name} step {name}"):
            break
        task, _, _ = build(shape, shape["sparse"], kernel=kernel, pool_from=pool_from or "auto", with_state=False)
        step = make_train_step(task)

        def body(i, state, step=step):
            return step(state, jax.tree.map(lambda x: x[i % 2], stacked))[0]

        t = timing.seconds_per_call(body, jax.tree.map(lambda x: x.copy(), state), repeats=3 if dry_run else 5,
                                    min_seconds=LOOP_SECONDS)
        xla_seconds = xla_seconds or t.seconds  # XLA runs first
        collection = task.collection
        section.emit({"name": "accelerator_step", "shape": shape_name, "variant": name, "kernel": collection.kernel,
                      "pool_from": collection.pool_from, "dedup": collection.dedup, "ms": 1000 * t.seconds,
                      "iterations": t.iterations, "ratio_over_xla": t.seconds / xla_seconds,
                      "auto_chose": name == auto_variant, "temp_bytes": t.temp_bytes, "config": shape})
        del task, step, body, t


def accelerator(dry_run: bool, budget_s: float = RUN_BUDGET_S) -> int:
    """The `--accelerator` command: 0 when every kernel matches XLA on the device (or there is no device), else 1."""
    import jax

    info = machine()
    if jax.default_backend() not in ("tpu", "gpu") and not dry_run:
        _log("no accelerator: jax's default backend is "
             f"{jax.default_backend()}; run this on a GPU or TPU host (nothing to check here)")
        _emit({"name": "accelerator", "status": "no accelerator", "machine": info})
        return 0
    deadline = time.monotonic() + budget_s

    def section(name: str) -> Section:
        return Section(name, SECTION_BUDGETS[name], deadline, info, dry_run)

    with section("check") as s:
        failures = accelerator_check(s, dry_run)
    with section("bandwidth") as s:
        bandwidth = accelerator_bandwidth(s, dry_run)
    shapes = {name: (DRY_RUN_SHAPES if dry_run else SHAPES)[name] for name in ACCELERATOR_SHAPES}
    for name, shape in shapes.items():
        with section("kernels") as s:
            accelerator_timings(s, name, shape, bandwidth, dry_run)
    auto = {}
    for name, shape in shapes.items():
        with section("auto") as s:
            auto[name] = accelerator_auto(s, name, shape, dry_run)
    for name, shape in shapes.items():
        with section("steps") as s:
            accelerator_steps(s, name, shape, auto[name], dry_run)
    _emit({"name": "accelerator", "status": "checked", "kernel_mismatches": failures, "machine": info})
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)}")
    parser.add_argument("--only", default=",".join(MEASUREMENTS), help=f"comma-separated, from {MEASUREMENTS}")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per contender (medians reported)")
    parser.add_argument("--accelerator", action="store_true",
                        help="the accelerator session's one command: every kernel vs XLA on the device, the copy "
                             "bandwidth and the HBM spec, kernel times, what embedding.kernel=auto measures, and "
                             "train-step times (reference_random, kaggle_b2048), in --budget_s; on a CPU it says so "
                             "and exits 0")
    parser.add_argument("--budget_s", type=float, default=RUN_BUDGET_S,
                        help="--accelerator: seconds the sections may start work in (each also has its own budget)")
    parser.add_argument("--accelerator_dry_run", action="store_true",
                        help="run --accelerator's code on this CPU: tiny shapes, Triton kernels interpreted, no "
                             "budgets (its times mean nothing)")
    args = parser.parse_args(argv)
    if args.accelerator or args.accelerator_dry_run:
        return accelerator(args.accelerator_dry_run, args.budget_s)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    only = {m.strip() for m in args.only.split(",") if m.strip()}
    unknown = [s for s in shapes if s not in SHAPES] + sorted(only - set(MEASUREMENTS))
    if unknown:
        parser.error(f"unknown shapes or measurements {unknown}; shapes {list(SHAPES)}, measurements {MEASUREMENTS}")
    info = machine()
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
