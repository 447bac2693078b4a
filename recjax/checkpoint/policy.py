"""Check-N-Run's policies (Eisenman et al. 2022, Sec. 4): which rows the next checkpoint writes and when it is a
baseline. The dirty-row bitmaps (bool[rows] per stacked group, in the TrainState, set inside the jitted step by
`recjax.step.mark_dirty_rows`) say which rows changed; `Policy` keeps the chain the next delta extends.

    "full"          every checkpoint a baseline (no bitmaps)
    "one_shot"      one baseline, then cumulative deltas since it: a restore reads 2 steps
    "consecutive"   per-interval deltas: a restore reads the whole chain
    "intermittent"  consecutive, with a new baseline once the chain's delta bytes exceed `baseline_fraction` of the
                    baseline's
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from recjax import quantize
from recjax.checkpoint.blocks import delta_blocks, dirty_blocks, gather_block
from recjax.checkpoint.integrity import nbytes
from recjax.checkpoint.store import ResumePoint, by_blocks, decode, encode


def table_shapes(state) -> dict[str, tuple[int, ...]]:
    return {g: tuple(t.shape) for g, t in state.tables.items()}


def row_sharding(table: jax.Array):
    """Where a per-row array of `table` lives: split like its rows on a mesh (replicated when the rows are not split,
    e.g. a column-wise table), else the table's device."""
    if not isinstance(table, jax.Array):  # an array read by row blocks (a disk tier's restore): the default device
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    sharding = table.sharding
    # In device memory, whatever memory the table is in (host memory: the step marks the bitmap on the device).
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[:1]))
    return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))


@functools.partial(jax.jit, static_argnums=(0, 1))
def zero_rows(rows: int, sharding) -> jax.Array:
    """bool[rows] of zeros made where `sharding` puts them (each process its blocks)."""
    return jax.lax.with_sharding_constraint(jnp.zeros(rows, jnp.bool_), sharding)


def gather_rows(array: jax.Array, ids: np.ndarray) -> np.ndarray:
    """array[ids] on the host, gathered on the device(s) holding the rows (a sharded array: each block gathers its
    own rows, on its device); ids padded to a power of two so few shapes compile. An array not on a device (a disk
    tier's `CheckpointRows`) reads its rows itself."""
    if not isinstance(array, jax.Array):
        return array.rows(ids)
    if len(array.sharding.device_set) == 1:
        return gather_block(array, ids)
    out = np.zeros((len(ids), *array.shape[1:]), array.dtype)
    for shard in array.addressable_shards:
        if shard.replica_id:
            continue
        rows, *rest = shard.index
        start, stop, _ = rows.indices(array.shape[0])
        mine = np.flatnonzero((ids >= start) & (ids < stop))
        if len(mine):
            out[(mine, *rest)] = gather_block(shard.data, ids[mine] - start)
    return out


class Policy:
    """The chain of checkpoints the next delta extends ([baseline, deltas...]) under `config.checkpoint`'s policy,
    its bytes, and what the next save writes."""

    def __init__(self, name: str, baseline_fraction: float, bits: int, optimizer_bits: int):
        self.name, self.baseline_fraction = name, baseline_fraction
        self.bits, self.optimizer_bits = bits, optimizer_bits  # quantized delta rows, optimizer rows (0: f32)
        self.chain: list[int] | None = None
        self.baseline_bytes = 0
        self.chain_bytes = 0
        self.baseline_shapes: dict[str, tuple[int, ...]] = {}  # table shapes of the chain's baseline

    def track(self, state):
        """`state` with a zero dirty-row bitmap per group when the policy writes deltas (none for "full")."""
        if self.name == "full":
            return state.replace(dirty_rows={})
        return state.replace(dirty_rows={g: zero_rows(t.shape[0], row_sharding(t)) for g, t in state.tables.items()})

    def optimizer_codes(self, optimizer) -> dict[str, str]:
        """{field: "signed" | "unsigned"}: the sparse-optimizer fields a delta stores in 8-bit dynamic codes
        (`quantize_optimizer_bits`): those with a vector per row (lazy Adam's m and v, Adagrad's accumulator); a
        per-row scalar (row-wise Adagrad's accumulator, 1 / D of the row's bytes) stays f32, as its block would be
        the one value. Unsigned for the fields the optimizer keeps non-negative."""
        if not self.optimizer_bits:
            return {}
        return {k: "unsigned" if k in optimizer.nonnegative_state else "signed"
                for k, shape in sorted(optimizer.state_shapes(1, 1).items()) if len(shape) > 1}

    def plan(self, state, optimizer) -> tuple[str, dict, int]:
        """("full", {}, 0) or ("delta", the rows item, its bytes) for the next save of `state` under the policy
        (`optimizer`: the run's sparse optimizer, whose rows a delta carries)."""
        # A dynamic table's pool re-allocated since the baseline (new shapes) needs a new baseline.
        if self.name == "full" or not self.chain or table_shapes(state) != self.baseline_shapes:
            return "full", {}, 0
        rows_item = {}
        if jax.process_count() > 1:  # by blocks: each process gathers and writes its devices' rows
            from jax.experimental import multihost_utils

            groups = sorted(state.dirty_rows)
            counts = np.array([max(map(len, dirty_blocks(state.dirty_rows[g]).values()), default=0)
                               for g in groups], np.int64)
            caps = np.asarray(multihost_utils.process_allgather(counts)).reshape(-1, len(groups)).max(axis=0)
            for g, cap in zip(groups, caps, strict=True):
                if cap:  # Orbax cannot store empty arrays; a group without touched rows is left out
                    rows_item[encode(g)] = delta_blocks(state.dirty_rows[g], state.tables[g],
                                                        state.sparse_opt_state[g], int(cap), self.bits,
                                                        self.optimizer_codes(optimizer))
            groups = ()
        else:
            groups = sorted(state.dirty_rows)
        for g in groups:
            dirty = state.dirty_rows[g]
            ids = np.flatnonzero(np.asarray(dirty)).astype(np.int32)
            if not len(ids):
                continue  # Orbax cannot store empty arrays; a group without touched rows is left out
            part = {"ids": ids}
            rows = gather_rows(state.tables[g], ids)
            part.update(quantize.quantize_rows(rows, self.bits) if self.bits else {"rows": rows})
            codes = self.optimizer_codes(optimizer)
            opt = {k: gather_rows(v, ids) for k, v in state.sparse_opt_state[g].items()}
            opt = {k: quantize.quantize_state_rows(v, codes[k] == "signed") if k in codes else v
                   for k, v in opt.items()}
            if opt:
                part["opt"] = opt
            rows_item[encode(g)] = part
        delta_bytes = nbytes(rows_item)
        if self.name == "intermittent" and (self.chain_bytes + delta_bytes
                                            > self.baseline_fraction * self.baseline_bytes):
            return "full", {}, 0
        return "delta", rows_item, delta_bytes

    def extend(self, step: int, kind: str, table_bytes: int, state) -> None:
        """Extend the chain by the save of `step` (`table_bytes`: a baseline's tables or a delta's rows)."""
        if kind == "full":
            self.chain, self.baseline_bytes, self.chain_bytes = [step], table_bytes, 0
            self.baseline_shapes = table_shapes(state)
        elif self.name == "one_shot":
            self.chain, self.chain_bytes = [self.chain[0], step], table_bytes
        else:
            self.chain, self.chain_bytes = [*self.chain, step], self.chain_bytes + table_bytes

    def clears(self, kind: str) -> bool:
        """Whether a save of `kind` clears the bitmaps: all but one-shot deltas (cumulative since the baseline:
        cleared at a baseline only)."""
        return kind == "full" or self.name != "one_shot"

    def clear(self, state, kind: str):
        """`state` after a save of `kind`: its bitmaps cleared as `clears` says."""
        if state.dirty_rows and self.clears(kind):
            return self.track(state)
        return state

    def meta(self, kind: str, optimizer) -> dict:
        """The policy's fields of a checkpoint's meta."""
        delta = kind == "delta"
        return {"policy": self.name, "chain": self.chain, "quantize_bits": self.bits if delta else 0,
                "quantize_optimizer_bits": self.optimizer_bits if delta else 0,
                "optimizer_codes": self.optimizer_codes(optimizer) if delta else {},
                "baseline_bytes": self.baseline_bytes, "chain_bytes": self.chain_bytes}

    def restored(self, point: ResumePoint, state, extend: bool):
        """After a restore of `point` (`state` tracked): the next delta extends its chain when `extend` (this run's
        own checkpoint, same layout and processes) and the policy is the same; returns the state, whose bitmaps mark
        the restored one-shot delta's rows (cumulative since the baseline)."""
        self.baseline_shapes = table_shapes(state)  # the chain restored reads tables of these shapes
        meta = point.meta
        if not extend or meta["policy"] != self.name or self.name == "full":
            return state
        self.chain = list(meta["chain"])
        self.baseline_bytes, self.chain_bytes = int(meta["baseline_bytes"]), int(meta["chain_bytes"])
        if self.name == "one_shot" and meta["groups"] and by_blocks(meta):
            self.chain = None  # multi-process: a new baseline rather than re-marking the delta's rows
        elif self.name == "one_shot" and meta["groups"]:
            rows = decode(point.store.item(point.step, "rows", meta))
            state = state.replace(dirty_rows={g: d.at[jnp.asarray(rows[g]["ids"])].set(True) if g in rows else d
                                              for g, d in state.dirty_rows.items()})
        return state
