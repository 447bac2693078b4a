"""The gather kernels lower for TPU (Mosaic) and CUDA (Triton) on this CPU-only machine.

`jax.export(..., platforms=[p])` runs Pallas' real lowering for platform p: kernel tracing, block-shape checks, and
the translation of every op in the kernel body to the Mosaic TPU or Triton MLIR dialect (an unsupported op or
block shape fails here). What it cannot check without the device compilers: Mosaic's layout passes and VMEM
allocation run in libtpu, and Triton's compilation to PTX (shared memory, registers) in XLA:GPU.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import gather, gather_reduce
from pallas_kernels.gather_reduce import mosaic_fallback_reason
from pallas_kernels.hardware import for_tpu_chip

MOSAIC_CALL = "tpu_custom_call"
TRITON_CALL = "__gpu$xla.gpu.triton"
# Triton IR has no serialization-compatibility guarantee, so jax.export refuses it unless told otherwise.
ALLOW_TRITON = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
KERNEL_CALL = {"tpu": MOSAIC_CALL, "cuda": TRITON_CALL, "rocm": TRITON_CALL}


def exported_module(fn, platform: str, *args, chip: str | None = None) -> str:
    """StableHLO of `fn` exported for `platform`; TPU kernels sized for `chip` (a device kind) if given, else for
    the every-chip fallback (pallas_kernels/hardware.py)."""
    export = lambda: jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=ALLOW_TRITON)(*args)  # noqa: E731
    if chip is None:
        return export().mlir_module()
    with for_tpu_chip(chip):
        return export().mlir_module()


def lookups(num_rows: int, dim: int, dtype, shape: tuple[int, ...]):
    """Abstract (table, rows, weights): shapes only, nothing is computed."""
    return (jax.ShapeDtypeStruct((num_rows, dim), dtype), jax.ShapeDtypeStruct(shape, jnp.int32),
            jax.ShapeDtypeStruct(shape, jnp.float32))


# impl="pallas": what "auto" resolves to on a TPU / GPU backend (on this CPU host "auto" is the XLA reference).
def pooled(table, rows, weights):
    return gather_reduce(table, rows, weights, impl="pallas")


def per_id(table, rows, weights):
    return gather(table, rows, impl="pallas")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("length", [1, 100])
@pytest.mark.parametrize("dim", [16, 64, 128])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_kernels_lower(platform, dim, length, dtype):
    """The platform's kernel is picked at lowering time; [B, F, L] ids, one launch."""
    args = lookups(1000, dim, dtype, (64, 3, length))
    for fn in (pooled, per_id):
        module = exported_module(fn, platform, *args)
        assert module.count(f"@{KERNEL_CALL[platform]}(") == 1, (fn.__name__, platform)
        other = MOSAIC_CALL if platform != "tpu" else TRITON_CALL
        assert other not in module


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_gradients_lower(platform):
    """The kernel in the forward pass, the XLA scatter-add (custom VJP) in the backward."""
    table, rows, weights = lookups(1000, 64, jnp.float32, (64, 3, 10))
    loss = lambda t, r, w: jnp.sum(pooled(t, r, w) ** 2) + jnp.sum(per_id(t, r, w) ** 2)
    # On a v5e one call takes all 1920 ids (the fallback's 2048-id SMEM budget would split the gather-reduce's).
    module = exported_module(jax.grad(loss, argnums=(0, 2)), platform, table, rows, weights, chip="TPU v5 lite")
    assert module.count(f"@{KERNEL_CALL[platform]}(") == 2
    assert "stablehlo.scatter" in module


def test_triton_lowers_for_rocm_too():
    module = exported_module(pooled, "rocm", *lookups(1000, 64, jnp.float32, (64, 10)))
    assert module.count(f"@{TRITON_CALL}(") == 1


@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_auto_and_pallas_are_decided_when_lowered(impl):
    """One traced function: the Mosaic kernel in a TPU export, Triton in CUDA / ROCm exports, and (auto) the XLA
    reference on CPU -- not decided at trace time by the host's backend, so a CPU host exports the kernels."""
    args = lookups(1000, 64, jnp.float32, (64, 10))
    for kind in (lambda t, r, w: gather_reduce(t, r, w, impl=impl), lambda t, r, w: gather(t, r, impl=impl)):
        assert MOSAIC_CALL in exported_module(kind, "tpu", *args)
        assert TRITON_CALL in exported_module(kind, "cuda", *args)
        assert TRITON_CALL in exported_module(kind, "rocm", *args)
        if impl == "auto":
            cpu = exported_module(kind, "cpu", *args)
            assert "custom_call" not in cpu and "stablehlo.gather" in cpu
        else:
            with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
                exported_module(kind, "cpu", *args)


def test_pooling_units_lower_for_tpu():
    """Bags of <= 8 ids pool on the VPU, longer ones on the MXU; both lower (with merged-run DMAs for bags of 1),
    and the kernel requests the chip's VMEM limit."""
    for length, unit in ((1, "vpu"), (8, "vpu"), (9, "mxu")):
        module = exported_module(pooled, "tpu", *lookups(1000, 64, jnp.float32, (256, length)), chip="TPU v5 lite")
        assert module.count(f"@{MOSAIC_CALL}(") == 1 and f"gather_reduce_mosaic_{unit}" in module


def test_explicit_kernel_impls_lower_without_platform_dispatch():
    args = lookups(1000, 128, jnp.float32, (64, 10))
    tpu = exported_module(lambda t, r, w: gather_reduce(t, r, w, impl="pallas_tpu"), "tpu", *args)
    cuda = exported_module(lambda t, r, w: gather_reduce(t, r, w, impl="pallas_gpu"), "cuda", *args)
    assert MOSAIC_CALL in tpu and TRITON_CALL in cuda


def test_export_refuses_triton_without_the_safety_opt_out():
    args = lookups(1000, 64, jnp.float32, (64, 10))
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees"):
        jax.export.export(jax.jit(pooled), platforms=["cuda"])(*args)


def test_documented_fallback_lowers_to_xla():
    """A bf16 table with an odd row count cannot be fetched as packed row pairs: TPU runs the XLA reference."""
    assert mosaic_fallback_reason("reduce", 1001, 64, jnp.bfloat16, 10) is not None
    args = lookups(1001, 64, jnp.bfloat16, (64, 10))
    for fn in (pooled, per_id):
        module = exported_module(fn, "tpu", *args)
        assert MOSAIC_CALL not in module and "stablehlo.gather" in module
        assert TRITON_CALL in exported_module(fn, "cuda", *args)  # Triton takes the same case


def test_one_module_for_tpu_and_cuda_is_not_supported():
    """Known limit (jax 0.10.2): a multi-platform export lowers every platform branch for every platform, and the
    Mosaic kernel's compiler params are rejected by the GPU lowering. Export once per platform instead."""
    args = lookups(1000, 64, jnp.float32, (64, 10))
    with pytest.raises(ValueError, match="cannot be used for gpu lowering"):
        jax.export.export(jax.jit(pooled), platforms=["tpu", "cuda"], disabled_checks=ALLOW_TRITON)(*args)


def test_batches_beyond_one_calls_smem_lower_as_a_loop():
    """70000 ids of bags of 1: two SMEM-sized calls in a lax.map (one kernel, in a while loop) plus the rest."""
    module = exported_module(pooled, "tpu", *lookups(100_000, 64, jnp.float32, (70_000, 1)))
    assert module.count(f"@{MOSAIC_CALL}(") == 2 and "stablehlo.while" in module
