"""Embedding kernels: gather-reduce and scatter-update.

Each kernel family has a plain-jnp reference (the fastest path on CPU, and the oracle the Pallas kernels are
tested against). This package imports only jax.
"""

from pallas_kernels.gather_reduce import gather_reduce_reference
from pallas_kernels.scatter_update import dedup_segment_sum_reference

__all__ = ["gather_reduce_reference", "dedup_segment_sum_reference"]
