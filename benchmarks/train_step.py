r"""Train-step benchmark: throughput, compile time and memory of the jitted DLRM train step.

    python benchmarks/train_step.py                                  # everything (~3 min on 2 CPU cores)
    python benchmarks/train_step.py --only vocab_scaling --steps 10  # one measurement, 10 timed steps
    python benchmarks/train_step.py --only compression_step_ratio    # QR, MD, TT vs full (~2 min, 7 GB peak RSS)

Prints one JSON line per measurement to stdout (progress goes to stderr). Every line carries the run's
config, its results and the machine (platform, CPU count, jax version, device kind). Each run executes in a
fresh subprocess (the script re-invokes itself with `--single <run>`), because ru_maxrss is a per-process
high-water mark: a shared process would report the largest earlier run's peak for every later one.

Measurements
  kaggle_onehot     The `kaggle` preset of experiments/configs/dlrm_synthetic.py: dim 16, bottom
                    13-512-256-64-16, top 512-256-1, the 26 full Criteo Kaggle cardinalities (33.8M rows,
                    2.2 GB of f32 tables, uncapped), one-hot ids drawn uniformly below each vocab size, the
                    preset's optimizers (dense Adam, sparse lazy Adam). Batch 128 and 2048, one line each.
  reference_random  The facebookresearch/dlrm random-data benchmark shape: 8 tables x 1M rows x dim 64,
                    100 ids per bag (every bag full), batch 2048, bottom 512-512-64, top 1024-1024-1024-1, dot
                    interaction, SGD (lr 0.01) for dense and sparse. The reference feeds 512 dense features
                    into its bottom MLP 512-512-64 (input 512 -> 512 -> 64); here 13 dense features feed
                    13 -> 512 -> 512 -> 64, which has the reference's layers plus a 13x512 one.
  vocab_scaling     One table of 1M rows vs one of 10M rows, dim 64, 20 ids per example, batch 2048, bottom
                    13-64-64, top 64-1, row-wise Adagrad. One line per table size, then a `vocab_scaling`
                    line with `ratio` = step time(10M) / step time(1M) (medians; `ratio_min` from the
                    fastest steps, less sensitive to other processes on the machine): a sparse update costs
                    O(ids in the batch), so the goal is ratio <= 1.2 (random access into a bigger table costs
                    some TLB and cache misses, nothing proportional to the row count).
  compression_step_ratio
                    The kaggle_onehot shape and optimizers at batch 2048 with three embeddings: full; QR
                    (collisions 4, op mult, tables of <= 200 ids kept full: the reference's --qr-threshold); and
                    MD (budget mode, alpha 0.3, budget = full params / 4, threshold 200); and TT-Rec (3 cores,
                    rank 16, default factors, threshold 200). One line per method, then
                    a `compression_step_ratio` line with each method's step time (median, min) and
                    `ratio_vs_full` = step time(method) / step time(full) (medians; `ratio_min_vs_full` from the
                    fastest steps). The goal is ratio <= 1.3: QR gathers and updates two rows per id and combines
                    per id (mult is not linear, so it cannot pool first); MD adds a small projection per table;
                    TT gathers three core slices per id and contracts them (~2 (d_1 d_2 r^2 + D r) flops per id).
                    Also FIITED (keep 0.25, 4 chunks; a step between adjustments with every chunk live: four
                    reads of the pool per id, plus the chunk-utility update: a sort of each FIITED feature's ids
                    and d loss / d embeddings), row_prune (1 chunk) and uniform_dim (4 of 16 columns).

Fields of each run's line
  step_time_ms          median over the timed steps (after warmup), each step blocked until ready; also
                        min/mean. examples_per_sec = batch_size / median step time.
  compile_time_s        `train_step.lower(state, batch).compile()` (lowering: lower_time_s); the
                        steps then run that compiled executable. first_step_s is its first call.
  peak_rss_bytes        ru_maxrss of the child at the end (the high-water mark over init, compile and steps).
  baseline_rss_bytes    ru_maxrss after importing jax and running a trivial jit, before building anything.
  accounted_bytes       embedding_bytes + sparse_optimizer_bytes (EmbeddingCollection.accounting())
                        + dense_param_bytes + dense_optimizer_bytes (the leaves of the state), each also
                        reported on its own. memory_ratio = peak_rss_bytes / accounted_bytes (goal <= 1.5);
                        memory_ratio_above_baseline = (peak - baseline) / accounted, which discounts the
                        runtime's fixed cost (it dominates small runs).
  xla_*_bytes           the compiled step's memory_analysis(): arguments, outputs, aliased (donated) bytes
                        and temporaries. A temp size on the order of a table means XLA copies the table
                        instead of updating it in place.

Batches are generated on the host (8 distinct ones, cycled), validated and device_put before timing, so data
generation is never timed. Labels are random: the loss is meaningless, only checked to be finite.
"""

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

_NUM_BATCHES = 8  # distinct pre-generated batches, cycled through the steps
_KAGGLE_RUNS_NOTE = "sparse optimizer: the kaggle preset's default"
_REFERENCE_NOTE = ("reference (facebookresearch/dlrm random data) feeds 512 dense features to bottom "
                   "512-512-64 (512 -> 512 -> 64); here num_dense=13 feeds 13 -> 512 -> 512 -> 64")


@dataclasses.dataclass(frozen=True)
class Run:
    """One benchmarked configuration, executed in its own process."""

    key: str  # unique id passed to --single (the "run" field of its JSON line)
    name: str  # the "name" of its JSON line
    measurement: str  # the group --only selects
    preset: str  # experiments/configs/dlrm_synthetic.py preset the config starts from
    batch_size: int
    vocab_sizes: tuple[int, ...]
    bag_size: int
    dim: int
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]
    num_dense: int = 13
    dense_optimizer: dict[str, Any] | None = None  # None: the preset's default
    sparse_optimizer: dict[str, Any] | None = None  # None: the preset's default
    warmup_steps: int = 3
    timed_steps: int = 50
    embedding_method: str = "full"  # config.embedding.method
    embedding_options: dict[str, Any] | None = None  # config.embedding.options (incl. threshold)
    note: str = ""


def _kaggle_vocab_sizes() -> tuple[int, ...]:
    from recjax.data.synthetic import KAGGLE_VOCAB_SIZES

    return tuple(KAGGLE_VOCAB_SIZES)


def _runs() -> list[Run]:
    kaggle = [
        Run(key=f"kaggle_onehot_b{b}", name="kaggle_onehot", measurement="kaggle_onehot", preset="kaggle",
            batch_size=b, vocab_sizes=_kaggle_vocab_sizes(), bag_size=1, dim=16,
            bottom_mlp=(512, 256, 64, 16), top_mlp=(512, 256, 1), note=_KAGGLE_RUNS_NOTE)
        for b in (128, 2048)
    ]
    sgd = {"name": "sgd", "learning_rate": 0.01}
    reference = Run(key="reference_random", name="reference_random", measurement="reference_random",
                    preset="terabyte", batch_size=2048, vocab_sizes=(1_000_000,) * 8, bag_size=100, dim=64,
                    bottom_mlp=(512, 512, 64), top_mlp=(1024, 1024, 1024, 1), dense_optimizer=sgd,
                    sparse_optimizer=sgd, warmup_steps=2, timed_steps=8, note=_REFERENCE_NOTE)
    vocab = [
        Run(key=f"vocab_scaling_{label}", name=f"vocab_scaling_{label}", measurement="vocab_scaling",
            preset="small", batch_size=2048, vocab_sizes=(rows,), bag_size=20, dim=64, bottom_mlp=(64, 64),
            top_mlp=(64, 1), sparse_optimizer={"name": "rowwise_adagrad", "learning_rate": 0.01})
        for label, rows in (("1M", 1_000_000), ("10M", 10_000_000))
    ]
    return [*kaggle, reference, *vocab, *_compression_runs()]


_COMPRESSION_THRESHOLD = 200  # tables with <= 200 ids stay full (the reference's --qr-threshold / --md-threshold)


def _compression_runs() -> list[Run]:
    """full vs QR (4 collisions, mult) vs MD (budget for 4x) vs TT-Rec (rank 16) vs FIITED and its baselines (a
    quarter of the values) on the kaggle_onehot shape at batch 2048."""
    vocab = _kaggle_vocab_sizes()
    dim = 16
    md_budget = sum(vocab) * dim // 4  # params of every table, full ones included (compression/plan.py)
    methods = (
        ("full", {}),
        ("qr", {"collisions": 4, "op": "mult", "threshold": _COMPRESSION_THRESHOLD}),
        ("md", {"budget": md_budget, "alpha": 0.3, "threshold": _COMPRESSION_THRESHOLD}),
        ("tt", {"rank": 16, "threshold": _COMPRESSION_THRESHOLD}),
        # FIITED between adjustments, before any pruning (the pool at V K chunks: the most it ever holds), and its
        # baselines at a quarter of the values.
        ("fiited", {"keep": 0.25, "threshold": _COMPRESSION_THRESHOLD}),
        ("row_prune", {"keep": 0.25, "threshold": _COMPRESSION_THRESHOLD}),
        ("uniform_dim", {"keep": 0.25, "threshold": _COMPRESSION_THRESHOLD}),
    )
    return [
        Run(key=f"compression_step_ratio_{method}", name=f"compression_step_ratio_{method}",
            measurement="compression_step_ratio", preset="kaggle", batch_size=2048, vocab_sizes=vocab, bag_size=1,
            dim=dim, bottom_mlp=(512, 256, 64, 16), top_mlp=(512, 256, 1), warmup_steps=3, timed_steps=30,
            embedding_method=method, embedding_options=options, note=_KAGGLE_RUNS_NOTE)
        for method, options in methods
    ]


MEASUREMENTS = ("kaggle_onehot", "reference_random", "vocab_scaling", "compression_step_ratio")


# ------------------------------------------------------------------------------------------- machine
def machine_info() -> dict[str, Any]:
    import jax
    import jaxlib

    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = jax.devices()[0]
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


# ------------------------------------------------------------------------------------- one run (child)
def _config(run: Run):
    import ml_collections

    from experiments.configs.dlrm_synthetic import get_config

    config = get_config(run.preset)
    config.embedding.dim = run.dim
    config.model.dlrm.bottom_mlp = run.bottom_mlp
    config.model.dlrm.top_mlp = run.top_mlp
    config.model.dlrm.interaction = "dot"
    config.train.batch_size = run.batch_size
    config.embedding.method = run.embedding_method
    config.embedding.options = ml_collections.ConfigDict(run.embedding_options or {})
    if run.dense_optimizer is not None:
        config.optimizer.dense = ml_collections.ConfigDict(run.dense_optimizer)
    if run.sparse_optimizer is not None:
        config.optimizer.sparse = ml_collections.ConfigDict(run.sparse_optimizer)
    return config


def _batches(run: Run, spec, seed: int = 0) -> list:
    """`_NUM_BATCHES` random full-bag batches (ids uniform below each vocab size), validated on the host."""
    import numpy as np

    from recjax.batch import Batch, validate_batch

    out = []
    for i in range(_NUM_BATCHES):
        rng = np.random.default_rng([seed, i])
        b = run.batch_size
        batch = Batch(
            dense=rng.standard_normal((b, spec.num_dense), dtype=np.float32),
            ids={f.name: rng.integers(0, f.vocab_size, (b, f.bag_size), dtype=np.int32)
                 for f in spec.features},
            lengths={f.name: np.full((b,), f.bag_size, np.int32) for f in spec.features},
            labels=rng.integers(0, 2, (b,)).astype(np.float32),
        )
        validate_batch(batch, spec, where=f"benchmark batch {i}")
        out.append(batch)
    return out


def _tree_bytes(tree) -> int:
    import jax

    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)))


def run_single(run: Run, timed_steps: int, warmup_steps: int) -> dict[str, Any]:
    """Build, compile and time one run in this process; return its JSON record."""
    import jax
    import jax.numpy as jnp

    from recjax.train import peak_rss_bytes

    jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.ones(4)))
    baseline_rss = peak_rss_bytes()

    import numpy as np

    from recjax.specs import DatasetSpec, FeatureSpec
    from recjax.step import init_state, make_train_step
    from recjax.task import build_task

    config = _config(run)
    spec = DatasetSpec(num_dense=run.num_dense, features=tuple(
        FeatureSpec(f"C{i + 1}", v, run.bag_size) for i, v in enumerate(run.vocab_sizes)))
    task = build_task(config, spec)
    batches = [jax.device_put(b) for b in _batches(run, spec)]
    jax.block_until_ready(batches)

    t0 = time.perf_counter()
    state = jax.block_until_ready(init_state(task, jax.random.key(config.seed), batches[0]))
    init_time = time.perf_counter() - t0

    accounting = task.collection.accounting(task.sparse_optimizer)
    dense_param_bytes = _tree_bytes(state.dense_params)
    dense_opt_bytes = _tree_bytes(state.dense_opt_state)
    # Dynamic tables' routing arrays (FIITED's indirection and utility) are accounted with their table.
    table_array_bytes = _tree_bytes(state.tables) + _tree_bytes(state.sparse_opt_state) + _tree_bytes(state.aux)
    # accounting["bytes"] includes the methods' glue params (MD projections), which live in the dense params.
    glue_bytes = 4 * sum(m.glue_params() for m in task.collection.methods.values())
    assert table_array_bytes == accounting["bytes"] - glue_bytes + accounting["optimizer_bytes"], (
        table_array_bytes, accounting["bytes"], glue_bytes, accounting["optimizer_bytes"])
    accounted = accounting["bytes"] - glue_bytes + accounting["optimizer_bytes"] + dense_param_bytes + dense_opt_bytes

    train_step = make_train_step(task)
    t0 = time.perf_counter()
    lowered = train_step.lower(state, batches[0])
    lower_time = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_time = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax: one dict per device
        cost = cost[0]
    flops = float(cost.get("flops", float("nan"))) if cost else float("nan")

    def step(state, i: int):
        state, metrics = compiled(state, batches[i % _NUM_BATCHES])
        return jax.block_until_ready((state, metrics))

    t0 = time.perf_counter()
    state, metrics = step(state, 0)
    first_step = time.perf_counter() - t0
    for i in range(1, warmup_steps):
        state, metrics = step(state, i)
    times = []
    for i in range(warmup_steps, warmup_steps + timed_steps):
        t0 = time.perf_counter()
        state, metrics = step(state, i)
        times.append(time.perf_counter() - t0)
    loss = float(metrics["loss"])
    if not np.isfinite(loss):
        raise FloatingPointError(f"{run.key}: loss is {loss}")
    peak_rss = peak_rss_bytes()

    median = statistics.median(times)
    sparse_cfg = dict(config.optimizer.sparse)
    dense_cfg = dict(config.optimizer.dense)
    record: dict[str, Any] = {
        "name": run.name,
        "run": run.key,
        "measurement": run.measurement,
        "batch_size": run.batch_size,
        "preset": run.preset,
        "num_tables": len(run.vocab_sizes),
        "total_rows": int(sum(run.vocab_sizes)),
        "vocab_sizes": list(run.vocab_sizes) if len(run.vocab_sizes) <= 8 else "kaggle (26 cardinalities)",
        "bag_size": run.bag_size,
        "bags_full": True,
        "id_distribution": "uniform",
        "dim": run.dim,
        "num_dense": run.num_dense,
        "bottom_mlp": [run.num_dense, *run.bottom_mlp],
        "top_mlp": list(run.top_mlp),
        "interaction": config.model.dlrm.interaction,
        "pooling": config.embedding.pooling,
        "embedding_method": run.embedding_method,
        "embedding_options": dict(run.embedding_options or {}),
        "compression_ratio": accounting["full_bytes"] / accounting["bytes"],
        "sparse_optimizer": sparse_cfg,
        "dense_optimizer": dense_cfg,
        "warmup_steps": warmup_steps,
        "timed_steps": timed_steps,
        "step_time_ms": 1e3 * median,
        "step_time_min_ms": 1e3 * min(times),
        "step_time_mean_ms": 1e3 * statistics.fmean(times),
        "examples_per_sec": run.batch_size / median,
        "lower_time_s": lower_time,
        "compile_time_s": compile_time,
        "first_step_s": first_step,
        "init_time_s": init_time,
        "train_flops_per_example": flops / run.batch_size,
        "final_loss": loss,
        "peak_rss_bytes": peak_rss,
        "baseline_rss_bytes": baseline_rss,
        "embedding_bytes": accounting["bytes"],
        "sparse_optimizer_bytes": accounting["optimizer_bytes"],
        "dense_param_bytes": dense_param_bytes,
        "dense_optimizer_bytes": dense_opt_bytes,
        "accounted_bytes": accounted,
        "memory_ratio": peak_rss / accounted,
        "memory_ratio_above_baseline": (peak_rss - baseline_rss) / accounted,
        "xla_argument_bytes": getattr(mem, "argument_size_in_bytes", None),
        "xla_output_bytes": getattr(mem, "output_size_in_bytes", None),
        "xla_alias_bytes": getattr(mem, "alias_size_in_bytes", None),
        "xla_temp_bytes": getattr(mem, "temp_size_in_bytes", None),
    }
    if run.note:
        record["note"] = run.note
    record["machine"] = machine_info()
    return record


# ------------------------------------------------------------------------------------------ driver
def _run_child(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--single", run.key]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    if args.warmup is not None:
        cmd += ["--warmup", str(args.warmup)]
    print(f"[train_step] {run.key} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=_REPO_ROOT)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"name": run.name, "run": run.key, "measurement": run.measurement,
                "error": f"child exited {proc.returncode}", "stdout_tail": proc.stdout[-2000:],
                "wall_time_s": wall}
    record = json.loads(lines[-1])
    record["wall_time_s"] = wall
    return record


def _compression_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The `compression_step_ratio` line: each method's step time relative to full at the same batch."""
    by_method = {r["embedding_method"]: r for r in records}
    full = by_method["full"]
    return {
        "name": "compression_step_ratio",
        "batch_size": full["batch_size"],
        "dim": full["dim"],
        "total_rows": full["total_rows"],
        "sparse_optimizer": full["sparse_optimizer"],
        "methods": {m: r["embedding_options"] for m, r in by_method.items()},
        "compression_ratio": {m: r["compression_ratio"] for m, r in by_method.items()},
        "embedding_bytes": {m: r["embedding_bytes"] for m, r in by_method.items()},
        "step_time_ms": {m: r["step_time_ms"] for m, r in by_method.items()},
        "step_time_min_ms": {m: r["step_time_min_ms"] for m, r in by_method.items()},
        "ratio_vs_full": {m: r["step_time_ms"] / full["step_time_ms"] for m, r in by_method.items()},
        "ratio_min_vs_full": {m: r["step_time_min_ms"] / full["step_time_min_ms"] for m, r in by_method.items()},
        "train_flops_per_example": {m: r["train_flops_per_example"] for m, r in by_method.items()},
        "xla_temp_bytes": {m: r["xla_temp_bytes"] for m, r in by_method.items()},
        "goal": "ratio_vs_full <= 1.3",
        "machine": full["machine"],
    }


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(MEASUREMENTS),
                        help=f"comma-separated measurements to run, from {', '.join(MEASUREMENTS)}")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default: per run)")
    parser.add_argument("--warmup", type=int, default=None, help="warmup steps per run (default: per run)")
    parser.add_argument("--single", default=None, help=argparse.SUPPRESS)  # internal: one run, this process
    args = parser.parse_args(argv)
    runs = _runs()

    if args.single is not None:
        by_key = {r.key: r for r in runs}
        if args.single not in by_key:
            parser.error(f"unknown run '{args.single}'; known: {sorted(by_key)}")
        run = by_key[args.single]
        steps = run.timed_steps if args.steps is None else args.steps
        warmup = run.warmup_steps if args.warmup is None else args.warmup
        if steps < 1 or warmup < 1:
            parser.error("--steps and --warmup must be >= 1")
        _emit(run_single(run, steps, warmup))
        return 0

    selected = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = set(selected) - set(MEASUREMENTS)
    if unknown:
        parser.error(f"unknown measurements {sorted(unknown)}; choose from {', '.join(MEASUREMENTS)}")

    start = time.perf_counter()
    failed = False
    for measurement in MEASUREMENTS:
        if measurement not in selected:
            continue
        records = []
        for run in (r for r in runs if r.measurement == measurement):
            record = _run_child(run, args)
            failed |= "error" in record
            records.append(record)
            _emit(record)
        if measurement == "vocab_scaling" and not any("error" in r for r in records):
            small, large = records
            _emit({
                "name": "vocab_scaling",
                "batch_size": small["batch_size"],
                "dim": small["dim"],
                "bag_size": small["bag_size"],
                "sparse_optimizer": small["sparse_optimizer"],
                "rows": [small["total_rows"], large["total_rows"]],
                "step_time_ms": [small["step_time_ms"], large["step_time_ms"]],
                "ratio": large["step_time_ms"] / small["step_time_ms"],
                "ratio_min": large["step_time_min_ms"] / small["step_time_min_ms"],  # robust to contention
                "goal": "ratio <= 1.2",
                "xla_temp_bytes": [small["xla_temp_bytes"], large["xla_temp_bytes"]],
                "memory_ratio": [small["memory_ratio"], large["memory_ratio"]],
                "machine": small["machine"],
            })
        if measurement == "compression_step_ratio" and not any("error" in r for r in records):
            _emit(_compression_summary(records))
    print(f"[train_step] total wall time {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    from recjax import cli

    cli.tune_malloc()  # as the launcher does, so the benchmark measures what a run gets
    cli.use_cpu_if_no_accelerator()
    with cli.user_errors():
        sys.exit(main())
