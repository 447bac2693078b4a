"""MeshTieredEmbedding: the disk (or host) tier on a device mesh, each device's block behind a row cache of its own.

The cache is a table the mesh already knows how to shard. For a group holding cached tables, on a plan that splits
them row-wise (or puts each on one device, table-wise) over P device blocks, the state holds one more storage,
"<group>/cache": f32[P * S, d] split like those tables' storage (`P(("data", "model"))`, or `P("model")` for a
row-wise split over the model axis), so block k holds device k's S cache slots. The cached tables' rows are in no
other storage; the group's memory tables keep their plan.

Each step, on the host (one process sees the whole global batch): each distinct cached row of the batch goes to the
device that owns it under the real plan (`Storage.locate` of the plan's storage, on the host) -- the owner the in-memory
mesh run uses, so every device serves the rows it would serve in memory --, that device's `RowCache` gives it a slot
(`PartitionedRowCache`: global slot k * S + j), and the step sees it as the *virtual stacked row* G + k S + j (G the
group's stacked rows), which the cache storage locates at owner k, local row j (a row-wise range split of P S rows in
chunks of S). Memory tables' rows keep their stacked row; padding goes to V = G + P S, in no storage. The map from
the batch's distinct stacked rows to these rows is replicated to every device (`SlottedBatch` with replicated
`cache_keys` / `cache_slots`), and each device rewrites its share's distinct rows with it (`route`), so the
exchange (recjax/sharding/exchange.py) runs unchanged: ids to their owners, rows back, gradients to their owners,
where each row's gradients are summed (in device order, as in memory) and the optimizer applied in place. Misses
are read from the store and scattered into their owners' blocks, dirty victims read out of them and written back,
behind the previous step, exactly as on one device (recjax/tiering/backend.py: `prepare_train`).

So a mesh run with the disk tier equals the in-memory mesh run of the same plan bit for bit: each row's value is an
exact copy, its gradient contributions reach the same owner from the same devices in the same order, and the
optimizer's row rule does not depend on where a row sits. What differs is only the shapes of the all_to_all buckets
(the cache's storage has its own capacity), so the `bucket_overflows` metric may differ.

Evaluation does not move the cache: the predict step gets a working set of the cache storage's shape, each owner's
block holding the batch's distinct rows it owns (from its cache where they are cached, else from the store), built
beside the cache (O(cache) device memory per eval batch).

Checkpoints record the single-device layout, as one device's tier does (`checkpoint_state`: the caches' dirty rows
written back, the cached tables' rows read from the stores, the memory tables' from their storages; Check-N-Run's
dirty rows of a cached group kept by stacked row on the host); a restore builds that state and `place_state` writes
the cached rows to fresh stores and lays the rest out by the plan. So a checkpoint moves between one device, the
in-memory mesh and this placement.

Under `sharding.plan=auto` the cached tables are pinned row-wise (`recjax.tiering.setup`). Not supported (refused
there with a ConfigError): multi-process runs (each process sees only its share of a batch, and the caches' plan needs
the whole batch), column-wise or replicated cached tables (every device would need every cached row), the cached
tables of one group split over different axes, and the static policy (its hot set would be profiled per device).
"""

import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from recjax.embedding import EmbeddingCollection, Routes
from recjax.errors import ConfigError
from recjax.sharding.backend import MeshEmbedding
from recjax.sharding.exchange import Storage, build_storages, group_layout
from recjax.sharding.placement import ALL_AXES, batch_spec, put_global, to_host
from recjax.sharding.plan import ShardingPlan, format_plan
from recjax.sparse_optim import SparseOptimizer
from recjax.tiering.backend import (
    CheckpointRows,
    GroupLayout,
    SlottedBatch,
    TieredBatch,
    TieredEmbedding,
    TieredStep,
    _power_of_two,
    call_text,
)
from recjax.tiering.cache import PartitionedRowCache

_CACHE = "cache"  # the cache storage of group g is "g/cache"


def cached_storages(storages: Mapping[str, Storage], cached: Mapping[str, Sequence[str]], collection) -> dict:
    """{group: the plan's storage holding the group's cached tables}; a ConfigError names a cached table the tier
    cannot serve on a mesh (column-wise or replicated), or a group whose cached tables are split over different
    axes."""
    placed = {p.table.name: p for p in collection.physical_tables()}
    out = {}
    for group, names in cached.items():
        holders = set()
        for name in names:
            p = placed[name]
            t = [q.offset for q in collection.physical_tables() if q.group == group].index(p.offset)
            s = next(s for s in storages.values() if s.group == group and s.member[t])
            if s.kind not in ("sharded", "model"):
                how = "column-wise" if s.kind == "column" else "replicated"
                raise ConfigError("sharding.tables", f"table {name!r} is on the disk / host tier and placed {how}: "
                                                     "on a mesh a cached table must be split row-wise or placed "
                                                     f"table-wise (e.g. --config.sharding.tables={name}=row), or "
                                                     "kept in memory")
            holders.add(s.name)
        if len(holders) > 1:
            raise ConfigError("sharding.tables", f"the cached tables {list(names)} of group {group} are split over "
                                                 f"different mesh axes ({sorted(holders)}): each device's cache "
                                                 "serves one split; split them over the same axes (sharding.row_axes)")
        out[group] = storages[holders.pop()]
    return out


def plan_mesh_layouts(collection, tiers: Mapping[str, str], plan: ShardingPlan, batch_size: int,
                      cache_fraction: float = 0.1, cache_rows: int = 0, steps_per_call: int = 1) -> list[GroupLayout]:
    """The layout of every group holding a cached table on a mesh: S = `slots` cache slots on each device block
    (`cache_rows`, or `cache_fraction` of the cached rows the fullest block owns, rounded up), which must hold the
    distinct rows one call's global batches (`steps_per_call` of them) can bring a block and fewer than every row a
    block owns. `step_rows` is the most distinct cached rows one call reads over all blocks (the swap's bucket)."""
    examples = batch_size * steps_per_call  # a call's batches' rows share the caches for the whole call
    storages = build_storages(collection, plan)
    cached = {}
    for p in collection.physical_tables():
        if tiers[p.table.name] != "memory":
            cached.setdefault(p.group, []).append(p.table.name)
    holders = cached_storages(storages, cached, collection)
    layouts = []
    for group in sorted(cached):
        placed = [p for p in collection.physical_tables() if p.group == group]
        s = holders[group]
        mine = np.array([tiers[p.table.name] != "memory" for p in placed])
        bags = np.array([collection.slots_per_example(p) for p in placed], np.int64)
        owned = s.part_rows[:, mine].sum(axis=1)  # i64[P] cached rows each block owns
        per_step = np.minimum(s.part_rows[:, mine], examples * bags[mine][None, :]).sum(axis=1)
        slots = cache_rows or math.ceil(cache_fraction * int(owned.max()))
        key = "tiering.cache_rows" if cache_rows else "tiering.cache_fraction"
        names = ", ".join(cached[group])
        need = int(per_step.max())
        if slots < need:
            # Every row a step brings a device must sit in that device's cache during the step, and any one device
            # may own all of a step's rows of a table: the bound is per device, not the global step's rows / P.
            raise ConfigError(key, f"group {group}'s cache of {slots:,} rows per device cannot hold the {need:,} "
                                   f"distinct rows of its tables {names} {call_text(batch_size, steps_per_call)} can "
                                   f"bring one device; raise it to at least {need:,} rows per device "
                                   f"(tiering.cache_fraction >= {need / owned.max():.3g} of the {int(owned.max()):,} "
                                   f"rows the fullest device owns) or lower train.batch_size"
                                   + (" or train.steps_per_call" if steps_per_call > 1 else ""))
        if slots >= owned.max():
            raise ConfigError(key, f"group {group}'s cache of {slots:,} rows per device holds all {int(owned.max()):,} "
                                   f"rows of its tables {names} any device owns: keep them in memory "
                                   "(tiering.tables) or lower the cache")
        resident = tuple((p.table.name, p.offset, p.table.rows) for p, m in zip(placed, mine, strict=True) if not m)
        tables = tuple((p.table.name, p.offset, p.table.rows, tiers[p.table.name])
                       for p, m in zip(placed, mine, strict=True) if m)
        step_rows = min(int(owned.sum()), int(per_step.sum()))
        layouts.append(GroupLayout(group, collection.group_rows[group], collection.group_dims[group], resident,
                                   tables, slots, step_rows))
    return layouts


def cache_storage(holder: Storage, cached: np.ndarray, slots: int) -> Storage:
    """The storage of a group's cache slots: P S virtual rows from the group's stacked rows G on, split like
    `holder` (the plan's storage of the cached tables, members `cached` bool[T]) in range chunks of S. Its capacity
    per owner counts the cached rows the owner really holds (at most S), so a table-wise table's cache fills one
    device's buckets, as in memory."""
    parts, g = holder.parts, holder.group_rows
    owned = np.minimum(holder.part_rows[:, cached].sum(axis=1), slots)
    return Storage(
        name=f"{holder.group}/{_CACHE}", group=holder.group, kind=holder.kind, axes=holder.axes,
        replica_axes=holder.replica_axes, parts=parts, local_rows=slots, dim=holder.dim,
        group_rows=g + parts * slots, offsets=np.array([0, g], np.int32), member=np.array([False, True]),
        split=np.array([1, parts], np.int32), chunk=np.array([1, slots], np.int32), modulo=np.zeros(2, bool),
        device=np.stack([np.zeros(parts, np.int32), np.arange(parts, dtype=np.int32)]),
        base=np.zeros((2, parts), np.int32), part_rows=np.stack([np.zeros(parts, np.int64), owned], axis=1),
        table_bags=np.array([0, holder.table_bags[cached].sum()], np.int64),
        source=np.full(parts * slots, -1, np.int64))


class MeshTieredEmbedding(TieredEmbedding):
    """The collection's tables laid out by `plan` on `mesh`, the cached ones (`layouts`, from `plan_mesh_layouts`)
    in `RowStore`s behind a row cache per device block; the rest of the arguments as `TieredEmbedding`'s and
    `MeshEmbedding`'s."""

    def __init__(self, collection: EmbeddingCollection, optimizer: SparseOptimizer, plan: ShardingPlan, mesh: Mesh,
                 layouts: Sequence[GroupLayout], directory, *, exchange_dtype: str = "float32",
                 capacity_factor: float = 0.0, capacity_sigmas: float = 0.0, temporary: bool = False,
                 policy: str = "lru", prefetch: bool = True, io_threads: int = 16):
        if policy == "static":  # `recjax.tiering.setup` refuses it with a ConfigError
            raise ValueError("the static policy is not supported on a mesh")
        names = {g.name: [name for name, *_ in g.cached] for g in layouts}
        self.holders = cached_storages(build_storages(collection, plan), names, collection)
        storages = build_storages(collection, plan, skip=frozenset(n for v in names.values() for n in v))
        for g in layouts:
            mine = np.array([p.table.name in names[g.name] for p in collection.physical_tables()
                             if p.group == g.name])
            storages[f"{g.name}/{_CACHE}"] = cache_storage(self.holders[g.name], mine, g.slots)
        self.mesh_embedding = MeshEmbedding(collection, plan, mesh, exchange_dtype, capacity_factor, capacity_sigmas,
                                            storages=storages)
        self.plan, self.mesh, self.storages = plan, mesh, self.mesh_embedding.storages
        self.shards = mesh.size
        self._replicated = NamedSharding(mesh, P())
        super().__init__(collection, optimizer, layouts, directory, temporary=temporary, policy=policy,
                         prefetch=prefetch, io_threads=io_threads)
        self._mesh_working_set_fn = {
            g: jax.jit(_working_set, out_shardings=NamedSharding(mesh, self.storages[f"{g}/{_CACHE}"].spec))
            for g in self.layouts}

    # ------------------------------------------------------------------------------------------- device side
    def route(self, batch: SlottedBatch, aux: Mapping, *, train: bool) -> Routes:
        """The plan's route of this device's share (always deduplicated: the exchange moves distinct rows), its cached
        groups' distinct rows rewritten to the rows the step sees (virtual rows of the cache storage)."""
        routes = self.collection.route(batch.ids, batch.lengths, aux=aux, dedup=True)
        keys, rows = batch.cache_keys, batch.cache_slots

        def step_rows(group: str, unique: jax.Array) -> jax.Array:
            at = jnp.minimum(jnp.searchsorted(keys[group], unique, method="sort"), keys[group].shape[0] - 1)
            # This share's padding may be missing from the global batch's distinct rows (when they fill its buffer).
            return jnp.where(unique >= self.layouts[group].rows, self._sentinel(group), rows[group][at])

        return routes.replace(unique={g: step_rows(g, u) if g in keys else u for g, u in routes.unique.items()})

    def fetch(self, tables, routes):
        return self.mesh_embedding.fetch(tables, routes)

    def update(self, optimizer, tables, opt_state, routes, exchange, rows, row_grads, lr, step):
        return self.mesh_embedding.update(optimizer, tables, opt_state, routes, exchange, rows, row_grads, lr, step)

    def all_reduce(self, tree):
        return self.mesh_embedding.all_reduce(tree)

    def device_rng(self, rng: jax.Array) -> jax.Array:
        return self.mesh_embedding.device_rng(rng)

    def step_metrics(self, exchange) -> dict[str, jax.Array]:
        return self.mesh_embedding.step_metrics(exchange)

    # ------------------------------------------------------------------------------------- the caches' layout
    def _sentinel(self, group: str) -> int:
        return self.storages[f"{group}/{_CACHE}"].group_rows

    def _cache_array(self, group: str) -> tuple[str, int, int]:
        return f"{group}/{_CACHE}", 0, self.storages[f"{group}/{_CACHE}"].parts * self.layouts[group].slots

    def _new_cache(self, group: str) -> PartitionedRowCache:
        holder, layout = self.holders[group], self.layouts[group]
        return PartitionedRowCache(layout.rows, layout.slots, holder.parts,
                                   lambda rows: holder.locate(rows, xp=np)[1], self.policy)

    def _swap_rows(self, group: str, n: int) -> int:
        """Powers of two from 256 up to the step's bound: the bound sums what a step could bring every device, many
        times what it brings them (e.g. ~30k rows against ~350 misses a step), and every padded row is copied to
        every device."""
        return min(self.layouts[group].step_rows, max(256, _power_of_two(n)))

    def _step_rows(self, group: str, unique: np.ndarray, resident: np.ndarray, table: np.ndarray) -> np.ndarray:
        """Memory tables' rows as they are (the exchange locates them), padding at the sentinel."""
        return np.where(unique < self.layouts[group].rows, unique, self._sentinel(group)).astype(np.int32)

    def _slot_base(self, group: str) -> int:
        """A slot's virtual row: after the group's stacked rows (`cache_storage`)."""
        return self.layouts[group].rows

    # --------------------------------------------------------------------------------------------- host side
    def place_state(self, state):
        """A state in the single-device layout (or with its cached groups as `init_tables` made them) -> the mesh:
        the cached tables' rows in fresh stores (`TieredEmbedding.place_state`), every other table by its plan, each
        cache storage empty (zeros), the rest replicated."""
        state = super().place_state(state)  # cached groups: their memory tables' rows, then S empty slots
        replicated = self._replicated

        def put(x):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
            return put_global(np.asarray(x), replicated)

        def lay_out(s: Storage, by_group: Mapping) -> jax.Array:
            sharding = NamedSharding(self.mesh, s.spec)
            if s.name.endswith(f"/{_CACHE}"):
                shape = (s.parts * s.local_rows, *by_group[s.group].shape[1:])
                return jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding)()
            source = self._source(s)
            data = np.asarray(by_group[s.group])[np.maximum(source, 0)]
            data[source < 0] = 0
            return put_global(data, sharding)

        fields = sorted({f for v in state.sparse_opt_state.values() for f in v})
        tables = {name: lay_out(s, state.tables) for name, s in self.storages.items()}
        opt = {name: {f: lay_out(s, {g: v[f] for g, v in state.sparse_opt_state.items()}) for f in fields}
               for name, s in self.storages.items()}
        dirty = {}
        if state.dirty_rows:  # cached groups' bitmaps are kept by stacked row on the host (`self.dirty`)
            for name, s in self.storages.items():
                rows = np.zeros(s.parts * s.local_rows if s.kind in ("sharded", "model") else s.local_rows, bool)
                if s.group not in self.layouts:
                    rows = np.asarray(state.dirty_rows[s.group])[np.maximum(s.source, 0)] & (s.source >= 0)
                dirty[name] = put_global(rows, NamedSharding(self.mesh, s.row_spec))
        return state.replace(
            step=put(state.step), dense_params=jax.tree.map(put, state.dense_params),
            dense_opt_state=jax.tree.map(put, state.dense_opt_state), tables=tables, sparse_opt_state=opt,
            dirty_rows=dirty, dropout_rng=put(state.dropout_rng), aux=jax.tree.map(put, state.aux))

    def _source(self, s: Storage) -> np.ndarray:
        """i64[rows of s]: where each of storage `s`'s global rows comes from in its group's array as `place_state`
        gets it -- the stacked row, or for a cached group the row among its memory tables' rows (the first rows of
        that group's array); -1 = none."""
        if s.group not in self.layouts:
            return s.source
        starts, _, device = self._where[s.group]
        source = np.maximum(s.source, 0)
        t = np.searchsorted(starts, source, side="right") - 1
        return np.where(s.source >= 0, device[t] + source - starts[t], -1)

    def _resident(self, group: str, by_storage: Mapping[str, np.ndarray]) -> np.ndarray:
        """The inverse of `_source` for a cached group: its memory tables' rows f32[R, ...] from the storages."""
        layout = self.layouts[group]
        out = None
        for name, s in self.storages.items():
            if s.group != group or name.endswith(f"/{_CACHE}"):
                continue
            data, source = by_storage[name], self._source(s)
            if out is None:
                out = np.zeros((layout.resident_rows, *data.shape[1:]), data.dtype)
            out[source[source >= 0]] = data[source >= 0]
        if out is None:
            shape = by_storage[f"{group}/{_CACHE}"].shape[1:]
            out = np.zeros((0, *shape), np.float32)
        return out

    def local_state(self, state):
        """The single-device layout of `state` on the default device (every row: the stores' after writing the caches'
        dirty rows back). Holds every table whole: for tests and small tables."""
        view = self.checkpoint_state(state)
        device = lambda tree: jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), tree)  # noqa: E731
        return view.replace(tables=device(view.tables), sparse_opt_state=device(view.sparse_opt_state))

    def checkpoint_state(self, state):
        """`state` in the single-device layout (host arrays): groups without cached tables from their storages, the
        cached groups' arrays `CheckpointRows` (memory tables' rows from their storages, cached tables' rows from the
        stores, after the caches' dirty rows are written back)."""
        self.write_back(state)
        host = lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else to_host(x)  # noqa: E731
        fields = sorted({f for v in state.sparse_opt_state.values() for f in v})
        plain = {name: s for name, s in self.storages.items() if s.group not in self.layouts}
        tables = group_layout(plain, {name: to_host(state.tables[name]) for name in plain})
        opt = {f: group_layout(plain, {name: to_host(state.sparse_opt_state[name][f]) for name in plain})
               for f in fields}
        opt_state = {g: {f: opt[f][g] for f in fields} for g in tables}
        mine = {name: s for name, s in self.storages.items() if s.group in self.layouts}
        for g in self.layouts:
            tables[g] = CheckpointRows(self, g, None, self._resident(
                g, {name: to_host(state.tables[name]) for name, s in mine.items() if s.group == g}))
            opt_state[g] = {f: CheckpointRows(self, g, f, self._resident(
                g, {name: to_host(state.sparse_opt_state[name][f]) for name, s in mine.items() if s.group == g}))
                for f in fields}
        dirty = {}
        if state.dirty_rows:
            dirty = group_layout(plain, {name: to_host(state.dirty_rows[name]) for name in plain})
            dirty.update({g: self._dirty(g) for g in self.layouts})
        return state.replace(step=host(state.step), dense_params=jax.tree.map(host, state.dense_params),
                             dense_opt_state=jax.tree.map(host, state.dense_opt_state), tables=tables,
                             sparse_opt_state=opt_state, dirty_rows=dirty, aux=jax.tree.map(host, state.aux))

    def put_batch(self, batch, stacked: bool = False) -> TieredBatch:
        """The batch split over the devices; its distinct stacked rows per cached group on the host and, replicated,
        on every device (each device maps its share's rows with them). `stacked`: k batches, each one's rows."""
        device = self.mesh_embedding.put_batch(batch, stacked)
        unique = (self._uniques_fn if stacked else self._unique_fn)(device.ids, device.lengths)
        unique = {g: np.asarray(u) for g, u in unique.items()}
        return TieredBatch(device, unique, jax.device_put(unique, self._replicated))

    def _slotted(self, tb: TieredBatch, slots: dict, sentinel: dict | None = None) -> SlottedBatch:
        b = tb.batch
        return SlottedBatch(dense=b.dense, ids=b.ids, lengths=b.lengths, labels=b.labels,
                            cache_keys=tb.unique_device, cache_slots=jax.device_put(slots, self._replicated))

    def prepare_predict(self, state, tb: TieredBatch):
        """A predict step's state, whose cache storages are the batch's working sets, and its batch; the caches do not
        change. Owner k's block holds the batch's distinct cached rows it owns (in batch order), read from its cache
        slot or, for a miss, from the store."""
        self._check_writer()
        tables, slots = dict(state.tables), {}
        for g, layout in self.layouts.items():
            out, at, rows = self._slots_and_misses(g, tb.unique[g], train=False)
            key = self._cache_array(g)[0]
            cache = self.caches[g]
            owner = cache.owner(rows).astype(np.int64)
            order = np.argsort(owner, kind="stable")
            counts = np.bincount(owner, minlength=len(cache.parts))
            rank = np.empty(len(rows), np.int64)
            rank[order] = np.arange(len(rows)) - (np.cumsum(counts) - counts)[owner[order]]
            place = owner * layout.slots + rank
            n = len(tb.unique[g])
            source = np.full(n, -1, np.int32)
            extra = np.zeros((n, layout.dim), np.float32)
            target = np.full(n, self._cache_array(g)[2], np.int32)  # padding: out of range, dropped
            source[: len(rows)] = cache.slots_of(rows)
            target[: len(rows)] = place
            misses = np.flatnonzero(source[: len(rows)] < 0)
            if len(misses):
                extra[misses] = self._read_misses(g, rows[misses])[:, : layout.dim]
                self.stats["eval_misses"] += len(misses)
            out[at] = layout.rows + place
            slots[g] = out
            tables[key] = self._mesh_working_set_fn[g](tables[key], target, source, extra)
        self.stats["eval_batches"] += 1
        return state.replace(tables=tables), self._slotted(tb, slots)

    def example_predict_state(self, state, tb: TieredBatch):
        return state  # the working sets have the caches' shapes

    def _batch_specs(self, stacked: bool = False) -> SlottedBatch:
        """The compiled step's batch: split over every device, the cache maps replicated."""
        split = batch_spec(stacked)
        return SlottedBatch(dense=split, ids=split, lengths=split, labels=split, cache_keys=P(), cache_slots=P())

    def compile_train(self, train_step: Callable, state, stacked: bool = False) -> TieredStep:
        specs = self.mesh_embedding.state_specs(state)
        step = jax.shard_map(train_step, mesh=self.mesh, in_specs=(specs, self._batch_specs(stacked)),
                             out_specs=(specs, P()), check_vma=False)
        return TieredStep(self, jax.jit(step, donate_argnums=(0,)), train=True)

    def compile_predict(self, predict_step: Callable, state) -> TieredStep:
        specs = self.mesh_embedding.state_specs(state)
        step = jax.shard_map(predict_step, mesh=self.mesh, in_specs=(specs, self._batch_specs()),
                             out_specs=P(ALL_AXES), check_vma=False)
        return TieredStep(self, jax.jit(step), train=False)

    def to_host(self, array: jax.Array) -> np.ndarray:
        return to_host(array)

    # ------------------------------------------------------------------------------------------------ run
    def process_state_bytes(self, optimizer: SparseOptimizer) -> int:
        """The plan's bytes on every device, less the cached tables' (in their stores), plus the caches' slots and
        the host's copy of the cached groups' rows in their stores when not on disk."""
        total = sum(self.plan.device_bytes())
        for g, layout in self.layouts.items():
            width = self.widths[g] * 4
            total -= layout.cached_rows * width
            total += self.storages[f"{g}/{_CACHE}"].parts * layout.slots * width
            total += sum(rows for _, _, rows, tier in layout.cached if tier != "disk") * width
        return max(int(total), 0)

    def describe(self) -> str:
        lines = [format_plan(self.plan), "embedding tiers on the mesh (each device block's cached rows behind its own "
                                         "row cache):"]
        for g, layout in self.layouts.items():
            parts = self.storages[f"{g}/{_CACHE}"].parts
            tables = ", ".join(f"{name} ({rows:,} rows, {tier})" for name, _, rows, tier in layout.cached)
            lines.append(f"  {g}: {tables}; a cache of {layout.slots:,} slots on each of {parts} device blocks "
                         f"({parts * layout.slots / layout.cached_rows:.1%} of {layout.cached_rows:,} rows), "
                         f"policy {self.policy}")
        if self.directory is not None:
            lines.append(f"  table files in {self.directory}" + (" (removed at the end)" if self.temporary else ""))
        return "\n".join(lines)

    def summary(self) -> dict:
        out = super().summary()
        for g, group in out["tiering"]["groups"].items():
            group["devices"] = self.storages[f"{g}/{_CACHE}"].parts
        return {**out, "mesh_shape": dict(self.plan.mesh_shape), "processes": jax.process_count(),
                "exchange_dtype": str(self.mesh_embedding.exchange.exchange_dtype)}


def _working_set(cache: jax.Array, target: jax.Array, source: jax.Array, extra: jax.Array) -> jax.Array:
    """f32[P S, d] of the cache's shape: at `target` i32[N] (out of range: dropped) the row of cache slot `source`
    i32[N] where it is >= 0, else `extra` f32[N, d]; zeros elsewhere."""
    rows = jnp.where((source >= 0)[:, None], cache.at[source].get(mode="fill", fill_value=0), extra)
    return jnp.zeros_like(cache).at[target].set(rows, mode="drop")

