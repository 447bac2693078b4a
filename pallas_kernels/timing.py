"""Device time per call of a computation, with the host's dispatch out of the figure.

A call timed alone (dispatch, launch, `block_until_ready`) carries the host's dispatch latency and the device's launch
overhead, tens to hundreds of microseconds: at sub-millisecond kernels that is a large and contender-dependent part of
the figure (the first accelerator run timed every contender one call per host sync at 0.3-0.8 ms). Here a jitted
`lax.fori_loop` runs the computation N times per host sync. Each iteration's inputs depend on the loop index or on
the previous iteration's output (the caller's `body` makes sure: a batch picked by the index, a table carried and
updated), so XLA cannot hoist the work out of the loop. N is a traced value -- one compile serves every N -- and is
grown until one loop takes at least `min_seconds`; the figure is the median over repeats of loop seconds / N, so the
one dispatch and sync per loop are spread over N calls.

`compare` times several contenders round-robin (each repeat runs every contender once), so a change of load or clock
hits them alike and their ratios are trustworthy; `copy_bandwidth` is the memory yardstick timed the same way.
"""

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

# body(i i32[], carry) -> carry: one call of the computation under test.
Body = Callable[[jax.Array, Any], Any]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call (the median over repeats of loop time / iterations) and how it was measured."""

    seconds: float
    iterations: int  # calls per host sync
    repeats: list[float]  # seconds per call of each timed loop
    # The compiled loop's temporary buffers (XLA's memory analysis; None where the backend gives none): an in-place
    # update of a donated table keeps this far below the table's size, a hidden copy of it does not.
    temp_bytes: int | None = None


class _Loop:
    """A contender: its compiled loop (carry donated, so tables update in place) and its current carry."""

    def __init__(self, body: Body, carry: Any):
        loop = jax.jit(lambda carry, n: jax.lax.fori_loop(0, n, body, carry), donate_argnums=0)
        self.run = loop.lower(carry, jnp.int32(1)).compile()  # n is traced: one executable for every n
        analysis = self.run.memory_analysis()
        self.temp_bytes = getattr(analysis, "temp_size_in_bytes", None)
        self.carry = carry
        self.iterations = 1

    def seconds(self, iterations: int) -> float:
        start = time.perf_counter()
        self.carry = self.run(self.carry, jnp.int32(iterations))
        jax.block_until_ready(self.carry)
        return time.perf_counter() - start

    def calibrate(self, min_seconds: float, max_iterations: int) -> None:
        """Warm up (twice: the first calls after a compile pay one-off costs), then grow the iterations until one
        loop takes `min_seconds`."""
        self.seconds(1)
        self.seconds(1)
        n = 1
        while n < max_iterations:
            elapsed = self.seconds(n)
            if elapsed >= min_seconds:
                break
            # Aim 20 % past the target (the first loops include warm-up effects), at least doubling.
            n = min(max_iterations, max(2 * n, math.ceil(1.2 * n * min_seconds / max(elapsed, 1e-7))))
        self.iterations = n


def compare(contenders: Mapping[str, tuple[Body, Any]], *, repeats: int = 5, min_seconds: float = 0.05,
            max_iterations: int = 1 << 16) -> tuple[dict[str, Timing], dict[str, Any]]:
    """Time each contender's `body` (module docstring), round-robin over `repeats`.

    Args:
      contenders: {name: (body, carry)}; each carry is donated to its loop (pass a copy of what must survive).
      repeats: timed loops per contender; min_seconds: the length of one timed loop; max_iterations: its cap.

    Returns:
      ({name: Timing}, {name: its final carry}).
    """
    loops = {name: _Loop(body, carry) for name, (body, carry) in contenders.items()}
    for loop in loops.values():
        loop.calibrate(min_seconds, max_iterations)
    per_call: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(repeats):
        for name, loop in loops.items():
            per_call[name].append(loop.seconds(loop.iterations) / loop.iterations)
    timings = {name: Timing(statistics.median(t), loops[name].iterations, t, loops[name].temp_bytes)
               for name, t in per_call.items()}
    return timings, {name: loop.carry for name, loop in loops.items()}


def seconds_per_call(body: Body, carry: Any, **kwargs) -> Timing:
    """`compare` of one contender."""
    return compare({"it": (body, carry)}, **kwargs)[0]["it"]


def copy_bandwidth(num_bytes: int = 512 << 20, **kwargs) -> tuple[float, Timing]:
    """(bytes per second, timing) of a streaming pass over an f32 array of `num_bytes` on the default device: each
    call reads the array and writes it back (x + 1, in place in the loop's buffer), 2 x num_bytes moved -- the memory
    bandwidth XLA achieves, the yardstick for kernels that should be memory-bound."""
    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    timing = seconds_per_call(lambda i, x: x + 1.0, x, **kwargs)
    return 2 * x.nbytes / timing.seconds, timing
