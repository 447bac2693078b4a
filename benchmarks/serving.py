r"""Serving benchmark: what each table format costs in bytes and test quality, and what a model costs to serve behind
the batching HTTP server (python -m experiments.serve) under open-loop load.

    python benchmarks/serving.py --root=/tmp/serving_bench                         # everything (~20-30 min, 2 cores)
    python benchmarks/serving.py --only=tables --datasets=movielens --ml100k=/path/to/ml-100k
    python benchmarks/serving.py --only=load --rates=20,100,400,1600 --seconds=2

Prints one JSON line per measurement to stdout (progress to stderr); --plot writes the latency / QPS figure. Trained
runs and exports are kept under --root and reused by a second invocation.

Measurements
  tables     per dataset (the default synthetic DLRM, `--synthetic_steps` steps; DLRM on ML-100K) and compression
             method (--methods, at --ratio x fewer embedding params than full; compression/ via
             experiments/sweep_compression.py's knobs) and format (f32, fp16, bf16, int8, int4): the stored table bytes,
             the ratio to f32, and the test AUC / logloss with the decoded tables and their change against f32. The
             checkpoint scored is the run's selected step (whose test metrics its summary reports; the export's
             default), for every format alike.
  forward    the bare exported model (loader.score_arrays, no HTTP, no batching) per batch size: the floor a server
             adds to; in the same process as the load generator, before any load.
  overhead   the server's own cost at low load: one client sends one-row requests one after another (closed loop,
             --overhead_requests) to the f32 export behind the server without batching (max_batch 1): the client's
             p50 latency minus the bare forward's median at batch 1 (measured twice, before and after the server,
             so drift shows), and the server's own time from its Server-Timing header, with and without its
             model call (what the server adds, apart from the HTTP round trip and the client on the same cores).
  load       the synthetic runs exported (full: f32, int8, int4; qr, md: f32; and the f32 export with its tables on disk
             behind a RAM row cache of --disk_cache of each table's rows, `--tier=disk`), each behind the server on
             127.0.0.1 at rising open-loop request rates (--rates, Poisson arrivals, --seconds counted per rate after
             --settle seconds sent but not counted, at most --max_requests counted, 1 encoded row per request;
             recjax/serving/measure.py): p50 / p95 / p99 against achieved QPS (and for the adaptive scheduler, the
             batching it chose by the end of each rate). Formats run at one batching setting (--format_batch,
             --format_wait_ms); the f32 model also runs without batching (max_batch 1), at every --grid setting
             (max_batch x max_wait_ms) and with the adaptive scheduler (recjax/serving/server.py AdaptiveBatching, cap
             --grid's largest max_batch, one run per --adaptive_targets p99 target). Per curve, the latency-bounded
             throughput at p99 targets --targets (ms); with --repeats N the no-batching, grid and scheduler curves
             run N times in alternating order, and the scheduler's median is set beside no batching's and the grid
             setting with the best median (one noisy curve's luck does not pick "the best fixed setting"), and
             beside the grid's choice measured on repeats it was not chosen on (per repeat, the setting with the
             best median over the other repeats, its figure in this one: what deploying the grid's pick gives,
             without the upward bias of taking the largest of nine noisy medians). Batch
             shapes are padded to powers of two (--batch_shapes=pow2) so a small batch costs a small batch's forward
             under every setting. The disk-tier model's cache hit ratio is read from the server's /metrics after its
             curve. The load generator shares the machine's cores with the server: its own CPU time is part of the
             figures.
  drain      the f32 export behind a fresh server per case (--drain_cases, REQUESTSxROWS@SECONDS): that many
             concurrent requests of that many rows, each on its own connection, and SIGTERM that many seconds after
             they start (recjax/serving/measure.py drain_burst): per answer, how many clients got it, how many were
             refused a connection (the listening socket closed), how many lost an accepted connection without an
             answer (never, since issue 43), the exit status and the server's drain report.
  stalled    --stalled connections to the f32 export's server whose headers promise a 100-byte body and send 10 bytes
             of it (recjax/serving/measure.py stalled_clients): what each got and when (408 after the body timeout,
             --stalled_body_timeout; the connection closed), and regular one-row requests' latency meanwhile.
  cpu        the server's own CPU microseconds per request (its process's user + system time, Linux), --cpu_requests
             sent one at a time: GET /healthz (HTTP and connection handling alone) and one-row POST /v1/score
             (max_batch 1), on one kept-alive connection and on a new connection each; --repeats servers in turn.
             Unlike latency, CPU time is not inflated by other work waiting for the same cores, so it compares two
             versions of the server on a loaded machine (run it in each checkout, alternating).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MEASUREMENTS = ("tables", "forward", "overhead", "load", "drain", "stalled", "cpu")
SHARED = os.environ.get("RECJAX_SHARED_DATA", str(REPO.parent / "shared" / "data"))
RESULTS = sys.stdout  # the JSON lines; everything else (training's and the data builders' prints) goes to stderr


def _log(message: str) -> None:
    print(f"[serving] {message}", file=sys.stderr, flush=True)


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps({"benchmark": "serving", **record, "machine": _machine()}), file=RESULTS, flush=True)


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load1": round(os.getloadavg()[0], 2)}


def train_run(root: pathlib.Path, dataset: str, method: str, ratio: float, steps: int, ml100k: str,
              dim: int = 0) -> pathlib.Path:
    """The run's workdir under `root`, trained unless it has finished before; `dim`: the embedding dim (0: the
    config's)."""
    from experiments import sweep_compression as sc
    from recjax.train import train_and_evaluate

    workdir = root / "runs" / (f"{dataset}_{method}" + (f"_d{dim}" if dim else ""))
    if (workdir / "summary.json").is_file():
        return workdir
    if dataset == "synthetic":
        from experiments.configs import dlrm_synthetic

        base = dlrm_synthetic.get_config()
        base.train.steps = steps
        base.train.eval_every = steps
        base.train.log_every = max(1, steps // 10)
        base.train.progress_bar = False
    else:
        base = sc.base_config("movielens", ml100k, prepared_dir=str(root / "prepared"))
    if dim:
        base.embedding.dim = dim
        bottom = tuple(base.model.dlrm.bottom_mlp)
        if base.model.name == "dlrm" and bottom:  # the dot interaction needs the bottom MLP to end at the dim
            base.model.dlrm.bottom_mlp = (*bottom[:-1], dim)
    config = sc.run_config(base, sc.dataset_spec(base), method, ratio if method != "full" else 1.0, seed=0)
    _log(f"training {dataset} {method} -> {workdir}")
    train_and_evaluate(config, workdir)
    return workdir


def measure_tables(args, root: pathlib.Path) -> None:
    from recjax.serving.export import load_run
    from recjax.serving.measure import format_quality

    for dataset in args.datasets:
        for method in args.methods:
            workdir = train_run(root, dataset, method, args.ratio, args.synthetic_steps, args.ml100k, args.dim)
            for row in format_quality(load_run(workdir), args.formats):
                _emit({"measurement": "tables", "dataset": dataset, "method": method, "ratio": args.ratio,
                       "dim": args.dim or None, **row})


def exports(args, root: pathlib.Path) -> dict[str, pathlib.Path]:
    from recjax.serving.export import export_run, load_run

    out = {}
    for name, method, fmt in (("f32", "full", "f32"), ("int8", "full", "int8"), ("int4", "full", "int4"),
                              ("qr", "qr", "f32"), ("md", "md", "f32")):
        directory = root / "exports" / name
        if not (directory / "export.json").is_file():
            workdir = train_run(root, "synthetic", method, args.ratio, args.synthetic_steps, args.ml100k)
            export_run(load_run(workdir), directory, fmt, log=_log)
        out[name] = directory
    return out


def request_rows(directory: pathlib.Path, count: int = 512) -> list[dict]:
    """Encoded JSON rows of the synthetic test split (the exported run's data)."""
    from recjax.serving.export import load_run

    manifest = json.loads((directory / "export.json").read_text())
    run = load_run(manifest["source"]["workdir"])
    batch = next(run.dataset.eval_batches(count, "test"))
    return [{"dense": [float(v) for v in batch.dense[r]],
             "ids": {f: [int(i) for i in ids[r, :batch.lengths[f][r]]] for f, ids in batch.ids.items()}}
            for r in range(batch.size)]


def with_disk_tier(args, models: dict[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """`models` and, unless --disk_cache=0, the f32 export served with its tables on disk behind a RAM row cache of
    --disk_cache of each table's rows (recjax/serving/tiered.py), named "f32 disk <pct>%"."""
    if not args.disk_cache:
        return models
    return {**models, disk_name(args): models["f32"]}


def disk_name(args) -> str:
    return f"f32 disk {args.disk_cache * 100:g}%"


def server_options(args, name: str) -> dict[str, Any]:
    return {"tier": "disk", "cache": args.disk_cache} if args.disk_cache and name == disk_name(args) else {}


def measure_forward(args, models: dict[str, pathlib.Path], rows: list[dict]) -> dict[str, dict[int, float]]:
    from recjax.serving import loader
    from recjax.serving.measure import forward_times
    from recjax.serving.tiered import TieredServingModel

    out = {}
    for name, directory in models.items():
        disk = server_options(args, name)
        model = TieredServingModel(directory, disk["cache"]) if disk else loader.load(directory)
        times = forward_times(model, args.forward_sizes, rows)
        out[name] = times
        for size, seconds in times.items():
            _emit({"measurement": "forward", "model": name, "batch": size, "ms": seconds * 1e3,
                   "us_per_row": seconds * 1e6 / size})
        if disk:
            hits, lookups = model.cache_stats()
            _emit({"measurement": "cache_hit_ratio", "model": name, "where": "forward", "hits": hits,
                   "lookups": lookups, "ratio": hits / lookups})
    return out


def load_curve(args, directory: pathlib.Path, rows: list[dict], label: str, model: str, repeat: int = 0,
               **server: Any) -> list[dict]:
    from recjax.serving.measure import ServerProcess, latency_bounded_throughput, open_loop

    levels = []
    with ServerProcess(directory, batch_shapes="pow2", **server) as process:
        for k, rate in enumerate(args.rates):
            level = open_loop(process.url, rows, rate, args.seconds, args.max_requests, seed=k, settle=args.settle)
            if server.get("scheduler") == "adaptive":  # what it chose by the end of the level
                level.update(scheduler_state(process.url))
            levels.append(level)
            _emit({"measurement": "load", "model": model, "setting": label, "repeat": repeat, **server, **level})
            _log(f"{model} {label} @ {rate:g}/s: achieved {level['achieved_qps']:.0f}/s, p50 {level['p50_ms']:.2f} "
                 f"p99 {level['p99_ms']:.2f} ms, failed {level['failed']}")
            if level["p99_ms"] > 4 * max(args.targets) or level["achieved_qps"] < 0.7 * rate:
                break  # saturated: higher rates only queue
        if server.get("tier") == "disk":
            import urllib.request

            with urllib.request.urlopen(f"{process.url}/metrics") as answer:
                ratio = next(float(line.split()[-1]) for line in answer.read().decode().splitlines()
                             if line.startswith("recjax_serving_table_cache_hit_ratio"))
            _emit({"measurement": "cache_hit_ratio", "model": model, "where": "load", "ratio": ratio})
    for target in args.targets:
        _emit({"measurement": "latency_bounded_throughput", "model": model, "setting": label, "repeat": repeat,
               **server, "p99_target_ms": target, "qps": latency_bounded_throughput(levels, target)})
    return levels


def scheduler_state(url: str) -> dict[str, float]:
    """The batching in force, from the server's /metrics gauges."""
    import urllib.request

    names = {"recjax_serving_fill_rows": "chose_fill_rows", "recjax_serving_max_batch": "chose_max_batch",
             "recjax_serving_max_wait_seconds": "chose_max_wait_s",
             'recjax_serving_busy_share{thread="worker"}': "busy_worker", 'recjax_serving_busy_share{thread="loop"}':
             "busy_loop"}
    with urllib.request.urlopen(f"{url}/metrics") as answer:
        lines = answer.read().decode().splitlines()
    return {names[k]: float(v) for k, v in (line.split() for line in lines if line.split(" ")[0] in names)}


def measure_overhead(args, models: dict[str, pathlib.Path], rows: list[dict]) -> None:
    from recjax.serving import loader
    from recjax.serving.measure import ServerProcess, closed_loop, forward_times

    model = loader.load(models["f32"])
    before = forward_times(model, [1], rows, repeats=200)[1]
    with ServerProcess(models["f32"], batch_shapes="pow2", max_batch=1, max_wait_ms=0) as process:
        closed_loop(process.url, rows, 50)  # warm: connection, first requests
        served = closed_loop(process.url, rows, args.overhead_requests)
    after = forward_times(model, [1], rows, repeats=200)[1]
    forward_ms = 1e3 * (before + after) / 2
    _emit({"measurement": "overhead", "model": "f32", "max_batch": 1, **served,
           "forward_batch1_ms_before": 1e3 * before, "forward_batch1_ms_after": 1e3 * after,
           "client_overhead_p50_ms": served["client_p50_ms"] - forward_ms})
    _log(f"server overhead at p50: the client sees {served['client_p50_ms']:.3f} ms against a bare forward of "
         f"{forward_ms:.3f} ms (+{served['client_p50_ms'] - forward_ms:.3f} ms); the server's own time "
         f"{served['server_p50_ms']:.3f} ms, {served['server_minus_forward_p50_ms']:.3f} ms of it not the model call")


def measure_load(args, models: dict[str, pathlib.Path], rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    from recjax.serving.measure import latency_bounded_throughput

    curves = {}
    for name, directory in models.items():
        if args.models and name not in args.models:
            continue
        curves[(name, "fixed")] = load_curve(args, directory, rows, f"b{args.format_batch}_w{args.format_wait_ms:g}",
                                             name, max_batch=args.format_batch, max_wait_ms=args.format_wait_ms,
                                             **server_options(args, name))
    f32 = models["f32"]
    settings = {"no batching": dict(max_batch=1, max_wait_ms=0)}
    for setting in args.grid:
        batch, wait = setting.split("x")
        settings[f"grid b{batch}_w{wait}"] = dict(max_batch=int(batch), max_wait_ms=float(wait))
    cap = max((int(s.split("x")[0]) for s in args.grid), default=args.format_batch)
    for target in args.adaptive_targets:
        settings[f"adaptive p99<{target:g}ms"] = dict(max_batch=cap, scheduler="adaptive", p99_target_ms=target)
    # The scheduler against no batching and the grid, `--repeats` times, in alternating order (drift on a shared
    # machine falls on every setting alike); the best fixed setting is the grid's best *median*, not the luckiest
    # single curve of nine.
    lbt: dict[str, list[list[float]]] = {label: [] for label in settings}
    for repeat in range(args.repeats):
        order = list(settings) if repeat % 2 == 0 else list(reversed(settings))
        for label in order:
            levels = load_curve(args, f32, rows, label, "f32", repeat=repeat, **settings[label])
            curves[("f32", label)] = levels
            lbt[label].append([latency_bounded_throughput(levels, t) for t in args.targets])
    if args.repeats > 1:
        compare_over_repeats(args, lbt)
    return curves


def compare_over_repeats(args, lbt: dict[str, list[list[float]]]) -> None:
    """Per p99 target: each setting's median latency-bounded throughput over the repeats, and each adaptive run's
    against no batching, against the grid setting with the best median, and against the grid's pick measured on
    repeats it was not picked on (`held_out_grid_choice`)."""
    import numpy as np

    for j, target in enumerate(args.targets):
        median = {label: float(np.median([r[j] for r in runs])) for label, runs in lbt.items()}
        for label, runs in lbt.items():
            _emit({"measurement": "latency_bounded_throughput_over_repeats", "setting": label,
                   "p99_target_ms": target, "median_qps": median[label], "qps": [r[j] for r in runs]})
        grid = {label: m for label, m in median.items() if label.startswith("grid ")}
        best = max(grid, key=grid.get) if grid else None
        picks, held_out = held_out_grid_choice({label: [r[j] for r in runs] for label, runs in lbt.items()
                                                if label.startswith("grid ")})
        for label in (label for label in median if label.startswith("adaptive")):
            record = {"measurement": "scheduler_vs_fixed", "setting": label, "p99_target_ms": target,
                      "median_qps": median[label], "no_batching_median_qps": median["no batching"],
                      "vs_no_batching": median[label] / median["no batching"] if median["no batching"] else None}
            if best:
                mine = [r[j] for r in lbt[label]]
                held = float(np.median(held_out))
                record.update(best_grid=best, best_grid_median_qps=grid[best],
                              vs_best_grid=median[label] / grid[best] if grid[best] else None,
                              held_out_picks=picks, held_out_qps=held_out, held_out_median_qps=held,
                              vs_held_out=median[label] / held if held else None,
                              repeats_at_least_held_out=sum(a >= h for a, h in zip(mine, held_out, strict=True)))
            _emit(record)
            _log(f"p99 <= {target:g} ms: {label} median {median[label]:.0f}/s, no batching "
                 f"{median['no batching']:.0f}/s" + (f", best grid setting {best} {grid[best]:.0f}/s, the grid's "
                                                     f"pick on held-out repeats {np.median(held_out):.0f}/s"
                                                     if best else ""))


def held_out_grid_choice(qps: dict[str, list[float]]) -> tuple[list[str], list[float]]:
    """Leave one repeat out: per repeat, the grid setting whose median over the *other* repeats is best, and its
    figure in this repeat. The median of these is what the grid's choice delivers when deployed; the largest of the
    settings' medians on the same repeats is biased upward (the winner's curse of picking among noisy arms)."""
    import numpy as np

    n = len(next(iter(qps.values())))
    picks, figures = [], []
    for r in range(n):
        others = {label: float(np.median([v[k] for k in range(n) if k != r])) for label, v in qps.items()}
        pick = max(others, key=others.get)
        picks.append(pick)
        figures.append(qps[pick][r])
    return picks, figures


def plot(curves: dict[tuple[str, str], list[dict]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for (model, setting), levels in curves.items():
        ax = axes[0] if setting == "fixed" else axes[1] if model == "f32" else None
        if ax is None or (ax is axes[1] and setting == "fixed"):
            continue
        label = model if ax is axes[0] else setting
        ax.plot([lv["achieved_qps"] for lv in levels], [lv["p99_ms"] for lv in levels], marker="o", label=label)
    for ax, title in zip(axes, ("table formats / methods (one batching setting)", "f32: batching and scheduling"),
                         strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("achieved QPS")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("p99 latency (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _log(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(MEASUREMENTS))
    parser.add_argument("--root", default="runs/serving_bench", help="runs and exports (reused when present)")
    parser.add_argument("--datasets", default="synthetic,movielens")
    parser.add_argument("--methods", default="full,hashing,qr,md,tt,fiited")
    parser.add_argument("--formats", default="f32,fp16,bf16,int8,int4")
    parser.add_argument("--ratio", type=float, default=4.0)
    parser.add_argument("--synthetic_steps", type=int, default=2000)
    parser.add_argument("--dim", type=int, default=0, help="tables: the embedding dim of the runs (0: each config's; "
                                                           "row-wise int8 / int4 pay 8 bytes a row for scale and bias, "
                                                           "so their byte ratios grow with the dim)")
    parser.add_argument("--ml100k", default=str(pathlib.Path(SHARED) / "movielens_100k"))
    parser.add_argument("--forward_sizes", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--overhead_requests", type=int, default=1000)
    parser.add_argument("--rates", default="20,50,100,150,200,300,400,600,800,1200,1600,3200")
    parser.add_argument("--seconds", type=float, default=2.0, help="counted seconds per rate")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds of each rate sent before the counted ones (every setting alike)")
    parser.add_argument("--max_requests", type=int, default=4000)
    parser.add_argument("--format_batch", type=int, default=32)
    parser.add_argument("--format_wait_ms", type=float, default=1.0)
    parser.add_argument("--grid", default="8x0,32x0,128x0,8x1,32x1,128x1,8x4,32x4,128x4",
                        help="max_batch x max_wait_ms")
    parser.add_argument("--targets", default="10,20,50")
    parser.add_argument("--adaptive_targets", default="20", help="a scheduler run per p99 target (ms)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="load: run no batching, the grid and the scheduler this many times (alternating order) "
                             "and compare medians")
    parser.add_argument("--disk_cache", type=float, default=0.1,
                        help="also the f32 model with its tables on disk behind a RAM cache of this share of each "
                             "table's rows (0: not)")
    parser.add_argument("--models", default="", help="load: only these models' fixed-setting curves (names as in "
                                                     "the JSON lines, e.g. 'f32,f32 disk 10%%'; default all)")
    parser.add_argument("--drain_cases", default="300x256@1.0,1500x32@1.0,1500x32@3.0",
                        help="drain: REQUESTSxROWS@SECONDS per case (issue 43's cases)")
    parser.add_argument("--cpu_requests", type=int, default=5000, help="cpu: requests per measurement")
    parser.add_argument("--stalled", type=int, default=3000, help="stalled: connections that never send their body")
    parser.add_argument("--stalled_body_timeout", type=float, default=30.0,
                        help="stalled: the server's --body_timeout_seconds (30: its default)")
    parser.add_argument("--plot", default="benchmarks/serving.png")
    args = parser.parse_args()
    only = args.only.split(",")
    unknown = set(only) - set(MEASUREMENTS)
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {MEASUREMENTS}")
    for name in ("datasets", "methods", "formats", "grid", "models", "drain_cases"):
        setattr(args, name, [v for v in getattr(args, name).split(",") if v])
    args.forward_sizes = [int(v) for v in args.forward_sizes.split(",")]
    args.rates = [float(v) for v in args.rates.split(",")]
    args.targets = [float(v) for v in args.targets.split(",")]
    args.adaptive_targets = [float(v) for v in args.adaptive_targets.split(",") if v]
    root = pathlib.Path(args.root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    from recjax import cli

    cli.use_cpu_if_no_accelerator()
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        run(args, only, root)
    _log(f"done in {time.perf_counter() - start:.0f} s")


def run(args, only: list[str], root: pathlib.Path) -> None:
    if "tables" in only:
        measure_tables(args, root)
    if {"forward", "overhead", "load", "drain", "stalled", "cpu"} & set(only):
        models = with_disk_tier(args, exports(args, root))
        rows = request_rows(models["f32"])
        if "forward" in only:
            measure_forward(args, models, rows)
        if "overhead" in only:
            measure_overhead(args, models, rows)
        if "load" in only:
            curves = measure_load(args, models, rows)
            if args.plot:
                plot(curves, REPO / args.plot if not pathlib.Path(args.plot).is_absolute() else pathlib.Path(args.plot))
        if "drain" in only:
            measure_drain(args, models["f32"], rows)
        if "cpu" in only:
            measure_cpu(args, models["f32"], rows)
        if "stalled" in only:
            from recjax.serving.measure import ServerProcess, stalled_clients

            with ServerProcess(models["f32"], body_timeout_seconds=args.stalled_body_timeout) as process:
                record = stalled_clients(process, rows, args.stalled, guard_s=4 * args.stalled_body_timeout + 60)
            _emit({"measurement": "stalled", "model": "f32", "body_timeout_s": args.stalled_body_timeout, **record})
            _log(f"stalled: {record}")


def measure_cpu(args, directory: pathlib.Path, rows: list[dict]) -> None:
    from recjax.serving.measure import ServerProcess, cpu_per_request

    body = json.dumps({"rows": [rows[0]]}).encode()
    requests = {"healthz": b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n",
                "score": (b"POST /v1/score HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body)) + body}
    for repeat in range(args.repeats):
        with ServerProcess(directory, max_batch=1, max_wait_ms=0) as process:
            for path, request in requests.items():
                for new in (False, True):
                    us = cpu_per_request(process, request, args.cpu_requests, new)
                    _emit({"measurement": "cpu", "model": "f32", "repeat": repeat, "request": path,
                           "connection": "new" if new else "kept", "requests": args.cpu_requests,
                           "server_cpu_us_per_request": us})
                    _log(f"cpu: {path} on a {'new' if new else 'kept'} connection: {us:.0f} us of server CPU")


def measure_drain(args, directory: pathlib.Path, rows: list[dict]) -> None:
    from recjax.serving.measure import ServerProcess, drain_burst

    for case in args.drain_cases:
        size, _, after = case.partition("@")
        count, per_request = (int(v) for v in size.split("x"))
        with ServerProcess(directory, max_batch=args.format_batch, max_wait_ms=args.format_wait_ms) as process:
            record = drain_burst(process, rows, count, per_request, float(after))
        _emit({"measurement": "drain", "model": "f32", "max_batch": args.format_batch, **record})
        _log(f"drain {case}: {record['outcomes']}, exit {record['exit_status']}; {record['drain']}")


if __name__ == "__main__":
    main()
