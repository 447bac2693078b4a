"""Row-wise uniform asymmetric k-bit quantization with Check-N-Run's adaptive range search, for checkpoint deltas.

Each row x f32[D] is stored as codes q in [0, 2^k - 1] with its own offset and scale (Eisenman et al. 2022,
"Check-N-Run", Sec. 5: row-wise asymmetric quantization):

    x_hat = offset + scale * q,   q = clip(round((x - lo) / scale), 0, 2^k - 1),   offset = lo,
    scale = (hi - lo) / (2^k - 1)

Plain min/max quantization sets [lo, hi] = [min x, max x]; with few bits an outlier then stretches the step for the
whole row. The adaptive search (Check-N-Run's "adaptive asymmetric quantization") tries shrunken ranges
[min + a * r, max - b * r] (r = max - min) for a, b on a small grid of clipping ratios and keeps, per row, the one
with the least L2 error ||x - x_hat||; a = b = 0 (plain min/max) is on the grid, so the search is never worse.

Codes are packed 8 / k per byte (little end first); offsets and scales are f32.
"""

import numpy as np

BITS = (2, 4, 8)
# Clipping ratios tried at each end of a row's range (a, b in this grid: 5 x 5 candidate ranges).
CLIP_RATIOS = (0.0, 0.05, 0.1, 0.2, 0.3)
_CHUNK_ROWS = 4096  # rows searched at once: the candidate errors are [chunk, 25] while each is [chunk, D]


def quantize_rows(x: np.ndarray, bits: int) -> dict[str, np.ndarray]:
    """x f32[N, D] -> {"codes": u8[N, ceil(D * bits / 8)], "offset": f32[N], "scale": f32[N]}."""
    if bits not in BITS:
        raise ValueError(f"quantize bits must be one of {BITS}, got {bits}")
    x = np.asarray(x, np.float32)
    assert x.ndim == 2, x.shape
    codes = np.empty(x.shape, np.uint8)
    offset = np.empty(x.shape[0], np.float32)
    scale = np.empty(x.shape[0], np.float32)
    for a in range(0, x.shape[0], _CHUNK_ROWS):
        sl = slice(a, a + _CHUNK_ROWS)
        codes[sl], offset[sl], scale[sl] = _search(x[sl], bits)
    return {"codes": pack_codes(codes, bits), "offset": offset, "scale": scale}


def dequantize_rows(quantized: dict[str, np.ndarray], bits: int, dim: int) -> np.ndarray:
    """The inverse of `quantize_rows`: f32[N, dim]."""
    q = unpack_codes(np.asarray(quantized["codes"]), bits, dim).astype(np.float32)
    return (np.asarray(quantized["offset"], np.float32)[:, None]
            + np.asarray(quantized["scale"], np.float32)[:, None] * q).astype(np.float32)


def _codes(x: np.ndarray, lo: np.ndarray, scale: np.ndarray, levels: int) -> np.ndarray:
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.rint((x - lo[..., None]) / safe[..., None]), 0, levels)


def _search(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, the clipped range with the least L2 error; codes u8[n, D], offset f32[n], scale f32[n]."""
    levels = 2**bits - 1
    xmin, xmax = x.min(axis=1), x.max(axis=1)
    span = xmax - xmin
    ratios = np.asarray(CLIP_RATIOS, np.float32)
    a, b = np.meshgrid(ratios, ratios, indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)
    lo = (xmin[:, None] + a[None, :] * span[:, None]).astype(np.float32)  # [n, C]
    hi = (xmax[:, None] - b[None, :] * span[:, None]).astype(np.float32)
    scale = ((hi - lo) / levels).astype(np.float32)
    q = _codes(x[:, None, :], lo, scale, levels)  # [n, C, D]
    err = np.sum((lo[..., None] + scale[..., None] * q - x[:, None, :]) ** 2, axis=-1)  # [n, C]
    best = np.argmin(err, axis=1)  # ties -> the first candidate, plain min/max
    rows = np.arange(x.shape[0])
    return q[rows, best].astype(np.uint8), lo[rows, best], scale[rows, best]


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """u8[N, D] codes < 2^bits -> u8[N, ceil(D * bits / 8)], 8 / bits codes per byte, the first in the low bits."""
    per_byte = 8 // bits
    n, d = codes.shape
    padded = np.zeros((n, -(-d // per_byte) * per_byte), np.uint8)
    padded[:, :d] = codes
    groups = padded.reshape(n, -1, per_byte).astype(np.uint16)
    shifts = (np.arange(per_byte) * bits).astype(np.uint16)
    return np.bitwise_or.reduce(groups << shifts, axis=-1).astype(np.uint8)


def unpack_codes(packed: np.ndarray, bits: int, dim: int) -> np.ndarray:
    per_byte = 8 // bits
    shifts = (np.arange(per_byte) * bits).astype(np.uint8)
    codes = (packed[:, :, None] >> shifts) & np.uint8(2**bits - 1)
    return codes.reshape(packed.shape[0], -1)[:, :dim]


def quantized_row_bytes(dim: int, bits: int) -> int:
    """Bytes per stored row: packed codes plus the f32 offset and scale."""
    return -(-dim * bits // 8) + 8
