r"""Checkpoint benchmark: bytes written and capacity of full vs Check-N-Run incremental (+ 4-bit rows, + 8-bit
optimizer rows) checkpoints at 0.1 %, 1 % and 10 % of the rows touched per interval with the bytes split into ids,
table rows and optimizer rows, the train loop's stall per save (sync vs async), the cost of the dirty-row bitmap on
step time, the AUC of models restored from quantized deltas (and of their training continued), and crash trials.

    python benchmarks/checkpoint.py                          # everything (~5-10 min on 2 shared cores)
    python benchmarks/checkpoint.py --only bytes,stall --rows 1000000
    python benchmarks/checkpoint.py --only bytes,stall --cpu_devices 8 --mesh data=4,model=2   # a mesh run's tables

Prints one JSON line per measurement to stdout (progress to stderr), each with its config and the machine.

Measurements
  bytes      a DLRM over 4 one-hot features of `rows / 4` ids each (dim 16, lazy Adam: table + m + v), trained on the
             synthetic stream with Zipf-distributed ids (exponent 1.05); the checkpoint interval (in steps) is
             calibrated so the bitmap really holds ~0.1 %, 1 % or 10 % of the rows when a save comes. Per policy
             (full; consecutive deltas; + 4-bit rows; + 8-bit optimizer rows) and fraction: the measured touched
             fraction, bytes per interval (the step directories' size on disk, the first baseline excluded) and their
             ratio to full, the logical bytes per interval split into ids / table rows / optimizer rows (from the
             arrays meta records) and their ratio to f32 deltas, and the capacity (the checkpoint dir's size with
             keep = 1 after `intervals` intervals, baseline included).
  bitmap     the compiled train step's time on the same device batches with the dirty-row bitmap (policy
             consecutive) vs without (full), alternating, medians.
  stall      how long the train loop waits per save of the `rows` model, synchronous (the whole write) vs async (the
             host copy + checksums; Orbax writes in the background), alternating, medians.
  quality    the default synthetic DLRM (`small` preset, lazy Adam) trained 3/5 of `--quality_steps` steps,
             checkpointed every 1/5 of the run with consecutive deltas per (row bits, optimizer bits) in QUALITY: the
             test AUC and logloss of the model restored from its last checkpoint (a delta: the table rows' loss;
             training itself is the same f32 run), and of a new run that restores it (`checkpoint.restore`) and
             trains to `--quality_steps` (where the optimizer rows' loss shows), each with its difference to f32
             (whose continuation is exactly the uninterrupted run); the deltas' logical bytes split as above.
  With --mesh, bytes / bitmap / stall train on that mesh (tables split by `sharding.plan=row`, every device's block
  saved where it lives); on a CPU machine --cpu_devices gives JAX that many devices.
  tiering    the same model with every table on the disk tier (a 10 % LRU cache, files in a temporary directory)
             against in memory, alternating, per repeat a fresh chain: the baseline's and the next delta's loop stall
             (the disk tier: its cache's dirty rows written back, then the rows read from the files) and time until
             written (save + wait), and the peak host memory the save allocates until written (`HostPeak`:
             tracemalloc, numpy arrays included); then the time and host peak of restoring that chain (baseline +
             delta) as a resume does (`Checkpointer.restore`, then `place_state`: the disk tier writes the rows to
             fresh table files); medians, and their disk / memory ratios. --block_mb sets the blocks a baseline
             writes the disk tier's tables in.
  crash      tests/crash_driver.py with `--crash_trials` SIGKILLs (mid-save and mid-steps): how many resumed from the
             newest complete checkpoint and ended bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MEASUREMENTS = ("bytes", "bitmap", "stall", "tiering", "quality", "crash")
FRACTIONS = (0.001, 0.01, 0.1)
MODES = {"full": dict(policy="full", quantize_bits=0, quantize_optimizer_bits=0),
         "incremental": dict(policy="consecutive", quantize_bits=0, quantize_optimizer_bits=0),
         "incremental_4bit": dict(policy="consecutive", quantize_bits=4, quantize_optimizer_bits=0),
         "incremental_4bit_opt8": dict(policy="consecutive", quantize_bits=4, quantize_optimizer_bits=8)}
# quality: (table row bits, optimizer row bits) of the deltas; 0 = f32.
QUALITY = {"f32": (0, 0), "rows8": (8, 0), "rows4": (4, 0), "rows2": (2, 0), "opt8": (0, 8), "rows8_opt8": (8, 8),
           "rows4_opt8": (4, 8)}


def _log(message: str) -> None:
    print(f"[checkpoint] {message}", file=sys.stderr, flush=True)


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def machine() -> dict[str, Any]:
    import jax
    import orbax.checkpoint as ocp

    return {"cpu_count": os.cpu_count(), "jax": jax.__version__, "orbax": ocp.__version__,
            "backend": jax.default_backend(), "load_average": os.getloadavg()[0]}


def du(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def byte_split(meta: dict) -> dict[str, int]:
    """A checkpoint's embedding bytes as written (before tensorstore's compression), from its meta's array records:
    "ids" (a delta's row ids), "table_rows" (f32 rows, or codes + offset + scale) and "optimizer_rows" (f32 rows, or
    codes + absmax)."""
    split = {"ids": 0, "table_rows": 0, "optimizer_rows": 0}
    for path, (dtype, shape, _) in meta["arrays"].items():
        item, *rest = path.split("/")
        nbytes = np.dtype(dtype).itemsize * int(np.prod(shape))
        if item == "rows":  # rows/<group>/ids | rows | codes | offset | scale | opt/<field>[/codes | /absmax]
            split["ids" if rest[1] == "ids" else "optimizer_rows" if rest[1] == "opt" else "table_rows"] += nbytes
        elif item == "state" and rest[0] in ("tables", "sparse_opt"):  # a baseline
            split["table_rows" if rest[0] == "tables" else "optimizer_rows"] += nbytes
    return split


MESH = ""  # --mesh: the mesh shape the bytes / bitmap / stall trainers use ("" = one device)


def table_config(rows: int, batch: int, **ckpt):
    """A small-MLP DLRM whose cost is its tables: 4 one-hot features of rows / 4 ids, dim 16, lazy Adam."""
    from experiments.configs.dlrm_synthetic import get_config

    config = get_config()
    if MESH:
        config.mesh.shape = MESH
        config.sharding.plan = "row"
    config.data.vocab_sizes = (rows // 4,) * 4
    config.data.zipf_exponent = 1.05
    config.data.eval_examples = 1024
    config.embedding.dim = 16
    config.model.dlrm.bottom_mlp = (16, 16)
    config.model.dlrm.top_mlp = (16, 1)
    config.train.batch_size = batch
    for key, value in ckpt.items():
        config.checkpoint[key] = value
    return config


class Trainer:
    """The trainer's pieces without its loop: a state, the compiled step and the synthetic stream (on a mesh when
    the config has one: the state laid out by its plan, the sharded step)."""

    def __init__(self, config):
        import jax

        from recjax import placement
        from recjax.data import make_dataset
        from recjax.step import init_state, make_train_step
        from recjax.task import build_task

        self.config = config
        self.dataset = make_dataset(config.data, seed=config.seed)
        self.task = build_task(config, self.dataset.spec, self.dataset, 100_000)
        self.stream = self.dataset.train_batches(config.train.batch_size)
        placed = placement.build(config, self.task)
        self.sharded = placed if placed.shards > 1 else None
        self.put = jax.device_put if self.sharded is None else self.sharded.put_batch
        self.state = init_state(self.task, jax.random.key(0), jax.device_put(next(self.stream)))
        if self.sharded is not None:
            self.state = self.sharded.place_state(self.state)
        self._steps = {}  # sharded steps by the state's bitmaps (their specs are part of the step)
        self._single = make_train_step(self.task) if self.sharded is None else None
        self._make_sharded = lambda state: make_train_step(self.task, self.sharded, state)
        self.step = 0

    def step_fn(self, state, batch):
        if self.sharded is None:
            return self._single(state, batch)
        key = tuple(sorted(state.dirty_rows))
        if key not in self._steps:
            self._steps[key] = self._make_sharded(state)
        return self._steps[key](state, batch)

    def train(self, steps: int) -> None:
        import jax

        from recjax.sharding.layout import MESH_STEPS_IN_FLIGHT

        in_flight = []
        for _ in range(steps):
            self.state, metrics = self.step_fn(self.state, self.put(next(self.stream)))
            self.step += 1
            in_flight.append(metrics["loss"])
            if self.sharded is not None and len(in_flight) > MESH_STEPS_IN_FLIGHT:  # see recjax/sharding/layout.py
                in_flight.pop(0).block_until_ready()
        jax.block_until_ready(self.state)

    def touched(self) -> float:
        return float(sum(np.asarray(d).sum() for d in self.state.dirty_rows.values())) / sum(
            d.shape[0] for d in self.state.dirty_rows.values())


def tracked(trainer: Trainer):
    """The trainer's state with dirty-row bitmaps as its config's policy wants (a throwaway checkpoint dir)."""
    from recjax.checkpoint import Checkpointer

    with tempfile.TemporaryDirectory() as directory:
        checkpointer = Checkpointer(trainer.config, pathlib.Path(directory))
        state = checkpointer.track(trainer.state)
        checkpointer.close()
    return state


def calibrate_interval(rows: int, batch: int, fraction: float) -> int:
    """Steps after which the bitmap holds >= `fraction` of the rows (the interval's length)."""

    trainer = Trainer(table_config(rows, batch, policy="consecutive"))
    trainer.state = tracked(trainer)
    steps = 0
    while trainer.touched() < fraction:
        trainer.train(1)
        steps += 1
    return steps


def bytes_measurement(rows: int, batch: int, intervals: int, info: dict) -> None:
    from recjax.checkpoint import Checkpointer

    for fraction in FRACTIONS:
        interval = calibrate_interval(rows, batch, fraction)
        results = {}
        for mode, ckpt in MODES.items():
            _log(f"bytes: {fraction:.1%} of {rows:,} rows touched per interval of {interval} steps, {mode}")
            workdir = pathlib.Path(tempfile.mkdtemp(prefix="ckpt_bench_"))
            trainer = Trainer(table_config(rows, batch, keep=1, async_save=False, **ckpt))
            checkpointer = Checkpointer(trainer.config, workdir)
            checkpointer.task = trainer.task
            trainer.state = checkpointer.track(trainer.state)
            checkpointer_steps, touched, sizes, logical, splits = [], [], [], [], []
            for i in range(intervals + 1):
                trainer.train(interval)
                if i:
                    touched.append(trainer.touched() if trainer.state.dirty_rows else float("nan"))
                trainer.state = checkpointer.save(trainer.step, trainer.state, {})
                checkpointer.wait()
                checkpointer_steps.append(trainer.step)
                if i:  # the first save is everyone's baseline
                    sizes.append(du(checkpointer.directory / str(trainer.step)))
                    meta = checkpointer.store.meta(trainer.step)
                    logical.append(meta["table_bytes"])
                    splits.append(byte_split(meta))
                    assert sum(splits[-1].values()) == meta["table_bytes"], (splits[-1], meta["table_bytes"])
            checkpointer.close()
            results[mode] = {"bytes_per_interval": statistics.mean(sizes), "capacity_bytes": du(
                checkpointer.directory), "table_bytes_per_interval": statistics.mean(logical),
                "split_per_interval": {k: statistics.mean(s[k] for s in splits) for k in splits[0]},
                "touched_fraction": statistics.mean(touched) if mode != "full" else None}
            shutil.rmtree(workdir, ignore_errors=True)
        touched = results["incremental"]["touched_fraction"]
        for mode, r in results.items():
            _emit({"measurement": "bytes", "mode": mode, "target_fraction": fraction, "touched_fraction": touched,
                   "interval_steps": interval, "intervals": intervals, **r,
                   "bytes_vs_full": r["bytes_per_interval"] / results["full"]["bytes_per_interval"],
                   "table_bytes_vs_full": r["table_bytes_per_interval"] / results["full"]["table_bytes_per_interval"],
                   "table_bytes_vs_incremental": (r["table_bytes_per_interval"]
                                                  / results["incremental"]["table_bytes_per_interval"]),
                   "capacity_vs_full": r["capacity_bytes"] / results["full"]["capacity_bytes"],
                   "config": {"rows": rows, "dim": 16, "batch": batch, "sparse": "lazy_adam", "zipf": 1.05,
                              "mesh": MESH},
                   "machine": info})


def bitmap_measurement(rows: int, batch: int, repeats: int, info: dict) -> None:
    """The jitted train step alone, on the same 50 device batches, with and without the bitmap."""
    import jax


    trainers = {}
    for name, policy in (("without_bitmap", "full"), ("with_bitmap", "consecutive")):
        trainer = Trainer(table_config(rows, batch, policy=policy))
        trainer.state = tracked(trainer)
        trainer.train(2)  # compile
        trainers[name] = trainer
    batches = [trainers["with_bitmap"].put(next(trainers["with_bitmap"].stream)) for _ in range(50)]
    times = {name: [] for name in trainers}
    for _ in range(repeats):
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            for b in batches:
                trainer.state, _ = trainer.step_fn(trainer.state, b)
            jax.block_until_ready(trainer.state)
            times[name].append((time.perf_counter() - t0) / len(batches) * 1e3)
    medians = {name: statistics.median(t) for name, t in times.items()}
    _emit({"measurement": "bitmap", **{f"{k}_step_ms": v for k, v in medians.items()},
           "overhead": medians["with_bitmap"] / medians["without_bitmap"] - 1, "repeats": repeats,
           "config": {"rows": rows, "dim": 16, "batch": batch, "sparse": "lazy_adam", "mesh": MESH}, "machine": info})


def stall_measurement(rows: int, batch: int, repeats: int, info: dict) -> None:
    from recjax.checkpoint import Checkpointer

    trainer = Trainer(table_config(rows, batch))
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="ckpt_bench_"))
    checkpointers = {mode: Checkpointer(table_config(rows, batch, keep=1, async_save=mode == "async"),
                                        workdir / mode) for mode in stalls}
    for checkpointer in checkpointers.values():
        checkpointer.task = trainer.task
    for _ in range(repeats):
        for mode, checkpointer in checkpointers.items():
            trainer.train(1)
            trainer.state = checkpointer.save(trainer.step, trainer.state, {})
            stalls[mode].append(checkpointer.save_stall_s[-1])
            checkpointer.wait()  # the next save must not wait for this one
    directory = checkpointers["sync"].directory
    size = du(directory / str(max(int(p.name) for p in directory.iterdir() if p.name.isdigit())))
    for checkpointer in checkpointers.values():
        checkpointer.close()
    shutil.rmtree(workdir, ignore_errors=True)
    medians = {mode: statistics.median(s) for mode, s in stalls.items()}
    _emit({"measurement": "stall", "sync_stall_s": medians["sync"], "async_stall_s": medians["async"],
           "async_vs_sync": medians["async"] / medians["sync"], "checkpoint_bytes": size, "repeats": repeats,
           "config": {"rows": rows, "dim": 16, "sparse": "lazy_adam", "policy": "full", "mesh": MESH},
           "machine": info})


class HostPeak:
    """The peak of host memory allocated while the block runs, over what was allocated on entry: Python objects and
    numpy arrays, on every thread (tracemalloc, which numpy reports its array buffers to; TensorStore's own C++
    buffers are not seen). Not RSS: the allocator keeps freed memory mapped, so RSS growth measures what earlier
    saves left behind rather than what this one holds."""

    def __enter__(self) -> HostPeak:
        import tracemalloc

        if not tracemalloc.is_tracing():
            tracemalloc.start()
        tracemalloc.reset_peak()
        self.start = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc) -> None:
        import tracemalloc

        self.growth = tracemalloc.get_traced_memory()[1] - self.start


def block_bytes(block_mb: float) -> int | None:
    """The disk tier's checkpoint block bytes, set to `block_mb` MiB if given (None: a recjax that writes the disk
    tier's tables whole, before recjax/checkpoint/streamed.py)."""
    try:
        from recjax.checkpoint import streamed
    except ImportError:
        return None
    if block_mb:
        streamed.BLOCK_BYTES = int(block_mb * 2**20)
    return streamed.BLOCK_BYTES


def tiering_measurement(rows: int, batch: int, repeats: int, steps: int, info: dict, block_mb: float = 0.0) -> None:
    import jax

    from recjax import placement
    from recjax.checkpoint import Checkpointer
    from recjax.data import make_dataset
    from recjax.step import init_state, make_train_step
    from recjax.task import build_task

    blocks = block_bytes(block_mb)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="ckpt_bench_tiering_"))
    arms = {}
    for arm in ("memory", "disk"):
        config = table_config(rows, batch, policy="consecutive", keep=1)
        if arm == "disk":
            config.tiering.default, config.tiering.cache_fraction = "disk", 0.1
            config.tiering.dir = str(workdir / "tables")
        dataset = make_dataset(config.data, seed=config.seed)
        task = build_task(config, dataset.spec, dataset, 100_000)
        backend = placement.build(config, task)
        stream = dataset.train_batches(batch)
        first = next(stream)
        state = backend.place_state(init_state(task, jax.random.key(0), first, backend))
        like = jax.eval_shape(lambda b, task=task: init_state(task, jax.random.key(0), b), first)  # one device's
        arms[arm] = {"config": config, "task": task, "backend": backend, "stream": stream, "state": state,
                     "like": like, "step": None, "at": 0,
                     "times": {k: [] for k in ("full_stall", "full_written", "delta_stall", "delta_written",
                                               "full_host_peak", "delta_host_peak", "restore", "restore_host_peak")}}
    for repeat in range(repeats):
        for arm, a in arms.items():
            checkpointer = Checkpointer(a["config"], workdir / arm / str(repeat))
            checkpointer.task, checkpointer.backend = a["task"], a["backend"]
            a["state"] = checkpointer.track(a["state"])
            if a["step"] is None:  # compiled for the tracked state (the bitmaps are part of it)
                a["step"] = make_train_step(a["task"], a["backend"], a["state"])
            for kind in ("full", "delta"):
                for _ in range(steps):
                    a["state"], _ = a["step"](a["state"], a["backend"].put_batch(next(a["stream"])))
                    a["at"] += 1
                jax.block_until_ready(a["state"])
                t0 = time.perf_counter()
                with HostPeak() as host:
                    a["state"] = checkpointer.save(a["at"], a["state"], {})
                    checkpointer.wait()
                a["times"][f"{kind}_written"].append(time.perf_counter() - t0)
                a["times"][f"{kind}_host_peak"].append(host.growth)
                a["times"][f"{kind}_stall"].append(checkpointer.save_stall_s[-1])
                assert checkpointer.store.meta(a["at"])["kind"] == kind
            # Restore the chain just written (baseline + delta) as a resume does, and train on from it.
            t0 = time.perf_counter()
            with HostPeak() as host:
                restored, _ = checkpointer.restore(checkpointer.resume_point(), a["like"])
                a["state"] = jax.block_until_ready(a["backend"].place_state(restored))
                del restored
            a["times"]["restore"].append(time.perf_counter() - t0)
            a["times"]["restore_host_peak"].append(host.growth)
            checkpointer.close()
            shutil.rmtree(workdir / arm / str(repeat), ignore_errors=True)
    medians = {arm: {k: statistics.median(v) for k, v in a["times"].items()} for arm, a in arms.items()}
    for a in arms.values():
        a["backend"].close()
    shutil.rmtree(workdir, ignore_errors=True)
    state_bytes = sum(arms["memory"]["backend"].memory_bytes(arms["memory"]["task"].sparse_optimizer))
    _emit({"measurement": "tiering", **{f"{arm}_{k}" + ("_bytes" if k.endswith("host_peak") else "_s"): v
                                        for arm, m in medians.items() for k, v in m.items()},
           "table_state_bytes": state_bytes,
           **{f"disk_vs_memory_{k}": medians["disk"][k] / medians["memory"][k] for k in medians["disk"]},
           "repeats": repeats, "steps_between_saves": steps,
           "config": {"rows": rows, "dim": 16, "sparse": "lazy_adam", "policy": "consecutive", "async_save": True,
                      "disk": "every table, cache_fraction 0.1 (lru)", "block_bytes": blocks},
           "machine": info})


def quality_measurement(steps: int, info: dict) -> None:
    import jax

    from experiments.configs.dlrm_synthetic import get_config
    from recjax import checkpoint
    from recjax.data import make_dataset
    from recjax.evaluation import evaluate
    from recjax.step import init_state, make_predict_step
    from recjax.task import build_task
    from recjax.train import train_and_evaluate

    restore_at, every = 3 * steps // 5, steps // 5

    def run(workdir: pathlib.Path, train_steps: int, **ckpt) -> dict:
        config = get_config()
        config.train.steps = train_steps
        config.train.eval_every = train_steps  # one evaluation, at the end
        config.train.progress_bar = False
        for key, value in ckpt.items():
            config.checkpoint[key] = value
        with contextlib.redirect_stdout(sys.stderr):  # the run's console lines are progress, not measurements
            summary = train_and_evaluate(config, workdir)
        return {"config": config, "summary": summary}

    results = {}
    for name, (bits, optimizer_bits) in QUALITY.items():
        _log(f"quality: {name}, {restore_at} steps, then restored and trained to {steps}")
        root = pathlib.Path(tempfile.mkdtemp(prefix="ckpt_quality_"))
        first = run(root / "first", restore_at, policy="consecutive", quantize_bits=bits,
                    quantize_optimizer_bits=optimizer_bits, every_steps=every, keep=10)
        config = first["config"]
        dataset = make_dataset(config.data, seed=config.seed)
        task = build_task(config, dataset.spec, dataset, restore_at)
        batch = jax.device_put(next(dataset.train_batches(config.train.batch_size)))
        like = jax.eval_shape(lambda b, task=task: init_state(task, jax.random.key(0), b), batch)
        point = checkpoint.open_checkpoint(root / "first" / "checkpoints")
        state = checkpoint.restore_state(
            point, like, record=checkpoint.table_record(task.collection, task.sparse_optimizer, like))
        restored = evaluate(task, make_predict_step(task), state, dataset, config.train.batch_size, "test")
        deltas = [point.store.meta(s) for s in point.meta["chain"][1:]]
        continued = run(root / "continued", steps, restore=str(root / "first" / "checkpoints"), every_minutes=0.0)
        results[name] = {
            "quantize_bits": bits, "quantize_optimizer_bits": optimizer_bits,
            "delta_bytes": statistics.mean(m["table_bytes"] for m in deltas),
            "delta_split": {k: statistics.mean(byte_split(m)[k] for m in deltas) for k in byte_split(deltas[0])},
            "delta_bytes_on_disk": statistics.mean(du(root / "first" / "checkpoints" / str(m["step"])) for m in deltas),
            "restored_auc": restored["auc"], "restored_logloss": restored["logloss"],
            "continued_auc": continued["summary"]["auc"], "continued_logloss": continued["summary"]["logloss"]}
        shutil.rmtree(root, ignore_errors=True)
    f32 = results["f32"]
    for name, r in results.items():
        _emit({"measurement": "quality", "name": name, **r,
               "delta_bytes_vs_f32": r["delta_bytes"] / f32["delta_bytes"],
               "restored_auc_minus_f32": r["restored_auc"] - f32["restored_auc"],
               "continued_auc_minus_f32": r["continued_auc"] - f32["continued_auc"],
               "continued_logloss_minus_f32": r["continued_logloss"] - f32["continued_logloss"],
               "config": {"preset": "small", "sparse": "lazy_adam", "steps": steps, "restored_at": restore_at,
                          "policy": "consecutive", "every_steps": every},
               "machine": info})


def crash_measurement(trials: int, info: dict) -> None:
    workdir = tempfile.mkdtemp(prefix="ckpt_crash_")
    result = subprocess.run([sys.executable, str(REPO / "tests" / "crash_driver.py"), f"--workdir={workdir}",
                             f"--trials={trials}", "--seed=1"], capture_output=True, text=True, cwd=REPO)
    shutil.rmtree(workdir, ignore_errors=True)
    if result.returncode:
        raise RuntimeError(f"crash driver failed: {result.stderr[-2000:]}")
    total = json.loads(result.stdout.strip().splitlines()[-1])
    _emit({"measurement": "crash", **total, "machine": info})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(MEASUREMENTS), help=f"comma-separated, from {MEASUREMENTS}")
    parser.add_argument("--rows", type=int, default=1_000_000, help="table rows in all (4 features) for bytes/stall")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--intervals", type=int, default=4, help="checkpoint intervals after the baseline")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quality_steps", type=int, default=3000)
    parser.add_argument("--crash_trials", type=int, default=30)
    parser.add_argument("--mesh", default="", help="bytes / bitmap / stall on this mesh, e.g. data=4,model=2")
    parser.add_argument("--cpu_devices", type=int, default=0, help="give JAX this many CPU devices (before it starts)")
    parser.add_argument("--block_mb", type=float, default=0.0,
                        help="tiering: the disk tier's checkpoint blocks in MiB (0: the library's BLOCK_BYTES)")
    args = parser.parse_args(argv)
    if args.cpu_devices:
        import jax

        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    global MESH
    MESH = args.mesh
    only = {m.strip() for m in args.only.split(",") if m.strip()}
    if only - set(MEASUREMENTS):
        parser.error(f"unknown measurements {sorted(only - set(MEASUREMENTS))}; use {MEASUREMENTS}")
    info = machine()
    if "bytes" in only:
        bytes_measurement(args.rows, args.batch, args.intervals, info)
    if "bitmap" in only:
        _log("bitmap")
        bitmap_measurement(args.rows, args.batch, args.repeats, info)
    if "stall" in only:
        _log("stall")
        stall_measurement(args.rows, args.batch, args.repeats, info)
    if "tiering" in only:
        _log("tiering")
        tiering_measurement(args.rows, args.batch, args.repeats, 10, info, args.block_mb)
    if "quality" in only:
        quality_measurement(args.quality_steps, info)
    if "crash" in only:
        _log(f"crash: {args.crash_trials} kills")
        crash_measurement(args.crash_trials, info)
    return 0


if __name__ == "__main__":
    from recjax import cli

    cli.tune_malloc()  # as the launcher does, so the benchmark measures what a run gets
    cli.use_cpu_if_no_accelerator()
    with cli.user_errors():
        sys.exit(main())
