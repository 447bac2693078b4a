"""One meaning of `impl` for every kernel family (gather-reduce, gather, the fused sparse update).

  "xla"         the family's plain-jnp reference: the CPU path and the tests' oracle.
  "pallas_tpu"  the Mosaic TPU kernel, whatever the platform (on a CPU host: with `interpret`, or for an export).
  "pallas_gpu"  the Triton kernel, likewise.
  "pallas"      the kernel of the platform the computation is lowered for: Mosaic on TPU, Triton on CUDA and ROCm.
                Lowering it for another platform fails with Pallas' "Only interpret mode is supported on CPU backend"
                (a kernel was asked for and none runs there). With `interpret` it is the Mosaic kernel under the TPU
                interpreter (DMAs and semaphores simulated).
  "auto"        as "pallas" on TPU, CUDA and ROCm, the XLA reference on every other platform.
"pallas" and "auto" are decided when the computation is lowered (`lax.platform_dependent`), not when it is traced:
`jax.export(..., platforms=["tpu"])` from a CPU host gets the Mosaic kernel, ["cuda"] the Triton one, and a CPU
program the reference -- only the chosen branch reaches the compiler. (The branches are all traced, so a CPU program
pays the kernels' tracing once per call site at compile time.) `interpret` needs a named kernel: "auto" with
`interpret` is an error, since a CPU lowering would run the reference and silently ignore it.
"""

from collections.abc import Callable
from typing import Any

import jax

IMPLS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu")
# Names the kernels' code as measured: recjax's `embedding.kernel="auto"` caches its measured choices under it, so a
# change to any kernel that can move its speed must change this, or cached choices would outlive what they measured.
KERNELS_REVISION = "issue41-2"


def check_impl(impl: str, interpret: Any, what: str) -> None:
    """A clear error for an unknown impl or an interpret request no kernel would honour."""
    if impl not in IMPLS:
        raise ValueError(f"{what}: unknown impl {impl!r}; use one of {IMPLS}")
    if interpret and impl in ("xla", "auto"):
        raise ValueError(f"{what}: interpret=True runs a Pallas kernel; impl={impl!r} names none (use 'pallas_tpu' "
                         f"or 'pallas_gpu')")


def by_platform(impl: str, interpret: Any, args: tuple, *, xla: Callable, mosaic: Callable, triton: Callable):
    """Call the implementation `impl` names (module docstring) on `args`."""
    if impl == "xla":
        return xla(*args)
    if impl == "pallas_tpu" or (impl == "pallas" and interpret):
        return mosaic(*args)
    if impl == "pallas_gpu":
        return triton(*args)
    # Lowering for another platform under "pallas" takes the Mosaic branch, whose lowering there fails with Pallas'
    # own message.
    return jax.lax.platform_dependent(*args, tpu=mosaic, cuda=triton, rocm=triton,
                                      default=xla if impl == "auto" else mosaic)
