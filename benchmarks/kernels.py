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
"""

from __future__ import annotations

import argparse
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
MEASUREMENTS = ("copy_bandwidth", "stages", "embedding_stage", "torch", "fbgemm")
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


def build(shape: dict, sparse: str, seed: int = 0, dedup: str = "auto"):
    """(task, state, batch) for `shape` with sparse optimizer `sparse` (dense SGD) and `embedding.dedup`, on
    device."""
    import jax
    import ml_collections

    from experiments.configs.dlrm_synthetic import get_config
    from recjax.batch import Batch, validate_batch
    from recjax.specs import DatasetSpec, FeatureSpec
    from recjax.step import init_state
    from recjax.task import build_task

    sizes = vocab_sizes(shape)
    config = get_config("small")
    config.embedding.dim = shape["dim"]
    config.model.dlrm.bottom_mlp = shape["bottom"]
    config.model.dlrm.top_mlp = shape["top"]
    config.train.batch_size = shape["batch"]
    config.embedding.dedup = dedup
    config.optimizer.dense = ml_collections.ConfigDict({"name": "sgd", "learning_rate": shape["lr"],
                                                        "weight_decay": 0.0})
    config.optimizer.sparse = ml_collections.ConfigDict({"name": sparse, "learning_rate": shape["lr"],
                                                         "weight_decay": 0.0})
    spec = DatasetSpec(num_dense=NUM_DENSE, features=tuple(
        FeatureSpec(f"C{i + 1}", v, shape["bag"]) for i, v in enumerate(sizes)))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)}")
    parser.add_argument("--only", default=",".join(MEASUREMENTS), help=f"comma-separated, from {MEASUREMENTS}")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per contender (medians reported)")
    args = parser.parse_args(argv)
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
