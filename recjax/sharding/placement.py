"""Placing host data on a mesh and reading it back: what the mesh backend, the checkpoints and the trainer share.

A leaf module (jax and numpy only). Batches are split over every device, `data` major (`ALL_AXES`); multi-host, each
process supplies only its devices' rows of every global batch.
"""

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ALL_AXES = ("data", "model")


def batch_spec(stacked: bool = False) -> P:
    """A batch's leading dim split over every device; k stacked batches (f32[k, B, ...]) split along B."""
    return P(None, ALL_AXES) if stacked else P(ALL_AXES)


def batch_sharding(mesh: Mesh, stacked: bool = False) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(stacked))


def process_rows(mesh: Mesh, batch_size: int) -> slice | None:
    """The rows of every global batch this process's devices hold -- what its data reader yields (one contiguous
    range, B / processes rows); None in a single-process run (the reader yields whole batches)."""
    if jax.process_count() == 1:
        return None
    spans = sorted((s[0].start, s[0].stop) for s in
                   batch_sharding(mesh).addressable_devices_indices_map((batch_size,)).values())
    if any(a[1] != b[0] for a, b in zip(spans[:-1], spans[1:], strict=True)):
        raise ValueError(f"process {jax.process_index()}'s devices hold rows {spans} of each batch of {batch_size}, "
                         "not one range; order the mesh's devices by process")
    return slice(spans[0][0], spans[-1][1])


def put_batch(mesh: Mesh, batch, stacked: bool = False):
    """A host batch -> device arrays split over every device (B/n rows each, data major); `stacked`: k batches on a
    leading axis, each split so. Single process: `batch` is the global batch (or made on a device: moved). Multi-host:
    it is this process's rows (`process_rows`), and the processes' shares make the global arrays (no process holds
    another's rows)."""
    sharding = batch_sharding(mesh, stacked)
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def put_global(data: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from the same host value on every process; each device gets only its block."""
    return jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])


def to_host(array: jax.Array) -> np.ndarray:
    """The whole value of a (possibly multi-process) global array as numpy."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
