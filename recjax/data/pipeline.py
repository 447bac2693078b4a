"""Host-side input pipeline: validate each batch and move it to the device on a background thread."""

import queue
import threading
from collections.abc import Callable, Iterator

import jax

from recjax.batch import Batch

_DONE = object()


def prefetch_to_device(batches: Iterator[Batch], validate: Callable[[Batch, str], None],
                       size: int = 2) -> Iterator[Batch]:
    """Yield device batches while the next `size` are prepared; errors surface in the consumer."""
    q: queue.Queue = queue.Queue(maxsize=size)
    stop = threading.Event()

    def produce():
        try:
            for i, batch in enumerate(batches):
                validate(batch, f"batch {i}")
                item = jax.device_put(batch)
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(_DONE)
        except BaseException as e:  # handed to the consumer, which re-raises it with its traceback
            q.put(e)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
