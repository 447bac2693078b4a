"""Gather-reduce: pooled embedding lookup from a (stacked) row table.

`gather_reduce_reference` is the plain-jnp path. Row ids equal to (or above) the table's row count are the
padding sentinel: they read zeros, so padded bag slots contribute nothing.
"""

import jax
import jax.numpy as jnp


def gather_reduce_reference(table: jax.Array, rows: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted sum of table rows per bag.

    Args:
      table: f32[R, D] stacked physical rows.
      rows: i32[B, L] row ids into `table`; ids >= R are padding and read as zero.
      weights: f32[B, L] per-id pooling weights (1 for sum, 1/len for mean, 0 for padding).

    Returns:
      f32[B, D] pooled embeddings.
    """
    assert rows.ndim == 2 and rows.shape == weights.shape, (rows.shape, weights.shape)
    gathered = jnp.take(table, rows, axis=0, mode="fill", fill_value=0)  # [B, L, D]
    return jnp.einsum("bld,bl->bd", gathered, weights.astype(gathered.dtype))
