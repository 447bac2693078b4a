"""The trainer's checkpointer: when to save (steps or minutes, agreed across processes), what a save writes (the
state item, a delta's rows item per the policy, meta), async saves whose host copies are the loop's only wait,
retention that never breaks a chain, and resuming (this run's latest step, else `checkpoint.restore`).

Async saves: the loop waits only for host copies of the tables (the next step donates the originals), made into
buffers kept from save to save (a table's size of host memory, held between saves); Orbax's save call runs on a
worker thread and writes in the background, the sha256s are computed on another worker and awaited by the meta
handler before Orbax finalises the step. The next save (or `close`) first waits for this one. Only one thread talks
to Orbax at a time: callers use `wait`, never the manager directly. A baseline holding arrays read by row blocks (a
disk tier's tables, `streamed.RowBlocks`: valid until the next step) is written before the loop goes on.

Resuming: the latest complete step of the run's own checkpoints wins, if its saved config equals this one but for
`config.RESUMABLE_CHANGES` (else an error listing the keys); a step marked finished with a summary.json beside it
ends the run at once. `checkpoint.restore` (another run's checkpoints) is used only while the run has none of its
own, and gives the tables and dense state but none of the other run's loop state (selection, history and train time
start at its step; FIITED pools take its capacities, not its memory history). Either way the saved table record must
equal this run's before any array is read. Not done yet: restoring a multi-process checkpoint under another layout
in a multi-process run (one process can), and resuming a one-shot chain with several processes starts a new
baseline.
"""

import concurrent.futures
import dataclasses
import os
import pathlib
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from recjax.checkpoint import blocks, streamed
from recjax.checkpoint.config import config_dict, config_differences, flatten_config
from recjax.checkpoint.integrity import DIGESTS, Checksums, flat, local_value, nbytes, unflat
from recjax.checkpoint.policy import Policy
from recjax.checkpoint.records import dense_leaves, table_record
from recjax.checkpoint.restore import restore_state
from recjax.checkpoint.store import (
    FORMAT_VERSION,
    ResumePoint,
    Store,
    by_blocks,
    decode,
    encode,
    join_background,
    meta_handler_types,
    open_checkpoint,
)
from recjax.checkpoint.streamed import RowBlocks
from recjax.errors import CheckpointError, UserError, disk_full, free_bytes
from recjax.sections import CheckpointSection, read_section

# Multi-process runs decide time-based saves together (process 0's clock) every this many steps.
AGREE_EVERY_STEPS = 20


class Checkpointer:
    """Saves and restores the trainer's state per `config.checkpoint` in `<workdir>/checkpoints` (or `dir`)."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: pathlib.Path):
        ck = read_section(config, "checkpoint", CheckpointSection)
        self.config_dict = config_dict(config)
        self.directory = pathlib.Path(ck.dir or pathlib.Path(workdir) / "checkpoints").expanduser().absolute()
        self.every_steps = int(ck.every_steps)
        self.every_seconds = 60.0 * float(ck.every_minutes)
        self.keep = int(ck.keep)
        self.keep_selected = bool(ck.keep_selected)
        self.policy = Policy(ck.policy, float(ck.baseline_fraction), int(ck.quantize_bits),
                             int(ck.quantize_optimizer_bits))
        self.restore_from = ck.restore
        self.async_save = bool(ck.async_save)
        if jax.process_count() > 1:
            # Orbax synchronises processes with device collectives, from its background thread during an async save:
            # they can cross the train step's collectives in another order on another process, and both wait forever
            # (seen with 2 processes under load). Synchronous saves keep every collective on the loop's thread.
            self.async_save = False
        self.store = Store(self.directory, async_save=self.async_save)
        self.last_save_time = time.monotonic()
        self.last_saved_step: int | None = None
        self.save_stall_s: list[float] = []  # per save: how long the train loop waited (the benchmark reads it)
        self._host: dict[str, np.ndarray] = {}  # host buffers of the baselines' tables (`_host_copy`)
        self._saver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-save")
        self._copy_workers = os.cpu_count() or 1
        self._copier = concurrent.futures.ThreadPoolExecutor(self._copy_workers, thread_name_prefix="checkpoint-copy")
        self._saving: concurrent.futures.Future | None = None  # the async save call in flight
        self._in_flight: _Save | None = None  # the save not known to be complete (sync or async)
        self.failed = False  # a save failed (and its error was raised): closing waits for nothing more of it
        self._pending_retain = False
        self.layout: dict | None = None  # the tables' layout on a mesh (the trainer sets it; None on one device)
        self.task = None  # the run's Task: what its tables hold (`table_record`); the trainer sets it
        self.relayout = None  # (by_key, saved layout) -> by_key in this run's layout (the trainer sets it)
        self.backend = None  # where the tables live: `checkpoint_state` gives what a save writes (None: the state)

    # ---------------------------------------------------------------------------------------- resume
    def resume_point(self) -> ResumePoint | None:
        """The latest complete checkpoint of this run, else `checkpoint.restore`'s, else None. A checkpoint in this
        run's dir from a run with another config is an error naming the keys that differ."""
        steps = self.store.steps()
        if steps:
            meta = self.store.meta(steps[-1])
            diff = config_differences(meta["config"], self.config_dict)
            if diff:
                saved, now = flatten_config(meta["config"]), flatten_config(self.config_dict)
                shown = ", ".join(f"{k} {saved.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r}" for k in diff[:5])
                raise CheckpointError(f"{self.directory} holds checkpoints of a run with another config ({shown}); "
                                      f"use a new workdir (--config.checkpoint.restore={self.directory} there starts "
                                      "from this run's state), or delete the checkpoints to train from scratch")
            return ResumePoint(self.store, steps[-1], meta, own=True)
        if not self.restore_from:
            return None
        try:
            return open_checkpoint(self.restore_from)
        except CheckpointError as error:
            raise CheckpointError(f"checkpoint.restore: {error}") from None

    def restore(self, point: ResumePoint, like) -> tuple[Any, dict]:
        """(TrainState, the trainer's loop state) of `point`, with dirty-row bitmaps as the policy needs. The loop
        state (selection, early stopping, metrics history, times) is the checkpoint's when this run resumes itself,
        and {} for another run's checkpoint (`checkpoint.restore`): its history is not this run's."""
        if jax.process_count() > 1 and by_blocks(point.meta) and point.meta.get("layout") != self.layout:
            raise CheckpointError(f"checkpoint step {point.step} in {point.store.directory} was saved by a "
                                  "multi-process run on another mesh or plan; restore it on the same mesh.shape and "
                                  "sharding.*, or in one process (which re-lays its tables out)")
        try:
            by_rows = () if self.backend is None else self.backend.restores_by_rows
            state = self.track(restore_state(point, like, self.relayout, record=self._record(like), by_rows=by_rows))
        except CheckpointError as error:
            if point.own:
                raise
            raise CheckpointError(f"checkpoint.restore: {error}") from None
        meta = point.meta
        # Another layout (or number of processes, which changes how deltas are written): a new baseline next.
        extend = point.own and meta.get("layout") == self.layout and meta.get("processes", 1) == jax.process_count()
        if extend:
            self.last_saved_step = point.step
        state = self.policy.restored(point, state, extend)
        return state, (meta["loop"] if point.own else {})

    def _record(self, state) -> dict:
        if self.task is None:
            raise ValueError("Checkpointer.task is not set: set it to the run's Task (what its tables hold) before a "
                             "save or a restore")
        return table_record(self.task.collection, self.task.sparse_optimizer, state)

    # ------------------------------------------------------------------------------------------ save
    def track(self, state):
        """`state` with a zero dirty-row bitmap per group when the policy writes deltas (none for "full")."""
        return self.policy.track(state)

    def due_at(self, step: int) -> bool:
        """Whether a fixed schedule may ask for a save exactly after `step` -- the steps interval, and under several
        processes the steps their clocks agree at -- so the trainer ends a call of k steps there. (One process's
        minutes interval is looked at after every call.)"""
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_seconds) and jax.process_count() > 1 and step % AGREE_EVERY_STEPS == 0

    def due(self, step: int) -> bool:
        """Whether the interval (steps or minutes) asks for a save after `step`."""
        if self.every_steps and step % self.every_steps == 0:
            return True
        if not self.every_seconds:
            return False
        late = time.monotonic() - self.last_save_time >= self.every_seconds
        if jax.process_count() == 1:
            return late
        # Every process must save at the same step: every AGREE_EVERY_STEPS steps, process 0's clock decides.
        if step % AGREE_EVERY_STEPS:
            return False
        from jax.experimental import multihost_utils

        return bool(multihost_utils.broadcast_one_to_all(np.asarray(late)))

    def save(self, step: int, state, loop: dict, finished: bool = False):
        """Checkpoint `state` after `step` (written in the background unless `async_save` is off); returns the state
        with its dirty-row bitmaps cleared as the policy says."""
        import orbax.checkpoint as ocp

        if step == self.last_saved_step:
            return state
        t0 = time.perf_counter()
        self._settle()
        # The tables as the checkpoint records them (a disk tier: its cache's dirty rows written back, the rows read
        # from the files); only until the next step, so everything below reads them before returning.
        view = state if self.backend is None else self.backend.checkpoint_state(state)
        paths, leaves, _ = dense_leaves(state)
        distributed = jax.process_count() > 1
        item_state = {
            "step": np.asarray(step, np.int32),
            "rng": local_value(jax.random.key_data(state.dropout_rng)),
            # Orbax cannot store empty arrays (e.g. a layer over zero dense features): their shapes are in meta.
            "dense": {f"{i:05d}": local_value(leaf) for i, leaf in enumerate(leaves) if np.size(leaf)},
        }
        kind, rows_item, delta_bytes = self.policy.plan(view, self.task.sparse_optimizer)
        if state.aux:  # routing arrays of dynamic tables (FIITED's indirection, utility): small, saved whole
            item_state["aux"] = {f: {k: np.array(v) for k, v in a.items()} for f, a in state.aux.items()}
        if kind == "full":
            # Host copies into buffers kept from the previous baseline: the next step may donate (overwrite) the
            # tables while Orbax writes these in the background, and reusing the buffers halves the copy (a fresh
            # allocation page-faults; benchmarks/RESULTS.md#checkpoints).
            # A synchronous save is finished before the next step: it writes the arrays themselves.
            arrays = {("tables", g): t for g, t in view.tables.items()}
            arrays.update({("sparse_opt", g, k): v for g, o in view.sparse_opt_state.items() for k, v in o.items()})
            if not distributed:  # several processes: the global arrays themselves (saved synchronously, __init__)
                # Arrays read by row blocks (a disk tier's tables: `RowBlocks`) are written block by block from where
                # they live; other arrays not on a device are read into fresh host arrays, which no step changes.
                on_device = {key: a for key, a in arrays.items() if isinstance(a, jax.Array) and self.async_save}
                arrays = {**{key: a if isinstance(a, RowBlocks) else np.asarray(a) for key, a in arrays.items()
                             if key not in on_device},
                          **self._host_copies(on_device)}
            item_state["tables"] = {encode(key[1]): a for key, a in arrays.items() if key[0] == "tables"}
            item_state["sparse_opt"] = {encode(g): {key[2]: a for key, a in arrays.items()
                                                     if key[:2] == ("sparse_opt", g)}
                                        for g, o in view.sparse_opt_state.items() if o}
            table_bytes = nbytes({"t": item_state["tables"], "o": item_state["sparse_opt"]})
        else:
            table_bytes = delta_bytes
        self.policy.extend(step, kind, table_bytes, view)
        # Arrays spread over processes (multi-process runs) are checked by blocks: their digests, by item and path.
        global_arrays = {p: a for p, a in flat({"state": item_state, "rows": rows_item}).items()
                         if blocks.is_global(a)}
        arrays = Checksums({"state": item_state, "rows": rows_item},
                            {f"digests/{p}": ["uint8", blocks.digest_shape(a), DIGESTS]
                             for p, a in global_arrays.items()})
        meta = {
            "format": FORMAT_VERSION, "step": step, "kind": kind, "groups": sorted(decode(rows_item)),
            **self.policy.meta(kind, self.task.sparse_optimizer),
            "table_bytes": table_bytes, "bytes": nbytes(item_state) + nbytes(rows_item),
            "dense_paths": paths, "dense_shapes": [[str(leaf.dtype), list(leaf.shape)] for leaf in leaves],
            "rng_impl": str(jax.random.key_impl(state.dropout_rng)), "layout": self.layout,
            "tables": self._record(view),
            "processes": jax.process_count(),
            "arrays": arrays, "loop": loop, "config": self.config_dict, "finished": finished,
        }
        streamed.register_handler()  # RowBlocks values: written by row blocks
        args = {"state": ocp.args.PyTreeSave(item_state), "meta": meta_handler_types()[0](meta)}
        if rows_item:
            args["rows"] = ocp.args.PyTreeSave(rows_item)

        def issue():
            if global_arrays:  # each process hashes the blocks it holds
                digests = {p: blocks.block_digests(a) for p, a in global_arrays.items()}
                args["digests"] = ocp.args.PyTreeSave(unflat(digests))
            self.store.manager.save(step, args=ocp.args.Composite(**args), force=True)

        # Arrays read by row blocks hold their rows only until the next step (`checkpoint_state`): a save writing
        # them (and hashing them) is complete before the loop goes on.
        streamed_arrays = [a for a in flat(item_state).values() if isinstance(a, RowBlocks)]
        self._in_flight = _Save(step, meta["bytes"], streamed_arrays, arrays)
        if self.async_save and not streamed_arrays:  # Orbax's save call (threads, an event loop) is a measurable
            self._saving = self._saver.submit(issue)  # stall: off the loop too
        else:  # and always with several processes (above)
            try:
                issue()
                self.store.manager.wait_until_finished()
            except BaseException as error:
                self._failed(error)
                raise
            self._in_flight = None
        self.store.remember(step, meta)
        self._pending_retain = True
        self.last_saved_step, self.last_save_time = step, time.monotonic()
        state = self.policy.clear(state, kind)
        if self.backend is not None:
            self.backend.checkpoint_saved(bool(state.dirty_rows) and self.policy.clears(kind))
        self.save_stall_s.append(time.perf_counter() - t0)
        return state

    def _host_copies(self, arrays: dict) -> dict:
        """Each array copied into this checkpointer's host buffer for its key (re-allocated when its shape changes),
        in row blocks over a thread per core (numpy releases the GIL; benchmarks/RESULTS.md#checkpoints)."""
        jobs = []
        for key, array in arrays.items():
            buffer = self._host.get(key)
            if buffer is None or buffer.shape != array.shape or buffer.dtype != array.dtype:
                buffer = self._host[key] = np.empty(array.shape, array.dtype)
            # A mesh array: each device's block is copied into its place (a replicated block once).
            parts = ([(shard.index, np.asarray(shard.data)) for shard in array.addressable_shards
                       if not shard.replica_id] if isinstance(array, jax.Array) else [((), np.asarray(array))])
            for index, source in parts:
                target = buffer[index]
                if source.ndim == 0 or len(source) < 2:
                    np.copyto(target, source)
                    continue
                bounds = np.linspace(0, len(source), self._copy_workers + 1).astype(int)
                jobs += [self._copier.submit(np.copyto, target[a:b], source[a:b])
                         for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
        for job in jobs:
            job.result()
        return {key: self._host[key] for key in arrays}

    def wait(self) -> None:
        """Block until the save in flight is complete (and old checkpoints are pruned)."""
        self._settle()

    def _settle(self) -> None:
        """Wait for the save in flight, then delete what no kept restore point needs -- only once the newer
        checkpoint is complete, so a crash always leaves a restorable chain."""
        try:
            if self._saving is not None:
                saving, self._saving = self._saving, None
                saving.result()  # re-raises an error of the save call
            self.store.manager.wait_until_finished()
        except BaseException as error:
            self._failed(error)
            raise
        self._in_flight = None
        if not self._pending_retain:
            return
        self._pending_retain = False
        steps = self.store.steps()
        kept = set(steps[-self.keep:])
        if self.keep_selected:  # and the step model selection chose (what summary.json reports, what export serves)
            selected = self.store.meta(steps[-1])["loop"].get("selection", {}).get("best_step")
            kept.update({selected} & set(steps))
        needed = set()
        for s in kept:
            needed.update(self.store.meta(s)["chain"])
        for s in steps:
            if s not in needed:
                self.store.delete(s)

    def _failed(self, error: BaseException) -> None:
        """The save in flight failed with `error`: stop what it still runs -- its arrays read by row blocks stop at
        their next block (with `error`), their digests too, and Orbax's threads of it are waited for, so nothing of it
        is left running (or printing) when the error is reported --, remove its partial directory, and turn a full
        disk into a CheckpointError naming the directory, the bytes the checkpoint needs and the bytes free (raised
        from here; any other error is the caller's to re-raise: a table file's StorageError says what to do)."""
        save, self._in_flight = self._in_flight, None
        self.failed = True
        if save is None:
            return
        for array in save.streamed:
            array.failure = array.failure or error
        save.checksums.stop()
        join_background()
        self.store.remove_partial(save.step)
        if disk_full(error) and not isinstance(error, UserError):
            steps = [s for s in self.store.steps() if s != save.step]
            kept = (f"the checkpoint of step {steps[-1]:,} ({self.directory / str(steps[-1])}) is intact: free space, "
                    "then rerun the same command to resume from it") if steps else (
                "the run has no complete checkpoint yet: free space, then rerun the same command to start again")
            raise CheckpointError(f"checkpoint step {save.step:,} in {self.directory}: the disk is full; the "
                                  f"checkpoint needs about {save.nbytes:,} bytes and {free_bytes(self.directory):,} "
                                  f"are free; {kept} (or point checkpoint.dir at a larger disk)") from None

    def close(self) -> None:
        """Wait for the save in flight (raising its error), then shut the checkpointer's threads and Orbax's manager
        down; after a failed save, whose error was raised already, nothing of it is raised again."""
        try:
            if not self.failed:
                self._settle()
        finally:
            self._saver.shutdown(wait=True)
            self._copier.shutdown(wait=True)
            try:
                self.store.manager.close()
            except BaseException:
                if not self.failed:  # an echo of the failed save's error otherwise
                    raise


@dataclasses.dataclass
class _Save:
    """A save in flight: its step, bytes (uncompressed), arrays read by row blocks and digests."""

    step: int
    nbytes: int
    streamed: list
    checksums: Checksums
