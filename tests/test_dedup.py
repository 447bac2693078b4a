"""The fast dedup (one key-only sort + a binary search) equals jnp.unique's on every edge case."""

import jax
import numpy as np
import pytest

from pallas_kernels import sorted_segments, unique_rows, unique_rows_reference


@pytest.mark.parametrize("n, sentinel, high", [(1, 5, 5), (7, 3, 3), (100, 1000, 50), (1000, 64, 80),
                                               (4096, 1 << 20, 1 << 20), (257, 10, 11)])
def test_unique_rows_equals_jnp_unique(n, sentinel, high):
    """Random ids below `high`: duplicates, ids 0 and sentinel-1, and padding (ids >= sentinel) when high > it."""
    rng = np.random.default_rng(n + sentinel)
    rows = rng.integers(0, high, n).astype(np.int32)
    rows[0] = 0
    fast, reference = jax.jit(unique_rows, static_argnums=1), jax.jit(unique_rows_reference, static_argnums=1)
    unique, inverse = fast(rows, sentinel)
    want_unique, want_inverse = reference(rows, sentinel)
    np.testing.assert_array_equal(unique, want_unique)
    np.testing.assert_array_equal(inverse, want_inverse)
    np.testing.assert_array_equal(np.asarray(unique)[np.asarray(inverse)], np.minimum(rows, sentinel))


def test_all_padding_and_all_equal():
    for rows in (np.full(9, 12, np.int32), np.full(9, 4, np.int32)):
        unique, inverse = unique_rows(rows, 12)
        want_unique, want_inverse = unique_rows_reference(rows, 12)
        np.testing.assert_array_equal(unique, want_unique)
        np.testing.assert_array_equal(inverse, want_inverse)


@pytest.mark.parametrize("n, sentinel, high", [(1, 5, 5), (9, 12, 12), (300, 40, 45), (257, 1 << 20, 1 << 20)])
def test_sorted_segments_against_numpy(n, sentinel, high):
    """One sort with positions: the distinct rows and slots of `unique_rows`, and each distinct row's occurrences as
    one contiguous, stably ordered segment of `order` (numpy's stable argsort is the oracle); unused slots' segments
    are empty at N."""
    rng = np.random.default_rng(n + high)
    rows = rng.integers(0, high, n).astype(np.int32)
    unique, inverse, starts, order = map(np.asarray, jax.jit(sorted_segments, static_argnums=1)(rows, sentinel))
    want_unique, want_inverse = map(np.asarray, unique_rows(rows, sentinel))
    np.testing.assert_array_equal(unique, want_unique)
    np.testing.assert_array_equal(inverse, want_inverse)
    clipped = np.minimum(rows, sentinel)
    np.testing.assert_array_equal(order, np.argsort(clipped, kind="stable"))
    distinct = np.unique(clipped)
    for u, value in enumerate(distinct):
        np.testing.assert_array_equal(order[starts[u]:starts[u + 1]], np.flatnonzero(clipped == value))
    np.testing.assert_array_equal(starts[distinct.size:], n)
