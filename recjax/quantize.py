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


def best_clipped_range(x: np.ndarray, quantize, ratios=CLIP_RATIOS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check-N-Run's adaptive range search over rows x[n, D], in x's dtype: per row the candidate range
    [min + a r, max - b r] (a, b in `ratios`) whose codes reconstruct the row with the least L2 error (ties: the
    first candidate, plain min / max when 0 leads `ratios`). `quantize(x[n, 1, D], lo[n, C], hi[n, C])` gives each
    candidate's (codes [n, C, D], scale [n, C], offset [n, C]) in the caller's parameter dtype and rounding (the
    checkpoint deltas' f32 below, the serving tables' fp16 / f32 bounds in recjax/serving/tables.py); the error is
    measured in x's dtype. Returns the chosen (codes [n, D], scale [n], offset [n])."""
    ratios = np.asarray(ratios, x.dtype)
    a, b = (r.reshape(-1) for r in np.meshgrid(ratios, ratios, indexing="ij"))
    xmin, xmax = x.min(axis=1), x.max(axis=1)
    span = xmax - xmin
    lo = xmin[:, None] + a[None, :] * span[:, None]  # [n, C]
    hi = xmax[:, None] - b[None, :] * span[:, None]
    q, scale, offset = quantize(x[:, None, :], lo, hi)
    err = np.sum((offset.astype(x.dtype)[..., None] + scale.astype(x.dtype)[..., None] * q - x[:, None, :]) ** 2,
                 axis=-1)  # [n, C]
    best = np.argmin(err, axis=1)
    rows = np.arange(x.shape[0])
    return q[rows, best], scale[rows, best], offset[rows, best]


def _search(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, the clipped range with the least L2 error (f32 arithmetic); codes u8[n, D], offset f32[n],
    scale f32[n]."""
    levels = 2**bits - 1

    def quantize(rows, lo, hi):
        lo, hi = lo.astype(np.float32), hi.astype(np.float32)
        scale = ((hi - lo) / levels).astype(np.float32)
        return _codes(rows, lo, scale, levels), scale, lo

    q, scale, offset = best_clipped_range(x, quantize)
    return q.astype(np.uint8), offset, scale


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


# ------------------------------------------------------------------------------------ optimizer state rows
# Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization": each block of a state tensor is divided by its
# absolute maximum and every value stored as the index of the nearest entry of a 256-value *dynamic* code (Sec. 2).
# A delta's unit is the row, so a block here is one row's state (D values, one f32 absmax): a row-wise asymmetric
# linear code (above) fits table rows, but Adam's moments and Adagrad's accumulators span decades within a row.
STATE_BITS = (8,)


def dynamic_code(signed: bool) -> np.ndarray:
    """The 8-bit dynamic tree code (Dettmers 2016; Dettmers et al. 2022, Sec. 2.2), ascending, f64: after the sign bit
    (signed only), e zero bits give the decade 10^-e, a one bit ends them, and the f remaining bits are a linear
    fraction in (0.1, 1]: the value is 10^-e (0.1 + 0.9 k / 2^f), k = 1..2^f; the code of all zeros is 0. Large values
    keep ~2-3 significant digits and values down to 10^-6 (signed) or 10^-7 (unsigned: the sign bit becomes one more
    decade, for non-negative state) of the block's maximum stay non-zero, where an 8-bit linear code would round
    everything below 1/255 of it to 0. 255 values signed (+0 and -0 are one), 256 unsigned; 1 is exact."""
    magnitude_bits = 7 if signed else 8
    positive = np.concatenate([10.0**-e * (0.1 + 0.9 * np.arange(1, 2**f + 1) / 2**f)
                               for e, f in ((e, magnitude_bits - 1 - e) for e in range(magnitude_bits))])
    positive = np.sort(positive)
    return np.concatenate([-positive[::-1], [0.0], positive]) if signed else np.concatenate([[0.0], positive])


def quantize_state_rows(x: np.ndarray, signed: bool) -> dict[str, np.ndarray]:
    """x f32[N, D] -> {"codes": u8[N, D] (indices into `dynamic_code(signed)`), "absmax": f32[N]}: each row
    divided by its absolute maximum, each value the nearest code -- except that the unsigned code never rounds a
    positive value to 0 (it takes the smallest positive code): Adam's v and Adagrad's accumulator are under a square
    root in the update's denominator, and a 0 there would make the row's next step lr * m / eps."""
    x = np.asarray(x, np.float32)
    assert x.ndim == 2, x.shape
    if not signed and np.any(x < 0):
        raise ValueError("the unsigned dynamic code holds non-negative state only; quantize signed state with "
                         "signed=True")
    code = dynamic_code(signed)
    absmax = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(len(x), np.float32)
    scaled = x.astype(np.float64) / np.where(absmax > 0, absmax, 1.0)[:, None]
    codes = np.searchsorted((code[1:] + code[:-1]) / 2, scaled)  # the nearest code (a tie: the lower one)
    if not signed:
        codes = np.where((x > 0) & (codes == 0), 1, codes)
    return {"codes": codes.astype(np.uint8), "absmax": absmax.astype(np.float32)}


def dequantize_state_rows(quantized: dict[str, np.ndarray], signed: bool) -> np.ndarray:
    """The inverse of `quantize_state_rows`: f32[N, D]."""
    code = dynamic_code(signed)
    absmax = np.asarray(quantized["absmax"], np.float64)
    return (code[np.asarray(quantized["codes"])] * absmax[:, None]).astype(np.float32)
