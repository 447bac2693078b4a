"""Sharded lookups and sparse updates: the plan's per-device arrays and the collectives between them.

Every physical table of a stacked group (`recjax/embedding.py`) lands, by its plan entry, in one of the group's
*mesh arrays* (`MeshArray`) -- named "<group>/<kind>":

    <group>/sharded     f32[n * L, d], P(("data", "model"))   table-wise and row-wise-over-all tables; device k
                        holds rows [k L, (k+1) L): its parts of those tables, back to back
    <group>/model       f32[n_model * L, d], P("model")        row-wise over the model axis, a copy per data row
    <group>/replicated  f32[L, d], P()                          replicated / data-parallel tables
    <group>/column      f32[L, d], P(None, ("data", "model"))   column-wise tables: device k holds columns k d/n..

Optimizer state rows follow their table rows (same leading dim and sharding). Inside `jax.shard_map`, each device
holds its local block and its slice of the batch (b examples). What crosses devices (DESIGN.md "The exchange"):

Pooled bags (`pools_on_owner`, recjax/sharding/plan.py: every read of a table whose method pools before combining,
unless it is replicated or, with `sharding.exchange=auto`, its rows move fewer bytes). TorchRec's / HugeCTR's
pooled all-to-all: the owner of a table's rows pools the bags of every device and returns one vector per
(example, bag) -- f32[b, d] per read, in `exchange_dtype` -- and the pooled gradient goes back to it:
  table-wise tables ("whole": all rows on one owner) -- each device sends the owner its b x L slots in place (a
    static bucket per owner, the fullest owner's size: no capacity to overflow); the owner gathers and sums each bag
    and all_to_alls the sums back.
  row-wise tables ("split" over k owners) -- each slot goes to the owner of its row: per owner a bucket of the slots
    it holds, packed in (read, bag, id) order, and how many of each bag's ids went there (b counts per read), which
    is all the owner needs to know where a bag ends; each owner returns a partial sum for every bag, and the
    requester adds the k partials in owner order (a reduce-scatter moves the same bytes per device: (n - 1) / n of
    the B x d sums). The buckets hold `capacity_factor` x E + `capacity_sigmas` x sd ids, E the slots a device is
    expected to send an owner (its share of the table's rows, ids spread evenly) and sd their binomial spread; a
    step where some device has more takes the worst case (every slot to one owner) instead, so no id is dropped.
  column-wise tables -- every device's slots are all-gathered, each device pools its columns of every bag and one
    all_to_all returns each requester its bags' slices, concatenated on the dim.
  backward: each bag's pooled gradient goes to the owners that pooled it (each of a row-wise table's k owners gets
    the whole bag gradient, as a reduce-scatter's transpose is an all-gather); the owner expands it to the ids it
    received (times the bag's scale: 1 for sum, 1 / length for mean, sent with the ids; weights are one scale per
    bag, 0 on slots that read no row), sums each distinct row's gradient in f32 and applies the optimizer in place.
Distinct rows, for what cannot pool on the owner (per-id methods: hashing with a sign, QR mult, path QR, TT-Rec;
replicated tables, read locally; and with `exchange=auto` one-hot or small tables, whose distinct rows are fewer than
their bags). `collection.route` gives each device's distinct stacked rows u i32[N] of a group; those the
row-travelling reads need go to their owners in buckets of `capacity_factor` x E + `capacity_sigmas` x sqrt(E) ids,
E the distinct ids a device is expected to ask an owner for (per table its share of rows (1 - (1 - 1 / rows)^slots):
distinct ids, not raw lookups), the rows come back, and the requester pools or combines them itself (the glue's
lookup, run here); the gradients of the distinct rows go back the same way. Column arrays all_gather the ids and
all_to_all the rows' slices; replicated arrays read locally and all_gather the touched rows' ids and gradients.
Either way the differentiated values are the bags (`Lookups`: pooled vectors and per-id rows), never a table.

Buckets. On GPU / TPU the bucketed all_to_alls are `jax.lax.ragged_all_to_all` (each peer is sent only its filled
slots; the buffers and the worst-case branch stay the same); XLA:CPU cannot run it, so on CPU the static buckets
carry padding. The worst case is a `lax.cond` branch in the forward (it only reads the tables) and, in the update,
a loop run zero or one times (`fori_loop` carries the table in place, where a cond taking the table would make
XLA:CPU copy it): a step whose buckets fit updates at the small buckets' length.

Limits of this version (what it costs: benchmarks/RESULTS.md#sharding-the-pooled-exchange-issue-39):
  - A row-wise table returns k partial sums per bag (k x the pooled volume): the price of splitting rows. Expected
    bucket sizes assume ids spread evenly over a table's rows: a hot id (or a frequency-sorted vocabulary split by
    `range`) sends one owner more slots than its share, so its steps take the worst-case buckets; the
    `bucket_overflows` metric counts them (table-wise pooled tables never overflow).
  - Table-wise buckets grouped by bag length pool with the single-device gather-reduce (one call per length); a
    row-wise owner's packed bucket, and table-wise buckets packed because grouping would pad them, pool with an XLA
    gather and segment sum (a bag's ids there sit where the requester's counts put them, which no static bag layout
    of the kernels describes).
  - A mesh array is one [n L, d] array, so a table-wise plan whose devices hold different row counts pads the others
    to the fullest; the `auto` planner evens blocks (`plan.balance_blocks`), a ragged layout would remove it.
  - `exchange_dtype` bf16 / f16 halves the bytes on GPU / TPU; XLA:CPU widens such collectives back to f32, so on
    CPU it only rounds. Accumulation (pooling, the owner's sum, the optimizer) stays f32.
  - Column-wise arrays need element-wise optimizer state (row-wise Adagrad's per-row accumulator would need the
    whole row's gradient norm).
  - Initialisation is the single-device one, built on the host and laid out by the plan, so the host briefly holds
    every table once.
"""

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import gather_reduce, unique_rows
from recjax.embedding import EmbeddingCollection, Lookups, Routes
from recjax.sharding.hlo import FALLBACK_SCOPE
from recjax.sharding.placement import ALL_AXES, put_global, to_host
from recjax.sharding.plan import ShardingPlan, expected_distinct, part_rows, pools_on_owner
from recjax.sparse_optim import SparseOptimizer, sparse_apply

KINDS = ("sharded", "model", "replicated", "column")
# Table-wise reads' buckets are grouped by bag length (one gather-reduce per length on the owner) unless that makes
# them this much larger than packing each owner's reads (then a segment sum pools them).
GROUPED_PADDING = 1.25
_KIND_OF = {"table": "sharded", "row": "sharded", "column": "column", "replicated": "replicated",
            "data_parallel": "replicated"}
Key = tuple[str, int]  # a read of a physical table: (feature, index among its route outputs)


@dataclasses.dataclass(frozen=True)
class TableRecord:
    """One physical table of a stacked group, in stacking order: what the exchange sizes its buffers from."""

    name: str
    offset: int  # its first stacked row
    rows: int
    bags: int  # ids one example reads from it, all its reads (`slots_per_example`)
    reads: int  # bags per example (FIITED reads its pool once per chunk)
    keys: tuple[Key, ...] = ()  # its reads in the collection ((table name, j) when sized from a plan alone)

    @property
    def bag(self) -> int:
        return self.bags // self.reads


def collection_tables(collection: EmbeddingCollection) -> dict[str, list[TableRecord]]:
    """{group: its physical tables} of a collection."""
    out: dict[str, list[TableRecord]] = {g: [] for g in sorted(collection.group_rows)}
    for p in collection.physical_tables():
        keys = tuple((q.feature, q.index) for q in collection.placements[p.feature] if q.table_index == p.table_index)
        out[p.group].append(TableRecord(p.table.name, p.offset, p.table.rows, collection.slots_per_example(p),
                                        len(keys), keys))
    return out


def plan_tables(plan: ShardingPlan) -> tuple[dict[str, list[TableRecord]], dict[str, int]]:
    """({group: its physical tables}, {group: dim}) from a plan alone (its placements in stacking order, as
    `table_infos` lists them)."""
    out: dict[str, list[TableRecord]] = {}
    dims: dict[str, int] = {}
    for p in plan.placements:
        t = p.table
        group = out.setdefault(t.group_name, [])
        offset = group[-1].offset + group[-1].rows if group else 0
        group.append(TableRecord(t.name, offset, t.rows, t.bag_size, t.reads,
                                 tuple((t.name, j) for j in range(t.reads))))
        dims[t.group_name] = t.dim
    return dict(sorted(out.items())), dims


@dataclasses.dataclass(frozen=True)
class MeshArray:
    """One per-device array of a group and the static maps from the group's stacked rows to it.

    Maps are over the group's T physical tables in offset order; K = the most parts a table is split into.
    """

    name: str
    group: str
    kind: str
    axes: tuple[str, ...]  # axes the rows (or columns) are split over
    replica_axes: tuple[str, ...]  # axes along which every device holds the same block
    parts: int  # devices along `axes`
    local_rows: int  # L, rows of the block on each device
    dim: int  # the table dim (column arrays hold dim / parts columns per device)
    group_rows: int  # the group's sentinel
    offsets: np.ndarray  # i32[T] stacked offset of each table
    member: np.ndarray  # bool[T]
    split: np.ndarray  # i32[T] parts each member table is split into
    chunk: np.ndarray  # i32[T] rows per part (range split)
    modulo: np.ndarray  # bool[T] modulo split
    device: np.ndarray  # i32[T, K] position along `axes` of each part
    base: np.ndarray  # i32[T, K] first local row of each part
    part_rows: np.ndarray  # i64[parts, T] rows of each table on each owner (a device asks at most this many of them)
    table_bags: np.ndarray  # i64[T] ids one example reads from each table (bag size x reads: `slots_per_example`)
    source: np.ndarray  # i64[parts * L] (sharded / model) or i64[L]: the stacked row at each global row, -1 = pad
    # Over the group's real tables (the same as `member` / `part_rows` but for a disk tier's cache array, whose maps
    # are over virtual rows: recjax/tiering/slots.py `cache_array`): the tables whose rows it holds and how many of
    # each on each owner.
    holds: np.ndarray  # bool[T]
    held_rows: np.ndarray  # i64[parts, T]

    @property
    def spec(self) -> P:
        return {"sharded": P(ALL_AXES), "model": P("model"), "replicated": P(),
                "column": P(None, ALL_AXES)}[self.kind]

    @property
    def row_spec(self) -> P:
        """The sharding of a per-row array (the dirty-row bitmap): split like the rows; replicated when every device
        holds every row (replicated and column arrays, whose devices update the same rows)."""
        return self.spec if self.kind in ("sharded", "model") else P()

    def capacity(self, local_batch: int) -> int:
        """C: the most distinct rows one device can ask one owner for in a step, every table it holds travelling as
        rows: per table the fewer of its slots (local_batch x bag size) and the rows the owner holds of it, summed
        over the owner's tables."""
        return self.expected_capacity(local_batch, 0.0)

    def expected_capacity(self, local_batch: int, factor: float, sigmas: float = 0.0) -> int:
        """C1 <= C of the rows exchange, every table it holds travelling as rows (`rows_buckets`)."""
        rows = np.maximum(self.part_rows.sum(axis=0), 1)
        return rows_buckets(self.part_rows, rows, self.table_bags, self.local_rows, local_batch, factor, sigmas)[1]

    def compact_size(self, local_batch: int, n: int) -> int:
        """S: the most distinct rows of a replicated / column array's tables among a device's n distinct rows
        (per table the fewer of its slots and its rows); only these cross devices, not the whole group's."""
        rows = np.where(self.member, self.chunk, 0)
        return max(1, min(n, int(np.minimum(rows, local_batch * self.table_bags).sum())))

    # ---------------------------------------------------------------------------------------- device side
    def locate(self, unique: jax.Array, xp=jnp) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Stacked rows i32[N] -> (member bool[N], owner i32[N] position along `axes`, local row i32[N]). `xp=np`
        runs the same math on the host (the disk tier on a mesh asks which device's cache a row goes to)."""
        offsets = xp.asarray(self.offsets)
        t = xp.clip(xp.searchsorted(offsets, unique, side="right") - 1, 0, len(self.offsets) - 1)
        member = (unique < self.group_rows) & xp.asarray(self.member)[t]
        r = unique - offsets[t]
        split, chunk, modulo = xp.asarray(self.split)[t], xp.asarray(self.chunk)[t], xp.asarray(self.modulo)[t]
        part = xp.where(member, xp.where(modulo, r % split, r // chunk), 0)  # non-members: any valid part
        within = xp.where(modulo, r // split, r % chunk)
        owner = xp.asarray(self.device)[t, part]
        local = xp.asarray(self.base)[t, part] + within
        return member, xp.where(member, owner, 0), xp.where(member, local, self.local_rows)


def mesh_arrays(collection: EmbeddingCollection, plan: ShardingPlan, skip: frozenset[str] = frozenset()
                ) -> dict[str, MeshArray]:
    """The plan's arrays of every group; tables named in `skip` are in none of them (a disk tier on a mesh keeps
    those behind per-device caches of its own, recjax/tiering/slots.py)."""
    return _arrays(collection_tables(collection), collection.group_dims, plan, skip)


def _arrays(tables_of: Mapping[str, list[TableRecord]], dims: Mapping[str, int], plan: ShardingPlan,
            skip: frozenset[str] = frozenset()) -> dict[str, MeshArray]:
    mesh_shape = plan.mesh_shape
    n = plan.devices
    arrays = {}
    for group in sorted(tables_of):
        tables = tables_of[group]
        offsets = np.array([t.offset for t in tables], np.int32)
        group_rows = tables[-1].offset + tables[-1].rows
        kinds = {}
        for i, t in enumerate(tables):
            if t.name in skip:
                continue
            entry = plan.placement(t.name)
            kind = _KIND_OF[entry.sharding]
            if kind == "sharded" and entry.axes == ("model",):
                kind = "model"
            kinds.setdefault(kind, []).append((i, entry))
        for kind, members in kinds.items():
            axes = {"sharded": ALL_AXES, "model": ("model",), "replicated": (), "column": ALL_AXES}[kind]
            parts = math.prod(mesh_shape[a] for a in axes) if kind != "column" else n
            t_count = len(tables)
            k_max = max(len(e.devices) if kind in ("sharded", "model") else 1 for _, e in members)
            member = np.zeros(t_count, bool)
            split = np.ones(t_count, np.int32)
            chunk = np.ones(t_count, np.int32)
            modulo = np.zeros(t_count, bool)
            device = np.zeros((t_count, k_max), np.int32)
            base = np.zeros((t_count, k_max), np.int32)
            used = [0] * (parts if kind in ("sharded", "model") else 1)
            part_rows_ = np.zeros((parts, t_count), np.int64)
            table_bags = np.array([t.bags for t in tables], np.int64)
            pieces: list[list[np.ndarray]] = [[] for _ in used]
            for i, entry in members:
                t = tables[i]
                rows = t.rows
                member[i] = True
                if kind in ("sharded", "model"):
                    k = len(entry.devices)
                    split[i], chunk[i] = k, -(-rows // k)
                    modulo[i] = entry.row_split == "mod"
                    for j, dev in enumerate(entry.devices):
                        device[i, j], base[i, j] = dev, used[dev]
                        count = part_rows(rows, k, j, entry.row_split)
                        local = np.arange(count) * k + j if modulo[i] else j * chunk[i] + np.arange(count)
                        pieces[dev].append(t.offset + local)
                        used[dev] += count
                        part_rows_[dev, i] = count
                else:
                    split[i], chunk[i] = 1, max(rows, 1)
                    base[i, 0] = used[0]
                    pieces[0].append(t.offset + np.arange(rows))
                    used[0] += rows
            local_rows = max(1, max(used))
            source = np.full((len(used), local_rows), -1, np.int64)
            for dev, chunks in enumerate(pieces):
                if chunks:
                    rows_here = np.concatenate(chunks)
                    source[dev, :rows_here.size] = rows_here
            name = f"{group}/{kind}"
            arrays[name] = MeshArray(
                name=name, group=group, kind=kind, axes=axes if kind != "replicated" else (),
                replica_axes=tuple(a for a in ALL_AXES if a not in axes) if kind != "column" else (),
                parts=parts, local_rows=local_rows, dim=dims[group], group_rows=group_rows, offsets=offsets,
                member=member, split=split, chunk=chunk, modulo=modulo, device=device, base=base,
                part_rows=part_rows_, table_bags=table_bags, source=source.reshape(-1), holds=member.copy(),
                held_rows=part_rows_.copy())
    return arrays


# --------------------------------------------------------------------------------------------- static sizes
@dataclasses.dataclass(frozen=True)
class Member:
    """One read of a table an array holds, as the exchange moves it."""

    key: Key
    table: int  # the table's position in its group
    bag: int  # L, ids per example


@dataclasses.dataclass(frozen=True)
class ArrayExchange:
    """What one mesh array exchanges in a step, sized once (static shapes; the module docstring says why).

    sharded / model arrays: `whole` pooled reads of tables on one owner (`whole_owner`), b bags each, in place in
    their owner's bucket of `whole_slots` ids and `whole_bags` sums (the fullest owner's): read i's first bag is
    `whole_bag[i]`, its first id `whole_first[i]`. Grouped by bag length (`whole_groups` ((L, bags), ...): every
    owner's bags of length L in one [bags, L] block at the same place, so an owner pools a group with one
    gather-reduce) unless that pads the buckets by more than GROUPED_PADDING over packing each owner's reads one
    after another (`whole_groups` empty: the owner sums its ids into their bags by a segment sum). `split` pooled
    reads of row-wise tables (owners `split_holders`), in buckets of `split_sizes` = (C, C1) ids, their bags b each
    in that order; `rows` the tables whose distinct rows travel, in buckets of `rows_sizes` (C, C1). column arrays:
    `whole` the pooled reads (every device pools its columns of every one), `rows_sizes` (S, S) the distinct rows;
    replicated arrays: `rows_sizes` (S, S)."""

    kind: str
    local_batch: int
    whole: tuple[Member, ...] = ()
    whole_owner: tuple[int, ...] = ()
    whole_bag: tuple[int, ...] = ()
    whole_first: tuple[int, ...] = ()
    whole_slots: int = 0
    whole_bags: int = 0
    whole_groups: tuple[tuple[int, int], ...] = ()
    split: tuple[Member, ...] = ()
    split_holders: tuple[tuple[int, ...], ...] = ()
    split_sizes: tuple[int, int] = (0, 0)
    rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))
    rows_sizes: tuple[int, int] = (0, 0)

    @property
    def split_bags(self) -> int:
        return len(self.split) * self.local_batch

    @property
    def pooled(self) -> tuple[Member, ...]:
        return self.whole + self.split

    @property
    def bucketed(self) -> bool:
        """Some bucket is smaller than its worst case: a step may overflow into the worst-case branch."""
        return self.split_sizes[1] < self.split_sizes[0] or self.rows_sizes[1] < self.rows_sizes[0]

    def whole_segments(self, parts: int) -> np.ndarray:
        """i32[parts, whole_slots]: on owner p, the bag each id of a requester's bucket adds to (`whole_bags`: padding;
        grouped, the same on every owner)."""
        seg = np.full((parts, self.whole_slots), self.whole_bags, np.int32)
        for m, owner, bag, first in zip(self.whole, self.whole_owner, self.whole_bag, self.whole_first, strict=True):
            seg[owner, first: first + self.local_batch * m.bag] = bag + np.arange(self.local_batch * m.bag) // m.bag
        if self.whole_groups:  # every owner's layout is the same blocks, padded where it has fewer bags
            start, bag = 0, 0
            for length, bags in self.whole_groups:
                seg[:, start: start + length * bags] = bag + np.arange(length * bags) // length
                start, bag = start + length * bags, bag + bags
        return seg


def size_exchange(s: MeshArray, tables: list[TableRecord], pooled: Mapping[int, bool], local_batch: int,
                  group_slots: int, capacity_factor: float, capacity_sigmas: float) -> ArrayExchange:
    """The static sizes of array `s`'s exchange (`ArrayExchange`): `pooled` {table position: its owners pool its
    bags} for the tables it holds; `group_slots` the length of the group's distinct rows on a device (the route's
    N); capacities as the module docstring says."""
    b = local_batch
    held = [i for i in range(len(tables)) if s.holds[i]]
    rows_mask = np.array([s.holds[i] and not pooled[i] for i in range(len(tables))], bool)
    reads = [Member(key, i, tables[i].bag) for i in held if pooled[i] for key in tables[i].keys]
    bags = np.array([t.bags for t in tables], np.int64)
    if s.kind in ("replicated", "column"):
        rows_t = np.array([t.rows for t in tables], np.int64)
        size = min(group_slots, int(np.minimum(rows_t, b * bags)[rows_mask].sum())) if rows_mask.any() else 0
        if s.kind == "replicated":
            return ArrayExchange(s.kind, b, rows=rows_mask, rows_sizes=(size, size))
        return ArrayExchange(s.kind, b, whole=tuple(reads), **_whole_layout(reads, [0] * len(reads), 1, b),
                             rows=rows_mask, rows_sizes=(size, size))
    rows_t = np.array([max(t.rows, 1) for t in tables], float)
    share = s.held_rows / rows_t[None, :]  # f64[parts, T]
    owners = {i: tuple(int(p) for p in np.flatnonzero(s.held_rows[:, i] > 0)) for i in held}
    whole = [m for m in reads if len(owners[m.table]) == 1]
    split = [m for m in reads if len(owners[m.table]) > 1]
    layout = _whole_layout(whole, [owners[m.table][0] for m in whole], s.parts, b)
    split_sizes = (0, 0)
    if split:
        slots = np.array([b * m.bag for m in split], float)
        f = share[:, [m.table for m in split]]  # [parts, reads]
        worst = int(((f > 0) * slots).sum(axis=1).max())
        mean, var = (f * slots).sum(axis=1), (f * (1 - f) * slots).sum(axis=1)
        split_sizes = (worst, _expected(worst, mean, np.sqrt(var), capacity_factor, capacity_sigmas))
    rows_sizes = (0, 0)
    if rows_mask.any():
        rows_sizes = rows_buckets(s.held_rows[:, rows_mask], rows_t[rows_mask], bags[rows_mask], s.local_rows, b,
                                  capacity_factor, capacity_sigmas)
    return ArrayExchange(
        s.kind, b, whole=tuple(whole), **layout, split=tuple(split),
        split_holders=tuple(owners[m.table] for m in split), split_sizes=split_sizes, rows=rows_mask,
        rows_sizes=rows_sizes)


def _whole_layout(reads: list[Member], owner: list[int], parts: int, local_batch: int) -> dict:
    """Where each table-wise read's bags sit in its owner's bucket (`ArrayExchange`'s whole_* fields): grouped by
    bag length -- per length L in increasing order every owner's reads of that length one after another, b bags
    each, the block as long as the fullest owner's -- unless that pads an owner's ids or bags by more than
    GROUPED_PADDING over packing each owner's reads in order."""
    b = local_batch
    packed_first, packed_bag = [0] * len(reads), [0] * len(reads)
    slots, bags = [0] * parts, [0] * parts
    for i, m in enumerate(reads):
        packed_first[i], packed_bag[i] = slots[owner[i]], bags[owner[i]]
        slots[owner[i]] += b * m.bag
        bags[owner[i]] += b
    packed = dict(whole_owner=tuple(owner), whole_bag=tuple(packed_bag), whole_first=tuple(packed_first),
                  whole_slots=max(slots, default=0), whole_bags=max(bags, default=0), whole_groups=())
    groups, first, bag_of = [], [0] * len(reads), [0] * len(reads)
    start = bag = 0
    for length in sorted({m.bag for m in reads}):
        count = [0] * parts
        for i, m in enumerate(reads):
            if m.bag == length:
                bag_of[i] = bag + count[owner[i]] * b
                first[i] = start + count[owner[i]] * b * length
                count[owner[i]] += 1
        groups.append((length, max(count) * b))
        start, bag = start + max(count) * b * length, bag + max(count) * b
    if start > GROUPED_PADDING * packed["whole_slots"] or bag > GROUPED_PADDING * packed["whole_bags"]:
        return packed
    return dict(whole_owner=tuple(owner), whole_bag=tuple(bag_of), whole_first=tuple(first), whole_slots=start,
                whole_bags=bag, whole_groups=tuple(groups))


def rows_buckets(held_rows: np.ndarray, rows: np.ndarray, bags: np.ndarray, local_rows: int, local_batch: int,
                 factor: float, sigmas: float) -> tuple[int, int]:
    """(C, C1) of a rows exchange: held_rows i64[parts, T] rows of each table on each owner (of `rows` i64[T]), each
    read `bags` i64[T] times per example. C, the most distinct rows one device can ask one owner for: per table the
    fewer of its slots and the owner's rows, summed (at most the block's `local_rows`). C1: `factor` x E + `sigmas` x
    sqrt(E), E the distinct rows one device is expected to ask the fullest owner for -- its slots of a table hit
    (1 - (1 - 1 / rows)^slots) of the table's rows with ids spread evenly (`plan.expected_distinct`), so a table
    with fewer rows than a step's ids asks for fewer rows than slots."""
    slots = local_batch * np.asarray(bags)
    worst = max(1, int(min(local_rows, np.minimum(held_rows, slots[None, :]).sum(axis=1).max())))
    hit = expected_distinct(rows, slots) / np.maximum(rows, 1)
    mean = np.minimum((held_rows * hit[None, :]).sum(axis=1), local_rows)
    return worst, _expected(worst, mean, np.sqrt(mean), factor, sigmas)


def _expected(worst: int, mean: np.ndarray, sd: np.ndarray, factor: float, sigmas: float) -> int:
    """C1 <= C: the fullest owner's `factor` x mean + `sigmas` x sd ids (the worst case C when `factor` is 0)."""
    if not factor:
        return worst
    return max(1, min(worst, math.ceil(float((factor * mean + sigmas * sd).max()))))


# --------------------------------------------------------------------------------------------- collectives
def _fallback(branch):
    """The worst-case exchange, under a named scope so the HLO tells its collectives apart."""
    def run(*operands):
        with jax.named_scope(FALLBACK_SCOPE):
            return branch(*operands)
    return run


def _bucket_all_to_all(x: jax.Array, filled: jax.Array, axes: tuple[str, ...], fill=0) -> jax.Array:
    """all_to_all of buckets x [parts, C, ...] (bucket j to device j; `filled` i32[parts]: its first rows that hold
    anything, the rest padding). On GPU / TPU a `ragged_all_to_all` sends only those rows (the result's padding
    reads `fill`); XLA:CPU cannot run it, so there the whole buckets go."""
    def static(x, filled):
        return jax.lax.all_to_all(x, axes, 0, 0)

    def ragged(x, filled):
        parts, size = x.shape[:2]
        flat = x.reshape(parts * size, *x.shape[2:])
        me = jax.lax.axis_index(axes)
        sizes = jnp.minimum(filled, size).astype(jnp.int32)
        offsets = jnp.arange(parts, dtype=jnp.int32) * size
        # My bucket lands at row me * size of every receiver; what each sender sends me, I learn first.
        received = jax.lax.all_to_all(sizes, axes, 0, 0, tiled=True)
        out = jax.lax.ragged_all_to_all(flat, jnp.full_like(flat, fill), offsets, sizes,
                                        jnp.full(parts, me * size, jnp.int32), received, axis_name=axes)
        return out.reshape(x.shape)

    return jax.lax.platform_dependent(x, filled, cpu=static, default=ragged)


# Up to this many owners a bucket's slots are ranked by a running count per owner (N x parts ints), beyond by a
# stable sort (a sort carrying the positions costs several times more on XLA:CPU: pallas_kernels/dedup.py).
_RANK_BY_COUNT = 64


def _bucket_positions(owner: jax.Array, member: jax.Array, parts: int) -> jax.Array:
    """Each id's slot in its owner's bucket: i32[N], the rank of the id among the ids for the same owner."""
    n = owner.shape[0]
    if parts <= _RANK_BY_COUNT:
        hits = (member[:, None] & (owner[:, None] == jnp.arange(parts, dtype=owner.dtype)[None, :])).astype(jnp.int32)
        return jnp.take_along_axis(jnp.cumsum(hits, axis=0), owner[:, None], axis=1)[:, 0] - 1
    key = jnp.where(member, owner, parts)
    order = jnp.argsort(key, stable=True)
    counts = jnp.zeros(parts + 1, jnp.int32).at[key].add(1)
    starts = jnp.cumsum(counts) - counts
    ranked = jnp.arange(n, dtype=jnp.int32) - starts[key[order]]
    return jnp.zeros(n, jnp.int32).at[order].set(ranked, unique_indices=True)


def _compact_slots(member: jax.Array, size: int) -> jax.Array:
    """Where each member entry goes in a packed buffer of `size` (its rank among members); `size` (dropped) for the
    others."""
    return jnp.where(member, jnp.cumsum(member, dtype=jnp.int32) - 1, size)


def _bags_of(counts: jax.Array, size: int) -> jax.Array:
    """i32[parts, size]: the bag each of a bucket's `size` packed ids belongs to, from each requester's counts
    i32[parts, bags] of ids per bag (in bag order); `bags` for the padding after them."""
    ends = jnp.cumsum(counts, axis=1)
    where = jnp.broadcast_to(jnp.arange(size, dtype=ends.dtype), (counts.shape[0], size))
    return jax.vmap(lambda e, w: jnp.searchsorted(e, w, side="right"))(ends, where).astype(jnp.int32)


def _pool(vals: jax.Array, bag: jax.Array, scale: jax.Array | None, bags: int) -> jax.Array:
    """f32[requesters, bags, d]: each requester's received rows `vals` f32[requesters, M, d] summed into its bags
    (`bag` i32[requesters, M], `bags` = padding, dropped), each times its bag's scale (f32[requesters, bags]; None:
    1, sum pooling) -- the weighted sum the single-device gather-reduce computes, in f32."""
    requesters, m, d = vals.shape
    vals = vals.astype(jnp.float32)
    if scale is not None:
        vals = vals * jnp.take_along_axis(scale, jnp.minimum(bag, bags - 1), axis=1)[..., None]
    target = jnp.where(bag < bags, jnp.arange(requesters, dtype=jnp.int32)[:, None] * bags + bag, requesters * bags)
    out = jnp.zeros((requesters * bags, d), jnp.float32).at[target.reshape(-1)].add(vals.reshape(-1, d),
                                                                                   mode="drop")
    return out.reshape(requesters, bags, d)


@dataclasses.dataclass
class _Received:
    """What an owner received to update: `direct` ids with a gradient each (rows), `bagged` ids each adding the
    pooled gradient of its bag: row `source` of the bags' gradients `grads` f32[S, d] (their scales f32[S], or None
    for sum pooling), which are the same whatever the buckets' size."""

    direct_ids: list = dataclasses.field(default_factory=list)
    direct_grads: list = dataclasses.field(default_factory=list)
    bagged_ids: list = dataclasses.field(default_factory=list)
    sources: list = dataclasses.field(default_factory=list)
    grads: list = dataclasses.field(default_factory=list)
    scales: list = dataclasses.field(default_factory=list)

    def add_direct(self, ids, grads):
        self.direct_ids.append(ids.reshape(-1))
        self.direct_grads.append(grads.reshape(-1, grads.shape[-1]))

    def add_bags(self, grads, scales) -> int:
        """Pooled gradients grads [R, bags, d] of R requesters' bags (scales [R, bags] or None): their first row."""
        first = sum(g.shape[0] for g in self.grads)
        self.grads.append(grads.reshape(-1, grads.shape[-1]))
        if scales is not None:
            self.scales.append(scales.reshape(-1))
        return first

    def add_bagged(self, ids, bag, first: int, bags: int):
        """ids [R, M] received from R requesters, bag i32[R, M] (`bags` = padding) of the bags added at `first`."""
        source = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None] * bags + jnp.minimum(bag, bags - 1)
        self.bagged_ids.append(ids.reshape(-1))
        self.sources.append((first + source).reshape(-1))

    def with_bagged(self) -> "_Received":
        """A copy sharing the bags' gradients, to add a bucket size's ids to."""
        return _Received(list(self.direct_ids), list(self.direct_grads), list(self.bagged_ids), list(self.sources),
                         self.grads, self.scales)


@dataclasses.dataclass
class _Context:
    """What `fetch` leaves `update` of one array: the requester's side (where its bags and rows went) and the owner's
    (what it received), and the step's overflow flag (None: its buckets are the worst case)."""

    overflow: jax.Array | None = None
    whole_recv: jax.Array | None = None  # i32[requesters, whole_slots]
    whole_scales: jax.Array | None = None  # f32[requesters, whole_bags] (mean pooling)
    split_recv: jax.Array | None = None  # i32[requesters, C] (padded to the worst case)
    split_bags: jax.Array | None = None  # i32[requesters, C]
    split_scales: jax.Array | None = None  # f32[requesters, split_bags]
    rows_member: jax.Array | None = None  # bool[N] this array's rows among the device's distinct rows
    rows_dest: jax.Array | None = None  # i32[N] their owner (parts: none)
    rows_filled: jax.Array | None = None  # i32[parts] how many of them each owner's bucket holds
    rows_pos: jax.Array | None = None  # i32[N] their slot in its bucket
    rows_recv: jax.Array | None = None  # i32[requesters, C] (padded) / column and replicated: the gathered ids
    rows_slot: jax.Array | None = None  # i32[N] (column / replicated: the packed slot)


class Exchange:
    """The collection's tables laid out by a plan on a mesh: device-side `fetch` / `update` (call them inside
    `jax.shard_map` over every mesh axis) and host-side `shard` / `unshard` of the single-device layout. The mesh
    layout (recjax/sharding/layout.py) puts it behind the step's interface.

    `arrays` (default: the plan's) lets a storage add arrays the plan does not know (a disk tier's caches);
    `storage_of` {group: storage} says how the owner reads and updates each group's block (recjax/placement/
    storage.py: in place for device memory, rows brought from host memory, ...); default: device memory. Which
    tables pool on their owners is the plan's (`ShardingPlan.pooled`, after `plan.exchange`)."""

    def __init__(self, collection: EmbeddingCollection, plan: ShardingPlan, mesh: jax.sharding.Mesh,
                 exchange_dtype: str = "float32", capacity_factor: float = 0.0, capacity_sigmas: float = 0.0,
                 arrays: Mapping[str, MeshArray] | None = None, storage_of: Mapping | None = None):
        self.collection = collection
        self.plan = plan
        self.mesh = mesh
        self.exchange_dtype = jnp.dtype(exchange_dtype)
        self.capacity_factor = float(capacity_factor)  # 0: buckets always of the worst case C
        self.capacity_sigmas = float(capacity_sigmas)
        self.arrays = dict(arrays) if arrays is not None else mesh_arrays(collection, plan)
        self.storage_of = dict(storage_of or {})
        self.local_batch = plan.batch_size // plan.devices
        self.tables = collection_tables(collection)
        self.sizes = sized_arrays(self.arrays, self.tables, plan, self.local_batch, capacity_factor, capacity_sigmas)
        # The reads each device pools itself, from the distinct rows it fetched (everything not pooled on an owner).
        pooled = {m.key for x in self.sizes.values() for m in x.pooled}
        self.local_reads = frozenset((p.feature, p.index) for placed in collection.placements.values()
                                     for p in placed) - pooled
        self.mean = collection.pooling == "mean"

    def _read(self, s: MeshArray, table: jax.Array):
        """local ids i32[n] -> the rows of `table` (the local block of array `s`) there, zeros out of range."""
        storage = self.storage_of.get(s.group)
        if storage is not None and not storage.resident:
            return lambda ids: storage.bring(s.group, table, ids)
        return lambda ids: jnp.take(table, ids, axis=0, mode="fill", fill_value=0)

    def _apply(self, s: MeshArray, optimizer, table, state, distinct, current, summed, lr, step):
        storage, kernel, interpret = self.storage_of.get(s.group), self.collection.kernel, self.collection.interpret
        if storage is None:
            return sparse_apply(optimizer, table, state, distinct, current, summed, lr, step, kernel=kernel,
                                interpret=interpret)
        return storage.apply(s.group, optimizer, table, state, distinct, current, summed, lr, step, kernel, interpret)

    # ------------------------------------------------------------------------------------------- device side
    def fetch(self, tables: Mapping[str, jax.Array], routes: Routes) -> tuple[Lookups, dict]:
        """The bags the loss is differentiated against (`Lookups`: each pooled read's f32[b, d], pooled on its
        owner or here from the distinct rows fetched, and each per-id read's rows), and what `update` needs to send
        their gradients back."""
        collection, features = self.collection, routes.features
        pooled: dict[Key, jax.Array] = {}
        rows: dict[str, jax.Array] = {}
        context: dict[str, _Context] = {}
        for group, u in routes.unique.items():
            n, d = u.shape[0], collection.group_dims[group]
            arrays = [s for s in self.arrays.values() if s.group == group]
            needed = self._needed(group, u, features)
            out = jnp.zeros((n, d), jnp.float32) if any(self.sizes[s.name].rows.any() for s in arrays) else None
            for s in arrays:
                x, ctx = self.sizes[s.name], _Context()
                context[s.name] = ctx
                read = self._read(s, tables[s.name])
                stacked = {m.key: u[features[m.key[0]].slots[m.key[1]]] for m in x.pooled}
                scales = {m.key: features[m.key[0]].weights.max(axis=1) for m in x.pooled} if self.mean else None
                if s.kind == "replicated":
                    got = self._replicated_fetch(s, x, read, u, needed, ctx)
                elif s.kind == "column":
                    got = self._column_fetch(s, x, read, tables[s.name], u, needed, stacked, scales, pooled, ctx)
                else:
                    got = self._sharded_fetch(s, x, read, tables[s.name], u, needed, stacked, scales, pooled, ctx)
                if got is not None:
                    out = out + got
            if out is not None:
                rows[group] = out
        local = collection.lookup(rows, features, self.local_reads) if self.local_reads else Lookups({}, {})
        return self._lookups(features, pooled, local), {"arrays": context, "rows": rows}

    def _lookups(self, features, pooled: Mapping[Key, jax.Array], local: Lookups) -> Lookups:
        """The `Lookups` the glue reads: each pool batch's reads stacked [K, b, d] in the collection's order, from
        the owners' sums or the local gather-reduce."""
        collection = self.collection
        local_pooled = {}
        for key, members in collection.pool_batches(features, self.local_reads).items():
            for k, member in enumerate(members):
                local_pooled[member] = local.pooled[key][k]
        out = {}
        for key, members in collection.pool_batches(features).items():
            out[key] = jnp.stack([pooled[m].astype(jnp.float32) if m in pooled else local_pooled[m]
                                  for m in members])
        return Lookups(pooled=out, per_id=dict(local.per_id))

    def _needed(self, group: str, u: jax.Array, features) -> jax.Array | None:
        """bool[N]: the device's distinct rows some locally pooled read uses (None: every one, nothing of the group
        pools on an owner)."""
        placed = [p for ps in self.collection.placements.values() for p in ps if p.group == group]
        if all((p.feature, p.index) in self.local_reads for p in placed):
            return None
        mark = jnp.zeros(u.shape[0], bool)
        for p in placed:
            if (p.feature, p.index) in self.local_reads:
                mark = mark.at[features[p.feature].slots[p.index].reshape(-1)].set(True, mode="drop")
        return mark

    def _replicated_fetch(self, s, x, read, u, needed, ctx):
        if not x.rows.any():
            return None
        member, _, local = s.locate(u)
        member = member if needed is None else member & needed
        ctx.rows_member, ctx.rows_recv = member, local
        ctx.rows_slot = _compact_slots(member, x.rows_sizes[0])
        return jnp.where(member[:, None], read(local), 0.0)

    def _column_fetch(self, s, x, read, table, u, needed, stacked, scales, pooled, ctx):
        d, parts, b, dtype = s.dim, s.parts, self.local_batch, self.exchange_dtype
        if x.whole:  # every device's bags, pooled over this device's columns, returned as slices
            width, bags = x.whole_slots, x.whole_bags
            ids, sc = self._whole_bucket(s, x, stacked, scales, 1)
            everyone = jax.lax.all_gather(ids, s.axes, tiled=True).reshape(parts, width)
            if sc is not None:
                sc = jax.lax.all_gather(sc, s.axes, tiled=True).reshape(parts, bags)
            sums = self._pool_whole(s, x, table, everyone, sc)
            back = jax.lax.all_to_all(sums.astype(dtype), s.axes, 0, 2, tiled=True).reshape(bags, d)
            for m, first in zip(x.whole, x.whole_bag, strict=True):
                pooled[m.key] = back[first: first + b]
            ctx.whole_recv, ctx.whole_scales = everyone, sc
        if not x.rows.any():
            return None
        size = x.rows_sizes[0]
        member, _, local = s.locate(u)
        member = member if needed is None else member & needed
        slot = _compact_slots(member, size)  # this array's rows, packed into i32[S]
        packed = jnp.full(size, s.local_rows, jnp.int32).at[slot].set(local, mode="drop")
        ids = jax.lax.all_gather(packed, s.axes, tiled=True)  # i32[parts * S]
        vals = read(ids).astype(dtype).reshape(parts, size, d // parts)
        back = jax.lax.all_to_all(vals, s.axes, 0, 2, tiled=True).reshape(size, d)
        ctx.rows_member, ctx.rows_recv, ctx.rows_slot = member, ids, slot
        return jnp.where(member[:, None], back[jnp.minimum(slot, size - 1)].astype(jnp.float32), 0.0)

    def _sharded_fetch(self, s, x, read, table, u, needed, stacked, scales, pooled, ctx):
        parts, b, dtype = s.parts, self.local_batch, self.exchange_dtype
        if x.whole:  # table-wise: each read's b x L slots in place in its owner's bucket
            width, bags = x.whole_slots, x.whole_bags
            send, sc = self._whole_bucket(s, x, stacked, scales, parts)
            recv = jax.lax.all_to_all(send.reshape(parts, width), s.axes, 0, 0)  # recv[j]: requester j's slots
            if sc is not None:
                sc = jax.lax.all_to_all(sc.reshape(parts, bags), s.axes, 0, 0)
            sums = self._pool_whole(s, x, table, recv, sc)
            back = jax.lax.all_to_all(sums.astype(dtype), s.axes, 0, 0)  # back[p]: owner p's sums of my bags
            for m, owner, first in zip(x.whole, x.whole_owner, x.whole_bag, strict=True):
                pooled[m.key] = back[owner, first: first + b]
            ctx.whole_recv, ctx.whole_scales = recv, sc
        split = rows = None
        if x.split:  # row-wise: each slot to the owner of its row, packed, with each bag's count per owner
            flat = jnp.concatenate([stacked[m.key].reshape(-1) for m in x.split])
            member, owner, local = s.locate(flat)
            pos = _bucket_positions(owner, member, parts)
            bag_of = np.concatenate([c * b + np.arange(b * m.bag) // m.bag for c, m in enumerate(x.split)])
            counts = jnp.zeros((parts, x.split_bags), jnp.int32).at[owner, bag_of].add(member.astype(jnp.int32))
            sc = None
            if scales is not None:
                sc = jnp.broadcast_to(jnp.concatenate([scales[m.key] for m in x.split]), (parts, x.split_bags))
                sc = jax.lax.all_to_all(sc, s.axes, 0, 0)
            split = (member, owner, local, pos, jax.lax.all_to_all(counts, s.axes, 0, 0), sc, counts.sum(axis=1))
            ctx.split_scales = sc
        if x.rows.any():  # distinct rows to their owners
            member, owner, local = s.locate(u)
            member = member if needed is None else member & needed
            pos = _bucket_positions(owner, member, parts)
            dest = jnp.where(member, owner, parts)  # non-members fall off the buffer
            filled = jnp.zeros(parts + 1, jnp.int32).at[dest].add(1)[:parts]
            rows = (member, owner, local, dest, pos, filled)
            ctx.rows_member, ctx.rows_dest, ctx.rows_pos = member, dest, pos
            ctx.rows_filled = filled
        if split is None and rows is None:
            return None
        worst = (x.split_sizes[0], x.rows_sizes[0])
        small = (x.split_sizes[1], x.rows_sizes[1])
        ctx.overflow = self._overflow(split, rows, small) if x.bucketed else None
        run = functools.partial(self._buckets, s, x, read, split, rows, worst)
        if ctx.overflow is None:
            split_back, ctx.split_recv, ctx.split_bags, got, ctx.rows_recv = run(worst)
        else:
            split_back, ctx.split_recv, ctx.split_bags, got, ctx.rows_recv = jax.lax.cond(
                ctx.overflow, _fallback(lambda: run(worst)), lambda: run(small))
        for c, (m, holders) in enumerate(zip(x.split, x.split_holders, strict=True)):
            parts_of_bag = [split_back[p, c * b: (c + 1) * b].astype(jnp.float32) for p in holders]
            pooled[m.key] = functools.reduce(jnp.add, parts_of_bag)  # the owners' partial sums, in owner order
        return got

    def _whole_bucket(self, s, x, stacked, scales, parts: int) -> tuple[jax.Array, jax.Array | None]:
        """The table-wise (or column-wise) reads' ids in place in their owners' buckets, i32[parts * whole_slots]
        (the sentinel where an owner has fewer bags or a slot reads no row), and their bags' scales f32[parts *
        whole_bags] (mean pooling; None for sum)."""
        b, width, bags = self.local_batch, x.whole_slots, x.whole_bags
        owners = x.whole_owner if parts > 1 else (0,) * len(x.whole)
        index = np.concatenate([owner * width + first + np.arange(b * m.bag) for m, owner, first in
                                zip(x.whole, owners, x.whole_first, strict=True)])
        ids = jnp.concatenate([s.locate(stacked[m.key].reshape(-1))[2] for m in x.whole])
        ids = jnp.full(parts * width, s.local_rows, jnp.int32).at[index].set(ids, unique_indices=True)
        if scales is None:
            return ids, None
        index = np.concatenate([owner * bags + first + np.arange(b) for owner, first in
                                zip(owners, x.whole_bag, strict=True)])
        sc = jnp.zeros(parts * bags, jnp.float32).at[index].set(jnp.concatenate([scales[m.key] for m in x.whole]),
                                                                  unique_indices=True)
        return ids, sc

    def _pool_whole(self, s, x, table, recv: jax.Array, scales: jax.Array | None) -> jax.Array:
        """f32[requesters, whole_bags, d]: each requester's bags of the ids recv i32[requesters, whole_slots] it sent
        (in place), one gather-reduce per bag length (`whole_groups`) -- the single-device pooling (weights: the
        bag's scale, or 1; a slot that reads no row reads zeros) -- or, packed, a segment sum."""
        storage = self.storage_of.get(s.group)
        requesters, out, slot, bag = recv.shape[0], [], 0, 0
        if not x.whole_groups:  # packed: each owner its own layout
            segments = jnp.asarray(x.whole_segments(s.parts if s.kind != "column" else 1))
            me = jax.lax.axis_index(s.axes) if s.kind != "column" else 0
            bag = jnp.broadcast_to(segments[me], recv.shape)
            return _pool(self._read(s, table)(recv.reshape(-1)).reshape(*recv.shape, -1), bag, scales, x.whole_bags)
        for length, bags in x.whole_groups:
            ids = recv[:, slot: slot + length * bags].reshape(requesters * bags, length)
            weights = jnp.ones(ids.shape, jnp.float32) if scales is None else jnp.broadcast_to(
                scales[:, bag: bag + bags].reshape(-1, 1), ids.shape)
            if storage is None or storage.resident:
                sums = gather_reduce(table, ids, weights, impl=self.collection.kernel,
                                     interpret=self.collection.interpret)
            else:  # rows brought to the device first (host memory)
                rows = storage.bring(s.group, table, ids.reshape(-1)).astype(jnp.float32)
                sums = (rows.reshape(*ids.shape, -1) * weights[..., None]).sum(axis=-2)
            out.append(sums.reshape(requesters, bags, -1))
            slot, bag = slot + length * bags, bag + bags
        return jnp.concatenate(out, axis=1)

    def _buckets(self, s, x, read, split, rows, worst, sizes):
        """The bucketed exchanges of a sharded array at bucket sizes `sizes` (split ids, rows): (the split bags'
        sums from each owner [parts, split_bags, d], the split ids and bags each requester sent me, padded to the
        worst case, this device's rows f32[N, d], the row ids each requester sent me, padded)."""
        d, parts, dtype, sentinel = s.dim, s.parts, self.exchange_dtype, s.local_rows
        split_size, rows_size = sizes
        out = [None] * 5
        if split is not None:
            member, owner, local, pos, counts, sc, filled = split
            send = jnp.full((parts, split_size), sentinel, jnp.int32).at[jnp.where(member, owner, parts), pos].set(
                local, mode="drop")
            recv = _bucket_all_to_all(send, filled, s.axes, sentinel)
            bag = _bags_of(counts, split_size)
            sums = _pool(read(recv.reshape(-1)).reshape(parts, split_size, d), bag, sc, x.split_bags)
            out[0] = jax.lax.all_to_all(sums.astype(dtype), s.axes, 0, 0)
            pad = ((0, 0), (0, worst[0] - split_size))
            out[1] = jnp.pad(recv, pad, constant_values=sentinel)
            out[2] = jnp.pad(bag, pad, constant_values=x.split_bags)
        if rows is not None:
            member, owner, local, dest, pos, filled = rows
            send = jnp.full((parts, rows_size), sentinel, jnp.int32).at[dest, pos].set(local, mode="drop")
            recv = _bucket_all_to_all(send, filled, s.axes, sentinel)  # recv[j]: the rows device j asks me for
            vals = read(recv.reshape(-1)).astype(dtype).reshape(parts, rows_size, d)
            back = _bucket_all_to_all(vals, (recv < sentinel).sum(axis=1), s.axes)  # back[j]: from owner j
            got = back[owner, jnp.minimum(pos, rows_size - 1)].astype(jnp.float32)
            out[3] = jnp.where(member[:, None], got, 0.0)
            out[4] = jnp.pad(recv, ((0, 0), (0, worst[1] - rows_size)), constant_values=sentinel)
        return tuple(out)

    @staticmethod
    def _overflow(split, rows, small) -> jax.Array:
        """bool[]: does any device have more than its small bucket's ids for one owner this step (psum'ed, so every
        device takes the same branch)."""
        mine = jnp.zeros((), bool)
        if split is not None:
            mine = mine | jnp.any(split[0] & (split[3] >= small[0]))
        if rows is not None:
            mine = mine | jnp.any(rows[0] & (rows[4] >= small[1]))
        return jax.lax.psum(mine.astype(jnp.int32), ALL_AXES) > 0

    def update(self, optimizer: SparseOptimizer, tables: Mapping[str, jax.Array], state: Mapping[str, dict],
               routes: Routes, context: Mapping, grads: Lookups, lr: jax.Array, step: jax.Array
               ) -> tuple[dict, dict, dict]:
        """Send each bag's pooled gradient to the owners that pooled it, and each fetched row's gradient (d loss / d
        the distinct rows, through the local lookup's transpose) to its owner; each owner sums its rows' gradients
        and applies the optimizer there, in place. Also returns {array: i32[M]} the local rows each device updated
        (padded with the sentinel `local_rows`), for the checkpoints' dirty-row bitmaps."""
        collection, features = self.collection, routes.features
        g_bags: dict[Key, jax.Array] = {}
        for key, members in collection.pool_batches(features).items():
            for k, member in enumerate(members):
                g_bags[member] = grads.pooled[key][k]
        row_grads = {}
        if context["rows"]:
            local = collection.pool_batches(features, self.local_reads)
            cotangent = Lookups(pooled={key: jnp.stack([g_bags[m] for m in members]) for key, members in local.items()},
                                per_id={name: grads.per_id[name] for name in grads.per_id})
            _, transpose = jax.vjp(lambda rows: collection.lookup(rows, features, self.local_reads), context["rows"])
            (row_grads,) = transpose(cotangent)
        new_tables, new_state, touched = dict(tables), dict(state), {}
        for name, s in self.arrays.items():
            x, ctx = self.sizes[name], context["arrays"][name]
            g_rows = None
            if x.rows.any():
                g_rows = jnp.where(ctx.rows_member[:, None], row_grads[s.group], 0.0).astype(self.exchange_dtype)
            optimizer_s = collection.group_optimizer(optimizer, s.group)
            if s.kind in ("replicated", "column"):
                received = self._received_static(s, x, ctx, g_bags, g_rows)
                new_tables[name], new_state[name], touched[name] = self._apply_received(
                    s, optimizer_s, tables[name], state[name], received, lr, step)
            else:
                new_tables[name], new_state[name], touched[name] = self._sharded_update(
                    s, x, ctx, optimizer_s, tables[name], state[name], g_bags, g_rows, lr, step)
        return new_tables, new_state, touched

    def _received_static(self, s, x, ctx, g_bags, g_rows) -> _Received:
        """What the owner of a replicated or column array receives to update (no buckets)."""
        d, parts, dtype = s.dim, s.parts, self.exchange_dtype
        received = _Received()
        if x.whole:  # column: each pooled gradient's column slices to their devices
            # Each read's bags where the forward pooled them (`whole_bag`: grouped by bag length, not read order).
            packed = jnp.zeros((1, x.whole_bags, d), dtype)
            for m, first in zip(x.whole, x.whole_bag, strict=True):
                packed = packed.at[0, first: first + self.local_batch].set(g_bags[m.key].astype(dtype))
            recv = jax.lax.all_to_all(packed, s.axes, 2, 0, tiled=True)  # [parts, bags, d / parts]
            bag = jnp.broadcast_to(jnp.asarray(x.whole_segments(1)[0]), ctx.whole_recv.shape)
            received.add_bagged(ctx.whole_recv, bag, received.add_bags(recv, ctx.whole_scales), x.whole_bags)
        if g_rows is not None:
            size = x.rows_sizes[0]
            if s.kind == "replicated":  # every device's touched rows and gradients, to every copy
                packed = jnp.full(size, s.local_rows, jnp.int32).at[ctx.rows_slot].set(ctx.rows_recv, mode="drop")
                ids = jax.lax.all_gather(packed, ALL_AXES, tiled=True)  # i32[n * S]
                grads = jax.lax.all_gather(jnp.zeros((size, d), g_rows.dtype).at[ctx.rows_slot].set(
                    g_rows, mode="drop"), ALL_AXES, tiled=True)
            else:  # column: each row gradient's slices to their devices
                packed = jnp.zeros((1, size, d), g_rows.dtype).at[0, ctx.rows_slot].set(g_rows, mode="drop")
                grads = jax.lax.all_to_all(packed, s.axes, 2, 0, tiled=True).reshape(parts * size, d // parts)
                ids = ctx.rows_recv
            received.add_direct(ids, grads)
        return received

    def _sharded_update(self, s, x, ctx, optimizer, table, state, g_bags, g_rows, lr, step):
        d, parts, b, dtype = s.dim, s.parts, self.local_batch, self.exchange_dtype
        static = _Received()
        if x.whole:  # each bag's gradient to its table's owner
            send = jnp.zeros((parts, x.whole_bags, d), dtype)
            for m, owner, first in zip(x.whole, x.whole_owner, x.whole_bag, strict=True):
                send = send.at[owner, first: first + b].set(g_bags[m.key].astype(dtype))
            recv = jax.lax.all_to_all(send, s.axes, 0, 0)
            bag = jnp.broadcast_to(jnp.asarray(x.whole_segments(parts))[jax.lax.axis_index(s.axes)],
                                   ctx.whole_recv.shape)
            static.add_bagged(ctx.whole_recv, bag, static.add_bags(recv, ctx.whole_scales), x.whole_bags)
        split_first = None
        if x.split:  # each bag's gradient to every owner of a part of its table
            send = jnp.zeros((parts, x.split_bags, d), dtype)
            for c, (m, holders) in enumerate(zip(x.split, x.split_holders, strict=True)):
                send = send.at[np.array(holders), c * b: (c + 1) * b].set(g_bags[m.key].astype(dtype))
            split_first = static.add_bags(jax.lax.all_to_all(send, s.axes, 0, 0), ctx.split_scales)
        static = self._gather_bags(s, static)

        inputs = {"static": dataclasses.astuple(static), "split_recv": ctx.split_recv, "split_bags": ctx.split_bags,
                  "rows_dest": ctx.rows_dest, "rows_pos": ctx.rows_pos, "rows_filled": ctx.rows_filled,
                  "rows_recv": ctx.rows_recv, "g_rows": g_rows}

        def received_at(sizes, inputs) -> _Received:
            split_size, rows_size = sizes
            received = _Received(*(list(v) for v in inputs["static"]))
            if split_first is not None:
                received.add_bagged(inputs["split_recv"][:, :split_size], inputs["split_bags"][:, :split_size],
                                    split_first, x.split_bags)
            if g_rows is not None:  # the row gradients back through the buckets
                send = jnp.zeros((parts, rows_size, d), g_rows.dtype).at[inputs["rows_dest"], inputs["rows_pos"]].set(
                    inputs["g_rows"], mode="drop")
                grads = _bucket_all_to_all(send, inputs["rows_filled"], s.axes)  # aligned with rows_recv[:, :size]
                received.add_direct(inputs["rows_recv"][:, :rows_size], grads)
            return received

        def apply_at(sizes, table, state, inputs):
            return self._apply_received(s, optimizer, table, state, received_at(sizes, inputs), lr, step)

        worst = (x.split_sizes[0], x.rows_sizes[0])
        if ctx.overflow is None:
            return apply_at(worst, table, state, inputs)
        # The small buckets' update, or (the step overflowed) the worst case's: loops run zero or one time, which
        # update the table in place where a cond taking it as an operand makes XLA:CPU copy it. Their inputs pass an
        # optimization barrier with the loop index: else XLA hoists what does not depend on the table (the worst
        # case's dedup and sums) out of the loop, and every step computes it.
        small = (x.split_sizes[1], x.rows_sizes[1])
        touched = []
        for sizes, trips, scope in ((small, 1 - ctx.overflow.astype(jnp.int32), lambda f: f),
                                    (worst, ctx.overflow.astype(jnp.int32), _fallback)):
            length = self._received_length(s, x, sizes)

            def body(i, carry, sizes=sizes):
                here, _ = jax.lax.optimization_barrier((inputs, i))
                return apply_at(sizes, carry[0], carry[1], here)

            table, state, distinct = jax.lax.fori_loop(
                0, trips, scope(body), (table, state, jnp.full(length, s.local_rows, jnp.int32)))
            touched.append(distinct)
        return table, state, jnp.concatenate(touched)

    def _gather_bags(self, s: MeshArray, received: _Received) -> _Received:
        """`received` with the bags' gradients (and scales) of every copy of the block (`replica_axes`): each copy
        applies every copy's updates. Gathered once, outside the buckets' branches: they do not depend on them."""
        if s.kind not in ("sharded", "model") or not s.replica_axes or not received.grads:
            return received
        gather = lambda v: jax.lax.all_gather(v, s.replica_axes, tiled=True)  # noqa: E731
        grads = [gather(jnp.concatenate(received.grads))]
        scales = [gather(jnp.concatenate(received.scales))] if received.scales else []
        return _Received(list(received.direct_ids), list(received.direct_grads), list(received.bagged_ids),
                         list(received.sources), grads, scales)

    def _received_length(self, s: MeshArray, x: ArrayExchange, sizes) -> int:
        """The distinct rows an update at bucket sizes `sizes` holds (`_apply_received`'s, padded)."""
        slots = s.parts * ((x.whole_slots if x.whole else 0) + (sizes[0] if x.split else 0)
                           + (sizes[1] if x.rows.any() else 0))
        replicas = math.prod(self.mesh.shape[a] for a in s.replica_axes)
        return min(replicas * slots, s.local_rows + 1)

    def _apply_received(self, s, optimizer, table, state, received: _Received, lr, step):
        """Sum each distinct received row's gradients in f32 and apply the optimizer to it where it lives:
        (table, state, the distinct local rows i32[U], sentinel-padded)."""
        cat = lambda parts: jnp.concatenate(parts) if parts else None  # noqa: E731
        direct_ids, direct_grads = cat(received.direct_ids), cat(received.direct_grads)
        bagged_ids, sources = cat(received.bagged_ids), cat(received.sources)
        grads, scales = cat(received.grads), cat(received.scales)
        if s.kind in ("sharded", "model") and s.replica_axes:  # every copy of the block applies every copy's
            gather = lambda v: None if v is None else jax.lax.all_gather(v, s.replica_axes, tiled=True)  # noqa
            if sources is not None:  # the bags' gradients are gathered already (`_gather_bags`)
                replicas = math.prod(self.mesh.shape[a] for a in s.replica_axes)
                sources = gather(sources) + jnp.repeat(jnp.arange(replicas, dtype=jnp.int32)
                                                       * (grads.shape[0] // replicas), sources.shape[0])
            direct_ids, direct_grads, bagged_ids = gather(direct_ids), gather(direct_grads), gather(bagged_ids)
        ids = jnp.concatenate([v for v in (direct_ids, bagged_ids) if v is not None])
        distinct, inverse = unique_rows(ids, s.local_rows)
        keep = min(ids.shape[0], s.local_rows + 1)  # at most the block's rows and the sentinel are distinct
        distinct = distinct[:keep]
        summed = jnp.zeros((keep, s.dim if s.kind != "column" else s.dim // s.parts), jnp.float32)
        first = 0
        if direct_ids is not None:
            first = direct_ids.shape[0]
            summed = summed.at[inverse[:first]].add(direct_grads.astype(jnp.float32))
        if bagged_ids is not None:  # each id adds its bag's pooled gradient, times the bag's scale (sum: 1)
            per_id = grads.astype(jnp.float32)[sources]
            if scales is not None:
                per_id = per_id * scales[sources][:, None]
            summed = summed.at[inverse[first:]].add(per_id)
        current = self._read(s, table)(distinct)
        table, state = self._apply(s, optimizer, table, state, distinct, current, summed, lr, step)
        return table, state, distinct

    @staticmethod
    def overflows(context: Mapping) -> jax.Array:
        """i32[]: how many arrays took the worst-case buckets this step (the same on every device)."""
        flags = [c.overflow for c in context["arrays"].values() if c.overflow is not None]
        return sum((f.astype(jnp.int32) for f in flags), jnp.zeros((), jnp.int32))

    def bucketed(self) -> int:
        """How many arrays have buckets smaller than their worst case (a step may overflow them)."""
        return sum(x.bucketed for x in self.sizes.values())

    # --------------------------------------------------------------------------------------------- host side
    def sharding(self, name: str) -> NamedSharding:
        """Where array `name` lives: its spec on the mesh, in its storage's memory (host memory: `pinned_host`)."""
        s = self.arrays[name]
        storage = self.storage_of.get(s.group)
        kind = None if storage is None else storage.memory_kind
        return NamedSharding(self.mesh, s.spec, memory_kind=kind)

    def shard(self, by_group: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Single-device stacked arrays {group: [rows, ...]} (tables or one optimizer state field) -> the plan's
        arrays {name: jax.Array}, each device receiving only its block."""
        return {name: put_global(data, self.sharding(name))
                for name, data in array_layout(self.arrays, by_group).items()}

    def unshard(self, by_array: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
        """The inverse of `shard`: {group: np.ndarray} in the single-device layout (on every process)."""
        return group_layout(self.arrays, {name: to_host(a) for name, a in by_array.items()})


def sized_arrays(arrays: Mapping[str, MeshArray], tables_of: Mapping[str, list[TableRecord]], plan: ShardingPlan,
                 local_batch: int, capacity_factor: float, capacity_sigmas: float) -> dict[str, ArrayExchange]:
    """Every array's `ArrayExchange`, pooling the tables the plan pools (`ShardingPlan.pooled`)."""
    pooled = {p.table.name for p in plan.placements
              if pools_on_owner(p, plan.mesh_shape, plan.batch_size, plan.exchange)}
    out = {}
    for name, s in arrays.items():
        tables = tables_of[s.group]
        slots = min(local_batch * sum(t.bags for t in tables), tables[-1].offset + tables[-1].rows + 1)
        out[name] = size_exchange(s, tables, {i: t.name in pooled for i, t in enumerate(tables)}, local_batch,
                                  slots, capacity_factor, capacity_sigmas)
    return out


def exchange_collectives(plan: ShardingPlan, capacity_factor: float, capacity_sigmas: float, itemsize: int = 4,
                         mean: bool = False) -> list[dict]:
    """The collectives the compiled step runs for `plan`'s exchange on CPU, each {"op", "bytes" (its result on one
    device), "fallback" (in the worst-case buckets' branch)}: the same static sizes the runtime allocates
    (`sized_arrays`), from the plan alone. Rows and gradients are `itemsize` bytes a value; `mean`: mean pooling
    (the bags' scales travel too). Not counted: the overflow flags' and the dense gradients' all-reduces, and a
    dynamic method's routing-array all-gathers (recjax/sharding/layout.py `update_aux`)."""
    tables_of, dims = plan_tables(plan)
    arrays = _arrays(tables_of, dims, plan)
    sizes = sized_arrays(arrays, tables_of, plan, plan.batch_size // plan.devices, capacity_factor, capacity_sigmas)
    out = []
    for name, s in arrays.items():
        out += array_collectives(s, sizes[name], plan.devices, itemsize, mean)
    return out


def exchange_bytes(plan: ShardingPlan, capacity_factor: float, capacity_sigmas: float, itemsize: int = 4,
                   mean: bool = False) -> tuple[int, int]:
    """(bytes a step's exchange collectives deliver to each device when its buckets fit, when they overflow into the
    worst case): `exchange_collectives` summed -- what the compiled HLO says (recjax/sharding/hlo.py)."""
    collectives = exchange_collectives(plan, capacity_factor, capacity_sigmas, itemsize, mean)
    small = sum(c["bytes"] for c in collectives if not c["fallback"])
    worst = sum(c["bytes"] for c in collectives if c["fallback"] or not c["bucketed"])
    return small, worst


def array_collectives(s: MeshArray, x: ArrayExchange, devices: int, itemsize: int, mean: bool) -> list[dict]:
    """One array's collectives (`exchange_collectives`), in the order the step runs them."""
    out = []

    def op(kind, count, each, fallback=False, bucketed=False):
        """`bucketed`: sized by the small buckets, replaced by a `fallback` one in a step that overflows."""
        out.append({"op": kind, "bytes": int(count * each), "fallback": fallback, "bucketed": bucketed,
                    "array": s.name})

    d, parts = s.dim, s.parts
    if s.kind == "replicated":
        if x.rows.any():
            size = x.rows_sizes[0]
            op("all-gather", devices * size, 4)
            op("all-gather", devices * size * d, itemsize)
        return out
    if s.kind == "column":
        if x.whole:
            op("all-gather", devices * x.whole_slots, 4)
            if mean:
                op("all-gather", devices * x.whole_bags, 4)
            op("all-to-all", x.whole_bags * d, itemsize)
        if x.rows.any():
            size = x.rows_sizes[0]
            op("all-gather", devices * size, 4)
            op("all-to-all", size * d, itemsize)
        if x.whole:
            op("all-to-all", x.whole_bags * d, itemsize)
        if x.rows.any():
            op("all-to-all", x.rows_sizes[0] * d, itemsize)
        return out
    replicas = devices // parts
    if x.whole:
        op("all-to-all", parts * x.whole_slots, 4)
        if mean:
            op("all-to-all", parts * x.whole_bags, 4)
        op("all-to-all", parts * x.whole_bags * d, itemsize)
    if x.split:
        if mean:
            op("all-to-all", parts * x.split_bags, 4)
        op("all-to-all", parts * x.split_bags, 4)
    branches = [(x.split_sizes[1], x.rows_sizes[1], False, x.bucketed)]
    if x.bucketed:
        branches.append((x.split_sizes[0], x.rows_sizes[0], True, False))
    for split_size, rows_size, fallback, bucketed in branches:  # the forward's buckets
        if x.split:
            op("all-to-all", parts * split_size, 4, fallback, bucketed)
            op("all-to-all", parts * x.split_bags * d, itemsize, fallback, bucketed)
        if x.rows.any():
            op("all-to-all", parts * rows_size, 4, fallback, bucketed)
            op("all-to-all", parts * rows_size * d, itemsize, fallback, bucketed)
    if x.whole:
        op("all-to-all", parts * x.whole_bags * d, itemsize)
    if x.split:
        op("all-to-all", parts * x.split_bags * d, itemsize)
    sources = parts * ((x.whole_bags if x.whole else 0) + (x.split_bags if x.split else 0))
    if replicas > 1 and sources:  # the bags' gradients (and scales) of every copy of the block
        op("all-gather", replicas * sources * d, itemsize)
        if mean:
            op("all-gather", replicas * sources, 4)
    for split_size, rows_size, fallback, bucketed in branches:  # the update's buckets
        if x.rows.any():
            op("all-to-all", parts * rows_size * d, itemsize, fallback, bucketed)
        if replicas > 1:
            direct = parts * rows_size if x.rows.any() else 0
            bagged = parts * ((x.whole_slots if x.whole else 0) + (split_size if x.split else 0))
            if bagged:
                op("all-gather", replicas * bagged, 4, fallback, bucketed)  # sources
            if direct:
                op("all-gather", replicas * direct, 4, fallback, bucketed)
                op("all-gather", replicas * direct * d, itemsize, fallback, bucketed)
            if bagged:
                op("all-gather", replicas * bagged, 4, fallback, bucketed)  # ids
    return out


def array_layout(arrays: Mapping[str, MeshArray], by_group: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Host arrays in the single-device layout {group: [rows, ...]} -> the mesh arrays' global values, as numpy
    (rows no table uses are zero)."""
    out = {}
    for name, s in arrays.items():
        data = np.asarray(by_group[s.group])[np.maximum(s.source, 0)]
        data[s.source < 0] = 0
        out[name] = data
    return out


def group_layout(arrays: Mapping[str, MeshArray], by_array: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of `array_layout`: the mesh arrays' global host values -> {group: [rows, ...]}."""
    out: dict[str, np.ndarray] = {}
    for name, s in arrays.items():
        data = np.asarray(by_array[name])
        if s.group not in out:
            out[s.group] = np.zeros((s.group_rows, *data.shape[1:]), data.dtype)
        valid = s.source >= 0
        out[s.group][s.source[valid]] = data[valid]
    return out
