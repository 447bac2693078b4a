"""Gather-reduce (pooled lookup) and gather (per-id lookup) from a row table, with Pallas kernels.

Semantics shared by every implementation: `table` is f32 or bf16 [R, D]; row ids outside [0, R) -- R is the
padding sentinel -- read zeros; results are f32 and accumulate in f32. Leading dims of `rows` are batch dims, so
one launch serves [B, L] (one feature) or [B, F, L] (all features of a stacked group).

Implementations (`impl=`):
  "xla"         the plain-jnp references below: the fastest path on CPU and the oracle for the kernels.
  "pallas_tpu"  the Mosaic TPU kernel: ids in SMEM (scalar prefetch), the table left in HBM, one DMA per row into a
                double-buffered VMEM scratch, pooled on the MXU.
  "pallas_gpu"  the Triton kernel: a block of bags per program, rows gathered with masked loads, f32 accumulation.
  "pallas"      Mosaic on TPU, Triton on GPU, chosen when the computation is lowered (`lax.platform_dependent`), so
                one traced function exports for either platform, from any host (lowering it for CPU fails: Pallas
                "Only interpret mode is supported on CPU backend").
  "auto"        "pallas" when `jax.default_backend()` is TPU or GPU, else (CPU) the XLA reference -- decided at trace
                time, so CPU programs never pay for tracing the kernels at every call site. To export a kernel for
                TPU / GPU from a CPU host, use "pallas".
`interpret=True` (or a `pltpu.InterpretParams`) runs a kernel in Pallas interpret mode on CPU: the kernel of
`jax.default_backend()`, the Mosaic one on CPU, or the one "pallas_tpu" / "pallas_gpu" names.

A case a kernel cannot express falls back to the XLA reference for that case only (`mosaic_fallback_reason`,
`triton_fallback_reason`; the why of each is in the Mosaic and Triton sections below):

    case                                         TPU: Mosaic kernel           CUDA / ROCm: Triton kernel
    f32 table, any D (never padded)              kernel                       kernel
    bf16 table, even R                           kernel (packed row pairs)    kernel
    bf16 table with odd R; f16 table             XLA                          kernel
    other dtypes                                 XLA                          XLA
    long bags past the VMEM estimate             XLA                          kernel
    more than `_MOSAIC_MAX_IDS_PER_CALL` ids     equal SMEM-sized calls in a `lax.map` (one kernel traced; a Python
                                                 loop would trace every call) + one for the rest; Triton: one call
    no bags, or bags of length 0                 XLA (nothing to launch)

What the lowering tests (tests/test_kernel_lowering.py: `jax.export` for "tpu" and "cuda") prove is Pallas' own
lowering; Mosaic's layout passes and VMEM allocation (libtpu) and Triton's compilation to PTX (XLA:GPU) run only on
the device, so the first run on a TPU / GPU should repeat tests/test_gather_kernels.py with `interpret=False`. To
watch there (valid for 32-bit types per the Pallas TPU docs, not verified on hardware): single-row DMAs at
arbitrary row offsets into VMEM, the uint32 bitcast of the HBM ref, static unaligned sublane slices, and matmuls
whose contraction (G * L) is not a multiple of 128. No kernel speed has been measured; interpret mode's times on CPU
mean nothing.

Found with jax / jaxlib 0.10.2 on CPU: `jax.export` refuses Triton calls (their IR has no stable serialization)
unless given `disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]`; one export for
platforms=["tpu", "cuda"] fails (every `platform_dependent` branch is lowered for every platform), so export once per
platform; integer `//` and `%` in a Mosaic kernel lower through `sign`, which asks for the TPU generation and fails
on a CPU host, so the kernel shifts instead; the TPU simulator (`pltpu.InterpretParams`) cannot run the bf16 variant
(a DMA through a bitcast ref), `interpret=True` runs both. `pallas_kernels.gather_reduce` is this module's function,
which shadows the module: reach the module with `importlib.import_module("pallas_kernels.gather_reduce")`.

Gradients (`jax.custom_vjp`): d table is the transpose, an XLA scatter-add of g (x w) into the rows read (the
sentinel dropped; duplicates summed exactly, accumulated in f32 and cast to the table's dtype); d weights is
<g, table[rows]>; ids get none.
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

IMPLS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu")
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
    if impl not in IMPLS:
        raise ValueError(f"unknown gather impl '{impl}'; use one of {IMPLS}")
    if table.ndim != 2:
        raise ValueError(f"table must be [R, D], got shape {table.shape}")
    if rows.ndim < 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"rows must be integer [..., L], got {rows.dtype}{list(rows.shape)}")
    if impl == "xla" and interpret:
        raise ValueError("interpret=True runs a Pallas kernel; impl='xla' has none (use 'pallas_tpu' or 'pallas_gpu')")


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
    reference = functools.partial(_reference, kind)
    mosaic = functools.partial(_mosaic, kind, interpret=interpret)
    triton = functools.partial(_triton, kind, interpret=interpret)
    args = (table, ids, weights)
    backend = jax.default_backend()
    if impl == "auto" and not interpret:
        impl = "pallas" if backend in ("tpu", "gpu") else "xla"
    if impl == "xla":
        return reference(*args)
    if impl == "pallas_tpu" or (interpret and backend != "gpu"):
        return mosaic(*args)
    if impl == "pallas_gpu" or interpret:
        return triton(*args)
    # Chosen per platform when lowered: a TPU export gets Mosaic, a CUDA / ROCm export Triton. Other platforms get
    # the Mosaic branch, whose lowering there fails with Pallas' own message (a kernel was asked for; none runs).
    return jax.lax.platform_dependent(*args, tpu=mosaic, cuda=triton, rocm=triton, default=mosaic)


def _reference(kind: str, table, ids, weights):
    if kind == "reduce":
        return gather_reduce_reference(table, ids, weights)
    return gather_reference(table, ids)


# ----------------------------------------------------------------------------------------------------------------
# Mosaic TPU kernel.
#
# Grid: one step per block of BB = _SUB_BLOCKS * G bags ("parallel": steps are independent, so megacore chips split
# them). A step walks its _SUB_BLOCKS sub-blocks of G bags; a sub-block's G*L rows land in one slot of a 2-slot VMEM
# buffer by one DMA per row, and the next sub-block's DMAs are issued before the current one is consumed, so row
# fetches overlap the pooling. Ids outside [0, R) DMA a zero row from VMEM instead: every buffer row gets exactly one
# DMA (its wait mirrors it), nothing reads out of bounds, and padding costs no HBM traffic. Pooling is one MXU matmul
# per sub-block with a block-diagonal weight matrix built from iotas (W[g, k] = w[k] when row k belongs to bag g), in
# f32 (HIGHEST); gather copies the slot into a flat [B * L, D] output block instead. The first sub-block's fetch in a
# step is not overlapped (a cross-step prefetch would make the grid sequential, and lose the megacore split).
#
# bf16 tables are read as uint32 words: the ref is bitcast to [R/2, D] (TPU packs rows 2i and 2i+1 into the low and
# high halves of one 32-bit word), a DMA fetches the word row holding the wanted row, and the kernel splits the low
# (even row) and high (odd row) halves into exact f32 values; the weights arrive split by id parity so each half is
# pooled with its own matmul. This keeps every DMA and VMEM access 32-bit wide at any row offset (Pallas TPU
# restricts unaligned slicing of packed 16-bit types), at the cost of reading 2x the bytes of a bf16 row. The bitcast
# needs an even R, hence the odd-R fallback; f16 would need the same plus an f16 -> f32 conversion (not done). VMEM:
# the two DMA slots and the double-buffered weights / output blocks are estimated per case, and above
# _MOSAIC_VMEM_BUDGET the case runs XLA. SMEM holds one call's ids (16 KiB on v2 / v3, 1 MiB on v4 and later).

_SUB_BLOCKS = 8  # sub-blocks per grid step: the weights / output blocks then have 8 rows (TPU sublane tiling)
_MOSAIC_ROWS_PER_SLOT = 256  # target G*L at D <= 128: rows in flight per DMA slot (128 KiB of f32)
_MOSAIC_MAX_IDS_PER_CALL = 1 << 15  # ids scalar-prefetched into SMEM per pallas_call (128 KiB; SMEM is 1 MiB on v4+)
_MOSAIC_VMEM_BUDGET = 12 << 20  # bytes of VMEM a call may use (the default scoped limit is 16 MiB on v4 / v5e)
_HIGH_HALF_MASK = 0xFFFF0000  # high half of a packed word: the odd row of a bf16 pair


def _bags_per_slot(length: int, dim: int) -> int:
    """G: the largest power of two whose G * L rows fit a slot of _MOSAIC_ROWS_PER_SLOT rows of 128 lanes (wider
    rows -> fewer of them, so the output block of 8 G bags stays small at large D); at least 1."""
    slot_rows = max(8, _MOSAIC_ROWS_PER_SLOT * 128 // _round_up(dim, 128))
    bags = 1
    while bags * 2 * length <= slot_rows:
        bags *= 2
    return bags


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def mosaic_fallback_reason(kind: str, num_rows: int, dim: int, dtype: Any, length: int) -> str | None:
    """Why the Mosaic kernel does not take this case (None when it does); the XLA reference runs instead."""
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.bfloat16):
        return f"{dtype} tables: only f32 rows and bf16 rows (as packed 32-bit words) are DMA'd"
    if dtype == jnp.bfloat16 and num_rows % 2:
        return ("bf16 table with an odd row count: rows are fetched as packed pairs of rows (32-bit words), which "
                "needs an even row count")
    bags = _bags_per_slot(length, dim)
    lanes = _round_up(dim, 128)
    vmem = 2 * _round_up(bags * length, 8) * lanes * 4  # the two DMA slots
    vmem += 2 * 2 * _SUB_BLOCKS * _round_up(bags * length, 128) * 4  # weights blocks (x2 buffers, x2 for bf16)
    if kind == "reduce":
        vmem += 2 * _SUB_BLOCKS * bags * lanes * 4  # output blocks
    else:
        vmem += 2 * _SUB_BLOCKS * _round_up(bags * length, 8) * lanes * 4
    if vmem > _MOSAIC_VMEM_BUDGET:
        return f"bags of {length} ids x dim {dim} need ~{vmem >> 20} MiB of VMEM (> {_MOSAIC_VMEM_BUDGET >> 20} MiB)"
    if _SUB_BLOCKS * bags * length > _MOSAIC_MAX_IDS_PER_CALL:
        return f"one grid step's {_SUB_BLOCKS * bags * length} ids exceed the SMEM budget per call"
    return None


def _mosaic(kind: str, table, ids, weights, *, interpret: Any):
    num_rows, dim = table.shape
    num_bags, length = ids.shape
    if num_bags == 0 or length == 0 or mosaic_fallback_reason(kind, num_rows, dim, table.dtype, length):
        return _reference(kind, table, ids, weights)
    packed = table.dtype == jnp.bfloat16
    ids = _sanitize(ids, num_rows)
    bags = _bags_per_slot(length, dim)
    step_bags = _SUB_BLOCKS * bags
    # SMEM holds one call's ids: a large batch runs as equal calls in a lax.map (traced once) plus one for the rest.
    call_bags = max(step_bags, _MOSAIC_MAX_IDS_PER_CALL // length // step_bags * step_bags)
    full, rest = divmod(num_bags, call_bags)
    call = lambda ids_and_w: _mosaic_call(kind, table, *ids_and_w, bags=bags, packed=packed, interpret=interpret)
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


def _mosaic_call(kind: str, table, ids, weights, *, bags: int, packed: bool, interpret: Any):
    """One pallas_call over ids i32[B, L] (already sanitized); see the section comment."""
    num_rows, dim = table.shape
    num_bags, length = ids.shape
    step_bags = _SUB_BLOCKS * bags
    padded_bags = _round_up(num_bags, step_bags)
    slot_rows = bags * length
    # Padding bags read the sentinel; their outputs fall outside the (partial) last output block and are dropped.
    flat_ids = jnp.pad(ids, ((0, padded_bags - num_bags), (0, 0)), constant_values=num_rows).reshape(-1)
    step = lambda i, ids_ref: (i, 0)
    in_specs = [pl.BlockSpec(memory_space=pl.ANY)]
    operands = [table]
    if kind == "reduce":
        w = jnp.where(ids < num_rows, weights, 0.0)
        parts = [jnp.where(ids % 2 == 0, w, 0.0), jnp.where(ids % 2 == 1, w, 0.0)] if packed else [w]
        for part in parts:  # [padded_bags / G, G * L]: one row per sub-block, bag-major
            part = jnp.pad(part, ((0, padded_bags - num_bags), (0, 0))).reshape(padded_bags // bags, slot_rows)
            operands.append(part)
            in_specs.append(pl.BlockSpec((_SUB_BLOCKS, slot_rows), step))
        out_shape = jax.ShapeDtypeStruct((num_bags, dim), jnp.float32)
        out_spec = pl.BlockSpec((step_bags, dim), step)
    else:  # rows flat, [B * L, D]: a [B, L, D] block would pad L to 8 sublanes (8x the VMEM at L = 1)
        out_shape = jax.ShapeDtypeStruct((num_bags * length, dim), jnp.uint32 if packed else jnp.float32)
        out_spec = pl.BlockSpec((_SUB_BLOCKS * slot_rows, dim), step)
    word = jnp.uint32 if packed else table.dtype
    kernel = functools.partial(_mosaic_kernel, kind=kind, num_rows=num_rows, length=length, bags=bags,
                               packed=packed, num_weights=len(operands) - 1)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(padded_bags // step_bags,),
            in_specs=in_specs,
            out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((2, slot_rows, dim), word),  # the two DMA slots
                            pltpu.VMEM((1, dim), word),  # the zero row sentinel ids read
                            pltpu.SemaphoreType.DMA((2,))]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name=f"gather_{kind}_mosaic",
    )(flat_ids, *operands)


def _mosaic_kernel(ids_smem, table_hbm, *refs, kind: str, num_rows: int, length: int, bags: int, packed: bool,
                   num_weights: int):
    """ids_smem i32[padded B * L]; table_hbm [R, D] in HBM; weights refs (reduce) [8, G*L]; out block; scratch."""
    weight_refs, (out_ref, slots, zero_row, sems) = refs[:num_weights], refs[num_weights:]
    slot_rows = bags * length
    source = table_hbm.bitcast(jnp.uint32) if packed else table_hbm  # [R/2, D] words or [R, D] rows
    first_id = pl.program_id(0) * (_SUB_BLOCKS * slot_rows)
    zero_row[...] = jnp.zeros(zero_row.shape, zero_row.dtype)

    def row_copy(slot: int, k, row, *, issue: bool) -> None:
        """Row k of `slot` <- table row `row`, or the zero row for the sentinel; start it or wait for it."""
        def run(src):
            copy = pltpu.make_async_copy(src, slots.at[slot, pl.ds(k, 1)], sems.at[slot])
            copy.start() if issue else copy.wait()

        @pl.when(row < num_rows)
        def _():
            run(source.at[pl.ds(jax.lax.shift_right_logical(row, 1) if packed else row, 1)])

        @pl.when(row >= num_rows)
        def _():
            run(zero_row)

    def for_each_row(sub: int, slot: int, *, issue: bool) -> None:
        def body(k, carry):
            row_copy(slot, k, ids_smem[first_id + sub * slot_rows + k], issue=issue)
            return carry

        jax.lax.fori_loop(0, slot_rows, body, 0)

    def consume(sub: int, slot: int) -> None:
        rows = slots[slot]  # [G*L, D]
        if kind == "gather":
            out_ref[pl.ds(sub * slot_rows, slot_rows), :] = rows.astype(out_ref.dtype)
            return
        halves = ([_low_half(rows), _high_half(rows)] if packed else [rows.astype(jnp.float32)])
        # W[g, k] = w[k] when id k belongs to bag g: pools G bags with one matmul (MXU idle otherwise).
        col = jax.lax.broadcasted_iota(jnp.int32, (bags, slot_rows), 1)
        first = jax.lax.broadcasted_iota(jnp.int32, (bags, slot_rows), 0) * length
        in_bag = (col >= first) & (col < first + length)
        pooled = jnp.zeros((bags, rows.shape[1]), jnp.float32)
        for w_ref, half in zip(weight_refs, halves, strict=True):
            w = jnp.where(in_bag, jnp.broadcast_to(w_ref[pl.ds(sub, 1), :], (bags, slot_rows)), 0.0)
            pooled += jnp.dot(w, half, precision=_HIGHEST, preferred_element_type=jnp.float32)
        out_ref[pl.ds(sub * bags, bags), :] = pooled

    # Every row's wait mirrors its start (same source kind, same destination, same semaphore).
    for_each_row(0, 0, issue=True)
    for sub in range(_SUB_BLOCKS):  # unrolled: the slot and every VMEM offset are static
        if sub + 1 < _SUB_BLOCKS:
            for_each_row(sub + 1, (sub + 1) % 2, issue=True)  # the next rows fly while this sub-block is pooled
        for_each_row(sub, sub % 2, issue=False)
        consume(sub, sub % 2)


def _low_half(words: jax.Array) -> jax.Array:
    """The even rows of packed bf16 row pairs u32[..., D], as exact f32 (a bf16 is the top half of an f32)."""
    return jax.lax.bitcast_convert_type(words << 16, jnp.float32)


def _high_half(words: jax.Array) -> jax.Array:
    """The odd rows of packed bf16 row pairs, as exact f32."""
    return jax.lax.bitcast_convert_type(words & jnp.uint32(_HIGH_HALF_MASK), jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# Triton GPU kernel.
#
# Grid: (bag blocks of BB, column blocks of DT). A program walks the L ids of its BB bags one column at a time:
# loads BB ids, gathers BB rows (DT columns each) with one masked load (ids outside [0, R) and columns past D masked
# to zero), and accumulates w * row in f32 registers. Triton tensors must have power-of-two shapes: DT is D rounded up
# to a power of two (at most 128), masked past D; the table is not padded.

_TRITON_TILE = 4096  # BB * DT elements per program: 32 f32 accumulator registers per thread at 4 warps
_TRITON_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def triton_fallback_reason(kind: str, num_rows: int, dim: int, dtype: Any, length: int) -> str | None:
    """Why the Triton kernel does not take this case (None when it does); the XLA reference runs instead."""
    if jnp.dtype(dtype) not in _TRITON_DTYPES:
        return f"{jnp.dtype(dtype)} tables: the Triton kernel loads f32, bf16 and f16 rows"
    return None


def _triton(kind: str, table, ids, weights, *, interpret: Any):
    num_rows, dim = table.shape
    num_bags, length = ids.shape
    if num_bags == 0 or length == 0 or triton_fallback_reason(kind, num_rows, dim, table.dtype, length):
        return _reference(kind, table, ids, weights)
    ids = _sanitize(ids, num_rows)
    col_block = min(pl.next_power_of_2(dim), 128)
    bag_block = max(16, min(256, _TRITON_TILE // col_block))
    operands = [ids] if weights is None else [ids, weights]
    out_shape = (num_bags, dim) if kind == "reduce" else (num_bags, length, dim)
    kernel = functools.partial(_triton_kernel, kind=kind, num_rows=num_rows, num_bags=num_bags, length=length,
                               dim=dim, bag_block=bag_block, col_block=col_block)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(pl.cdiv(num_bags, bag_block), pl.cdiv(dim, col_block)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"gather_{kind}_triton",
    )(*operands, table)


def _triton_kernel(*refs, kind: str, num_rows: int, num_bags: int, length: int, dim: int, bag_block: int,
                   col_block: int):
    """ids i32[B, L], (reduce) weights f32[B, L], table [R, D], out f32[B, D] or f32[B, L, D]; all whole arrays."""
    if kind == "reduce":
        ids_ref, w_ref, table_ref, out_ref = refs
    else:
        (ids_ref, table_ref, out_ref), w_ref = refs, None
    bag = pl.program_id(0) * bag_block + jnp.arange(bag_block, dtype=jnp.int32)
    col = pl.program_id(1) * col_block + jnp.arange(col_block, dtype=jnp.int32)
    bag_ok, col_ok = bag < num_bags, col < dim
    out_ok = bag_ok[:, None] & col_ok[None, :]

    def rows_at(pos):
        """f32[BB, DT]: row ids[bag, pos] of the table (zeros for the sentinel), and the bag's weight mask."""
        row = plgpu.load(ids_ref.at[bag, pos], mask=bag_ok, other=num_rows)
        ok = bag_ok & (row < num_rows)
        safe = jnp.where(ok, row, 0)  # masked lanes never read, but keep their addresses in bounds
        vals = plgpu.load(table_ref.at[safe[:, None], col[None, :]], mask=ok[:, None] & col_ok[None, :], other=0)
        return vals.astype(jnp.float32), ok

    if kind == "gather":
        def copy(pos, carry):
            vals, _ = rows_at(pos)
            plgpu.store(out_ref.at[bag[:, None], pos, col[None, :]], vals, mask=out_ok)
            return carry

        jax.lax.fori_loop(0, length, copy, 0)
        return

    def accumulate(pos, acc):
        vals, ok = rows_at(pos)
        w = plgpu.load(w_ref.at[bag, pos], mask=ok, other=0.0)
        return acc + w[:, None] * vals

    acc = jax.lax.fori_loop(0, length, accumulate, jnp.zeros((bag_block, col_block), jnp.float32))
    plgpu.store(out_ref.at[bag[:, None], col[None, :]], acc, mask=out_ok)
