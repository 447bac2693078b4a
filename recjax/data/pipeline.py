"""Host-side input pipeline: validate each batch and move it to the device on a background thread."""

import queue
import threading
from collections.abc import Callable, Iterator

import jax

from recjax.batch import Batch

_DONE = object()


class DevicePrefetcher:
    """Iterate device batches while the next `size` are validated and transferred on a worker thread.

    Use as a context manager (or call `close()`): the worker must be stopped and joined before the interpreter
    exits, or it can be killed inside a device transfer and abort the process.
    """

    def __init__(self, batches: Iterator[Batch], validate: Callable[[Batch, str], None], size: int = 2,
                 put: Callable[[Batch], Batch] = jax.device_put):
        self._batches = batches
        self._put_on_device = put  # a mesh run splits each batch over its devices (recjax/sharding)
        self._validate = validate
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self):
        try:
            for i, batch in enumerate(self._batches):
                if self._stop.is_set():
                    return
                self._validate(batch, f"batch {i}")
                if not self._put(self._put_on_device(batch)):
                    return
            self._put(_DONE)
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._put(e)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        item = self._queue.get()
        if item is _DONE:
            self._put(_DONE)  # stay exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        self._stop.set()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
