"""Sharded lookups and sparse updates: the plan's per-device arrays and the collectives between them.

Every physical table of a stacked group (`recjax/embedding.py`) lands, by its plan entry, in one of the group's
*mesh arrays* (`MeshArray`) -- named "<group>/<kind>":

    <group>/sharded     f32[n * L, d], P(("data", "model"))   table-wise and row-wise-over-all tables; device k
                        holds rows [k L, (k+1) L): its parts of those tables, back to back
    <group>/model       f32[n_model * L, d], P("model")        row-wise over the model axis, a copy per data row
    <group>/replicated  f32[L, d], P()                          replicated / data-parallel tables
    <group>/column      f32[L, d], P(None, ("data", "model"))   column-wise tables: device k holds columns k d/n..

Optimizer state rows follow their table rows (same leading dim and sharding). Inside `jax.shard_map`, each device
holds its local block; a step (per device, on its slice of the batch):

  forward (`fetch`): `collection.route` gives the local distinct stacked rows u i32[N] of a group. For a
    sharded/model array each member row maps to (owner, local row) by static integer math on its table's split;
    ids are bucketed by owner into i32[parts, C1] (C1 = `capacity_factor` x E + `capacity_sigmas` x sqrt(E), E the
    ids a device is expected to send an owner; padding = the local sentinel L), all_to_all'd to the owners, who
    gather f32[parts, C1, d] (cast to `exchange_dtype`) and all_to_all them back; each distinct row is read from its
    bucket slot. If any device has more than C1 ids for an owner (a psum'ed flag), every device takes the
    worst-case branch of a `lax.cond` instead: C = the most an owner can receive from one device (per table it
    holds, the fewer of the local slots and its rows there), so no id is ever dropped. ragged_all_to_all would
    need no C1, but XLA:CPU cannot run it. Column arrays all_gather the ids, every device gathers its column
    slice of all of them and one all_to_all returns each requester its rows' slices (concatenated on the dim).
    Replicated arrays read locally.
  backward (`update`): d loss / d rows (f32[N, d], cast to `exchange_dtype`) goes back through the same buckets
    (the reverse all_to_all; for column arrays split by columns); the owner all_gathers what it received over
    the axes its array is replicated along (so every copy applies the same update), deduplicates the received
    local rows (`unique_rows`), sums their gradients in f32, and `sparse_apply`s them in place (donated). Replicated
    arrays all_gather the touched rows' ids and gradients from every device. No collective carries a table: each
    moves ids, rows or gradients of a batch.

Limits of this version (what it costs: benchmarks/RESULTS.md#sharding-the-exchange-per-plan):
  - Buckets are static. The owner's dedup + `sparse_apply` run over the worst case's received ids even when the
    small buckets sufficed (a cond around them would take the table as an operand, and XLA:CPU copies it).
  - Expected counts assume ids spread evenly over a table's rows: a frequency-sorted vocabulary split by `range`
    sends the hot head to one owner, so steps may overflow every time; use `sharding.row_split=mod` there.
  - A table read more than once per id (FIITED reads its pool once per chunk) fills `slots_per_example` slots per
    example, and capacities count those, not the bag size.
  - A mesh array is one [n L, d] array, so a table-wise plan whose devices hold different row counts pads the others
    to the fullest; the `auto` planner evens blocks (`plan.balance_blocks`), a ragged layout would remove it.
  - `exchange_dtype` bf16 / f16 halves the bytes on GPU / TPU; XLA:CPU widens such collectives back to f32, so on
    CPU it only rounds. Accumulation (the owner's sum, the optimizer) stays f32.
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

from pallas_kernels import unique_rows
from recjax.embedding import EmbeddingCollection
from recjax.sharding.hlo import FALLBACK_SCOPE
from recjax.sharding.placement import ALL_AXES, put_global, to_host
from recjax.sharding.plan import ShardingPlan, part_rows
from recjax.sparse_optim import SparseOptimizer, sparse_apply

KINDS = ("sharded", "model", "replicated", "column")
_KIND_OF = {"table": "sharded", "row": "sharded", "column": "column", "replicated": "replicated",
            "data_parallel": "replicated"}


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
        """C: the most distinct rows one device can ask one owner for in a step: per table the fewer of its slots
        (local_batch x bag size) and the rows the owner holds of it, summed over the owner's tables."""
        per_owner = np.minimum(self.part_rows, local_batch * self.table_bags[None, :]).sum(axis=1)
        return max(1, int(per_owner.max()))

    def expected_capacity(self, local_batch: int, factor: float, sigmas: float = 0.0) -> int:
        """C1 <= C: `factor` x E + `sigmas` x sqrt(E), E = the most distinct rows one device is expected to ask one
        owner for, ids spread evenly over each table's rows (per table its slots x the owner's fraction of the
        table, at most the rows it holds); a count of ids falling on an owner has a standard deviation of about
        sqrt(E), so the margin is in standard deviations (relatively small for large buckets). Buckets of C1 carry a
        step unless some device has more for some owner; then every device takes the worst case C instead
        (`fetch`), so no id is ever dropped."""
        rows = np.maximum(self.part_rows.sum(axis=0), 1)
        slots = local_batch * self.table_bags[None, :]
        expected = float(np.minimum(self.part_rows, slots * self.part_rows / rows[None, :]).sum(axis=1).max())
        return max(1, min(self.capacity(local_batch), math.ceil(factor * expected + sigmas * math.sqrt(expected))))

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
    mesh_shape = plan.mesh_shape
    n = plan.devices
    arrays = {}
    for group in sorted(collection.group_rows):
        tables = [p for p in collection.physical_tables() if p.group == group]
        offsets = np.array([p.offset for p in tables], np.int32)
        kinds = {}
        for i, p in enumerate(tables):
            if p.table.name in skip:
                continue
            entry = plan.placement(p.table.name)
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
            table_bags = np.array([collection.slots_per_example(p) for p in tables], np.int64)
            pieces: list[list[np.ndarray]] = [[] for _ in used]
            for i, entry in members:
                p = tables[i]
                rows = p.table.rows
                member[i] = True
                if kind in ("sharded", "model"):
                    k = len(entry.devices)
                    split[i], chunk[i] = k, -(-rows // k)
                    modulo[i] = entry.row_split == "mod"
                    for j, dev in enumerate(entry.devices):
                        device[i, j], base[i, j] = dev, used[dev]
                        count = part_rows(rows, k, j, entry.row_split)
                        local = np.arange(count) * k + j if modulo[i] else j * chunk[i] + np.arange(count)
                        pieces[dev].append(p.offset + local)
                        used[dev] += count
                        part_rows_[dev, i] = count
                else:
                    split[i], chunk[i] = 1, max(rows, 1)
                    base[i, 0] = used[0]
                    pieces[0].append(p.offset + np.arange(rows))
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
                parts=parts, local_rows=local_rows, dim=collection.group_dims[group],
                group_rows=collection.group_rows[group], offsets=offsets, member=member, split=split, chunk=chunk,
                modulo=modulo, device=device, base=base, part_rows=part_rows_, table_bags=table_bags,
                source=source.reshape(-1))
    return arrays


def _fallback(branch):
    """The worst-case exchange, under a named scope so the HLO tells its collectives apart."""
    def run(*operands):
        with jax.named_scope(FALLBACK_SCOPE):
            return branch(*operands)
    return run


def _bucketed(exchange, args: tuple, overflow, capacity: int, small: int):
    """`exchange(*args, size)` in buckets of `small` ids, or of the worst case `capacity` when any device overflowed
    (`overflow` None: there is only the worst case)."""
    if overflow is None:
        return exchange(*args, capacity)
    return jax.lax.cond(overflow, _fallback(functools.partial(exchange, *args, capacity)),
                        functools.partial(exchange, *args, small))


def _rows_exchange(read, s: MeshArray, owner, local, dest, pos, capacity: int, dtype, size: int):
    """Ids to their owners in buckets i32[parts, size], rows back (`read`: local ids -> rows of the owner's block):
    (rows f32[N, d], the received ids padded to i32[parts, capacity] with the sentinel)."""
    d = s.dim
    send = jnp.full((s.parts, size), s.local_rows, jnp.int32).at[dest, pos].set(local, mode="drop")
    recv = jax.lax.all_to_all(send, s.axes, 0, 0)  # recv[j]: the rows device j asks me for
    vals = read(recv.reshape(-1))
    back = jax.lax.all_to_all(vals.astype(dtype).reshape(s.parts, size, d), s.axes, 0, 0)  # back[j]: from owner j
    recv = jnp.pad(recv, ((0, 0), (0, capacity - size)), constant_values=s.local_rows)
    return back[owner, jnp.minimum(pos, size - 1)], recv


def _grads_exchange(g, s: MeshArray, dest, pos, recv, size: int):
    """Row gradients g [N, d] back through buckets of `size` to their owners (and every copy of the owner's block):
    (local ids, gradients) aligned, padded to the worst case's static length with the sentinel."""
    capacity, d = recv.shape[1], g.shape[1]
    send = jnp.zeros((s.parts, size, d), g.dtype).at[dest, pos].set(g, mode="drop")
    grads = jax.lax.all_to_all(send, s.axes, 0, 0).reshape(-1, d)  # aligned with recv[:, :size]
    ids = recv[:, :size].reshape(-1)
    if s.replica_axes:  # every copy of this block applies every copy's gradients
        ids = jax.lax.all_gather(ids, s.replica_axes, tiled=True)
        grads = jax.lax.all_gather(grads, s.replica_axes, tiled=True)
    pad = ids.shape[0] * (capacity - size) // size
    return jnp.pad(ids, (0, pad), constant_values=s.local_rows), jnp.pad(grads, ((0, pad), (0, 0)))


def _compact_slots(member: jax.Array, size: int) -> jax.Array:
    """Where each member entry goes in a packed buffer of `size` (its rank among members); `size` (dropped) for the
    others."""
    return jnp.where(member, jnp.cumsum(member, dtype=jnp.int32) - 1, size)


def _bucket_positions(owner: jax.Array, member: jax.Array, parts: int) -> jax.Array:
    """Each id's slot in its owner's bucket: i32[N], the rank of the id among the ids for the same owner."""
    n = owner.shape[0]
    key = jnp.where(member, owner, parts)
    order = jnp.argsort(key, stable=True)
    counts = jnp.zeros(parts + 1, jnp.int32).at[key].add(1)
    starts = jnp.cumsum(counts) - counts
    ranked = jnp.arange(n, dtype=jnp.int32) - starts[key[order]]
    return jnp.zeros(n, jnp.int32).at[order].set(ranked, unique_indices=True)


class Exchange:
    """The collection's tables laid out by a plan on a mesh: device-side `fetch` / `update` (call them inside
    `jax.shard_map` over every mesh axis) and host-side `shard` / `unshard` of the single-device layout. The mesh
    layout (recjax/sharding/layout.py) puts it behind the step's interface.

    `arrays` (default: the plan's) lets a storage add arrays the plan does not know (a disk tier's caches);
    `storage_of` {group: storage} says how the owner reads and updates each group's block (recjax/placement/
    storage.py: in place for device memory, rows brought from host memory, ...); default: device memory."""

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
    def fetch(self, tables: Mapping[str, jax.Array], unique: Mapping[str, jax.Array], local_batch: int
              ) -> tuple[dict[str, jax.Array], dict]:
        """Each local distinct row's value, wherever it lives: {group: f32[N_g, d]} and the buckets `update`
        sends the gradients back through."""
        rows, context = {}, {}
        for group, u in unique.items():
            n, d = u.shape[0], self.collection.group_dims[group]
            out = jnp.zeros((n, d), jnp.float32)
            for s in (s for s in self.arrays.values() if s.group == group):
                member, owner, local = s.locate(u)
                read = self._read(s, tables[s.name])
                if s.kind == "replicated":
                    got = read(local)
                    size = s.compact_size(local_batch, n)
                    context[s.name] = (member, local, _compact_slots(member, size), size)
                elif s.kind == "column":
                    size = s.compact_size(local_batch, n)
                    slot = _compact_slots(member, size)  # this array's rows, packed into i32[S]
                    packed = jnp.full(size, s.local_rows, jnp.int32).at[slot].set(local, mode="drop")
                    ids = jax.lax.all_gather(packed, s.axes, tiled=True)  # i32[parts * S]
                    vals = read(ids)  # [parts * S, d / parts]
                    vals = vals.astype(self.exchange_dtype).reshape(s.parts, size, d // s.parts)
                    back = jax.lax.all_to_all(vals, s.axes, 0, 2, tiled=True).reshape(size, d)
                    got = back[jnp.minimum(slot, size - 1)]
                    context[s.name] = (member, ids, slot, size)
                else:
                    capacity, small = self.capacities(s, local_batch)
                    pos = _bucket_positions(owner, member, s.parts)
                    dest = jnp.where(member, owner, s.parts)  # non-members fall off the buffer

                    overflow = self._overflow(member, pos, small, capacity)
                    got, recv = _bucketed(_rows_exchange, (read, s, owner, local, dest, pos, capacity,
                                                           self.exchange_dtype), overflow, capacity, small)
                    context[s.name] = (member, dest, pos, recv, overflow, small)
                out = out + jnp.where(member[:, None], got.astype(jnp.float32), 0.0)
            rows[group] = out
        return rows, context

    def update(self, optimizer: SparseOptimizer, tables: Mapping[str, jax.Array], state: Mapping[str, dict],
               context: Mapping, row_grads: Mapping[str, jax.Array], lr: jax.Array, step: jax.Array
               ) -> tuple[dict, dict, dict]:
        """Send each distinct row's gradient to its owner(s) and apply the optimizer there, in place. Also returns
        {array: i32[M]} the local rows each device updated (padded with the sentinel `local_rows`), for the
        checkpoints' dirty-row bitmaps."""
        new_tables, new_state, touched = dict(tables), dict(state), {}
        for s in self.arrays.values():
            g = row_grads[s.group]
            n, d = g.shape
            member = context[s.name][0]
            g = jnp.where(member[:, None], g, 0.0).astype(self.exchange_dtype)
            if s.kind == "replicated":
                _, local, slot, size = context[s.name]
                packed = jnp.full(size, s.local_rows, jnp.int32).at[slot].set(local, mode="drop")
                ids = jax.lax.all_gather(packed, ALL_AXES, tiled=True)  # i32[n * S]
                grads = jax.lax.all_gather(jnp.zeros((size, d), g.dtype).at[slot].set(g, mode="drop"), ALL_AXES,
                                           tiled=True)
            elif s.kind == "column":
                _, ids, slot, size = context[s.name]
                packed = jnp.zeros((1, size, d), g.dtype).at[0, slot].set(g, mode="drop")
                grads = jax.lax.all_to_all(packed, s.axes, 2, 0, tiled=True)  # [parts, S, d / parts]
                grads = grads.reshape(s.parts * size, d // s.parts)
            else:
                _, dest, pos, recv, overflow, small = context[s.name]
                capacity = recv.shape[1]
                ids, grads = _bucketed(_grads_exchange, (g, s, dest, pos, recv), overflow, capacity, small)
            # The owner's dedup and update run on the worst case's length either way: a cond around them would take
            # the table as an operand, and XLA:CPU then copies it (measured: temp bytes grow with the table).
            table = tables[s.name]
            distinct, inverse = unique_rows(ids, s.local_rows)
            summed = jnp.zeros((ids.shape[0], table.shape[1]), jnp.float32).at[inverse].add(
                grads.astype(jnp.float32))
            current = self._read(s, table)(distinct)
            new_tables[s.name], new_state[s.name] = self._apply(
                s, self.collection.group_optimizer(optimizer, s.group), table, state[s.name], distinct, current,
                summed, lr, step)
            touched[s.name] = distinct
        return new_tables, new_state, touched

    @staticmethod
    def overflows(context: Mapping) -> jax.Array:
        """i32[]: how many arrays took the worst-case buckets this step (the same on every device)."""
        flags = [c[4] for name, c in context.items() if len(c) == 6 and c[4] is not None]
        return sum((f.astype(jnp.int32) for f in flags), jnp.zeros((), jnp.int32))

    def capacities(self, s: MeshArray, local_batch: int) -> tuple[int, int]:
        """(C, C1): the worst-case bucket size and the expected one (`sharding.capacity_factor` and
        `capacity_sigmas`; C1 = C when the factor is 0)."""
        capacity = s.capacity(local_batch)
        if not self.capacity_factor:
            return capacity, capacity
        return capacity, s.expected_capacity(local_batch, self.capacity_factor, self.capacity_sigmas)

    def _overflow(self, member: jax.Array, pos: jax.Array, small: int, capacity: int) -> jax.Array | None:
        """bool[]: does any device have more than `small` rows for one owner this step (psum'ed, so every device
        takes the same branch); None when the buckets are the worst case anyway."""
        if small >= capacity:
            return None
        mine = jnp.any(member & (pos >= small)).astype(jnp.int32)
        return jax.lax.psum(mine, ALL_AXES) > 0

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
