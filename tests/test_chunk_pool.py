"""The FIITED chunk pool (compression/chunk_pool.py): invariants and values after random prune / grow / compact
sequences, checked against a plain-Python model of each row's chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compression import chunk_pool as cp

V, K, C = 12, 4, 3  # rows, chunks per row, chunk width (D = 12)


def check_invariants(p: cp.ChunkPool) -> None:
    index, free, num_free = np.asarray(p.index), np.asarray(p.free), int(p.num_free)
    live = index[index >= 0]
    assert len(set(live.tolist())) == live.size, "a slot is referenced twice"
    assert np.all(live < p.capacity)
    unreferenced = set(range(p.capacity)) - set(live.tolist())
    stack = free[:num_free].tolist()
    assert len(stack) == len(set(stack)) and set(stack) == unreferenced, (stack, sorted(unreferenced))
    assert np.all(free[num_free:] == -1)
    has = index >= 0
    assert np.all(has[:, 1:] <= has[:, :-1]), "a row's live chunks are not a prefix"
    pool = np.asarray(p.pool)
    assert np.all(pool[sorted(unreferenced)] == 0)  # a free slot is clean
    for s in p.state.values():
        assert np.all(np.asarray(s)[sorted(unreferenced)] == 0)


def check_values(p: cp.ChunkPool, model: dict[int, list[np.ndarray]], model_state: dict[int, list[float]]) -> None:
    """Every row reads its live chunks' values then zeros; each live slot's state is the model's."""
    got = np.asarray(cp.read(p, jnp.arange(V)))
    index, acc = np.asarray(p.index), np.asarray(p.state["acc"])
    for r in range(V):
        expected = np.zeros(K * C, np.float32)
        for k, chunk in enumerate(model[r]):
            expected[k * C:(k + 1) * C] = chunk
            assert acc[index[r, k]] == model_state[r][k]
        np.testing.assert_array_equal(got[r], expected)
        assert (index[r] >= 0).sum() == len(model[r])


@pytest.mark.parametrize("seed", range(4))
def test_random_prune_grow_compact_sequences_keep_the_pool_consistent(seed):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(V, K * C)).astype(np.float32)
    counts = rng.integers(0, K + 1, V)
    p = cp.create(values, K, capacity=max(30, int(counts.sum())), live_chunks=counts, state={"acc": ()})
    model = {r: [values[r, k * C:(k + 1) * C] for k in range(counts[r])] for r in range(V)}
    model_state = {r: [0.0] * counts[r] for r in range(V)}
    # A per-slot state write, as an optimizer step would do, so the test can see state move with its slot.
    p = p.replace(state={"acc": jnp.asarray(np.where(np.arange(p.capacity) < counts.sum(),
                                                     np.arange(p.capacity) + 1.0, 0.0), jnp.float32)})
    index = np.asarray(p.index)
    model_state = {r: [float(index[r, k] + 1) for k in range(counts[r])] for r in range(V)}
    check_invariants(p)
    check_values(p, model, model_state)
    prune, grow = jax.jit(cp.prune), jax.jit(cp.grow)
    for step in range(26):
        op = rng.choice(["prune", "grow", "compact"], p=[0.4, 0.4, 0.2]) if step < 25 else "grow_all"
        # Every row in a random order (one shape, one compile); keep = K and want = 0 leave a row alone.
        rows = rng.permutation(V)
        if op == "prune":
            keep = np.where(rng.random(V) < 0.4, rng.integers(0, K, V), K)
            p = prune(p, jnp.asarray(rows, jnp.int32), jnp.asarray(keep, jnp.int32))
            for r, c in zip(rows, keep, strict=True):
                model[r], model_state[r] = model[r][:c], model_state[r][:c]
        elif op in ("grow", "grow_all"):  # grow_all: every row to K chunks, more than the pool's <= 36 slots
            want = np.where(rng.random(V) < 0.4, rng.integers(1, K + 1, V), 0) if op == "grow" else np.full(V, K)
            new = rng.normal(size=(len(rows), K, C)).astype(np.float32)
            available = int(p.num_free)
            p = grow(p, jnp.asarray(rows, jnp.int32), jnp.asarray(want, jnp.int32), jnp.asarray(new))
            for i, (r, w) in enumerate(zip(rows, want, strict=True)):  # served in (row, chunk) order while slots last
                for k in range(len(model[r]), w):
                    if available == 0:
                        break
                    available -= 1
                    model[r].append(new[i, k])
                    model_state[r].append(0.0)
        else:
            live = sum(len(c) for c in model.values())
            # Fewer slots than V * K so grows run out of slots; mostly two shapes (compiles), tight when needed.
            capacity = max(live, int(rng.choice([30, 36])))
            p = cp.compact(p, capacity)
            assert p.capacity == capacity and int(p.num_free) == capacity - live
            assert np.array_equal(np.sort(np.asarray(p.index)[np.asarray(p.index) >= 0]), np.arange(live))
        check_invariants(p)
        check_values(p, model, model_state)
        assert cp.allocated_bytes(p) == 4 * (p.capacity * C + V * K + p.capacity + p.capacity)
    assert int(p.num_free) == 0  # grow_all asked for more slots than were free: served in order until none left


def test_pruning_then_compacting_really_shrinks_the_pool():
    values = np.arange(V * K * C, dtype=np.float32).reshape(V, K * C)
    p = cp.create(values, K, state={"acc": (C,)})
    before = cp.allocated_bytes(p)
    p = cp.prune(p, jnp.arange(V), jnp.full(V, 1, jnp.int32))  # keep the first chunk of every row
    assert int(p.num_free) == V * (K - 1) and cp.allocated_bytes(p) == before  # freed, not yet returned
    p = cp.compact(p, V)
    assert p.capacity == V and cp.allocated_bytes(p) < before
    np.testing.assert_array_equal(np.asarray(cp.read(p, jnp.arange(V)))[:, :C], values[:, :C])
    np.testing.assert_array_equal(np.asarray(cp.read(p, jnp.arange(V)))[:, C:], 0)
    with pytest.raises(ValueError, match="cannot compact 12 live chunks into capacity 11"):
        cp.compact(p, V - 1)
