r"""Criteo display-advertising click logs (Kaggle and Terabyte): a streaming, vectorised parser and DLRM preprocessing.

    from recjax.data import criteo
    prepared = criteo.prepare_criteo(criteo.kaggle_splits("train.txt"), criteo.CriteoOptions(frequency_threshold=3))
    prepared.spec                      # DatasetSpec: 13 dense, C1..C26 one-hot with the fitted vocab sizes
    for block in prepared.blocks("train"): ...   # recjax.batch.Batch blocks of `block_rows` examples
    prepared.stats.save(directory)     # stats.json + index_counts.npz; prepared.report.to_dict() for the log

Line grammar (anything else is a bad line, never silently misparsed)
    40 fields separated by '\t': label, I1..I13, C1..C26; lines end with '\n' or '\r\n' (the '\r' is stripped).
    label    exactly '0' or '1'
    I*       empty, or '-'? [0-9]+ with at most 20 characters and a value in the int64 range
    C*       empty, or exactly 8 hex digits (either case): the raw 32-bit hash
    A '\r' anywhere but right before '\n' is a bad line. A line with no bytes (after stripping '\r') is a blank
    line: skipped and counted, never an error. The file's last line needs no '\n' if it is complete (a last line
    with too few fields is a bad line like any other). A gzip stream cut short keeps the lines decoded before the
    cut; its incomplete last line is a bad line and the file is listed in `ParseReport.truncated_files`.

Preprocessing (facebookresearch/dlrm `data_utils.py`: `getCriteoAdData` / `processCriteoAdData` /
`transformCriteoAdData`)
    dense    missing -> 0, negative -> 0, then log(x + 1) in float32 (`np.log(X_int.astype(np.float32) + 1)`).
    C*       the hex hash as an integer. The reference turns an empty field into "0", so a missing category collides
             with the hash 00000000; here a missing category has its own raw key `MISSING_CATEGORY` = 2**32 (no
             8-digit hash can take it), so "missing" is a category of its own in both vocabulary modes.
    vocab    "frequency": fitted on the train split only. Raw keys seen >= `frequency_threshold` times in train get
             indices 1..K in descending train frequency (ties: ascending raw key); index 0 is out-of-vocabulary
             (rare in train, or unseen: only in validation/test). Frequency order puts the hot rows first, which
             frequency-aware compression methods can use. (The reference instead numbers every id of *all* days,
             test included, in order of first appearance, with no threshold; threshold 1 here is the same
             vocabulary minus ids that occur only in validation/test.)
             "hash": index = raw key % `max_index` (the reference's `--max-ind-range`: `int(x, 16) % max_ind_range`);
             vocab_size = max_index for every feature.

Splits
    Kaggle (`kaggle_splits`): as `getCriteoAdData` + `transformCriteoAdData(data_split="train")`: the N lines are cut
    into 7 "days" by line count (`divmod(N, 7)`, the first `N % 7` days one line longer); days 0-5 are "train";
    day 6 is cut with `np.array_split(day6, 2)` into "test" (the first ceil(n/2) lines) and "validation" (the
    rest) -- the reference names the halves `test_indices, val_indices` in that order, and its
    `CriteoDataset.__getitem__` reads test from offset 0 and val from offset `test_size = ceil(n/2)`.
    Terabyte (`terabyte_splits`): "train" = days 0-22, day 23 halved the same way (test first, validation second;
    `data_loader_terabyte.numpy_to_binary` uses `midpoint = ceil(n/2)`); other day assignments are options.
    Line counts are of physical lines (blank and bad lines included), so which split a line belongs to depends on
    its line number only, never on whether other lines parse.

Statistics (`CriteoStats`): per feature the vocab size, train occurrences per index (i64[vocab_size]; index 0 =
out-of-vocabulary in frequency mode), raw distinct keys in train, missing count, and a histogram of raw keys by
log2 of their train frequency.

Performance (figures and commands: benchmarks/RESULTS.md#data-criteo-preprocessing). Files are read in `chunk_bytes`
blocks (default 4 MB, which parsed faster than 32 MB: the working set stays in cache) cut at the last '\n' (gzip via
streaming zlib), never whole. A block is parsed with numpy only: '\n', '\t' and '\r' positions by comparison, field
bounds by indexing the tab positions; each field's last (dense) or first (hex) 8 bytes are read as one unaligned
uint64 through a byte-strided view and validated and converted with SWAR arithmetic (8 characters per uint64
operation). Blocks are parsed (and counted, spilled or mapped) on a pool of `num_threads` threads -- numpy releases
the GIL in array operations -- and results are merged in file order, so reports and errors are deterministic.
Reading, line blocks, reports and the thread pool are shared with the other parsers (`recjax/data/textio.py`), and
so are key counting and the vocabularies (`recjax/data/vocabulary.py`).
The vocabulary needs all of train before any id can be mapped, so train is read twice. By default the fitting
pass spills each train chunk compactly (labels, dense, and per feature its distinct keys plus each row's uint16
position among them: ~175 bytes a row, less than the text) and train's blocks are built from that, which costs
less CPU than parsing train again. The spill needs temporary disk (Kaggle's 39M train
rows: ~7 GB; it is deleted by `PreparedCriteo.close()`); `CriteoOptions(spill=False)` parses train again instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from recjax.batch import Batch
from recjax.data.arrays import ArrayDataset, concatenate, rebatch
from recjax.data.textio import (
    DEFAULT_CHUNK_BYTES,
    MAX_LINE_BYTES,
    MAX_REPORTED,
    BlockReport,
    FileSlice,
    LineIndex,
    ParseReport,
    TextBlock,
    blocks_of,
    count_lines,
    index_lines,
    merge_report,
    ordered_map,
    read_arrays,
    show_value,
    write_arrays,
)
from recjax.data.vocabulary import (
    KeyCounter,
    VocabularyStats,
    count_column_keys,
    distinct_inverse,
    frequency_histogram,
    frequency_vocabulary,
    hash_index_counts,
    lookup,
)
from recjax.errors import DataError
from recjax.specs import DatasetSpec, FeatureSpec

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26
CRITEO_NUM_FIELDS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_SPARSE
CRITEO_DENSE_NAMES = tuple(f"I{i}" for i in range(1, CRITEO_NUM_DENSE + 1))
CRITEO_FEATURE_NAMES = tuple(f"C{i}" for i in range(1, CRITEO_NUM_SPARSE + 1))
MISSING_CATEGORY = 1 << 32  # raw key of an empty C* field: outside the 8-hex-digit range [0, 2**32)
KEY_BITS = 33  # raw keys are < 2**33 (MISSING_CATEGORY included): narrow enough for the packed sorts
KAGGLE_DAYS = 7
TERABYTE_DAYS = 24
MAX_DENSE_CHARS = 20  # len("-9223372036854775808")

_NL, _TAB, _CR = ord("\n"), ord("\t"), ord("\r")
_PAD = bytes(8)  # zero bytes around a block: 8-byte reads at a field's end or start never leave the buffer
_BAD = 255
_DEC = np.full(256, _BAD, np.uint8)
_DEC[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX = _DEC.copy()
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)
_INT64_MAX = np.uint64(2**63 - 1)


# ----------------------------------------------------------------------------------------------------------------------
# Options, parsed chunks
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CriteoOptions:
    """How to parse and index Criteo logs.

    vocab: "frequency" (fitted on train, see module doc) or "hash" (raw key % max_index).
    frequency_threshold: keep raw keys seen at least this often in train (1 = every key seen in train).
    max_index: the hash range; required for vocab="hash".
    strict: raise on the first bad line / empty file / truncated gzip instead of skipping and reporting it.
    chunk_bytes: bytes of text parsed per block (memory per in-flight block is ~10x this).
    num_threads: blocks parsed in parallel.
    spill: keep the train split's parsed rows from the fitting pass in a temporary directory (~175 bytes a row,
      less than the text) instead of parsing train again when its blocks are streamed (see the module doc).
    spill_dir: where that temporary directory is made (None: the system's temp directory).
    """

    vocab: Literal["frequency", "hash"] = "frequency"
    frequency_threshold: int = 1
    max_index: int | None = None
    strict: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    num_threads: int = 2
    spill: bool = True
    spill_dir: str | None = None

    def __post_init__(self):
        if self.vocab not in ("frequency", "hash"):
            raise ValueError(f"CriteoOptions.vocab must be 'frequency' or 'hash', got {self.vocab!r}")
        if self.vocab == "hash" and (self.max_index is None or not 1 <= self.max_index < 2**31):
            raise ValueError(f"CriteoOptions(vocab='hash') needs 1 <= max_index < 2**31 (ids are int32), "
                             f"got {self.max_index}")
        if self.frequency_threshold < 1:
            raise ValueError(f"CriteoOptions.frequency_threshold must be >= 1, got {self.frequency_threshold}")
        if self.chunk_bytes < 1024:
            raise ValueError(f"CriteoOptions.chunk_bytes must be >= 1024, got {self.chunk_bytes}")
        if self.num_threads < 1:
            raise ValueError(f"CriteoOptions.num_threads must be >= 1, got {self.num_threads}")


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays
class RawChunk:
    """Parsed rows of one block, before vocabulary mapping.

    labels: f32[n] in {0, 1}; dense: f32[n, 13] = log(max(x, 0) + 1), missing -> 0;
    cats: i64[n, 26] raw hashes in [0, 2**32), MISSING_CATEGORY for an empty field; stored feature-major (the
      transpose of a C-contiguous [26, n]) because counting and mapping work one feature at a time;
    line_numbers: i64[n] 1-based line numbers in `path`.
    """

    path: str
    labels: np.ndarray
    dense: np.ndarray
    cats: np.ndarray
    line_numbers: np.ndarray

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def take(self, index: np.ndarray | slice) -> RawChunk:
        return RawChunk(self.path, self.labels[index], self.dense[index], self.cats[index], self.line_numbers[index])


# ----------------------------------------------------------------------------------------------------------------------
# Parsing one block
# ----------------------------------------------------------------------------------------------------------------------


def _read_u64(buf: np.ndarray) -> np.ndarray:
    """Every 8-byte window of `buf` as a uint64 (unaligned, byte stride): view[i] = buf[i:i+8], little-endian."""
    return np.ndarray((buf.size - 7,), np.uint64, buffer=buf, strides=(1,))


# SWAR ("SIMD within a register") constants: one uint64 holds a field's 8 characters, one byte each.
_U = np.uint64
_ONES = _U(0x0101010101010101)
_ASCII_ZEROS = _U(0x3030303030303030)
_HIGH_BITS = _U(0x8080808080808080)
_LOW_BYTES = np.array([(1 << (8 * k)) - 1 for k in range(9)], np.uint64)  # [k]: the k low bytes set


def _parse_dense(buf: np.ndarray, words: np.ndarray, start: np.ndarray, end: np.ndarray):
    """Dense fields [G, 13] -> (i64 values clipped at 0, bad-character mask, overflow mask), each [G, 13].

    A field of <= 8 digits (all of Criteo's in practice) is the uint64 of the 8 bytes ending at the field's end, the
    bytes before its digits (sign, tab, previous field) replaced by '0'; validated and converted with the
    eight-digit SWAR steps of Lemire, "Fast integer parsing" (simdjson's parse_eight_digits_unrolled). Longer
    fields go through `_parse_long_dense`.
    """
    length = end - start
    negative = (length > 0) & (buf[start] == ord("-"))
    digits = length - negative
    before = _LOW_BYTES[8 - np.minimum(digits, 8)]  # little-endian: earlier bytes are the low ones
    x = (words[end - 8] & ~before) | (_ASCII_ZEROS & before)
    bad_char = (((x + _U(0x4646464646464646)) | (x - _ASCII_ZEROS)) & _HIGH_BITS) != 0
    bad_char |= negative & (digits == 0)
    x -= _ASCII_ZEROS
    x = x * _U(10) + (x >> _U(8))  # digit pairs in the even bytes
    x = ((x & _U(0x000000FF000000FF)) * _U(100 + (1000000 << 32))
         + ((x >> _U(16)) & _U(0x000000FF000000FF)) * _U(1 + (10000 << 32))) >> _U(32)
    number = x.astype(np.int64)
    overflow = np.zeros(length.shape, bool)
    long = digits > 8
    if np.any(long):
        rows, cols = np.nonzero(long)
        long_value, long_bad, long_overflow = _parse_long_dense(buf, start[rows, cols], end[rows, cols])
        number[rows, cols], bad_char[rows, cols], overflow[rows, cols] = long_value, long_bad, long_overflow
    number[negative | bad_char | overflow] = 0
    return number, bad_char, overflow


def _parse_long_dense(buf: np.ndarray, start: np.ndarray, end: np.ndarray):
    """Dense fields of 9+ digits, i64[k] bounds -> (values clipped at 0, bad-character mask, overflow mask)."""
    length = end - start
    negative = buf[start] == ord("-")
    digits = length - negative
    width = MAX_DENSE_CHARS
    pos = end[:, None] - width + np.arange(width)
    chars = buf[np.maximum(pos, 0)]
    inside = pos >= (start + negative)[:, None]
    values = np.where(inside, _DEC[chars], 0)
    bad_char = np.any(values == _BAD, axis=1) | (length > MAX_DENSE_CHARS)
    values[bad_char] = 0
    # Significant digits: leading zeros are allowed, so overflow is decided on the digits after them.
    nonzero = inside & (values > 0)
    first_nonzero = np.where(nonzero.any(axis=1), np.argmax(nonzero, axis=1), width)
    significant = width - first_nonzero
    number = np.zeros(len(start), np.uint64)
    for column in range(width - 19, width):  # 19 digits always fit in uint64
        number = number * np.uint64(10) + values[:, column].astype(np.uint64)
    limit = np.where(negative, _INT64_MAX + np.uint64(1), _INT64_MAX)
    overflow = ~bad_char & ((significant > 19) | (number > limit))
    number = np.where(negative | overflow | bad_char | (digits == 0), 0, np.minimum(number, _INT64_MAX))
    return number.astype(np.int64), bad_char, overflow


def _parse_hex(words: np.ndarray, start: np.ndarray, length: np.ndarray):
    """Categorical field bounds (any shape, here [26, G]) -> (i64 raw keys, MISSING_CATEGORY when empty; bad mask).

    Each field's 8 bytes are read from its start whatever its length (the block's trailing pad keeps the read
    inside the buffer); only fields of exactly 8 valid characters (or none) are kept.
    """
    x = words[start]
    chars = x.view(np.uint8)
    is_digit = (chars - np.uint8(ord("0"))) < np.uint8(10)
    is_letter = ((chars | np.uint8(0x20)) - np.uint8(ord("a"))) < np.uint8(6)  # | 0x20: lower case
    valid = (is_digit | is_letter).view(np.uint64) == _ONES
    x = x.byteswap()  # first character in the most significant byte
    letters = (x >> _U(6)) & _ONES  # 1 in the bytes holding a letter
    nibbles = (x & _U(0x0F0F0F0F0F0F0F0F)) + (letters << _U(3)) + letters  # '0'-'9' -> 0-9, 'a'/'A'-'f' -> 10-15
    octets = ((nibbles & _U(0x0F000F000F000F00)) >> _U(4)) | (nibbles & _U(0x000F000F000F000F))
    pairs = (octets | (octets >> _U(8))) & _U(0x0000FFFF0000FFFF)
    keys = ((pairs & _U(0xFFFF)) | ((pairs >> _U(16)) & _U(0xFFFF0000))).view(np.int64)
    empty = length == 0
    keys[empty] = MISSING_CATEGORY
    return keys, ~(empty | ((length == 8) & valid))


def _parse_block(block: TextBlock) -> tuple[RawChunk, BlockReport]:
    """Parse the lines of one block: the good rows and a report of blank and bad lines (no Python loop over lines)."""
    if block.oversized:
        empty = np.zeros(0, np.int64)
        chunk = RawChunk(block.path, np.zeros(0, np.float32), np.zeros((0, CRITEO_NUM_DENSE), np.float32),
                         np.zeros((0, CRITEO_NUM_SPARSE), np.int64), empty)
        reason = f"line longer than {MAX_LINE_BYTES} bytes (is this a Criteo text file?)"
        return chunk, BlockReport(block.path, 1, empty, np.array([block.first_line]), (reason,))
    data = block.data
    if data and not data.endswith(b"\n"):
        data += b"\n"
    buf = np.frombuffer(_PAD + data + _PAD, np.uint8)
    newline = np.flatnonzero(buf == _NL)
    n = newline.size
    start = np.empty(n, np.int64)
    start[:1], start[1:] = len(_PAD), newline[:-1] + 1
    has_cr = (buf[newline - 1] == _CR) & (newline > start)
    end = newline - has_cr
    line_numbers = block.first_line + np.arange(n, dtype=np.int64)
    blank = end == start
    tabs = np.flatnonzero(buf == _TAB)
    first_tab = np.searchsorted(tabs, start)
    num_tabs = np.searchsorted(tabs, newline) - first_tab
    crs = np.flatnonzero(buf == _CR)
    stray_cr = np.searchsorted(crs, newline) - np.searchsorted(crs, start) > has_cr
    candidate = ~blank & ~stray_cr & (num_tabs == CRITEO_NUM_FIELDS - 1)
    cut_line = bool(block.truncated and block.data and not block.data.endswith(b"\n"))
    if cut_line:
        candidate[-1] = False  # the line cut by the truncation: whatever it looks like, it is incomplete

    rows = np.flatnonzero(candidate)
    tab = tabs[first_tab[rows, None] + np.arange(CRITEO_NUM_FIELDS - 1)]  # [G, 39]: tab k ends field k
    words = _read_u64(buf)
    label_char = buf[start[rows]]
    label_bad = (tab[:, 0] - start[rows] != 1) | ((label_char != ord("0")) & (label_char != ord("1")))
    num_dense = CRITEO_NUM_DENSE
    dense, dense_bad, dense_overflow = _parse_dense(buf, words, tab[:, :num_dense] + 1, tab[:, 1:num_dense + 1])
    hex_start = np.ascontiguousarray(tab[:, num_dense:].T) + 1  # [26, G]: feature-major from here on
    hex_end = np.concatenate([tab[:, num_dense + 1:].T, end[None, rows]], axis=0)
    cats, hex_bad = _parse_hex(words, hex_start, hex_end - hex_start)
    good = ~(label_bad | np.any(dense_bad | dense_overflow, axis=1) | np.any(hex_bad, axis=0))
    candidate[rows[~good]] = False

    chunk = RawChunk(
        path=block.path,
        labels=(label_char[good] - ord("0")).astype(np.float32),
        dense=np.log(dense[good].astype(np.float32) + np.float32(1)),
        cats=cats[:, good].T,
        line_numbers=line_numbers[rows[good]],
    )
    bad = np.flatnonzero(~candidate & ~blank)
    reasons = tuple(_explain_line(bytes(buf[start[i]:newline[i]]), truncated=block.truncated
                                  if cut_line and i == n - 1 else None) for i in bad[:MAX_REPORTED])
    report = BlockReport(block.path, n, line_numbers[blank], line_numbers[bad], reasons, block.truncated,
                          int(line_numbers[-1]) if cut_line else None, block.empty_file)
    return chunk, report


def _explain_line(line: bytes, truncated: str | None = None) -> str:
    """Why a line (without its '\n') is bad, for the report: the grammar of the module doc, one line at a time."""
    if truncated:
        return f"incomplete last line: {truncated}"
    text = line[:-1] if line.endswith(b"\r") else line
    if b"\r" in text:
        return "stray carriage return (\\r) inside the line"
    fields = text.split(b"\t")
    if len(fields) != CRITEO_NUM_FIELDS:
        return f"{len(fields)} tab-separated fields, expected {CRITEO_NUM_FIELDS} (truncated or merged line?)"
    if fields[0] not in (b"0", b"1"):
        return f"label {show_value(fields[0])} is not 0 or 1"
    for name, field in zip(CRITEO_DENSE_NAMES, fields[1:1 + CRITEO_NUM_DENSE], strict=True):
        digits = field[1:] if field.startswith(b"-") else field
        if field and not (digits.isdigit() and len(field) <= MAX_DENSE_CHARS):  # bytes.isdigit: ASCII only
            return f"dense field {name} = {show_value(field)} is not an integer"
        if field and not -(2**63) <= int(field) < 2**63:
            return f"dense field {name} = {show_value(field)} overflows int64"
    for name, field in zip(CRITEO_FEATURE_NAMES, fields[1 + CRITEO_NUM_DENSE:], strict=True):
        if field and not (len(field) == 8 and all(c in b"0123456789abcdefABCDEF" for c in field)):
            return f"categorical field {name} = {show_value(field)} is not 8 hex digits"
    return "rejected by the vectorised parser"  # not reached unless the two disagree


# ----------------------------------------------------------------------------------------------------------------------
# Streaming: blocks -> parallel parse (+ per-block work) -> ordered merge into the report
# ----------------------------------------------------------------------------------------------------------------------


def _stream(pieces: Sequence[FileSlice], fn: Callable[[RawChunk], Any], report: ParseReport,
            options: CriteoOptions) -> Iterator[Any]:
    """fn(parsed chunk) for every block of `pieces`, computed on worker threads, yielded in file order."""

    def work(block: TextBlock):
        chunk, block_report = _parse_block(block)
        return fn(chunk), chunk.size, block_report

    blocks = blocks_of(pieces, options.chunk_bytes)
    for result, rows, block_report in ordered_map(work, blocks, options.num_threads):
        merge_report(report, block_report, rows, strict=options.strict,
                     expected="Criteo lines (40 tab-separated fields)")
        yield result


def parse_file(path: str | pathlib.Path, *, strict: bool = False, report: ParseReport | None = None,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, num_threads: int = 2) -> Iterator[RawChunk]:
    """Parsed chunks of a Criteo file (plain or gzip), one per block of about `chunk_bytes`, in file order.

    Bad lines are skipped and recorded in `report` (strict=False) or raise ValueError naming file, line and reason.
    """
    options = CriteoOptions(strict=strict, chunk_bytes=chunk_bytes, num_threads=num_threads)
    yield from parse_slices([FileSlice(str(path))], options, report)


def parse_slices(pieces: Sequence[FileSlice], options: CriteoOptions,
                 report: ParseReport | None = None) -> Iterator[RawChunk]:
    """Parsed chunks of the given file slices, in order (see `parse_file`)."""
    chunks = _stream(pieces, lambda chunk: chunk, report if report is not None else ParseReport(), options)
    yield from (chunk for chunk in chunks if chunk.size)  # a block of only bad or blank lines gives no chunk


# ----------------------------------------------------------------------------------------------------------------------
# Splits
# ----------------------------------------------------------------------------------------------------------------------


def _halves(first_line: int, num_lines: int) -> tuple[int, int]:
    """First lines of the reference's two halves of a day: test = first ceil(n/2) lines, validation = the rest."""
    return first_line, first_line + (num_lines + 1) // 2


def kaggle_splits(path: str | pathlib.Path, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, list[FileSlice]]:
    """The Kaggle train.txt as the reference splits it: {"train": days 0-5, "test": day 6's first half (ceil),
    "validation": day 6's second half}, days being 7 equal runs of lines (the first N % 7 one line longer)."""
    path = str(path)
    index = index_lines(path, chunk_bytes)
    base, extra = divmod(index.lines, KAGGLE_DAYS)
    day_lines = [base + (day < extra) for day in range(KAGGLE_DAYS)]
    train_end = 1 + sum(day_lines[:-1])  # first line of day 6
    test_start, validation_start = _halves(train_end, day_lines[-1])
    test_byte, validation_byte = index.offset_of(test_start), index.offset_of(validation_start)
    return {
        "train": [FileSlice(path, 1, 0, test_byte)],
        "validation": [FileSlice(path, validation_start, validation_byte, None)],
        "test": [FileSlice(path, test_start, test_byte, validation_byte)],
    }


def terabyte_files(data_dir: str | pathlib.Path) -> dict[int, str]:
    """{day: path} of day_0 .. day_23 (each plain or .gz) in `data_dir`."""
    data_dir = pathlib.Path(data_dir)
    files = {}
    for day in range(TERABYTE_DAYS):
        found = [p for p in (data_dir / f"day_{day}", data_dir / f"day_{day}.gz") if p.exists()]
        if len(found) > 1:
            raise ValueError(f"{data_dir}: both day_{day} and day_{day}.gz exist; keep one")
        if found:
            files[day] = str(found[0])
    return files


def terabyte_splits(data_dir: str | pathlib.Path, *, train_days: Sequence[int] = tuple(range(23)),
                    halved_day: int | None = 23, validation_days: Sequence[int] = (), test_days: Sequence[int] = (),
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, list[FileSlice]]:
    """Terabyte days as splits. Default (the reference): train = days 0-22; day 23 halved into "test" (first
    ceil(n/2) lines) and "validation" (the rest). Whole days can also go to validation/test; `halved_day`
    None turns the halving off."""
    days = list(train_days) + list(validation_days) + list(test_days) + ([] if halved_day is None else [halved_day])
    if len(set(days)) != len(days):
        raise ValueError(f"a day is in two splits: train {list(train_days)}, validation {list(validation_days)}, "
                         f"test {list(test_days)}, halved {halved_day}")
    files = terabyte_files(data_dir)
    missing = sorted(set(days) - set(files))
    if missing:
        raise ValueError(f"{data_dir}: no day_N or day_N.gz for days {missing}; download them or change the days")
    splits = {"train": [FileSlice(files[d]) for d in train_days],
              "validation": [FileSlice(files[d]) for d in validation_days],
              "test": [FileSlice(files[d]) for d in test_days]}
    if halved_day is not None:
        path = files[halved_day]
        index = index_lines(path, chunk_bytes)
        test_start, validation_start = _halves(1, index.lines)
        validation_byte = index.offset_of(validation_start)
        splits["test"].append(FileSlice(path, test_start, 0, validation_byte))
        splits["validation"].append(FileSlice(path, validation_start, validation_byte, None))
    return splits


# ----------------------------------------------------------------------------------------------------------------------
# Vocabulary
# ----------------------------------------------------------------------------------------------------------------------


def count_keys(chunk: RawChunk) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per feature (sorted unique raw keys i64[u], counts i64[u]) of one chunk."""
    return count_column_keys([chunk.cats[:, f] for f in range(chunk.cats.shape[1])])


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays
class CriteoVocabulary:
    """Raw key -> index per feature.

    keys[f]: i64[K_f] ascending raw keys that have an index (frequency mode; empty in hash mode);
    indices[f]: i32[K_f] their indices in 1..K_f (descending train frequency, ties by raw key);
    index_counts[f]: i64[vocab_size_f] train occurrences per index (frequency: index 0 = out of vocabulary);
    raw_keys[f], raw_counts[f]: every raw key seen in train with its count (for the statistics).
    """

    mode: str
    max_index: int | None
    keys: tuple[np.ndarray, ...]
    indices: tuple[np.ndarray, ...]
    index_counts: tuple[np.ndarray, ...]
    raw_keys: tuple[np.ndarray, ...]
    raw_counts: tuple[np.ndarray, ...]

    @property
    def vocab_sizes(self) -> tuple[int, ...]:
        return tuple(int(c.size) for c in self.index_counts)

    def spec(self) -> DatasetSpec:
        return DatasetSpec(num_dense=CRITEO_NUM_DENSE, features=tuple(
            FeatureSpec(name, size) for name, size in zip(CRITEO_FEATURE_NAMES, self.vocab_sizes, strict=True)))


def _vocabulary_from_counts(counted: Sequence[tuple[np.ndarray, np.ndarray]], options: CriteoOptions
                            ) -> CriteoVocabulary:
    keys, indices, index_counts = [], [], []
    for raw_keys, raw_counts in counted:
        if options.vocab == "hash":
            keys.append(np.zeros(0, np.int64))
            indices.append(np.zeros(0, np.int32))
            index_counts.append(hash_index_counts(raw_keys, raw_counts, options.max_index))
            continue
        kept_keys, index, counts = frequency_vocabulary(raw_keys, raw_counts, options.frequency_threshold)
        keys.append(kept_keys)
        indices.append(index)
        index_counts.append(counts)
    return CriteoVocabulary(options.vocab, options.max_index, tuple(keys), tuple(indices), tuple(index_counts),
                            tuple(k for k, _ in counted), tuple(c for _, c in counted))


def fit_vocabulary(chunks: Iterable[RawChunk], options: CriteoOptions) -> CriteoVocabulary:
    """The vocabulary of the train split's chunks (see the module doc for the two modes)."""
    counters = [KeyCounter(key_bits=KEY_BITS) for _ in CRITEO_FEATURE_NAMES]
    rows = 0
    for chunk in chunks:
        rows += chunk.size
        for counter, (keys, counts) in zip(counters, count_keys(chunk), strict=True):
            counter.add(keys, counts)
    if rows == 0:
        raise ValueError("the train split has no valid rows; check the files and the parse report")
    return _vocabulary_from_counts([c.result() for c in counters], options)


def _lookup(vocabulary: CriteoVocabulary, f: int, distinct: np.ndarray) -> np.ndarray:
    """Ascending distinct raw keys i64[u] of feature f -> their indices i32[u] (0 = out of vocabulary)."""
    if vocabulary.mode == "hash":
        return (distinct % vocabulary.max_index).astype(np.int32)
    return lookup(vocabulary.keys[f], vocabulary.indices[f], distinct)


def map_ids(vocabulary: CriteoVocabulary, cats: np.ndarray) -> np.ndarray:
    """Raw keys i64[n, 26] -> indices i32[26, n] (feature-major) in [0, vocab_size_f).

    Frequency mode looks up each feature's distinct keys in ascending order (`distinct_inverse`): Criteo's keys
    repeat a lot, and ascending queries walk the vocabulary monotonically -- measured faster than searching every
    key in row order (benchmarks/RESULTS.md#data-criteo-preprocessing).
    """
    n, num_features = cats.shape
    if vocabulary.mode == "hash":
        return (cats.T % vocabulary.max_index).astype(np.int32)
    out = np.empty((num_features, n), np.int32)
    for f in range(num_features):
        distinct, _, inverse = distinct_inverse(cats[:, f], KEY_BITS)
        out[f] = _lookup(vocabulary, f, distinct)[inverse]
    return out


def _to_batch(labels: np.ndarray, dense: np.ndarray, ids: np.ndarray) -> Batch:
    """ids i32[26, n] (feature-major) -> a one-hot Batch (ids i32[n, 1] and lengths 1 per feature)."""
    ones = np.ones(labels.shape[0], np.int32)
    return Batch(dense=dense, ids={name: ids[f][:, None] for f, name in enumerate(CRITEO_FEATURE_NAMES)},
                 lengths={name: ones for name in CRITEO_FEATURE_NAMES}, labels=labels)


def apply(vocabulary: CriteoVocabulary, chunk: RawChunk) -> Batch:
    """A parsed chunk as a Batch: dense f32[n, 13], ids {C_f: i32[n, 1]}, lengths {C_f: 1}, labels f32[n]."""
    return _to_batch(chunk.labels, chunk.dense, map_ids(vocabulary, chunk.cats))


# ----------------------------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------------------------


CriteoStats = VocabularyStats  # stats.json + index_counts.npz (recjax/data/vocabulary.py)


def vocabulary_stats(vocabulary: CriteoVocabulary, options: CriteoOptions) -> CriteoStats:
    """Per-feature statistics of the fitted vocabulary (train split).

    frequency_histogram: raw keys bucketed by floor(log2(train count)): bucket b holds keys seen [2^b, 2^(b+1))
    times; `keys` and `occurrences` per bucket (`recjax.data.vocabulary.frequency_histogram`).
    """
    features = {}
    for f, name in enumerate(CRITEO_FEATURE_NAMES):
        raw_keys, raw_counts = vocabulary.raw_keys[f], vocabulary.raw_counts[f]
        missing = raw_keys.size and raw_keys[-1] == MISSING_CATEGORY
        features[name] = {
            "vocab_size": vocabulary.vocab_sizes[f],
            "train_occurrences": int(raw_counts.sum()),
            "raw_distinct_train": int(raw_keys.size),
            "missing_train": int(raw_counts[-1]) if missing else 0,
            "out_of_vocabulary_train": int(vocabulary.index_counts[f][0]) if vocabulary.mode == "frequency" else 0,
            "frequency_histogram": frequency_histogram(raw_counts),
        }
    summary = {"vocab": options.vocab, "frequency_threshold": options.frequency_threshold,
               "max_index": options.max_index, "vocab_sizes": list(vocabulary.vocab_sizes), "features": features}
    return CriteoStats(summary, dict(zip(CRITEO_FEATURE_NAMES, vocabulary.index_counts, strict=True)))


# ----------------------------------------------------------------------------------------------------------------------
# Preparing splits
# ----------------------------------------------------------------------------------------------------------------------


_Spill = tuple[pathlib.Path, dict[str, tuple[int, str, tuple]]]  # a spilled chunk's file and layout (write_arrays)


def _spill_chunk(chunk: RawChunk, path: pathlib.Path) -> tuple[list[tuple[np.ndarray, np.ndarray]], _Spill]:
    """Write a train chunk compactly -- labels, dense, and per feature its distinct raw keys plus each row's
    position among them (uint16 when the chunk has <= 65536 rows) -- and return per feature (distinct, counts), and
    where the chunk went."""
    n = chunk.size
    inverse = np.empty((CRITEO_NUM_SPARSE, n), np.uint16 if n <= 1 << 16 else np.int32)
    distinct, counted = [], []
    for f in range(CRITEO_NUM_SPARSE):
        keys, counts, inverse[f] = distinct_inverse(chunk.cats[:, f], KEY_BITS)
        distinct.append(keys)
        counted.append((keys, counts))
    layout = write_arrays(path, {"labels": chunk.labels, "dense": chunk.dense, "inverse": inverse,
                                 "distinct": np.concatenate(distinct),
                                 "distinct_sizes": np.array([d.size for d in distinct], np.int64)})
    return counted, (path, layout)


def _spilled_batch(vocabulary: CriteoVocabulary, spill: _Spill) -> Batch:
    """A spilled chunk as a Batch (see `_spill_chunk`): only each feature's distinct keys are looked up."""
    spilled = read_arrays(*spill)
    labels, dense, inverse = spilled["labels"], spilled["dense"], spilled["inverse"]
    distinct = np.split(spilled["distinct"], np.cumsum(spilled["distinct_sizes"])[:-1])
    ids = np.empty(inverse.shape, np.int32)
    for f in range(CRITEO_NUM_SPARSE):
        ids[f] = _lookup(vocabulary, f, distinct[f])[inverse[f]]
    return _to_batch(labels, dense, ids)


@dataclasses.dataclass
class PreparedCriteo:
    """The fitted spec, vocabulary and statistics, and the splits as re-iterable streams of blocks.

    `report` covers the train split from the fitting pass and each other split from the first stream of its blocks
    (each line is counted once). With `options.spill`, train's blocks come from the temporary directory the fitting
    pass wrote: call `close()` (or use `with prepare_criteo(...) as prepared:`) to delete it; it is also deleted
    when this object is garbage-collected.
    """

    spec: DatasetSpec
    vocabulary: CriteoVocabulary = dataclasses.field(repr=False)
    stats: CriteoStats = dataclasses.field(repr=False)
    report: ParseReport
    splits: dict[str, list[FileSlice]]
    options: CriteoOptions
    block_rows: int
    train_split: str = "train"
    spilled: list[_Spill] | None = dataclasses.field(default=None, repr=False)  # train's chunks, in order
    spill_directory: tempfile.TemporaryDirectory | None = None
    reported: set[str] = dataclasses.field(default_factory=set)  # splits whose lines are in `report`

    def blocks(self, split: str) -> Iterator[Batch]:
        """Blocks of `block_rows` examples of `split` in file order (the last block may be short)."""
        if split not in self.splits:
            raise ValueError(f"split '{split}' not found; the prepared data has {sorted(self.splits)}")
        vocabulary = self.vocabulary
        if split == self.train_split and self.spilled is not None:
            if self.spill_directory is None:
                raise ValueError("the spilled train split was deleted by close(); prepare the data again")
            batches = ordered_map(lambda spill: _spilled_batch(vocabulary, spill), self.spilled,
                                   self.options.num_threads)
            return rebatch(batches, self.block_rows)
        # Each split is reported by the first stream of its blocks; train was reported by the fitting pass.
        report = ParseReport() if split in self.reported else self.report
        self.reported.add(split)
        return rebatch(_stream(self.splits[split], lambda chunk: apply(vocabulary, chunk), report, self.options),
                        self.block_rows)

    def close(self) -> None:
        """Delete the spilled train split (if any)."""
        if self.spill_directory is not None:
            self.spill_directory.cleanup()
            self.spill_directory = None

    def __enter__(self) -> PreparedCriteo:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prepare_criteo(splits: Mapping[str, Sequence[FileSlice]], options: CriteoOptions = CriteoOptions(), *,
                   block_rows: int = 8192, train_split: str = "train") -> PreparedCriteo:
    """Fit the vocabulary on `splits[train_split]` (one streaming pass) and return the prepared splits.

    splits: e.g. `kaggle_splits(path)` or `terabyte_splits(directory)`. The blocks are produced lazily by
    `PreparedCriteo.blocks(split)`: train from the spill (or parsed again if `options.spill` is False), the other
    splits parsed then.
    """
    if train_split not in splits:
        raise ValueError(f"train split '{train_split}' not in the splits {sorted(splits)}")
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    report = ParseReport()
    counters = [KeyCounter(key_bits=KEY_BITS) for _ in CRITEO_FEATURE_NAMES]
    spill_directory = tempfile.TemporaryDirectory(prefix="recjax_criteo_spill_", dir=options.spill_dir) \
        if options.spill else None
    spilled: list[_Spill] = []
    names = itertools.count()  # unique file names across worker threads; the order is restored from `results`

    def count(chunk: RawChunk):
        if spill_directory is None or chunk.size == 0:
            return count_keys(chunk), None
        return _spill_chunk(chunk, pathlib.Path(spill_directory.name) / f"chunk_{next(names):07d}.bin")

    try:
        for counted, spill in _stream(splits[train_split], count, report, options):
            if spill is not None:
                spilled.append(spill)
            for counter, (keys, counts) in zip(counters, counted, strict=True):
                counter.add(keys, counts)
        if report.rows_kept == 0:
            if report.empty_files:
                raise DataError(f"{', '.join(report.empty_files)}: the file is empty (0 bytes); expected Criteo lines "
                                "(label, 13 integer and 26 hex fields, tab-separated)")
            raise DataError(f"the train split has no valid rows ({report.summary()}); check the files")
    except BaseException:
        if spill_directory is not None:
            spill_directory.cleanup()
        raise
    vocabulary = _vocabulary_from_counts([c.result() for c in counters], options)
    return PreparedCriteo(vocabulary.spec(), vocabulary, vocabulary_stats(vocabulary, options), report,
                          {name: list(pieces) for name, pieces in splits.items()}, options, block_rows, train_split,
                          spilled if spill_directory is not None else None, spill_directory, {train_split})


def criteo_array_dataset(path: str | pathlib.Path, options: CriteoOptions = CriteoOptions(), seed: int = 0
                         ) -> ArrayDataset:
    """A Kaggle-format file prepared into memory (small files: tests, the shared sample): splits "train",
    "validation", "test" (`kaggle_splits`)."""
    data = {}
    with prepare_criteo(kaggle_splits(path, chunk_bytes=options.chunk_bytes), options) as prepared:
        for split in prepared.splits:
            blocks = list(prepared.blocks(split))
            data[split] = concatenate(blocks) if blocks else _to_batch(
                np.zeros(0, np.float32), np.zeros((0, CRITEO_NUM_DENSE), np.float32),
                np.zeros((CRITEO_NUM_SPARSE, 0), np.int32))
    info = {"parse_report": prepared.report.to_dict(), "criteo_stats": prepared.stats.summary,
            "split_sizes": {name: batch.size for name, batch in data.items()}}
    return ArrayDataset(prepared.spec, data, seed=seed, info=info)


__all__ = [
    "CRITEO_DENSE_NAMES", "CRITEO_FEATURE_NAMES", "CRITEO_NUM_DENSE", "CRITEO_NUM_SPARSE", "MISSING_CATEGORY",
    "CriteoOptions", "CriteoStats", "CriteoVocabulary", "FileSlice", "LineIndex", "ParseReport", "PreparedCriteo",
    "RawChunk", "apply", "count_keys", "count_lines", "criteo_array_dataset", "fit_vocabulary", "index_lines",
    "kaggle_splits", "map_ids", "parse_file", "parse_slices", "prepare_criteo", "terabyte_files", "terabyte_splits",
    "vocabulary_stats",
]
