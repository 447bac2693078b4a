"""TieredEmbedding: physical tables on disk (or in host RAM) behind an in-RAM cache of rows, for the one step.

Layout. A stacked group holding a cached table (tier disk, or host on an accelerator) is, on the device, one array
f32[R + S, d] (and its optimizer state, same leading dim): its memory-tier tables' R rows (in stacking order) then S
cache slots; the cached tables' rows and optimizer-state rows live in a `RowStore` (recjax/tiering/store.py), and
`RowCache` (recjax/tiering/cache.py) says which row sits in which slot. Groups without a cached table are as on one
device. So the compiled step is the single-device one: it takes the batch's route, maps each stacked row to its
device row, and gathers, differentiates and updates in place exactly as in memory. A train step's route is the one
`put_batch` made ahead of the step (the batch's distinct rows are the cache's keys, so their device rows `cache_slots`
are carried in the same order and need no search); without dedup the step routes the batch itself and looks each
stacked row up in `cache_keys` (a searchsorted). Rows are exact copies and a step sees them in the same order, so a
tiered run equals the in-memory run bit for bit.

The pipeline, for training step i + 1 while step i runs on the device:
  1. prefetch thread (the trainer's `DevicePrefetcher` calls `put_batch`): the batch goes to the device and is
     routed (the train step's route, jitted apart from the step), and its distinct stacked rows per group are
     brought to the host.
  2. main thread, when the trainer calls the step with it (`TieredStep.__call__`), in step order: the cache plans
     the step (hits, misses, victims among slots the step does not use), the misses are read -- from the eviction
     of a row still on its way to the store if there is one, else from the store -- and the swap, queued behind
     step i on the device, reads the dirty victims' rows out of their slots (`_records`) and writes the misses in
     (`_fill`, in place); then step i + 1 is queued. JAX dispatches asynchronously, so all of this runs while step i
     computes.
  3. writer thread: each swap's evicted rows, once the device has produced them, are written to the store.

Why no row is evicted before use or read stale: a victim is never a slot of the step it is planned for, and the
swap that reuses it runs on the device after every earlier step (it takes their output tables), so earlier steps have
used and updated it and the swap reads its final value out. A row whose write-back is still pending is read from the
eviction itself, never from the store; rows reach the store in eviction order (one writer, FIFO). Evaluation reads
through the cache without changing it: the predict step gets a per-batch working set (the memory tables' rows, then
each of the batch's cached rows), so evaluating never moves the training cache.
"""

import dataclasses
import math
import pathlib
import queue
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from recjax.batch import Batch
from recjax.checkpoint import streamed
from recjax.checkpoint.streamed import RowBlocks
from recjax.embedding import EmbeddingCollection, Routes
from recjax.embedding_backend import EmbeddingBackend
from recjax.sparse_optim import SparseOptimizer
from recjax.tiering.cache import RowCache
from recjax.tiering.store import RowStore

# A swap moves a bucket of rows per group: the fewest of step_rows / 8, / 4, / 2 and step_rows that holds its misses
# and its write-backs (padding is dropped), so a run compiles at most four swaps per set of groups.
_BUCKETS = (8, 4, 2, 1)
_WRITES_IN_FLIGHT = 8  # evictions queued for the writer before the step loop waits for it


@flax.struct.dataclass
class SlottedBatch(Batch):
    """A batch as a tiered run's compiled step takes it: per group with cached tables, `cache_keys` i32[N] the
    batch's distinct stacked rows (the route's `unique`: sorted, padded with the sentinel `group_rows`) and
    `cache_slots` i32[N] the device row of each (the sentinel's is the array's row count: gathers zeros, dropped by
    the scatter)."""

    cache_keys: dict = flax.struct.field(default_factory=dict)
    cache_slots: dict = flax.struct.field(default_factory=dict)
    # A train step's route, made by `put_batch` (None: the step routes the batch; prediction, or no dedup).
    routes: Routes | None = None


@dataclasses.dataclass
class TieredBatch:
    """What `put_batch` hands the trainer: the batch on the device, per group with cached tables its distinct
    stacked rows (the route's `unique` i32[N]) on the host and on the device, and the train step's route of it when
    that route deduplicates (whose `unique` they are)."""

    batch: Batch
    unique: dict[str, np.ndarray]
    unique_device: dict[str, jax.Array]
    routes: Routes | None = None


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Where one stacked group's rows are when it holds a cached table."""

    name: str
    rows: int  # stacked rows (the single-device array's)
    dim: int
    resident: tuple[tuple[str, int, int], ...]  # memory tables: (name, first stacked row, rows), in stacking order
    cached: tuple[tuple[str, int, int, str], ...]  # cached tables: (name, first stacked row, rows, tier)
    slots: int  # S, cache slots
    step_rows: int  # the most distinct cached rows one call (of steps_per_call steps) can ask for

    @property
    def resident_rows(self) -> int:
        return sum(rows for _, _, rows in self.resident)

    @property
    def cached_rows(self) -> int:
        return sum(rows for _, _, rows, _ in self.cached)

    @property
    def device_rows(self) -> int:
        return self.resident_rows + self.slots

    def locate(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first stacked row, cached?, first device row of a resident table) of every table, by stacked row."""
        tables = sorted([(start, False, rows) for _, start, rows in self.resident]
                        + [(start, True, rows) for _, start, rows, _ in self.cached])
        starts = np.asarray([t[0] for t in tables], np.int64)
        cached = np.asarray([t[1] for t in tables], bool)
        device, at = np.zeros(len(tables), np.int64), 0
        for i, (_, is_cached, rows) in enumerate(tables):
            if not is_cached:
                device[i], at = at, at + rows
        return starts, cached, device


def _rows(array, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of a table array: a device or numpy array, or one read by row blocks."""
    return array.block(start, stop) if isinstance(array, RowBlocks) else np.asarray(array[start:stop])


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def call_text(batch_size: int, steps_per_call: int) -> str:
    """What one call of the compiled step reads, for messages: "one step of 512 examples", or with k steps per call
    "one call of 4 steps of 512 examples (train.steps_per_call)"."""
    if steps_per_call == 1:
        return f"one step of {batch_size} examples"
    return f"one call of {steps_per_call} steps of {batch_size} examples (train.steps_per_call)"


def _bucket(n: int, step_rows: int) -> int:
    return next(size for size in (-(-step_rows // k) for k in _BUCKETS) if size >= n)


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
    f32[group rows, ...] in the single-device layout, read where its rows live -- the memory tables' rows from the
    device array `device`, the cached tables' from the store -- and only when asked: `rows(ids)` for a delta's rows,
    `block(start, stop)` for a baseline, which writes it block by block (recjax/checkpoint/streamed.py). Valid
    until the next step (the backend writes the cache's dirty rows back first: `TieredEmbedding.checkpoint_state`)."""

    def __init__(self, backend: "TieredEmbedding", group: str, field: str | None, device: jax.Array):
        layout = backend.layouts[group]
        self.backend, self.group, self.device = backend, group, device
        self.shape = (layout.rows, *device.shape[1:])
        self.dtype = np.dtype(np.float32)
        start = 0 if field is None else layout.dim + sum(math.prod(s) for k, s in backend.fields[group].items()
                                                         if k < field)
        self.columns = slice(start, start + math.prod(self.shape[1:]))

    @property
    def block_rows(self) -> int:
        """Rows per block: as many whole records (the row and all its optimizer state, what the files hold) as fit in
        BLOCK_BYTES, so a block's read of the files is bounded too."""
        return max(1, streamed.BLOCK_BYTES // (self.backend.widths[self.group] * 4))

    def _from_records(self, records: np.ndarray) -> np.ndarray:
        # A copy: a view would keep the whole records (every field) alive while the block is written.
        return np.ascontiguousarray(records[:, self.columns]).reshape((len(records), *self.shape[1:]))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The stacked rows `ids` i64[n] (each < group rows)."""
        ids = np.asarray(ids, np.int64)
        starts, cached, device = self.backend._where[self.group]
        table = np.searchsorted(starts, ids, side="right") - 1
        on_store = cached[table]
        out = np.empty((len(ids), *self.shape[1:]), np.float32)
        if on_store.any():
            out[on_store] = self._from_records(self.backend.stores[self.group].read(ids[on_store], count=False))
        resident = np.flatnonzero(~on_store)
        if len(resident):
            t = table[resident]
            at = np.zeros(_power_of_two(len(resident)), np.int64)  # few shapes to compile (padding reads row 0)
            at[: len(resident)] = device[t] + ids[resident] - starts[t]
            out[resident] = np.asarray(self.device[jnp.asarray(at)])[: len(resident)]
        return out

    def block(self, start: int, stop: int) -> np.ndarray:
        """The stacked rows [start, stop), in order."""
        starts, cached, device = self.backend._where[self.group]
        out = np.empty((stop - start, *self.shape[1:]), np.float32)
        for t in range(len(starts)):
            first, end = int(starts[t]), int(starts[t + 1]) if t + 1 < len(starts) else self.shape[0]
            lo, hi = max(start, first), min(stop, end)
            if lo >= hi:
                continue
            if cached[t]:
                out[lo - start: hi - start] = self._from_records(self.backend.stores[self.group].read_range(lo, hi))
            else:
                at = int(device[t]) + lo - first
                out[lo - start: hi - start] = np.asarray(self.device[at: at + hi - lo])
        return out


class TieredEmbedding(EmbeddingBackend):
    """The collection's cached tables in `RowStore`s behind per-group `RowCache`s; everything else as on one device.

    layouts: the groups holding cached tables; directory: where the disk tables' files go (`temporary`: remove it on
    `close`); pinned: {group: rows} the static policy's hot set; prefetch False makes each step wait for the previous
    one before reading its misses (for measuring what the overlap hides).
    """

    # The trainer keeps at most this many steps queued: the misses of step i + 1 are read while step i runs, and the
    # host never plans far ahead of the device (evictions waiting for the writer stay few).
    steps_in_flight = 2
    # A checkpoint records the single-device layout (so an in-memory run restores it, and the reverse): a restore
    # builds that state and `place_state` writes its rows to fresh table files and empties the cache.
    restores_single_device = True

    def __init__(self, collection: EmbeddingCollection, optimizer: SparseOptimizer, layouts: Sequence[GroupLayout],
                 directory: pathlib.Path | None, *, temporary: bool = False, policy: str = "lru",
                 pinned: Mapping[str, np.ndarray] | None = None, prefetch: bool = True, io_threads: int = 16):
        self.collection, self.optimizer = collection, optimizer
        self.layouts = {layout.name: layout for layout in layouts}
        self.directory, self.temporary = directory, temporary
        self.policy, self.pinned = policy, dict(pinned or {})
        self.prefetch, self.io_threads = prefetch, io_threads
        # Record columns: the row, then each optimizer-state field (sorted by name) flattened.
        self.fields = {}
        for g, layout in self.layouts.items():
            shapes = optimizer.state_shapes(1, layout.dim)
            self.fields[g] = {k: shapes[k][1:] for k in sorted(shapes)}
        self.widths = {g: self.layouts[g].dim + sum(math.prod(s) for s in f.values()) for g, f in self.fields.items()}
        self._where = {g: layout.locate() for g, layout in self.layouts.items()}
        self.restores_by_rows = frozenset(self.layouts)  # `place_state` writes them to the files block by block
        self.stores: dict[str, RowStore] = {}
        self.caches: dict[str, RowCache] = {}
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
        self._uniques_fn = jax.jit(lambda ids, lengths: jax.lax.map(lambda x: self._unique(*x), (ids, lengths)))
        self._train_route_fn = jax.jit(self._train_route)
        # k stacked batches (a k-step call): each batch's route, one after the other in one call.
        self._train_routes_fn = jax.jit(lambda ids, lengths: jax.lax.map(lambda x: self._train_route(*x),
                                                                          (ids, lengths)))
        self._fill_fn = jax.jit(self._fill, donate_argnums=(0, 1))
        self._working_set_fn = jax.jit(self._working_set, static_argnums=(0,))
        self._records_fn = jax.jit(self._records)
        # plan_s / read_s: the host's planning and miss reads per step; write_s: the writer thread's write-backs;
        # queue_wait_s: the step loop blocked on a full write queue (the write-back not keeping up).
        self.stats = {"steps": 0, "plan_s": 0.0, "read_s": 0.0, "write_s": 0.0, "queue_wait_s": 0.0,
                      "rows_from_evictions": 0, "swap_rows": 0, "eval_batches": 0, "eval_misses": 0}

    # ------------------------------------------------------------------------------------------- device side
    def route(self, batch: SlottedBatch, aux: Mapping, *, train: bool) -> Routes:
        keys, slots = batch.cache_keys, batch.cache_slots
        if batch.routes is not None:
            # put_batch's route: its distinct rows are `keys` themselves, so `slots` are their device rows in order.
            routes = batch.routes
            unique = {g: slots[g] if g in keys else u for g, u in routes.unique.items()}
            features = routes.features
            if routes.unique_slots is not None:  # pool_from="table": the bags read stacked rows, found in `unique`
                features = {name: route.replace(slots=tuple(
                    unique[p.group][at] if p.group in keys else s
                    for p, s, at in zip(self.collection.placements[name], route.slots, routes.unique_slots[name],
                                        strict=True)))
                    for name, route in features.items()}
            return routes.replace(unique=unique, features=features)
        routes = self.collection.route(batch.ids, batch.lengths, aux=aux, dedup=None if train else False)
        assert not routes.deduplicated, "a deduplicating train route is made by put_batch"

        def device_rows(group: str, stacked: jax.Array) -> jax.Array:
            at = jnp.searchsorted(keys[group], stacked.reshape(-1), method="sort")
            return slots[group][at].reshape(stacked.shape)

        # Without dedup the slots are stacked rows themselves.
        return routes.replace(features={name: route.replace(slots=tuple(
            device_rows(p.group, s) if p.group in keys else s
            for p, s in zip(self.collection.placements[name], route.slots, strict=True)))
            for name, route in routes.features.items()})

    def fetch(self, tables, routes):
        return self.collection.gather(tables, routes), None

    def update(self, optimizer, tables, opt_state, routes, exchange, rows, row_grads, lr, step):
        tables, opt_state = self.collection.sparse_update(optimizer, dict(tables), dict(opt_state), routes, rows,
                                                          row_grads, lr, step)
        return tables, opt_state, self.collection.touched_rows(routes)

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

    def _working_set(self, resident_rows: int, table: jax.Array, source: jax.Array, extra: jax.Array) -> jax.Array:
        """f32[R + N, d]: the group's R memory-table rows, then each of a batch's distinct cached rows -- from device
        row `source` i32[N] where it is cached (>= 0), else `extra` f32[N, d] (misses; padding reads zeros)."""
        cached = jnp.where((source >= 0)[:, None], table.at[source].get(mode="fill", fill_value=0), extra)
        return jnp.concatenate([table[:resident_rows], cached])

    # --------------------------------------------------------------------------------------------- host side
    def init_tables(self, rng: jax.Array, optimizer: SparseOptimizer) -> tuple[dict, dict]:
        """Groups without a cached table as on one device; the others' cached rows and initial optimizer state go to
        their stores block by block (`collection.init_chunks`: the same bits as `init_tables`), the memory tables'
        rows to the device array's first rows, and the cache starts empty (the static policy's hot set loaded)."""
        tables, opt_state = {}, {}
        for g in sorted(self.collection.group_rows):
            if g not in self.layouts:
                tables[g] = self.collection.init_group(rng, g)
                opt_state[g] = optimizer.init(self.collection.group_rows[g], self.collection.group_dims[g])
                continue
            layout = self.layouts[g]
            store = self._new_store(g)
            resident = np.zeros((layout.resident_rows, layout.dim), np.float32)
            starts, cached, device = self._where[g]
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
        self.stores[group] = RowStore([(name, start, rows, directory if tier == "disk" else None)
                                       for name, start, rows, tier in layout.cached],
                                      self.widths[group], self.io_threads)
        self.caches[group] = self._new_cache(group)
        return self.stores[group]

    def _new_cache(self, group: str) -> RowCache:
        layout = self.layouts[group]
        return RowCache(layout.rows, layout.slots, self.policy, self.pinned.get(group))

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

    def place_state(self, state):
        """A state whose cached groups are in the single-device layout ({group: f32[group_rows, d]}) -> this layout:
        the cached tables' rows and state go to fresh stores, the cache starts empty. Groups already in this layout
        (made by `init_tables`; a cache never holds every row, so the shapes differ) pass through."""
        tables, opt_state, dirty = dict(state.tables), dict(state.sparse_opt_state), dict(state.dirty_rows)
        for g, layout in self.layouts.items():
            rows = tables[g].shape[0]
            if rows == layout.device_rows:
                continue
            assert rows == layout.rows, (g, rows, layout.rows, layout.device_rows)
            if g in dirty:  # a restored one-shot delta's rows stay dirty (by stacked row, here); the state's bitmap
                self.dirty[g] = np.array(dirty[g], bool)  # is over the device rows, unused
                dirty[g] = jnp.zeros(layout.device_rows, jnp.bool_)
            else:
                self.dirty.pop(g, None)
            arrays = [tables[g]] + [opt_state[g][k] for k in sorted(opt_state[g])]
            store = self._new_store(g)
            starts, cached, _ = self._where[g]
            resident = []  # blocks of the memory tables' rows, of each array
            # A block of records at a time, never a whole array (a restore's arrays are read from the checkpoint by
            # row blocks: `restores_by_rows`).
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
            tables[g], opt_state[g] = self._device_arrays(g, kept[0], dict(zip(sorted(opt_state[g]), kept[1:],
                                                                               strict=True)))
        return state.replace(tables=tables, sparse_opt_state=opt_state, dirty_rows=dirty)

    def local_state(self, state):
        """The single-device layout of `state` (every row: the stores' after writing the cache's dirty rows back).
        Holds every table whole: for tests and small tables."""
        view = self.checkpoint_state(state)
        return state.replace(tables={g: jnp.asarray(t) for g, t in view.tables.items()},
                             sparse_opt_state={g: {k: jnp.asarray(v) for k, v in o.items()}
                                               for g, o in view.sparse_opt_state.items()})

    def checkpoint_state(self, state):
        """`state` in the single-device layout a checkpoint records, its cached groups' arrays `CheckpointRows`
        (read on demand: a delta reads its rows only, a baseline every row) after the cache's dirty rows are written
        back to the stores -- the files then hold the tables as of this step -- and its cached groups' dirty-row
        bitmaps by stacked row."""
        self.write_back(state)
        tables, opt_state, dirty = dict(state.tables), dict(state.sparse_opt_state), dict(state.dirty_rows)
        for g in self.layouts:
            tables[g] = CheckpointRows(self, g, None, state.tables[g])
            opt_state[g] = {k: CheckpointRows(self, g, k, v) for k, v in state.sparse_opt_state[g].items()}
            if g in dirty:
                dirty[g] = self._dirty(g)
        return state.replace(tables=tables, sparse_opt_state=opt_state, dirty_rows=dirty)

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
        through the same mapping, and a restore rewrites the files, so nothing waits for the disk here)."""
        self._drain()
        tables, opt_state = (state.tables, state.sparse_opt_state) if state is not None else (self._latest or (None,
                                                                                                                 None))
        for g, cache in self.caches.items():
            rows, slots = cache.dirty_slots()
            if len(rows) and tables is not None:
                # Padded to a power of two with an out-of-range slot (read as zeros, dropped): a flush before each
                # checkpoint compiles a few shapes, not one per count of dirty rows.
                key, first, end = self._cache_array(g)
                device = np.full(_power_of_two(len(slots)), end, np.int32)
                device[: len(slots)] = first + slots
                records = np.asarray(self._records_fn(tables[key], opt_state[key], jnp.asarray(device)))
                self.stores[g].write(rows, records[: len(rows)])
                cache.mark_clean()

    def put_batch(self, batch, stacked: bool = False) -> TieredBatch:
        device = jax.device_put(batch)
        routes, unique = (self._train_routes_fn if stacked else self._train_route_fn)(device.ids, device.lengths)
        return TieredBatch(device, {g: np.asarray(u) for g, u in unique.items()}, unique, routes)

    def compile_train(self, train_step: Callable, state, stacked: bool = False) -> "TieredStep":
        return TieredStep(self, jax.jit(train_step, donate_argnums=(0,)), train=True)

    def compile_predict(self, predict_step: Callable, state) -> "TieredStep":
        return TieredStep(self, jax.jit(predict_step), train=False)

    def rebuilt(self, collection: EmbeddingCollection, optimizer: SparseOptimizer) -> "TieredEmbedding":
        raise NotImplementedError("tables that change shape (dynamic methods) cannot be on the disk or host tier")

    # -------------------------------------------------------------------------------------- the step's rows
    def _cache_array(self, group: str) -> tuple[str, int, int]:
        """Where `group`'s cache slots are in the state: (its key in `state.tables`, the array row of slot 0, the
        array's rows: an out-of-range row for padding). Here the group's array, after its memory tables' rows."""
        layout = self.layouts[group]
        return group, layout.resident_rows, layout.device_rows

    def _swap_rows(self, group: str, n: int) -> int:
        """The rows a swap of `n` misses or write-backs moves (padded: a few compiled shapes)."""
        return _bucket(n, self.layouts[group].step_rows)

    def _slots_and_misses(self, group: str, unique: np.ndarray, train: bool):
        """The rows the step sees for a batch's distinct stacked rows i32[N] (`_step_rows`; cached ones at their
        slot, from `_slot_base`), and the cached ones' plan (for prediction: their positions and rows, then the
        misses are those without a slot, and nothing moves)."""
        layout = self.layouts[group]
        starts, cached, _ = self._where[group]
        real = np.flatnonzero(unique < layout.rows)
        table = np.searchsorted(starts, unique[real], side="right") - 1
        out = self._step_rows(group, unique, real[~cached[table]], table[~cached[table]])
        at = real[cached[table]]
        rows = unique[at].astype(np.int64)
        if not train:
            return out, at, rows
        plan = self.caches[group].plan(rows, dirty=True)
        out[at] = self._slot_base(group) + plan.slots
        return out, at, plan

    def _step_rows(self, group: str, unique: np.ndarray, resident: np.ndarray, table: np.ndarray) -> np.ndarray:
        """i32[N]: the device row of each memory-table row (positions `resident` of `unique`, in tables `table`);
        padding and cached rows at the sentinel (the cached ones are filled in by the caller)."""
        starts, _, device = self._where[group]
        out = np.full(len(unique), self.layouts[group].device_rows, np.int32)
        out[resident] = device[table] + unique[resident] - starts[table]
        return out

    def _slot_base(self, group: str) -> int:
        """The step row of cache slot 0 (the slots follow the memory tables' rows)."""
        return self.layouts[group].resident_rows

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

    def prepare_train(self, state, tb: TieredBatch):
        """Plan a train step's rows, read its misses and queue the swap (behind the previous step): the state with
        the batch's rows in the cache, and the batch the compiled step takes. For k stacked batches (a k-step call,
        `tb.unique` {group: i32[k, N]}) the cache takes the union of their rows at once -- one plan, one swap --
        and holds it for the whole call (the layouts' `step_rows` count a call's rows); each batch gets its rows'
        slots."""
        self._check_writer()
        if not self.prefetch:  # measurement mode: read only once the previous step is done
            jax.block_until_ready(state.tables)
        t0 = time.perf_counter()
        slots, evict, fill, records, evicting = {}, {}, {}, {}, {}
        read_s = 0.0
        for g, layout in self.layouts.items():
            if state.dirty_rows:  # the in-memory step marks exactly the batch's distinct rows (`touched_rows`)
                self._dirty(g)[tb.unique[g][tb.unique[g] < layout.rows]] = True
            unique, where = tb.unique[g], None
            if unique.ndim == 2:  # k batches: plan their union (sorted; the sentinel padding stays last)
                unique, where = np.unique(unique.ravel(), return_inverse=True)
            slots[g], _, plan = self._slots_and_misses(g, unique, train=True)
            if where is not None:
                slots[g] = slots[g][where].reshape(tb.unique[g].shape)
            if not len(plan.miss_rows) and not len(plan.evict_rows):
                continue
            t1 = time.perf_counter()
            miss = self._read_misses(g, plan.miss_rows)
            read_s += time.perf_counter() - t1
            key, first, end = self._cache_array(g)
            m = e = self._swap_rows(g, max(len(plan.miss_rows), len(plan.evict_rows)))
            fill[key] = np.full(m, end, np.int32)
            fill[key][: len(plan.miss_rows)] = first + plan.miss_slots
            records[key] = np.zeros((m, self.widths[g]), np.float32)
            records[key][: len(miss)] = miss
            evict[key] = np.full(e, end, np.int32)
            evict[key][: len(plan.evict_rows)] = first + plan.evict_slots
            evicting[g] = plan.evict_rows
            self.stats["swap_rows"] += len(plan.miss_rows) + len(plan.evict_rows)
        if fill:
            keys = {g: self._cache_array(g)[0] for g in evicting}
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
        self.stats["steps"] += tb.batch.labels.shape[0] if tb.batch.labels.ndim == 2 else 1
        self.stats["read_s"] += read_s
        self.stats["plan_s"] += time.perf_counter() - t0 - read_s
        return state, self._slotted(tb, slots).replace(routes=tb.routes)

    def prepare_predict(self, state, tb: TieredBatch):
        """A predict step's state, whose cached groups are the batch's working set (`_working_set`), and its batch;
        the cache does not change."""
        self._check_writer()
        tables, slots = dict(state.tables), {}
        for g, layout in self.layouts.items():
            device, at, rows = self._slots_and_misses(g, tb.unique[g], train=False)
            n = len(tb.unique[g])
            cached_slot = self.caches[g].slots_of(rows)
            source = np.full(n, -1, np.int32)
            source[at] = np.where(cached_slot >= 0, layout.resident_rows + cached_slot, -1)
            extra = np.zeros((n, layout.dim), np.float32)
            misses = at[cached_slot < 0]
            if len(misses):
                extra[misses] = self._read_misses(g, unique_rows := rows[cached_slot < 0])[:, : layout.dim]
                self.stats["eval_misses"] += len(unique_rows)
            device[at] = layout.resident_rows + at  # the working set's cached rows follow the batch's order
            slots[g] = device
            tables[g] = self._working_set_fn(layout.resident_rows, tables[g], source, extra)
        self.stats["eval_batches"] += 1
        return state.replace(tables=tables), self._slotted(tb, slots, sentinel={
            g: layout.resident_rows + len(tb.unique[g]) for g, layout in self.layouts.items()})

    def _slotted(self, tb: TieredBatch, slots: dict, sentinel: dict | None = None) -> SlottedBatch:
        if sentinel:  # the working set is shorter than the training layout: its own out-of-range row
            for g in slots:
                slots[g] = np.where(tb.unique[g] < self.layouts[g].rows, slots[g], sentinel[g]).astype(np.int32)
        b = tb.batch
        return SlottedBatch(dense=b.dense, ids=b.ids, lengths=b.lengths, labels=b.labels,
                            cache_keys=tb.unique_device, cache_slots=jax.device_put(slots))

    def example_batch(self, tb: TieredBatch, *, train: bool) -> SlottedBatch:
        """A batch of the compiled step's shapes, to lower it (nothing planned)."""
        batch = self._slotted(tb, {g: np.zeros(u.shape, np.int32) for g, u in tb.unique.items()})
        return batch.replace(routes=tb.routes) if train else batch

    def example_predict_state(self, state, tb: TieredBatch):
        """A state of the predict step's shapes: the cached groups as working sets of `tb`'s distinct rows."""
        return state.replace(tables={**state.tables, **{
            g: jax.ShapeDtypeStruct((layout.resident_rows + len(tb.unique[g]), layout.dim), jnp.float32)
            for g, layout in self.layouts.items()}})

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
    def process_state_bytes(self, optimizer: SparseOptimizer) -> int:
        """Bytes of rows and optimizer state in memory (the memory check before a run): the collection's, less the
        disk tier's rows (in their files), plus each cache's slots. Records are f32 (`widths`)."""
        accounting = self.collection.accounting(optimizer)
        total = accounting["bytes"] + accounting["optimizer_bytes"]
        for g, layout in self.layouts.items():
            on_disk = sum(rows for _, _, rows, tier in layout.cached if tier == "disk")
            total += (layout.slots - on_disk) * self.widths[g] * 4
        return max(int(total), 0)

    def checkpoint_bytes(self, optimizer: SparseOptimizer) -> int:
        """What a baseline copies: the whole state (as on one device) less the cached groups' arrays, which are
        read and written block by block (`CheckpointRows`, recjax/checkpoint/streamed.py). A block is `block_rows`
        records; per array (the rows and each optimizer field) the records read from the files, the array's block
        cut from them and the chunk Orbax encodes from it; and the records and block the digest reads."""
        total = EmbeddingBackend.process_state_bytes(self, optimizer)
        for g, layout in self.layouts.items():
            rows = min(layout.rows, max(1, streamed.BLOCK_BYTES // (self.widths[g] * 4)))
            shapes = {"rows": (layout.rows, layout.dim), **optimizer.state_shapes(layout.rows, layout.dim)}
            blocks = []
            for shape in shapes.values():
                row_bytes = math.prod(shape[1:]) * 4  # f32
                total -= layout.rows * row_bytes
                blocks.append(rows * row_bytes)
            total += (len(blocks) + 1) * rows * self.widths[g] * 4 + 2 * sum(blocks) + max(blocks)
        return max(int(total), 0)

    def describe(self) -> str:
        lines = ["embedding tiers (tables on disk / in host RAM behind a row cache):"]
        for g, layout in self.layouts.items():
            tables = ", ".join(f"{name} ({rows:,} rows, {tier})" for name, _, rows, tier in layout.cached)
            lines.append(f"  {g}: {tables}; cache {layout.slots:,} slots ({layout.slots / layout.cached_rows:.1%} of "
                         f"{layout.cached_rows:,} rows), policy {self.policy}"
                         + (f", {len(self.pinned[g]):,} hot rows pinned" if g in self.pinned else ""))
        if self.directory is not None:
            lines.append(f"  table files in {self.directory}" + (" (removed at the end)" if self.temporary else ""))
        return "\n".join(lines)

    def summary(self) -> dict:
        groups = {}
        for g, cache in self.caches.items():
            store, width = self.stores[g], self.widths[g]
            groups[g] = {"tables": {name: tier for name, _, _, tier in self.layouts[g].cached},
                         "cache_slots": self.layouts[g].slots, "cached_rows": self.layouts[g].cached_rows,
                         "lookups": cache.lookups, "hits": cache.hits, "misses": cache.misses,
                         "hit_rate": cache.hits / max(cache.lookups, 1), "evictions": cache.evictions,
                         "writebacks": cache.writebacks, "rows_read": store.rows_read,
                         "rows_written": store.rows_written, "bytes_read": store.rows_read * width * 4,
                         "bytes_written": store.rows_written * width * 4}
        return {"tiering": {"policy": self.policy, "prefetch": self.prefetch, "groups": groups, **self.stats}}

    def close(self) -> None:
        """Write the cache's dirty rows back (the files then hold the final tables), stop the writer, close the
        files; a temporary directory is removed."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self.temporary and self._writer_error is None:
                self.flush()
        finally:
            self._writes.put(None)
            self._writer.join()
            for store in self.stores.values():
                store.close()
            if self.temporary and self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)


class TieredStep:
    """A compiled step behind the cache: each call prepares the batch's rows (`prepare_train` / `prepare_predict`)
    and runs the step. Lowers and compiles like a jitted function (the trainer compiles it up front)."""

    def __init__(self, backend: TieredEmbedding, step, *, train: bool, compiled=None):
        self.backend, self.step, self.train, self.compiled = backend, step, train, compiled

    def lower(self, state, batch: TieredBatch) -> "_Lowered":
        if not self.train:
            state = self.backend.example_predict_state(state, batch)
        return _Lowered(self, self.step.lower(state, self.backend.example_batch(batch, train=self.train)))

    def __call__(self, state, batch: TieredBatch):
        step = self.compiled or self.step
        if not self.train:
            return step(*self.backend.prepare_predict(state, batch))
        new_state, metrics = step(*self.backend.prepare_train(state, batch))
        self.backend._latest = (new_state.tables, new_state.sparse_opt_state)
        return new_state, metrics

    def cost_analysis(self):
        return self.compiled.cost_analysis()


@dataclasses.dataclass
class _Lowered:
    owner: TieredStep
    lowered: object

    def compile(self) -> TieredStep:
        o = self.owner
        return TieredStep(o.backend, o.step, train=o.train, compiled=self.lowered.compile())
