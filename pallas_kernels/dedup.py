"""Deduplication of row ids: one sort per step, shared by the forward gather and the sparse update.

Gathering each distinct row once (instead of once per occurrence) halves the random reads of a large table,
and differentiating with respect to the distinct rows makes autodiff sum the gradients of duplicate ids
exactly -- the aggregation FBGEMM's EXACT_* optimizers perform before their update.
"""

import jax
import jax.numpy as jnp


def unique_rows_reference(rows: jax.Array, sentinel: int) -> tuple[jax.Array, jax.Array]:
    """Distinct row ids with static shape, and where each occurrence landed.

    Args:
      rows: i32[N] row ids; values >= sentinel are padding.
      sentinel: the table's row count. Padding collapses onto it; it gathers zeros (mode="fill") and a
        scatter with mode="drop" ignores it.

    Returns:
      unique: i32[N] distinct ids ascending, tail-padded with `sentinel`.
      inverse: i32[N] with unique[inverse[i]] == min(rows[i], sentinel).
    """
    rows = jnp.minimum(rows, sentinel)
    unique, inverse = jnp.unique(rows, size=rows.shape[0], fill_value=sentinel, return_inverse=True)
    return unique.astype(jnp.int32), inverse.reshape(-1).astype(jnp.int32)
