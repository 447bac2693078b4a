"""Arrays a checkpoint writes and reads by row blocks, never whole: a disk tier's tables (recjax/tiering), which are
larger than memory.

`RowBlocks` is such an array: shape, dtype and `block(start, stop)` (its rows [start, stop) as numpy), read where its
rows live. A save writes it with `RowBlocksHandler`, an Orbax type handler that writes the zarr array Orbax's own
NumpyHandler writes for a numpy array of that shape and dtype (same driver, kvstore, compression, metadata; only
the chunks are row blocks instead of the whole array), one block at a time: the reader asks for `block_rows` rows,
the block is written and dropped. Its digest is the sha256 of the blocks' bytes in row order, which is the sha256
of the whole C-ordered array's bytes (`integrity.sha256`), so the checkpoint's record of it is the one a numpy
array of the same values would have. A restore reads it back as a numpy array (a run with the tables in memory), or
-- asked with `RestoreArgs(restore_type=StoredRows)` -- as `StoredRows`, which reads its blocks from the checkpoint
on demand; a delta's rows go over it as `Patched` (recjax/checkpoint/restore.py).
"""

import asyncio
import copy
import hashlib
import inspect
import math
from collections.abc import Iterator

import numpy as np

# The largest block a save or restore of a RowBlocks array holds: one zarr chunk. 64 MiB: large enough that a
# block's compression and write are not dominated by per-chunk overhead, small next to any table worth a disk tier.
BLOCK_BYTES = 64 << 20


class RowBlocks:
    """An array read by row blocks. Subclasses set `shape` and `dtype` and define `block`."""

    shape: tuple[int, ...]
    dtype: np.dtype
    # The error of the save writing this array, once it failed elsewhere: its writer and its digest stop at their next
    # block with it (`next_block`) instead of reading the rest of a table larger than memory for a lost save. The
    # error itself, not a cancellation: Orbax takes a CancelledError for a save stopped on purpose, and a commit
    # that ends so first would hide the failure.
    failure: BaseException | None = None

    def block(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as a numpy array."""
        raise NotImplementedError

    def next_block(self, start: int, stop: int) -> np.ndarray:
        """`block`, for a save: raises the save's `failure` once there is one."""
        if self.failure is not None:
            raise self.failure
        return self.block(start, stop)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __deepcopy__(self, memo) -> "RowBlocks":
        # A view of where the rows live, read as it is written: a copy would copy that (a disk tier's backend). Orbax's
        # NumpyHandler deep-copies the host values it writes in the background (orbax-checkpoint < 0.12.5 always;
        # later ones unless told not to, as `RowBlocksHandler` does).
        return self

    @property
    def block_rows(self) -> int:
        """Rows per block: as many as fit in BLOCK_BYTES (at least one)."""
        row_bytes = math.prod(self.shape[1:]) * np.dtype(self.dtype).itemsize
        return max(1, BLOCK_BYTES // max(row_bytes, 1))

    def spans(self) -> Iterator[tuple[int, int]]:
        """(start, stop) of each block, in row order."""
        step = self.block_rows
        for start in range(0, self.shape[0], step):
            yield start, min(start + step, self.shape[0])

    def sha256(self) -> str:
        """The sha256 of the array's C-ordered bytes, read block by block."""
        digest = hashlib.sha256()
        for start, stop in self.spans():
            digest.update(np.ascontiguousarray(self.next_block(start, stop), self.dtype).view(np.uint8).reshape(-1))
        return digest.hexdigest()

    def patched(self, ids: np.ndarray, values: np.ndarray) -> "Patched":
        """This array with rows `ids` replaced by `values` (a delta's rows)."""
        return Patched(self, ids, values)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole array (for tests and small tables; a checkpoint never asks for it)."""
        out = np.empty(self.shape, self.dtype)
        for start, stop in self.spans():
            out[start:stop] = self.block(start, stop)
        return out if dtype is None else out.astype(dtype)


class Patched(RowBlocks):
    """`base` with the rows `ids` i64[n] (distinct) replaced by `values` [n, ...]: a delta of a Check-N-Run chain
    applied over its baseline without reading the baseline whole."""

    def __init__(self, base: RowBlocks, ids: np.ndarray, values: np.ndarray):
        self.base, self.shape, self.dtype = base, base.shape, base.dtype
        order = np.argsort(ids, kind="stable")
        self.ids, self.values = np.asarray(ids, np.int64)[order], np.asarray(values, self.dtype)[order]

    @property
    def block_rows(self) -> int:
        return self.base.block_rows

    def block(self, start: int, stop: int) -> np.ndarray:
        out = np.array(self.base.block(start, stop))
        lo, hi = np.searchsorted(self.ids, [start, stop])
        out[self.ids[lo:hi] - start] = self.values[lo:hi]
        return out


class StoredRows(RowBlocks):
    """An array of a checkpoint, opened (a TensorStore) and read a stored chunk at a time when asked: its blocks are
    its chunks' rows -- BLOCK_BYTES for an array written as RowBlocks, up to Orbax's 2 GiB chunks for one written
    whole. The chunk last read is kept, so blocks of other arrays' sizes read each chunk once."""

    def __init__(self, store):
        self.store = store
        self.shape = tuple(int(n) for n in store.shape)
        self.dtype = np.dtype(store.dtype.numpy_dtype)
        self.chunk_rows = int(store.chunk_layout.read_chunk.shape[0]) if self.shape else 1
        self._chunk: tuple[int, np.ndarray] | None = None  # (first row, rows) of the chunk last read

    @property
    def block_rows(self) -> int:
        return self.chunk_rows

    def block(self, start: int, stop: int) -> np.ndarray:
        first = start - start % self.chunk_rows
        if stop > first + self.chunk_rows:  # across chunks: read as asked
            return self.store[start:stop].read().result()
        if self._chunk is None or self._chunk[0] != first:
            self._chunk = None  # dropped before the next one is read
            self._chunk = (first, self.store[first: min(first + self.chunk_rows, self.shape[0])].read().result())
        return self._chunk[1][start - first: stop - first]


def _chunked_by_rows(tspec: dict, rows: int) -> dict:
    """`tspec` (Orbax's write spec of a zarr array) with chunks of `rows` rows and the whole of every other axis."""
    tspec = copy.deepcopy(tspec)
    base = tspec["base"] if tspec.get("driver") == "cast" else tspec
    metadata = base["metadata"]
    chunks = [rows, *metadata["shape"][1:]]
    if "chunks" in metadata:  # zarr v2
        metadata["chunks"] = chunks
    else:  # zarr v3: a regular grid of shards, each one chunk
        metadata["chunk_grid"]["configuration"]["chunk_shape"] = chunks
        for codec in metadata["codecs"]:
            if codec["name"] == "sharding_indexed":
                codec["configuration"]["chunk_shape"] = chunks
    return tspec


_HANDLER = None


def register_handler() -> None:
    """Register `RowBlocksHandler` with Orbax for RowBlocks values and numpy arrays (once; orbax is imported
    lazily)."""
    global _HANDLER
    if _HANDLER is not None:
        return
    import logging

    import orbax.checkpoint as ocp
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import tensorstore_utils

    class RowBlocksHandler(ocp.type_handlers.NumpyHandler):
        """Writes a RowBlocks value as NumpyHandler writes a numpy array, but chunked and written by row blocks;
        reads numpy arrays as NumpyHandler does, or StoredRows when the restore asks for them. Its typestr is
        NumpyHandler's ("np.ndarray"): a checkpoint records a RowBlocks value as a numpy array, so any reader
        restores it as one. It writes numpy arrays too (in place of NumpyHandler, as it would), so that a failed
        save leaves no write of either kind in flight (`_open_and_write`)."""

        def __init__(self, deepcopy_host_arrays: bool):
            # orbax-checkpoint < 0.12.5 has no such option and always deep-copies; there RowBlocks.__deepcopy__
            # returns the view itself.
            if "deepcopy_host_arrays" in inspect.signature(ocp.type_handlers.NumpyHandler.__init__).parameters:
                super().__init__(deepcopy_host_arrays=deepcopy_host_arrays)
            else:
                super().__init__()
            self._writing: dict = {}  # event loop -> [(value, done)]: the values it writes together

        async def _open_and_write(self, value, tspec: dict, ts_context) -> None:
            # Orbax writes a save's values together in one event loop (gathered) and closes the loop once one fails;
            # a tensorstore write of another still in flight then completes into a closed loop, which tensorstore
            # prints ("RuntimeError: Event loop is closed"), and its files land in the removed partial checkpoint.
            # So when one fails, it waits for the others -- those read by row blocks stop at their next block with
            # its error -- before it raises.
            loop = asyncio.get_running_loop()
            group = self._writing.setdefault(loop, [])
            done = loop.create_future()
            group.append((value, done))
            try:
                if not isinstance(value, RowBlocks):
                    return await super()._open_and_write(value, tspec, ts_context)
                store = await ts.open(ts.Spec(_chunked_by_rows(tspec, value.block_rows)), create=True, open=True,
                                      context=ts_context)
                for start, stop in value.spans():
                    # One block at a time: read (from the table files), written (one zarr chunk), then dropped.
                    await store[start:stop].write(value.next_block(start, stop))
            except BaseException as error:
                for other, _ in group:
                    if isinstance(other, RowBlocks) and other.failure is None:
                        other.failure = error
                done.set_result(None)
                await asyncio.gather(*(d for _, d in group))
                raise
            finally:
                if not done.done():
                    done.set_result(None)
                if all(d.done() for _, d in group):
                    self._writing.pop(loop, None)

        async def deserialize(self, infos, args=None):
            args = list(args or [ocp.type_handlers.RestoreArgs()] * len(infos))
            lazy = [i for i, a in enumerate(args) if isinstance(a.restore_type, type)
                    and issubclass(a.restore_type, StoredRows)]
            whole = [i for i in range(len(infos)) if i not in lazy]
            # Each read on its own and all of them awaited before an error is raised: a read still in flight when
            # a corrupt array's fails would complete into a closed event loop (`_open_and_write`).
            reads = [ocp.type_handlers.NumpyHandler.deserialize(self, [infos[i]], [args[i]]) for i in whole]
            for i in lazy:
                await infos[i].await_path_creation()
                spec = tensorstore_utils.build_array_read_spec(
                    infos[i], use_ocdbt=infos[i].is_ocdbt_checkpoint, metadata_key=self._metadata_key,
                    raise_array_data_missing_error=infos[i].raise_array_data_missing_error)
                reads.append(ts.open(ts.Spec(spec.json), open=True, context=infos[i].ts_context))
            done = await asyncio.gather(*reads, return_exceptions=True)
            failed = next((d for d in done if isinstance(d, BaseException)), None)
            if failed is not None:
                raise failed
            out = [None] * len(infos)
            for i, value in zip(whole, done[: len(whole)], strict=True):
                out[i] = value[0]
            for i, store in zip(lazy, done[len(whole):], strict=True):
                out[i] = StoredRows(store)
            return out

    # No defensive deep copy of a RowBlocks value: a view of where its rows live, read as it is written. Numpy arrays
    # are copied as NumpyHandler copies them.
    _HANDLER = RowBlocksHandler(deepcopy_host_arrays=False)
    # The handler takes NumpyHandler's typestr, which Orbax reports as a collision: expected, not worth a warning.
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(RowBlocks, _HANDLER, override=True)
        ocp.type_handlers.register_type_handler(np.ndarray, RowBlocksHandler(deepcopy_host_arrays=True),
                                                override=True)
    finally:
        absl.setLevel(level)
