"""Where a cached table's rows live outside the cache: a plain file per physical table (disk), or a numpy array in
host RAM (the host tier on an accelerator).

A table's file holds one record per row, f32[rows, width]: the row's values then its optimizer-state values (a
Adagrad accumulator row, lazy Adam's m and v rows, ...), so one read brings everything a step needs of a row.

Rows are read and written with pread / pwrite, a system call per row, split over a thread pool so that the reads of
rows not in the page cache are in flight together (a disk serves random reads faster with many in flight). Chosen by
measurement (benchmarks/tiering.py --only engines; benchmarks/RESULTS.md, "Disk tier: the storage engine") over two
ways through a mapping of the file:
  * numpy gathers / scatters on the mapped array (the engine until session 17): faster on rows the page cache holds,
    but it cannot be made safe: a mapped page past the end of a file something outside the run truncated is a SIGBUS,
    which kills the process wherever it happens -- a size check before the access leaves a window (a run died so in
    its write-back thread).
  * the kernel copying rows through the mapping (process_vm_readv / writev on this process's own memory), where a
    fault it cannot serve ends the call early instead of raising SIGBUS: as safe, slower than pread / pwrite there,
    and its pages count in this process's RSS in amounts only the kernel knows -- a fault maps the page cache's
    neighbours of the page (its fault-around window) or a whole large folio, so counting a page per row, as the old
    cap did, let many times the cap be mapped.
pread / pwrite map nothing: the table files' pages stay in the page cache, out of the process's RSS, and there is no
cap to hold. Rows the page cache does not hold cost the disk's random reads whichever way they are asked for.

The page cache is kept to single pages (the initial rows written a page at a time, rows read without read-ahead): a
row written back dirties its whole folio, and a large one (up to 2 MiB) made each write-back many times dearer.

A truncated, removed or replaced file is a `StorageError` naming it, never a wrong row: each access checks the file
first (fstat: its size and its allocated blocks; stat: its path still names it), a read that comes back short checks
again, and so does every write -- a pwrite past the end of a truncated file extends it again, but the blocks freed by
the truncation stay missing. Files are allocated in full when created (posix_fallocate) and written in full with the
initial rows, so a full disk is found there, before training; a write the disk still refuses (a copy-on-write file
system) is an error naming the file, the bytes and the disk's free space.
"""

import errno
import os
import pathlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from recjax.errors import StorageError, free_bytes

_MIN_ROWS_PER_TASK = 512  # a thread-pool task reads or writes at least this many rows (below, one thread is cheaper)
_SPAN_BYTES = 4 << 20  # sorted rows at least _SPAN_DENSITY dense are written back by spans of the file of this size
_SPAN_DENSITY = 1 / 32
_PAGE = os.sysconf("SC_PAGE_SIZE")

RESUME = "rerun the same command to resume from the last checkpoint (or start again)"


class TableFile:
    """One physical table's records f32[rows, width] in the file `path`, created (allocated in full)."""

    def __init__(self, path: pathlib.Path, name: str, rows: int, width: int):
        self.path, self.name, self.rows, self.width = path, name, rows, width
        self.record_bytes = width * 4
        self.size = rows * self.record_bytes
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
            raise _write_error(error, path, name, self.size, "the file") from error
        # Whether the file system allocated every block (most do; a compressing one may not): then a file with fewer
        # blocks lost some -- truncated and extended again, by something else or by a pwrite past its new end.
        self.allocated = os.fstat(self.fd).st_blocks * 512 >= self.size
        # Rows are read at random: no read-ahead around them (whose large folios would make each row written back
        # later cost its whole folio, `write_block`).
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def write_block(self, row: int, records: np.ndarray) -> None:
        """Write records f32[n, width] at rows [row, row + n) (the initial rows, in order), a page per write: a
        larger write fills the page cache with large folios (up to 2 MiB, ext4 on Linux 6.x), and a row written back
        later dirties its whole folio, so writing it back costs the folio (benchmarks/RESULTS.md, "Disk tier: the
        storage engine")."""
        data = memoryview(np.ascontiguousarray(records, np.float32).reshape(-1).view(np.uint8))
        offset, done = row * self.record_bytes, 0
        while done < len(data):
            size = min(len(data) - done, _PAGE - (offset + done) % _PAGE)  # up to the next page boundary
            try:
                done += os.pwrite(self.fd, data[done: done + size], offset + done)
            except OSError as error:
                raise _write_error(error, self.path, self.name, self.size, "the file") from error

    def read_block(self, row: int, n: int) -> np.ndarray:
        """Records f32[n, width] of rows [row, row + n)."""
        self.check()
        out = np.empty((n, self.width), np.float32)
        data = memoryview(out.reshape(-1).view(np.uint8))
        offset, done = row * self.record_bytes, 0
        while done < len(data):
            got = self._read(data[done:], offset + done, row + (done // self.record_bytes))
            if not got:
                self._short(row + done // self.record_bytes)
            done += got
        return out

    def read_rows(self, local: np.ndarray, out: np.ndarray, positions: np.ndarray) -> None:
        """out[positions] = the records of rows `local` i64[n] (`out` f32[N, width], C-contiguous)."""
        rb = self.record_bytes
        view = memoryview(out.reshape(-1).view(np.uint8))
        for row, at in zip(local.tolist(), positions.tolist(), strict=True):
            if self._read(view[at * rb: (at + 1) * rb], row * rb, row) < rb:
                self._short(row)

    def write_rows(self, local: np.ndarray, records: np.ndarray, positions: np.ndarray) -> None:
        """Rows `local` i64[n] = records[positions] (`records` f32[N, width], C-contiguous)."""
        rb = self.record_bytes
        if len(local) > 1 and np.all(local[1:] > local[:-1]) and len(local) >= _SPAN_DENSITY * (local[-1] - local[0]):
            self._write_spans(local, records, positions)
            return
        view = memoryview(records.reshape(-1).view(np.uint8))
        for row, at in zip(local.tolist(), positions.tolist(), strict=True):
            try:
                done = os.pwrite(self.fd, view[at * rb: (at + 1) * rb], row * rb)
            except OSError as error:
                raise _write_error(error, self.path, self.name, len(local) * rb, "writing rows") from error
            if done < rb:  # a write the disk took in part: a full disk
                raise _write_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), self.path, self.name,
                                   len(local) * rb, "writing rows")
        self.check()  # a pwrite past the end of a truncated file extends it again: the check sees its freed blocks

    def _write_spans(self, local: np.ndarray, records: np.ndarray, positions: np.ndarray) -> None:
        """`write_rows` for sorted rows dense in their range (a write-back of a full cache): each span of the file
        read, its rows patched, written back a page per write (`write_block`). A record is smaller than a page and a
        page not in the page cache is read before a write to it, so a write per row waits on a read per page (~20k
        rows/s here), where a span's one read streams (benchmarks/RESULTS.md, "The 52 GB preset at steady state").
        A span ends at the last row given: the rows past it may be another thread's."""
        span, last = max(1, _SPAN_BYTES // self.record_bytes), int(local[-1]) + 1
        i = 0
        while i < len(local):
            lo = int(local[i])
            hi = min(lo + span, last)
            j = int(np.searchsorted(local, hi))
            block = self.read_block(lo, hi - lo)
            block[local[i:j] - lo] = records[positions[i:j]]
            self.write_block(lo, block)
            i = j
        self.check()

    def _read(self, buffer: memoryview, offset: int, row: int) -> int:
        try:
            return os.preadv(self.fd, [buffer], offset)
        except OSError as error:
            raise StorageError(f"table file {self.path} (table {self.name}): cannot read row {row:,} "
                               f"({error.strerror}); {RESUME}") from error

    def _short(self, row: int) -> None:
        """A read came back short at `row`: the file changed (the check says how), else it ends early."""
        self.check()
        raise StorageError(f"table file {self.path} (table {self.name}) ends before row {row:,}; something outside "
                           f"the run changed it, so its rows are lost: {RESUME}")

    def check(self) -> None:
        """Raise a StorageError naming the file if it was truncated, removed or replaced since it was written."""
        stat = os.fstat(self.fd)
        if stat.st_size < self.size:
            raise StorageError(f"table file {self.path} (table {self.name}) is truncated: {stat.st_size:,} bytes, its "
                               f"{self.rows:,} rows need {self.size:,}; something outside the run changed it, so its "
                               f"rows are lost: {RESUME}")
        if self.allocated and stat.st_blocks * 512 < self.size:
            raise StorageError(f"table file {self.path} (table {self.name}) was truncated: it holds "
                               f"{stat.st_blocks * 512:,} bytes of its {self.size:,}; something outside the run "
                               f"changed it, so its rows are lost: {RESUME}")
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            inode = None
        if inode != self.inode:
            what = "is missing" if inode is None else "was replaced by another file"
            raise StorageError(f"table file {self.path} (table {self.name}) {what}; something outside the run removed "
                               f"it, so its rows are lost: {RESUME}")

    def flush(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as error:
            raise _write_error(error, self.path, self.name, self.size, "the file") from error

    def close(self) -> None:
        self._close_fd()

    def _close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_error(error: OSError, path: pathlib.Path, name: str, nbytes: int, what: str) -> StorageError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return StorageError(f"table file {path} (table {name}): the disk is full ({error.strerror}); {what} needs "
                            f"{nbytes:,} bytes and {free_bytes(path.parent):,} are free; free space or set tiering.dir "
                            f"to a larger disk, then {RESUME}")
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

    def read_rows(self, local: np.ndarray, out: np.ndarray, positions: np.ndarray) -> None:
        out[positions] = self.array[local]

    def write_rows(self, local: np.ndarray, records: np.ndarray, positions: np.ndarray) -> None:
        self.array[local] = records[positions]

    def check(self) -> None:
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
        try:
            for name, _, rows, directory in tables:
                self.backings.append(TableArray(name, rows, width) if directory is None else
                                     TableFile(directory / (name.replace("/", ".") + ".f32"), name, rows, width))
        except BaseException:
            for b in self.backings:
                b.close()
            raise
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="recjax-rows")
        self._threads = max(1, threads)
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
        """The initial rows are written: check the files hold them."""
        self.check()

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
        self._each(rows, lambda backing, local, positions: backing.read_rows(local, out, positions))
        if count:
            self.rows_read += len(rows)
        return out

    def write(self, rows: np.ndarray, records: np.ndarray) -> None:
        """Store records f32[n, width] at the stacked rows i64[n] (distinct)."""
        records = np.ascontiguousarray(records, np.float32)
        self._each(rows, lambda backing, local, positions: backing.write_rows(local, records, positions))
        self.rows_written += len(rows)

    def read_range(self, start: int, stop: int) -> np.ndarray:
        """Records of the stacked rows [start, stop) (all of one or more cached tables), in order: a checkpoint reads
        the tables so, block by block."""
        self.check()
        return np.concatenate([self.backings[t].read_block(lo - int(self.starts[t]), hi - lo)
                               for t, lo, hi in self._spans(start, stop)])

    def _each(self, rows: np.ndarray, op) -> None:
        """op(backing, local rows, positions in `rows`) over each table's share of `rows`, split over the pool so the
        reads of rows not in the page cache wait on the disk together."""
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
                tasks.append((self.backings[t], local[chunk], positions[chunk]))
        if len(tasks) == 1:
            op(*tasks[0])
            return
        futures = [self._pool.submit(op, *task) for task in tasks]
        errors = [f.exception() for f in futures]  # every task done before the caller's buffers may go
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    # ------------------------------------------------------------------------------------------------ end
    def flush(self) -> None:
        for b in self.backings:
            b.flush()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for b in self.backings:
            b.close()
