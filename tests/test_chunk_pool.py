"""The FIITED chunk pool (compression/chunk_pool.py): invariants and values after random resize / compact
sequences, checked against a plain-Python model of each row's chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compression import chunk_pool as cp

V, K, C = 12, 4, 3  # rows, chunks per row, chunk width (D = 12)


def check_invariants(p: cp.ChunkPool) -> None:
    offsets = np.asarray(p.offsets)
    counts = np.diff(offsets)
    assert offsets[0] == 0 and np.all(counts >= 0) and np.all(counts <= K) and offsets[-1] <= p.capacity
    live = int(offsets[-1])
    assert np.all(np.asarray(p.pool)[live:] == 0)  # a free slot is clean
    for s in p.state.values():
        assert np.all(np.asarray(s)[live:] == 0)


def check_values(p: cp.ChunkPool, model: dict[int, list[np.ndarray]], model_state: dict[int, list[float]]) -> None:
    """Every row reads its live chunks' values then zeros; each live chunk's state is the model's."""
    got = np.asarray(cp.read(p, jnp.arange(V)))
    slots, acc = np.asarray(cp.slots(p.offsets[:-1], p.offsets[1:], K)), np.asarray(p.state["acc"])
    for r in range(V):
        expected = np.zeros(K * C, np.float32)
        for k, chunk in enumerate(model[r]):
            expected[k * C:(k + 1) * C] = chunk
            assert acc[slots[r, k]] == model_state[r][k]
        np.testing.assert_array_equal(got[r], expected)
        assert (slots[r] >= 0).sum() == len(model[r])
        assert np.all(slots[r, len(model[r]):] == -1)


@pytest.mark.parametrize("seed", range(4))
def test_random_resize_compact_sequences_keep_the_pool_consistent(seed):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(V, K * C)).astype(np.float32)
    counts = rng.integers(0, K + 1, V)
    p = cp.create(values, K, capacity=max(30, int(counts.sum())), live_chunks=counts, state={"acc": ()})
    model = {r: [values[r, k * C:(k + 1) * C] for k in range(counts[r])] for r in range(V)}
    # A per-slot state write, as an optimizer step would do, so the test can see state move with its chunk.
    live = int(counts.sum())
    p = p.replace(state={"acc": jnp.asarray(np.where(np.arange(p.capacity) < live, np.arange(p.capacity) + 1.0, 0.0),
                                            jnp.float32)})
    slots = np.asarray(cp.slots(p.offsets[:-1], p.offsets[1:], K))
    model_state = {r: [float(slots[r, k] + 1) for k in range(counts[r])] for r in range(V)}
    check_invariants(p)
    check_values(p, model, model_state)
    resize = jax.jit(cp.resize)
    for step in range(26):
        op = rng.choice(["resize", "compact"], p=[0.75, 0.25]) if step < 25 else "grow_all"
        if op in ("resize", "grow_all"):  # grow_all: every row to K chunks, more than the pool's <= 36 slots
            want = np.where(rng.random(V) < 0.5, rng.integers(0, K + 1, V), [len(model[r]) for r in range(V)])
            want = np.full(V, K) if op == "grow_all" else want
            fill = rng.normal(size=(p.capacity, C)).astype(np.float32)
            available = p.capacity
            p, fresh = resize(p, jnp.asarray(want, jnp.int32), jnp.asarray(fill))
            slots = np.asarray(cp.slots(p.offsets[:-1], p.offsets[1:], K))
            want_fresh = np.zeros(p.capacity, bool)
            for r in range(V):  # served in row order while slots last
                c = min(int(want[r]), available)
                available -= c
                kept = min(c, len(model[r]))
                model[r], model_state[r] = model[r][:kept], model_state[r][:kept]
                for k in range(kept, c):
                    model[r].append(fill[slots[r, k]])
                    model_state[r].append(0.0)
                    want_fresh[slots[r, k]] = True
            np.testing.assert_array_equal(np.asarray(fresh), want_fresh)
        else:
            live = sum(len(c) for c in model.values())
            # Fewer slots than V * K so resizes run out of slots; mostly two shapes (compiles), tight when needed.
            capacity = max(live, int(rng.choice([30, 36])))
            p = cp.compact(p, capacity)
            assert p.capacity == capacity
        check_invariants(p)
        check_values(p, model, model_state)
        assert cp.allocated_bytes(p) == 4 * (p.capacity * C + V + 1 + p.capacity)
    assert int(np.asarray(p.offsets)[-1]) == p.capacity  # grow_all asked for more slots than there are


def test_pruning_then_compacting_really_shrinks_the_pool():
    values = np.arange(V * K * C, dtype=np.float32).reshape(V, K * C)
    p = cp.create(values, K, state={"acc": (C,)})
    before = cp.allocated_bytes(p)
    p, fresh = cp.resize(p, jnp.full(V, 1, jnp.int32))  # keep the first chunk of every row
    assert not np.any(np.asarray(fresh)) and int(p.offsets[-1]) == V
    assert cp.allocated_bytes(p) == before  # packed at slots 0..V-1, the rest free but not yet returned
    p = cp.compact(p, V)
    assert p.capacity == V and cp.allocated_bytes(p) == before - 4 * V * (K - 1) * C * 2
    np.testing.assert_array_equal(np.asarray(cp.read(p, jnp.arange(V)))[:, :C], values[:, :C])
    np.testing.assert_array_equal(np.asarray(cp.read(p, jnp.arange(V)))[:, C:], 0)
    with pytest.raises(ValueError, match="cannot compact 12 live chunks into capacity 11"):
        cp.compact(p, V - 1)


def test_the_offsets_cost_four_bytes_per_row_whatever_the_chunk_count():
    """The reason for the packed layout: 1-column chunks (K = D) with an i32 per (row, chunk) would cost more
    bytes than the table itself; the offsets stay at 4 (V + 1) (FIITED packs them further: pack_offsets)."""
    for k in (1, 4, 16):
        p = cp.create(np.zeros((100, 16), np.float32), k, live_chunks=0, capacity=10)
        assert p.offsets.nbytes == 4 * 101 and p.pool.nbytes == 4 * 10 * (16 // k)


@pytest.mark.parametrize("chunks", [1, 4, 15, 16, 255, 256])
def test_packed_offsets_are_the_cumulative_counts(chunks):
    """pack_offsets keeps each row's count in bit_length(K) bits and an i32 base per block; unpacking any rows gives
    np.cumsum of the counts (the oracle), for random counts, all-full rows and all-empty rows."""
    rng = np.random.default_rng(chunks)
    b = cp.block_rows(chunks)
    # Jitted as the trainer runs them: one compile per shape, not an eager compile of every primitive.
    pack = jax.jit(cp.pack_offsets, static_argnums=1)
    unpack_offsets = jax.jit(cp.unpack_offsets, static_argnums=(2, 3))
    unpack_counts = jax.jit(cp.unpack_counts, static_argnums=1)
    for v in (1, 5, b - 1, b, b + 1, 1000):
        for counts in (rng.integers(0, chunks + 1, v), np.full(v, chunks), np.zeros(v, int)):
            want = np.concatenate([[0], np.cumsum(counts)])
            base, packed = pack(jnp.asarray(cp.offsets_of(counts)), chunks)
            assert packed.dtype == jnp.uint32 and base.dtype == jnp.int32
            assert base.nbytes + packed.nbytes == cp.packed_bytes(v, chunks)
            np.testing.assert_array_equal(unpack_offsets(base, packed, chunks, v), want)
            rows = jnp.asarray(rng.integers(0, v + 1, (5, 7)))
            np.testing.assert_array_equal(unpack_offsets(base, packed, chunks, v, rows), want[np.asarray(rows)])
            ids = rows.clip(0, v - 1)
            np.testing.assert_array_equal(unpack_counts(packed, chunks, ids), counts[np.asarray(ids)])


def test_packed_offsets_cost_under_six_bits_per_row_at_sixteen_chunks():
    """The bookkeeping FIITED pays per row out of its budget: 5 bits of count + an i32 per 60 rows at K = 16 (the
    byte-per-row packing before it cost 10 bits), i.e. 0.73 bytes per row; 3 bits + an i32 per 60 rows at K = 4."""
    assert cp.packed_bytes(6000, 16) == 4 * (6000 // 60 + 1) + 4 * 1000  # 6 counts per word
    assert cp.packed_bytes(6000, 16) / 6000 < 0.74
    assert cp.packed_bytes(6000, 4) == 4 * (6000 // 60 + 1) + 4 * 600  # 10 counts per word
