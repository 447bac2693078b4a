"""Where a cached group's slots sit in a layout's arrays, and how the step's rows map onto them.

A storage that keeps a group's rows off the device behind a cache of S rows (recjax/tiering/storage.py) asks the
layout for its slots (`Layout.cache_slots`), which answers with one of these:

    GroupSlots (one device)   the group's array f32[R + S, d]: its memory tables' R rows (compacted, in stacking
                              order), then the S slots. A stacked row of a memory table maps to its compacted row, a
                              cached row to R + its slot; padding to R + S (gathers zeros, dropped by the scatter).
    BlockSlots (a mesh)       one more array "<group>/cache" f32[P S, d], split like the plan's array that holds the
                              cached tables (P device blocks of S slots); the group's memory tables keep their plan.
                              A cached row owned by block k sits in slot k S + j and the step sees it as the virtual
                              stacked row G + k S + j, which the cache array locates at owner k, local row j, so the
                              exchange runs unchanged; memory tables' rows keep their stacked row.

Both answer the same questions (the slots' array, the cache directory, the step row of each of a batch's rows, the
route rewrite, the predict step's working set, how the group's arrays are laid out and read back), so the storage's
pipeline is written once. Plans of the caches' sizes (`plan_group_layouts`, `plan_block_layouts`) check that a cache
holds one step's rows and fewer than all.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from recjax.embedding import Routes
from recjax.errors import ConfigError
from recjax.sharding.exchange import MeshArray, mesh_arrays
from recjax.sharding.placement import put_global, to_host
from recjax.sharding.plan import ShardingPlan
from recjax.tiering.cache import PartitionedRowCache, RowCache

# A one-device swap moves a bucket of rows per group: the fewest of step_rows / 8, / 4, / 2 and step_rows that holds
# its misses and its write-backs (padding is dropped), so a run compiles at most four swaps per set of groups.
_BUCKETS = (8, 4, 2, 1)
_CACHE = "cache"  # a mesh's cache array of group g is "g/cache"


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Where one stacked group's rows are when it holds a cached table."""

    name: str
    rows: int  # stacked rows (the single-device array's)
    dim: int
    resident: tuple[tuple[str, int, int], ...]  # memory tables: (name, first stacked row, rows), in stacking order
    cached: tuple[tuple[str, int, int, bool], ...]  # cached tables: (name, first stacked row, rows, in a file?)
    slots: int  # S, cache slots (per device block on a mesh)
    step_rows: int  # the most distinct cached rows one step can ask for

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
        """(first stacked row, cached?, first compacted row of a memory table) of every table, by stacked row."""
        tables = sorted([(start, False, rows) for _, start, rows in self.resident]
                        + [(start, True, rows) for _, start, rows, _ in self.cached])
        starts = np.asarray([t[0] for t in tables], np.int64)
        cached = np.asarray([t[1] for t in tables], bool)
        device, at = np.zeros(len(tables), np.int64), 0
        for i, (_, is_cached, rows) in enumerate(tables):
            if not is_cached:
                device[i], at = at, at + rows
        return starts, cached, device


def power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _group_tables(collection, group: str, cached: Mapping[str, bool]):
    placed = [p for p in collection.physical_tables() if p.group == group]
    resident = tuple((p.table.name, p.offset, p.table.rows) for p in placed if p.table.name not in cached)
    tables = tuple((p.table.name, p.offset, p.table.rows, cached[p.table.name]) for p in placed
                   if p.table.name in cached)
    return placed, resident, tables


def plan_group_layouts(collection, cached: Mapping[str, bool], batch_size: int, cache_fraction: float = 0.1,
                       cache_rows: int = 0) -> list[GroupLayout]:
    """One device: the layout of every group holding a table of `cached` ({physical table: its rows in a file?}):
    its memory tables, its cached tables, and a cache of `cache_rows` slots (0: `cache_fraction` of the cached rows,
    rounded up), which must hold one step's distinct cached rows and fewer than all of them."""
    layouts = []
    for group in sorted(collection.group_rows):
        placed, resident, tables = _group_tables(collection, group, cached)
        if not tables:
            continue
        total = sum(rows for _, _, rows, _ in tables)
        step_rows = min(total, sum(min(p.table.rows, batch_size * collection.slots_per_example(p))
                                   for p in placed if p.table.name in cached))
        slots = cache_rows or math.ceil(cache_fraction * total)
        key = "tiering.cache_rows" if cache_rows else "tiering.cache_fraction"
        names = ", ".join(name for name, _, _, _ in tables)
        if slots < step_rows:
            raise ConfigError(key, f"group {group}'s cache of {slots:,} rows cannot hold the {step_rows:,} distinct "
                                   f"rows one step of {batch_size} examples can read from its tables {names}; "
                                   f"raise it to at least {step_rows:,} rows ({step_rows / total:.3g} of {total:,}) "
                                   "or lower train.batch_size")
        if slots >= total:
            raise ConfigError(key, f"group {group}'s cache of {slots:,} rows holds all {total:,} rows of its tables "
                                   f"{names}: keep them in memory (tiering.tables) or lower the cache")
        layouts.append(GroupLayout(group, collection.group_rows[group], collection.group_dims[group], resident,
                                   tables, slots, step_rows))
    return layouts


# ------------------------------------------------------------------------------------------------- one device
class GroupSlots:
    """One device: the slots after the group's memory tables' rows in its array (module docstring)."""

    parts = 1
    routes_ahead = True  # a train step takes the route `put_batch` made (its distinct rows are the cache's keys)

    def __init__(self, layout: GroupLayout):
        self.layout = layout
        self.where = layout.locate()
        self.key, self.first, self.end = layout.name, layout.resident_rows, layout.device_rows
        self.slot_base = layout.resident_rows  # the step row of slot 0

    def new_cache(self, policy: str, pinned: np.ndarray | None) -> RowCache:
        return RowCache(self.layout.rows, self.layout.slots, policy, pinned)

    def swap_rows(self, n: int) -> int:
        """The rows a swap of `n` misses or write-backs moves (padded: a few compiled shapes)."""
        step_rows = self.layout.step_rows
        return next(size for size in (-(-step_rows // k) for k in _BUCKETS) if size >= n)

    def step_rows(self, unique: np.ndarray, resident: np.ndarray, table: np.ndarray) -> np.ndarray:
        """i32[N]: the device row of each memory-table row (positions `resident` of `unique`, in tables `table`);
        padding and cached rows at the sentinel (the cached ones are filled in by the caller)."""
        starts, _, device = self.where
        out = np.full(len(unique), self.layout.device_rows, np.int32)
        out[resident] = device[table] + unique[resident] - starts[table]
        return out

    def rewrite(self, collection, routes: Routes, keys: jax.Array, rows: jax.Array, *, premade: bool) -> Routes:
        """`routes` with the group's stacked rows as device rows. `premade`: the train route `put_batch` made, whose
        distinct rows are `keys` themselves, so `rows` are their device rows in order; else the route without dedup,
        each bag slot's stacked row looked up in `keys` (sorted)."""
        group = self.key
        if premade:
            unique = {**routes.unique, group: rows}
            features = routes.features
            if routes.unique_slots is not None:  # pool_from="table": the bags read stacked rows, found in `unique`
                features = {name: route.replace(slots=tuple(
                    rows[at] if p.group == group else s
                    for p, s, at in zip(collection.placements[name], route.slots, routes.unique_slots[name],
                                        strict=True)))
                    for name, route in features.items()}
            return routes.replace(unique=unique, features=features)

        def device_rows(stacked: jax.Array) -> jax.Array:
            at = jnp.searchsorted(keys, stacked.reshape(-1), method="sort")
            return rows[at].reshape(stacked.shape)

        return routes.replace(features={name: route.replace(slots=tuple(
            device_rows(s) if p.group == group else s
            for p, s in zip(collection.placements[name], route.slots, strict=True)))
            for name, route in routes.features.items()})

    def step_sentinels(self, unique: np.ndarray, slots: np.ndarray, train: bool) -> np.ndarray:
        """The step rows of a batch's distinct rows, padding at the array's out-of-range row (the predict step's
        working set is shorter than the training array: its own out-of-range row)."""
        if train:
            return slots
        return np.where(unique < self.layout.rows, slots, self.layout.resident_rows + len(unique)).astype(np.int32)

    # ----------------------------------------------------------------------------------- the predict step's rows
    def working_set(self, fn_cache: dict, table: jax.Array, cache, unique: np.ndarray, at: np.ndarray,
                    rows: np.ndarray, step: np.ndarray, read_misses: Callable) -> tuple[jax.Array, int]:
        """The predict step's array f32[R + N, d]: the memory tables' rows, then each of the batch's N distinct rows
        (`unique`; the cached ones at positions `at`, rows `rows`) from its slot where cached, else read
        (`read_misses`); `step` (the step rows, filled in here) index it. Returns (array, misses read)."""
        layout = self.layout
        n = len(unique)
        cached_slot = cache.slots_of(rows)
        source = np.full(n, -1, np.int32)
        source[at] = np.where(cached_slot >= 0, layout.resident_rows + cached_slot, -1)
        extra = np.zeros((n, layout.dim), np.float32)
        misses = at[cached_slot < 0]
        if len(misses):
            extra[misses] = read_misses(rows[cached_slot < 0])[:, : layout.dim]
        step[at] = layout.resident_rows + at  # the working set's cached rows follow the batch's order
        if "fn" not in fn_cache:
            fn_cache["fn"] = jax.jit(_group_working_set, static_argnums=(0,))
        return fn_cache["fn"](layout.resident_rows, table, source, extra), len(misses)

    def predict_shapes(self, tables: Mapping, n: int) -> dict:
        """The predict step's array shapes for a batch of `n` distinct rows of the group."""
        layout = self.layout
        return {self.key: jax.ShapeDtypeStruct((layout.resident_rows + n, layout.dim), jnp.float32)}

    # ------------------------------------------------------------------------------------------ the arrays
    def lay_out(self, tables: dict, opt_state: dict) -> tuple[dict, dict]:
        """The group's arrays as the storage built them (f32[R + S, d] and its state) -> the layout's: as they are."""
        return tables, opt_state

    def resident_source(self, tables: Mapping, field_of: Callable) -> np.ndarray | jax.Array:
        """An array whose first R rows are the memory tables' rows (compacted) of one state array (`field_of` picks
        the table or an optimizer field from a group's entry): here the group's array itself."""
        return field_of(tables[self.key])

    def dirty_bitmaps(self, dirty_rows: Mapping) -> dict:
        """The state's dirty-row bitmaps of this group's arrays (unused: the storage keeps them by stacked row)."""
        return {self.key: jnp.zeros(self.layout.device_rows, jnp.bool_)}


def _group_working_set(resident_rows: int, table: jax.Array, source: jax.Array, extra: jax.Array) -> jax.Array:
    """f32[R + N, d]: the group's R memory-table rows, then each of a batch's distinct cached rows -- from device row
    `source` i32[N] where it is cached (>= 0), else `extra` f32[N, d] (misses; padding reads zeros)."""
    cached = jnp.where((source >= 0)[:, None], table.at[source].get(mode="fill", fill_value=0), extra)
    return jnp.concatenate([table[:resident_rows], cached])


# ------------------------------------------------------------------------------------------------------- a mesh
def cached_holders(arrays: Mapping[str, MeshArray], cached: Mapping[str, Sequence[str]], collection) -> dict:
    """{group: the plan's array holding the group's cached tables}; a ConfigError names a cached table the tier
    cannot serve on a mesh (column-wise or replicated), or a group whose cached tables are split over different
    axes."""
    placed = {p.table.name: p for p in collection.physical_tables()}
    out = {}
    for group, names in cached.items():
        holders = set()
        for name in names:
            p = placed[name]
            t = [q.offset for q in collection.physical_tables() if q.group == group].index(p.offset)
            s = next(s for s in arrays.values() if s.group == group and s.member[t])
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
        out[group] = arrays[holders.pop()]
    return out


def plan_block_layouts(collection, cached: Mapping[str, bool], plan: ShardingPlan, batch_size: int,
                       cache_fraction: float = 0.1, cache_rows: int = 0) -> list[GroupLayout]:
    """A mesh: the layout of every group holding a table of `cached`: S = `slots` cache slots on each device block
    (`cache_rows`, or `cache_fraction` of the cached rows the fullest block owns, rounded up), which must hold the
    distinct rows one global batch can bring a block and fewer than every row a block owns. `step_rows` is the most
    distinct cached rows one step reads over all blocks (the swap's bucket)."""
    arrays = mesh_arrays(collection, plan)
    by_group = {}
    for p in collection.physical_tables():
        if p.table.name in cached:
            by_group.setdefault(p.group, []).append(p.table.name)
    holders = cached_holders(arrays, by_group, collection)
    layouts = []
    for group in sorted(by_group):
        placed, resident, tables = _group_tables(collection, group, cached)
        s = holders[group]
        mine = np.array([p.table.name in cached for p in placed])
        bags = np.array([collection.slots_per_example(p) for p in placed], np.int64)
        owned = s.part_rows[:, mine].sum(axis=1)  # i64[P] cached rows each block owns
        per_step = np.minimum(s.part_rows[:, mine], batch_size * bags[mine][None, :]).sum(axis=1)
        slots = cache_rows or math.ceil(cache_fraction * int(owned.max()))
        key = "tiering.cache_rows" if cache_rows else "tiering.cache_fraction"
        names = ", ".join(by_group[group])
        need = int(per_step.max())
        if slots < need:
            # Every row a step brings a device must sit in that device's cache during the step, and any one device
            # may own all of a step's rows of a table: the bound is per device, not the global step's rows / P.
            raise ConfigError(key, f"group {group}'s cache of {slots:,} rows per device cannot hold the {need:,} "
                                   f"distinct rows of its tables {names} one step of {batch_size} examples can bring "
                                   f"one device; raise it to at least {need:,} rows per device (tiering.cache_fraction "
                                   f">= {need / owned.max():.3g} of the {int(owned.max()):,} rows the fullest device "
                                   "owns) or lower train.batch_size")
        if slots >= owned.max():
            raise ConfigError(key, f"group {group}'s cache of {slots:,} rows per device holds all {int(owned.max()):,} "
                                   f"rows of its tables {names} any device owns: keep them in memory "
                                   "(tiering.tables) or lower the cache")
        step_rows = min(int(owned.sum()), int(per_step.sum()))
        layouts.append(GroupLayout(group, collection.group_rows[group], collection.group_dims[group], resident,
                                   tables, slots, step_rows))
    return layouts


def cache_array(holder: MeshArray, cached: np.ndarray, slots: int) -> MeshArray:
    """The array of a group's cache slots: P S virtual rows from the group's stacked rows G on, split like `holder`
    (the plan's array of the cached tables, members `cached` bool[T]) in range chunks of S. Its capacity per owner
    counts the cached rows the owner really holds (at most S), so a table-wise table's cache fills one device's
    buckets, as in memory."""
    parts, g = holder.parts, holder.group_rows
    owned = np.minimum(holder.part_rows[:, cached].sum(axis=1), slots)
    return MeshArray(
        name=f"{holder.group}/{_CACHE}", group=holder.group, kind=holder.kind, axes=holder.axes,
        replica_axes=holder.replica_axes, parts=parts, local_rows=slots, dim=holder.dim,
        group_rows=g + parts * slots, offsets=np.array([0, g], np.int32), member=np.array([False, True]),
        split=np.array([1, parts], np.int32), chunk=np.array([1, slots], np.int32), modulo=np.zeros(2, bool),
        device=np.stack([np.zeros(parts, np.int32), np.arange(parts, dtype=np.int32)]),
        base=np.zeros((2, parts), np.int32), part_rows=np.stack([np.zeros(parts, np.int64), owned], axis=1),
        table_bags=np.array([0, holder.table_bags[cached].sum()], np.int64),
        source=np.full(parts * slots, -1, np.int64), holds=cached.copy(),
        held_rows=np.where(cached[None, :], holder.held_rows, 0))


class BlockSlots:
    """A mesh: each device block's slots in the group's cache array (module docstring). `holder` is the plan's array
    of the cached tables, `arrays` every array of the group in the layout (the cache array among them)."""

    routes_ahead = False  # each device routes its share inside the step, then maps its rows by the batch's keys

    def __init__(self, layout: GroupLayout, holder: MeshArray, arrays: Mapping[str, MeshArray], mesh):
        self.layout, self.holder, self.mesh = layout, holder, mesh
        self.where = layout.locate()
        self.key = f"{layout.name}/{_CACHE}"
        self.arrays = {name: s for name, s in arrays.items() if s.group == layout.name}
        self.parts = holder.parts
        self.first, self.end = 0, self.parts * layout.slots
        self.slot_base = layout.rows  # a slot's virtual row: after the group's stacked rows (`cache_array`)
        self.sentinel = self.arrays[self.key].group_rows

    def new_cache(self, policy: str, pinned: np.ndarray | None) -> PartitionedRowCache:
        if pinned is not None and len(pinned):  # refused with a ConfigError when the storage is built
            raise ValueError("the static policy is not supported on a mesh")
        holder = self.holder
        return PartitionedRowCache(self.layout.rows, self.layout.slots, holder.parts,
                                   lambda rows: holder.locate(rows, xp=np)[1], policy)

    def swap_rows(self, n: int) -> int:
        """Powers of two from 256 up to the step's bound: the bound sums what a step could bring every device, many
        times what it brings them (e.g. ~30k rows against ~350 misses a step), and every padded row is copied to
        every device."""
        return min(self.layout.step_rows, max(256, power_of_two(n)))

    def step_rows(self, unique: np.ndarray, resident: np.ndarray, table: np.ndarray) -> np.ndarray:
        """Memory tables' rows as they are (the exchange locates them), padding at the sentinel."""
        return np.where(unique < self.layout.rows, unique, self.sentinel).astype(np.int32)

    def rewrite(self, collection, routes: Routes, keys: jax.Array, rows: jax.Array, *, premade: bool) -> Routes:
        """This device's share's distinct rows (always deduplicated: the exchange moves distinct rows) as the rows
        the step sees: each looked up in the batch's distinct rows `keys` (replicated), whose step rows are `rows`."""
        group, sentinel, stacked = self.layout.name, self.sentinel, self.layout.rows
        unique = routes.unique[group]
        at = jnp.minimum(jnp.searchsorted(keys, unique, method="sort"), keys.shape[0] - 1)
        # This share's padding may be missing from the global batch's distinct rows (when they fill its buffer).
        return routes.replace(unique={**routes.unique, group: jnp.where(unique >= stacked, sentinel, rows[at])})

    def step_sentinels(self, unique: np.ndarray, slots: np.ndarray, train: bool) -> np.ndarray:
        return slots

    # ----------------------------------------------------------------------------------- the predict step's rows
    def working_set(self, fn_cache: dict, table: jax.Array, cache, unique: np.ndarray, at: np.ndarray,
                    rows: np.ndarray, step: np.ndarray, read_misses: Callable) -> tuple[jax.Array, int]:
        """The predict step's cache array (the training one's shape): owner k's block holds the batch's distinct
        cached rows it owns (in batch order), from its cache slot or, for a miss, read (`read_misses`). Built beside
        the cache, O(cache) device memory per eval batch; the caches do not change."""
        layout = self.layout
        owner = cache.owner(rows).astype(np.int64)
        order = np.argsort(owner, kind="stable")
        counts = np.bincount(owner, minlength=len(cache.parts))
        rank = np.empty(len(rows), np.int64)
        rank[order] = np.arange(len(rows)) - (np.cumsum(counts) - counts)[owner[order]]
        place = owner * layout.slots + rank
        n = len(unique)
        source = np.full(n, -1, np.int32)
        extra = np.zeros((n, layout.dim), np.float32)
        target = np.full(n, self.end, np.int32)  # padding: out of range, dropped
        source[: len(rows)] = cache.slots_of(rows)
        target[: len(rows)] = place
        misses = np.flatnonzero(source[: len(rows)] < 0)
        if len(misses):
            extra[misses] = read_misses(rows[misses])[:, : layout.dim]
        step[at] = layout.rows + place
        if "fn" not in fn_cache:
            fn_cache["fn"] = jax.jit(_block_working_set,
                                     out_shardings=NamedSharding(self.mesh, self.arrays[self.key].spec))
        return fn_cache["fn"](table, target, source, extra), len(misses)

    def predict_shapes(self, tables: Mapping, n: int) -> dict:
        return {}  # the working sets have the caches' shapes

    # ------------------------------------------------------------------------------------------ the arrays
    def _source(self, s: MeshArray) -> np.ndarray:
        """i64[rows of s]: where each of array `s`'s global rows comes from in the group's array as the storage built
        it -- the row among its memory tables' rows (the first rows of that array); -1 = none."""
        starts, _, device = self.where
        source = np.maximum(s.source, 0)
        t = np.searchsorted(starts, source, side="right") - 1
        return np.where(s.source >= 0, device[t] + source - starts[t], -1)

    def lay_out(self, tables: dict, opt_state: dict) -> tuple[dict, dict]:
        """The group's arrays as the storage built them ({group: f32[R + S, d]}, the memory tables' rows first) ->
        the mesh's: the plan's arrays of its memory tables, and the cache array, empty (zeros)."""
        group = self.layout.name

        def lay_out(s: MeshArray, array) -> jax.Array:
            sharding = NamedSharding(self.mesh, s.spec)
            if s.name == self.key:
                shape = (s.parts * s.local_rows, *array.shape[1:])
                return jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding)()
            source = self._source(s)
            data = np.asarray(array)[np.maximum(source, 0)]
            data[source < 0] = 0
            return put_global(data, sharding)

        fields = sorted(opt_state[group])
        out_tables = {name: lay_out(s, tables[group]) for name, s in self.arrays.items()}
        out_opt = {name: {f: lay_out(s, opt_state[group][f]) for f in fields} for name, s in self.arrays.items()}
        return out_tables, out_opt

    def resident_source(self, tables: Mapping, field_of: Callable) -> np.ndarray:
        """The memory tables' rows f32[R, ...] of one state array (`field_of` picks the table or an optimizer field
        from an array's entry), gathered from the plan's arrays to the host."""
        layout = self.layout
        out = None
        for name, s in self.arrays.items():
            if name == self.key:
                continue
            data, source = to_host(field_of(tables[name])), self._source(s)
            if out is None:
                out = np.zeros((layout.resident_rows, *data.shape[1:]), data.dtype)
            out[source[source >= 0]] = data[source >= 0]
        if out is None:
            out = np.zeros((0, *field_of(tables[self.key]).shape[1:]), np.float32)
        return out

    def dirty_bitmaps(self, dirty_rows: Mapping) -> dict:
        """The state's bitmaps of this group's arrays, all clear (the storage keeps a cached group's dirty rows by
        stacked row on the host)."""
        out = {}
        for name, s in self.arrays.items():
            rows = np.zeros(s.parts * s.local_rows if s.kind in ("sharded", "model") else s.local_rows, bool)
            out[name] = put_global(rows, NamedSharding(self.mesh, s.row_spec))
        return out

    def batch_specs(self) -> P:
        return P()


def _block_working_set(cache: jax.Array, target: jax.Array, source: jax.Array, extra: jax.Array) -> jax.Array:
    """f32[P S, d] of the cache's shape: at `target` i32[N] (out of range: dropped) the row of cache slot `source`
    i32[N] where it is >= 0, else `extra` f32[N, d]; zeros elsewhere."""
    rows = jnp.where((source >= 0)[:, None], cache.at[source].get(mode="fill", fill_value=0), extra)
    return jnp.zeros_like(cache).at[target].set(rows, mode="drop")
