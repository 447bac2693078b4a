r"""Loop benchmark: how much of the compiled step's speed the training loop delivers (issue 38).

    python benchmarks/loop.py                                   # both shapes, the steps_per_call sweep (~6 min, 2 CPUs)
    python benchmarks/loop.py --only default --steps 600 --steps-per-call 1,4
    python benchmarks/loop.py --accelerator                     # on one GPU / TPU: under 4 minutes, exits 0

Prints one JSON line per measurement to stdout (progress to stderr). Each (shape, steps_per_call) runs in a fresh
child process, and everything on one line comes from that one process: the bare step and the loop see the same
config, data, compiled executable kind and machine load.

Shapes
  default          experiments/configs/dlrm_synthetic.py as `python -m experiments.train` runs it: the synthetic
                   Criteo-like data, batch 512, checkpoints and the progress bar on; `--steps` steps, validation only
                   at the last step.
  kaggle_prepared  experiments/configs/dlrm_criteo_kaggle.py (the Kaggle model shape: dim 16, bottom 13-512-256-64-16,
                   top 512-256-1, SGD; batch `--kaggle-batch`) on a Criteo-format train.txt of `--rows` lines made by
                   benchmarks/data.py's generator (Zipf 1.05 over 100k raw keys per feature), prepared once by the TFDS
                   builder into array_record blocks and read through the prepared-data pipeline (Grain).

Fields
  step_examples_per_sec  the bare compiled one-step executable on pre-made device batches (the run's own first 16
                         batches, validated and on the device before timing), dispatched back to back and waited for
                         once at the end: what the device does with no loop around it. Timed before the first main job
                         and after each; a main job is compared with the mean of the two around it.
  loop_examples_per_sec  `train_and_evaluate`'s summary.json examples_per_sec: the main job's loop (its train time
                         excludes compiles, evaluations and checkpoint stalls, as the summary always has).
  loop_efficiency        loop / step (with --repeats: the median of the repeats' ratios; `*_each` lists them). Above 1
                         when k steps per call save dispatches the bare one-step loop pays.
  loop_cpu_efficiency    the same per CPU-second of the process (the main job's CPU time over its train windows,
                         summary.json loop.cpu_s, against the bare steps'): on a shared CPU machine the other work's
                         load moves it far less than wall time. Where the host's work competes with the step's for
                         the same cores, it is what the loop costs.
  scan_examples_per_sec  (steps_per_call > 1) the compiled k-step executable on pre-made stacked device batches.
  host_us_per_step       each host cost of one step measured alone, in microseconds: `produce` (the dataset's next
                         train batch), `validate` (`validate_batch`), `transfer` (`put_batch` and wait), `dispatch`
                         (returning from the compiled call, not waiting; per step), `sync` (reading a finished loss);
                         for the synthetic data, `device_make` (its batch made on the device, waited for) and
                         `device_make_in_blocks` (per batch of a block of 16). On a CPU these compete with the step
                         for the same cores.
  loop                   (when the trainer reports it) where the loop's train time went: waiting for input, dispatching
                         calls, host syncs at log points, and the rest (device work the loop waited for).
"""

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

SHAPES = ("default", "kaggle_prepared")
_PREMADE = 16  # distinct pre-made device batches the bare step cycles through


def _log(message: str) -> None:
    print(f"[loop] {message}", file=sys.stderr, flush=True)


def _criteo_generator():
    """benchmarks/data.py as a module (its Criteo-format line generator)."""
    spec = importlib.util.spec_from_file_location("recjax_bench_data", _REPO_ROOT / "benchmarks" / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine_info() -> dict[str, Any]:
    import jax

    info = {"cpu_count": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
            "loadavg_1min": os.getloadavg()[0]}
    return info


# ---------------------------------------------------------------------------------------------- one child
def _config(shape: str, args, workdir: pathlib.Path):
    if shape == "default":
        from experiments.configs.dlrm_synthetic import get_config

        config = get_config()
    else:
        from experiments.configs.dlrm_criteo_kaggle import get_config

        config = get_config()
        config.data.dir = str(args.data_dir)
        config.data.prepared_dir = str(args.data_dir / "prepared")
        config.train.epochs = None
        config.train.batch_size = args.kaggle_batch
        config.train.early_stopping_patience = 0
        config.train.log_every = 100
    config.train.steps = args.steps
    config.train.eval_every = args.steps  # validation (and test) once, at the end: not train time either way
    config.checkpoint.dir = str(workdir / "checkpoints")
    if args.input_workers is not None:
        config.train.input_workers = args.input_workers
    return config


def _bare_step(compiled, state, batches, steps: int):
    """(seconds of `steps` back-to-back calls, the median seconds to dispatch one call to an idle device, the final
    state and metrics). Back to back, a call returns once the runtime has room to queue it, so the dispatch cost
    is timed apart: each of a few calls issued after the previous one finished."""
    import jax

    state, metrics = compiled(state, batches[0])  # warm: allocations, thread pools
    jax.block_until_ready((state, metrics))
    dispatch = []
    for i in range(9):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batches[i % len(batches)])
        dispatch.append(time.perf_counter() - t0)
        jax.block_until_ready((state, metrics))
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(steps):
        state, metrics = compiled(state, batches[i % len(batches)])
    jax.block_until_ready((state, metrics))
    _bare_step.cpu_s = time.process_time() - cpu  # the process's CPU seconds (every thread's) for the steps
    return time.perf_counter() - start, statistics.median(dispatch), state, metrics


def measure(shape: str, args) -> list[dict[str, Any]]:
    """One line per steps_per_call in `args.steps_per_call` (None: the config's default), all from this process: the
    bare step timed before the first main job and after each, each line against the mean of the two around it."""
    import jax
    import numpy as np

    from recjax.batch import validate_batch
    from recjax.data import make_dataset
    from recjax.evaluation import resolve_budget
    from recjax.placement.embedding import one_device
    from recjax.step import init_state, make_train_step
    from recjax.task import build_task
    from recjax.train import train_and_evaluate

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="recjax_loop_"))
    config = _config(shape, args, workdir)
    with contextlib.redirect_stdout(sys.stderr):
        dataset = make_dataset(config.data, seed=config.seed)
    budget = resolve_budget(config.train, dataset)
    batch_size = budget.batch_size
    task = build_task(config, dataset.spec, dataset, budget.steps)
    backend = one_device(task.collection)
    validate = lambda b: validate_batch(b, task.spec, any_id=task.collection.any_id_features)  # noqa: E731

    # Host costs of one step, each alone.
    stream = dataset.train_batches(batch_size)
    host_batches = [next(stream)]  # the first starts a reader's threads
    t0 = time.perf_counter()
    for _ in range(_PREMADE * 2 - 1):
        host_batches.append(next(stream))
    produce = (time.perf_counter() - t0) / (_PREMADE * 2 - 1)
    t0 = time.perf_counter()
    for b in host_batches:
        validate(b)
    validate_s = (time.perf_counter() - t0) / len(host_batches)
    jax.block_until_ready(backend.put_batch(host_batches[0]))
    t0 = time.perf_counter()
    for b in host_batches:
        jax.block_until_ready(backend.put_batch(b))
    transfer = (time.perf_counter() - t0) / len(host_batches)
    device_batches = [backend.put_batch(b) for b in host_batches[:_PREMADE]]
    host_us = {"produce": 1e6 * produce, "validate": 1e6 * validate_s, "transfer": 1e6 * transfer}
    if hasattr(dataset, "device_batches"):  # made on the device instead: one batch, then a block of 16, waited for
        jax.block_until_ready(dataset.device_batches(batch_size, 0))
        t0 = time.perf_counter()
        for i in range(_PREMADE):
            made = dataset.device_batches(batch_size, i)
        jax.block_until_ready(made)
        host_us["device_make"] = 1e6 * (time.perf_counter() - t0) / _PREMADE
        jax.block_until_ready(dataset.device_batches(batch_size, 0, _PREMADE))
        t0 = time.perf_counter()
        jax.block_until_ready(dataset.device_batches(batch_size, _PREMADE, _PREMADE))
        host_us["device_make_in_blocks"] = 1e6 * (time.perf_counter() - t0) / _PREMADE

    steps = args.bare_steps

    def bare():
        state = init_state(task, jax.random.key(config.seed), device_batches[0])
        compiled = make_train_step(task, backend, state).lower(state, device_batches[0]).compile()
        elapsed, dispatch, state, metrics = _bare_step(compiled, state, device_batches, steps)
        cpu = _bare_step.cpu_s
        t0 = time.perf_counter()
        for _ in range(20):
            float(metrics["loss"])
        return steps * batch_size / elapsed, dispatch, (time.perf_counter() - t0) / 20, steps * batch_size / cpu

    before, dispatch, sync, before_cpu = bare()
    host_us.update({"dispatch": 1e6 * dispatch, "sync": 1e6 * sync})
    ks = args.steps_per_call or [None]
    runs: dict = {k: [] for k in ks}
    scans: dict = {}
    for repeat in range(args.repeats):
        for k in ks:  # interleaved, so a change of the machine's load falls on every k alike
            run_config = _config(shape, args, workdir / f"k{k}_{repeat}")
            if k is not None:
                run_config.train.steps_per_call = k
            if k and k > 1 and k not in scans:  # the k-step executable on pre-made stacked batches
                stacked = [backend.put_batch(jax.tree.map(lambda *xs: np.stack(xs), *host_batches[i: i + k]),
                                             stacked=True)
                           for i in range(0, len(host_batches) - k + 1, k)]
                state = init_state(task, jax.random.key(config.seed), device_batches[0])
                scan = make_train_step(task, backend, state, steps_per_call=k).lower(state, stacked[0]).compile()
                calls = max(1, steps // k)
                elapsed, scan_dispatch, state, _ = _bare_step(scan, state, stacked, calls)
                scans[k] = {"scan_examples_per_sec": calls * k * batch_size / elapsed,
                            "scan_dispatch_us_per_step": 1e6 * scan_dispatch / k}
                del state, scan
            # The main job, as the launcher runs it.
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(sys.stderr):
                summary = train_and_evaluate(run_config, workdir / f"k{k}_{repeat}" / "run")
            run_wall = time.perf_counter() - t0
            after, _, _, after_cpu = bare()
            loop_cpu = (summary["steps"] * batch_size / summary["loop"]["cpu_s"]
                        if summary.get("loop", {}).get("cpu_s") else None)
            runs[k].append({"loop": summary["examples_per_sec"], "before": before, "after": after,
                            "loop_cpu": loop_cpu, "step_cpu": (before_cpu + after_cpu) / 2,
                            "summary": summary, "wall": run_wall})
            before, before_cpu = after, after_cpu
    records = []
    for k in ks:
        done = runs[k]
        summary = done[-1]["summary"]
        steps_eps = [(r["before"] + r["after"]) / 2 for r in done]
        loops = [r["loop"] for r in done]
        record: dict[str, Any] = {
            "name": f"loop_{shape}", "shape": shape, "batch_size": batch_size, "steps": args.steps,
            "input_workers": int(config.train.get("input_workers", 1)),
            "bare_steps": steps, "repeats": len(done),
            "steps_per_call": summary.get("loop", {}).get("steps_per_call", 1),
            # Medians over the repeats; each repeat's loop against the bare step timed right before and after it.
            "step_examples_per_sec": statistics.median(steps_eps),
            "loop_examples_per_sec": statistics.median(loops),
            "loop_efficiency": statistics.median(lp / st for lp, st in zip(loops, steps_eps, strict=True)),
            "loop_efficiencies": [lp / st for lp, st in zip(loops, steps_eps, strict=True)],
            "step_examples_per_sec_each": steps_eps,
            "loop_examples_per_sec_each": loops,
            # Per CPU-second of the whole process (every thread), which the machine's other load changes far less
            # than wall time: what the loop costs beside the step, on a CPU where both share the cores.
            "step_examples_per_cpu_sec": statistics.median(r["step_cpu"] for r in done),
            **({"loop_examples_per_cpu_sec": statistics.median(r["loop_cpu"] for r in done),
                "loop_cpu_efficiency": statistics.median(r["loop_cpu"] / r["step_cpu"] for r in done),
                "loop_cpu_efficiencies": [r["loop_cpu"] / r["step_cpu"] for r in done]}
               if all(r["loop_cpu"] for r in done) else {}),
            "host_us_per_step": host_us,
            "train_time_s": summary["train_time_s"],
            "run_wall_time_s": done[-1]["wall"],
            "compile_time_s": summary["compile_time_s"],
            "test_auc": summary["auc"],
            **scans.get(k, {}),
        }
        if k in scans:
            record["loop_vs_scan"] = record["loop_examples_per_sec"] / scans[k]["scan_examples_per_sec"]
        if "loop" in summary:
            record["loop"] = summary["loop"]
        record["machine"] = machine_info()
        records.append(record)
        print(json.dumps(record), flush=True)
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)
    return records


# ---------------------------------------------------------------------------------------------- driver
def _prepare_criteo(args) -> None:
    """A generated Criteo train.txt in args.data_dir (once; reused while its size matches)."""
    path = args.data_dir / "train.txt"
    marker = args.data_dir / f"rows_{args.rows}"
    if path.exists() and marker.exists():
        return
    args.data_dir.mkdir(parents=True, exist_ok=True)
    _log(f"generating {args.rows:,} Criteo-format lines in {path}")
    _criteo_generator().generate_file(path, args.rows)
    marker.write_text("")


def _child(shape: str, sweep: str | None, args) -> list[dict[str, Any]]:
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--single", shape, "--steps", str(args.steps),
           "--bare-steps", str(args.bare_steps), "--data-dir", str(args.data_dir),
           "--kaggle-batch", str(args.kaggle_batch), "--repeats", str(args.repeats)]
    if args.input_workers is not None:
        cmd += ["--input-workers", str(args.input_workers)]
    if sweep is not None:
        cmd += ["--steps-per-call", sweep]
    _log(f"{shape}, steps_per_call {sweep or 'default'} ...")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=_REPO_ROOT)
    records = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not records:
        records.append({"name": f"loop_{shape}", "steps_per_call": sweep, "error": f"child exited {proc.returncode}",
                        "stderr_tail": proc.stderr[-3000:]})
    for record in records:
        record["child_wall_time_s"] = time.perf_counter() - t0
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SHAPES), help=f"comma-separated shapes from {', '.join(SHAPES)}")
    parser.add_argument("--steps", type=int, default=None, help="train steps of each run (default 600; 2000 with "
                                                                "--accelerator)")
    parser.add_argument("--bare-steps", type=int, default=None, help="timed bare steps (default 200; 1000 with "
                                                                     "--accelerator)")
    parser.add_argument("--steps-per-call", default=None,
                        help="comma-separated train.steps_per_call values to sweep (default: the config's default "
                             "only; '1,4,16' for the sweep)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="main jobs per steps_per_call, interleaved (each against the bare step around it; the "
                             "line reports medians): on a shared machine the load changes between runs")
    parser.add_argument("--input-workers", type=int, default=None,
                        help="train.input_workers of the main jobs (default: the config's)")
    parser.add_argument("--rows", type=int, default=300_000, help="lines of the generated Criteo train.txt")
    parser.add_argument("--kaggle-batch", type=int, default=None,
                        help="batch size of kaggle_prepared (default 128, the config's; 2048 with --accelerator)")
    parser.add_argument("--data-dir", type=pathlib.Path, default=None,
                        help="where the generated train.txt and its prepared blocks go (default: a temp dir, removed)")
    parser.add_argument("--accelerator", action="store_true",
                        help="the GPU / TPU check: more steps, steps_per_call 1,8,32, under 4 minutes")
    parser.add_argument("--single", default=None, help=argparse.SUPPRESS)  # internal: one measurement here
    args = parser.parse_args(argv)
    args.steps = args.steps or (2000 if args.accelerator else 600)
    args.bare_steps = args.bare_steps or (1000 if args.accelerator else 200)
    args.kaggle_batch = args.kaggle_batch or (2048 if args.accelerator else 128)

    if args.single is not None:
        args.steps_per_call = None if args.steps_per_call is None else [int(k) for k in args.steps_per_call.split(",")]
        measure(args.single, args)  # prints its lines as they come
        return 0

    shapes = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    sweep = args.steps_per_call or ("1,32" if args.accelerator else None)
    cleanup = args.data_dir is None
    args.data_dir = args.data_dir or pathlib.Path(tempfile.mkdtemp(prefix="recjax_loop_data_"))
    failed = False
    start = time.perf_counter()
    try:
        if "kaggle_prepared" in shapes:
            _prepare_criteo(args)
        for shape in shapes:
            for record in _child(shape, sweep, args):
                failed |= "error" in record
                print(json.dumps(record), flush=True)
    finally:
        if cleanup:
            import shutil

            shutil.rmtree(args.data_dir, ignore_errors=True)
    _log(f"total wall time {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    from recjax import cli

    cli.tune_malloc()  # as the launcher does, so the loop measured is the one a run gets
    cli.use_cpu_if_no_accelerator()
    sys.exit(main())
