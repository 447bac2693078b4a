"""Arrays spread over processes, for checkpoints of multi-process runs (recjax/checkpoint.py): each process hashes,
gathers and writes only the blocks its devices hold.

A global array is cut into R x C blocks by its sharding (R row blocks, C column blocks; replicas hold the same
block). `block_digests` is the sha256 of every block as u8[R, 32 C], placed like the array, so each process hashes
its own; `check_blocks` compares what a reader holds (its blocks, or the whole array as numpy) with them. A delta
(`delta_blocks`) holds every row block's marked rows padded to the largest block's count: ids i32[R cap] (-1 =
padding), rows [R cap, d] or per-block k-bit codes, placed like the table; `apply_blocks` writes them back on the
devices holding the rows.
"""

import hashlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from recjax import quantize
from recjax.errors import CheckpointError


@jax.jit
def _take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=0)


def gather_block(array: jax.Array, ids: np.ndarray) -> np.ndarray:
    n = len(ids)
    padded = np.full(1 << max(n - 1, 0).bit_length(), array.shape[0], np.int32)
    padded[:n] = ids
    return np.asarray(_take_rows(array, jax.device_put(padded, array.sharding)))[:n]


def digest(array) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).reshape(-1)).digest()


def is_global(array) -> bool:
    """An array some of whose blocks live in other processes."""
    return isinstance(array, jax.Array) and not array.is_fully_addressable


def _block_grid(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, int]:
    """(R, C): the row and column blocks of an array of `shape` split into blocks of `block`."""
    return shape[0] // max(block[0], 1), (shape[1] // max(block[1], 1) if len(shape) > 1 else 1)


def _block_of(index: tuple, block: tuple[int, ...]) -> tuple[int, int]:
    """(r, c) of the block at a shard's `index`."""
    r = (index[0].start or 0) // max(block[0], 1)
    c = (index[1].start or 0) // max(block[1], 1) if len(block) > 1 else 0
    return r, c


def block_digests(array: jax.Array) -> jax.Array:
    """u8[R, C * 32]: the sha256 of each (row block r, column block c) of a mesh array, placed like the array (the
    device holding block (r, c) holds row r, columns [32 c, 32 c + 32)), so each process hashes and Orbax writes
    only the blocks it holds."""
    sharding = array.sharding
    block = sharding.shard_shape(array.shape)
    local = {}
    for shard in array.addressable_shards:
        key = _block_of(shard.index, block)
        if key not in local:
            local[key] = np.frombuffer(digest(shard.data), np.uint8)
    return jax.make_array_from_callback(tuple(digest_shape(array)), digest_sharding(sharding),
                                        lambda index: local[(index[0].start or 0, (index[1].start or 0) // 32)][None])


def digest_shape(array: jax.Array) -> list[int]:
    rows, cols = _block_grid(array.shape, array.sharding.shard_shape(array.shape))
    return [rows, 32 * cols]


def digest_sharding(sharding):
    """Where the digests of an array placed by `sharding` go: their rows and columns split like its rows and
    columns."""
    spec = (*tuple(sharding.spec), None, None)
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(spec[0], spec[1]))


def check_blocks(array, digests, where: str) -> None:
    """Compare each block of `array` this process holds (or all of a host array) with its recorded sha256."""
    if on_mesh(array):
        expected = {d.device: np.asarray(d.data) for d in digests.addressable_shards}
        found = [(shard.data, expected[shard.device].reshape(-1)) for shard in array.addressable_shards]
    else:
        host, table = np.asarray(array), np.asarray(digests)
        rows, cols = table.shape[0], table.shape[1] // 32
        h, w = host.shape[0] // rows, (host.shape[1] // cols if host.ndim > 1 else 0)
        found = [(host[r * h:(r + 1) * h, c * w:(c + 1) * w] if host.ndim > 1 else host[r * h:(r + 1) * h],
                  table[r, 32 * c:32 * c + 32]) for r in range(rows) for c in range(cols)]
    for data, recorded in found:
        if digest(data) != bytes(recorded):
            raise CheckpointError(f"{where}: a block does not match its sha256 in the digests item")


def on_mesh(array) -> bool:
    return isinstance(array, jax.Array) and len(array.sharding.device_set) > 1


def dirty_blocks(dirty: jax.Array) -> dict[int, np.ndarray]:
    """{row block r: the marked rows of block r (global row ids)} for the blocks this process holds."""
    height = dirty.sharding.shard_shape(dirty.shape)[0]
    out = {}
    for shard in dirty.addressable_shards:
        r = (shard.index[0].start or 0) // height
        if r not in out:
            out[r] = (np.flatnonzero(np.asarray(shard.data)) + r * height).astype(np.int32)
    return out


def _gathered_blocks(array: jax.Array, marked: Mapping[int, np.ndarray], cap: int) -> dict[tuple[int, int], np.ndarray]:
    """{(r, c): the marked rows of block (r, c), zero-padded to `cap` rows} for the blocks this process holds,
    gathered on the device holding each."""
    block = array.sharding.shard_shape(array.shape)
    out = {}
    for shard in array.addressable_shards:
        key = _block_of(shard.index, block)
        if key not in out:
            ids = marked[key[0]] - key[0] * block[0]
            values = np.zeros((cap, *block[1:]), array.dtype)
            values[:len(ids)] = gather_block(shard.data, ids) if len(ids) else 0
            out[key] = values
    return out


def _assemble(shape: tuple[int, ...], sharding, blocks: Mapping[tuple[int, int], np.ndarray]) -> jax.Array:
    """A global array whose block (r, c) is `blocks[(r, c)]` (each process gives the blocks its devices hold)."""
    block = sharding.shard_shape(shape)
    return jax.make_array_from_callback(shape, sharding, lambda index: blocks[_block_of(index, block)])


def delta_blocks(dirty: jax.Array, table: jax.Array, opt: Mapping[str, jax.Array], cap: int, bits: int,
                 optimizer_codes: Mapping[str, str] | None = None) -> dict:
    """One group's part of a multi-process delta: every row block's marked rows padded to `cap` (the most any block
    has), as global arrays placed like the table, so each process writes its blocks: "ids" i32[R cap] (global row
    ids, -1 = padding), "rows" [R cap, d] or quantized per (row, column) block "codes" / "offset" / "scale", and
    "opt" (the fields of `optimizer_codes`, {field: "signed" | "unsigned"}, as 8-bit dynamic "codes" per (row, column)
    block with their "absmax")."""
    marked = dirty_blocks(dirty)
    blocks = dirty.shape[0] // dirty.sharding.shard_shape(dirty.shape)[0]

    def padded(r: int) -> np.ndarray:
        ids = np.full(cap, -1, np.int32)
        ids[:len(marked[r])] = marked[r]
        return ids

    part = {"ids": jax.make_array_from_callback((blocks * cap,), dirty.sharding,
                                                lambda index: padded((index[0].start or 0) // cap))}
    rows = _gathered_blocks(table, marked, cap)
    if bits:
        quantized = {key: quantize.quantize_rows(v, bits) for key, v in rows.items()}
        width = next(iter(quantized.values()))["codes"].shape[1]
        columns = table.shape[1] // table.sharding.shard_shape(table.shape)[1]
        part["codes"] = _assemble((blocks * cap, columns * width), table.sharding,
                                  {k: q["codes"] for k, q in quantized.items()})
        for name in ("offset", "scale"):
            part[name] = _assemble((blocks * cap, columns), digest_sharding(table.sharding),
                                   {k: q[name][:, None] for k, q in quantized.items()})
    else:
        part["rows"] = _assemble((blocks * cap, *table.shape[1:]), table.sharding, rows)
    optimizer_codes = optimizer_codes or {}
    if opt:
        part["opt"] = {}
        for k, v in opt.items():
            gathered = _gathered_blocks(v, marked, cap)
            if k not in optimizer_codes:
                part["opt"][k] = _assemble((blocks * cap, *v.shape[1:]), v.sharding, gathered)
                continue
            quantized = {key: quantize.quantize_state_rows(x, optimizer_codes[k] == "signed")
                         for key, x in gathered.items()}
            columns = v.shape[1] // v.sharding.shard_shape(v.shape)[1]
            part["opt"][k] = {
                "codes": _assemble((blocks * cap, *v.shape[1:]), v.sharding,
                                   {key: q["codes"] for key, q in quantized.items()}),
                "absmax": _assemble((blocks * cap, columns), digest_sharding(v.sharding),
                                    {key: q["absmax"][:, None] for key, q in quantized.items()})}
    return part


def block_values(part: Mapping, bits: int, table: jax.Array) -> dict:
    """{device: the delta's rows for the table block on that device} (dequantized on the host)."""
    if "rows" in part:
        return {b.device: np.asarray(b.data) for b in part["rows"].addressable_shards}
    width = table.sharding.shard_shape(table.shape)[1]
    offset = {b.device: np.asarray(b.data)[:, 0] for b in part["offset"].addressable_shards}
    scale = {b.device: np.asarray(b.data)[:, 0] for b in part["scale"].addressable_shards}
    return {b.device: quantize.dequantize_rows({"codes": np.asarray(b.data), "offset": offset[b.device],
                                                "scale": scale[b.device]}, bits, width)
            for b in part["codes"].addressable_shards}


def state_block_values(part: Mapping, signed: bool) -> dict:
    """{device: a delta's optimizer rows for the block on that device}, dequantized from their dynamic codes."""
    absmax = {b.device: np.asarray(b.data)[:, 0] for b in part["absmax"].addressable_shards}
    return {b.device: quantize.dequantize_state_rows({"codes": np.asarray(b.data), "absmax": absmax[b.device]},
                                                     signed)
            for b in part["codes"].addressable_shards}


def apply_blocks(array: jax.Array, ids: jax.Array, values: Mapping) -> jax.Array:
    """`array` with the rows `ids` (global row ids placed like its rows, -1 = padding) set to `values` ({device:
    the rows for that device's block}), each block updated on its device."""
    marked = {b.device: np.asarray(b.data) for b in ids.addressable_shards}
    out = []
    for shard in array.addressable_shards:
        ids_here = marked[shard.device]
        valid = ids_here >= 0
        local = jax.device_put(ids_here[valid] - (shard.index[0].start or 0), shard.device)
        out.append(shard.data.at[local].set(jax.device_put(values[shard.device][valid], shard.device)))
    return jax.make_array_from_single_device_arrays(array.shape, array.sharding, out)
