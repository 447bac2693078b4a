"""The chunk pool behind FIITED (per-row dynamic dimensions whose pruning really frees memory).

Each logical row of a V x D table is K chunks of C = D / K columns. Chunks live in a physical pool f32[capacity, C];
rows keep a *prefix* of their chunks (chunk k is live only if chunks 0..k-1 are), so a row of c live chunks is its
first c C dimensions and pruning removes trailing chunks. The pool is *packed*: row r's live chunks sit at the
consecutive slots offsets[r] .. offsets[r + 1] - 1, in row order, and the indirection is just the offsets i32[V + 1]
(a row's live count is offsets[r + 1] - offsets[r]; offsets[V] is the live total, slots from there on are free).

Why not FIITED's per-chunk indirection (an i32[V, K] slot per (row, chunk), or -1, with a free-slot stack): it costs
4 K bytes per row whatever the budget, i.e. K / D of the full table -- 1/4 at D = 16, K = 4, and *more than the
table* at K = D, the 1-column chunks that came closest to the full model on ML-100K at a 10 % budget
(benchmarks/RESULTS.md#compression-fiited). The offsets cost 4 bytes per row for any K, and a free
stack (4 bytes per slot: as much again as 1-column chunks) is not needed, because a packed pool has no holes.

FIITED keeps the offsets packed (`pack_offsets`: each row's live count in ceil(log2(K + 1)) bits, packed into u32
words, and an i32 base -- the offset of a block's first row -- per block of about 64 rows; a row's offset is its
base plus the counts of the block's earlier rows), 0.73 bytes per row at K = 16 -- 1.1 % of a 16-dim f32 row. It
matters at the budgets FIITED is for: at 20x on ML-100K the earlier byte-per-row packing (1.25 bytes per row) took
57 % of the compressed tables' bytes (benchmarks/RESULTS.md, "FIITED against hashing on MovieLens").

The price is that changing a row's chunk count moves every later row, so chunks are re-assigned for all rows at
once: `resize` lays the whole pool out again from the new per-row counts -- one gather of the pool and its state,
O(capacity + V), the same order as the adjustment's sort of the V K chunk scores that decides the counts (FIITED
re-decides every row at an adjustment anyway). Between adjustments nothing moves, and reads are a gather of two
offsets per id instead of K slots.

Every operation is a pure function from a `ChunkPool` to a new one. Per-slot optimizer state (`state`: arrays whose
leading axis is the slot, e.g. Adagrad's accumulator f32[capacity, C] or a row-wise f32[capacity]) moves with its
chunk; a new chunk's state and every free slot are zero. `resize` keeps the shapes, so it runs under jit; `compact`
changes the capacity (the live chunks already sit at 0..live-1: it truncates or extends the arrays) and runs on the
host.

Invariants (tests/test_chunk_pool.py checks them after random operation sequences):
  - offsets[0] = 0, 0 <= offsets[r + 1] - offsets[r] <= K, offsets[V] <= capacity;
  - a free slot's (>= offsets[V]) pool row and state are zero; values and state of kept chunks survive every
    operation.
"""

import functools
from collections.abc import Mapping

import flax
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class ChunkPool:
    """pool f32[capacity, C]; offsets i32[V + 1] (row r's chunks at slots offsets[r]..offsets[r+1]-1);
    state {name: f32[capacity, ...]} per-slot optimizer state; `chunks` K (static)."""

    pool: jax.Array
    offsets: jax.Array
    state: Mapping[str, jax.Array]
    chunks: int = flax.struct.field(pytree_node=False, default=1)

    @property
    def capacity(self) -> int:
        return self.pool.shape[0]

    @property
    def rows(self) -> int:
        return self.offsets.shape[0] - 1


def offsets_of(counts) -> np.ndarray:
    """i32[V + 1]: the packed offsets of per-row live chunk counts (host)."""
    return np.concatenate([[0], np.cumsum(np.asarray(counts, np.int64))]).astype(np.int32)


def count_bits(chunks: int) -> int:
    """Bits of one row's live chunk count (0..K): 5 at K = 16, 3 at K = 4, 1 at K = 1."""
    return int(chunks).bit_length()


def counts_per_word(chunks: int) -> int:
    """Row counts packed into one u32 word of `pack_offsets` (6 at K = 16, 10 at K = 4)."""
    return 32 // count_bits(chunks)


def block_rows(chunks: int) -> int:
    """Rows per i32 base of `pack_offsets`: whole words, about 64 rows (60 at K = 16), so a base costs under 0.07
    bytes per row and finding a row's offset sums at most that many counts."""
    per = counts_per_word(chunks)
    return per * max(1, 64 // per)


def packed_bytes(rows: int, chunks: int) -> int:
    """Bytes of `pack_offsets`' arrays for `rows` rows: the i32 bases and the u32 count words."""
    return 4 * (rows // block_rows(chunks) + 1) + 4 * -(-rows // counts_per_word(chunks))


# jitted: FIITED packs on the host side (its initial offsets, every adjustment's), where op by op it compiled ~8
# primitives per table shape.
@functools.partial(jax.jit, static_argnums=(1,))
def pack_offsets(offsets: jax.Array, chunks: int) -> tuple[jax.Array, jax.Array]:
    """Offsets i32[V + 1] -> (base i32[V // B + 1]: offsets[b B], the offset of each block's first row; counts
    u32[ceil(V / W)]: each row's live chunk count in count_bits(K) bits, W = counts_per_word(K) rows per word),
    B = block_rows(K). About count_bits(K) / 8 + 4 / B bytes per row (0.73 at K = 16) instead of 4."""
    bits, per = count_bits(chunks), counts_per_word(chunks)
    counts = (offsets[1:] - offsets[:-1]).astype(jnp.uint32)
    v = counts.shape[0]
    words = jnp.zeros(-(-v // per) * per, jnp.uint32).at[:v].set(counts).reshape(-1, per)
    # The fields do not overlap, so the sum of the shifted counts is their bitwise or.
    words = jnp.sum(words << (jnp.arange(per, dtype=jnp.uint32) * bits), axis=1, dtype=jnp.uint32)
    return offsets[::block_rows(chunks)], words


def unpack_counts(counts: jax.Array, chunks: int, rows: jax.Array) -> jax.Array:
    """i32[...]: the live chunk counts of `rows` (i32[...]) from `pack_offsets`' count words; 0 past the last row."""
    bits, per = count_bits(chunks), counts_per_word(chunks)
    word = counts.at[rows // per].get(mode="fill", fill_value=0)
    shift = ((rows % per) * bits).astype(jnp.uint32)
    return ((word >> shift) & jnp.uint32((1 << bits) - 1)).astype(jnp.int32)


# jitted: the whole-table unpack runs eagerly on the host side of every adjustment (recjax/dynamic.py's memory record
# and compaction), where op by op it compiled ~10 primitives per table shape (benchmarks/RESULTS.md, the suite's
# wall time, session 16).
@functools.partial(jax.jit, static_argnums=(1, 2))
def _every_offset(counts: jax.Array, chunks: int, vocab: int) -> jax.Array:
    every = unpack_counts(counts, chunks, jnp.arange(vocab, dtype=jnp.int32))
    return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(every, dtype=jnp.int32)])


def unpack_offsets(base: jax.Array, counts: jax.Array, chunks: int, vocab: int,
                   rows: jax.Array | None = None) -> jax.Array:
    """The offsets i32 of `rows` (i32[...] in [0, V]; default all V + 1) from `pack_offsets`' (base, counts) of a
    V-row table: the row's block base plus the counts of the block's earlier rows -- fewer than B of them, so a
    lookup costs O(B) per id, never O(V)."""
    if rows is None:
        return _every_offset(counts, chunks, vocab)
    b = block_rows(chunks)
    block = rows // b
    earlier = block[..., None] * b + jnp.arange(b, dtype=jnp.int32)
    within = jnp.where(earlier < rows[..., None], unpack_counts(counts, chunks, earlier), 0)
    return base[block] + jnp.sum(within, axis=-1, dtype=jnp.int32)


def create(values: jax.Array, chunks: int, capacity: int | None = None, live_chunks: jax.Array | int | None = None,
           state: Mapping[str, tuple[int, ...]] | None = None) -> ChunkPool:
    """A pool holding the first `live_chunks[r]` chunks (default all K) of each row of `values` f32[V, D].

    `capacity` defaults to the live chunks; `state` maps a state name to its per-slot trailing shape (zeros).
    """
    values = np.asarray(values, np.float32)
    v, d = values.shape
    if chunks < 1 or d % chunks:
        raise ValueError(f"chunk pool: dim {d} is not divisible into {chunks} chunks")
    counts = np.broadcast_to(np.asarray(chunks if live_chunks is None else live_chunks), (v,))
    if np.any(counts < 0) or np.any(counts > chunks):
        raise ValueError(f"chunk pool: live chunks per row must be in [0, {chunks}]")
    live = np.arange(chunks)[None, :] < counts[:, None]  # [V, K] prefixes, row-major = slot order
    total = int(live.sum())
    capacity = total if capacity is None else capacity
    if capacity < total:
        raise ValueError(f"chunk pool: capacity {capacity} < {total} live chunks")
    pool = np.zeros((capacity, d // chunks), np.float32)
    pool[:total] = values.reshape(v, chunks, d // chunks)[live]
    return ChunkPool(pool=jnp.asarray(pool), offsets=jnp.asarray(offsets_of(counts)), chunks=chunks,
                     state={k: jnp.zeros((capacity, *shape), jnp.float32) for k, shape in (state or {}).items()})


def slots(start: jax.Array, end: jax.Array, chunks: int) -> jax.Array:
    """i32[..., K]: the pool slot of each chunk of rows whose offsets are `start` and `end` (i32[...]: offsets[r],
    offsets[r + 1]), -1 where the chunk is pruned."""
    k = jnp.arange(chunks, dtype=jnp.int32)
    return jnp.where(k < (end - start)[..., None], start[..., None] + k, -1)


def read(p: ChunkPool, ids: jax.Array) -> jax.Array:
    """Rows f32[..., K * C] of `ids` i32[...]; pruned chunks read zeros."""
    s = slots(p.offsets[ids], p.offsets[ids + 1], p.chunks)
    rows = jnp.take(p.pool, jnp.where(s >= 0, s, p.capacity), axis=0, mode="fill", fill_value=0)
    return rows.reshape(*ids.shape, -1)


def live_chunks(offsets: jax.Array) -> jax.Array:
    """i32[V]: each row's live chunk count (its prefix length)."""
    return offsets[1:] - offsets[:-1]


def resize(p: ChunkPool, counts: jax.Array, fill: jax.Array | None = None) -> tuple[ChunkPool, jax.Array]:
    """Give row r its first `counts[r]` chunks (i32[V], clipped to [0, K]) and lay the pool out again.

    A kept chunk keeps its values and state (at its new slot); a new chunk reads `fill` at its new slot (f32[capacity,
    C]; default zeros) with zero state; every slot past the live ones is zeroed. When the counts need more than the
    capacity, rows are served in row order while slots last (a row short of slots keeps a shorter prefix). Returns
    (the new pool, bool[capacity]: the slots holding a new chunk).
    """
    v, k, cap = p.rows, p.chunks, p.capacity
    old_start, old_count = p.offsets[:-1], live_chunks(p.offsets)
    want = jnp.clip(counts.astype(jnp.int32), 0, k)
    start = jnp.cumsum(want) - want
    granted = jnp.clip(cap - start, 0, want)  # start is unchanged by the clip: earlier rows got all they wanted
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(granted, dtype=jnp.int32)])
    slot = jnp.arange(cap, dtype=jnp.int32)
    live = slot < offsets[v]
    row = jnp.clip(jnp.searchsorted(offsets, slot, side="right") - 1, 0, v - 1)
    chunk = slot - offsets[row]
    kept = live & (chunk < old_count[row])
    fresh = live & ~kept
    source = jnp.where(kept, old_start[row] + chunk, cap)  # cap: out of range -> the fill value, zero

    def moved(a: jax.Array) -> jax.Array:
        return jnp.take(a, source, axis=0, mode="fill", fill_value=0)

    pool = moved(p.pool)
    if fill is not None:
        pool = jnp.where(fresh[:, None], fill.astype(pool.dtype), pool)
    return ChunkPool(pool=pool, offsets=offsets, chunks=k, state={n: moved(s) for n, s in p.state.items()}), fresh


def compact(p: ChunkPool, capacity: int) -> ChunkPool:
    """The same rows in a pool of `capacity` slots (>= the live chunks): the live chunks already sit at slots
    0..live-1, so this truncates or zero-extends the pool and its state. Runs on the host, in numpy (the capacity is
    a shape, and compaction is rare): the result holds numpy arrays."""
    offsets = np.asarray(p.offsets)
    total = int(offsets[-1])
    if capacity < total:
        raise ValueError(f"chunk pool: cannot compact {total} live chunks into capacity {capacity}")

    def moved(a) -> np.ndarray:
        a = np.asarray(a)
        out = np.zeros((capacity, *a.shape[1:]), a.dtype)
        out[:total] = a[:total]
        return out

    return ChunkPool(pool=moved(p.pool), offsets=offsets, chunks=p.chunks,
                     state={k: moved(s) for k, s in p.state.items()})


def allocated_bytes(p: ChunkPool) -> int:
    """Device bytes the pool really holds: the chunk pool, the offsets and the state."""
    leaves = [p.pool, p.offsets, *p.state.values()]
    return int(sum(a.size * a.dtype.itemsize for a in leaves))
