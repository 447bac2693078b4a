"""The input pipeline: the trainer's calls' inputs, made ahead of the loop and put on the device.

The trainer runs calls of n steps (`train.steps_per_call`, or fewer where a log / eval / checkpoint step falls inside
a call's reach; recjax/train.py). Call i's input is a *block*: its n batches stacked on a new leading axis,
f32[n, B, ...] (n = 1: the batch itself), put on the device in one transfer.

Two kinds of source:
  - a stream of host batches (prepared data read by Grain's threads, an in-memory split): `BlockPrefetcher`. A feeder
    thread takes each block's n batches from the stream in order (it is sequential), and `workers` threads stack,
    validate (once over the whole block: recjax/batch.py `validate_batch`) and transfer them, up to `depth` blocks
    ahead, handed over in order: while the device runs block i, block i + 1 is there and the next are on their way
    (double-buffered at least), and no single Python thread does all of the host's work.
  - blocks made on the device (`make(first_step, n)`: the synthetic data, keyed by step): `MadeBlocks`. Making one is
    an asynchronous device call, dispatched one call ahead from the loop's own thread; nothing is made, checked or
    copied on the host (the ids are in range by construction).
"""

import concurrent.futures
import functools
import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator

import jax
import numpy as np

from recjax.batch import Batch

_DONE = object()

Put = Callable[..., object]  # put(batch, stacked=...) -> what the compiled step takes (`backend.put_batch`)


def stack(batches: list[Batch]) -> Batch:
    """n batches of the same shapes -> one batch with a new leading axis, f32[n, B, ...]."""
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)


def flat(block: Batch) -> Batch:
    """A stacked block f32[n, B, ...] viewed as one batch of n * B examples (no copy)."""
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), block)


def stream_blocks(batches: Iterator[Batch], lengths: Iterable[int], validate: Callable[[Batch, str], None],
                  put: Put, first_step: int = 0) -> Iterator[Callable[[], tuple[int, object]]]:
    """Blocks of a sequential stream of host batches: the jobs that stack, check and transfer each block, in order
    (taking the batches from the stream happens here, on the feeder thread). `first_step`: the step of the stream's
    first batch (for the messages)."""
    step = first_step
    for n in lengths:
        taken = list(itertools.islice(batches, n))
        if len(taken) < n:
            return
        yield functools.partial(_host_block, taken, step, validate, put)
        step += n


def _host_block(batches: list[Batch], step: int, validate, put: Put) -> tuple[int, object]:
    n = len(batches)
    if n == 1:
        validate(batches[0], f"batch {step}")
        return 1, put(batches[0])
    block = stack(batches)
    try:
        validate(flat(block), f"batches {step}-{step + n - 1}")
    except ValueError:  # name the very batch, as a one-step call would
        for i, batch in enumerate(batches):
            validate(batch, f"batch {step + i}")
        raise
    return n, put(block, stacked=True)


class BlockPrefetcher:
    """Iterate `(n, block)` in order while the next `depth` blocks are made on `workers` threads.

    `jobs` yields, in order, callables returning `(n, block on the device)` (`stream_blocks`); taking the
    next job runs on a feeder thread, the jobs on the workers. An error in any of them reaches the consumer at the
    block it concerns. Use as a context manager (or call `close()`): the threads must be stopped before the interpreter
    exits, or one can be killed inside a device transfer and abort the process.
    """

    def __init__(self, jobs: Iterator[Callable[[], tuple[int, object]]], workers: int = 2, depth: int = 4):
        if workers < 1 or depth < 1:
            raise ValueError(f"workers and depth must be >= 1, got {workers}, {depth}")
        self._jobs = jobs
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="recjax-input")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, daemon=True, name="recjax-input-feeder")
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _feed(self) -> None:
        try:
            for job in self._jobs:
                if self._stop.is_set() or not self._put(self._pool.submit(job)):
                    return
            self._put(_DONE)
        except BaseException as error:  # handed to the consumer, which re-raises it
            self._put(error)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, object]:
        item = self._queue.get()
        if item is _DONE:
            self._put(_DONE)  # stay exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item.result()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        while True:  # jobs queued but never taken: cancel those not started, wait for the others
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, concurrent.futures.Future):
                item.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "BlockPrefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MadeBlocks:
    """Iterate `(n, block)` of blocks made on the device by `make(first_step, n)`, each dispatched one call ahead
    from the consumer's own thread: making a block is an asynchronous device call, so the device has block i + 1 queued
    behind step i with no Python thread dispatching beside the loop's (a 2-core CPU measured the loop's own calls
    waiting 12 ms, median, when worker threads dispatched the generator). `put` runs on one worker thread, in order,
    a block ahead: placing a block on one device does nothing, but a disk tier's reads the block's distinct rows back
    to the host (waiting for the device), which must not hold up the loop. `warmup` jobs (compiling `make` for each
    length) run on another thread started here, while the trainer compiles its steps, and are waited for before the
    first block."""

    def __init__(self, make: Callable[[int, int], Batch], lengths: Iterable[int], put: Put, first_step: int = 0,
                 warmup: Iterable[Callable[[], object]] = ()):
        self._make, self._lengths, self._put, self._step = make, iter(lengths), put, first_step
        self._next, self._started = None, False
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recjax-input-put")
        jobs = list(warmup)
        self._warmup = threading.Thread(target=lambda: [job() for job in jobs], daemon=True,
                                        name="recjax-input-warmup")
        self._warmup.start()

    def _dispatch(self):
        n = next(self._lengths, None)
        if n is None:
            return None
        batch = self._make(self._step, n)
        self._step += n
        return n, self._pool.submit(self._put, batch, stacked=True) if n > 1 else self._pool.submit(self._put, batch)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, object]:
        if not self._started:
            self._warmup.join()
            self._next, self._started = self._dispatch(), True
        current, self._next = self._next, None
        if current is None:
            raise StopIteration
        self._next = self._dispatch()  # queued behind this block's step
        n, placed = current
        return n, placed.result()

    def close(self) -> None:
        self._warmup.join()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "MadeBlocks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DevicePrefetcher(BlockPrefetcher):
    """Iterate device batches one at a time while the next `size` are validated and transferred on a worker thread
    (`BlockPrefetcher` with every block one batch; for scripts that step batch by batch)."""

    def __init__(self, batches: Iterator[Batch], validate: Callable[[Batch, str], None], size: int = 2,
                 put: Callable[[Batch], object] = jax.device_put):
        super().__init__(stream_blocks(batches, itertools.repeat(1), validate, lambda b, stacked=False: put(b)),
                         workers=1, depth=size)

    def __next__(self):
        return super().__next__()[1]
