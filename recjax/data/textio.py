r"""Reading text data files in blocks of whole lines, and reporting what parsing saw (shared by every parser).

    for block in blocks_of([FileSlice("train.txt")], chunk_bytes=4 << 20):   # plain or gzip, cut after a '\n'
        block.first_line, block.data                                          # exact 1-based line numbers
    report = ParseReport()
    merge_report(report, block_report, rows_kept, strict=False, expected="...")  # lenient: skip + record
    for result in ordered_map(parse, blocks, num_threads=2): ...               # threads, results in input order

Files are read in pieces of `chunk_bytes` (gzip through streaming zlib, never whole) and cut at the last '\n' of
each piece, so a block holds whole lines and knows the line number of its first one. A line longer than
`MAX_LINE_BYTES` is never held in memory: its bytes are dropped and the block stands for it (`oversized`), so a
wrong or binary file costs no memory. A gzip stream cut short keeps the lines decoded before the cut; the
truncation is reported on the file's last block.

A parser turns each block into its rows and a `BlockReport` (blank and bad line numbers, the reasons of the first
few bad lines); `merge_report` adds the blocks' reports in file order into one `ParseReport`, and in strict mode
raises on the first bad line, empty file or truncated stream, naming the file, the line and what to do.
"""

from __future__ import annotations

import dataclasses
import pathlib
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from recjax.errors import DataError

DEFAULT_CHUNK_BYTES = 4 << 20  # smaller blocks stay in cache (benchmarks/RESULTS.md#data-criteo-preprocessing)
MAX_REPORTED = 10  # bad / blank line numbers kept in a ParseReport
MAX_LINE_BYTES = 1 << 20  # longer lines are skipped without being held in memory (a wrong or binary file)

_NL = ord("\n")


# ----------------------------------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ParseReport:
    """What parsing saw: counts, the first `MAX_REPORTED` skipped and blank lines, empty and truncated files.

    Filled as blocks are merged (in file order), so it is complete once the iterators that feed it are exhausted.
    Parsers of row-based files (Parquet) count rows as lines.
    """

    lines_read: int = 0  # physical lines, blank and bad ones included
    rows_kept: int = 0
    blank_lines: int = 0
    skipped: int = 0  # bad lines
    first_skipped: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)  # (file, line, reason)
    first_blank: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    empty_files: list[str] = dataclasses.field(default_factory=list)
    truncated_files: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (file, reason)

    def to_dict(self) -> dict[str, Any]:
        return {
            "lines_read": self.lines_read, "rows_kept": self.rows_kept, "blank_lines": self.blank_lines,
            "skipped": self.skipped,
            "first_skipped": [{"file": f, "line": n, "reason": r} for f, n, r in self.first_skipped],
            "first_blank": [{"file": f, "line": n} for f, n in self.first_blank],
            "empty_files": list(self.empty_files),
            "truncated_files": [{"file": f, "reason": r} for f, r in self.truncated_files],
        }

    def summary(self) -> str:
        """One line for a log."""
        text = (f"{self.lines_read} lines: {self.rows_kept} rows kept, {self.skipped} bad lines skipped, "
                f"{self.blank_lines} blank")
        if self.first_skipped:
            text += "; first bad: " + "; ".join(f"{f}:{n}: {r}" for f, n, r in self.first_skipped[:3])
        if self.empty_files:
            text += "; empty: " + ", ".join(self.empty_files)
        if self.truncated_files:
            text += "; truncated: " + ", ".join(f for f, _ in self.truncated_files)
        return text


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays
class BlockReport:
    """What parsing one block saw, before it is merged into a `ParseReport`.

    blank, bad: i64 line numbers (ascending); reasons: why, for the first MAX_REPORTED bad lines.
    """

    path: str
    lines: int
    blank: np.ndarray
    bad: np.ndarray
    reasons: tuple[str, ...]
    truncated: str | None = None
    cut_line: int | None = None  # the incomplete line a truncated stream ends in, if any
    empty_file: bool = False
    last_complete_line: int | None = None  # truncated: the last line read whole (None: cut_line - 1, if known)


def merge_report(report: ParseReport, block: BlockReport, rows: int, *, strict: bool, expected: str,
                 lenient_hint: str = "parse with strict=False", line_word: str = "line") -> None:
    """Add one block's counts to `report`; in strict mode raise on its first bad line, truncation or empty file.

    expected: what a file should hold, for the empty-file error (e.g. "Criteo lines (40 tab-separated fields)").
    lenient_hint: how the user turns strict mode off (e.g. "set data.strict=False").
    line_word: "line" for text files, "row" for row-based files.
    """
    if block.empty_file:
        if strict:
            raise DataError(f"{block.path}: the file is empty; expected {expected}. Remove the file, or "
                             f"{lenient_hint} to skip it and list it in the parse report")
        report.empty_files.append(block.path)
    last = block.last_complete_line if block.last_complete_line is not None else (
        block.cut_line - 1 if block.cut_line else None)
    after = f": the file is truncated after {line_word} {last}" if last is not None else ""
    if strict and block.truncated and (block.bad.size == 0 or block.bad[0] == block.cut_line):
        where = f" (in {line_word} {block.cut_line})" if block.cut_line else ""
        raise DataError(f"{block.path}: {block.truncated}{where}{after}; re-download or re-compress the file, or "
                         f"{lenient_hint} to keep the {line_word}s before the cut")
    if strict and block.bad.size:
        raise DataError(f"{block.path}: {line_word} {block.bad[0]}: {block.reasons[0]}; fix or remove the "
                         f"{line_word}, or {lenient_hint} to skip and report bad {line_word}s")
    report.lines_read += block.lines
    report.rows_kept += rows
    report.blank_lines += block.blank.size
    report.skipped += block.bad.size
    room = MAX_REPORTED - len(report.first_skipped)
    report.first_skipped += [(block.path, int(n), r) for n, r in zip(block.bad[:room], block.reasons[:room],
                                                                      strict=False)]
    room = MAX_REPORTED - len(report.first_blank)
    report.first_blank += [(block.path, int(n)) for n in block.blank[:room]]
    if block.truncated:
        report.truncated_files.append((block.path, block.truncated + (
            f"; the last complete {line_word} is {last}" if last is not None else "")))


def show_value(field: bytes | str, limit: int = 24) -> str:
    """A field's text for a message: quoted, cut at `limit` characters."""
    text = field.decode("latin-1") if isinstance(field, bytes) else field
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


# ----------------------------------------------------------------------------------------------------------------------
# Reading: plain or gzip bytes, cut into blocks of whole lines
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FileSlice:
    """Lines of one file: uncompressed bytes [start_byte, end_byte) (None = to the end), starting at line `first_line`.

    Offsets are on line starts (e.g. as `LineIndex.offset_of` computes them), so line numbers stay exact.
    """

    path: str
    first_line: int = 1
    start_byte: int = 0
    end_byte: int | None = None


def is_gzip(path: str | pathlib.Path) -> bool:
    """Whether the file starts with the gzip magic bytes (whatever its name)."""
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


class ByteReader:
    """Uncompressed bytes [start, end) of a plain or gzip file, in pieces of at most `piece_bytes`.

    After iteration, `truncated` says why a gzip stream ended early (cut short or corrupt), else None. Gzip is
    decoded with zlib directly (not gzip.GzipFile), so every byte decoded before a cut is delivered.
    """

    def __init__(self, path: str, start: int = 0, end: int | None = None, piece_bytes: int = DEFAULT_CHUNK_BYTES):
        self.path, self.start, self.end, self.piece_bytes = path, start, end, piece_bytes
        self.truncated: str | None = None

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            if f.read(2) == b"\x1f\x8b":
                f.seek(0)
                pieces = self._gunzip(f)
            else:
                f.seek(self.start)
                pieces = iter(lambda: f.read(self.piece_bytes), b"")
                pos = self.start
                for piece in pieces:
                    if self.end is not None and pos + len(piece) >= self.end:
                        yield piece[:self.end - pos]
                        return
                    pos += len(piece)
                    yield piece
                return
            pos = 0  # uncompressed offset of the next decoded byte
            for piece in pieces:
                lo, hi = max(self.start - pos, 0), len(piece)
                if self.end is not None:
                    hi = min(hi, self.end - pos)
                if lo < hi:
                    yield piece[lo:hi]
                pos += len(piece)
                if self.end is not None and pos >= self.end:
                    return

    def _gunzip(self, f) -> Iterator[bytes]:
        decoder = zlib.decompressobj(wbits=31)
        pending = b""  # compressed input not yet consumed
        while True:
            if not pending:
                pending = f.read(1 << 20)
                if not pending:
                    break
            try:
                out = decoder.decompress(pending, self.piece_bytes)
            except zlib.error as error:
                self.truncated = f"corrupt gzip data ({error})"
                return
            pending = decoder.unconsumed_tail
            if out:
                yield out
            if decoder.eof:  # end of one gzip member: another may follow (concatenated members), or zero padding
                pending = decoder.unused_data  # all input after the member (unconsumed_tail may repeat it)
                while pending and not pending.strip(b"\0"):
                    pending = f.read(1 << 20)
                if not pending:
                    return
                decoder = zlib.decompressobj(wbits=31)
        try:
            out = decoder.flush()  # output zlib still holds when the input ended on a max_length boundary
        except zlib.error as error:
            self.truncated = f"corrupt gzip data ({error})"
            return
        if out:
            yield out
        if not decoder.eof:
            self.truncated = "gzip stream ends before its end-of-stream marker (file cut short?)"


@dataclasses.dataclass(frozen=True)
class TextBlock:
    """Whole lines of one file; the last one may lack '\n' (end of file, or `truncated` stream)."""

    path: str
    data: bytes
    first_line: int
    truncated: str | None = None  # set on the file's last block if the gzip stream was cut: its tail is incomplete
    oversized: bool = False  # the block stands for one line longer than MAX_LINE_BYTES (its bytes were dropped)
    empty_file: bool = False  # the block stands for a file without a single byte

    @property
    def cut_line(self) -> bool:
        """Whether the block ends in the incomplete line of a truncated stream."""
        return bool(self.truncated and self.data and not self.data.endswith(b"\n"))


def line_blocks(piece: FileSlice, chunk_bytes: int) -> Iterator[TextBlock]:
    """Blocks of about `chunk_bytes` cut after a '\n'; an empty file yields nothing."""
    reader = ByteReader(piece.path, piece.start_byte, piece.end_byte, chunk_bytes)
    line, carry, skipping = piece.first_line, b"", False
    for data in reader:
        if skipping:  # inside an oversized line: drop bytes up to its end
            end = data.find(b"\n")
            if end < 0:
                continue
            yield TextBlock(piece.path, b"", line, oversized=True)
            line, data, skipping = line + 1, data[end + 1:], False
        data = carry + data if carry else data
        cut = data.rfind(b"\n") + 1
        if cut == 0:  # no line end yet: keep reading, unless the line is too long to be data (a wrong or binary file)
            carry, skipping = (b"", True) if len(data) > MAX_LINE_BYTES else (data, False)
            continue
        block, carry = data[:cut], data[cut:]
        yield TextBlock(piece.path, block, line)
        line += block.count(b"\n")
    if skipping:
        yield TextBlock(piece.path, b"", line, oversized=True)
        line += 1
    if carry or reader.truncated:
        yield TextBlock(piece.path, carry, line, reader.truncated)


def blocks_of(pieces: Sequence[FileSlice], chunk_bytes: int) -> Iterator[TextBlock]:
    """The blocks of every slice in order; a whole file with no bytes gives one `empty_file` block."""
    for piece in pieces:
        any_block = False
        for block in line_blocks(piece, chunk_bytes):
            any_block = True
            yield block
        if not any_block and piece.start_byte == 0 and piece.end_byte is None:
            yield TextBlock(piece.path, b"", piece.first_line, empty_file=True)


def ordered_map(fn: Callable, items: Iterable, num_threads: int) -> Iterator:
    """fn over items on `num_threads` threads, results in input order, at most num_threads + 1 in flight.

    Parsers spend their time in numpy / pyarrow calls that release the GIL, so threads run them in parallel;
    merging results in input order keeps reports and errors deterministic.
    """
    if num_threads <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(num_threads) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) > num_threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def write_arrays(path: pathlib.Path, arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[int, str, tuple]]:
    """Arrays' raw bytes one after the other (8-byte aligned) -> their layout {name: (offset, dtype, shape)}: how the
    parsers spill chunks to disk. Not np.savez: np.load's per-array zip and header parsing cost more than the reads
    themselves (benchmarks/RESULTS.md#data-tabular-preparation), and its header parsing (ast.literal_eval) on the
    threads of `ordered_map` failed here on CPython 3.11.7 with a spurious "SystemError: AST constructor recursion
    depth mismatch" (the error of python/cpython#106905: the AST builder's depth counter is not per thread)."""
    layout, offset = {}, 0
    with open(path, "wb") as f:
        for name, array in arrays.items():
            array = np.ascontiguousarray(array)
            pad = -array.nbytes % 8
            f.write(memoryview(array).cast("B") if array.nbytes else b"")
            f.write(bytes(pad))
            layout[name] = (offset, array.dtype.str, array.shape)
            offset += array.nbytes + pad
    return layout


def read_arrays(path: pathlib.Path, layout: Mapping[str, tuple[int, str, tuple]]) -> dict[str, np.ndarray]:
    """The arrays of `write_arrays`, as writable views of one read."""
    data = np.fromfile(path, np.uint8)
    return {name: data[offset:offset + int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
            for name, (offset, dtype, shape) in layout.items()}


# ----------------------------------------------------------------------------------------------------------------------
# Line indexes: line number -> byte offset
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays
class LineIndex:
    """Where the lines of a file are: enough to turn a line number into a byte offset by re-reading one piece.

    piece_starts: i64[P + 1] uncompressed offset of each piece read, then the file's size;
    newlines_before: i64[P + 1] '\n' bytes before each piece, then the total.
    """

    path: str
    lines: int
    piece_starts: np.ndarray
    newlines_before: np.ndarray

    def offset_of(self, line: int) -> int:
        """Uncompressed byte offset where 1-based `line` begins (the file's size for a line past the end)."""
        if line <= 1:
            return 0
        if line > self.lines:
            return int(self.piece_starts[-1])
        # Line t begins after the (t-1)-th newline; find the piece holding it and look inside.
        p = int(np.searchsorted(self.newlines_before, line - 1, side="left")) - 1
        lo, hi = int(self.piece_starts[p]), int(self.piece_starts[p + 1])
        piece = b"".join(ByteReader(self.path, lo, hi))
        newlines = np.flatnonzero(np.frombuffer(piece, np.uint8) == _NL)
        return lo + int(newlines[line - 2 - self.newlines_before[p]]) + 1


def index_lines(path: str | pathlib.Path, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> LineIndex:
    """Count the lines of a file in one streaming pass (bytes.count runs at memory speed).

    A line is what '\n' ends, plus a last line without '\n' if it has any bytes (blank and bad lines count).
    """
    starts, before = [0], [0]
    last = b"\n"
    for piece in ByteReader(str(path), piece_bytes=chunk_bytes):
        starts.append(starts[-1] + len(piece))
        before.append(before[-1] + piece.count(b"\n"))
        last = piece[-1:]
    return LineIndex(str(path), before[-1] + (last != b"\n"), np.array(starts, np.int64), np.array(before, np.int64))


def count_lines(path: str | pathlib.Path, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Number of lines in a plain or gzip file (see `index_lines`)."""
    return index_lines(path, chunk_bytes).lines


__all__ = [
    "DEFAULT_CHUNK_BYTES", "MAX_LINE_BYTES", "MAX_REPORTED", "BlockReport", "ByteReader", "FileSlice", "LineIndex",
    "ParseReport", "TextBlock", "blocks_of", "count_lines", "index_lines", "is_gzip", "line_blocks", "merge_report",
    "ordered_map", "show_value",
]
