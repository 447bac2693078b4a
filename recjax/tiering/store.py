"""Where a cached table's rows live outside the cache: a plain file per physical table (disk), or a numpy array in
host RAM (the host tier on an accelerator).

A table's file holds one record per row, f32[rows, width]: the row's values then its optimizer-state values (a
Adagrad accumulator row, lazy Adam's m and v rows, ...), so one read brings everything a step needs of a row.

The engine was chosen by measurement (benchmarks/tiering.py --only engines; benchmarks/RESULTS.md, "Disk tier: the
storage engine"): the file is mapped (MAP_SHARED) and rows are gathered / scattered with numpy fancy indexing, split
over a thread pool so that the page faults of rows not in the page cache are in flight together (the disk of the
measuring machine served 7.0k random 4 KiB reads/s one at a time and 22.5k with 16 in flight). Rows the page cache
holds are gathered 7x faster than by pread (a system call per row) and written 12x faster than by pwrite; rows it
does not hold cost the disk's random reads either way (20.5k vs 24.2k rows/s). LMDB and RocksDB (rocksdict) spend
their time in per-key Python calls, and tensorstore's chunked zarr arrays re-write whole chunks.

Two things a mapping needs that a pread would not:
  * RSS: the pages a process touches through a shared mapping count in its resident set (they are the page cache's,
    reclaimable, but ru_maxrss counts them), so after `_MAPPED_BYTES` of touched pages the store drops them from this
    process (madvise MADV_DONTNEED: dirty pages stay dirty in the page cache and reach the file as usual).
  * Errors: reading a mapped page past the end of a truncated file is a SIGBUS, not an exception, so every access is
    preceded by `check()` (fstat: the file still has its size; stat: its path still names it) and a file that fails
    it is a `StorageError` naming it. Files are allocated in full when created (posix_fallocate) and written in full
    with the initial rows, so a full disk is found there, before training, never by a write-back.
"""

import errno
import mmap
import os
import pathlib
import shutil
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from recjax.errors import StorageError

_MAPPED_BYTES = 1 << 30  # touched-page bytes after which the mappings are dropped from this process (RSS bound)
_MIN_ROWS_PER_TASK = 512  # a thread-pool task gathers at least this many rows (below, one call is cheaper)


class TableFile:
    """One physical table's records f32[rows, width] in the file `path`, created (allocated in full) or opened."""

    def __init__(self, path: pathlib.Path, name: str, rows: int, width: int):
        self.path, self.name, self.rows, self.width = path, name, rows, width
        self.size = rows * width * 4
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as error:
            raise StorageError(f"table file {path} (table {name}): cannot create it ({error.strerror}); set "
                               "tiering.dir to a writable directory") from error
        self.inode = os.fstat(self.fd).st_ino
        try:
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as error:
            self._close_fd()
            raise _write_error(error, path, name, self.size) from error
        self._map: mmap.mmap | None = None
        self.array: np.ndarray | None = None

    def write_block(self, row: int, records: np.ndarray) -> None:
        """Write records f32[n, width] at rows [row, row + n) with plain writes (the initial rows, in order)."""
        data = np.ascontiguousarray(records, np.float32).view(np.uint8).reshape(-1)
        offset, done = row * self.width * 4, 0
        while done < data.size:
            try:
                done += os.pwrite(self.fd, data[done:], offset + done)
            except OSError as error:
                raise _write_error(error, self.path, self.name, self.size) from error

    def read_block(self, row: int, n: int) -> np.ndarray:
        """Records f32[n, width] of rows [row, row + n) with plain reads (the page cache shares them with the mapping,
        so they are the rows the mapping last wrote)."""
        self.check()
        out = np.empty((n, self.width), np.float32)
        data = memoryview(out.reshape(-1).view(np.uint8))
        offset, done = row * self.width * 4, 0
        while done < len(data):
            try:
                got = os.preadv(self.fd, [data[done:]], offset + done)
            except OSError as error:
                raise StorageError(f"table file {self.path} (table {self.name}): {error.strerror}") from error
            if not got:
                raise StorageError(f"table file {self.path} (table {self.name}) ends before row {row + n:,}; "
                                   "something outside the run truncated it, so its rows are lost: start the run again")
            done += got
        return out

    def open_mapping(self) -> np.ndarray:
        """The records as a mapped array f32[rows, width] (after the initial rows are written)."""
        self.check()
        self._map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._map.madvise(mmap.MADV_RANDOM)  # rows are scattered: no read-ahead around a fault
        self.array = np.frombuffer(self._map, np.float32).reshape(self.rows, self.width)
        return self.array

    def check(self) -> None:
        """Raise a StorageError naming the file if it was truncated, removed or replaced since it was written."""
        size = os.fstat(self.fd).st_size
        if size < self.size:
            raise StorageError(f"table file {self.path} (table {self.name}) is truncated: {size:,} bytes, its "
                               f"{self.rows:,} rows need {self.size:,}; something outside the run changed it, so its "
                               "rows are lost: start the run again")
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            inode = None
        if inode != self.inode:
            what = "is missing" if inode is None else "was replaced by another file"
            raise StorageError(f"table file {self.path} (table {self.name}) {what}; something outside the run removed "
                               "it, so its rows are lost: start the run again")

    def drop_pages(self) -> None:
        """Unmap the touched pages from this process (they stay in the page cache; dirty ones are still written)."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def flush(self) -> None:
        if self._map is not None:
            try:
                self._map.flush()
            except OSError as error:
                raise _write_error(error, self.path, self.name, self.size) from error

    def close(self) -> None:
        self.array = None  # the mapping cannot close while an array exports its buffer
        if self._map is not None:
            self._map.close()
            self._map = None
        self._close_fd()

    def _close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_error(error: OSError, path: pathlib.Path, name: str, size: int) -> StorageError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        free = shutil.disk_usage(path.parent).free
        return StorageError(f"table file {path} (table {name}): the disk is full ({error.strerror}); the file needs "
                            f"{size:,} bytes and {free:,} are free; free space or set tiering.dir to a larger disk")
    return StorageError(f"table file {path} (table {name}): {error.strerror}")


class TableArray:
    """One physical table's records f32[rows, width] in host RAM (the host tier): a TableFile without the file."""

    def __init__(self, name: str, rows: int, width: int):
        self.name, self.rows, self.width = name, rows, width
        self.array = np.zeros((rows, width), np.float32)

    def write_block(self, row: int, records: np.ndarray) -> None:
        self.array[row: row + len(records)] = records

    def read_block(self, row: int, n: int) -> np.ndarray:
        return np.array(self.array[row: row + n])

    def open_mapping(self) -> np.ndarray:
        return self.array

    def check(self) -> None:
        pass

    def drop_pages(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.array = None


class RowStore:
    """The cached tables of one stacked group: records addressed by stacked row id.

    tables: (name, first stacked row, rows, directory) of each cached physical table, in stacking order; a directory
    None keeps that table's records in host RAM (the host tier), else they go to a file in it (the disk tier). Reads
    and writes of different rows may run on different threads at once (the cache never has a row in flight both ways,
    recjax/tiering/storage.py).
    """

    def __init__(self, tables: Sequence[tuple[str, int, int, pathlib.Path | None]], width: int, threads: int = 16):
        self.width = width
        self.starts = np.asarray([start for _, start, _, _ in tables], np.int64)
        self.stops = np.asarray([start + rows for _, start, rows, _ in tables], np.int64)
        self.names = [name for name, _, _, _ in tables]
        self.backings: list[TableFile | TableArray] = []
        for name, _, rows, directory in tables:
            self.backings.append(TableArray(name, rows, width) if directory is None else
                                 TableFile(directory / (name.replace("/", ".") + ".f32"), name, rows, width))
        self.arrays: list[np.ndarray] = []
        self._mapped = any(isinstance(b, TableFile) for b in self.backings)
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="recjax-rows")
        self._threads = max(1, threads)
        self._touched = 0  # rows touched through the mappings since they were last dropped
        self._lock = threading.Lock()
        self.rows_read = self.rows_written = 0

    @property
    def files(self) -> list[TableFile]:
        return [b for b in self.backings if isinstance(b, TableFile)]

    @property
    def nbytes(self) -> int:
        return int((self.stops - self.starts).sum()) * self.width * 4

    # ------------------------------------------------------------------------------------------ initial rows
    def write_initial(self, start: int, records: np.ndarray) -> None:
        """Records f32[n, width] of the stacked rows [start, start + n), which all belong to cached tables, in order
        (the initial rows; before `open`)."""
        for t, lo, hi in self._spans(start, start + len(records)):
            self.backings[t].write_block(int(lo - self.starts[t]), records[lo - start: hi - start])

    def open(self) -> None:
        """Map the files once their initial rows are written."""
        self.arrays = [b.open_mapping() for b in self.backings]

    def _spans(self, start: int, stop: int):
        for t in range(len(self.starts)):
            lo, hi = max(start, self.starts[t]), min(stop, self.stops[t])
            if lo < hi:
                yield t, int(lo), int(hi)

    # -------------------------------------------------------------------------------------------- row access
    def check(self) -> None:
        for b in self.backings:
            b.check()

    def read(self, rows: np.ndarray, *, count: bool = True) -> np.ndarray:
        """Records f32[n, width] of the stacked rows i64[n] (each must belong to a cached table); `count` False
        leaves the training statistics (`rows_read`) alone (a checkpoint's reads)."""
        out = np.empty((len(rows), self.width), np.float32)

        def gather(array, local, positions):
            out[positions] = array[local]

        self._each(rows, gather)
        if count:
            self.rows_read += len(rows)
        return out

    def write(self, rows: np.ndarray, records: np.ndarray) -> None:
        """Store records f32[n, width] at the stacked rows i64[n] (distinct)."""

        def scatter(array, local, positions):
            array[local] = records[positions]

        self._each(rows, scatter)
        self.rows_written += len(rows)

    def read_range(self, start: int, stop: int) -> np.ndarray:
        """Records of the stacked rows [start, stop) (all of one or more cached tables), in order: a checkpoint reads
        the tables so, block by block, with plain reads (`TableFile.read_block`), so that its pages never count in
        this process's RSS as the mapping's would."""
        self.check()
        return np.concatenate([self.backings[t].read_block(lo - int(self.starts[t]), hi - lo)
                               for t, lo, hi in self._spans(start, stop)])

    def _each(self, rows: np.ndarray, op) -> None:
        """op(array, local rows, positions in `rows`) over each table's share of `rows`, split over the pool so the
        page faults of rows not in the page cache wait on the disk together."""
        if not len(rows):
            return
        self.check()
        rows = np.asarray(rows, np.int64)
        table = np.searchsorted(self.starts, rows, side="right") - 1
        if np.any(table < 0) or np.any(rows >= self.stops[np.maximum(table, 0)]):
            bad = rows[(table < 0) | (rows >= self.stops[np.maximum(table, 0)])][0]
            raise AssertionError(f"stacked row {bad} is in none of the cached tables {self.names}")
        tasks = []
        for t in np.unique(table):
            positions = np.flatnonzero(table == t)
            local = rows[positions] - self.starts[t]
            parts = max(1, min(self._threads, len(positions) // _MIN_ROWS_PER_TASK))
            for chunk in np.array_split(np.arange(len(positions)), parts):
                tasks.append((self.arrays[t], local[chunk], positions[chunk]))
        if len(tasks) == 1:
            op(*tasks[0])
        else:
            for future in [self._pool.submit(op, *task) for task in tasks]:
                future.result()
        if self._mapped:
            self._note_touched(len(rows))

    def _note_touched(self, rows: int) -> None:
        # A record can straddle two pages; count one per row (the bound is loose by design, the drop is cheap).
        with self._lock:
            self._touched += rows
            if self._touched * mmap.PAGESIZE < _MAPPED_BYTES:
                return
            self._touched = 0
        for b in self.backings:
            b.drop_pages()

    # ------------------------------------------------------------------------------------------------ end
    def flush(self) -> None:
        for b in self.backings:
            b.flush()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.arrays = []
        for b in self.backings:
            b.close()
