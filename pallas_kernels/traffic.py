"""Analytic HBM traffic of one training pass over a stacked group, by where the forward pools from.

The two deduplicated training paths (recjax/embedding.py, `pool_from`):
  "distinct_rows"  gather the batch's U distinct rows into a buffer, pool the M ids' bags from the buffer, and
                   hand the buffer to the fused update as the rows' current values;
  "table"          pool the M ids' bags straight from the table inside the kernel; the update kernel reads the U
                   rows it updates itself.
Everything else is common to both: the pooled outputs and their cotangents, each occurrence's weighted gradient
(written, then read by the scatter-add into the U distinct rows' gradients), the update's gradient read, row write
and optimizer-state read and write. Counted with no caches (HBM on TPU has none in between; a GPU's L2 can hold a
small buffer, which favours "distinct_rows" when U x D is a few MB): "table" moves 2 U D itemsize bytes less -- the
buffer's write and the gather's read -- whatever U and M are.

`fused_backward=True` counts the table path's update as the GPU's fused backward + update (scatter_update.py,
`SegmentGrads`): neither the M per-occurrence gradients nor the U summed gradients reach memory; instead each
occurrence reads its bag's pooled gradient row and its source index and weight (f32 + i32), and the update writes the
rows it sums. (The XLA and TPU paths sum the segments with XLA first: the unfused count.)
"""

POOL_FROM = ("distinct_rows", "table")


def training_pass_bytes(pool_from: str, *, ids: int, distinct: int, bags: int, dim: int, itemsize: int = 4,
                        state_floats_per_row: int = 0, fused_backward: bool = False) -> int:
    """HBM bytes a training pass over one group moves on the `pool_from` path (module docstring).

    Args:
      ids: M, the id slots the batch's bags read from the group (padding included: every slot is read).
      distinct: U, the distinct rows among them.
      bags: the pooled outputs (bags x features of the group).
      dim: D; itemsize: bytes per table element; state_floats_per_row: f32 optimizer state per row (lazy Adam 2 D,
        Adagrad D, row-wise Adagrad 1).
      fused_backward: the table path's backward summed inside the update kernel (module docstring).
    """
    if pool_from not in POOL_FROM:
        raise ValueError(f"unknown pool_from {pool_from!r}; use one of {POOL_FROM}")
    if fused_backward and pool_from != "table":
        raise ValueError("fused_backward is the table path's update (pool_from='table')")
    row, f32_row = dim * itemsize, dim * 4
    if fused_backward:  # each occurrence reads its bag's gradient row, its source index and its weight
        backward = ids * f32_row + 2 * ids * 4
    else:
        backward = (2 * ids * f32_row  # each occurrence's weighted gradient, written and read by the scatter-add
                    + 3 * distinct * f32_row  # the distinct rows' gradient: zeroed, read-modify-written
                    + distinct * f32_row)  # ... read by the update
    common = (ids * row  # the pooling reads every id's row (from the buffer or the table)
              + 2 * bags * f32_row  # pooled outputs written, their cotangents read
              + backward
              + distinct * row  # the new rows written
              + 2 * distinct * 4 * state_floats_per_row)  # optimizer state read and written
    if pool_from == "distinct_rows":  # the gather reads U rows and writes the buffer; the update reads the buffer
        return common + 3 * distinct * row
    return common + distinct * row  # the update reads the U rows from the table
