"""Scatter-update support: exact aggregation of duplicate row ids before a sparse optimizer step.

FBGEMM's EXACT_* optimizers sum the gradients of all occurrences of a row in a batch and apply the optimizer
once per distinct row; `dedup_segment_sum_reference` computes that aggregation with static shapes.
"""

import jax
import jax.numpy as jnp


def dedup_segment_sum_reference(
    rows: jax.Array, grads: jax.Array, num_rows: int
) -> tuple[jax.Array, jax.Array]:
    """Distinct row ids and the summed gradient of each.

    Args:
      rows: i32[N] row ids; ids >= num_rows are padding.
      grads: f32[N, D] one gradient per occurrence.
      num_rows: R, the table's row count (used as the padding sentinel).

    Returns:
      unique_rows: i32[N] distinct ids in ascending order, padded with `num_rows` (so a scatter with
        mode="drop" ignores the padding).
      summed: f32[N, D] summed gradient of each distinct id (zeros in padded slots).
    """
    n = rows.shape[0]
    assert grads.shape[0] == n, (rows.shape, grads.shape)
    # Padding ids all collapse onto the sentinel, which is out of range and dropped by the scatter.
    rows = jnp.minimum(rows, num_rows)
    unique_rows, inverse = jnp.unique(rows, size=n, fill_value=num_rows, return_inverse=True)
    summed = jax.ops.segment_sum(grads, inverse.reshape(-1), num_segments=n)
    return unique_rows, summed
