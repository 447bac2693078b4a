"""Embedding kernels: gather-reduce, deduplication and the fused sparse update.

Each kernel family has a plain-jnp reference (the fastest path on CPU, and the oracle the Pallas kernels are
tested against). This package imports only jax.
"""

from pallas_kernels.dedup import sorted_segments, unique_rows, unique_rows_reference
from pallas_kernels.gather_reduce import gather, gather_reduce, gather_reduce_reference, gather_reference
from pallas_kernels.scatter_update import (
    SegmentGrads,
    fused_row_update,
    kernel_fallback_reason,
    row_update_reference,
    segment_grads_reference,
)

__all__ = ["SegmentGrads", "fused_row_update", "gather", "gather_reduce", "gather_reduce_reference", "gather_reference",
           "kernel_fallback_reason", "row_update_reference", "segment_grads_reference", "sorted_segments",
           "unique_rows", "unique_rows_reference"]
