"""Fused sparse update: apply an optimizer's row rule to the touched rows of a table and its state, in place.

The train step hands over the distinct rows a batch touched (`unique_rows`), their current values (the forward
pass gathered them) and their exactly summed gradients. `fused_row_update` reads each touched row's optimizer
state, applies the caller's row rule and writes the rows and the state back into the donated buffers. Work and
memory traffic grow with the rows touched, never with the table.

Three implementations, one contract:
  * `row_update_reference` (XLA): gather the state rows, apply the rule, scatter with mode="drop". XLA updates a
    donated scatter operand in place, so this path is copy-free too; it is the CPU path and the tests' oracle.
  * TPU (Pallas / Mosaic): the table and the [R, D] state stay in HBM; row ids arrive by scalar prefetch; each
    block of rows has its state rows (and, when the caller has not gathered them, its current rows) DMA'd into
    VMEM (double-buffered across grid steps with the buffer index in SMEM, as jax's paged-attention kernel does:
    block i + 1's reads are in flight while block i computes and block i - 1's writes land), the rule runs on the
    block, and new rows and state are DMA'd straight back into the aliased HBM buffers -- one DMA per run of 8
    adjacent ids (the distinct ids of a step arrive sorted), else one per row. The grid is (cores, blocks per
    core), ("parallel", "arbitrary"): megacore chips update disjoint row blocks on both TensorCores. This is the
    TPU embedding update (jax-tpu-embedding / SparseCore: gather the touched rows' slot variables, update, scatter)
    fused into one kernel. As there, step-dependent scalars are computed
    once outside the per-row work (jax-tpu-embedding's Adam spec derives alpha_t = lr sqrt(1 - b2^t) / (1 - b1^t)
    on the TensorCore and hands it to the SparseCore update): the part of `rule` that depends only on (lr, step)
    is split off by partial evaluation and run by XLA, so the kernel sees only vector math and scalar constants.
  * GPU (Pallas / Triton): one program per block of rows; masked gathers of the state rows (and the current
    rows, when not given), the rule, masked scatters -- the structure of FBGEMM TBE's fused backward-optimizer
    kernels for its EXACT_* optimizers (gradients of duplicate ids are summed first, then each distinct row is
    updated by one thread block).

The fused backward + update (FBGEMM's table-batched embedding backward, `split_embedding_backward_codegen_*`: the
ids sorted once, each distinct row's gradient summed over its run of occurrences in f32, then the optimizer applied
to that row by the same thread block): `grads` may be a `SegmentGrads` instead of f32[U, D] -- for each distinct row
the segment of its occurrences in the sorted order (`dedup.sorted_segments`), and per occurrence the gradient row it
reads (a pooled bag's gradient, or a per-id gradient) and its pooling weight. The GPU kernel sums each row's segment
in registers and updates the row in the same program, so neither the per-occurrence gradients [M, D] nor the summed
[U, D] ever reach memory; the XLA path and the TPU kernel sum the segments first (`segment_grads_reference`, an XLA
segment sum) and then update as before.

Distinctness is the caller's contract: no id < R may appear twice in `unique_rows`. With distinct ids no two GPU
programs and no two in-flight TPU DMAs touch the same row, which is why neither path needs atomics or ordering
between blocks -- as in FBGEMM's EXACT_* backward, which sorts the ids, sums each distinct row's gradient and then
updates that row from a single thread block. A duplicated id would race.

What lowers where: `impl="auto"` picks when the computation is lowered (`lax.platform_dependent`): the Mosaic kernel
on TPU, the Triton kernel on CUDA, the XLA reference elsewhere (CPU, ROCm); `kernel_fallback_reason` sends the
cases a kernel cannot take to XLA. tests/test_update_kernels.py exports every sparse optimizer's rule for "tpu" and
"cuda" from a CPU host: each is one custom call whose output_operand_aliases are the donated table and state. That
proves the Pallas lowering only (libtpu's Mosaic compiler and XLA:GPU's Triton compiler run on the device): neither
kernel has run on real hardware yet.
  TPU: [R] state (row-wise Adagrad's accumulator) is gathered and scattered by XLA around the kernel and enters it as
    an [N, 1] column: a one-element DMA out of a 1-D HBM array is not tile-aligned, and a rank-1 BlockSpec cannot
    even be exported from a CPU host (Pallas asks the default device for its 1-D tiling).
  GPU: Triton is chosen explicitly; this jax lowers a plain `pallas_call` on GPU with Mosaic GPU, which rejects the
    kernel as written (its copies move whole blocks through shared memory in 128-byte units, staging every blocked
    operand, the table included). A Mosaic GPU version would need GMEM refs and its own gather / scatter copies.
    Exporting the Triton call needs `disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
    "__gpu$xla.gpu.triton")]`: its IR is tied to the jaxlib that wrote it.
  Interpret mode on CPU: the TPU kernel runs under Pallas's TPU interpreter (DMAs and semaphores simulated, slow per
    row copy: keep U small in tests), the GPU kernel under the HLO interpreter, which drops stores to out-of-range
    rows -- so interpret mode cannot catch a GPU mask that lets a padding lane write row R.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from jax.extend.core import jaxpr_as_fun

from pallas_kernels.dispatch import by_platform, check_impl
from pallas_kernels.hardware import gpu_budget, tpu_budget

State = Mapping[str, jax.Array]
# rule(rows f32[N, D], state_rows {k: f32[N, D] | f32[N]}, grads f32[N, D], lr f32[], step i32[]) ->
#     (new_rows f32[N, D], new_state_rows with the same keys and shapes)
RowRule = Callable[[jax.Array, dict[str, jax.Array], jax.Array, jax.Array, jax.Array],
                   tuple[jax.Array, dict[str, jax.Array]]]
Impl = Literal["auto", "xla", "pallas", "pallas_tpu", "pallas_gpu"]

# TPU budgets come from the chip being lowered for (pallas_kernels/hardware.py): one call's ids are scalar-prefetched
# into SMEM (`TpuBudget.smem_ids`: 2048 on v2/v3, 131072 from v4 on), so longer id lists are processed in chunks of
# that many ids (a loop of aliased calls); the VMEM buffers are sized to `TpuBudget.vmem_buffer_bytes`.
# TPU: candidate rows per block, largest first; multiples of 8 (the f32 sublane tiling of a VMEM block).
TPU_BLOCK_ROWS = (256, 128, 64, 32, 16, 8)
# TPU: rows per merged DMA: 8 adjacent ids (a whole f32 sublane tile) move as one copy.
TPU_RUN = 8
# GPU: elements of a [rows, D] tile held by one program (in registers); 4096 f32 = 16 KiB.
GPU_TILE_ELEMENTS = 4096
# GPU: fewer rows per program until the grid has this many programs per SM (`hardware.gpu_budget`), down to 1 row.
GPU_PROGRAMS_PER_SM = 2


class SegmentGrads(NamedTuple):
    """Each distinct row's gradient as a sum over its occurrences, for the fused backward + update.

    grads[u] = sum_{k in [starts[u], starts[u + 1])} weights[k] * source_rows[sources[k]], summed in f32 in k order.

    starts: i32[U + 1] the segments of the sorted occurrences (`dedup.sorted_segments`; non-decreasing; the padding
      ids' segments are ignored whatever they hold).
    sources: i32[M] for the k-th sorted occurrence, the row of `source_rows` holding its gradient (in [0, P)).
    weights: f32[M] its pooling weight (1 for a per-id gradient, 0 for padding).
    source_rows: f32[P, D] the gradients the occurrences read: the pooled bags' gradients (a bag's rows all read
      the same one) and per-id gradients.
    """

    starts: jax.Array
    sources: jax.Array
    weights: jax.Array
    source_rows: jax.Array


def segment_grads_reference(segments: SegmentGrads, num_unique: int) -> jax.Array:
    """f32[U, D]: each distinct row's summed gradient (`SegmentGrads`), by an XLA segment sum over the sorted
    occurrences. Occurrences past starts[U] belong to no row and are dropped."""
    starts, sources, weights, source_rows = segments
    (count,) = sources.shape
    # The distinct row of the k-th occurrence: how many segments start at or before k (after the first).
    marks = jnp.zeros(count + 1, jnp.int32).at[starts[1:]].add(1, mode="drop")
    row_of = jnp.cumsum(marks, dtype=jnp.int32)[:count]
    per_occurrence = weights.astype(jnp.float32)[:, None] * jnp.take(source_rows, sources, axis=0, mode="clip")
    return jax.ops.segment_sum(per_occurrence, row_of, num_segments=num_unique, indices_are_sorted=True)


def row_update_reference(table: jax.Array, state: State, unique_rows: jax.Array, current: jax.Array | None,
                         grads: jax.Array | SegmentGrads, rule: RowRule, lr: jax.Array, step: jax.Array
                         ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """XLA path: gather the touched rows' state, apply `rule`, scatter rows and state back (see `fused_row_update`).

    Padding ids (>= R) gather zeros (mode="fill") and are dropped by the scatter (mode="drop"), so they are never
    read out of bounds nor written. `current` None: the rows are gathered here too. `SegmentGrads` are summed first
    (`segment_grads_reference`).
    """
    if isinstance(grads, SegmentGrads):
        grads = segment_grads_reference(grads, unique_rows.shape[0])
    if current is None:
        current = jnp.take(table, unique_rows, axis=0, mode="fill", fill_value=0)
    state_rows = {k: jnp.take(v, unique_rows, axis=0, mode="fill", fill_value=0) for k, v in state.items()}
    new_rows, new_state = rule(current, state_rows, grads, lr, step)
    table = table.at[unique_rows].set(new_rows.astype(table.dtype), mode="drop")
    state = {k: v.at[unique_rows].set(new_state[k].astype(v.dtype), mode="drop") for k, v in state.items()}
    return table, state


def fused_row_update(table: jax.Array, state: State, unique_rows: jax.Array, current: jax.Array | None,
                     grads: jax.Array | SegmentGrads,
                     rule: RowRule, lr: jax.Array | float, step: jax.Array | int, *, impl: Impl = "auto",
                     interpret: bool | pltpu.InterpretParams = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Apply `rule` to the distinct touched rows of `table` and their optimizer state, writing both in place.

    Args:
      table: f32[R, D]. Donate it (`jax.jit(..., donate_argnums=...)`): every path then writes in place and no
        table-sized copy exists.
      state: per-row optimizer arrays {name: f32[R, D] or f32[R]} (donate them too); may be empty.
      unique_rows: i32[U] DISTINCT row ids -- the caller's contract; the kernels write rows without atomics, so a
        duplicated id would race. Ids >= R are padding: never read, never written. U may exceed R or not.
      current: f32[U, D] the rows' current values, when the forward pass gathered them (the kernels then use them
        rather than re-reading the table; padding slots may hold anything); None when it pooled straight from the
        table: each path then reads the touched rows itself (the kernels inside, with the state rows).
      grads: f32[U, D] each row's exactly summed gradient (any weight-decay term is folded into `rule`), or a
        `SegmentGrads` saying how to sum it from the occurrences' gradients (the fused backward + update: the GPU
        kernel sums each row's segment in the program that updates the row; XLA and the TPU kernel sum the segments
        with an XLA segment sum first).
      rule: `rule(rows, state_rows, grads, lr, step) -> (new_rows, new_state_rows)`, a pure jnp function over a
        block of N rows (state rows f32[N, D] or f32[N]); recjax passes `SparseOptimizer.update_rows` with the
        weight-decay term folded into the gradient.
      lr: f32[] learning rate.
      step: i32[] 1-based optimizer step.
      impl: as for every kernel (pallas_kernels/dispatch.py): "xla" (`row_update_reference`); "pallas_tpu" /
        "pallas_gpu" (that kernel whatever the platform; on a CPU only with `interpret=True`); "pallas" (the kernel
        of the platform the computation is lowered for -- Mosaic on TPU, Triton on CUDA and ROCm -- and an error
        elsewhere; with `interpret=True` the TPU kernel under Pallas's TPU interpreter); "auto" (like "pallas" on
        TPU, CUDA and ROCm, XLA on every other platform), both decided when lowered. A case a kernel cannot
        express (`kernel_fallback_reason`) takes the XLA path instead, for that call only.
      interpret: run the Pallas kernel in interpret mode (tests on CPU); a `pltpu.InterpretParams` configures the
        TPU interpreter (e.g. whether DMAs land when issued or only when waited on).

    Returns:
      (table f32[R, D], state) with the touched rows and their state updated; every other row bit-identical.
    """
    check_impl(impl, interpret, "fused_row_update")
    num_rows, dim = table.shape
    (num_unique,) = unique_rows.shape
    assert current is None or current.shape == (num_unique, dim), (table.shape, unique_rows.shape, current.shape)
    if isinstance(grads, SegmentGrads):
        assert grads.starts.shape == (num_unique + 1,), (unique_rows.shape, grads.starts.shape)
        assert grads.sources.ndim == 1 and grads.weights.shape == grads.sources.shape, (grads.sources.shape,
                                                                                         grads.weights.shape)
        assert grads.source_rows.ndim == 2 and grads.source_rows.shape[1] == dim, (table.shape,
                                                                                   grads.source_rows.shape)
        grads = SegmentGrads(grads.starts.astype(jnp.int32), grads.sources.astype(jnp.int32),
                             grads.weights.astype(jnp.float32), grads.source_rows.astype(jnp.float32))
    else:
        assert grads.shape == (num_unique, dim), (table.shape, unique_rows.shape, grads.shape)
    for k, v in state.items():
        assert v.shape in ((num_rows, dim), (num_rows,)), (k, v.shape, table.shape)
    state = dict(state)
    unique_rows = unique_rows.astype(jnp.int32)
    lr = jnp.asarray(lr, jnp.float32)
    step = jnp.asarray(step, jnp.int32)
    args = (table, state, unique_rows, current, grads, lr, step)

    return by_platform(impl, interpret, args,
                       xla=functools.partial(_kernel_or_reference, "xla", rule=rule, interpret=interpret),
                       mosaic=functools.partial(_kernel_or_reference, "tpu", rule=rule, interpret=interpret),
                       triton=functools.partial(_kernel_or_reference, "gpu", rule=rule, interpret=interpret))


def kernel_fallback_reason(platform: Literal["tpu", "gpu"], rule: RowRule, table: jax.Array | jax.ShapeDtypeStruct,
                           state: Mapping[str, jax.Array | jax.ShapeDtypeStruct]) -> str | None:
    """Why the `platform` kernel hands this case to the XLA path, or None when the kernel runs.

    Only shapes and dtypes of `table` and `state` are read (arrays or `jax.ShapeDtypeStruct`s).
    """
    _, dim = table.shape
    dtypes = {table.dtype, *(v.dtype for v in state.values())}
    if dtypes != {jnp.dtype(jnp.float32)}:
        return f"{platform.upper()}: the kernels hold f32 tables and state only, got {sorted(map(str, dtypes))}"
    state_shapes = {k: tuple(v.shape) for k, v in state.items()}
    if platform == "tpu":
        if _tpu_block_rows(dim, state_shapes) is None:
            budget = tpu_budget()
            return (f"TPU: {TPU_BLOCK_ROWS[-1]} rows of D={dim} with {len(state_shapes)} state arrays already "
                    f"exceed the kernel's VMEM budget ({budget.vmem_buffer_bytes} bytes on {budget.chip})")
        split = _split_step_math(rule, TPU_BLOCK_ROWS[-1], dim, state_shapes)
        return split if isinstance(split, str) else None
    if platform == "gpu":
        if dim & (dim - 1):
            # Triton tiles have power-of-two shapes. Padding D would let the rule see padded columns (a row-wise
            # mean over D would come out wrong), and the rule is the caller's, so it cannot be told to mask them.
            return f"GPU: D={dim} is not a power of two (Triton tile shapes must be)"
        return None
    raise ValueError(f"unknown platform {platform!r}; use 'tpu' or 'gpu'")


# ------------------------------------------------------------------------------------------------ dispatch
def _kernel_or_reference(platform, table, state, unique_rows, current, grads, lr, step, *, rule, interpret):
    if platform == "xla" or kernel_fallback_reason(platform, rule, table, state) is not None:
        return row_update_reference(table, state, unique_rows, current, grads, rule, lr, step)
    if platform == "tpu":
        if isinstance(grads, SegmentGrads):  # the Mosaic kernel takes summed gradients (module docstring)
            grads = segment_grads_reference(grads, unique_rows.shape[0])
        return _tpu_row_update(table, state, unique_rows, current, grads, rule, lr, step, interpret=interpret)
    return _gpu_row_update(table, state, unique_rows, current, grads, rule, lr, step, interpret=interpret)


def _check_rule_output(new_rows, new_state, rows, state_rows):
    assert new_rows.shape == rows.shape, ("rule changed the rows' shape", rows.shape, new_rows.shape)
    assert set(new_state) == set(state_rows), ("rule changed the state keys", sorted(state_rows), sorted(new_state))
    for k, v in state_rows.items():
        assert new_state[k].shape == v.shape, ("rule changed a state shape", k, v.shape, new_state[k].shape)


def _split_step_math(rule: RowRule, block: int, dim: int, state_shapes: Mapping[str, tuple[int, ...]]):
    """Split `rule` into the part that depends on (lr, step) only and the per-row rest.

    Returns (outside, inside, residual_dtypes) with
      outside(lr, step) -> list of residual scalars (XLA, once per call),
      inside(residuals, rows, state_rows, grads) -> (new_rows, new_state_rows) (the kernel, per block),
    or a string saying why the split is not possible (a residual that is not a 32-bit scalar).
    """
    # Partial evaluation is how JAX itself splits computations by data dependence (linearize, remat); the
    # helper is not exported, hence the private import. Structure and shapes are fixed per trace, so tracing
    # the rule here costs one small jaxpr per (rule, block, D) and nothing at run time.
    from jax._src.interpreters import partial_eval as pe

    f32 = jnp.float32
    vec_args = (jax.ShapeDtypeStruct((block, dim), f32),
                {k: jax.ShapeDtypeStruct((block, *s[1:]), f32) for k, s in sorted(state_shapes.items())},
                jax.ShapeDtypeStruct((block, dim), f32))
    scalar_args = (jax.ShapeDtypeStruct((), f32), jax.ShapeDtypeStruct((), jnp.int32))
    closed, out_shape = jax.make_jaxpr(rule, return_shape=True)(*vec_args, *scalar_args)
    unknowns = [True] * len(jax.tree.leaves(vec_args)) + [False, False]
    known, unknown, _, residual_avals = pe.partial_eval_jaxpr_nounits(closed, unknowns, instantiate=True)
    for aval in residual_avals:
        if aval.shape != () or aval.dtype not in (jnp.dtype(f32), jnp.dtype(jnp.int32)):
            return (f"TPU: the rule's (lr, step)-only math yields a {aval.str_short()} value; the kernel takes "
                    f"only f32 / i32 scalars from it")
    out_tree = jax.tree.structure(out_shape)

    def outside(lr, step):
        return jaxpr_as_fun(known)(lr, step)

    def inside(residuals, rows, state_rows, grads):
        leaves = jax.tree.leaves((rows, state_rows, grads))
        return jax.tree.unflatten(out_tree, jaxpr_as_fun(unknown)(*residuals, *leaves))

    return outside, inside, [aval.dtype for aval in residual_avals]


# ------------------------------------------------------------------------------------------ TPU (Mosaic)
def _tpu_block_rows(dim: int, state_shapes: Mapping[str, tuple[int, ...]]) -> int | None:
    """Rows per block whose VMEM buffers fit the chip's `vmem_buffer_bytes`, or None."""
    wide = sum(len(s) == 2 for s in state_shapes.values())
    narrow = len(state_shapes) - wide
    lanes = -(-dim // 128) * 128  # VMEM pads the minor dim to whole 128-lane tiles
    # Per row: current (a pipelined block, or the 2 slots it is DMA'd into) + grads (pipelined, 2 buffers), new rows
    # (2 slots), each [R, D] state in and out
    # (2 slots each), each [R] state as a [N, 1] column in and out (pipelined, 2 buffers each, padded to 128 lanes).
    row_bytes = 4 * (lanes * (2 * 2 + 2 + 2 * 2 * wide) + 128 * 2 * 2 * narrow)
    budget = tpu_budget().vmem_buffer_bytes
    for rows in TPU_BLOCK_ROWS:
        if rows * row_bytes <= budget:
            return rows
    return None


def _tpu_row_update(table, state, unique_rows, current, grads, rule, lr, step, *, interpret):
    """Mosaic kernel over blocks of rows (see the module docstring); arguments as in `fused_row_update`.

    [R, D] state (and the current rows, when `current` is None) is DMA'd inside the kernel. [R] state (row-wise
    Adagrad's accumulator) is gathered and scattered by XLA around the kernel (O(U), in place on the donated buffer)
    and enters the kernel as an [N, 1] column block. A one-element DMA out of a 1-D HBM array is not a tile-aligned
    copy (1-D arrays are tiled in runs of 128 or more elements; Mosaic's DMA alignment rules for them are
    undocumented, so nothing here relies on them), and viewing [R] as [R, 1] would be a table-sized relayout on TPU.
    """
    num_rows, dim = table.shape
    (num_unique,) = unique_rows.shape
    state_shapes = {k: tuple(v.shape) for k, v in state.items()}
    wide = sorted(k for k, s in state_shapes.items() if len(s) == 2)
    narrow = sorted(k for k, s in state_shapes.items() if len(s) == 1)
    budget = tpu_budget()
    block = _tpu_block_rows(dim, state_shapes)
    if num_unique <= block:
        block = num_unique  # one block spanning the whole array: any size is a legal block shape
    num_blocks = pl.cdiv(num_unique, block)
    # A call's blocks: as many as its ids fit SMEM, split evenly over the cores (a core's run of blocks pipelines).
    cores = min(budget.num_cores, num_blocks)
    per_core = max(1, min(pl.cdiv(num_blocks, cores), budget.smem_ids // (block * cores)))
    blocks_per_call = cores * per_core
    num_calls = pl.cdiv(num_blocks, blocks_per_call)
    ids_per_call = blocks_per_call * block
    # Padding ids (= R) fill the tail so every call sees whole blocks; the kernel issues no DMA for them.
    ids = jnp.pad(unique_rows, (0, num_calls * ids_per_call - num_unique), constant_values=num_rows)

    outside, inside, residual_dtypes = _split_step_math(rule, block, dim, state_shapes)
    residuals = outside(lr, step)
    f32_res = [r for r, d in zip(residuals, residual_dtypes, strict=True) if d == jnp.float32]
    i32_res = [r for r, d in zip(residuals, residual_dtypes, strict=True) if d == jnp.int32]
    f32_res = jnp.stack(f32_res) if f32_res else jnp.zeros((1,), jnp.float32)
    i32_res = jnp.stack(i32_res) if i32_res else jnp.zeros((1,), jnp.int32)
    call = _tpu_call(num_rows, dim, block, cores, per_core, num_blocks, wide, narrow, inside, residual_dtypes,
                     read_rows=current is None, vmem_limit_bytes=budget.vmem_limit_bytes, interpret=interpret)
    given_rows = [] if current is None else [current]

    def one_call(c, carry):
        table, state = carry
        call_ids = lax.dynamic_slice_in_dim(ids, c * ids_per_call, ids_per_call)
        narrow_rows = [jnp.take(state[k], call_ids, mode="fill", fill_value=0)[:, None] for k in narrow]
        first_block = jnp.reshape(c * blocks_per_call, (1,)).astype(jnp.int32)
        table, *outs = call(call_ids, f32_res, i32_res, first_block, *given_rows, grads, *narrow_rows, table,
                            *[state[k] for k in wide])
        state = dict(state)
        state.update(zip(wide, outs[:len(wide)], strict=True))
        for k, new in zip(narrow, outs[len(wide):], strict=True):
            state[k] = state[k].at[call_ids].set(new[:, 0], mode="drop")
        return table, state

    if num_calls == 1:
        return one_call(0, (table, state))
    return lax.fori_loop(0, num_calls, one_call, (table, state))


def _tpu_call(num_rows: int, dim: int, block: int, cores: int, per_core: int, num_blocks: int, wide: Sequence[str],
              narrow: Sequence[str], inside, residual_dtypes, *, read_rows: bool, vmem_limit_bytes: int, interpret):
    """The pallas_call for one chunk of `cores * per_core` blocks (see `_tpu_row_update`).

    Grid (cores, per_core), ("parallel", "arbitrary"): core c updates blocks c * per_core ... (c + 1) * per_core - 1
    of the chunk, in order. Within a core's run, step j starts block j + 1's reads, waits for block j's, runs the
    rule, finishes block j - 1's writes and starts block j's; the slot block j uses lives in SMEM (flipped each step,
    reset at a run's first step), like the buffer index of jax's paged-attention kernel. Blocks of different cores
    touch disjoint rows (the ids are distinct), so the cores never race.
    """
    n_wide, n_narrow = len(wide), len(narrow)
    n_given = 0 if read_rows else 1
    n_gathered = n_wide + (1 if read_rows else 0)  # arrays DMA'd in per block: [R, D] state (+ the rows)

    def kernel(ids_ref, f32_res_ref, i32_res_ref, first_block_ref, *refs):
        del first_block_ref  # read by the index maps only
        given, refs = refs[:n_given], refs[n_given:]
        grads_ref, refs = refs[0], refs[1:]
        narrow_in, refs = refs[:n_narrow], refs[n_narrow:]
        # refs[0] and refs[1:1 + n_wide] are the table / [R, D] state inputs: aliased to the outputs (same HBM
        # buffers), so the kernel reads and writes them through the output refs.
        table_hbm = refs[1 + n_wide]
        wide_hbm = refs[2 + n_wide:2 + 2 * n_wide]
        narrow_out = refs[2 + 2 * n_wide:2 + 2 * n_wide + n_narrow]
        rows_buf, *scratch = refs[2 + 2 * n_wide + n_narrow:]
        in_bufs, wide_out_buf = scratch[:n_gathered], scratch[n_gathered:n_gathered + n_wide]
        gather_sem, scatter_sem, slot_ref = scratch[n_gathered + n_wide:]
        sources = (*wide_hbm, table_hbm) if read_rows else tuple(wide_hbm)  # in the order of in_bufs

        c, j = pl.program_id(0), pl.program_id(1)
        blk = c * per_core + j  # this step's block within the chunk

        @pl.when(j == 0)
        def _():
            slot_ref[0] = 0

        slot = slot_ref[0]
        other = 1 - slot

        def transfers(b, fn):
            """fn(buffer row, table row, count) for every copy block b needs: one per run of TPU_RUN adjacent ids
            (count TPU_RUN), else one per row (count 1); padding ids (>= R) need none."""
            def single(k, row):
                @pl.when(row < num_rows)
                def _():
                    fn(k, row, 1)

            if block % TPU_RUN:
                def by_row(k, carry):
                    single(k, ids_ref[b * block + k])
                    return carry

                lax.fori_loop(0, block, by_row, 0)
                return

            def by_run(r, carry):
                k = pl.multiple_of(r * TPU_RUN, TPU_RUN)
                base = ids_ref[b * block + k]
                adjacent = base + TPU_RUN <= num_rows
                for t in range(1, TPU_RUN):
                    adjacent = adjacent & (ids_ref[b * block + k + t] == base + t)

                @pl.when(adjacent)
                def _():
                    fn(k, base, TPU_RUN)

                @pl.when(jnp.logical_not(adjacent))
                def _():
                    def by_row(t, carry):
                        single(k + t, ids_ref[b * block + k + t])
                        return carry

                    # A loop, not unrolled: every traced body costs compile time at each call site, on a CPU too
                    # (lax.platform_dependent traces every branch).
                    lax.fori_loop(0, TPU_RUN, by_row, 0)
                return carry

            lax.fori_loop(0, block // TPU_RUN, by_run, 0)

        def gathers(s, action):
            def fn(k, row, count):
                for hbm, buf in zip(sources, in_bufs, strict=True):
                    copy = pltpu.make_async_copy(hbm.at[pl.ds(row, count)], buf.at[s, pl.ds(k, count)],
                                                 gather_sem.at[s])
                    copy.start() if action == "start" else copy.wait()
            return fn

        def scatters(s, action):
            def fn(k, row, count):
                for buf, hbm in zip((rows_buf, *wide_out_buf), (table_hbm, *wide_hbm), strict=True):
                    copy = pltpu.make_async_copy(buf.at[s, pl.ds(k, count)], hbm.at[pl.ds(row, count)],
                                                 scatter_sem.at[s])
                    copy.start() if action == "start" else copy.wait()
            return fn

        if n_gathered:
            # Double buffering: block j + 1's rows are read while block j computes. Blocks touch disjoint rows (ids
            # are distinct), so those reads never race the writes of blocks j and j - 1.
            @pl.when(j == 0)
            def _():
                transfers(blk, gathers(slot, "start"))

            @pl.when(j + 1 < per_core)
            def _():
                transfers(blk + 1, gathers(other, "start"))

            transfers(blk, gathers(slot, "wait"))

        residuals, n_f32, n_i32 = [], 0, 0
        for dtype in residual_dtypes:
            if dtype == jnp.float32:
                residuals.append(f32_res_ref[n_f32])
                n_f32 += 1
            else:
                residuals.append(i32_res_ref[n_i32])
                n_i32 += 1
        state_rows = {k: in_bufs[w][slot] for w, k in enumerate(wide)}
        # [N, 1] <-> [N] is a shape cast between a column and the layout a row reduction (row-wise Adagrad's mean
        # over D) produces, so the rule's [N] math needs no relayout.
        state_rows.update({k: narrow_in[w][...][:, 0] for w, k in enumerate(narrow)})
        rows = in_bufs[n_wide][slot] if read_rows else given[0][...]
        new_rows, new_state = inside(residuals, rows, state_rows, grads_ref[...])
        _check_rule_output(new_rows, new_state, rows, state_rows)
        rows_buf[slot] = new_rows.astype(jnp.float32)
        for w, k in enumerate(wide):
            wide_out_buf[w][slot] = new_state[k].astype(jnp.float32)
        for w, k in enumerate(narrow):
            narrow_out[w][...] = new_state[k][:, None].astype(jnp.float32)

        # Block j - 1's writes overlapped this block's gather wait and compute; its slot is reused by block j + 1,
        # so they must land before this step ends.
        @pl.when(j > 0)
        def _():
            transfers(blk - 1, scatters(other, "wait"))

        transfers(blk, scatters(slot, "start"))

        @pl.when(j + 1 == per_core)
        def _():
            transfers(blk, scatters(slot, "wait"))

        slot_ref[0] = other

    last_block = num_blocks - 1

    def row_block(c, j, ids, f32_res, i32_res, first_block):
        # The last chunk may run past the end of `current` / `grads`; its ids there are padding, so clamping the
        # block index only re-reads a block whose results are never written.
        return (jnp.minimum(first_block[0] + c * per_core + j, last_block), 0)

    def call_block(c, j, *_):
        return (c * per_core + j, 0)

    hbm = pl.BlockSpec(memory_space=pl.ANY)
    column = pl.BlockSpec((block, 1), call_block)
    in_specs = [*[pl.BlockSpec((block, dim), row_block) for _ in range(n_given + 1)],
                *[column for _ in narrow], hbm, *[hbm for _ in wide]]
    out_specs = [hbm, *[hbm for _ in wide], *[column for _ in narrow]]
    out_shape = [jax.ShapeDtypeStruct((num_rows, dim), jnp.float32),
                 *[jax.ShapeDtypeStruct((num_rows, dim), jnp.float32) for _ in wide],
                 *[jax.ShapeDtypeStruct((cores * per_core * block, 1), jnp.float32) for _ in narrow]]
    scratch = [pltpu.VMEM((2, block, dim), jnp.float32),  # new rows
               *[pltpu.VMEM((2, block, dim), jnp.float32) for _ in range(n_gathered + n_wide)],
               pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,)),
               pltpu.SMEM((1,), jnp.int32)]  # the slot of this step's block
    # Operand indices count the 4 scalar-prefetch operands; the table and [R, D] state become outputs 0..n_wide.
    first_hbm = 4 + n_given + 1 + n_narrow
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=4, grid=(cores, per_core), in_specs=in_specs,
                                               out_specs=out_specs, scratch_shapes=scratch),
        input_output_aliases={first_hbm + w: w for w in range(1 + n_wide)},
        # A core's steps are sequential (step j starts block j + 1's reads and finishes block j - 1's writes); the
        # cores' runs are independent.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=(interpret if isinstance(interpret, pltpu.InterpretParams)
                   else pltpu.InterpretParams() if interpret else False),
        name="fused_row_update_tpu",
    )


# ----------------------------------------------------------------------------------------- GPU (Triton)
def _gpu_block_rows(num_unique: int, dim: int) -> int:
    """Rows per program: a power of two (Triton tile shapes must be) with rows * D <= GPU_TILE_ELEMENTS, halved while
    the grid would have fewer than GPU_PROGRAMS_PER_SM programs per SM of the device."""
    rows = min(max(1, GPU_TILE_ELEMENTS // dim), pl.next_power_of_2(num_unique))
    rows = 1 << (rows.bit_length() - 1)
    while rows > 1 and pl.cdiv(num_unique, rows) < GPU_PROGRAMS_PER_SM * gpu_budget().sm_count:
        rows //= 2
    return rows


def _gpu_row_update(table, state, unique_rows, current, grads, rule, lr, step, *, interpret):
    """Triton kernel, one program per block of rows (see the module docstring); arguments as in `fused_row_update`.

    Each program gathers its rows' state (and the rows, when `current` is None; the table output aliases the
    input, so it reads them from there) with masked loads, applies the rule and scatters rows and state with
    masked stores into the aliased buffers. Ids are distinct, so no two programs write the same row and plain
    stores suffice; padding ids and the tail past U are masked off, so nothing is read or written for them.

    With `SegmentGrads` the program first sums its rows' gradients: step j of a loop as long as the block's longest
    segment adds, for every row whose segment has a j-th occurrence, that occurrence's weight times its source
    gradient row (one masked [rows, D] gather per step), in f32 registers -- FBGEMM's backward accumulates a run of
    equal ids the same way before its optimizer step. Padding ids get an empty segment, so the padding slots' many
    occurrences (all sorted into the sentinel's segment) cost nothing. A block's loop is as long as its hottest row's
    segment: heavily skewed ids make some blocks loop long (FBGEMM splits long segments over several thread blocks;
    not done here).
    """
    num_rows, dim = table.shape
    (num_unique,) = unique_rows.shape
    keys = sorted(state)
    block = _gpu_block_rows(num_unique, dim)
    segmented = isinstance(grads, SegmentGrads)
    given = [] if current is None else [current]
    grad_operands = list(grads) if segmented else [grads]

    def kernel(ids_ref, lr_ref, step_ref, *refs):
        current_ref, refs = (refs[0], refs[1:]) if given else (None, refs)
        grad_refs, refs = refs[:len(grad_operands)], refs[len(grad_operands):]
        # refs[:1 + len(keys)] are the table / state inputs: aliased to the outputs, used through those.
        table_out, *state_out = refs[1 + len(keys):]
        start = pl.program_id(0) * block
        in_range = start + jnp.arange(block) < num_unique
        row_ids = plgpu.load(ids_ref.at[pl.ds(start, block)], mask=in_range, other=num_rows)
        valid = in_range & (row_ids < num_rows)
        # Masked-off lanes address row R: never dereferenced on the GPU, and out of bounds (so dropped rather than
        # clamped onto a real row) when interpret mode discharges the store as a scatter.
        row_index = jnp.where(valid, row_ids, num_rows)
        # Full integer indexers rather than `ref.at[ids, :]`: interpret mode discharges only all-slice or
        # all-array indexing, and Triton turns either into the same pointer arithmetic.
        columns = jnp.broadcast_to(jnp.arange(dim)[None, :], (block, dim))
        wide_index = (jnp.broadcast_to(row_index[:, None], (block, dim)), columns)
        wide_mask = jnp.broadcast_to(valid[:, None], (block, dim))
        in_range_2d = jnp.broadcast_to(in_range[:, None], (block, dim))

        def index_and_mask(ref):
            return (wide_index, wide_mask) if len(ref.shape) == 2 else ((row_index,), valid)

        if current_ref is None:
            rows = plgpu.load(table_out.at[wide_index], mask=wide_mask, other=0.0)
        else:
            rows = plgpu.load(current_ref.at[pl.ds(start, block), :], mask=in_range_2d, other=0.0)
        if segmented:
            starts_ref, sources_ref, weights_ref, source_rows_ref = grad_refs
            first = plgpu.load(starts_ref.at[pl.ds(start, block)], mask=in_range, other=0)
            end = plgpu.load(starts_ref.at[pl.ds(start + 1, block)], mask=in_range, other=0)
            count = jnp.where(valid, end - first, 0)  # padding ids: no occurrence is read

            def add_occurrence(j, acc):
                live = j < count
                at = jnp.where(live, first + j, 0)
                source = plgpu.load(sources_ref.at[at], mask=live, other=0)
                weight = plgpu.load(weights_ref.at[at], mask=live, other=0.0)
                source_index = (jnp.broadcast_to(source[:, None], (block, dim)), columns)
                values = plgpu.load(source_rows_ref.at[source_index],
                                    mask=jnp.broadcast_to(live[:, None], (block, dim)), other=0.0)
                return acc + weight[:, None] * values

            grads_block = lax.fori_loop(0, jnp.max(count), add_occurrence, jnp.zeros((block, dim), jnp.float32))
        else:
            grads_block = plgpu.load(grad_refs[0].at[pl.ds(start, block), :], mask=in_range_2d, other=0.0)
        state_rows = {}
        for k, ref in zip(keys, state_out, strict=True):
            index, mask = index_and_mask(ref)
            state_rows[k] = plgpu.load(ref.at[index], mask=mask, other=0.0)
        new_rows, new_state = rule(rows, state_rows, grads_block, lr_ref[0], step_ref[0])
        _check_rule_output(new_rows, new_state, rows, state_rows)
        plgpu.store(table_out.at[wide_index], new_rows.astype(table_out.dtype), mask=wide_mask)
        for k, ref in zip(keys, state_out, strict=True):
            index, mask = index_and_mask(ref)
            plgpu.store(ref.at[index], new_state[k].astype(ref.dtype), mask=mask)

    out_shape = [jax.ShapeDtypeStruct(table.shape, table.dtype),
                 *[jax.ShapeDtypeStruct(state[k].shape, state[k].dtype) for k in keys]]
    first_aliased = 3 + len(given) + len(grad_operands)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(num_unique, block),),
        # Operands: ids, lr, step, (current,) grads or the segments' four arrays, table, *state; the table and state
        # are updated in place.
        input_output_aliases={first_aliased + i: i for i in range(1 + len(keys))},
        # Triton explicitly: this jax lowers a plain pallas_call on GPU with Mosaic GPU by default, whose copies
        # move whole blocks through shared memory in 128-byte units -- no fit for scattered single rows (see the
        # module docstring).
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=bool(interpret),
        name="fused_backward_update_gpu" if segmented else "fused_row_update_gpu",
    )(unique_rows, lr.reshape(1), step.reshape(1), *given, *grad_operands, table, *[state[k] for k in keys])
    return outs[0], dict(zip(keys, outs[1:], strict=True))
