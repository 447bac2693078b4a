"""Gather-reduce / gather kernels (Pallas interpret mode on CPU) against the jnp references, and the references
against a brute-force numpy loop.

Tolerances. A gather moves values and is compared exactly. A pooled sum is the same f32 sum in another order (the
Mosaic kernel pools on the MXU, the reference with einsum): bf16 rows are upcast to f32 exactly before either sums,
so bf16 tables get the same bound as f32 ones, |kernel - reference| <= 2 L eps_f32 sum_l |w_l x_l| per element.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pallas_calls
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import gather, gather_reduce, gather_reduce_reference, gather_reference
from pallas_kernels.gather_reduce import mosaic_fallback_reason, triton_fallback_reason
from pallas_kernels.hardware import TpuBudget

# The module (the package attribute `gather_reduce` is the function), for monkeypatching its block sizes.
gr = importlib.import_module("pallas_kernels.gather_reduce")

KERNELS = ("pallas_tpu", "pallas_gpu")
DTYPES = (jnp.float32, jnp.bfloat16)
FAMILY = {"pallas_tpu": "mosaic", "pallas_gpu": "triton", "pallas": "mosaic"}  # "pallas" + interpret: Mosaic


def assert_ran(impl: str, fn, *args, names: set[str] | None = None) -> None:
    """`fn` traces kernels of `impl`'s family only (and, if given, exactly the kernels `names`)."""
    calls = pallas_calls(fn, *args)
    assert calls and {family for _, family in calls} == {FAMILY[impl]}, (impl, calls)
    if names is not None:
        assert {name for name, _ in calls} == names, calls


def small_budget(smem_ids: int, num_cores: int = 1) -> TpuBudget:
    """A chip with room for `smem_ids` ids per call (16 MiB of VMEM) and `num_cores` TensorCores."""
    return TpuBudget(chip="test", smem_bytes=8 * smem_ids, vmem_bytes=16 << 20, num_cores=num_cores,
                     hbm_bytes_per_second=None)


def special_bags(num_rows: int, length: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """i32[13, L] ids and f32[13, L] weights: one bag per edge case, then random bags sharing ids across bags."""
    assert length >= 4
    rng = np.random.default_rng(seed)
    sentinel = num_rows
    ids = np.full((13, length), sentinel, np.int64)
    weights = np.zeros((13, length), np.float32)
    # 0: empty bag (all sentinel, weight 0). 1: all sentinel with non-zero weights (must still read zeros).
    weights[1] = 1.0
    # 2: full bag of distinct ids, sum pooling.
    ids[2] = rng.choice(num_rows, length, replace=False)
    weights[2] = 1.0
    # 3: bag of one id, mean pooling (1 / len = 1).
    ids[3, 0] = 7
    weights[3, 0] = 1.0
    # 4: duplicates within the bag, mean pooling over 3 ids.
    ids[4, :3] = [5, 5, 5]
    weights[4, :3] = 1 / 3
    # 5: the first and last rows, weighted.
    ids[5, :2] = [0, num_rows - 1]
    weights[5, :2] = [0.5, -2.0]
    # 6: ids past the sentinel and negative ones read zeros too; a real id in the middle of padding.
    ids[6] = [num_rows + 7, -1, 3] + [-5] * (length - 3)
    weights[6] = 1.5
    # 7-12: random bags with random lengths over a small id range (duplicates across bags), arbitrary weights.
    for b in range(7, 13):
        n = rng.integers(1, length + 1)
        ids[b, :n] = rng.integers(0, 6, n)
        weights[b, :n] = rng.normal(size=n)
    return ids.astype(np.int32), weights


def random_table(num_rows: int, dim: int, dtype, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(num_rows, dim)), dtype)


def assert_sum_close(out, ref, table, rows, weights):
    """|out - ref| <= 2 L eps sum_l |w_l x_l| (elementwise): the same f32 sum accumulated in another order."""
    length = rows.shape[-1]
    magnitude = gather_reduce_reference(jnp.abs(table), rows, jnp.abs(weights))
    bound = 2 * length * np.finfo(np.float32).eps * np.asarray(magnitude) + 1e-30
    err = np.abs(np.asarray(out) - np.asarray(ref))
    assert np.all(err <= bound), f"max err {err.max()}, max excess {(err - bound).max()}"


def numpy_pool(table: np.ndarray, rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Brute-force loop: sum_l w_l * table[id_l] over ids in [0, R)."""
    out = np.zeros(rows.shape[:-1] + (table.shape[1],), np.float64)
    for index in np.ndindex(rows.shape[:-1]):
        for row, w in zip(rows[index], weights[index], strict=True):
            if 0 <= row < table.shape[0]:
                out[index] += w * table[row].astype(np.float64)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The references.


@pytest.mark.parametrize("dtype", DTYPES)
def test_references_match_numpy_loop(dtype):
    table = random_table(40, 16, dtype)
    ids, weights = special_bags(40, 6)
    table_np = np.asarray(table.astype(jnp.float32))
    pooled = gather_reduce_reference(table, jnp.asarray(ids), jnp.asarray(weights))
    assert pooled.dtype == jnp.float32 and pooled.shape == (13, 16)
    np.testing.assert_allclose(pooled, numpy_pool(table_np, ids, weights), rtol=1e-6, atol=1e-6)
    per_id = gather_reference(table, jnp.asarray(ids))
    expected = np.where(((ids >= 0) & (ids < 40))[..., None], table_np[np.clip(ids, 0, 39)], 0.0)
    np.testing.assert_array_equal(per_id, expected)


# ---------------------------------------------------------------------------------------------------------------
# Forward: the kernels against the references.


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", KERNELS)
def test_edge_case_bags_match_reference(impl, dtype):
    table = random_table(40, 48, dtype)  # D = 48: not a power of two, not a multiple of 128
    ids, weights = map(jnp.asarray, special_bags(40, 6))
    pooled = lambda t: gather_reduce(t, ids, weights, impl=impl, interpret=True)
    per_id = lambda t: gather(t, ids, impl=impl, interpret=True)
    # Bags of 6 ids: Mosaic pools them on the VPU.
    assert_ran(impl, pooled, table, names={"gather_reduce_mosaic_vpu" if impl == "pallas_tpu" else
                                           "gather_reduce_triton"})
    assert_ran(impl, per_id, table, names={"gather_mosaic" if impl == "pallas_tpu" else "gather_triton"})
    out = pooled(table)
    assert out.dtype == jnp.float32 and out.shape == (13, 48)
    assert_sum_close(out, gather_reduce_reference(table, ids, weights), table, ids, weights)
    assert not np.any(np.asarray(out[:2])), "empty / all-sentinel bags must pool to zero"
    rows = per_id(table)
    assert rows.dtype == jnp.float32 and rows.shape == (13, 6, 48)
    np.testing.assert_array_equal(rows, gather_reference(table, ids))


@pytest.mark.parametrize("impl", KERNELS)
def test_random_shapes_match_reference(impl):
    rng = np.random.default_rng(1)
    # (R, D, rows shape): bags of 1 (B not a multiple of any block), bags of 100, and [B, F, L] -- all features of a
    # stacked group in one call -> [B, F, D]; dims 16, 128 and 200 (two column blocks / lane tiles).
    # Mosaic pools bags of 1 and 3 on the VPU, bags of 100 on the MXU.
    pooling = {1: "vpu", 100: "mxu", 3: "vpu"}
    for num_rows, dim, shape in [(30, 16, (37, 1)), (64, 128, (5, 100)), (9, 200, (3, 2, 3))]:
        table = random_table(num_rows, dim, jnp.float32, seed=num_rows)
        ids = jnp.asarray(rng.integers(0, num_rows + 2, shape), jnp.int32)  # some sentinels
        weights = jnp.asarray(rng.normal(size=shape), jnp.float32)
        kernel = f"gather_reduce_mosaic_{pooling[shape[-1]]}" if impl == "pallas_tpu" else "gather_reduce_triton"
        assert_ran(impl, lambda t, r, w: gather_reduce(t, r, w, impl=impl, interpret=True), table, ids, weights,
                   names={kernel})
        assert_ran(impl, lambda t, r: gather(t, r, impl=impl, interpret=True), table, ids)
        out = gather_reduce(table, ids, weights, impl=impl, interpret=True)
        assert out.shape == (*shape[:-1], dim)
        assert_sum_close(out, gather_reduce_reference(table, ids, weights), table, ids, weights)
        per_id = gather(table, ids, impl=impl, interpret=True)
        assert per_id.shape == (*shape, dim)
        np.testing.assert_array_equal(per_id, gather_reference(table, ids))
        if len(shape) == 3:  # feature f of the stacked call is the [B, L] lookup of that feature
            for f in range(shape[1]):
                np.testing.assert_array_equal(per_id[:, f], gather_reference(table, ids[:, f]))


def test_mosaic_splits_a_batch_over_smem_sized_calls(monkeypatch):
    """More ids than one call's SMEM budget: equal calls in a lax.map plus one for the rest, same result."""
    monkeypatch.setattr(gr, "_MOSAIC_ROWS_PER_SLOT", 8)  # 2 bags of 4 per slot, 16 bags (64 ids) per grid step
    monkeypatch.setattr(gr, "tpu_budget", lambda: small_budget(smem_ids=64))  # one grid step per call
    table = random_table(20, 16, jnp.float32)
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, 21, (52, 4)), jnp.int32)  # 3 calls of 16 bags (one traced) + 4 bags
    weights = jnp.asarray(rng.normal(size=(52, 4)), jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda t: gr._mosaic("reduce", t, ids, weights, interpret=True))(table))
    assert jaxpr.count("pallas_call") == 2 and "scan" in jaxpr
    out = gather_reduce(table, ids, weights, impl="pallas_tpu", interpret=True)
    assert_sum_close(out, gather_reduce_reference(table, ids, weights), table, ids, weights)
    np.testing.assert_array_equal(gather(table, ids, impl="pallas_tpu", interpret=True), gather_reference(table, ids))


def run_on_two_cores(fn):
    """Run `fn(params)` under the TPU simulator with 2 cores and race detection; returns (result, {core: [grid
    points in the order that core ran them]})."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as simulator

    visits: dict[int, list[tuple[int, ...]]] = {}

    def record(token, grid_point, core):
        visits.setdefault(int(core), []).append(tuple(int(x) for x in grid_point))
        return token

    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, grid_point_recorder=record)
    out = jax.block_until_ready(fn(params))
    assert not simulator.races.races_found
    return out, visits


@pytest.mark.parametrize("length", [1, 4, 9])
def test_mosaic_pipelines_across_steps_on_two_cores_without_races(monkeypatch, length):
    """Megacore split + DMAs pipelined across grid steps, under the TPU simulator (DMAs land only when waited on,
    scratch starts as NaN, race detection over 2 cores): each core runs one contiguous run of steps in order (grid
    (core, step), ("parallel", "arbitrary")); a read before its wait, a row never written, a slot reused too early
    or a step's first sub-block (prefetched by the step before) consumed before it landed would show here. Bags of
    1 (VPU, merged runs: sorted ids with runs of 8 adjacent rows, one ending exactly at R, one cut by the sentinel,
    one broken by a gap), 4 (VPU, position-major rows, the edge-case bags) and 9 (MXU; and the per-id gather,
    bag-major)."""
    monkeypatch.setattr(gr, "_MOSAIC_ROWS_PER_SLOT", 8)  # G * L <= 8 (or L): several grid steps from a few dozen bags
    monkeypatch.setattr(gr, "tpu_budget", lambda: small_budget(smem_ids=4096, num_cores=2))
    num_rows, rng = 300, np.random.default_rng(7)
    if length == 1:  # 4 steps of 64 bags (G = 8), 2 per core; most of the 32 runs of 8 slot rows are one DMA
        ids = np.concatenate([np.arange(0, 224), np.arange(num_rows - 8, num_rows), [296, 297, 298, 299] + [300] * 4,
                              [3, 4, 5, 7, 8, 9, 10, 11], rng.integers(0, num_rows + 1, 8)])[:, None]
    elif length == 4:  # 3 steps of 16 bags (G = 2): the edge-case bags, then random ones
        ids = np.concatenate([special_bags(num_rows, 4)[0], rng.integers(0, num_rows + 1, (27, 4))])
    else:  # 3 steps of 8 bags (G = 1)
        ids = rng.integers(0, num_rows + 1, (20, length))
    table = random_table(num_rows, 16, jnp.float32)
    ids = jnp.asarray(ids, jnp.int32)
    weights = jnp.asarray(rng.normal(size=ids.shape), jnp.float32)
    plan = gr.mosaic_plan("reduce", num_rows, 16, jnp.float32, length)
    assert plan.num_cores == 2 and plan.merge_runs == (length == 1)
    assert plan.pooling == ("mxu" if length > 8 else "vpu")

    out, visits = run_on_two_cores(lambda params: gather_reduce(table, ids, weights, impl="pallas_tpu",
                                                                  interpret=params))
    assert_sum_close(out, gather_reduce_reference(table, ids, weights), table, ids, weights)
    assert sorted(visits) == [0, 1] and sum(map(len, visits.values())) == 4
    for points in visits.values():  # one parallel coordinate per core, its steps in order
        assert len({c for c, _ in points}) == 1 and [j for _, j in points] == list(range(len(points))), visits
    if length == 9:  # the per-id gather: bag-major rows, one DMA each
        rows, visits = run_on_two_cores(lambda params: gather(table, ids, impl="pallas_tpu", interpret=params))
        np.testing.assert_array_equal(rows, gather_reference(table, ids))
        assert sorted(visits) == [0, 1]


def test_blocks_and_limits_come_from_the_chip():
    """On this CPU host the every-chip fallback (16 KiB SMEM: 2048 ids per call; 16 MiB VMEM); lowered for a v5e
    (`for_tpu_chip`: jax's abstract-device mechanism) the chip's 1 MiB SMEM and 128 MiB VMEM, and a v4 megacore
    splits the grid over its 2 TensorCores. The kernel requests 3/4 of the chip's VMEM (`vmem_limit_bytes`)."""
    from pallas_kernels.hardware import for_tpu_chip, tpu_budget

    assert (tpu_budget().chip, tpu_budget().smem_ids, tpu_budget().vmem_limit_bytes) == ("fallback", 2048, 12 << 20)
    table = jax.ShapeDtypeStruct((100_000, 64), jnp.float32)
    ids, weights = jax.ShapeDtypeStruct((70_000, 1), jnp.int32), jax.ShapeDtypeStruct((70_000, 1), jnp.float32)
    pooled = lambda t, r, w: gather_reduce(t, r, w, impl="pallas_tpu")

    def traced():
        text = str(jax.make_jaxpr(pooled)(table, ids, weights))
        return text.count("pallas_call["), text

    calls, text = traced()  # 34 equal calls of one grid step in a lax.map (one traced) + one for the rest
    assert calls == 2 and "vmem_limit_bytes=12582912" in text and "grid=(1, 1)" in text
    with for_tpu_chip("TPU v5 lite"):
        assert gr.mosaic_plan("reduce", 100_000, 64, jnp.float32, 1).ids_per_call == 131072
        calls, text = traced()  # every id in one call, one core
        assert calls == 1 and "vmem_limit_bytes=100663296" in text and "grid=(1, 35)" in text
    with for_tpu_chip("TPU v4", num_cores=2):
        calls, text = traced()
        assert calls == 1 and "grid=(2, 18)" in text


def test_triton_blocks_follow_the_device(monkeypatch):
    """Bags per program shrink until the grid has 4 programs per SM (keeping >= 16 rows in flight per loop step); a
    step gathers up to 16 positions of each bag; pipeline stages fit shared memory."""
    from pallas_kernels.hardware import GpuBudget

    blocks = gr.TritonBlocks
    monkeypatch.setattr(gr, "gpu_budget", lambda: GpuBudget("test", sm_count=4, shared_memory_per_block=48 * 1024))
    assert gr.triton_blocks(4096, 1, 16, 4) == blocks(256, 1, 16, 3)  # 16 programs = 4 per SM; 3 stages of 16 KiB
    assert gr.triton_blocks(4096, 1, 64, 2) == blocks(128, 1, 64, 3)  # the register tile caps bags at 8192 / 64
    assert gr.triton_blocks(100, 1, 128, 4) == blocks(16, 1, 128, 3)  # 7 programs at 16 bags: the floor
    # Bags of 100: 16 positions a step (7 steps), 4 bags of 16 rows each = the 8192-element tile; 1 stage of 32 KiB.
    assert gr.triton_blocks(100, 100, 128, 4) == blocks(4, 16, 128, 1)
    # D 200: two 128-column blocks; L 3 -> 4 positions a step; 16 bags would give 14 programs, 8 give 26.
    assert gr.triton_blocks(100, 3, 200, 4) == blocks(8, 4, 128, 3)
    monkeypatch.setattr(gr, "gpu_budget", lambda: GpuBudget("test", sm_count=132, shared_memory_per_block=16 * 1024))
    assert gr.triton_blocks(131072, 1, 16, 4) == blocks(128, 1, 16, 2)  # 1024 programs >= 4 x 132; 2 stages of 8 KiB
    # reference_random's lookups: 8 x 2048 bags of 100 at D 64 -> 8 bags x 16 positions, 2048 programs.
    assert gr.triton_blocks(16384, 100, 64, 4) == blocks(8, 16, 64, 1)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu", "pallas"])
def test_interpret_runs_the_kernel_the_impl_names(impl):
    """Regression: impl="pallas_gpu" with interpret=True on a CPU ran the Mosaic kernel (the dispatcher tested
    "interpret on a non-GPU backend" before the impl), so no test ever executed the Triton gather."""
    table = random_table(20, 16, jnp.float32)
    ids, weights = map(jnp.asarray, special_bags(20, 4))
    assert_ran(impl, lambda t: gather_reduce(t, ids, weights, impl=impl, interpret=True), table)
    assert_ran(impl, lambda t: gather(t, ids, impl=impl, interpret=True), table)


# ---------------------------------------------------------------------------------------------------------------
# Gradients: the custom VJPs against jax.vjp of the references.


# The backward is the same XLA code for every impl (only the forward differs), so the slow-to-interpret Mosaic
# kernel is exercised once here.
@pytest.mark.parametrize("impl,dtype", [("pallas_tpu", jnp.float32), ("pallas_gpu", jnp.float32),
                                        ("pallas_gpu", jnp.bfloat16), ("xla", jnp.float32), ("xla", jnp.bfloat16)])
def test_vjps_match_reference(impl, dtype):
    """Small integers everywhere, so every sum is exact in any order and in bf16: duplicates (within and across
    bags) must be summed exactly, sentinels dropped."""
    rng = np.random.default_rng(4)
    table = jnp.asarray(rng.integers(-3, 4, (40, 48)), dtype)  # the edge-case test's shapes: kernels compile once
    ids, _ = special_bags(40, 6)
    ids = jnp.asarray(ids)
    weights = jnp.asarray(rng.integers(-2, 3, ids.shape), jnp.float32)
    kw = dict(interpret=True) if impl != "xla" else {}
    if impl != "xla":
        assert_ran(impl, lambda t, w: gather_reduce(t, ids, w, impl=impl, **kw), table, jnp.ones(ids.shape))

    out, vjp = jax.vjp(lambda t, w: gather_reduce(t, ids, w, impl=impl, **kw), table, weights)
    ref_out, ref_vjp = jax.vjp(lambda t, w: gather_reduce_reference(t, ids, w), table, weights)
    np.testing.assert_array_equal(out, ref_out)
    cotangent = jnp.asarray(rng.integers(-3, 4, out.shape), jnp.float32)
    (d_table, d_weights), (ref_d_table, ref_d_weights) = vjp(cotangent), ref_vjp(cotangent)
    assert d_table.dtype == dtype and d_weights.dtype == jnp.float32
    np.testing.assert_array_equal(d_table, ref_d_table)
    np.testing.assert_array_equal(d_weights, ref_d_weights)

    out, vjp = jax.vjp(lambda t: gather(t, ids, impl=impl, **kw), table)
    ref_out, ref_vjp = jax.vjp(lambda t: gather_reference(t, ids), table)
    cotangent = jnp.asarray(rng.integers(-3, 4, out.shape), jnp.float32)
    (d_table,), (ref_d_table,) = vjp(cotangent), ref_vjp(cotangent)
    assert d_table.dtype == dtype
    np.testing.assert_array_equal(d_table, ref_d_table)


def test_vjp_of_duplicates_is_their_sum():
    """Hand-computed: id 2 read three times (two bags) gets the three cotangent rows, weighted. (The backward is
    the same XLA code for every impl; "xla" runs it without a kernel compile.)"""
    table = jnp.zeros((4, 2), jnp.float32)
    ids = jnp.asarray([[2, 2, 4], [2, 0, 4]], jnp.int32)  # 4 is the sentinel
    weights = jnp.asarray([[1.0, 2.0, 5.0], [3.0, 1.0, 5.0]], jnp.float32)
    g = jnp.asarray([[1.0, 10.0], [100.0, 1000.0]], jnp.float32)
    _, vjp = jax.vjp(lambda t: gather_reduce(t, ids, weights, impl="xla"), table)
    (d_table,) = vjp(g)
    np.testing.assert_array_equal(d_table, [[100, 1000], [0, 0], [1 * 1 + 2 * 1 + 3 * 100, 10 + 20 + 3000], [0, 0]])


def test_grad_under_jit_with_auto():
    table = random_table(30, 16, jnp.float32)
    ids, weights = map(jnp.asarray, special_bags(30, 4))
    loss = lambda t, impl: jnp.sum(gather_reduce(t, ids, weights, impl=impl) ** 2)
    np.testing.assert_allclose(jax.jit(jax.grad(loss), static_argnums=1)(table, "auto"),
                               jax.grad(lambda t: jnp.sum(gather_reduce_reference(t, ids, weights) ** 2))(table),
                               rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Dispatch and fallbacks.


def test_auto_is_the_reference_on_cpu():
    table = random_table(30, 16, jnp.float32)
    ids, weights = map(jnp.asarray, special_bags(30, 4))
    np.testing.assert_array_equal(gather_reduce(table, ids, weights), gather_reduce_reference(table, ids, weights))
    np.testing.assert_array_equal(gather(table, ids), gather_reference(table, ids))
    assert "pallas_call" not in jax.jit(lambda t: gather(t, ids)).lower(table).as_text()


def test_bad_arguments_say_what_to_do():
    table, ids = jnp.zeros((4, 8)), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="gather: unknown impl 'mosaic'"):
        gather(table, ids, impl="mosaic")
    with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
        gather(table, ids, impl="pallas")  # a kernel was asked for: none compiles for CPU
    with pytest.raises(ValueError, match="impl='xla' names none"):
        gather(table, ids, impl="xla", interpret=True)
    with pytest.raises(ValueError, match="impl='auto' names none"):  # a CPU lowering would silently run XLA
        gather(table, ids, interpret=True)
    with pytest.raises(ValueError, match="rows must be integer"):
        gather(table, ids.astype(jnp.float32))


def test_documented_fallbacks_run_the_reference():
    """Cases the Mosaic kernel leaves to XLA (WORKSPACE.md, "Kernels: what lowers where") still give the answer."""
    assert "odd row count" in mosaic_fallback_reason("reduce", 41, 16, jnp.bfloat16, 4)
    assert "float16" in mosaic_fallback_reason("reduce", 40, 16, jnp.float16, 4)
    assert "VMEM" in mosaic_fallback_reason("gather", 40, 1024, jnp.float32, 4000)
    assert mosaic_fallback_reason("reduce", 40, 16, jnp.bfloat16, 4) is None
    assert triton_fallback_reason("reduce", 40, 16, jnp.bfloat16, 4) is None
    assert "int8" in triton_fallback_reason("reduce", 40, 16, jnp.int8, 4)
    table = random_table(41, 16, jnp.bfloat16)  # odd R: the Mosaic path falls back
    ids, weights = map(jnp.asarray, special_bags(41, 4))
    fn = lambda t: gather_reduce(t, ids, weights, impl="pallas_tpu", interpret=True)
    assert "pallas_call" not in str(jax.make_jaxpr(fn)(table))
    np.testing.assert_array_equal(fn(table), gather_reduce_reference(table, ids, weights))


@pytest.mark.parametrize("impl", KERNELS)
def test_empty_batches_and_bags(impl):
    """No bags, bags of length 0, a feature axis of 0: right shapes, zeros (the kernels hand these to XLA)."""
    table = random_table(10, 16, jnp.float32)
    for shape in [(0, 5), (3, 0), (2, 0, 4)]:
        ids, weights = jnp.zeros(shape, jnp.int32), jnp.ones(shape, jnp.float32)
        out = gather_reduce(table, ids, weights, impl=impl, interpret=True)
        assert out.shape == (*shape[:-1], 16) and not np.any(np.asarray(out))
        assert gather(table, ids, impl=impl, interpret=True).shape == (*shape, 16)
