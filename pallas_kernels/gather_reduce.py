"""Gather-reduce (pooled lookup) and gather (per-id lookup) from a row table, with Pallas kernels.

Semantics shared by every implementation: `table` is f32 or bf16 [R, D]; row ids outside [0, R) -- R is the
padding sentinel -- read zeros; results are f32 and accumulate in f32. Leading dims of `rows` are batch dims, so
one launch serves [B, L] (one feature) or [B, F, L] (all features of a stacked group).

Implementations (`impl=`, the same meaning for every kernel family: pallas_kernels/dispatch.py):
  "xla"         the plain-jnp references below: the fastest path on CPU and the oracle for the kernels.
  "pallas_tpu"  the Mosaic TPU kernel: ids in SMEM (scalar prefetch), the table left in HBM, rows DMA'd into a
                double-buffered VMEM scratch (one DMA per run of 8 adjacent ids, else per row), the DMAs pipelined
                across grid steps, pooled on the VPU (bags of <= 8 ids) or the MXU.
  "pallas_gpu"  the Triton kernel: a block of bags per program, a chunk of each bag's ids per loop step (many rows in
                flight), rows gathered with masked loads, f32 accumulation.
  "pallas"      Mosaic on TPU, Triton on CUDA / ROCm, chosen when the computation is lowered.
  "auto"        as "pallas" on TPU / CUDA / ROCm, the XLA reference elsewhere, chosen when lowered.
`interpret=True` (or a `pltpu.InterpretParams`) runs the kernel "pallas_tpu" / "pallas_gpu" names ("pallas": the
Mosaic one) in Pallas interpret mode on CPU.

A case a kernel cannot express falls back to the XLA reference for that case only (`mosaic_fallback_reason`,
`triton_fallback_reason`; pallas_kernels/README.md says why). Block sizes come from the chip the
kernel is lowered for (pallas_kernels/hardware.py).

Gradients (`jax.custom_vjp`): d table is the transpose, an XLA scatter-add of g (x w) into the rows read (the
sentinel dropped; duplicates summed exactly, accumulated in f32 and cast to the table's dtype); d weights is
<g, table[rows]>; ids get none.
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import IMPLS, by_platform, check_impl
from pallas_kernels.hardware import gpu_budget, tpu_budget

__all__ = ["IMPLS", "gather", "gather_reduce", "gather_reduce_reference", "gather_reference",
           "mosaic_fallback_reason", "mosaic_plan", "triton_blocks", "triton_fallback_reason"]

_HIGHEST = jax.lax.Precision.HIGHEST  # f32 products on the MXU (the default rounds operands to bf16 on TPU)


# ----------------------------------------------------------------------------------------------------------------
# References (plain jnp).


def _sanitize(rows: jax.Array, num_rows: int) -> jax.Array:
    """Ids outside [0, R) -> R, the sentinel. jnp.take would wrap negative ids; no path should read them."""
    rows = rows.astype(jnp.int32)
    return jnp.where((rows >= 0) & (rows < num_rows), rows, num_rows)


def gather_reference(table: jax.Array, rows: jax.Array) -> jax.Array:
    """Rows per id, no reduce.

    Args:
      table: f32 or bf16 [R, D].
      rows: int [..., L] row ids; ids outside [0, R) read zeros.

    Returns:
      f32[..., L, D].
    """
    valid, gathered = _gather_valid(table, rows)
    return jnp.where(valid[..., None], gathered.astype(jnp.float32), 0.0)


def _gather_valid(table: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(valid bool[..., L], table[rows] with invalid ids reading row 0). The caller selects zeros for invalid ids.

    An unchecked gather of clamped ids and a select measured faster on XLA:CPU than `jnp.take(mode="fill")`
    followed by the weighted sum (benchmarks/RESULTS.md#embedding-engine-internals), and a select (not a multiply by
    0) keeps padding at exactly zero even if row 0 held inf or NaN.
    """
    rows = rows.astype(jnp.int32)
    valid = (rows >= 0) & (rows < table.shape[0])
    return valid, table.at[jnp.where(valid, rows, 0)].get(mode="promise_in_bounds")


def gather_reduce_reference(table: jax.Array, rows: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted sum of table rows per bag.

    Args:
      table: f32 or bf16 [R, D] (e.g. stacked physical rows, or the distinct rows of a batch).
      rows: int [..., L] row ids into `table`; ids outside [0, R) (R is the padding sentinel) read zeros.
      weights: f32 [..., L] per-id pooling weights (1 for sum, 1/len for mean, 0 for padding, any for weighted bags).

    Returns:
      f32[..., D] pooled embeddings, accumulated in f32.
    """
    assert rows.shape == weights.shape and rows.ndim >= 1, (rows.shape, weights.shape)
    valid, gathered = _gather_valid(table, rows)  # [..., L], [..., L, D]
    weighted = gathered.astype(jnp.float32) * weights.astype(jnp.float32)[..., None]
    return jnp.where(valid[..., None], weighted, 0.0).sum(axis=-2)


# ----------------------------------------------------------------------------------------------------------------
# Public API.


def gather_reduce(table: jax.Array, rows: jax.Array, weights: jax.Array, *, impl: str = "auto",
                  interpret: Any = False) -> jax.Array:
    """Pooled lookup: out[..., :] = sum_l weights[..., l] * table[rows[..., l]] (zeros for ids outside [0, R)).

    Args:
      table: f32 or bf16 [R, D].
      rows: int [..., L] row ids.
      weights: f32 [..., L] per-id weights.
      impl: one of IMPLS (see the module docstring).
      interpret: run the Pallas kernel in interpret mode (True or a `pltpu.InterpretParams`); CPU tests use it.

    Returns:
      f32[..., D].
    """
    _check_args(table, rows, impl, interpret)
    assert weights.shape == rows.shape, (weights.shape, rows.shape)
    lead, length = rows.shape[:-1], rows.shape[-1]
    ids = rows.reshape(math.prod(lead), length).astype(jnp.int32)
    w = weights.reshape(math.prod(lead), length).astype(jnp.float32)
    out = _gather_reduce(table, ids, w, impl, interpret)
    return out.reshape(*lead, table.shape[1])


def gather(table: jax.Array, rows: jax.Array, *, impl: str = "auto", interpret: Any = False) -> jax.Array:
    """Per-id lookup without reduce, for methods that combine per id before pooling.

    Args:
      table: f32 or bf16 [R, D].
      rows: int [..., L] row ids; ids outside [0, R) read zeros.
      impl, interpret: as in `gather_reduce`.

    Returns:
      f32[..., L, D].
    """
    _check_args(table, rows, impl, interpret)
    lead, length = rows.shape[:-1], rows.shape[-1]
    ids = rows.reshape(math.prod(lead), length).astype(jnp.int32)
    out = _gather(table, ids, impl, interpret)
    return out.reshape(*lead, length, table.shape[1])


def _check_args(table: jax.Array, rows: jax.Array, impl: str, interpret: Any) -> None:
    check_impl(impl, interpret, "gather")
    if table.ndim != 2:
        raise ValueError(f"table must be [R, D], got shape {table.shape}")
    if rows.ndim < 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"rows must be integer [..., L], got {rows.dtype}{list(rows.shape)}")


# ----------------------------------------------------------------------------------------------------------------
# Custom VJPs: the forward runs the chosen implementation, the backward is XLA.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gather_reduce(table, ids, weights, impl, interpret):
    return _dispatch("reduce", table, ids, weights, impl, interpret)


def _gather_reduce_fwd(table, ids, weights, impl, interpret):
    return _dispatch("reduce", table, ids, weights, impl, interpret), (table, ids, weights)


def _gather_reduce_bwd(impl, interpret, residuals, g):
    table, ids, weights = residuals  # g: f32[B, D]
    ids = _sanitize(ids, table.shape[0])
    w = jnp.where(ids < table.shape[0], weights, 0.0)
    d_table = _scatter_add_rows(table, ids, w[:, :, None] * g[:, None, :])
    d_weights = jnp.einsum("bld,bd->bl", gather_reference(table, ids), g, precision=_HIGHEST)
    return d_table, None, d_weights.astype(weights.dtype)


_gather_reduce.defvjp(_gather_reduce_fwd, _gather_reduce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gather(table, ids, impl, interpret):
    return _dispatch("gather", table, ids, None, impl, interpret)


def _gather_fwd(table, ids, impl, interpret):
    return _dispatch("gather", table, ids, None, impl, interpret), (table, ids)


def _gather_bwd(impl, interpret, residuals, g):
    table, ids = residuals  # g: f32[B, L, D]
    return _scatter_add_rows(table, _sanitize(ids, table.shape[0]), g), None


_gather.defvjp(_gather_fwd, _gather_bwd)


def _scatter_add_rows(table: jax.Array, ids: jax.Array, updates: jax.Array) -> jax.Array:
    """d table: updates f32[B, L, D] summed into rows ids i32[B, L] (sentinel dropped), in f32, as table's dtype."""
    num_rows, dim = table.shape
    summed = jnp.zeros((num_rows, dim), jnp.float32).at[ids.reshape(-1)].add(updates.reshape(-1, dim), mode="drop")
    return summed.astype(table.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Dispatch.


def _dispatch(kind: str, table, ids, weights, impl: str, interpret: Any):
    """kind "reduce" -> f32[B, D]; kind "gather" -> f32[B, L, D]. ids i32[B, L], weights f32[B, L] or None."""
    return by_platform(impl, interpret, (table, ids, weights), xla=functools.partial(_reference, kind),
                       mosaic=functools.partial(_mosaic, kind, interpret=interpret),
                       triton=functools.partial(_triton, kind, interpret=interpret))


def _reference(kind: str, table, ids, weights):
    if kind == "reduce":
        return gather_reduce_reference(table, ids, weights)
    return gather_reference(table, ids)


# ----------------------------------------------------------------------------------------------------------------
# Mosaic TPU kernel.
#
# Grid: (cores, steps per core), ("parallel", "arbitrary"): megacore chips give each TensorCore one contiguous run of
# steps, and within a run the steps are sequential, so the row DMAs pipeline across them (the structure of jax's
# paged-attention TPU kernel: the parallel axis first, the DMA-carrying axes "arbitrary" after it). A step owns
# _SUB_BLOCKS sub-blocks of G bags; a sub-block's G*L rows land in one slot of a 2-slot VMEM buffer, and the next
# sub-block's DMAs -- at a step's last sub-block, the next step's first -- are issued before the current one is
# consumed, so only the first sub-block of each core's run is fetched without overlap. With an even number of
# sub-blocks per step the slot of every sub-block is static (sub % 2; the next step's first sub-block lands in slot
# 0), so every VMEM offset stays static and no buffer index has to live in SMEM (the fused update, whose blocks are
# one per step, keeps one there).
#
# DMAs: ids outside [0, R) DMA a VMEM zero row instead (no HBM read for padding, no out-of-bounds DMA). When 8
# consecutive slot rows read 8 adjacent table rows (sorted distinct ids, e.g. the batch's distinct rows on the
# distinct-rows training path, or runs of ids in a bag), one 8-row DMA replaces eight. Every wait mirrors its start
# (the same test on the same SMEM ids picks the same descriptor).
#
# Pooling: bags of <= _VPU_MAX_BAG ids pool on the VPU -- the rows of a sub-block are laid out position-major (row
# l*G + g holds bag g's l-th id), so position l's rows are one contiguous [G, D] slice, scaled by a [G, 1] weight
# column and summed: L multiply-adds over [G, D]. Longer bags pool with one MXU matmul per sub-block against a
# block-diagonal weight matrix built from iotas (W[g, k] = w[k] when row k belongs to bag g), in f32 (HIGHEST); at
# L = 1 that matmul would be a 256x256 mostly-zero product per sub-block. Gather copies the slot into a flat [B * L, D]
# output block instead.
#
# bf16 tables are read as uint32 words: the ref is bitcast to [R/2, D] (TPU packs rows 2i and 2i+1 into the low and
# high halves of one 32-bit word), a DMA fetches the word row holding the wanted row, and the kernel splits the low
# (even row) and high (odd row) halves into exact f32 values; the weights arrive split by id parity so each half is
# pooled with its own weights. This keeps every DMA and VMEM access 32-bit wide at any row offset (Pallas TPU
# restricts unaligned slicing of packed 16-bit types), at the cost of reading 2x the bytes of a bf16 row (and no
# merged runs: adjacent ids share words).
#
# Budgets (pallas_kernels/hardware.py): one call's ids are scalar-prefetched into SMEM (`TpuBudget.smem_ids`; a larger
# batch runs as equal calls in a `lax.map` plus one for the rest), the VMEM buffers are sized to
# `vmem_buffer_bytes` and the kernel requests `vmem_limit_bytes`.

_SUB_BLOCKS = 8  # sub-blocks per grid step: even (static slots), and the weights / output blocks get 8k rows
_MOSAIC_ROWS_PER_SLOT = 256  # target G*L at D <= 128: rows in flight per DMA slot (128 KiB of f32)
_VPU_MAX_BAG = 8  # bags of up to this many ids pool on the VPU, longer ones on the MXU
_RUN = 8  # rows per merged DMA (a whole sublane tile of f32 rows)
_HIGH_HALF_MASK = 0xFFFF0000  # high half of a packed word: the odd row of a bf16 pair


@dataclasses.dataclass(frozen=True)
class MosaicPlan:
    """How the Mosaic kernel runs one case: G bags per sub-block, the pooling unit, merged DMAs, the budgets used."""

    bags: int
    pooling: str  # "vpu", "mxu", or "none" (gather)
    merge_runs: bool
    num_cores: int
    ids_per_call: int
    vmem_bytes: int  # the estimate of the kernel's VMEM buffers
    vmem_limit_bytes: int


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _vmem_estimate(kind: str, bags: int, length: int, dim: int, pooling: str, packed: bool) -> int:
    """Bytes of VMEM the kernel's blocks, scratch and largest temporaries take: words are 4 bytes, lanes pad to 128,
    sublanes to 8 (per [.., sublane, lane] tile of a 3-D block), blocks are double-buffered."""
    lanes, rows, parts = _round_up(dim, 128), bags * length, 2 if packed else 1
    vmem = 2 * _round_up(rows, 8) * lanes * 4 + 8 * lanes * 4  # the two DMA slots, the zero row
    if kind == "gather":
        return vmem + 2 * _SUB_BLOCKS * _round_up(rows, 8) * lanes * 4  # output blocks [8, G*L, D]
    vmem += 2 * _SUB_BLOCKS * _round_up(bags, 8) * lanes * 4  # output blocks [8, G, D]
    if pooling == "vpu":  # weights blocks [8, G, L]; the accumulator
        return vmem + 2 * parts * _SUB_BLOCKS * _round_up(bags, 8) * 128 * 4 + _round_up(bags, 8) * lanes * 4
    # weights blocks [8, 1, G*L]; the block-diagonal matrix and its mask; the unpacked halves
    return (vmem + 2 * parts * _SUB_BLOCKS * 8 * _round_up(rows, 128) * 4 + 2 * _round_up(bags, 8)
            * _round_up(rows, 128) * 4 + parts * _round_up(rows, 8) * lanes * 4)


def mosaic_plan(kind: str, num_rows: int, dim: int, dtype: Any, length: int) -> MosaicPlan | str:
    """The Mosaic kernel's plan for this case on the chip being lowered for, or why it hands the case to XLA."""
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.bfloat16):
        return f"{dtype} tables: only f32 rows and bf16 rows (as packed 32-bit words) are DMA'd"
    packed = dtype == jnp.bfloat16
    if packed and num_rows % 2:
        return ("bf16 table with an odd row count: rows are fetched as packed pairs of rows (32-bit words), which "
                "needs an even row count")
    budget = tpu_budget()
    pooling = "none" if kind == "gather" else "vpu" if length <= _VPU_MAX_BAG else "mxu"
    # G: the largest power of two whose G * L rows fit a slot of _MOSAIC_ROWS_PER_SLOT rows of 128 lanes (wider rows
    # -> fewer of them), then halved until the buffers fit the chip's VMEM budget.
    slot_rows = max(8, _MOSAIC_ROWS_PER_SLOT * 128 // _round_up(dim, 128))
    bags = 1
    while bags * 2 * length <= slot_rows:
        bags *= 2
    while bags > 1 and _vmem_estimate(kind, bags, length, dim, pooling, packed) > budget.vmem_buffer_bytes:
        bags //= 2
    vmem = _vmem_estimate(kind, bags, length, dim, pooling, packed)
    if vmem > budget.vmem_buffer_bytes:
        return (f"bags of {length} ids x dim {dim} need ~{vmem >> 20} MiB of VMEM (> {budget.vmem_buffer_bytes >> 20} "
                f"MiB on {budget.chip})")
    if _SUB_BLOCKS * bags * length > budget.smem_ids:
        return f"one grid step's {_SUB_BLOCKS * bags * length} ids exceed the {budget.smem_ids} SMEM ids per call"
    merge = not packed and (pooling != "vpu" or length == 1) and (bags * length) % _RUN == 0
    return MosaicPlan(bags, pooling, merge, budget.num_cores, budget.smem_ids, vmem, budget.vmem_limit_bytes)


def mosaic_fallback_reason(kind: str, num_rows: int, dim: int, dtype: Any, length: int) -> str | None:
    """Why the Mosaic kernel does not take this case (None when it does); the XLA reference runs instead."""
    plan = mosaic_plan(kind, num_rows, dim, dtype, length)
    return plan if isinstance(plan, str) else None


def _mosaic(kind: str, table, ids, weights, *, interpret: Any):
    num_rows, dim = table.shape
    num_bags, length = ids.shape
    plan = mosaic_plan(kind, num_rows, dim, table.dtype, length) if num_bags and length else "nothing to launch"
    if isinstance(plan, str):
        return _reference(kind, table, ids, weights)
    packed = table.dtype == jnp.bfloat16
    ids = _sanitize(ids, num_rows)
    step_bags = _SUB_BLOCKS * plan.bags
    # SMEM holds one call's ids: a large batch runs as equal calls in a lax.map (traced once) plus one for the rest.
    # A call's steps are a multiple of the core count when it has several, so each core gets the same run length.
    max_steps = max(1, plan.ids_per_call // (step_bags * length))
    if max_steps >= plan.num_cores:
        max_steps -= max_steps % plan.num_cores
    call_bags = max_steps * step_bags
    full, rest = divmod(num_bags, call_bags)
    call = lambda ids_and_w: _mosaic_call(kind, table, *ids_and_w, plan=plan, packed=packed, interpret=interpret)
    outs = []
    if full == 1:
        outs.append(call((ids[:call_bags], None if weights is None else weights[:call_bags])))
    elif full > 1:
        chunks = lambda x: None if x is None else x[:full * call_bags].reshape(full, call_bags, length)
        mapped = jax.lax.map(call, (chunks(ids), chunks(weights)))  # [full, call_bags (* L), D]
        outs.append(mapped.reshape(-1, dim))
    if rest:
        start = full * call_bags
        outs.append(call((ids[start:], None if weights is None else weights[start:])))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    if kind == "gather":
        out = out.reshape(num_bags, length, dim)
        if packed:
            out = _unpack_bf16_rows(out, ids)
    return out


def _unpack_bf16_rows(words: jax.Array, ids: jax.Array) -> jax.Array:
    """u32[B, L, D] words (row pairs) -> f32[B, L, D]: the high half for odd ids, the low half for even ids."""
    return jnp.where((ids % 2 == 1)[:, :, None], _high_half(words), _low_half(words))


# Jitted (and inlined) with its static configuration, so a call site whose shapes, plan and chip were traced before
# reuses that trace: "auto" traces every platform's kernel at every call site, on a CPU too.
@functools.partial(jax.jit, static_argnums=0, static_argnames=("plan", "packed", "interpret"), inline=True)
def _mosaic_call(kind: str, table, ids, weights, *, plan: MosaicPlan, packed: bool, interpret: Any):
    """One pallas_call over ids i32[B, L] (already sanitized); see the section comment. Returns [B (* L), D]."""
    num_rows, dim = table.shape
    num_bags, length = ids.shape
    bags = plan.bags
    step_bags = _SUB_BLOCKS * bags
    steps = pl.cdiv(num_bags, step_bags)
    cores = min(plan.num_cores, steps)
    per_core = pl.cdiv(steps, cores)
    padded_bags = cores * per_core * step_bags
    slot_rows = bags * length
    # Padding bags read the sentinel (zero-row DMAs from VMEM, no HBM traffic); their outputs are sliced off.
    pad = ((0, padded_bags - num_bags), (0, 0))
    flat_ids = jnp.pad(ids, pad, constant_values=num_rows).reshape(-1)
    # Every block is [sub-blocks, ...]: the kernel indexes sub-blocks on the leading, untiled dim only, so its
    # dynamic indices never cut a (sublane, lane) tile.
    step = lambda c, j, ids_ref: (c * per_core + j, 0, 0)
    in_specs = [pl.BlockSpec(memory_space=pl.ANY)]
    operands = [table]
    if kind == "reduce":
        w = jnp.where(ids < num_rows, weights, 0.0)
        parts = [jnp.where(ids % 2 == 0, w, 0.0), jnp.where(ids % 2 == 1, w, 0.0)] if packed else [w]
        for part in parts:
            part = jnp.pad(part, pad)
            if plan.pooling == "vpu":  # [B / G, G, L]: sub-block s's position l is the [G, 1] column [s, :, l]
                operands.append(part.reshape(padded_bags // bags, bags, length))
                in_specs.append(pl.BlockSpec((_SUB_BLOCKS, bags, length), step))
            else:  # [B / G, 1, G * L]: sub-block s's weights, bag-major, are the row [s, 0, :]
                operands.append(part.reshape(padded_bags // bags, 1, slot_rows))
                in_specs.append(pl.BlockSpec((_SUB_BLOCKS, 1, slot_rows), step))
        out_shape = jax.ShapeDtypeStruct((padded_bags // bags, bags, dim), jnp.float32)
        out_spec = pl.BlockSpec((_SUB_BLOCKS, bags, dim), step)
    else:  # [B / G, G * L, D]: a sub-block's rows flat (a [B, L, D] block would pad L to 8 sublanes)
        out_shape = jax.ShapeDtypeStruct((padded_bags // bags, slot_rows, dim), jnp.uint32 if packed else jnp.float32)
        out_spec = pl.BlockSpec((_SUB_BLOCKS, slot_rows, dim), step)
    word = jnp.uint32 if packed else table.dtype
    kernel = functools.partial(_mosaic_kernel, kind=kind, num_rows=num_rows, length=length, bags=bags,
                               packed=packed, pooling=plan.pooling, merge_runs=plan.merge_runs, per_core=per_core,
                               num_weights=len(operands) - 1)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(cores, per_core),
            in_specs=in_specs,
            out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((2, slot_rows, dim), word),  # the two DMA slots
                            pltpu.VMEM((1, dim), word),  # the zero row sentinel ids read
                            pltpu.SemaphoreType.DMA((2,))]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=plan.vmem_limit_bytes),
        interpret=interpret,
        name="gather_mosaic" if kind == "gather" else f"gather_reduce_mosaic_{plan.pooling}",
    )(flat_ids, *operands)
    return out.reshape(-1, dim)[:num_bags * (length if kind == "gather" else 1)]


def _mosaic_kernel(ids_smem, table_hbm, *refs, kind: str, num_rows: int, length: int, bags: int, packed: bool,
                   pooling: str, merge_runs: bool, per_core: int, num_weights: int):
    """ids_smem i32[padded B * L]; table_hbm [R, D] in HBM; weights blocks (reduce); out block; scratch."""
    weight_refs, (out_ref, slots, zero_row, sems) = refs[:num_weights], refs[num_weights:]
    slot_rows = bags * length
    source = table_hbm.bitcast(jnp.uint32) if packed else table_hbm  # [R/2, D] words or [R, D] rows
    j = pl.program_id(1)
    first_id = (pl.program_id(0) * per_core + j) * (_SUB_BLOCKS * slot_rows)

    def copy(src, slot, dst_row, count: int, issue: bool) -> None:
        dma = pltpu.make_async_copy(src, slots.at[slot, pl.ds(dst_row, count)], sems.at[slot])
        dma.start() if issue else dma.wait()

    def row_copy(slot, dst_row, row, issue: bool) -> None:
        """Slot row `dst_row` <- table row `row`, or the zero row for the sentinel; start it or wait for it."""
        @pl.when(row < num_rows)
        def _():
            copy(source.at[pl.ds(jax.lax.shift_right_logical(row, 1) if packed else row, 1)], slot, dst_row, 1, issue)

        @pl.when(row >= num_rows)
        def _():
            copy(zero_row, slot, dst_row, 1, issue)

    def sub_block(first, slot, *, issue: bool) -> None:
        """Start (or wait for) the DMAs of the sub-block whose ids start at flat index `first`, into `slot`."""
        # Loops rather than unrolled bodies throughout: every traced body costs compile time at each call site (a
        # CPU program traces the kernels too: lax.platform_dependent traces every branch).
        if pooling == "vpu" and length > 1:  # position-major: slot row l*G + g <- bag g's l-th id
            def by_slot(k, carry):
                # G is a power of two: a shift and a mask (integer // and % lower through `sign`, which Mosaic
                # cannot lower without knowing the TPU generation, e.g. when exporting from a CPU host).
                pos, g = jax.lax.shift_right_logical(k, bags.bit_length() - 1), k & (bags - 1)
                row_copy(slot, k, ids_smem[first + g * length + pos], issue)
                return carry

            jax.lax.fori_loop(0, slot_rows, by_slot, 0)
        elif merge_runs:  # bag-major, in runs of _RUN slot rows: one DMA when their ids are adjacent table rows
            def by_run(r, carry):
                k = pl.multiple_of(r * _RUN, _RUN)
                base = ids_smem[first + k]
                adjacent = base + _RUN <= num_rows  # ids are sanitized: base >= 0
                for t in range(1, _RUN):
                    adjacent = adjacent & (ids_smem[first + k + t] == base + t)

                @pl.when(adjacent)
                def _():
                    copy(source.at[pl.ds(base, _RUN)], slot, k, _RUN, issue)

                @pl.when(jnp.logical_not(adjacent))
                def _():
                    def by_row(t, carry):
                        row_copy(slot, k + t, ids_smem[first + k + t], issue)
                        return carry

                    jax.lax.fori_loop(0, _RUN, by_row, 0)
                return carry

            jax.lax.fori_loop(0, slot_rows // _RUN, by_run, 0)
        else:
            def by_row(k, carry):
                row_copy(slot, k, ids_smem[first + k], issue)
                return carry

            jax.lax.fori_loop(0, slot_rows, by_row, 0)

    def halves(words) -> list:
        return [_low_half(words), _high_half(words)] if packed else [words.astype(jnp.float32)]

    def consume(sub, slot) -> None:
        if kind == "gather":
            out_ref[sub] = slots[slot].astype(out_ref.dtype)
            return
        pooled = jnp.zeros((bags, out_ref.shape[2]), jnp.float32)
        if pooling == "vpu":  # position l's rows are slot rows [l*G, (l+1)*G): scale by the [G, 1] column, add
            weights = [w_ref[sub] for w_ref in weight_refs]  # [G, L] each
            for pos in range(length):
                rows = halves(slots[slot, pl.ds(pos * bags, bags), :])
                for w, half in zip(weights, rows, strict=True):
                    pooled += half * w[:, pos:pos + 1]
        else:  # W[g, k] = w[k] when id k belongs to bag g: G bags pooled by one matmul
            col = jax.lax.broadcasted_iota(jnp.int32, (bags, slot_rows), 1)
            first = jax.lax.broadcasted_iota(jnp.int32, (bags, slot_rows), 0) * length
            in_bag = (col >= first) & (col < first + length)
            for w_ref, half in zip(weight_refs, halves(slots[slot]), strict=True):
                w = jnp.where(in_bag, jnp.broadcast_to(w_ref[sub], (bags, slot_rows)), 0.0)
                pooled += jnp.dot(w, half, precision=_HIGHEST, preferred_element_type=jnp.float32)
        out_ref[sub] = pooled

    # A core's first step fetches its first sub-block unoverlapped (and zeroes the zero row: later steps' DMAs may
    # read it while in flight, so it is written only here); every later fetch is issued one sub-block earlier.
    @pl.when(j == 0)
    def _():
        zero_row[...] = jnp.zeros(zero_row.shape, zero_row.dtype)
        sub_block(first_id, 0, issue=True)

    def by_sub_block(sub, carry):
        slot = sub & 1  # _SUB_BLOCKS is even: a step's first sub-block is always in slot 0
        # The next sub-block's ids follow this one's, across the step boundary too (a core's steps are contiguous):
        # at a step's last sub-block this is the next step's first, unless the core's run ends here.
        @pl.when((sub + 1 < _SUB_BLOCKS) | (j + 1 < per_core))
        def _():
            sub_block(first_id + (sub + 1) * slot_rows, 1 - slot, issue=True)

        sub_block(first_id + sub * slot_rows, slot, issue=False)
        consume(sub, slot)
        return carry

    jax.lax.fori_loop(0, _SUB_BLOCKS, by_sub_block, 0)


def _low_half(words: jax.Array) -> jax.Array:
    """The even rows of packed bf16 row pairs u32[..., D], as exact f32 (a bf16 is the top half of an f32)."""
    return jax.lax.bitcast_convert_type(words << 16, jnp.float32)


def _high_half(words: jax.Array) -> jax.Array:
    """The odd rows of packed bf16 row pairs, as exact f32."""
    return jax.lax.bitcast_convert_type(words & jnp.uint32(_HIGH_HALF_MASK), jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# Triton GPU kernel.
#
# Grid: (bag blocks of BB, column blocks of DT). A program walks its BB bags' L ids a chunk of LC positions at a time:
# it loads the [BB, LC] ids of the chunk, gathers their BB x LC rows (DT columns each) with one masked load -- ids
# outside [0, R), positions past L and columns past D masked to zero -- and adds w * row over the chunk's positions
# into an f32 [BB, DT] accumulator (bf16 / f16 rows are widened to f32 as loaded). One loop step thus has BB x LC
# independent rows in flight, the memory-level parallelism a gather needs (FBGEMM's TBE forward keeps a warp's 32
# ids' rows in flight the same way); each row's DT columns are contiguous and the row offset is a multiple of D, so
# Triton can issue vector loads along a row. Triton tensors must have power-of-two shapes: DT is D rounded up to a
# power of two (at most 128), masked past D, and the table is never padded; LC is L rounded up to a power of two, at
# most _TRITON_MAX_CHUNK. BB is as large as the register tile allows (_TRITON_TILE elements of BB x LC x DT) unless
# that leaves fewer than _TRITON_PROGRAMS_PER_SM programs per SM of the device (`hardware.gpu_budget`), but keeps at
# least _TRITON_MIN_ROWS rows per step; the loads are software-pipelined over as many stages as the device's shared
# memory per block holds (at most 3). Every stacked table of a group is one array with row offsets (the engine's
# groups, FBGEMM TBE's stacking), so one launch serves every feature of a (group, bag size).

_TRITON_TILE = 8192  # BB * LC * DT elements gathered per loop step: 64 f32 registers per thread at 4 warps
_TRITON_MAX_CHUNK = 16  # LC: bag positions per loop step
_TRITON_MIN_ROWS = 16  # BB * LC: rows in flight per loop step, at least
_TRITON_PROGRAMS_PER_SM = 4
_TRITON_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class TritonBlocks(NamedTuple):
    """How the Triton kernel tiles one case (section comment)."""

    bags: int  # BB, bags per program
    chunk: int  # LC, bag positions per loop step
    cols: int  # DT, columns per program
    stages: int  # software-pipelining stages of the loop's loads


def triton_fallback_reason(kind: str, num_rows: int, dim: int, dtype: Any, length: int) -> str | None:
    """Why the Triton kernel does not take this case (None when it does); the XLA reference runs instead."""
    if jnp.dtype(dtype) not in _TRITON_DTYPES:
        return f"{jnp.dtype(dtype)} tables: the Triton kernel loads f32, bf16 and f16 rows"
    return None


def triton_blocks(num_bags: int, length: int, dim: int, itemsize: int) -> TritonBlocks:
    """The tiling for this case on this device (section comment)."""
    budget = gpu_budget()
    cols = min(pl.next_power_of_2(dim), 128)
    chunk = min(pl.next_power_of_2(length), _TRITON_MAX_CHUNK)
    floor = max(1, _TRITON_MIN_ROWS // chunk)
    bags = max(floor, min(256, _TRITON_TILE // (chunk * cols)))
    col_blocks = pl.cdiv(dim, cols)
    while bags > floor and pl.cdiv(num_bags, bags) * col_blocks < _TRITON_PROGRAMS_PER_SM * budget.sm_count:
        bags //= 2
    stages = max(1, min(3, budget.shared_memory_per_block // (bags * chunk * cols * itemsize)))
    return TritonBlocks(bags, chunk, cols, stages)


def _triton(kind: str, table, ids, weights, *, interpret: Any):
    num_rows, dim = table.shape
    num_bags, length = ids.shape
    if num_bags == 0 or length == 0 or triton_fallback_reason(kind, num_rows, dim, table.dtype, length):
        return _reference(kind, table, ids, weights)
    return _triton_call(kind, table, _sanitize(ids, num_rows), weights,
                        blocks=triton_blocks(num_bags, length, dim, table.dtype.itemsize), interpret=bool(interpret))


@functools.partial(jax.jit, static_argnums=0, static_argnames=("blocks", "interpret"), inline=True)
def _triton_call(kind: str, table, ids, weights, *, blocks: TritonBlocks, interpret: bool):
    """The pallas_call over sanitized ids (jitted like `_mosaic_call`)."""
    num_rows, dim = table.shape
    num_bags, length = ids.shape
    operands = [ids] if weights is None else [ids, weights]
    out_shape = (num_bags, dim) if kind == "reduce" else (num_bags, length, dim)
    kernel = functools.partial(_triton_kernel, kind=kind, num_rows=num_rows, num_bags=num_bags, length=length,
                               dim=dim, blocks=blocks)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(pl.cdiv(num_bags, blocks.bags), pl.cdiv(dim, blocks.cols)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=blocks.stages),
        interpret=interpret,
        name="gather_triton" if kind == "gather" else "gather_reduce_triton",
    )(*operands, table)


def _triton_kernel(*refs, kind: str, num_rows: int, num_bags: int, length: int, dim: int, blocks: TritonBlocks):
    """ids i32[B, L], (reduce) weights f32[B, L], table [R, D], out f32[B, D] or f32[B, L, D]; all whole arrays."""
    if kind == "reduce":
        ids_ref, w_ref, table_ref, out_ref = refs
    else:
        (ids_ref, table_ref, out_ref), w_ref = refs, None
    bag = pl.program_id(0) * blocks.bags + jnp.arange(blocks.bags, dtype=jnp.int32)
    col = pl.program_id(1) * blocks.cols + jnp.arange(blocks.cols, dtype=jnp.int32)
    bag_ok, col_ok = bag < num_bags, col < dim
    # Index arrays broadcast to [BB, LC] (ids, weights) and [BB, LC, DT] (rows): interpret mode discharges
    # all-array indexing, and Triton turns it into the same pointer arithmetic.
    bags_2d = jnp.broadcast_to(bag[:, None], (blocks.bags, blocks.chunk))
    tile = (blocks.bags, blocks.chunk, blocks.cols)
    cols_3d = jnp.broadcast_to(col[None, None, :], tile)
    col_ok_3d = jnp.broadcast_to(col_ok[None, None, :], tile)

    def chunk_at(c):
        """(positions [BB, LC], the slots that exist (bag < B, position < L), the ids read (id in [0, R)) and the
        rows f32[BB, LC, DT] -- zeros where no id is read) of chunk c."""
        pos = jnp.broadcast_to((c * blocks.chunk + jnp.arange(blocks.chunk, dtype=jnp.int32))[None, :],
                               (blocks.bags, blocks.chunk))
        slot_ok = bag_ok[:, None] & (pos < length)
        row = plgpu.load(ids_ref.at[bags_2d, pos], mask=slot_ok, other=num_rows)
        ok = slot_ok & (row < num_rows)
        safe = jnp.where(ok, row, 0)  # masked lanes never read, but keep their addresses in bounds
        rows_3d = jnp.broadcast_to(safe[:, :, None], tile)
        vals = plgpu.load(table_ref.at[rows_3d, cols_3d], mask=jnp.broadcast_to(ok[:, :, None], tile) & col_ok_3d,
                          other=0)
        return pos, slot_ok, ok, vals.astype(jnp.float32)

    steps = pl.cdiv(length, blocks.chunk)
    if kind == "gather":
        def copy(c, carry):
            pos, slot_ok, _, vals = chunk_at(c)
            index = (jnp.broadcast_to(bag[:, None, None], tile), jnp.broadcast_to(pos[:, :, None], tile), cols_3d)
            plgpu.store(out_ref.at[index], vals, mask=jnp.broadcast_to(slot_ok[:, :, None], tile) & col_ok_3d)
            return carry

        jax.lax.fori_loop(0, steps, copy, 0)
        return

    def accumulate(c, acc):
        pos, _, ok, vals = chunk_at(c)
        w = plgpu.load(w_ref.at[bags_2d, pos], mask=ok, other=0.0)
        return acc + jnp.sum(w[:, :, None] * vals, axis=1)

    acc = jax.lax.fori_loop(0, steps, accumulate, jnp.zeros((blocks.bags, blocks.cols), jnp.float32))
    out_index = (jnp.broadcast_to(bag[:, None], (blocks.bags, blocks.cols)),
                 jnp.broadcast_to(col[None, :], (blocks.bags, blocks.cols)))
    plgpu.store(out_ref.at[out_index], acc, mask=bag_ok[:, None] & col_ok[None, :])
