"""Deduplication of row ids: one sort per step, shared by the forward gather and the sparse update.

Gathering each distinct row once (instead of once per occurrence) halves the random reads of a large table,
and differentiating with respect to the distinct rows makes autodiff sum the gradients of duplicate ids
exactly -- the aggregation FBGEMM's EXACT_* optimizers perform before their update.

`unique_rows` is the fast path: one key-only sort, a compaction, and a vectorised binary search for each id's
slot. On XLA:CPU a sort that carries a payload (the ids' positions, as `jnp.unique(return_inverse=True)` does)
costs several times a key-only sort of the same ids, so the inverse is found by searching the sorted distinct ids
instead (faster than `jnp.unique` in all: benchmarks/RESULTS.md#embedding-engine-internals).
`unique_rows_reference` is `jnp.unique`, the oracle the tests compare with.

`sorted_segments` is the dedup of the training path that pools from the tables (`embedding.pool_from="table"`): the
backward needs, for each distinct row, the occurrences whose gradients it sums -- the segments of the ids sorted by
row, as FBGEMM's table-batched backward builds them (`sorted_linear_indices_run`,
`sorted_linear_indices_cumulative_run_lengths`, `sorted_infos`: one radix sort of the ids with their positions, then
each run of equal ids is one row's segment). One sort that carries the positions gives the distinct rows, each
occurrence's slot, the segment bounds and the sorted order at once.
"""

import jax
import jax.numpy as jnp


def unique_rows(rows: jax.Array, sentinel: int) -> tuple[jax.Array, jax.Array]:
    """Distinct row ids with static shape, and where each occurrence landed.

    Args:
      rows: i32[N] row ids; values >= sentinel are padding.
      sentinel: the table's row count. Padding collapses onto it; it gathers zeros (mode="fill") and a
        scatter with mode="drop" ignores it.

    Returns:
      unique: i32[N] distinct ids ascending, tail-padded with `sentinel`.
      inverse: i32[N] with unique[inverse[i]] == min(rows[i], sentinel).
    """
    assert rows.ndim == 1, rows.shape
    n = rows.shape[0]
    rows = jnp.minimum(rows, sentinel).astype(jnp.int32)
    ordered = jax.lax.sort(rows)
    first = jnp.concatenate([jnp.ones(1, bool), ordered[1:] != ordered[:-1]])
    slot = jnp.cumsum(first, dtype=jnp.int32) - 1
    # Each distinct id goes to its slot; repeats are sent out of range and dropped.
    unique = jnp.full(n, sentinel, jnp.int32).at[jnp.where(first, slot, n)].set(
        ordered, mode="drop", unique_indices=True, indices_are_sorted=True)
    # The tail repeats `sentinel`, the largest value, so the leftmost match is each id's slot.
    inverse = jnp.searchsorted(unique, rows, side="left", method="scan").astype(jnp.int32)
    return unique, inverse


def unique_rows_reference(rows: jax.Array, sentinel: int) -> tuple[jax.Array, jax.Array]:
    """`unique_rows` through `jnp.unique` (the oracle for tests)."""
    rows = jnp.minimum(rows, sentinel)
    unique, inverse = jnp.unique(rows, size=rows.shape[0], fill_value=sentinel, return_inverse=True)
    return unique.astype(jnp.int32), inverse.reshape(-1).astype(jnp.int32)


def sorted_segments(rows: jax.Array, sentinel: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`unique_rows` plus the occurrences of each distinct row, from one sort of the ids with their positions.

    Args:
      rows: i32[N] row ids; values >= sentinel are padding.
      sentinel: the table's row count.

    Returns:
      unique: i32[N] distinct ids ascending, tail-padded with `sentinel` (as `unique_rows`).
      inverse: i32[N] with unique[inverse[i]] == min(rows[i], sentinel) (as `unique_rows`).
      starts: i32[N + 1] segment bounds: the occurrences of unique[u] are order[starts[u]:starts[u + 1]]; the
        segments of the padding tail are empty (starts[u] = N from the first unused slot on).
      order: i32[N] the positions of `rows` sorted by id, stably (equal ids keep their order, so a segment's
        gradients are summed in the same order on every run).
    """
    assert rows.ndim == 1, rows.shape
    n = rows.shape[0]
    rows = jnp.minimum(rows, sentinel).astype(jnp.int32)
    ordered, order = jax.lax.sort((rows, jnp.arange(n, dtype=jnp.int32)), num_keys=1, is_stable=True)
    first = jnp.concatenate([jnp.ones(1, bool), ordered[1:] != ordered[:-1]])
    slot = jnp.cumsum(first, dtype=jnp.int32) - 1
    at_first = jnp.where(first, slot, n + 1)  # repeats go out of range and are dropped
    unique = jnp.full(n, sentinel, jnp.int32).at[at_first].set(ordered, mode="drop", unique_indices=True,
                                                              indices_are_sorted=True)
    starts = jnp.full(n + 1, n, jnp.int32).at[at_first].set(jnp.arange(n, dtype=jnp.int32), mode="drop",
                                                             unique_indices=True, indices_are_sorted=True)
    inverse = jnp.zeros(n, jnp.int32).at[order].set(slot, unique_indices=True)
    return unique, inverse, starts, order
