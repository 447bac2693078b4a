"""Host memory: a group's rows and optimizer state in host memory through JAX memory kinds (`pinned_host`), the
step's rows brought to the device.

A GPU's or TPU's host RAM is many times its device memory; tables that do not fit the device but fit the host live
there whole, with no cache to plan (FBGEMM's UVM tables, `EmbeddingLocation.MANAGED`; keras-rs / jax-tpu-embedding
keep tables in host memory on TPU the same way). The arrays are committed to the `pinned_host` memory of their device
(on a mesh, each device's block), so XLA keeps them there across steps and the step moves only rows:

    fetch    the distinct rows a step reads (without dedup: every bag slot's row) are gathered on the host
             (`compute_on("device_host")`: the indices go to host memory, the gather runs there) and copied to the
             device; the lookup, pooling and model then run on the device as for any table.
    update   the rows' optimizer state is brought the same way, the optimizer's row rule runs on the device, and the
             new rows and state are scattered back on the host, in place (the state is donated).

The Pallas kernels read and write device memory only, so the update of a host table is the XLA path's arithmetic
(`row_update_reference`) around the host gather / scatter, whatever `embedding.kernel` says; the forward's gather-reduce
kernels run on the brought rows, which are on the device. The numbers are the device-memory run's, bit for bit on a
CPU (tests/test_placement.py), where host memory is the device's own RAM and jax 0.10 has the same memory kinds.
"""

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

from pallas_kernels import SegmentGrads, segment_grads_reference
from recjax.embedding_backend import Storage
from recjax.errors import ConfigError
from recjax.sparse_optim import row_rule, scatter_delta

HOST = "pinned_host"


def _on_host(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Host)


def _on_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device)


class HostStorage(Storage):
    """The groups' arrays in host memory (`pinned_host`); the layout places them (on a mesh, each block in its
    device's host memory) and reads and updates rows through `bring` / `apply` / `scatter_add`."""

    name = "host"
    resident = False
    memory_kind = HOST

    def __init__(self, collection, groups, context=None):
        super().__init__(collection, groups, context)
        kinds = {m.kind for m in jax.local_devices()[0].addressable_memories()}
        if HOST not in kinds:
            raise ConfigError("tiering.tables", f"the host tier keeps tables in the '{HOST}' memory of the "
                                                f"device, which {jax.local_devices()[0].device_kind} does not have "
                                                f"(it has {sorted(kinds)}); keep the tables in memory or on disk")

    def bring(self, group, array, ids):
        valid = (ids >= 0) & (ids < array.shape[0])
        # The gather runs on the host: every operand in host memory, no constants of its own (a "fill" gather's
        # bounds checks would be device constants), so out-of-range ids read row 0 and are zeroed on the device.
        safe = _on_host(jnp.where(valid, ids, 0).astype(jnp.int32))
        with compute_on("device_host"):
            rows = array.at[safe].get(mode="promise_in_bounds")
        rows = _on_device(rows)
        return jnp.where(valid.reshape(valid.shape + (1,) * (rows.ndim - 1)), rows, 0)

    def _put(self, array, ids, values):
        """`array` (host) with rows `ids` set to `values` (device), on the host; out-of-range ids dropped."""
        ids, values = _on_host(ids.astype(jnp.int32)), _on_host(values.astype(array.dtype))
        with compute_on("device_host"):
            return array.at[ids].set(values, mode="drop")

    def apply(self, group, optimizer, array, state, ids, current, grads, lr, step, kernel, interpret=None):
        if isinstance(grads, SegmentGrads):  # pool_from="table": each row's occurrences summed first, as XLA does
            grads = segment_grads_reference(grads, ids.shape[0])
        if current is None:
            current = self.bring(group, array, ids)
        state_rows = {k: self.bring(group, v, ids) for k, v in state.items()}
        new_rows, new_state = row_rule(optimizer)(current, state_rows, grads, lr, step)
        return self._put(array, ids, new_rows), {k: self._put(v, ids, new_state[k]) for k, v in state.items()}

    def scatter_add(self, group, optimizer, array, ids, grads, lr, step):
        delta = _on_host(scatter_delta(optimizer, grads, lr, step).astype(array.dtype))
        ids = _on_host(ids.astype(jnp.int32))
        with compute_on("device_host"):
            return array.at[ids].add(delta, mode="drop")

    def describe(self) -> str:
        tables = sorted(self.tables())
        return f"host memory ({HOST}): groups {', '.join(self.groups)} (tables {', '.join(tables)})"

    def summary(self) -> dict:
        return {"host_memory": {"groups": list(self.groups), "tables": sorted(self.tables())}}
