"""The disk storage: a group's cached tables on local disk (or, for its host-tier tables, in host RAM) behind a
device-side cache of rows, on any layout.

Layout. A group holding a cached table keeps its memory tables where the layout puts them and its cached tables'
rows and optimizer-state rows in a `RowStore` (recjax/tiering/store.py): a file per disk table, a host array per
host-tier table. The step sees a cache of S slots per device block, which the layout places
(recjax/tiering/slots.py: one device, after the group's memory tables' rows in its array; a mesh, one more array
split like the plan's array of the cached tables), and `RowCache` (recjax/tiering/cache.py) says which row sits in
which slot. Groups without a cached table are another storage's. So the compiled step is the in-memory one: the
route is rewritten to the rows the step's arrays hold (`rewrite_routes`), and the step gathers, differentiates and
updates in place exactly as in memory. Rows are exact copies and a step sees them in the same order, so a run on
disk equals the in-memory run of its layout bit for bit.

The pipeline, for training step i + 1 while step i runs on the device:
  1. prefetch thread (the trainer's `DevicePrefetcher` calls `put_batch`): the batch goes to the device and is
     routed (one device: the train step's route, jitted apart from the step, which the step then takes; a mesh: the
     global batch's distinct rows), and its distinct stacked rows per group are brought to the host.
  2. main thread, when the trainer calls the step with it (`PreparedStep`, recjax/placement/embedding.py), in step
     order (`prepare_train`): the cache plans the step (hits, misses, victims among slots the step does not use),
     the misses are read -- from the eviction of a row still on its way to the store if there is one, else from the
     store -- and the swap, queued behind step i on the device, reads the dirty victims' rows out of their slots
     (`_records`) and writes the misses in (`_fill`, in place); then step i + 1 is queued. JAX dispatches
     asynchronously, so all of this runs while step i computes.
  3. writer thread: each swap's evicted rows, once the device has produced them, are written to the store.

Why no row is evicted before use or read stale: a victim is never a slot of the step it is planned for, and the
swap that reuses it runs on the device after every earlier step (it takes their output tables), so earlier steps have
used and updated it and the swap reads its final value out. A row whose write-back is still pending is read from the
eviction itself, never from the store; rows reach the store in eviction order (one writer, FIFO). Evaluation reads
through the cache without changing it: the predict step gets a per-batch working set of the batch's rows
(`prepare_predict`), so evaluating never moves the training cache.

Checkpoints record the single-device layout (`checkpoint_view`: the cache's dirty rows written back, the cached
tables' rows read from the stores, the memory tables' from the device; Check-N-Run's dirty rows of a cached group kept
by stacked row on the host); a restore builds that state and `place` writes the cached rows to fresh stores. So a
checkpoint moves between one device, a mesh, memory and disk.

Not supported (refused with a ConfigError when the placement is built): multi-process runs (each process sees only
its share of a batch, and the caches' plan needs the whole batch), dynamic methods (their tables change shape), the
static policy on a mesh (its hot set would be profiled per device), and on a mesh cached tables placed column-wise
or replicated (every device would need every cached row; `sharding.plan=auto` places them row-wise).
"""

import dataclasses
import math
import pathlib
import queue
import shutil
import threading
import time
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from recjax.checkpoint import streamed
from recjax.checkpoint.streamed import RowBlocks
from recjax.embedding import Routes
from recjax.embedding_backend import DeviceStorage, MemoryUse, Storage
from recjax.errors import ConfigError
from recjax.sparse_optim import SparseOptimizer
from recjax.tiering.folders import FolderInUse, TableFolder
from recjax.tiering.slots import GroupLayout, power_of_two
from recjax.tiering.store import RowStore

_WRITES_IN_FLIGHT = 8  # evictions queued for the writer before the step loop waits for it
_WRITE_BACK_ROWS = 1 << 18  # dirty rows gathered and written per chunk of a write-back (~70 MB at 65 floats)


@dataclasses.dataclass
class DiskBatch:
    """The disk storage's view of a batch on the devices: per group its distinct stacked rows (the route's `unique`
    i32[N], sorted, padded with the sentinel `group_rows`) on the host and on the device (a mesh: replicated)."""

    unique: dict[str, np.ndarray]
    unique_device: dict[str, jax.Array]


def _rows(array, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of a table array: a device or numpy array, or one read by row blocks."""
    return array.block(start, stop) if isinstance(array, RowBlocks) else np.asarray(array[start:stop])


class _Eviction:
    """Dirty rows i64[n] of one group leaving the cache in one swap, and their records as the swap returned them
    (f32[>= n, width] on the device); `host()` waits for the swap and keeps the host copy."""

    def __init__(self, group: str, rows: np.ndarray, records: jax.Array):
        self.group, self.rows, self.records = group, rows, records
        self.order = np.argsort(rows, kind="stable")
        self.sorted_rows = rows[self.order]
        self._host: np.ndarray | None = None
        self._lock = threading.Lock()

    def host(self) -> np.ndarray:
        with self._lock:
            if self._host is None:
                self._host = np.asarray(self.records)[: len(self.rows)]
            return self._host

    def find(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of `rows` this eviction holds: bool[n], their record indices)."""
        pos = np.minimum(np.searchsorted(self.sorted_rows, rows), len(self.sorted_rows) - 1)
        found = self.sorted_rows[pos] == rows
        return found, self.order[pos[found]]


class CheckpointRows(RowBlocks):
    """One array of a cached group as a checkpoint records it: the table (`field` None) or one sparse-optimizer field,
    f32[group rows, ...] in the single-device layout, read where its rows live -- the memory tables' rows from
    `resident` (an array whose first rows are the memory tables' rows, compacted: the device array on one device, a
    host copy on a mesh), the cached tables' from the store -- and only when asked: `rows(ids)` for a delta's rows,
    `block(start, stop)` for a baseline, which writes it block by block (recjax/checkpoint/streamed.py). Valid
    until the next step (the storage writes the cache's dirty rows back first: `DiskStorage.checkpoint_view`)."""

    def __init__(self, storage: "DiskStorage", group: str, field: str | None, resident):
        layout = storage.layouts[group]
        self.storage, self.group, self.device = storage, group, resident
        self.shape = (layout.rows, *resident.shape[1:])
        self.dtype = np.dtype(np.float32)
        start = 0 if field is None else layout.dim + sum(math.prod(s) for k, s in storage.fields[group].items()
                                                         if k < field)
        self.columns = slice(start, start + math.prod(self.shape[1:]))

    @property
    def block_rows(self) -> int:
        """Rows per block: as many whole records (the row and all its optimizer state, what the files hold) as fit in
        BLOCK_BYTES, so a block's read of the files is bounded too."""
        return max(1, streamed.BLOCK_BYTES // (self.storage.widths[self.group] * 4))

    def _from_records(self, records: np.ndarray) -> np.ndarray:
        # A copy: a view would keep the whole records (every field) alive while the block is written.
        return np.ascontiguousarray(records[:, self.columns]).reshape((len(records), *self.shape[1:]))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The stacked rows `ids` i64[n] (each < group rows)."""
        ids = np.asarray(ids, np.int64)
        starts, cached, device = self.storage.slots[self.group].where
        table = np.searchsorted(starts, ids, side="right") - 1
        on_store = cached[table]
        out = np.empty((len(ids), *self.shape[1:]), np.float32)
        if on_store.any():
            out[on_store] = self._from_records(self.storage.stores[self.group].read(ids[on_store], count=False))
        resident = np.flatnonzero(~on_store)
        if len(resident):
            t = table[resident]
            at = np.zeros(power_of_two(len(resident)), np.int64)  # few shapes to compile (padding reads row 0)
            at[: len(resident)] = device[t] + ids[resident] - starts[t]
            out[resident] = np.asarray(self.device[jnp.asarray(at)])[: len(resident)]
        return out

    def block(self, start: int, stop: int) -> np.ndarray:
        """The stacked rows [start, stop), in order."""
        starts, cached, device = self.storage.slots[self.group].where
        out = np.empty((stop - start, *self.shape[1:]), np.float32)
        for t in range(len(starts)):
            first, end = int(starts[t]), int(starts[t + 1]) if t + 1 < len(starts) else self.shape[0]
            lo, hi = max(start, first), min(stop, end)
            if lo >= hi:
                continue
            if cached[t]:
                out[lo - start: hi - start] = self._from_records(self.storage.stores[self.group].read_range(lo, hi))
            else:
                at = int(device[t]) + lo - first
                out[lo - start: hi - start] = np.asarray(self.device[at: at + hi - lo])
        return out


class DiskStorage(Storage):
    """The groups' cached tables (`context.tiers`: those not in device memory; in a file when their tier is this
    storage's, else in host RAM) in `RowStore`s behind per-group row caches; their memory tables where the layout puts
    them. Settings from the `tiering` section (recjax/sections.py): the caches' size (`cache_fraction` /
    `cache_rows`), `policy` (the static one profiles its hot set from the first training batches of
    `context.dataset`), `dir` ("" = <workdir>/tables.tmp, removed on `close`), `prefetch` (False makes each step wait
    for the previous one before reading its misses, to measure what the overlap hides), `io_threads`."""

    name = "disk"
    places = True
    prepares = True
    static_shapes_only = True
    # On a mesh each device's cache serves the rows it owns: under `sharding.plan=auto` this storage's tables are
    # split row-wise (recjax/placement `build`).
    row_wise_on_a_mesh = True
    # The trainer keeps at most this many steps queued: the misses of step i + 1 are read while step i runs, and the
    # host never plans far ahead of the device (evictions waiting for the writer stay few).
    steps_in_flight = 2

    def __init__(self, collection, groups, context):
        super().__init__(collection, groups, context)
        section, optimizer, layout = context.tiering, context.optimizer, context.layout
        if jax.process_count() > 1:
            raise ConfigError("mesh.shape", f"tables {sorted(self._cached_tables())} are on the disk / host tier, "
                                            f"which runs in one process only (this run has {jax.process_count()}): "
                                            "the caches are planned from the whole global batch, and each process "
                                            "reads only its share; keep the tables in memory or run one process")
        self.optimizer, self.layout = optimizer, layout
        self.policy, self.prefetch, self.io_threads = section.policy, section.prefetch, section.io_threads
        layouts = layout.cache_layouts(self._cached_tables(), context.batch_size, section.cache_fraction,
                                       section.cache_rows)
        self.layouts = {g.name: g for g in layouts}
        self.slots = layout.cache_slots(layouts)
        if self.policy == "static" and not all(sl.routes_ahead for sl in self.slots.values()):
            raise ConfigError("tiering.policy", "'static' is not supported on a mesh yet (its hot set would be "
                                                "profiled per device block); use lru or lfu")
        self.folder: TableFolder | None = None  # the run's table folder (recjax/tiering/folders.py): held until close
        self.directory, self.temporary = None, False
        if any(in_file for g in layouts for *_, in_file in g.cached):
            self.folder = table_folder(section.dir, layouts, optimizer, context.workdir)
            self.directory, self.temporary = self.folder.path, self.folder.temporary
        self.pinned: dict[str, np.ndarray] = {}
        # Record columns: the row, then each optimizer-state field (sorted by name) flattened.
        self.fields = {}
        for g, group_layout in self.layouts.items():
            shapes = optimizer.state_shapes(1, group_layout.dim)
            self.fields[g] = {k: shapes[k][1:] for k in sorted(shapes)}
        self.widths = {g: self.layouts[g].dim + sum(math.prod(s) for s in f.values()) for g, f in self.fields.items()}
        self.stores: dict[str, RowStore] = {}
        self.caches: dict = {}
        self._pending: dict[str, list[_Eviction]] = {g: [] for g in self.layouts}
        self._pending_lock = threading.Lock()
        self._writes: queue.Queue = queue.Queue(maxsize=_WRITES_IN_FLIGHT)
        self._writer_error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="recjax-writeback")
        self._writer.start()
        self._latest = None  # the newest train state's (tables, opt state), for the final write-back
        # Check-N-Run's dirty rows of the cached groups, by stacked row (bool[group rows]), kept here while the
        # checkpoint policy tracks dirty rows: the state's bitmap of such a group is over its device rows, whose
        # cache slots change rows with every eviction.
        self.dirty: dict[str, np.ndarray] = {}
        self._closed = False
        self._unique_fn = jax.jit(self._unique)
        self._train_route_fn = jax.jit(self._train_route)
        self._fill_fn = jax.jit(self._fill, donate_argnums=(0, 1))
        self._records_fn = jax.jit(self._records)
        self._working_sets: dict[str, dict] = {g: {} for g in self.layouts}
        # plan_s / read_s: the host's planning and miss reads per step; write_s: the writer thread's write-backs;
        # queue_wait_s: the step loop blocked on a full write queue (the write-back not keeping up).
        self.stats = {"steps": 0, "plan_s": 0.0, "read_s": 0.0, "write_s": 0.0, "queue_wait_s": 0.0,
                      "rows_from_evictions": 0, "swap_rows": 0, "eval_batches": 0, "eval_misses": 0}
        if self.policy == "static":
            try:
                if context.dataset is None:
                    raise ConfigError("tiering.policy", "'static' needs the training data to profile its hot rows")
                self.pinned = profile_hot_rows(lambda b: self.put_batch(layout.put_batch(b))[0].unique,
                                               context.dataset.train_batches(context.batch_size), layouts,
                                               section.profile_batches)
            except BaseException:
                self.close()  # the writer thread and the table folder
                raise

    def _cached_tables(self) -> dict[str, bool]:
        """{physical table of this storage's groups not in device memory: its rows in a file (this storage's tier)
        rather than in host RAM (another off-device tier grouped with it)}."""
        tiers = self.context.tiers
        return {name: tiers[name] == self.name for name in sorted(self.tables())
                if tiers[name] != DeviceStorage.name}

    # ------------------------------------------------------------------------------------------- device side
    def rewrite_routes(self, routes: Routes, batch, *, train: bool, premade: bool) -> Routes:
        """The cached groups' rows as the step's arrays hold them (`batch.extras`: each group's distinct stacked rows
        `keys` and the step row of each, `slots`)."""
        extras = batch.extras[self.name]
        assert premade or not routes.deduplicated or not all(sl.routes_ahead for sl in self.slots.values()), \
            "a deduplicating train route on one device is made by put_batch"
        for g, sl in self.slots.items():
            routes = sl.rewrite(self.collection, routes, extras["keys"][g], extras["slots"][g], premade=premade)
        return routes

    # ---------------------------------------------------------------------------------- jitted host helpers
    def _unique(self, ids, lengths) -> dict[str, jax.Array]:
        routes = self.collection.route(ids, lengths, aux={}, dedup=True)
        return {g: routes.unique[g] for g in self.layouts}

    def _train_route(self, ids, lengths) -> tuple[Routes | None, dict[str, jax.Array]]:
        """(the train step's route when it deduplicates, else None; the cached groups' distinct rows)."""
        if not self.collection.dedup:
            return None, self._unique(ids, lengths)
        routes = self.collection.route(ids, lengths, aux={}, dedup=None)
        return routes, {g: routes.unique[g] for g in self.layouts}

    def _records(self, table: jax.Array, state: dict, slots: jax.Array) -> jax.Array:
        """Records f32[n, width] of device rows `slots` (out of range: zeros): the row, then its state fields."""
        parts = [table.at[slots].get(mode="fill", fill_value=0)]
        for k in sorted(state):
            parts.append(state[k].at[slots].get(mode="fill", fill_value=0).reshape(len(slots), -1))
        return jnp.concatenate(parts, axis=1)

    def _fill(self, tables: dict, opt_state: dict, fill: dict, records: dict):
        """Per group: the `fill` slots set to `records` (slots out of range are padding). Tables and state donated:
        in place. The evicted slots' records are read by `_records_fn` beforehand, in a call of its own: gathering
        and scattering the same donated buffer in one computation makes XLA copy the whole cache array each swap
        (225 ms at 1M slots, 2.1 s at 8M on this machine; 3 and 7.5 ms split), and JAX runs a donating call only
        after the earlier calls reading that buffer."""
        for g in tables:
            dim = tables[g].shape[1]
            tables[g] = tables[g].at[fill[g]].set(records[g][:, :dim], mode="drop")
            state, at = dict(opt_state[g]), dim
            for k in sorted(state):
                shape = state[k].shape[1:]
                width = math.prod(shape)
                value = records[g][:, at: at + width].reshape((-1, *shape))
                state[k] = state[k].at[fill[g]].set(value, mode="drop")
                at += width
            opt_state[g] = state
        return tables, opt_state

    # --------------------------------------------------------------------------------------------- host side
    def init_tables(self, rng: jax.Array, optimizer: SparseOptimizer) -> tuple[dict, dict]:
        """Each group's cached rows and initial optimizer state go to its store block by block
        (`collection.init_chunks`: the same bits as `init_tables`), the memory tables' rows to the device array's
        first rows, and the cache starts empty (the static policy's hot set loaded): {group: f32[R + S, d]}."""
        tables, opt_state = {}, {}
        for g, layout in self.layouts.items():
            store = self._new_store(g)
            resident = np.zeros((layout.resident_rows, layout.dim), np.float32)
            starts, cached, device = self.slots[g].where
            state_columns = self._initial_state_columns(g)
            for start, block in self.collection.init_chunks(rng, g):
                stop = start + len(block)
                for t in range(len(starts)):
                    lo = max(start, starts[t])
                    hi = min(stop, starts[t + 1] if t + 1 < len(starts) else layout.rows)
                    if lo >= hi:
                        continue
                    rows = block[lo - start: hi - start]
                    if cached[t]:
                        store.write_initial(lo, np.concatenate([rows, np.broadcast_to(
                            state_columns, (len(rows), len(state_columns)))], axis=1))
                    else:
                        resident[device[t] + lo - starts[t]: device[t] + hi - starts[t]] = rows
            tables[g], opt_state[g] = self._device_arrays(g, resident, None)
        return tables, opt_state

    def _initial_state_columns(self, group: str) -> np.ndarray:
        return np.concatenate([np.zeros(0, np.float32)] + [
            np.full(math.prod(shape), self.optimizer.initial_state_value(k), np.float32)
            for k, shape in self.fields[group].items()])

    def _new_store(self, group: str) -> RowStore:
        """A fresh store for `group` (its files created) and an empty cache (the hot set pinned)."""
        if group in self.stores:
            self._drain()
            self.stores[group].close()
        layout = self.layouts[group]
        directory = None if self.directory is None else self.directory / group
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        self.stores[group] = RowStore([(name, start, rows, directory if in_file else None)
                                       for name, start, rows, in_file in layout.cached],
                                      self.widths[group], self.io_threads)
        self.caches[group] = self.slots[group].new_cache(self.policy, self.pinned.get(group))
        return self.stores[group]

    def _device_arrays(self, group: str, resident: np.ndarray, resident_state: dict | None):
        """The device table f32[R + S, d] and state of `group`: the memory tables' rows (and state; None: initial),
        an empty cache, and the hot set's records in its first slots. Built by one jit, so the cache is allocated
        once (a numpy array copied to the device would be held twice)."""
        layout, store, cache = self.layouts[group], self.stores[group], self.caches[group]
        store.open()
        pinned = cache.pinned_rows
        hot = store.read(pinned) if len(pinned) else np.zeros((0, self.widths[group]), np.float32)
        state_shapes = self.optimizer.state_shapes(layout.resident_rows, layout.dim)
        if resident_state is None:
            resident_state = {k: np.full(s, self.optimizer.initial_state_value(k), np.float32)
                              for k, s in state_shapes.items()}
        slots = layout.slots

        @jax.jit
        def build(resident, resident_state, hot):
            where = layout.resident_rows + jnp.arange(hot.shape[0])
            table = jnp.zeros((layout.device_rows, layout.dim), jnp.float32).at[: layout.resident_rows].set(resident)
            table = table.at[where].set(hot[:, : layout.dim])
            state, at = {}, layout.dim
            for k in sorted(resident_state):
                shape = resident_state[k].shape[1:]
                width = math.prod(shape)
                value = jnp.zeros((layout.resident_rows + slots, *shape), jnp.float32)
                value = value.at[: layout.resident_rows].set(resident_state[k])
                state[k] = value.at[where].set(hot[:, at: at + width].reshape((-1, *shape)))
                at += width
            return table, state

        return build(resident, resident_state, hot)

    def place(self, state) -> tuple[dict, dict, dict]:
        """A state whose cached groups are in the single-device layout ({group: f32[group_rows, d]}) -> the layout's
        arrays: the cached tables' rows and state go to fresh stores, the cache starts empty. Groups as `init_tables`
        made them (a cache never holds every row, so the shapes differ) are only laid out."""
        tables, opt_state, dirty = {}, {}, {}
        for g, layout in self.layouts.items():
            table, opt = state.tables[g], state.sparse_opt_state[g]
            if table.shape[0] != layout.device_rows:
                assert table.shape[0] == layout.rows, (g, table.shape, layout.rows, layout.device_rows)
                if g in state.dirty_rows:  # a restored one-shot delta's rows stay dirty (by stacked row, here)
                    self.dirty[g] = np.array(state.dirty_rows[g], bool)
                else:
                    self.dirty.pop(g, None)
                table, opt = self._to_store(g, table, opt)
            t, o = self.slots[g].lay_out({g: table}, {g: opt})
            tables.update(t)
            opt_state.update(o)
            if g in state.dirty_rows:  # the state's bitmaps are over its device rows, unused (`self.dirty`)
                dirty.update(self.slots[g].dirty_bitmaps(state.dirty_rows))
        return tables, opt_state, dirty

    def _to_store(self, g: str, table, opt: Mapping):
        """A group's single-device arrays -> its fresh store (cached rows) and the device arrays [R + S]."""
        layout = self.layouts[g]
        arrays = [table] + [opt[k] for k in sorted(opt)]
        store = self._new_store(g)
        starts, cached, _ = self.slots[g].where
        resident = []  # blocks of the memory tables' rows, of each array
        # A block of records at a time, never a whole array (a restore's arrays are read from the checkpoint by row
        # blocks: `restores_by_rows`).
        step = max(1, min([streamed.BLOCK_BYTES // (self.widths[g] * 4)]
                          + [a.block_rows for a in arrays if isinstance(a, RowBlocks)]))
        for t in range(len(starts)):
            start, stop = int(starts[t]), int(starts[t + 1]) if t + 1 < len(starts) else layout.rows
            for lo in range(start - start % step, stop, step):  # blocks aligned to the arrays' blocks
                lo, hi = max(lo, start), min(lo + step, stop)
                rows = [_rows(a, lo, hi) for a in arrays]
                if cached[t]:
                    store.write_initial(lo, np.concatenate([r.reshape(hi - lo, -1) for r in rows], axis=1))
                else:
                    resident.append(rows)
        kept = [np.concatenate([rows[i] for rows in resident]) if resident else
                np.zeros((0, *a.shape[1:]), np.float32) for i, a in enumerate(arrays)]
        return self._device_arrays(g, kept[0], dict(zip(sorted(opt), kept[1:], strict=True)))

    def checkpoint_view(self, state) -> tuple[dict, dict, dict]:
        """The cached groups in the single-device layout a checkpoint records: `CheckpointRows` (read on demand: a
        delta reads its rows only, a baseline every row) after the cache's dirty rows are written back to the stores
        -- the files then hold the tables as of this step --, and their dirty-row bitmaps by stacked row."""
        self.write_back(state)
        tables, opt_state, dirty = {}, {}, {}
        for g in self.layouts:
            sl = self.slots[g]
            fields = sorted(self.fields[g])
            tables[g] = CheckpointRows(self, g, None, sl.resident_source(state.tables, lambda a: a))
            opt_state[g] = {k: CheckpointRows(self, g, k, sl.resident_source(state.sparse_opt_state,
                                                                             lambda a, k=k: a[k])) for k in fields}
            if state.dirty_rows:
                dirty[g] = self._dirty(g)
        return tables, opt_state, dirty

    def checkpoint_saved(self, dirty_rows_cleared: bool) -> None:
        if dirty_rows_cleared:
            for bitmap in self.dirty.values():
                bitmap[:] = False

    def _dirty(self, group: str) -> np.ndarray:
        if group not in self.dirty:
            self.dirty[group] = np.zeros(self.layouts[group].rows, bool)
        return self.dirty[group]

    def flush(self, state=None) -> None:
        """`write_back`, then the files synced to the disk (at the end of a run: they hold the final tables)."""
        self.write_back(state)
        for store in self.stores.values():
            store.flush()

    def write_back(self, state=None) -> None:
        """Write every pending eviction and every dirty cached row (of `state`'s cache; default the newest train
        state's) to the stores: then the stores hold the tables (in the page cache: a checkpoint reads them back
        with plain reads, and a restore rewrites the files, so nothing waits for the disk here)."""
        self._drain()
        tables, opt_state = (state.tables, state.sparse_opt_state) if state is not None else (self._latest or (None,
                                                                                                                 None))
        for g, cache in self.caches.items():
            rows, slots = cache.dirty_slots()
            if len(rows) and tables is not None:
                # In chunks of at most _WRITE_BACK_ROWS (a full cache of millions of dirty rows gathered at once
                # would hold gigabytes twice, on the device and on the host), each padded to a power of two with an
                # out-of-range slot (read as zeros, dropped): a flush compiles a few shapes, not one per count.
                sl = self.slots[g]
                # In file order: a row's page is then read once for all its dirty rows (a record is smaller than a
                # page; a page not in the page cache is read before it is written) and the reads run ahead.
                order = np.argsort(rows, kind="stable")
                rows, slots = rows[order], slots[order]
                for lo in range(0, len(rows), _WRITE_BACK_ROWS):
                    part = slots[lo: lo + _WRITE_BACK_ROWS]
                    device = np.full(power_of_two(len(part)), sl.end, np.int32)
                    device[: len(part)] = sl.first + part
                    records = np.asarray(self._records_fn(tables[sl.key], opt_state[sl.key], jnp.asarray(device)))
                    self.stores[g].write(rows[lo: lo + len(part)], records[: len(part)])
                cache.mark_clean()

    # ------------------------------------------------------------------------------------------- per batch
    def put_batch(self, batch) -> tuple[DiskBatch, Routes | None]:
        """A batch on the devices -> its distinct stacked rows per cached group, on the host and on the device(s);
        with the train step's route when the layout routes on one device and that route deduplicates (its `unique`
        are those rows)."""
        if all(sl.routes_ahead for sl in self.slots.values()):
            routes, unique = self._train_route_fn(batch.ids, batch.lengths)
            return DiskBatch({g: np.asarray(u) for g, u in unique.items()}, unique), routes
        unique = {g: np.asarray(u) for g, u in self._unique_fn(batch.ids, batch.lengths).items()}
        return DiskBatch(unique, self.layout.put_replicated(unique)), None

    def _slots_and_misses(self, group: str, unique: np.ndarray, train: bool):
        """The rows the step sees for a batch's distinct stacked rows i32[N] (`step_rows`; cached ones at their
        slot, from `slot_base`), and the cached ones' plan (for prediction: their positions and rows, then the
        misses are those without a slot, and nothing moves)."""
        layout, sl = self.layouts[group], self.slots[group]
        starts, cached, _ = sl.where
        real = np.flatnonzero(unique < layout.rows)
        table = np.searchsorted(starts, unique[real], side="right") - 1
        out = sl.step_rows(unique, real[~cached[table]], table[~cached[table]])
        at = real[cached[table]]
        rows = unique[at].astype(np.int64)
        if not train:
            return out, at, rows
        plan = self.caches[group].plan(rows, dirty=True)
        out[at] = sl.slot_base + plan.slots
        return out, at, plan

    def _read_misses(self, group: str, rows: np.ndarray) -> np.ndarray:
        """Records f32[n, width] of rows the cache does not hold: from a pending eviction (newest first) where one
        holds the row -- its write-back may not have happened yet --, else from the store."""
        records = np.empty((len(rows), self.widths[group]), np.float32)
        todo = np.ones(len(rows), bool)
        with self._pending_lock:
            pending = list(self._pending[group])
        for eviction in reversed(pending):
            if not todo.any():
                break
            left = np.flatnonzero(todo)
            found, index = eviction.find(rows[left])
            if found.any():
                records[left[found]] = eviction.host()[index]
                todo[left[found]] = False
                self.stats["rows_from_evictions"] += int(found.sum())
        if todo.any():
            records[todo] = self.stores[group].read(rows[todo])
        return records

    def _extras(self, db: DiskBatch, slots: Mapping) -> dict:
        return {"keys": db.unique_device, "slots": self.layout.put_replicated(dict(slots))}

    def prepare_train(self, state, prepared):
        """Plan a train step's rows, read its misses and queue the swap (behind the previous step): the state with
        the batch's rows in the cache, and the step rows of the batch's distinct rows."""
        self._check_writer()
        db: DiskBatch = prepared.extras[self.name]
        if not self.prefetch:  # measurement mode: read only once the previous step is done
            jax.block_until_ready(state.tables)
        t0 = time.perf_counter()
        slots, evict, fill, records, evicting, keys = {}, {}, {}, {}, {}, {}
        read_s = 0.0
        for g, layout in self.layouts.items():
            if state.dirty_rows:  # the in-memory step marks exactly the batch's distinct rows (`touched_rows`)
                self._dirty(g)[db.unique[g][db.unique[g] < layout.rows]] = True
            slots[g], _, plan = self._slots_and_misses(g, db.unique[g], train=True)
            if not len(plan.miss_rows) and not len(plan.evict_rows):
                continue
            t1 = time.perf_counter()
            miss = self._read_misses(g, plan.miss_rows)
            read_s += time.perf_counter() - t1
            sl = self.slots[g]
            key = keys[g] = sl.key
            m = e = sl.swap_rows(max(len(plan.miss_rows), len(plan.evict_rows)))
            fill[key] = np.full(m, sl.end, np.int32)
            fill[key][: len(plan.miss_rows)] = sl.first + plan.miss_slots
            records[key] = np.zeros((m, self.widths[g]), np.float32)
            records[key][: len(miss)] = miss
            evict[key] = np.full(e, sl.end, np.int32)
            evict[key][: len(plan.evict_rows)] = sl.first + plan.evict_slots
            evicting[g] = plan.evict_rows
            self.stats["swap_rows"] += len(plan.miss_rows) + len(plan.evict_rows)
        if fill:
            swapped = sorted(fill)
            evicted = {g: self._records_fn(state.tables[k], state.sparse_opt_state[k], evict[k])
                       for g, k in keys.items() if len(evicting[g])}
            tables, opt_state = self._fill_fn({k: state.tables[k] for k in swapped},
                                              {k: state.sparse_opt_state[k] for k in swapped}, fill, records)
            state = state.replace(tables={**state.tables, **tables},
                                  sparse_opt_state={**state.sparse_opt_state, **opt_state})
            for g, rows in evicting.items():
                if len(rows):
                    self._queue_write(_Eviction(g, rows, evicted[g]))
        self.stats["steps"] += 1
        self.stats["read_s"] += read_s
        self.stats["plan_s"] += time.perf_counter() - t0 - read_s
        return state, self._extras(db, slots)

    def prepare_predict(self, state, prepared):
        """A predict step's state, whose cached groups' slots are the batch's working set, and the step rows of the
        batch's distinct rows; the cache does not change."""
        self._check_writer()
        db: DiskBatch = prepared.extras[self.name]
        tables, slots = dict(state.tables), {}
        for g in self.layouts:
            sl = self.slots[g]
            step, at, rows = self._slots_and_misses(g, db.unique[g], train=False)
            tables[sl.key], misses = sl.working_set(self._working_sets[g], tables[sl.key], self.caches[g],
                                                    db.unique[g], at, rows, step,
                                                    lambda r, g=g: self._read_misses(g, r))
            self.stats["eval_misses"] += misses
            slots[g] = sl.step_sentinels(db.unique[g], step, train=False)
        self.stats["eval_batches"] += 1
        return state.replace(tables=tables), self._extras(db, slots)

    def example(self, state, prepared, *, train: bool):
        """A state and batch part of the compiled step's shapes, to lower it (nothing planned)."""
        db: DiskBatch = prepared.extras[self.name]
        extras = self._extras(db, {g: np.zeros(len(u), np.int32) for g, u in db.unique.items()})
        if not train:
            shapes = {}
            for g, sl in self.slots.items():
                shapes.update(sl.predict_shapes(state.tables, len(db.unique[g])))
            state = state.replace(tables={**state.tables, **shapes})
        return state, extras

    def stepped(self, state) -> None:
        self._latest = (state.tables, state.sparse_opt_state)

    # ------------------------------------------------------------------------------------------ write-back
    def _queue_write(self, eviction: _Eviction) -> None:
        with self._pending_lock:
            self._pending[eviction.group].append(eviction)
        t0 = time.perf_counter()
        self._writes.put(eviction)  # waits while the writer is _WRITES_IN_FLIGHT evictions behind
        self.stats["queue_wait_s"] += time.perf_counter() - t0

    def _write_loop(self) -> None:
        while True:
            eviction = self._writes.get()
            try:
                if eviction is None:
                    return
                if self._writer_error is None:
                    t0 = time.perf_counter()
                    self.stores[eviction.group].write(eviction.rows, eviction.host())
                    self.stats["write_s"] += time.perf_counter() - t0
                    with self._pending_lock:  # written: the store now holds these rows' newest values
                        self._pending[eviction.group].remove(eviction)
            except BaseException as error:  # kept pending (the store is stale); raised on the step loop
                self._writer_error = error
            finally:
                self._writes.task_done()

    def _check_writer(self) -> None:
        if self._writer_error is not None:
            raise self._writer_error

    def _drain(self) -> None:
        """Wait until every queued eviction is written."""
        self._writes.join()
        self._check_writer()

    # ------------------------------------------------------------------------------------------------ run
    def memory_use(self, optimizer: SparseOptimizer | None) -> MemoryUse:
        """The memory tables on the device (where the layout puts them), each cache's slots on every device block,
        and the host-tier tables' records in host RAM; the disk tables' rows are in their files. Records are f32
        (`widths`)."""
        resident = frozenset(name for layout in self.layouts.values() for name, _, _ in layout.resident)
        slots = sum(sl.parts * self.layouts[g].slots * self.widths[g] * 4 for g, sl in self.slots.items())
        in_ram = sum(rows * self.widths[g] * 4 for g, layout in self.layouts.items()
                     for _, _, rows, in_file in layout.cached if not in_file)
        return MemoryUse(device_tables=resident, device_extra=slots, host_extra=in_ram)

    def checkpoint_bytes(self, optimizer: SparseOptimizer | None) -> int:
        """What a baseline holds of the cached groups at once (read and written block by block: `CheckpointRows`,
        recjax/checkpoint/streamed.py). A block is `block_rows` records; per array (the rows and each optimizer
        field) the records read from the files, the array's block cut from them and the chunk Orbax encodes from
        it; and the records and block the digest reads."""
        total = 0
        for g, layout in self.layouts.items():
            rows = min(layout.rows, max(1, streamed.BLOCK_BYTES // (self.widths[g] * 4)))
            shapes = {"rows": (layout.rows, layout.dim), **self.optimizer.state_shapes(layout.rows, layout.dim)}
            blocks = [rows * math.prod(shape[1:]) * 4 for shape in shapes.values()]  # f32
            total += (len(blocks) + 1) * rows * self.widths[g] * 4 + 2 * sum(blocks) + max(blocks)
        return total

    def describe(self) -> str:
        blocks = max(sl.parts for sl in self.slots.values())
        lines = ["embedding tiers (tables on disk / in host RAM behind a row cache"
                 + ("; each device block's cached rows behind its own cache):" if blocks > 1 else "):")]
        for g, layout in self.layouts.items():
            parts = self.slots[g].parts
            tables = ", ".join(f"{name} ({rows:,} rows, {self.context.tiers[name]})"
                               for name, _, rows, _ in layout.cached)
            per = f"{layout.slots:,} slots" + (f" on each of {parts} device blocks" if parts > 1 else "")
            lines.append(f"  {g}: {tables}; cache {per} ({parts * layout.slots / layout.cached_rows:.1%} of "
                         f"{layout.cached_rows:,} rows), policy {self.policy}"
                         + (f", {len(self.pinned[g]):,} hot rows pinned" if g in self.pinned else ""))
        if self.directory is not None:
            lines.append(f"  table files in {self.directory}" + (" (removed at the end)" if self.temporary else ""))
        return "\n".join(lines)

    def summary(self) -> dict:
        groups = {}
        for g, cache in self.caches.items():
            store, width, layout = self.stores[g], self.widths[g], self.layouts[g]
            groups[g] = {"tables": {name: self.context.tiers[name] for name, *_ in layout.cached},
                         "cache_slots": layout.slots, "cached_rows": layout.cached_rows,
                         "lookups": cache.lookups, "hits": cache.hits, "misses": cache.misses,
                         "hit_rate": cache.hits / max(cache.lookups, 1), "evictions": cache.evictions,
                         "writebacks": cache.writebacks, "rows_read": store.rows_read,
                         "rows_written": store.rows_written, "bytes_read": store.rows_read * width * 4,
                         "bytes_written": store.rows_written * width * 4}
            if self.slots[g].parts > 1:
                groups[g]["devices"] = self.slots[g].parts
        return {"tiering": {"policy": self.policy, "prefetch": self.prefetch, "groups": groups, **self.stats}}

    def finish(self, state) -> None:
        """The final write-back (before the summary reads the peak memory): files kept after the run (`tiering.dir`)
        then hold the final tables; temporary ones are removed unwritten."""
        if not self.temporary:
            self.flush(state)

    def close(self) -> None:
        """Stop the writer (after the write-backs queued), close the files, release the table folder (a temporary
        one is removed). The files hold the final tables after `finish` (a run that ended normally); after an
        error, what was written back, and a resume rewrites them from its checkpoint."""
        if self._closed:
            return
        self._closed = True
        self._writes.put(None)
        self._writer.join()
        for store in self.stores.values():
            store.close()
        if self.folder is not None:
            self.folder.release()

    def rebuilt(self, collection) -> "DiskStorage":
        raise NotImplementedError("tables that change shape (dynamic methods) cannot be on the disk or host tier")


def profile_hot_rows(backend_unique, batches: Iterable, layouts: list[GroupLayout], count: int
                     ) -> dict[str, np.ndarray]:
    """The static policy's hot set: per group, the cached rows read by the most of the first `count` batches (each
    row counted once per batch), as many as the cache holds beside one step's rows; ties by row id."""
    seen: dict[str, list[np.ndarray]] = {layout.name: [] for layout in layouts}
    for _, batch in zip(range(count), batches, strict=False):
        unique = backend_unique(batch)
        for layout in layouts:
            rows = unique[layout.name]
            starts = np.asarray([start for _, start, _, _ in layout.cached])
            stops = np.asarray([start + rows for _, start, rows, _ in layout.cached])
            t = np.searchsorted(starts, rows, side="right") - 1
            cached = (t >= 0) & (rows < stops[np.maximum(t, 0)])
            seen[layout.name].append(rows[cached])
    hot = {}
    for layout in layouts:
        rows, counts = np.unique(np.concatenate(seen[layout.name] or [np.zeros(0, np.int64)]), return_counts=True)
        keep = layout.slots - layout.step_rows
        order = np.lexsort((rows, -counts))[:keep]
        hot[layout.name] = np.sort(rows[order]).astype(np.int64)
    return hot


def table_folder(text: str, layouts: list[GroupLayout], optimizer, workdir) -> TableFolder:
    """The folder for the disk tables' files, taken (its owner file locked; recjax/tiering/folders.py): `tiering.dir`,
    kept after the run, or ("") a temporary one, in the workdir (`workdir`; without one, in the system's temporary
    directory) -- after checking the disk has room for them."""
    folder = TableFolder(pathlib.Path(text), temporary=False) if text else TableFolder.temporary_in(workdir)
    key = "tiering.dir" if text or workdir is None else "--workdir"
    try:
        folder.take()
    except FolderInUse as error:
        raise ConfigError(key, f"{error}; wait for it to end, or use another "
                               + ("tiering.dir" if key == "tiering.dir" else "workdir")) from None
    except OSError as error:
        raise ConfigError(key, f"cannot create {folder.path}: {error.strerror}") from error
    need = 0
    for layout in layouts:
        width = layout.dim + sum(math.prod(s[1:]) for s in optimizer.state_shapes(1, layout.dim).values())
        need += sum(rows for _, _, rows, in_file in layout.cached if in_file) * width * 4
    free = shutil.disk_usage(folder.path).free
    if need > free:
        folder.release()
        raise ConfigError("tiering.dir", f"the disk tables need {need:,} bytes in {folder.path} but {free:,} are free; "
                                         "free space or point tiering.dir at a larger disk")
    return folder
