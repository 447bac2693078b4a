"""What the kernels know about the chip they are lowered for: TPU memories and cores, GPU SMs and shared memory.

Block sizes, VMEM limits and the ids one call may hold in SMEM are static, so they are decided when a kernel is
traced, from the device that computation would run on:
  * TPU: `pltpu.get_tpu_info()` -- on a TPU, or on any host under `jax.sharding.use_abstract_mesh` with a TPU
    `jax.sharding.AbstractDevice` (jax's own way to lower for a chosen chip; `for_tpu_chip` below);
  * GPU: the device's attributes (`core_count` SMs, shared memory per block where the plugin reports it).
Elsewhere -- export-only lowering on a CPU host, interpret mode -- a fallback that is valid on every chip: for TPU
the smallest SMEM and VMEM of every chip jax 0.10 knows (`pltpu.get_tpu_info_for_chip`: 16 KiB SMEM on v2 / v3,
16 MiB VMEM on v2-v4) and a 2-way "parallel" grid split (megacore chips share it over their two TensorCores; a
single-core chip runs both halves in turn); for GPU the 48 KiB of shared memory every CUDA and ROCm part gives a
block without opting in, and an A100's 108 SMs. A fallback only costs speed, never correctness: the blocks it picks
fit every chip.
"""

import contextlib
import dataclasses
import re
from collections.abc import Iterator

import jax
from jax.experimental.pallas import tpu as pltpu

# Of a TPU core's VMEM, what a kernel asks Mosaic for (`vmem_limit_bytes`): Mosaic keeps the rest for its own
# internal scratch. Of that limit, what the kernel's own buffers are sized to: the rest covers the temporaries of
# the kernel body (the pooling matrices, the rule's intermediates).
TPU_VMEM_LIMIT_FRACTION = 0.75
TPU_VMEM_BUFFER_FRACTION = 0.75
# Of SMEM, what one call's scalar-prefetched ids may take (the rest holds Mosaic's scalars and SMEM scratch).
TPU_SMEM_IDS_FRACTION = 0.5
GPU_FALLBACK_SM_COUNT = 108  # an A100
GPU_FALLBACK_SHARED_MEMORY = 48 * 1024  # per block without the opt-in, on every CUDA / ROCm part
# Peak HBM bandwidth by GPU device kind (as `jax.devices()[0].device_kind` names it), bytes per second, from NVIDIA's
# data sheets; the first pattern that matches wins. A measured kernel's GB/s is quoted as a fraction of this (and of
# the device copy measured beside it, `timing.copy_bandwidth`): the spec is what the memory can do, the copy what XLA
# gets out of it.
GPU_HBM_SPEC = (
    (r"\bH200\b", 4.8e12),  # H200 SXM / NVL, 141 GB HBM3e ("NVIDIA GH200" does not match: no word boundary)
    (r"\bH100 NVL\b", 3.9e12),
    (r"\bH100 PCIe\b", 2.0e12),
    (r"\bH100\b", 3.35e12),  # H100 SXM5 80 GB HBM3 ("NVIDIA H100 80GB HBM3")
    (r"\bA100\b.*80GB.*PCIe", 1.935e12),
    (r"\bA100\b.*80GB", 2.039e12),  # A100 SXM4 80 GB
    (r"\bA100\b", 1.555e12),  # the 40 GB parts
)


@dataclasses.dataclass(frozen=True)
class TpuBudget:
    """Per-TensorCore memories of the chip a TPU kernel is lowered for, and how a kernel may use them."""

    chip: str  # "v5e", ... or "fallback" (no TPU known at trace time)
    smem_bytes: int
    vmem_bytes: int
    num_cores: int  # TensorCores a leading "parallel" grid dimension is split over (2 on megacore v4 / v5p)
    hbm_bytes_per_second: int | None  # per TensorCore, from jax's table; None for the fallback

    @property
    def vmem_limit_bytes(self) -> int:
        """The scoped VMEM limit a kernel requests (`pltpu.CompilerParams(vmem_limit_bytes=...)`)."""
        return int(self.vmem_bytes * TPU_VMEM_LIMIT_FRACTION)

    @property
    def vmem_buffer_bytes(self) -> int:
        """What a kernel's VMEM blocks and scratch buffers may add up to."""
        return int(self.vmem_limit_bytes * TPU_VMEM_BUFFER_FRACTION)

    @property
    def smem_ids(self) -> int:
        """i32 ids one call may scalar-prefetch into SMEM (2048 on v2 / v3, 131072 from v4 on)."""
        return int(self.smem_bytes * TPU_SMEM_IDS_FRACTION) // 4


@dataclasses.dataclass(frozen=True)
class GpuBudget:
    """What the GPU kernels' block choice reads from the device."""

    device: str  # the device kind, or "fallback"
    sm_count: int
    shared_memory_per_block: int


def _fallback_tpu() -> TpuBudget:
    chips = [pltpu.get_tpu_info_for_chip(chip, 1) for chip in pltpu.ChipVersion]
    return TpuBudget(chip="fallback", smem_bytes=min(c.smem_capacity_bytes for c in chips),
                     vmem_bytes=min(c.vmem_capacity_bytes for c in chips), num_cores=2, hbm_bytes_per_second=None)


def tpu_budget() -> TpuBudget:
    """The TPU this trace lowers for (`pltpu.get_tpu_info()`), else the every-chip fallback (module docstring)."""
    try:
        info = pltpu.get_tpu_info()
    except ValueError:  # "Unsupported TPU device kind: cpu": no TPU at trace time
        return _fallback_tpu()
    return TpuBudget(chip=str(info.chip_version), smem_bytes=info.smem_capacity_bytes,
                     vmem_bytes=info.vmem_capacity_bytes, num_cores=info.num_cores,
                     hbm_bytes_per_second=info.mem_bw_bytes_per_second)


def gpu_budget() -> GpuBudget:
    """The default GPU's SM count and shared memory per block, else the fallback (module docstring)."""
    try:
        device = jax.local_devices(backend="gpu")[0]
    except RuntimeError:  # no GPU backend: export-only lowering
        return GpuBudget("fallback", GPU_FALLBACK_SM_COUNT, GPU_FALLBACK_SHARED_MEMORY)
    return GpuBudget(device.device_kind, int(getattr(device, "core_count", GPU_FALLBACK_SM_COUNT)),
                     int(getattr(device, "shared_memory_per_block_optin", GPU_FALLBACK_SHARED_MEMORY)))


@contextlib.contextmanager
def for_tpu_chip(device_kind: str, num_cores: int = 1) -> Iterator[None]:
    """Trace (and lower, e.g. `jax.export(..., platforms=["tpu"])`) the kernels for a named chip from any host:
    `with for_tpu_chip("TPU v5 lite"): ...` (device kinds as `jax.devices()[0].device_kind` prints them)."""
    mesh = jax.sharding.AbstractMesh((1,), ("kernels",), abstract_device=jax.sharding.AbstractDevice(
        device_kind=device_kind, num_cores=num_cores, platform="tpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def hbm_spec_bytes_per_second(device: jax.Device | None = None) -> tuple[float | None, str]:
    """(peak HBM bytes per second, where the figure comes from) of `device` (default: the first device): GPUs from
    GPU_HBM_SPEC by device kind, TPUs from jax's chip table (`pltpu.get_tpu_info()`, per TensorCore, times the
    TensorCores); (None, why) when neither knows the device."""
    device = device or jax.devices()[0]
    kind = device.device_kind
    if device.platform == "gpu":
        for pattern, rate in GPU_HBM_SPEC:
            if re.search(pattern, kind):
                return rate, f"data sheet ({kind})"
        return None, f"no HBM spec known for {kind!r} (hardware.GPU_HBM_SPEC)"
    if device.platform == "tpu":
        budget = tpu_budget()
        if budget.hbm_bytes_per_second:
            return budget.hbm_bytes_per_second * budget.num_cores, f"jax's TPU chip info ({budget.chip})"
        return None, f"jax's TPU chip info has no bandwidth for {kind!r}"
    return None, f"no HBM on a {device.platform} device"
