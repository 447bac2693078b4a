"""What stops a run before it goes wrong, or once it has: a workdir that cannot be written, a model too big for
memory (checked before any table is made), a diverging train loss (checked at log points), and Ctrl-C (stop after
the current step and checkpoint it)."""

import dataclasses
import math
import os
import pathlib
import signal
import threading

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from recjax.checkpoint import Checkpointer
from recjax.embedding_backend import EmbeddingBackend
from recjax.errors import ConfigError, Interrupted
from recjax.sections import read_sections
from recjax.task import Task
from recjax.validation import MISSING, find


@dataclasses.dataclass
class Divergence:
    """Whether the train loss diverged, from the mean loss of each log window (fetched at log points only, so no step
    waits for the device).

    Diverged: a non-finite loss, or a window mean above `factor` times the lowest so far (step 1's loss -- the untrained
    model's -- and every window mean) *and* above step 1's loss. The second condition keeps a low-loss
    model's noisy windows (few positives in a window, a FIITED adjustment, a warmup's rise) from counting: a run
    counts as diverged only once it is worse than it was untrained. factor 0: only a non-finite loss counts.
    """

    factor: float
    initial: float | None = None  # step 1's loss
    lowest: float | None = None  # the lowest of step 1's loss and every window mean so far

    def start(self, first_loss: float) -> None:
        if self.initial is None and math.isfinite(first_loss):
            self.initial = self.lowest = first_loss

    def check(self, mean: float, span: str = "the last log window") -> str | None:
        """Note a log window's mean train loss (`span`: its steps); why the run diverged, or None."""
        if not math.isfinite(mean):
            return f"the train loss is {mean} (mean of {span})"
        if self.factor and self.initial is not None and mean > self.factor * self.lowest and mean > self.initial:
            return (f"the train loss {mean:.4g} (mean of {span}) is above step 1's {self.initial:.4g} "
                    f"and {mean / self.lowest:.3g}x its lowest so far, {self.lowest:.4g} (train.divergence_factor "
                    f"{self.factor:g})")
        self.lowest = mean if self.lowest is None else min(self.lowest, mean)
        return None


def _largest_values(tree) -> float:
    """max |x| over the arrays of `tree` (nan if any is nan)."""
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if np.size(x)]
    return max((float(jnp.max(jnp.abs(x))) for x in leaves), default=0.0, key=lambda v: (math.isnan(v), v))


def divergence_advice(config: ml_collections.ConfigDict, state) -> str:
    """Which learning rates to lower: both, the one whose parameters reached the larger values first."""
    optimizer = config.optimizer
    parts = [(_largest_values(state.tables), "optimizer.sparse.learning_rate", optimizer.sparse.learning_rate,
              "embedding rows"),
             (_largest_values(state.dense_params), "optimizer.dense.learning_rate", optimizer.dense.learning_rate,
              "dense weights")]
    parts.sort(key=lambda p: (math.isnan(p[0]), p[0]), reverse=True)
    rates = " and ".join(f"{key} ({lr:g}; its {what} reach |{value:.3g}|)" for value, key, lr, what in parts)
    return f"lower the learning rates: {rates}; or warm up longer (optimizer.warmup_steps {optimizer.warmup_steps})"


MEMINFO = pathlib.Path("/proc/meminfo")
# What a run holds at its peak besides one copy of its tables and optimizer state ("the state"): benchmarks/memory.py
# measures it (peak RSS growth of a run over its state; the figures are in benchmarks/RESULTS.md, "Memory"), and
# these are those figures rounded up. Checkpoint saves, in multiples of the state: an async save's host copies (kept
# from save to save) and Orbax's write buffers; a synchronous save's (multi-process saves are synchronous).
CHECKPOINT_MEMORY = {"async": 2.5, "sync": 1.5}
MEMORY_MARGIN = 0.05  # per byte of state: the step's temporaries, the dense model
MEMORY_MARGIN_BYTES = 512 << 20  # whatever the size: the compiled steps, the data, the libraries


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo: what the kernel can hand out without swapping (None where there is none)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_memory(config: ml_collections.ConfigDict, task: Task, backend: EmbeddingBackend) -> None:
    """Before anything is allocated: a ConfigError if the embedding tables and their optimizer state
    (`EmbeddingCollection.accounting`: "the state") cannot fit, naming the largest tables and the keys that shrink
    them -- instead of XLA's RESOURCE_EXHAUSTED traceback (or swapping) once the tables are made.

    The state is counted where it lives (`backend.memory_bytes`): in device memory (tables on the device, a disk
    tier's caches) and in host memory (tables in host memory, a disk tier's host-tier rows in RAM); a disk tier's
    files count in neither. CPU, where both are the host's RAM: this process's state (a mesh: its devices' blocks)
    x (1 + MEMORY_MARGIN), plus what checkpoint saves hold (CHECKPOINT_MEMORY), plus MEMORY_MARGIN_BYTES, against
    the host's MemAvailable. GPU / TPU: the device state x (1 + MEMORY_MARGIN) against the device's free memory (one
    device; a mesh's devices are checked by the sharding plan), and the host state x (1 + MEMORY_MARGIN) with the
    checkpoint saves' buffers against the host's. `train.check_memory=False` skips it."""
    sections = read_sections(config)
    if not sections.train.check_memory:
        return
    accounting = task.collection.accounting(task.sparse_optimizer)
    memory = backend.memory_bytes(task.sparse_optimizer)
    checkpoint = sections.checkpoint
    saves = "none" if not checkpoint.enabled else (
        "async" if checkpoint.async_save and jax.process_count() == 1 else "sync")
    saved_bytes = backend.checkpoint_bytes(task.sparse_optimizer)  # a disk tier's: blocks of its tables
    saving = saved_bytes * CHECKPOINT_MEMORY.get(saves, 0.0)
    device = jax.local_devices()[0]
    needs = []  # (bytes needed, bytes available, where, the state's bytes in it, checkpoint saves in it)
    host = host_available_bytes()
    if device.platform == "cpu":
        state = memory.device + memory.host  # one RAM
        if host is not None:
            needs.append((state * (1 + MEMORY_MARGIN) + saving + MEMORY_MARGIN_BYTES, host,
                          "host memory (MemAvailable in /proc/meminfo)", None, saving))
    else:
        stats = device.memory_stats() or {}
        if backend.shards == 1 and "bytes_limit" in stats:
            needs.append((memory.device * (1 + MEMORY_MARGIN), stats["bytes_limit"] - stats.get("bytes_in_use", 0),
                          f"free memory on {device.device_kind} {device.id}", None if not memory.host else
                          ("device memory", memory.device), 0))
        if host is not None and (saving or memory.host):
            needs.append((memory.host * (1 + MEMORY_MARGIN) + saving + MEMORY_MARGIN_BYTES, host,
                          "host memory (MemAvailable in /proc/meminfo)",
                          ("host memory", memory.host) if memory.host else None, saving))
    for need, available, where, split, saves_in_it in needs:
        if need <= available:
            continue
        tables = sorted(accounting["tables"].items(), key=lambda t: -(t[1]["bytes"] + t[1]["optimizer_bytes"]))
        largest = ", ".join(f"{name} {t['vocab_size']:,} x {t['dim']} {t['method']} "
                            f"{_gib(t['bytes'] + t['optimizer_bytes'])}" for name, t in tables[:3])
        caps = [key for key in ("data.vocab_sizes", "data.max_index", "data.frequency_threshold",
                                "data.sparse.frequency_threshold", "data.sparse.hash_buckets")
                if find(config, key, MISSING) is not MISSING]
        parts = []
        if split is not None:  # the part of the tables and optimizer state in this memory
            parts.append(f"{_gib(split[1])} of embedding tables and optimizer state in {split[0]}")
        elif device.platform == "cpu" or not saves_in_it:  # on a GPU / TPU the host holds only the saves' buffers
            parts += [f"{_gib(accounting['bytes'])} of embedding tables",
                      f"{_gib(accounting['optimizer_bytes'])} of optimizer state "
                      f"({sections.optimizer.sparse['name']})"]
        if saves_in_it:
            sync = _gib(saved_bytes * CHECKPOINT_MEMORY["sync"])
            parts.append(f"{_gib(saves_in_it)} for {saves} checkpoint saves"
                         + (f" (checkpoint.async_save=False: {sync})" if saves == "async" else ""))
        raise ConfigError("embedding", (
            f"the model does not fit: {' + '.join(parts)} + margin = {_gib(need)}, but {_gib(max(available, 0))} of "
            f"{where} is available. Largest tables: {largest}. Shrink them: embedding.dim "
            f"({sections.embedding.dim}), a compression method (embedding.method: hashing, qr, md, tt, fiited, ...)"
            + (f", fewer rows ({', '.join(caps)})" if caps else "")
            + ", or shard them over more devices (mesh.shape; the devices of one CPU host share its memory, so on "
            "CPU that means more hosts), or put tables in host memory or on disk (tiering.tables); or "
            "train.check_memory=False to start anyway"))


def writable_directory(path: pathlib.Path, key: str) -> None:
    """Create `path` (and its parents) and write a file in it, or a ConfigError naming `key` and what is in the way
    (a file where a directory should be, a read-only or virtual file system, no permission)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".recjax_write_test_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        blocking = next((p for p in (path, *path.parents) if p.exists()), None)
        if blocking is not None and not blocking.is_dir():
            why = f"{blocking} is a file, not a directory"
        else:
            why = f"{error.strerror or error} ({error.filename or path})"
        raise ConfigError(key, f"cannot use {path} as a directory: {why}; choose a directory you can write") from None


def interrupted(step: int, checkpointer: Checkpointer | None) -> Interrupted:
    """What a rerun of an interrupted run resumes from."""
    if checkpointer is None:
        return Interrupted(f"interrupted at step {step:,}; checkpoints are off (checkpoint.enabled=False), so "
                           "rerunning the same command starts over", step)
    last = checkpointer.last_saved_step
    if last is None:
        return Interrupted(f"interrupted at step {step:,}, before this run's first checkpoint; rerunning the same "
                           "command starts it again", step)
    return Interrupted(f"interrupted at step {step:,}; rerun the same command to resume from its checkpoint of step "
                       f"{last:,} ({checkpointer.directory / str(last)})", step, resumable=True)


class StopRequest:
    """Ctrl-C (SIGINT) while a run trains: the first asks the loop to stop after its current step, which it
    checkpoints so that a rerun resumes there; a second interrupts at once (KeyboardInterrupt; a rerun then resumes
    from the last checkpoint). Only in the main thread of a single-process run (several processes must stop at the
    same step: there Ctrl-C interrupts at once)."""

    def __init__(self):
        self.requested = False
        self.step = 0  # the last step the loop dispatched (for the message)
        self._previous = None
        self._installed = False

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterrupt: stopping after this step and checkpointing it (press Ctrl-C again to stop at once, "
              "without it)", flush=True)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
