"""The chunk pool behind FIITED (per-row dynamic dimensions whose pruning really frees memory).

Each logical row of a V x D table is K chunks of D / K columns. Chunks live in a physical pool f32[capacity, D/K];
an indirection i32[V, K] maps (row, chunk) to its pool slot, or -1 when the chunk is pruned (it reads zeros) --
the virtually-hashed physical index (VHPI) idea of FIITED. Rows keep a *prefix* of their chunks: chunk k is live
only if chunks 0..k-1 are, so a row of c live chunks is its first c * D/K dimensions and pruning removes trailing
chunks. Free slots sit on a stack: `free[:num_free]` are exactly the unreferenced slots, so pruning pushes slots and
growing pops them in O(rows touched). `compact` re-allocates a pool of another capacity (at least the live chunks),
moves the live chunks to slots 0..live-1 in (row, chunk) order and remaps the indirection, which is what really
returns memory once pruning has emptied part of the pool.

Every operation is a pure function from a `ChunkPool` to a new one. Per-slot optimizer state (`state`: arrays whose
leading axis is the slot, e.g. Adagrad's accumulator f32[capacity, D/K] or a row-wise f32[capacity]) follows the
slots: it moves with them in `compact` and is zeroed for freed and for newly allocated slots, so a recycled slot
starts clean. `prune` and `grow` keep the shapes, so they run under jit; `compact` changes the capacity and needs
the live count on the host (it checks the new capacity holds every live chunk).

Invariants (tests/test_chunk_pool.py checks them after random operation sequences):
  - every live slot is referenced by exactly one (row, chunk);
  - `free[:num_free]` holds each unreferenced slot exactly once, `free[num_free:]` is -1;
  - prefix: index[r, k] >= 0 implies index[r, k - 1] >= 0;
  - a free slot's pool row and state are zero; values of live chunks survive every operation.
"""

from collections.abc import Mapping

import flax
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class ChunkPool:
    """pool f32[capacity, C]; index i32[V, K] (slot or -1); free i32[capacity] stack; num_free i32[];
    state {name: f32[capacity, ...]} per-slot optimizer state."""

    pool: jax.Array
    index: jax.Array
    free: jax.Array
    num_free: jax.Array
    state: Mapping[str, jax.Array]

    @property
    def capacity(self) -> int:
        return self.pool.shape[0]

    @property
    def chunks(self) -> int:
        return self.index.shape[1]


def create(values: jax.Array, chunks: int, capacity: int | None = None, live_chunks: jax.Array | int | None = None,
           state: Mapping[str, tuple[int, ...]] | None = None) -> ChunkPool:
    """A pool holding the first `live_chunks[r]` chunks (default all K) of each row of `values` f32[V, D].

    Slots are assigned in (row, chunk) order; `capacity` defaults to the live chunks; `state` maps a state name to
    its per-slot trailing shape (zeros).
    """
    values = jnp.asarray(values, jnp.float32)
    v, d = values.shape
    if chunks < 1 or d % chunks:
        raise ValueError(f"chunk pool: dim {d} is not divisible into {chunks} chunks")
    counts = np.broadcast_to(np.asarray(chunks if live_chunks is None else live_chunks), (v,))
    if np.any(counts < 0) or np.any(counts > chunks):
        raise ValueError(f"chunk pool: live chunks per row must be in [0, {chunks}]")
    live = np.arange(chunks)[None, :] < counts[:, None]  # [V, K] prefixes
    total = int(live.sum())
    capacity = total if capacity is None else capacity
    if capacity < total:
        raise ValueError(f"chunk pool: capacity {capacity} < {total} live chunks")
    index = np.full((v, chunks), -1, np.int32)
    index[live] = np.arange(total, dtype=np.int32)
    pool = jnp.zeros((capacity, d // chunks), jnp.float32).at[jnp.asarray(index[live])].set(
        values.reshape(v, chunks, d // chunks)[jnp.asarray(live)])
    free = np.full(capacity, -1, np.int32)
    free[: capacity - total] = np.arange(capacity - 1, total - 1, -1)  # lowest free slot on top of the stack
    return ChunkPool(pool=pool, index=jnp.asarray(index), free=jnp.asarray(free),
                     num_free=jnp.asarray(capacity - total, jnp.int32),
                     state={k: jnp.zeros((capacity, *shape), jnp.float32) for k, shape in (state or {}).items()})


def read(p: ChunkPool, ids: jax.Array) -> jax.Array:
    """Rows f32[..., K * C] of `ids` i32[...]; pruned chunks read zeros."""
    slots = p.index[ids]  # [..., K]
    slots = jnp.where(slots >= 0, slots, p.capacity)  # pruned -> out of range -> the fill value
    rows = jnp.take(p.pool, slots, axis=0, mode="fill", fill_value=0)
    return rows.reshape(*ids.shape, -1)


def live_chunks(p: ChunkPool) -> jax.Array:
    """i32[V]: each row's live chunk count (its prefix length)."""
    return jnp.sum(p.index >= 0, axis=1, dtype=jnp.int32)


def _clear_slots(p: ChunkPool, slots: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Zero the pool rows and state of `slots` (out-of-range entries are skipped)."""
    pool = p.pool.at[slots].set(0.0, mode="drop")
    state = {k: s.at[slots].set(0.0, mode="drop") for k, s in p.state.items()}
    return pool, state


def prune(p: ChunkPool, rows: jax.Array, keep: jax.Array) -> ChunkPool:
    """Keep only the first `keep[i]` chunks of row `rows[i]` (distinct rows): their trailing chunks become -1 and
    their slots, zeroed with their state, go onto the free stack. Rows already at or under `keep` are unchanged."""
    k = p.chunks
    slots = p.index[rows]  # [R, K]
    drop = (jnp.arange(k)[None, :] >= keep[:, None]) & (slots >= 0)
    flat_drop, flat_slots = drop.reshape(-1), slots.reshape(-1)
    position = p.num_free + jnp.cumsum(flat_drop, dtype=jnp.int32) - 1  # where each freed slot lands on the stack
    free = p.free.at[jnp.where(flat_drop, position, p.capacity)].set(flat_slots, mode="drop")
    pool, state = _clear_slots(p, jnp.where(flat_drop, flat_slots, p.capacity))
    index = p.index.at[rows].set(jnp.where(drop, -1, slots))
    return ChunkPool(pool=pool, index=index, free=free, num_free=p.num_free + jnp.sum(flat_drop, dtype=jnp.int32),
                     state=state)


def grow(p: ChunkPool, rows: jax.Array, want: jax.Array, values: jax.Array | None = None) -> ChunkPool:
    """Extend row `rows[i]` (distinct rows) to its first `want[i]` chunks, popping slots off the free stack.

    Requests are served in (row, chunk) order while slots last, so a row short of slots still keeps a prefix.
    New chunks take `values` f32[R, K, C] at their (row, chunk) (default zeros); their state starts at zero.
    """
    k = p.chunks
    slots = p.index[rows]  # [R, K]
    need = (jnp.arange(k)[None, :] < jnp.minimum(want, k)[:, None]) & (slots < 0)
    flat_need = need.reshape(-1)
    order = jnp.cumsum(flat_need, dtype=jnp.int32) - 1  # request number, in (row, chunk) order
    granted = flat_need & (order < p.num_free)
    stack_top = p.num_free - 1 - order
    new_slots = jnp.where(granted, p.free[jnp.clip(stack_top, 0, p.capacity - 1)], -1)
    n_granted = jnp.sum(granted, dtype=jnp.int32)
    free = p.free.at[jnp.where(granted, stack_top, p.capacity)].set(-1, mode="drop")
    index = p.index.at[rows].set(jnp.where(granted.reshape(need.shape), new_slots.reshape(need.shape), slots))
    target = jnp.where(granted, new_slots, p.capacity)
    pool, state = _clear_slots(p, target)
    if values is not None:
        pool = pool.at[target].set(values.reshape(-1, pool.shape[1]), mode="drop")
    return ChunkPool(pool=pool, index=index, free=free, num_free=p.num_free - n_granted, state=state)


def compact(p: ChunkPool, capacity: int) -> ChunkPool:
    """A pool of `capacity` slots (>= the live chunks) with the live chunks at slots 0..live-1 in (row, chunk)
    order, their values and state moved along, the indirection remapped and the rest of the slots free. Runs on
    the host, in numpy (the capacity is a shape, and compaction is rare): the result holds numpy arrays."""
    index = np.asarray(p.index)
    live = index >= 0
    total = int(live.sum())
    if capacity < total:
        raise ValueError(f"chunk pool: cannot compact {total} live chunks into capacity {capacity}")
    old_slots = index[live]
    new_index = np.full(index.shape, -1, np.int32)
    new_index[live] = np.arange(total, dtype=np.int32)

    def moved(a) -> np.ndarray:
        a = np.asarray(a)
        out = np.zeros((capacity, *a.shape[1:]), a.dtype)
        out[:total] = a[old_slots]
        return out

    free = np.full(capacity, -1, np.int32)
    free[: capacity - total] = np.arange(capacity - 1, total - 1, -1)
    return ChunkPool(pool=moved(p.pool), index=new_index, free=free, num_free=np.asarray(capacity - total, np.int32),
                     state={k: moved(s) for k, s in p.state.items()})


def allocated_bytes(p: ChunkPool) -> int:
    """Device bytes the pool really holds: the chunk pool, the indirection, the free stack and the state."""
    leaves = [p.pool, p.index, p.free, *p.state.values()]
    return int(sum(a.size * a.dtype.itemsize for a in leaves))
