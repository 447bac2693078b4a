r"""CSV / Parquet / libSVM files -> parsed chunks (labels, dense values, raw sparse keys), for recjax/data/tabular.py.

Each reader cuts its files into *units* in the main thread (`units`: text blocks of whole lines, or Parquet record
batches) and parses a unit on a worker thread (`parse_unit`) into a `ParsedChunk` of the unit's good rows and a
`textio.BlockReport` of its blank and bad lines. Everything per value is vectorised (numpy, pyarrow compute); the
only Python loops are over columns, word positions and the first few bad lines' reasons.

CSV (plain or gzip, any single-character delimiter, '"' quotes with "" escapes)
    A block of whole lines (textio) is checked line by line with numpy -- a line ends in '\n' and every '\r' right
    before it ("\r\r\n" too: a CRLF file converted to CRLF again), blank lines (nothing else) are counted, a stray
    '\r' or an odd number of '"' is a bad line (a record cannot span lines: a quoted newline leaves an unterminated
    quote on both halves) -- and the remaining lines are parsed by
    `pyarrow.csv.read_csv(..., use_threads=False)`, whose `invalid_row_handler` reports rows with the wrong field
    count. Measured with pyarrow 26: `row.number` is 1-based among the non-blank lines handed to the reader (not
    the physical line; None with threads), so it is mapped back to the physical line, and the row's text is checked
    against that line. Label and dense columns are read as float64 (pyarrow's fast
    converter, its null markers but the NaN spellings, `MISSING_MARKERS`, meaning missing; "nan" reads as NaN, which
    `data.dense.nan` imputes or skips); if a cell is not a number, pyarrow fails the whole
    block and the block is read again with every column as bytes, the bad cells found vectorised (`_numbers`).
    Sparse and time columns are read as bytes. A file's first line is its header (`csv.header`), a UTF-8 BOM is
    dropped; without a header, columns are named by `csv.column_names` or by position ("0", "1", ...), the column
    count being the first line's.
Parquet
    Record batches of `parquet_batch_rows` rows of the needed columns; bad rows are reported as "row N" (1-based).
    Numeric columns are used as they are; string columns are converted like CSV cells.
libSVM / libFM / libFFM (plain or gzip)
    "label idx:val idx:val ..." (or "label field:idx:val ..." with `libsvm_fields="ffm"`), separated by spaces or
    tabs. Tokens are found with numpy (separator masks), indices parsed with vectorised digit arithmetic (at most 18
    digits), values "0"/"1" recognised directly and any other value converted by pyarrow.

Keys (`recjax/data/vocabulary.py`): a CSV/Parquet value's raw key is `string_keys` of its UTF-8 bytes, computed for
each block's distinct values only (`pyarrow.compute.dictionary_encode` finds them and each row's position among
them). Parquet integer columns are hashed through their decimal text, so "12" is the same value in CSV and Parquet
(floats through Arrow's shortest text, 1.0 -> "1", booleans as "true"/"false"). An empty cell, a null and "" are
the missing value, whose key `MISSING_STRING_KEY` = key of b"" is an ordinary category. A multi-valued cell is split
at the separator; empty items are dropped, so an empty cell is an empty bag. A libSVM index is its own raw key
(0 <= idx < 10**18); an absent field of a positional or ffm line has the key `MISSING_INDEX_KEY` = 2**63 - 1.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from recjax.data.textio import (
    MAX_LINE_BYTES,
    MAX_REPORTED,
    BlockReport,
    ByteReader,
    FileSlice,
    TextBlock,
    blocks_of,
    show_value,
)
from recjax.data.vocabulary import string_key, string_keys
from recjax.errors import DataError

MISSING_STRING_KEY = string_key(b"")  # an empty / null CSV or Parquet cell
MISSING_INDEX_KEY = 2**63 - 1  # an absent libSVM field (indices have at most 18 digits)
NULL_MARKERS = tuple(pa_csv.ConvertOptions().null_values)  # pyarrow's: "", "NA", "NULL", "nan", "N/A", ...
# Of those, the spellings of NaN (C's "nan", MSVC's "1.#QNAN" / "1.#IND") are NaN cells, which data.dense.nan decides
# about; the others ("", "NA", "NULL", "N/A", ...) say the value is missing.
NAN_MARKERS = tuple(m for m in NULL_MARKERS if re.fullmatch(r"(?i)[+-]?(nan|1\.#(qnan|ind))", m))
MISSING_MARKERS = tuple(m for m in NULL_MARKERS if m not in NAN_MARKERS)
LABEL_VALUES = 20  # distinct label values counted per chunk and in the summary (the most frequent)
DENSE_NAN = ("impute", "skip")  # data.dense.nan: a NaN dense cell is data.dense.missing (counted), or a bad line
DENSE_STEPS = ("clip", "log1p", "standardise")  # the transform chain, in the order it is applied
MAX_INDEX_DIGITS = 18  # libSVM indices: 10**18 - 1 < 2**63 - 1
_BOM = b"\xef\xbb\xbf"
_NL, _CR, _QUOTE, _SPACE, _TABC, _COLON = (ord(c) for c in "\n\r\" \t:")
# A superset of the float grammar of pyarrow's converter (fast_float): cells outside it are not numbers; cells inside
# it are still converted by pyarrow, which has the last word.
_FLOAT_PATTERN = r"(?i)^[+-]?(([0-9]+\.?[0-9]*|\.[0-9]+)(e[+-]?[0-9]+)?|inf|infinity|nan)$"


# ----------------------------------------------------------------------------------------------------------------------
# What to read, and what comes out
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DenseColumn:
    """A dense feature: its column (CSV/Parquet) or libSVM index, and its transform steps (a subset of DENSE_STEPS
    in that order; "standardise" is applied later, with the train split's statistics)."""

    name: str
    steps: tuple[str, ...] = ()
    index: int | None = None  # libSVM: the index whose value this is


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """Everything a reader needs, resolved from `TabularOptions` (see recjax/data/tabular.py for each field)."""

    format: str  # "csv", "parquet" or "libsvm"
    label: str = "label"
    label_threshold: float = 0.5
    positive_values: tuple[str, ...] = ()
    dense: tuple[DenseColumn, ...] = ()
    clip_min: float | None = None
    clip_max: float | None = None
    missing: float = 0.0
    nan: str = "impute"  # a NaN dense cell: "impute" (the missing value, counted) or "skip" (a bad line)
    sparse: tuple[str, ...] = ()
    multi_valued: frozenset[str] = frozenset()
    separator: str = "|"
    max_bag_size: int = 0
    time_column: str | None = None
    delimiter: str = ","
    header: bool = True
    column_names: tuple[str, ...] = ()
    libsvm_fields: str = "positional"
    chunk_bytes: int = 4 << 20
    parquet_batch_rows: int = 16384

    @property
    def columns(self) -> tuple[str, ...]:
        """The CSV/Parquet columns to read, each once: label, dense, sparse, time."""
        names = [self.label] + [d.name for d in self.dense] + list(self.sparse)
        if self.time_column:
            names.append(self.time_column)
        return tuple(dict.fromkeys(names))

    @property
    def dense_indices(self) -> dict[int, int]:
        """libSVM: dense index -> its column in the dense matrix."""
        return {d.index: j for j, d in enumerate(self.dense)}


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays
class SparseValues:
    """One sparse feature of a chunk: value v of the chunk is keys[inverse[v]].

    keys: i64[u] distinct raw keys (any order); inverse: i32[m]; lengths: i32[n] values per row (bags), None for a
    one-hot feature (m == n); truncated: bags cut to `max_bag_size`.
    """

    keys: np.ndarray
    inverse: np.ndarray
    lengths: np.ndarray | None = None
    truncated: int = 0

    @property
    def max_length(self) -> int:
        if self.lengths is None:
            return 1
        return int(self.lengths.max()) if self.lengths.size else 0


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays
class ParsedChunk:
    """The good rows of one unit, before vocabularies and standardisation.

    positions: i64[n] 1-based line (text) or row (Parquet) numbers in `path`; labels: f32[n] in {0, 1};
    dense: f32[n, D] (missing -> plan.missing, then clip / log1p); dense_missing / dense_nan: i64[D] the rows' cells
    that were missing / NaN (and imputed) per column; label_values: {the label's text: rows} of the rows (the
    LABEL_VALUES most frequent); unknown_labels: {text: lines} of the labels that are not numbers (threshold mode;
    those lines are left out, and preparing stops), the first at position unknown_label_at; time: f64[n] or None
    (numbers as they are,
    ISO-8601 as unix seconds); time_numeric_at / time_iso_at: the first position holding each kind of time value
    (a column must not mix them); sparse: {feature: SparseValues} (ffm: only the fields the unit has).
    """

    path: str
    file_index: int
    positions: np.ndarray
    labels: np.ndarray
    dense: np.ndarray
    time: np.ndarray | None
    sparse: dict[str, SparseValues]
    time_numeric_at: int | None = None
    time_iso_at: int | None = None
    dense_missing: np.ndarray | None = None
    dense_nan: np.ndarray | None = None
    label_values: dict[str, int] = dataclasses.field(default_factory=dict)
    unknown_labels: dict[str, int] = dataclasses.field(default_factory=dict)
    unknown_label_at: int | None = None

    def __post_init__(self):
        columns = self.dense.shape[1]
        for name in ("dense_missing", "dense_nan"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros(columns, np.int64))

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])


def _empty_chunk(path: str, file_index: int, plan: ReadPlan) -> ParsedChunk:
    return ParsedChunk(path, file_index, np.zeros(0, np.int64), np.zeros(0, np.float32),
                       np.zeros((0, len(plan.dense)), np.float32),
                       np.zeros(0, np.float64) if plan.time_column else None, {})


# ----------------------------------------------------------------------------------------------------------------------
# Arrow helpers
# ----------------------------------------------------------------------------------------------------------------------


def _one_array(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(column, pa.ChunkedArray):
        return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return column


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or \
        pa.types.is_large_binary(t)


def _decoded(array: pa.Array) -> pa.Array:
    return array.dictionary_decode() if pa.types.is_dictionary(array.type) else array


def _as_bytes(array: pa.Array) -> pa.Array:
    """Any column as binary values, nulls kept: text as it is, other types through their Arrow string form."""
    array = _decoded(array)
    if pa.types.is_binary(array.type) or pa.types.is_large_binary(array.type):
        return array
    if not _is_text(array.type):
        array = pc.cast(array, pa.string())
    return pc.cast(array, pa.large_binary() if pa.types.is_large_string(array.type) else pa.binary())


def _offsets_and_data(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A binary / string array's value bounds i64[n + 1] (into the data buffer) and data u8[m]."""
    _, offsets, data = array.buffers()[:3]
    width = np.int64 if pa.types.is_large_binary(array.type) or pa.types.is_large_string(array.type) else np.int32
    bounds = np.frombuffer(offsets, width, len(array) + 1, array.offset * np.dtype(width).itemsize)
    return bounds.astype(np.int64), (np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8))


def _cast_each(array: pa.Array, to: pa.DataType) -> tuple[pa.Array, np.ndarray]:
    """Cast what converts: (values, null where the cast failed; ok bool[n]). pyarrow fails a cast as a whole, so
    failures are found by bisection -- a few casts per bad value, a single cast when there is none."""
    n = len(array)
    try:
        return pc.cast(array, to), np.ones(n, bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        if n == 1:
            return pa.nulls(1, to), np.zeros(1, bool)
    half = n // 2
    a, ok_a = _cast_each(array.slice(0, half), to)
    b, ok_b = _cast_each(array.slice(half), to)
    return pa.concat_arrays([a, b]), np.concatenate([ok_a, ok_b])


def _float_numpy(array: pa.Array) -> np.ndarray:
    """f64[n], NaN where null."""
    return pc.cast(array, pa.float64()).to_numpy(zero_copy_only=False)


def _text(array: pa.Array, i: int) -> str:
    value = array[int(i)].as_py()
    return show_value(value if isinstance(value, bytes | str) else str(value))


def _numbers(array: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A column as numbers: (values f64[n], missing bool[n], not_a_number bool[n], nan bool[n]); values are NaN
    where missing, NaN or not a number.

    Missing: null, or (text) one of `MISSING_MARKERS` ("", "NA", "NULL", ...). NaN: a NaN value, (text) one of
    `NAN_MARKERS`, or any text that converts to NaN ("NAN", "+nan"). Text cells are converted as pyarrow's CSV reader
    converts them (the fast path of `parse_csv`), so a block gives the same values whichever path read it:
    surrounding spaces and tabs are ignored.
    """
    array = _decoded(array)
    n = len(array)
    t = array.type
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t):
        values = _float_numpy(array)
        null = pc.is_null(array).to_numpy(zero_copy_only=False)
        return values, null, np.zeros(n, bool), np.isnan(values) & ~null
    if not _is_text(t):
        raise TypeError(f"has Arrow type {t}, not numbers or text")
    raw = _as_bytes(array)
    markers = pa.array([m.encode() for m in MISSING_MARKERS], raw.type)
    missing = pc.or_(pc.is_null(raw), pc.is_in(raw, value_set=markers)).to_numpy(zero_copy_only=False)
    nan = pc.is_in(raw, value_set=pa.array([m.encode() for m in NAN_MARKERS], raw.type)).to_numpy(
        zero_copy_only=False) & ~missing
    values = np.full(n, np.nan)
    converted = np.zeros(n, bool)
    candidate = np.flatnonzero(~missing & ~nan & pc.match_substring_regex(raw, _FLOAT_PATTERN).to_numpy(
        zero_copy_only=False))
    if candidate.size:
        numbers, ok = _cast_each(raw.take(candidate), pa.float64())
        values[candidate] = _float_numpy(numbers)
        converted[candidate] = ok
    spaced = np.flatnonzero(~missing & ~nan & ~converted & pc.match_substring_regex(raw, r"^[ \t]|[ \t]$").to_numpy(
        zero_copy_only=False))
    for i in spaced:  # rare: cells with surrounding blanks, which pyarrow's CSV converter trims
        stripped = raw[int(i)].as_py().strip(b" \t")
        numbers, ok = _cast_each(pa.array([stripped], pa.binary()), pa.float64())
        if ok[0]:
            values[i], converted[i] = _float_numpy(numbers)[0], True
    nan |= converted & np.isnan(values)
    return values, missing, ~missing & ~nan & ~converted, nan


# ----------------------------------------------------------------------------------------------------------------------
# Columns -> chunk (CSV and Parquet share this)
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Check:
    """Rows failing one check, and the reason of a failing row (computed only for the reported ones)."""

    bad: np.ndarray
    explain: Callable[[int], str]


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays
class _LabelColumn:
    """A label column read: labels f32[n] in {0, 1}; the checks that make a row's label bad (empty, NaN, infinite);
    unknown bool[n]: (threshold mode) a label that is not a number -- no bad line, since the label column's values are
    a setting to fix rather than a broken line: the rows are left out and preparing stops once every file is read,
    listing the values (tabular.py); numbers f64[n] (threshold mode) or raw bytes (positive_values) to count values."""

    labels: np.ndarray
    checks: list[_Check]
    unknown: np.ndarray
    numbers: np.ndarray | None = None
    raw: pa.Array | None = None

    def value_counts(self, rows: np.ndarray) -> dict[str, int]:
        """{the label's text: rows} among `rows` (bool[n]), the LABEL_VALUES most frequent (numbers as %g)."""
        if self.numbers is not None:
            values, counts = np.unique(self.numbers[rows], return_counts=True)
            top = np.argsort(-counts, kind="stable")[:LABEL_VALUES]
            return {f"{values[k]:g}": int(counts[k]) for k in top}
        return _text_counts(self.raw, rows)

    def unknown_counts(self) -> dict[str, int]:
        return _text_counts(self.raw, self.unknown) if self.unknown.any() else {}


def _text_counts(raw: pa.Array, rows: np.ndarray) -> dict[str, int]:
    counted = pc.value_counts(raw.filter(pa.array(rows)))
    values, counts = counted.field("values").to_pylist(), counted.field("counts").to_numpy(zero_copy_only=False)
    top = np.argsort(-counts, kind="stable")[:LABEL_VALUES]
    return {(values[k] or b"").decode("utf-8", "replace"): int(counts[k]) for k in top}


def _label_column(array: pa.Array, plan: ReadPlan, name: str | None = None) -> _LabelColumn:
    """The labels and their checks. name: how messages call the label."""
    name = name or f"label column '{plan.label}'"
    n = len(array)
    raw = _as_bytes(array)
    if plan.positive_values:
        empty = pc.or_(pc.is_null(raw), pc.equal(pc.binary_length(raw), 0)).to_numpy(zero_copy_only=False)
        positive = pc.is_in(raw, value_set=pa.array([v.encode() for v in plan.positive_values], raw.type))
        labels = positive.to_numpy(zero_copy_only=False).astype(np.float32)
        return _LabelColumn(labels, [_Check(empty, lambda i: f"{name} is empty")], np.zeros(n, bool), raw=raw)
    try:
        values, missing, not_number, nan = _numbers(array)
    except TypeError as error:
        raise DataError(f"{name} {error}; set data.label.positive_values to the values that mean "
                         "a click") from None
    infinite = np.isinf(values)
    labels = (np.nan_to_num(values, nan=-np.inf) >= plan.label_threshold).astype(np.float32)
    return _LabelColumn(labels, [
        _Check(missing, lambda i: f"{name} is empty"),
        _Check(nan, lambda i: f"{name} = {_text(array, i)} is NaN"),
        _Check(infinite, lambda i: f"{name} = {_text(array, i)} is not finite"),
    ], not_number, numbers=values, raw=raw)


def transform_dense(values: np.ndarray, column: DenseColumn, plan: ReadPlan) -> tuple[np.ndarray, np.ndarray]:
    """Raw values f64[n] (NaN = missing) -> (clip / log1p applied, f64[n]; bad_log1p bool[n]: values <= -1 before
    log1p, which has no finite result there)."""
    values = np.where(np.isnan(values), plan.missing, values)
    if "clip" in column.steps:
        values = np.clip(values, plan.clip_min if plan.clip_min is not None else -np.inf,
                         plan.clip_max if plan.clip_max is not None else np.inf)
    bad_log = np.zeros(values.shape, bool)
    if "log1p" in column.steps:
        bad_log = values <= -1
        values = np.log1p(np.where(bad_log, 0.0, values))
    return values, bad_log


def nan_reason(shown: str, plan: ReadPlan) -> str:
    """Why a NaN dense value makes its line bad (data.dense.nan = "skip")."""
    return (f"{shown} is NaN (data.dense.nan='skip'; 'impute' replaces NaN by data.dense.missing = {plan.missing:g} "
            "and counts it)")


def _dense_checks(arrays: Sequence[pa.Array], plan: ReadPlan, n: int
                  ) -> tuple[np.ndarray, list[_Check], np.ndarray, np.ndarray]:
    """dense f32[n, D] (missing -- and, with plan.nan "impute", NaN -- imputed, clip / log1p applied), the checks
    that make a row's dense values bad, and which cells were missing / NaN (bool[n, D] each)."""
    dense = np.zeros((n, len(plan.dense)), np.float32)
    missing_cells = np.zeros((n, len(plan.dense)), bool)
    nan_cells = np.zeros((n, len(plan.dense)), bool)
    checks = []
    for j, (column, array) in enumerate(zip(plan.dense, arrays, strict=True)):
        try:
            values, missing, not_number, nan = _numbers(array)
        except TypeError as error:
            raise DataError(f"dense column '{column.name}' {error}; list it in data.sparse.columns if it is "
                             "categorical") from None
        infinite = np.isinf(values)
        values, bad_log = transform_dense(np.where(infinite, np.nan, values), column, plan)
        dense[:, j] = values
        missing_cells[:, j], nan_cells[:, j] = missing, nan
        name = column.name

        def shown(i, array=array):
            return _text(array, i)

        checks += [
            _Check(not_number, lambda i, name=name, shown=shown: f"column '{name}' = {shown(i)} is not a number"),
            _Check(nan if plan.nan == "skip" else np.zeros(n, bool),
                   lambda i, name=name, shown=shown: nan_reason(f"column '{name}' = {shown(i)}", plan)),
            _Check(infinite, lambda i, name=name, shown=shown: f"column '{name}' = {shown(i)} is infinite"),
            _Check(bad_log, lambda i, name=name, shown=shown: (
                f"column '{name}' = {shown(i)}: log1p needs values > -1 (after clip; the missing value is "
                f"{plan.missing}); set data.dense.clip_min or drop log1p for this column")),
        ]
    return dense, checks, missing_cells, nan_cells


def time_values(array: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A time column -> (values f64[n]: numbers as they are, dates/times as unix seconds; missing bool[n];
    unparsable bool[n]; iso bool[n]: the value was a date/time)."""
    array = _decoded(array)
    t = array.type
    n = len(array)
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        ns = pc.cast(pc.cast(array, pa.timestamp("ns", t.tz if pa.types.is_timestamp(t) else None)), pa.int64())
        values = ns.to_numpy(zero_copy_only=False).astype(np.float64) / 1e9
        missing = pc.is_null(array).to_numpy(zero_copy_only=False)
        values[missing] = np.nan
        return values, missing, np.zeros(n, bool), ~missing
    values, missing, not_number, nan = _numbers(array)
    missing |= nan  # no instant
    iso = np.zeros(n, bool)
    rows = np.flatnonzero(not_number)
    if rows.size:
        strings, ok = _cast_each(_as_bytes(array).take(rows), pa.string())  # invalid UTF-8 is no date
        rows, strings = rows[ok], strings.filter(pa.array(ok))
        for tz in (None, "UTC"):  # naive ISO-8601, then with a "Z" / "+hh:mm" offset
            if not rows.size:
                break
            stamps, ok = _cast_each(strings, pa.timestamp("ns", tz))
            ns = pc.cast(pc.fill_null(stamps, 0), pa.int64()).to_numpy(zero_copy_only=False)
            values[rows[ok]] = ns[ok] / 1e9
            iso[rows[ok]] = True
            rows, strings = rows[~ok], strings.filter(pa.array(~ok))
    return values, missing, not_number & ~iso, iso


def _time_checks(array: pa.Array, name: str) -> tuple[np.ndarray, np.ndarray, list[_Check]]:
    try:
        values, missing, unparsable, iso = time_values(array)
    except TypeError as error:
        raise DataError(f"time column '{name}' {error}; data.split.time_column needs numbers or ISO-8601 "
                         "dates/times") from None
    return values, iso, [
        _Check(missing, lambda i: f"time column '{name}' is empty"),
        _Check(unparsable, lambda i: f"time column '{name}' = {_text(array, i)} is neither a number nor an "
                                     "ISO-8601 date/time"),
    ]


def _dictionary_keys(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Values (any type; a dictionary array is used as it is) -> (raw keys i64[u] of the distinct values, inverse
    i32[m]): only the distinct values are hashed. Nulls are the missing value ""."""
    if not (pa.types.is_dictionary(values.type) and values.null_count == 0 and values.dictionary.null_count == 0):
        values = pc.dictionary_encode(pc.fill_null(_as_bytes(values), b""))
    offsets, data = _offsets_and_data(_as_bytes(values.dictionary))
    return string_keys(offsets, data), values.indices.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)


def bag_positions(lengths: np.ndarray) -> np.ndarray:
    """Lengths i32[n] of consecutive bags -> each value's position in its bag, i64[sum(lengths)]."""
    starts = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum())) - np.repeat(starts, lengths)


def _truncate(lengths: np.ndarray, max_bag_size: int) -> tuple[np.ndarray | None, np.ndarray, int]:
    """(mask of the values kept or None = all, new lengths, bags truncated) for bags cut to `max_bag_size`."""
    if max_bag_size <= 0 or not lengths.size or lengths.max() <= max_bag_size:
        return None, lengths, 0
    return (bag_positions(lengths) < max_bag_size, np.minimum(lengths, max_bag_size).astype(np.int32),
            int((lengths > max_bag_size).sum()))


def _sparse_values(array: pa.Array, name: str, plan: ReadPlan) -> SparseValues:
    if name not in plan.multi_valued:
        keys, inverse = _dictionary_keys(array)
        return SparseValues(keys, inverse)
    values = pc.fill_null(_as_bytes(array), b"")
    lists = pc.split_pattern(values, plan.separator.encode())
    flat = lists.flatten()
    lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int32)
    nonempty = pc.greater(pc.binary_length(flat), 0).to_numpy(zero_copy_only=False)
    if not nonempty.all():  # "" (an empty cell) and empty items ("a||b") are no values
        row = np.repeat(np.arange(lengths.size), lengths)
        lengths = np.bincount(row[nonempty], minlength=lengths.size).astype(np.int32)
        flat = flat.filter(pa.array(nonempty))
    kept, lengths, truncated = _truncate(lengths, plan.max_bag_size)
    if kept is not None:
        flat = flat.filter(pa.array(kept))
    keys, inverse = _dictionary_keys(flat)
    return SparseValues(keys, inverse, lengths, truncated)


def _first_reasons(checks: Sequence[_Check], rows: np.ndarray) -> list[str]:
    """The reason of each of `rows`: its first failing check, in column order."""
    reasons = []
    for row in rows:
        check = next(c for c in checks if c.bad[row])
        reasons.append(check.explain(int(row)))
    return reasons


def columns_to_chunk(path: str, file_index: int, positions: np.ndarray, columns: Mapping[str, pa.Array],
                     plan: ReadPlan) -> tuple[ParsedChunk, np.ndarray, list[str]]:
    """Columns of n rows -> (the chunk of the good rows, bad rows' positions i64[b], reasons of the first
    MAX_REPORTED of them)."""
    label = _label_column(columns[plan.label], plan)
    labels, checks = label.labels, list(label.checks)
    dense, dense_checks, missing_cells, nan_cells = _dense_checks([columns[d.name] for d in plan.dense], plan,
                                                                  positions.size)
    checks += dense_checks
    time = iso = None
    if plan.time_column:
        time, iso, time_checks = _time_checks(columns[plan.time_column], plan.time_column)
        checks += time_checks
    bad = np.zeros(positions.size, bool)
    for check in checks:
        bad |= check.bad
    bad_rows = np.flatnonzero(bad)
    reasons = _first_reasons(checks, bad_rows[:MAX_REPORTED])
    sparse_arrays = {name: columns[name] for name in plan.sparse}
    keep = ~bad & ~label.unknown
    label_values, unknown_labels = label.value_counts(keep), label.unknown_counts()
    unknown_at = int(positions[np.argmax(label.unknown)]) if unknown_labels else None
    if not keep.all():
        labels, dense, positions = labels[keep], dense[keep], positions[keep]
        missing_cells, nan_cells = missing_cells[keep], nan_cells[keep]
        if time is not None:
            time, iso = time[keep], iso[keep]
        mask = pa.array(keep)
        sparse_arrays = {name: array.filter(mask) for name, array in sparse_arrays.items()}
    sparse = {name: _sparse_values(array, name, plan) for name, array in sparse_arrays.items()}
    numeric_at = iso_at = None
    if time is not None and time.size:
        numeric_at = int(positions[np.argmin(iso)]) if not iso.all() else None
        iso_at = int(positions[np.argmax(iso)]) if iso.any() else None
    chunk = ParsedChunk(path, file_index, positions, labels, dense, time, sparse, numeric_at, iso_at,
                        missing_cells.sum(axis=0), nan_cells.sum(axis=0), label_values, unknown_labels, unknown_at)
    return chunk, bad_rows, reasons


# ----------------------------------------------------------------------------------------------------------------------
# Lines of a text block
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays
class _Lines:
    """The lines of a block: buf u8 (the block, '\n'-terminated); per line start, end (before the line end: the
    '\n' and every '\r' right before it), newline (the '\n' position), number (1-based), blank, stray_cr (a '\r'
    before `end`)."""

    buf: np.ndarray
    start: np.ndarray
    end: np.ndarray
    newline: np.ndarray
    number: np.ndarray
    blank: np.ndarray
    stray_cr: np.ndarray

    @property
    def count(self) -> int:
        return int(self.start.size)


def _lines(block: TextBlock) -> _Lines:
    data = block.data if not block.data or block.data.endswith(b"\n") else block.data + b"\n"
    buf = np.frombuffer(data, np.uint8)
    newline = np.flatnonzero(buf == _NL)
    start = np.empty(newline.size, np.int64)
    start[:1], start[1:] = 0, newline[:-1] + 1
    end = newline.copy()
    stray_cr = np.zeros(newline.size, bool)
    if b"\r" in data:
        # Every '\r' right before the '\n' belongs to the line end: "\r\r\n" is what converting a CRLF file to
        # CRLF again gives, and no field ends in a carriage return. A '\r' anywhere else is stray.
        last_other = np.maximum.accumulate(np.where(buf != _CR, np.arange(buf.size), -1))
        end = np.where(newline > start, np.maximum(last_other[np.maximum(newline - 1, 0)] + 1, start), start)
        crs = np.flatnonzero(buf == _CR)
        stray_cr = _count_between(crs, start, end) > 0
    number = block.first_line + np.arange(newline.size, dtype=np.int64)
    return _Lines(buf, start, end, newline, number, end == start, stray_cr)


def _count_between(positions: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """How many of the ascending `positions` lie in [start, end) of each line."""
    return np.searchsorted(positions, end) - np.searchsorted(positions, start)


def _block_report(block: TextBlock, lines: _Lines, bad: np.ndarray, reasons_of: Mapping[int, str]) -> BlockReport:
    """bad: bool[L]; reasons_of: {line index: reason} for at least the first MAX_REPORTED bad lines."""
    bad_lines = np.flatnonzero(bad)
    reasons = tuple(reasons_of[int(i)] for i in bad_lines[:MAX_REPORTED])
    cut = block.cut_line
    last_complete = (int(lines.number[-1]) - cut if lines.count else block.first_line - 1) if block.truncated else None
    return BlockReport(block.path, lines.count, lines.number[lines.blank & ~bad], lines.number[bad_lines], reasons,
                       block.truncated, int(lines.number[-1]) if cut else None, last_complete_line=last_complete)


def _oversized(block: TextBlock, what: str) -> BlockReport:
    reason = f"line longer than {MAX_LINE_BYTES} bytes (is this a {what} file?)"
    return BlockReport(block.path, 1, np.zeros(0, np.int64), np.array([block.first_line]), (reason,))


def _first_line(path: str) -> tuple[bytes, int]:
    """The first non-blank line of a file (plain or gzip) without its line end, and its number; (b"", 0) if none,
    (b"", -1) if the file has no byte at all."""
    carry, number, empty = b"", 1, True
    for piece in ByteReader(path, piece_bytes=1 << 16):
        empty = empty and not piece
        carry += piece
        while b"\n" in carry:
            line, carry = carry.split(b"\n", 1)
            line = line.rstrip(b"\r")
            if number == 1:
                line = line.removeprefix(_BOM)
            if line:
                return line, number
            number += 1
        if len(carry) > MAX_LINE_BYTES:
            raise DataError(f"{path}: line {number} is longer than {MAX_LINE_BYTES} bytes; is this a text file?")
    carry = carry.rstrip(b"\r")
    if number == 1:
        carry = carry.removeprefix(_BOM)
    return (carry, number) if carry else (b"", -1 if empty else 0)


# ----------------------------------------------------------------------------------------------------------------------
# CSV
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CsvUnit:
    file_index: int
    block: TextBlock
    names: tuple[str, ...]  # the file's columns, in order


def _split_fields(line: bytes, delimiter: str, where: str) -> list[str]:
    try:
        return next(csv.reader([line.decode("utf-8", errors="replace")], delimiter=delimiter))
    except csv.Error as error:  # e.g. binary data: a stray '\r' or NUL in the line
        raise DataError(f"{where} cannot be read as CSV ({error}); is this a CSV file? (data.files, data.format)"
                        ) from None


def check_columns(path: str, available: Sequence[str], plan: ReadPlan, where: str) -> None:
    """Every configured column must be among `available`, once. where: e.g. "the header" or "the schema"."""
    missing = [c for c in plan.columns if c not in available]
    if missing:
        hint = " (if the file has no header, set data.csv.header=False)" if where == "the header" else ""
        raise DataError(f"{path}: {where} has no column {missing}; its columns are {list(available)}. Fix "
                         f"data.label.column / data.dense.columns / data.sparse.columns / data.split.time_column"
                         f"{hint}")
    repeated = sorted({c for c in plan.columns if list(available).count(c) > 1})
    if repeated:
        raise DataError(f"{path}: columns {repeated} appear more than once in {where}; rename them in the file")


def csv_units(paths: Sequence[str], plan: ReadPlan) -> Iterator[CsvUnit]:
    """Blocks of whole lines of each file, with the file's column names; the header line is not part of them."""
    fixed: tuple[str, ...] | None = None  # header=False: the names, from the first file's first line
    for file_index, path in enumerate(paths):
        first, first_number = _first_line(path)
        if plan.header:
            if first_number != 1 and first_number != -1:
                raise DataError(f"{path}: line 1 (the header, data.csv.header=True) is blank")
            names = tuple(_split_fields(first, plan.delimiter, f"{path}: line 1")) if first else ()
            if first:
                check_columns(path, names, plan, "the header")
        else:
            if fixed is None and first:
                count = len(_split_fields(first, plan.delimiter, f"{path}: line {first_number}"))
                if plan.column_names and len(plan.column_names) != count:
                    raise DataError(f"data.csv.column_names has {len(plan.column_names)} names but line "
                                     f"{first_number} of {path} has {count} fields (delimiter "
                                     f"{plan.delimiter!r}); name every column")
                fixed = plan.column_names or tuple(str(i) for i in range(count))
                check_columns(path, fixed, plan, "the column names (data.csv.column_names or positions)")
            names = fixed or ()
        start = True
        for block in blocks_of([FileSlice(path)], plan.chunk_bytes):
            if start and not block.empty_file:
                start = False
                if block.oversized:
                    raise DataError(f"{path}: line 1 is longer than {MAX_LINE_BYTES} bytes; is this a CSV file?")
                data = block.data.removeprefix(_BOM)
                if plan.header:  # drop the header line; the block starts at line 2
                    cut = data.find(b"\n") + 1
                    data = data[cut:] if cut else b""
                    block = dataclasses.replace(block, data=data, first_line=block.first_line + 1)
                    if not data and not block.truncated:
                        continue
                else:
                    block = dataclasses.replace(block, data=data)
            yield CsvUnit(file_index, block, names)


def _read_csv(text: bytes, unit: CsvUnit, plan: ReadPlan, fast: bool) -> tuple[pa.Table, list[tuple[int, int, str]]]:
    """pyarrow's parse of `text`: the table and (number, field count, text) of each row with the wrong field count.

    With use_threads=False, pyarrow 26 numbers rows 1-based among the non-blank lines it is given (blank lines are
    skipped without a number; a header would count); with threads it gives no number at all.
    """
    invalid: list[tuple[int, int, str]] = []

    def handler(row) -> str:
        invalid.append((row.number, row.actual_columns, row.text))
        return "skip"

    # Fast path: numbers converted by pyarrow, one-hot columns dictionary-encoded while parsing (cheaper than
    # encoding afterwards). Fallback: everything as bytes.
    floats = {plan.label} if not plan.positive_values else set()
    floats |= {d.name for d in plan.dense}
    encoded = set(plan.sparse) - set(plan.multi_valued) - floats
    types = {c: pa.float64() if c in floats else pa.dictionary(pa.int32(), pa.binary()) if c in encoded else
             pa.binary() for c in plan.columns} if fast else dict.fromkeys(plan.columns, pa.binary())
    table = pa_csv.read_csv(
        io.BytesIO(text),
        read_options=pa_csv.ReadOptions(use_threads=False, column_names=list(unit.names),
                                        block_size=max(len(text) + 1, 1 << 16)),
        parse_options=pa_csv.ParseOptions(delimiter=plan.delimiter, invalid_row_handler=handler),
        convert_options=pa_csv.ConvertOptions(column_types=types, include_columns=list(plan.columns),
                                              null_values=list(MISSING_MARKERS), strings_can_be_null=False))
    return table, invalid


def _line_text(lines: _Lines, chosen: np.ndarray) -> bytes:
    """The lines `chosen` (ascending indices), each without its line end and followed by '\n'."""
    size = lines.buf.size + 1
    marks = np.bincount(lines.start[chosen], minlength=size) - np.bincount(lines.end[chosen], minlength=size)
    inside = np.cumsum(marks[:-1]) > 0
    inside[lines.newline[chosen]] = True
    return lines.buf[inside].tobytes()


def _parse_lines(block: TextBlock, lines: _Lines, structural: np.ndarray, reasons_of: dict[int, str],
                 unit: CsvUnit, plan: ReadPlan) -> tuple[pa.Table | None, list[tuple[int, int, str]], np.ndarray]:
    """pyarrow's parse of the block's lines but the structurally bad ones (marked in `structural`, which this may
    extend): (table, wrong-count rows, the indices of the lines pyarrow numbered 1, 2, ...); table None if no line
    is left to parse."""
    while True:
        # pyarrow sees the whole block if no line is excluded (it skips blank lines itself) and every line ends in
        # '\n' or '\r\n'; else the other lines only, each cut at `end` and given a '\n'.
        extra_cr = bool(np.any(lines.newline - lines.end > 1))
        if structural.any() or extra_cr:
            passed = np.flatnonzero(~structural & ~lines.blank)
            text = _line_text(lines, passed)
        else:
            passed = np.arange(lines.count)
            text = block.data
        nonblank = passed[~lines.blank[passed]]
        if nonblank.size == 0:  # nothing for pyarrow (which calls an empty text "Empty CSV file")
            return None, [], nonblank
        try:
            try:
                table, invalid = _read_csv(text, unit, plan, fast=True)
            except pa.ArrowInvalid as error:
                if "conversion error" not in str(error):
                    raise
                table, invalid = _read_csv(text, unit, plan, fast=False)  # a cell is not a number: found vectorised
            return table, invalid, nonblank
        except pa.ArrowInvalid as error:
            # pyarrow cannot hand a row with the wrong field count and invalid UTF-8 to the handler (it fails
            # decoding row.text) and stops with "CSV parse error: Row #N"; such a line is bad: drop it, parse again.
            found = re.search(r"CSV parse error: Row #(\d+)", str(error))
            if not found or not 1 <= int(found.group(1)) <= nonblank.size:
                raise DataError(f"{block.path}: lines {block.first_line}-{lines.number[-1]}: pyarrow cannot parse "
                                f"them ({error})") from None
            i = int(nonblank[int(found.group(1)) - 1])
            structural[i] = True
            reasons_of[i] = (f"wrong field count, expected {len(unit.names)} (delimiter {plan.delimiter!r}), and not "
                             "valid UTF-8")


def parse_csv(unit: CsvUnit, plan: ReadPlan) -> tuple[ParsedChunk, BlockReport]:
    block = unit.block
    path = block.path
    if block.empty_file:
        return _empty_chunk(path, unit.file_index, plan), BlockReport(
            path, 0, np.zeros(0, np.int64), np.zeros(0, np.int64), (), empty_file=True)
    if block.oversized:
        return _empty_chunk(path, unit.file_index, plan), _oversized(block, "CSV")
    lines = _lines(block)
    reasons_of: dict[int, str] = {}
    quotes_odd = np.zeros(lines.count, bool)
    if b'"' in block.data:
        quotes = np.flatnonzero(lines.buf == _QUOTE)
        quotes_odd = _count_between(quotes, lines.start, lines.end) % 2 == 1
    cut = np.zeros(lines.count, bool)
    cut[-1:] = block.cut_line
    structural = (cut | lines.stray_cr | quotes_odd) & ~lines.blank
    for i in np.flatnonzero(structural)[:MAX_REPORTED]:
        reasons_of[int(i)] = (f"incomplete last line: {block.truncated}" if cut[i] else
                              "stray carriage return (\\r) inside the line" if lines.stray_cr[i] else
                              "unterminated quoted field (an odd number of '\"'); a record cannot span lines")
    table, invalid, nonblank = _parse_lines(block, lines, structural, reasons_of, unit, plan)
    bad = structural.copy()
    if table is None:  # every line is blank or structurally bad
        return _empty_chunk(path, unit.file_index, plan), _block_report(block, lines, bad, reasons_of)
    wrong_count = nonblank[np.array([number for number, _, _ in invalid], np.int64) - 1]
    for i, (_, _, text) in zip(wrong_count, invalid, strict=True):
        line = lines.buf[lines.start[i]:lines.end[i]].tobytes()
        if text.encode() != line:  # the numbering above is pyarrow's behaviour, not its documented contract
            raise RuntimeError(f"{path}: line {lines.number[i]}: pyarrow reported the bad row {text!r} for this "
                               "line; its invalid-row numbering differs from what recjax expects (pyarrow 26)")
    bad[wrong_count] = True
    for i, (_, count, _) in zip(wrong_count[:MAX_REPORTED], invalid, strict=False):
        reasons_of[int(i)] = (f"{count} fields, expected {len(unit.names)} (delimiter {plan.delimiter!r}; a "
                              "record cannot span lines)")
    rows = nonblank[~bad[nonblank]]
    if table.num_rows != rows.size:
        raise RuntimeError(f"{path}: lines {block.first_line}-{lines.number[-1]}: pyarrow returned "
                           f"{table.num_rows} rows for {rows.size} lines; please report this file")
    columns = {name: _one_array(table.column(name)) for name in plan.columns}
    chunk, bad_rows, reasons = columns_to_chunk(path, unit.file_index, lines.number[rows], columns, plan)
    bad[rows[bad_rows]] = True
    reasons_of.update(zip(rows[bad_rows[:MAX_REPORTED]].tolist(), reasons, strict=True))
    return chunk, _block_report(block, lines, bad, reasons_of)


# ----------------------------------------------------------------------------------------------------------------------
# Parquet
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class ParquetUnit:
    file_index: int
    path: str
    batch: pa.RecordBatch | None  # None: the file has no rows
    first_row: int  # 1-based number of the batch's first row


def parquet_units(paths: Sequence[str], plan: ReadPlan) -> Iterator[ParquetUnit]:
    for file_index, path in enumerate(paths):
        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as error:
            raise DataError(f"{path}: not a readable Parquet file ({error}); check data.format and data.files") \
                from None
        check_columns(path, parquet.schema_arrow.names, plan, "the schema")
        if parquet.metadata.num_rows == 0:
            yield ParquetUnit(file_index, path, None, 1)
            continue
        first = 1
        for batch in parquet.iter_batches(batch_size=plan.parquet_batch_rows, columns=list(plan.columns)):
            yield ParquetUnit(file_index, path, batch, first)
            first += batch.num_rows


def parse_parquet(unit: ParquetUnit, plan: ReadPlan) -> tuple[ParsedChunk, BlockReport]:
    if unit.batch is None:
        return _empty_chunk(unit.path, unit.file_index, plan), BlockReport(
            unit.path, 0, np.zeros(0, np.int64), np.zeros(0, np.int64), (), empty_file=True)
    n = unit.batch.num_rows
    positions = unit.first_row + np.arange(n, dtype=np.int64)
    columns = {name: unit.batch.column(name) for name in plan.columns}
    chunk, bad_rows, reasons = columns_to_chunk(unit.path, unit.file_index, positions, columns, plan)
    return chunk, BlockReport(unit.path, n, np.zeros(0, np.int64), positions[bad_rows], tuple(reasons))


# ----------------------------------------------------------------------------------------------------------------------
# libSVM / libFM / libFFM
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LibsvmUnit:
    file_index: int
    block: TextBlock
    expected_pairs: int  # positional: the first line's number of (non-dense) pairs


def libsvm_units(paths: Sequence[str], plan: ReadPlan) -> Iterator[LibsvmUnit]:
    expected = 0
    if plan.libsvm_fields == "positional" and paths:
        line, _ = _first_line(paths[0])
        dense = {str(i) for i in plan.dense_indices}
        expected = sum(1 for token in line.split()[1:] if token.split(b":")[0].decode("latin-1") not in dense)
    for file_index, path in enumerate(paths):
        for block in blocks_of([FileSlice(path)], plan.chunk_bytes):
            if block.first_line == 1 and block.data.startswith(_BOM):
                block = dataclasses.replace(block, data=block.data.removeprefix(_BOM))
            yield LibsvmUnit(file_index, block, expected)


def _parse_uints(buf: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decimal digits buf[start:end) -> (values i64[k], ok bool[k]: 1 to MAX_INDEX_DIGITS digits, nothing else)."""
    width = MAX_INDEX_DIGITS
    pos = end[:, None] - width + np.arange(width)
    inside = pos >= start[:, None]
    digits = buf[np.maximum(pos, 0)].astype(np.int64) - ord("0")
    digits = np.where(inside, digits, 0)
    length = end - start
    ok = (length >= 1) & (length <= width) & np.all(~inside | ((digits >= 0) & (digits <= 9)), axis=1)
    values = np.zeros(start.size, np.int64)
    for column in range(width):
        values = values * 10 + np.where(ok, digits[:, column], 0)
    return values, ok


def _gather_bytes(buf: np.ndarray, start: np.ndarray, end: np.ndarray) -> pa.Array:
    """The ascending, non-overlapping ranges buf[start:end) as a binary array."""
    marks = np.bincount(start, minlength=buf.size + 1) - np.bincount(end, minlength=buf.size + 1)
    data = buf[np.cumsum(marks[:-1]) > 0]
    offsets = np.concatenate([[0], np.cumsum(end - start)]).astype(np.int32)
    return pa.Array.from_buffers(pa.binary(), start.size, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _one_hot(keys: np.ndarray) -> SparseValues:
    distinct, inverse = np.unique(keys, return_inverse=True)
    return SparseValues(distinct, inverse.astype(np.int32))


def _first_per_line(token_line: np.ndarray, tokens: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Of ascending token indices on ascending lines, the first token of each of the first `limit` lines."""
    lines, first = np.unique(token_line[tokens], return_index=True)
    return lines[:limit], tokens[first[:limit]]


def parse_libsvm(unit: LibsvmUnit, plan: ReadPlan) -> tuple[ParsedChunk, BlockReport]:
    block = unit.block
    path = block.path
    if block.empty_file:
        return _empty_chunk(path, unit.file_index, plan), BlockReport(
            path, 0, np.zeros(0, np.int64), np.zeros(0, np.int64), (), empty_file=True)
    if block.oversized:
        return _empty_chunk(path, unit.file_index, plan), _oversized(block, "libSVM")
    lines = _lines(block)
    buf, count = lines.buf, lines.count
    ffm = plan.libsvm_fields == "ffm"

    # Tokens: runs of bytes other than ' ', '\t', '\r', '\n'; a token belongs to the line of the next '\n'.
    separator = (buf == _SPACE) | (buf == _TABC) | (buf == _NL) | (buf == _CR)
    edges = np.diff(np.concatenate([[0], (~separator).view(np.int8), [0]]))
    tok_start, tok_end = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    tok_line = np.searchsorted(lines.newline, tok_start)
    first_tok = np.searchsorted(tok_line, np.arange(count))
    blank = np.bincount(tok_line, minlength=count) == 0  # blanks only: blank here, as blanks separate tokens
    cut = np.zeros(count, bool)
    cut[-1:] = block.cut_line
    structural = (cut | lines.stray_cr) & ~blank
    reasons_of = {int(i): f"incomplete last line: {block.truncated}" if cut[i] else
                  "stray carriage return (\\r) inside the line" for i in np.flatnonzero(structural)[:MAX_REPORTED]}

    # Labels: the first token of each line; a first token with a ':' is a feature (the line has no label).
    colons = np.flatnonzero(buf == _COLON)
    label_lines = np.flatnonzero(~blank)
    label_tok = first_tok[label_lines]
    label_array = _gather_bytes(buf, tok_start[label_tok], tok_end[label_tok])
    no_label = _count_between(colons, tok_start[label_tok], tok_end[label_tok]) > 0
    label = _label_column(label_array, plan, name="label")
    label = dataclasses.replace(label, unknown=label.unknown & ~no_label)
    label_checks = [_Check(no_label, lambda k: f"the line has no label: its first token {_text(label_array, k)} is "
                                               "a feature")] + label.checks
    labels = np.zeros(count, np.float32)
    labels[label_lines] = label.labels
    label_bad = np.zeros(label_lines.size, bool)
    for check in label_checks:
        label_bad |= check.bad
    for k in np.flatnonzero(label_bad & ~structural[label_lines])[:MAX_REPORTED]:
        reasons_of[int(label_lines[k])] = next(c for c in label_checks if c.bad[k]).explain(int(k))
    bad = structural.copy()
    bad[label_lines[label_bad]] = True
    unknown = np.zeros(count, bool)  # no bad line: the label's values are listed once every file is read
    unknown[label_lines[label.unknown]] = True

    # Feature tokens: index:value (or field:index:value). Indices by digit arithmetic; values "0" / "1" directly,
    # anything else through pyarrow.
    is_feature = np.ones(tok_start.size, bool)
    is_feature[label_tok] = False
    feat = np.flatnonzero(is_feature)
    f_start, f_end, f_line = tok_start[feat], tok_end[feat], tok_line[feat]
    first_colon = np.searchsorted(colons, f_start)
    shape_ok = np.searchsorted(colons, f_end) - first_colon == (2 if ffm else 1)
    last = max(colons.size - 1, 0)
    c1 = np.where(shape_ok, colons[np.minimum(first_colon, last)] if colons.size else 0, f_start)
    c2 = np.where(shape_ok & ffm, colons[np.minimum(first_colon + 1, last)] if colons.size else 0, c1)
    field, field_ok = _parse_uints(buf, f_start, c1) if ffm else (np.zeros(feat.size, np.int64),
                                                                   np.ones(feat.size, bool))
    index, index_ok = _parse_uints(buf, c1 + 1 if ffm else f_start, c2 if ffm else c1)
    value_start = np.where(shape_ok, c2 + 1, f_end)
    one_char = f_end - value_start == 1
    first_char = buf[np.minimum(value_start, buf.size - 1)]
    value = np.where(one_char & (first_char == ord("1")), 1.0, 0.0)
    other = np.flatnonzero(shape_ok & ~(one_char & ((first_char == ord("1")) | (first_char == ord("0")))))
    value_bad = np.zeros(feat.size, bool)
    value_nan = np.zeros(feat.size, bool)
    if other.size:
        numbers, missing, not_number, nan = _numbers(_gather_bytes(buf, value_start[other], f_end[other]))
        value[other] = numbers
        value_bad[other] = missing | not_number | np.isinf(numbers)
        value_nan[other] = nan
    dense_of = plan.dense_indices
    is_dense = index_ok & np.isin(index, np.array(sorted(dense_of), np.int64))
    # A NaN value of a dense index follows data.dense.nan (imputed like an absent index, or a bad line); any other
    # index's value is 0 or 1.
    nan_skipped = value_nan & is_dense & (plan.nan == "skip")
    value_bad |= value_nan & ~is_dense
    not_binary = ~is_dense & ~value_bad & (value != 0) & (value != 1)
    token_bad = ~shape_ok | ~field_ok | ~index_ok | value_bad | nan_skipped | not_binary
    # A dense index twice in a line, or (ffm) a field twice, is ambiguous.
    slot_kind = np.where(is_dense, 1, np.where(ffm & ~token_bad, 2, 0))
    dup = np.zeros(feat.size, bool)
    if np.any(slot_kind):
        rows = np.flatnonzero(slot_kind)
        slot = np.where(is_dense[rows], index[rows], field[rows])
        order = np.lexsort((slot, slot_kind[rows], f_line[rows]))
        key = np.stack([f_line[rows], slot_kind[rows], slot], axis=1)[order]
        dup[rows[order[1:][np.all(key[1:] == key[:-1], axis=1)]]] = True
    token_bad |= dup

    def token_reason(t: int) -> str:
        text = show_value(bytes(buf[f_start[t]:f_end[t]]))
        if not shape_ok[t]:
            return f"token {text} is not {'field:index:value' if ffm else 'index:value'}"
        if not field_ok[t]:
            return f"token {text}: the field is not a non-negative integer of at most {MAX_INDEX_DIGITS} digits"
        if not index_ok[t]:
            return f"token {text}: the index is not a non-negative integer of at most {MAX_INDEX_DIGITS} digits"
        if value_bad[t]:
            return f"token {text}: the value is not a finite number"
        if nan_skipped[t]:
            return nan_reason(f"token {text}: dense index {index[t]}", plan)
        if not_binary[t]:
            return (f"token {text}: index {index[t]} has a value other than 0 or 1; list the index in "
                    "data.libsvm.dense_indices if it is a dense feature")
        return (f"token {text}: dense index {index[t]} appears twice in the line" if is_dense[t] else
                f"token {text}: field {field[t]} appears twice in the line (data.libsvm.fields='bag' reads "
                "multi-hot lines)")

    token_bad_lines = np.bincount(f_line[token_bad], minlength=count) > 0
    fresh = np.flatnonzero(token_bad & ~bad[f_line])
    for line, t in zip(*_first_per_line(f_line, fresh, MAX_REPORTED), strict=True):
        reasons_of[int(line)] = token_reason(int(t))
    bad |= token_bad_lines

    sparse_tok = ~is_dense
    if plan.libsvm_fields == "positional":
        pairs = np.bincount(f_line[sparse_tok], minlength=count)
        wrong = ~blank & (pairs != unit.expected_pairs)
        for i in np.flatnonzero(wrong & ~bad)[:MAX_REPORTED]:
            reasons_of[int(i)] = (f"{pairs[i]} index:value pairs, expected {unit.expected_pairs} like the first "
                                  "line of the first file (data.libsvm.fields='positional' needs the same number on "
                                  "every line)")
        bad |= wrong

    # Dense values: absent -> missing; then the transforms (a log1p domain error is a bad line too).
    dense = np.full((count, len(plan.dense)), np.nan)
    nan_cells = np.zeros((count, len(plan.dense)), bool)
    dense_tok = np.flatnonzero(is_dense & ~token_bad)
    if dense_tok.size:
        dense_index = np.array(sorted(dense_of), np.int64)  # ascending dense indices and their dense columns
        dense_column = np.array([dense_of[int(k)] for k in dense_index], np.int64)
        column = dense_column[np.searchsorted(dense_index, index[dense_tok])]
        dense[f_line[dense_tok], column] = value[dense_tok]
        nan_cells[f_line[dense_tok], column] = value_nan[dense_tok]
    missing_cells = np.isnan(dense) & ~nan_cells
    dense_out = np.zeros((count, len(plan.dense)), np.float32)
    for j, spec in enumerate(plan.dense):
        values, bad_log = transform_dense(dense[:, j], spec, plan)
        dense_out[:, j] = values
        for i in np.flatnonzero(bad_log & ~bad & ~blank)[:MAX_REPORTED]:
            reasons_of[int(i)] = (f"dense index {spec.index} = {dense[i, j]}: log1p needs values > -1 (after clip; "
                                  f"the missing value is {plan.missing}); set data.dense.clip_min or drop log1p")
        bad |= bad_log & ~blank

    good = ~blank & ~bad & ~unknown
    rows = np.flatnonzero(good)
    n = rows.size
    row_of_line = np.full(count, -1, np.int64)
    row_of_line[rows] = np.arange(n)
    tok_row = row_of_line[f_line]
    present = (tok_row >= 0) & sparse_tok
    sparse: dict[str, SparseValues] = {}
    if plan.libsvm_fields == "positional":
        tok = np.flatnonzero(present)
        position = bag_positions(np.bincount(tok_row[tok], minlength=n))
        keys = np.full((unit.expected_pairs, n), MISSING_INDEX_KEY, np.int64)
        keys[position, tok_row[tok]] = np.where(value[tok] == 1, index[tok], MISSING_INDEX_KEY)
        sparse = {f"f{k}": _one_hot(keys[k]) for k in range(unit.expected_pairs)}
    elif ffm:
        tok = np.flatnonzero(present)
        for f in np.unique(field[tok]):
            at = tok[field[tok] == f]
            keys = np.full(n, MISSING_INDEX_KEY, np.int64)
            keys[tok_row[at]] = np.where(value[at] == 1, index[at], MISSING_INDEX_KEY)
            sparse[f"f{f}"] = _one_hot(keys)
    else:  # bag: every index with value 1, in line order
        tok = np.flatnonzero(present & (value == 1))
        lengths = np.bincount(tok_row[tok], minlength=n).astype(np.int32)
        kept, lengths, truncated = _truncate(lengths, plan.max_bag_size)
        values = index[tok] if kept is None else index[tok][kept]
        distinct, inverse = np.unique(values, return_inverse=True)
        sparse = {"features": SparseValues(distinct, inverse.astype(np.int32), lengths, truncated)}

    unknown_labels = label.unknown_counts()
    chunk = ParsedChunk(path, unit.file_index, lines.number[rows], labels[rows], dense_out[rows], None, sparse,
                        dense_missing=missing_cells[rows].sum(axis=0), dense_nan=nan_cells[rows].sum(axis=0),
                        label_values=label.value_counts(good[label_lines]), unknown_labels=unknown_labels,
                        unknown_label_at=int(lines.number[np.argmax(unknown)]) if unknown_labels else None)
    return chunk, _block_report(block, dataclasses.replace(lines, blank=blank), bad & ~blank, reasons_of)


# ----------------------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------------------


def units(paths: Sequence[str], plan: ReadPlan) -> Iterator:
    """The units of `paths` in file order (read in the calling thread)."""
    if plan.format == "csv":
        return csv_units(paths, plan)
    if plan.format == "parquet":
        return parquet_units(paths, plan)
    return libsvm_units(paths, plan)


def parse_unit(unit, plan: ReadPlan) -> tuple[ParsedChunk, BlockReport]:
    """One unit's good rows and report (thread-safe; pyarrow and numpy release the GIL)."""
    if isinstance(unit, CsvUnit):
        return parse_csv(unit, plan)
    if isinstance(unit, ParquetUnit):
        return parse_parquet(unit, plan)
    return parse_libsvm(unit, plan)


__all__ = [
    "DENSE_NAN", "DENSE_STEPS", "MISSING_INDEX_KEY", "MISSING_MARKERS", "MISSING_STRING_KEY", "NAN_MARKERS",
    "NULL_MARKERS", "CsvUnit", "DenseColumn", "LibsvmUnit", "ParquetUnit", "ParsedChunk", "ReadPlan", "SparseValues",
    "bag_positions", "check_columns", "columns_to_chunk", "csv_units", "libsvm_units", "nan_reason", "parquet_units",
    "parse_csv", "parse_libsvm", "parse_parquet", "parse_unit", "time_values", "transform_dense", "units",
]
