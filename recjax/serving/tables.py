"""Serving tables: a trained run's stacked physical tables stored for inference, and `ServingStorage`, the read-only
storage whose lookup gathers the stored rows and dequantizes them inside the compiled step (recjax.placement.serving
composes it with the one-device layout).

Every compression method ends in plain row tables stacked by group (full and hashing tables, QR's quotient and
remainder, MD's blocks, TT's cores, FIITED's chunk pool), so one row format serves all of them; the dense glue (MD
projections, path-based MLPs) stays f32 with the model. Formats, and what a row of a d-wide table costs:

    f32    4 d bytes             the trained rows
    fp16   2 d                   IEEE half, round to nearest; a value beyond fp16's range is an error, not an inf
    bf16   2 d                   bfloat16, round to nearest even, stored as its uint16 bits
    int8   d + 8                 codes u8[d], then the row's scale and bias as f32 (FBGEMM's fused 8-bit rowwise)
    int4   ceil(d / 2) + 4       codes two per byte (the first in the low nibble), then scale and bias as fp16
                                 (FBGEMM's fused N-bit rowwise, "SBHalf")

Row-wise asymmetric quantization (FBGEMM; Eisenman et al. 2022, Check-N-Run, Sec. 5): x_hat = bias + scale * q with
q = clip(round((x - bias) / scale), 0, 2^k - 1), one (scale, bias) per row. int8 takes the row's [min, max] as the
range (FBGEMM's choice: at 255 levels clipping outliers buys nothing). int4 has 15 levels, so its range is chosen per
row among Check-N-Run's clipped candidates [min + a r, max - b r] (a, b in `recjax.quantize.CLIP_RATIOS`, r = max -
min) by least L2 error -- min / max is a candidate, so the search is never worse. In both, the stored bias is
rounded *down* and the scale *up* to the parameter dtype, so the stored range still covers the chosen one and every
value inside it is within scale / 2 of its code (tests/test_serving_tables.py checks these bounds per format).
"""

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from recjax.embedding import EmbeddingCollection, Routes
from recjax.embedding_backend import MemoryUse, Storage
from recjax.quantize import CLIP_RATIOS, best_clipped_range, pack_codes, unpack_codes


@dataclasses.dataclass(frozen=True)
class TableFormat:
    """How a table's rows are stored: `storage` is the numpy dtype of the stored array ([rows, d] for the float
    formats, [rows, row_bytes] of uint8 for the fused integer rows)."""

    name: str
    bits: int = 0  # 8 / 4: fused integer rows; 0: a float format
    param_dtype: type | None = None  # the dtype of a fused row's scale and bias
    storage: type = np.float32

    def row_bytes(self, dim: int) -> int:
        if self.bits:
            return -(-dim * self.bits // 8) + 2 * np.dtype(self.param_dtype).itemsize
        return dim * np.dtype(self.storage).itemsize

    def code_bytes(self, dim: int) -> int:
        return -(-dim * self.bits // 8)


FORMATS = {
    "f32": TableFormat("f32"),
    "fp16": TableFormat("fp16", storage=np.float16),
    "bf16": TableFormat("bf16", storage=np.uint16),  # bfloat16 bits: plain numpy has no bfloat16 to save
    "int8": TableFormat("int8", 8, np.float32, np.uint8),
    "int4": TableFormat("int4", 4, np.float16, np.uint8),
}
_FP16_MAX = float(np.finfo(np.float16).max)
_SEARCH_CHUNK_ROWS = 1024  # int4's range search holds [chunk, 25 candidates, d] float64 at once


def table_format(name: str) -> TableFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown serving table format {name!r}; use one of {list(FORMATS)}")
    return FORMATS[name]


# ------------------------------------------------------------------------------------------------ encode (host)
def _round_down(x: np.ndarray, dtype) -> np.ndarray:
    """The largest `dtype` value <= x (x float64)."""
    y = x.astype(dtype)
    return np.where(y.astype(np.float64) > x, np.nextafter(y, np.asarray(-np.inf, dtype)), y)


def _round_up(x: np.ndarray, dtype) -> np.ndarray:
    y = x.astype(dtype)
    return np.where(y.astype(np.float64) < x, np.nextafter(y, np.asarray(np.inf, dtype)), y)


def _quantize_range(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits: int, dtype
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes (float64, [..., d]), scale and bias ([...], `dtype`) for rows x[..., d] and ranges [lo, hi] (float64)."""
    levels = 2**bits - 1
    bias = _round_down(lo, dtype)
    scale = _round_up((hi - bias.astype(np.float64)) / levels, dtype)
    s = scale.astype(np.float64)
    q = np.clip(np.rint((x - bias.astype(np.float64)[..., None]) / np.where(s > 0, s, 1.0)[..., None]), 0, levels)
    return q, scale, bias


def quantize_fused(x: np.ndarray, bits: int, param_dtype=np.float32, search: bool = False) -> np.ndarray:
    """Rows x f32[N, d] -> fused rows u8[N, ceil(d bits / 8) + 2 * sizeof(param)]: packed codes, scale, bias.

    search=False: the row's [min, max]; True: the best of Check-N-Run's clipped ranges by L2 error (module doc),
    `recjax.quantize.best_clipped_range` in float64 with this format's parameter rounding."""
    x = np.asarray(x, np.float64)
    assert x.ndim == 2, x.shape
    n, d = x.shape
    codes = np.empty((n, d), np.uint8)
    scale = np.empty(n, param_dtype)
    bias = np.empty(n, param_dtype)
    quantize = functools.partial(_quantize_range, bits=bits, dtype=param_dtype)
    for start in range(0, n, _SEARCH_CHUNK_ROWS):
        rows = slice(start, start + _SEARCH_CHUNK_ROWS)
        codes[rows], scale[rows], bias[rows] = best_clipped_range(x[rows], quantize, CLIP_RATIOS if search else (0.0,))
    params = np.stack([scale, bias], axis=1).view(np.uint8).reshape(n, -1)  # little-endian bytes, scale first
    return np.concatenate([pack_codes(codes, bits), params], axis=1)


def encode_table(table: np.ndarray, fmt: str, name: str = "table") -> np.ndarray:
    """A stacked table f32[R, d] stored in format `fmt` (see FORMATS); `name` names it in errors."""
    spec = table_format(fmt)
    table = np.asarray(table, np.float32)
    if not np.all(np.isfinite(table)):
        row = int(np.argwhere(~np.isfinite(table))[0][0])
        raise ValueError(f"table {name}: row {row} holds {table[row][~np.isfinite(table[row])][0]}; a trained table "
                         "must be finite to be served")
    if fmt == "f32":
        return table
    if fmt == "bf16":
        return table.astype(ml_dtypes.bfloat16).view(np.uint16)
    # fp16 values, and int4's fp16 bias / scale, must fit fp16's range (an overflow would serve inf).
    peak = float(np.abs(table).max(initial=0.0))
    span = float((table.max(axis=1) - table.min(axis=1)).max(initial=0.0)) if table.size else 0.0
    if (fmt == "fp16" and peak > _FP16_MAX) or (fmt == "int4" and (peak > _FP16_MAX or span / 15 > _FP16_MAX)):
        raise ValueError(f"table {name}: values up to {peak:.4g} exceed fp16's range ({_FP16_MAX:g}); serve it as "
                         "int8, bf16 or f32")
    if fmt == "fp16":
        return table.astype(np.float16)
    return quantize_fused(table, spec.bits, spec.param_dtype, search=spec.bits < 8)


def group_formats(fmt: str, dims: Mapping[str, int]) -> dict[str, str]:
    """The format each group {name: dim} is stored in when `fmt` is asked for: `fmt`, except that an integer format
    stores a group in fp16 when its fused rows would be larger than fp16 rows. A fused row pays 8 (int8) or 4 (int4)
    bytes of scale and bias whatever its width, so on narrow rows -- MD's small dims, FIITED's chunk pool, thin TT
    cores -- it can cost more than f32 (a 1-wide int8 row: 9 bytes for 4); fp16 is smaller there and more exact."""
    spec = table_format(fmt)
    half = FORMATS["fp16"]
    return {g: "fp16" if spec.bits and spec.row_bytes(int(d)) > half.row_bytes(int(d)) else fmt
            for g, d in dims.items()}


def encode_tables(tables: Mapping[str, np.ndarray], fmt: str) -> dict[str, np.ndarray]:
    """{group: f32[R, d]} -> {group: the stored array}, each group in its `group_formats` format."""
    formats = group_formats(fmt, {g: np.shape(t)[1] for g, t in tables.items()})
    return {g: encode_table(np.asarray(t), formats[g], g) for g, t in tables.items()}


def stored_bytes(stored: Mapping[str, np.ndarray]) -> int:
    return int(sum(np.asarray(a).nbytes for a in stored.values()))


# ---------------------------------------------------------------------------------------------- decode (device)
def decode_rows(stored: jax.Array, fmt: str, dim: int) -> jax.Array:
    """Stored rows [..., row width] (any leading shape: gathered rows) -> f32[..., dim]. Runs inside jit."""
    spec = table_format(fmt)
    if fmt == "f32":
        return stored
    if fmt == "fp16":
        return stored.astype(jnp.float32)
    if fmt == "bf16":
        return jax.lax.bitcast_convert_type(stored, jnp.bfloat16).astype(jnp.float32)
    width = spec.code_bytes(dim)
    size = np.dtype(spec.param_dtype).itemsize
    lead = stored.shape[:-1]
    scale = _param(stored[..., width:width + size], spec.param_dtype)
    bias = _param(stored[..., width + size:width + 2 * size], spec.param_dtype)
    packed = stored[..., :width]
    if spec.bits == 8:
        codes = packed
    else:  # two codes per byte, the first in the low nibble (recjax.quantize.pack_codes)
        codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*lead, 2 * width)[..., :dim]
    return bias[..., None] + scale[..., None] * codes.astype(jnp.float32)


def _param(data: jax.Array, dtype) -> jax.Array:
    """Little-endian bytes u8[..., 4 | 2] -> f32[...] (of an f32 or fp16 parameter).

    The bytes are assembled into one u32 / u16 and bitcast at the same width: a bitcast that drops the byte axis
    (u8[..., 4] -> f32) does not survive `jax.export`'s shape refinement with a symbolic batch dimension."""
    unsigned, floating = (jnp.uint32, jnp.float32) if np.dtype(dtype).itemsize == 4 else (jnp.uint16, jnp.float16)
    word = data[..., 0].astype(unsigned)
    for k in range(1, data.shape[-1]):
        word = word | (data[..., k].astype(unsigned) << (8 * k))
    return jax.lax.bitcast_convert_type(word, floating).astype(jnp.float32)


def decode_table(stored: np.ndarray, fmt: str, dim: int) -> np.ndarray:
    """The f32 rows a stored table serves (numpy, on the host): what the lookup reads."""
    spec = table_format(fmt)
    stored = np.asarray(stored)
    if fmt == "f32":
        return stored
    if fmt == "fp16":
        return stored.astype(np.float32)
    if fmt == "bf16":
        return stored.view(ml_dtypes.bfloat16).astype(np.float32)
    width = spec.code_bytes(dim)
    params = np.ascontiguousarray(stored[:, width:]).view(spec.param_dtype).astype(np.float32)  # [R, 2]
    codes = unpack_codes(stored[:, :width], spec.bits, dim).astype(np.float32)
    return params[:, 1:2] + params[:, 0:1] * codes


# --------------------------------------------------------------------------------------------------- storage
def _in_table(ids: jax.Array, rows: int) -> jax.Array:
    return (ids >= 0) & (ids < rows)


def slot_rows(collection: EmbeddingCollection, routes: Routes) -> dict[str, jax.Array]:
    """The stored row every bag slot of a route without dedup reads, {group: i32[M_g]}: each placement's slots
    flattened, in placement order (padding and skipped ids are outside [0, rows): they read zeros). The order in which
    the one-device layout brings a storage's rows to the device (recjax/placement/layout.py), so rows gathered outside
    the step in this order (recjax/serving/tiered.py) are what a `ServingStorage` with `gathered` rows takes."""
    flat: dict[str, list[jax.Array]] = {g: [] for g in collection.group_rows}
    for name, placed in collection.placements.items():
        for p, slots in zip(placed, routes.features[name].slots, strict=True):
            flat[p.group].append(slots.reshape(-1))
    return {g: jnp.concatenate(parts).astype(jnp.int32) for g, parts in flat.items() if parts}


class ServingStorage(Storage):
    """Read-only tables in a serving format: the forward route (no dedup) gathers the stored rows every bag slot reads,
    decoded to f32 inside the step (`bring`), then the collection's own pooling and glue.

    f32 tables are read in place by the collection's gather, so an f32 export scores exactly as the trainer's
    predict step. `gathered` {group: stored rows}: the step's arrays hold, per group, the stored rows every bag slot
    of the batch reads ([M_g, width] in `slot_rows` order), gathered outside the step -- from a RAM cache and the table
    files (recjax/serving/tiered.py) -- and the ids say which are real rows; every format then decodes, and for f32
    that reads the same rows in the same order as the collection's gather, so the scores are the in-RAM model's.
    Nothing writes a row: train steps are refused."""

    name = "serving"
    read_only = True

    def __init__(self, collection: EmbeddingCollection, groups, fmt: str = "f32",
                 gathered: Mapping[str, int] | None = None):
        super().__init__(collection, groups)
        self.format = table_format(fmt).name  # an unknown name is a ValueError
        self.formats = group_formats(self.format, collection.group_dims)  # what encode_tables stores per group
        self.gathered = None if gathered is None else dict(gathered)
        self.resident = self.format == "f32" and gathered is None

    def rewrite_routes(self, routes, batch, *, train: bool, premade: bool):
        if train:
            raise TypeError("serving tables are read-only: they have no train route")
        return routes

    def bring(self, group, array, ids):
        if self.gathered is not None:  # the array holds the rows the ids read, in their order
            stored, rows = array, self.gathered[group]
        else:
            rows = array.shape[0]
            stored = array.at[jnp.where(_in_table(ids, rows), ids, 0)].get(mode="promise_in_bounds")
        decoded = decode_rows(stored, self.formats[group], self.collection.group_dims[group])
        return jnp.where(_in_table(ids, rows)[:, None], decoded, 0.0)

    def apply(self, group, optimizer, array, state, ids, current, grads, lr, step, kernel, interpret=None):
        raise TypeError("serving tables are read-only: they take no sparse update")

    def scatter_add(self, group, optimizer, array, ids, grads, lr, step):
        raise TypeError("serving tables are read-only: they take no sparse update")

    def memory_use(self, optimizer):
        return MemoryUse()  # not a training placement: nothing is checked against memory

    def rebuilt(self, collection) -> "ServingStorage":
        return ServingStorage(collection, self.groups, self.format, self.gathered)

    def describe(self) -> str:
        return f"serving tables: {self.format}"

    def summary(self) -> dict:
        return {"serving_format": self.format}
