"""Serving tables: each format's stored layout and error bound against plain-numpy oracles, and `ServingStorage`'s
lookup (decoded inside the step) against the trainer's lookup of the decoded tables, for every compression method."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import random_batch
from test_train import tiny_config

from recjax import placement
from recjax.data import make_dataset
from recjax.serving.tables import (
    FORMATS,
    decode_rows,
    decode_table,
    encode_table,
    encode_tables,
    group_formats,
    stored_bytes,
)
from recjax.step import init_state, make_predict_step
from recjax.task import build_task


def _table(rows: int = 300, dim: int = 16, seed: int = 0) -> np.ndarray:
    """Rows of the kinds a trained table holds: small uniform, one outlier, a constant row, all zeros, all negative."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-0.05, 0.05, (rows, dim)).astype(np.float32)
    x[1, 3] = 2.5  # an outlier stretching its row's range
    x[2] = 0.125  # constant
    x[3] = 0.0
    x[4] = -np.abs(x[4]) - 1.0
    x[5] = rng.normal(0, 3, dim)
    return x


def _decode(stored: np.ndarray, fmt: str, dim: int) -> np.ndarray:
    return np.asarray(jax.jit(lambda s: decode_rows(s, fmt, dim))(jnp.asarray(stored)))


def _fused_by_hand(row: np.ndarray, bits: int, dim: int) -> tuple[np.ndarray, float, float]:
    """FBGEMM's fused row read byte by byte: codes (int4: the first in the low nibble), then scale, then bias."""
    width = -(-dim * bits // 8)
    if bits == 8:
        codes = row[:dim].astype(np.int64)
        scale, bias = (float(np.frombuffer(row[width + 4 * k:width + 4 * k + 4].tobytes(), "<f4")[0]) for k in (0, 1))
    else:
        codes = np.array([(row[j // 2] >> (4 * (j % 2))) & 0xF for j in range(dim)], np.int64)
        scale, bias = (float(np.frombuffer(row[width + 2 * k:width + 2 * k + 2].tobytes(), "<f2")[0]) for k in (0, 1))
    return codes, scale, bias


def test_row_bytes_per_format():
    dim = 16
    x = _table(dim=dim)
    expected = {"f32": 4 * dim, "fp16": 2 * dim, "bf16": 2 * dim, "int8": dim + 8, "int4": dim // 2 + 4}
    for fmt, row_bytes in expected.items():
        stored = encode_table(x, fmt)
        assert stored.nbytes == x.shape[0] * row_bytes, fmt
        assert FORMATS[fmt].row_bytes(dim) == row_bytes
    assert FORMATS["int4"].row_bytes(15) == 8 + 4  # an odd dim pads its last byte
    assert stored_bytes({"a": encode_table(x, "int8"), "b": encode_table(x[:10], "f32")}) == 300 * 24 + 10 * 64


def test_integer_formats_fall_back_to_fp16_on_narrow_rows():
    """A fused row's scale and bias cost 8 (int8) / 4 (int4) bytes at any width: a group whose fused rows would be
    larger than fp16 rows is stored in fp16, so no format ever stores a group in more bytes than fp16 would."""
    dims = {"d1": 1, "d2": 2, "d3": 3, "d4": 4, "d8": 8, "d9": 9, "d16": 16}
    # By hand: int8 row d + 8 vs fp16 2d -> fp16 while d < 8; int4 row ceil(d / 2) + 4 vs 2d -> fp16 while d < 3.
    assert group_formats("int8", dims) == {"d1": "fp16", "d2": "fp16", "d3": "fp16", "d4": "fp16", "d8": "int8",
                                           "d9": "int8", "d16": "int8"}
    assert group_formats("int4", dims) == {"d1": "fp16", "d2": "fp16", "d3": "int4", "d4": "int4", "d8": "int4",
                                           "d9": "int4", "d16": "int4"}
    for fmt in ("f32", "fp16", "bf16"):
        assert set(group_formats(fmt, dims).values()) == {fmt}
    tables = {g: np.random.default_rng(d).normal(0, 0.1, (40, d)).astype(np.float32) for g, d in dims.items()}
    for fmt in ("int8", "int4"):
        stored = encode_tables(tables, fmt)
        for g, d in dims.items():
            assert stored[g].nbytes == 40 * min(FORMATS[fmt].row_bytes(d), 2 * d), (fmt, g)
            assert stored[g].nbytes <= encode_table(tables[g], "fp16").nbytes
        np.testing.assert_array_equal(stored["d1"], tables["d1"].astype(np.float16))


def test_int8_is_fbgemm_min_max_within_half_a_step():
    x = _table()
    stored = encode_table(x, "int8")
    decoded = _decode(stored, "int8", 16)
    for r in range(x.shape[0]):
        codes, scale, bias = _fused_by_hand(stored[r], 8, 16)
        lo, hi = float(x[r].min()), float(x[r].max())
        assert bias == lo  # an f32 minimum is its own f32
        # The scale covers the range: (max - min) / 255, rounded up to f32 (and no further).
        assert scale >= (hi - lo) / 255 and scale <= np.nextafter(np.float32((hi - lo) / 255), np.float32(np.inf))
        by_hand = np.float32(bias) + np.float32(scale) * codes.astype(np.float32)
        np.testing.assert_allclose(decoded[r], by_hand, rtol=1e-6, atol=1e-7)
        bound = scale / 2 + 4 * np.finfo(np.float32).eps * max(abs(lo), abs(hi))
        assert np.all(np.abs(decoded[r] - x[r]) <= bound), (r, np.abs(decoded[r] - x[r]).max(), bound)
    np.testing.assert_array_equal(decoded[2], x[2])  # a constant row is exact (scale 0)
    np.testing.assert_array_equal(decoded[3], 0.0)
    np.testing.assert_allclose(decode_table(stored, "int8", 16), decoded, rtol=1e-6, atol=1e-7)


def _fp16_min_max_error(row: np.ndarray) -> float:
    """Squared L2 error of plain min / max int4 with fp16 bias rounded down and scale up (the search's first
    candidate), by brute force."""
    bias = np.float16(row.min())
    if float(bias) > float(row.min()):
        bias = np.nextafter(bias, np.float16(-np.inf))
    scale = np.float16((float(row.max()) - float(bias)) / 15)
    if float(scale) < (float(row.max()) - float(bias)) / 15:
        scale = np.nextafter(scale, np.float16(np.inf))
    total = 0.0
    for v in row.astype(np.float64):
        q = min(max(round((v - float(bias)) / float(scale)), 0), 15) if scale > 0 else 0
        total += (float(bias) + float(scale) * q - v) ** 2
    return total


def test_int4_range_search_bounds():
    x = _table()
    stored = encode_table(x, "int4")
    decoded = _decode(stored, "int4", 16)
    for r in range(x.shape[0]):
        codes, scale, bias = _fused_by_hand(stored[r], 4, 16)
        by_hand = np.float32(bias) + np.float32(scale) * codes.astype(np.float32)
        np.testing.assert_allclose(decoded[r], by_hand, rtol=1e-6, atol=1e-7)
        # Inside the stored range every value is within half a step; outside it (clipped) it reads the range's end.
        inside = (x[r] >= bias) & (x[r] <= bias + 15 * scale)
        err = np.abs(decoded[r] - x[r])
        assert np.all(err[inside] <= scale / 2 + 1e-6 * (1 + np.abs(x[r][inside]))), r
        np.testing.assert_allclose(decoded[r][~inside], np.where(x[r][~inside] < bias, bias, bias + 15 * scale),
                                   rtol=1e-6, atol=1e-7)
        # The searched range is never worse than plain min / max.
        assert np.sum((decoded[r].astype(np.float64) - x[r]) ** 2) <= _fp16_min_max_error(x[r]) * (1 + 1e-6) + 1e-12
    # On Gaussian rows clipping the tails pays: measured 21 % of rows better by > 1 %, 5 % less error in all.
    g = np.random.default_rng(1).normal(0, 1, (200, 16)).astype(np.float32)
    searched = np.sum((_decode(encode_table(g, "int4"), "int4", 16).astype(np.float64) - g) ** 2, axis=1)
    plain = np.array([_fp16_min_max_error(row) for row in g])
    assert np.all(searched <= plain * (1 + 1e-6) + 1e-12)
    assert np.mean(searched < 0.99 * plain) > 0.1 and searched.sum() < 0.97 * plain.sum()


def test_float_formats_round_to_nearest():
    x = _table()
    half = encode_table(x, "fp16")
    np.testing.assert_array_equal(_decode(half, "fp16", 16), x.astype(np.float16).astype(np.float32))
    normal = np.abs(x) >= np.finfo(np.float16).tiny
    assert np.all(np.abs(_decode(half, "fp16", 16) - x)[normal] <= 2.0**-11 * np.abs(x)[normal])
    # bfloat16 by integer arithmetic on the f32 bits: round to nearest, ties to even.
    bits = x.view(np.uint32).astype(np.uint64)
    expected = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    brain = encode_table(x, "bf16")
    np.testing.assert_array_equal(brain, expected)
    decoded = _decode(brain, "bf16", 16)
    np.testing.assert_array_equal(decoded, (expected.astype(np.uint32) << 16).view(np.float32))
    assert np.all(np.abs(decoded - x) <= 2.0**-8 * np.abs(x))  # 8 significant bits: unit roundoff 2^-8
    np.testing.assert_array_equal(decode_table(brain, "bf16", 16), decoded)


def test_bad_tables_are_refused_naming_them():
    x = _table()
    x[7, 0] = 7e4
    with pytest.raises(ValueError, match="table dim16: values up to 7e\\+04 exceed fp16's range"):
        encode_table(x, "fp16", "dim16")
    with pytest.raises(ValueError, match="exceed fp16's range"):
        encode_table(x, "int4", "dim16")
    encode_table(x, "int8")  # int8's f32 scale and bias hold it
    x[9, 2] = np.nan
    with pytest.raises(ValueError, match="table t: row 9 holds nan"):
        encode_table(x, "bf16", "t")
    with pytest.raises(ValueError, match="unknown serving table format 'int3'"):
        encode_table(x, "int3")


# ------------------------------------------------------------------------------------- the lookup, every method
# One model with a different method on each table (compiling a model per method and format took 11 minutes).
TABLES = {
    "C1": {"method": "hashing", "options": {"collisions": 4, "sign": True}},
    "C2": {"method": "qr_path", "options": {"collisions": 4, "hidden": 4}},  # combines per id, then pools
    "C3": {"method": "tt", "options": {"rank": 4}},
    "C4": {"method": "qr", "options": {"collisions": 3, "op": "mult"}},
    "C5": {"method": "md_blocks", "options": {"blocks": (0.1, 1.0)}},
    "C6": {"method": "fiited", "options": {"keep": 0.5, "chunks": 4}},
}


def _task(tables: dict | None = None):
    config = tiny_config(20)
    config.data.bag_sizes = (1, 3, 1, 2, 1, 2)  # multi-hot bags exercise pooling and padding
    config.embedding.tables = ml_collections.ConfigDict(TABLES if tables is None else tables)
    config.embedding.id_counts = "dataset"  # md_blocks' frequency blocks
    # XLA's lookups, as the serving exports have (recjax/serving/export.py scoring_function) and as "auto" lowers on a
    # CPU (test_kernel_dispatch: test_auto_is_the_xla_path_on_cpu): "auto" would also trace the Pallas TPU and GPU
    # kernels of all 30-odd lookups in this model for lowerings that never come.
    config.embedding.kernel = "xla"
    dataset = make_dataset(config.data, seed=0)
    return build_task(config, dataset.spec, dataset, 20)


def test_serving_lookup_equals_the_trainer_on_decoded_tables():
    """For each format, scores through serving tables (stored rows decoded inside the step) equal the trainer's
    predict step on the tables decoded on the host, with hashing, QR, path-based QR, TT, MD blocks and FIITED tables
    in one model; f32 equals the trainer's own scores bit for bit."""
    task = _task()
    assert sorted(m.spec.method for m in task.collection.methods.values()) == sorted(
        t["method"] for t in TABLES.values())
    batch = random_batch(task.spec, 32, seed=3)
    state = init_state(task, jax.random.key(1), batch)
    # Trained-looking tables: spread the rows so quantization is not trivially exact.
    tables = {g: np.asarray(t) * 3.0 for g, t in state.tables.items()}
    state = state.replace(tables={g: jnp.asarray(t) for g, t in tables.items()})
    predict = make_predict_step(task)  # one compile: the oracle's tables differ in values only
    trainer = np.asarray(predict(state, batch))
    for fmt in FORMATS:
        stored = encode_tables(tables, fmt)
        served = np.asarray(make_predict_step(task, placement.serving(task.collection, fmt))(
            state.replace(tables={g: jnp.asarray(s) for g, s in stored.items()}), batch))
        formats = group_formats(fmt, task.collection.group_dims)
        oracle = np.asarray(predict(state.replace(tables={
            g: jnp.asarray(decode_table(s, formats[g], task.collection.group_dims[g])) for g, s in stored.items()}),
            batch))
        if fmt == "f32":
            np.testing.assert_array_equal(served, trainer)
        np.testing.assert_allclose(served, oracle, rtol=1e-5, atol=1e-6, err_msg=fmt)
        assert fmt == "f32" or not np.array_equal(oracle, trainer), fmt  # the format changed something


def test_serving_backend_is_read_only():
    task = _task({})
    backend = placement.serving(task.collection, "int8")
    with pytest.raises(TypeError, match="read-only"):
        backend.compile_train(lambda s, b: (s, {}), None)
    with pytest.raises(TypeError, match="read-only"):
        backend.route(random_batch(task.spec, 2), {}, train=True)
    with pytest.raises(ValueError, match="unknown serving table format"):
        placement.serving(task.collection, "int2")
