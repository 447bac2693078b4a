"""The fused sparse-update kernels against an independent numpy loop and the XLA reference (interpret mode on
CPU), in-place aliasing, and real Mosaic TPU / Triton lowering through `jax.export` on this CPU host."""

import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pallas_calls
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels.scatter_update as scatter_update
from pallas_kernels import SegmentGrads, fused_row_update, kernel_fallback_reason, sorted_segments
from pallas_kernels.hardware import TpuBudget
from recjax.sparse_optim import SGD, Adagrad, LazyAdam, RowwiseAdagrad

OPTIMIZERS = {"sgd": lambda wd: SGD(0.1, weight_decay=wd),
              "adagrad": lambda wd: Adagrad(0.1, weight_decay=wd, initial_accumulator_value=0.1),
              "rowwise_adagrad": lambda wd: RowwiseAdagrad(0.1, weight_decay=wd),
              "lazy_adam": lambda wd: LazyAdam(0.01, weight_decay=wd)}
EPS, B1, B2 = 1e-8, 0.9, 0.999
TRITON = "__gpu$xla.gpu.triton"


def folded_rule(optimizer):
    """The rule recjax hands over: the optimizer's row rule with its coupled L2 folded into the gradient."""
    def rule(rows, state, grads, lr, step):
        if optimizer.weight_decay:
            grads = grads + optimizer.weight_decay * rows
        return optimizer.update_rows(rows, state, grads, lr, step)
    return rule


def numpy_update(name, table, state, ids, grads, lr, step, weight_decay):
    """One step, row by row in numpy: ids >= R skipped, each listed row updated once."""
    table, state = table.copy(), {k: v.copy() for k, v in state.items()}
    for i, r in enumerate(ids):
        if r >= table.shape[0]:
            continue
        w = table[r].astype(np.float64)
        g = grads[i].astype(np.float64) + weight_decay * w
        if name == "sgd":
            w = w - lr * g
        elif name == "adagrad":
            state["accumulator"][r] += g * g
            w = w - lr * g / (np.sqrt(state["accumulator"][r].astype(np.float64)) + EPS)
        elif name == "rowwise_adagrad":
            state["accumulator"][r] += np.mean(g * g)
            w = w - lr * g / (np.sqrt(np.float64(state["accumulator"][r])) + EPS)
        else:
            state["m"][r] = B1 * state["m"][r] + (1 - B1) * g
            state["v"][r] = B2 * state["v"][r] + (1 - B2) * g * g
            m_hat = state["m"][r] / (1 - B1**step)
            v_hat = state["v"][r] / (1 - B2**step)
            w = w - lr * m_hat / (np.sqrt(v_hat) + EPS)
        table[r] = w
    return table, state


def random_ids(rng, num_rows, num_unique):
    """Distinct real ids (always 0 and R - 1 when they fit) plus padding ids >= R (repeats allowed), shuffled."""
    real = min(num_unique - 1, num_rows)  # keep at least one padding slot
    chosen = rng.permutation(np.arange(1, num_rows - 1))[:max(real - 2, 0)]
    chosen = np.concatenate([[0, num_rows - 1][:real], chosen])
    padding = rng.choice([num_rows, num_rows + 3, 2**31 - 1], num_unique - chosen.size)
    return rng.permutation(np.concatenate([chosen, padding])).astype(np.int32)


def run_steps(impl, name, weight_decay, num_rows, dim, num_unique, seed, steps=3, interpret=True, pass_current=True):
    """`steps` updates through `impl` and through numpy; returns both results and the touched-row mask. Without
    `pass_current` the update reads the touched rows itself (current=None)."""
    rng = np.random.default_rng(seed)
    optimizer = OPTIMIZERS[name](weight_decay)
    table0 = rng.normal(size=(num_rows, dim)).astype(np.float32)
    state0 = {k: np.asarray(v) + rng.uniform(0, 0.1, v.shape).astype(np.float32)
              for k, v in optimizer.init(num_rows, dim).items()}
    rule = folded_rule(optimizer)
    interpret = interpret if impl.startswith("pallas") else False  # "xla" / "auto" run no kernel to interpret
    update = jax.jit(lambda t, s, i, c, g, st: fused_row_update(t, s, i, c if pass_current else None, g, rule,
                                                               optimizer.learning_rate, st, impl=impl,
                                                               interpret=interpret),
                     donate_argnums=(0, 1))
    table, state = jnp.asarray(table0), {k: jnp.asarray(v) for k, v in state0.items()}
    np_table, np_state = table0, state0
    touched = np.zeros(num_rows, bool)
    for step in range(1, steps + 1):
        ids = random_ids(rng, num_rows, num_unique)
        valid = ids < num_rows
        touched[ids[valid]] = True
        current = np.full((num_unique, dim), np.nan, np.float32)  # padding slots hold garbage
        current[valid] = np.asarray(table)[ids[valid]]
        grads = rng.normal(size=(num_unique, dim)).astype(np.float32)
        grads[~valid] = np.nan
        np_table, np_state = numpy_update(name, np_table, np_state, ids, grads, optimizer.learning_rate, step,
                                          weight_decay)
        table, state = update(table, state, jnp.asarray(ids), jnp.asarray(current), jnp.asarray(grads),
                              jnp.int32(step))
    return (np.asarray(table), {k: np.asarray(v) for k, v in state.items()}), (np_table, np_state), \
        (table0, state0), touched


# name, weight decay, R, D, U: every rule with and without weight decay, D over {1, 8, 16, 64, 128}, U > R and < R.
CASES = [("sgd", 0.0, 23, 1, 30), ("sgd", 0.05, 40, 128, 17),
         ("adagrad", 0.0, 31, 8, 12), ("adagrad", 0.05, 9, 16, 24),
         ("rowwise_adagrad", 0.0, 27, 64, 40), ("rowwise_adagrad", 0.05, 50, 8, 21),
         ("lazy_adam", 0.0, 12, 16, 20), ("lazy_adam", 0.05, 35, 1, 14)]


def small_budget(smem_ids: int, num_cores: int = 1) -> TpuBudget:
    """A chip with room for `smem_ids` ids per call (16 MiB of VMEM) and `num_cores` TensorCores."""
    return TpuBudget(chip="test", smem_bytes=8 * smem_ids, vmem_bytes=16 << 20, num_cores=num_cores,
                     hbm_bytes_per_second=None)


FAMILY = {"pallas_tpu": ("fused_row_update_tpu", "mosaic"), "pallas_gpu": ("fused_row_update_gpu", "triton")}


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("name,weight_decay,num_rows,dim,num_unique", CASES)
def test_kernel_matches_numpy_and_xla(impl, name, weight_decay, num_rows, dim, num_unique):
    seed = CASES.index((name, weight_decay, num_rows, dim, num_unique))
    optimizer = OPTIMIZERS[name](weight_decay)
    table, rows = jnp.zeros((num_rows, dim)), jnp.zeros((num_unique, dim))
    state = optimizer.init(num_rows, dim)
    traced = pallas_calls(lambda t, s, i, c, g: fused_row_update(t, s, i, c, g, folded_rule(optimizer), 0.1, 1,
                                                                 impl=impl, interpret=True),
                          table, state, jnp.zeros((num_unique,), jnp.int32), rows, rows)
    assert traced == [FAMILY[impl]], traced  # the kernel the impl names ran (Triton under the HLO interpreter)
    (table, state), (np_table, np_state), (table0, state0), touched = run_steps(
        impl, name, weight_decay, num_rows, dim, num_unique, seed)
    (xla_table, xla_state), *_ = run_steps("xla", name, weight_decay, num_rows, dim, num_unique, seed)
    np.testing.assert_allclose(table, np_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(table, xla_table, rtol=1e-5, atol=1e-6)
    assert set(state) == set(np_state)
    for k in state:
        np.testing.assert_allclose(state[k], np_state[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state[k], xla_state[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(state[k][~touched], state0[k][~touched])
    # Lazy semantics: rows never listed keep their exact bits.
    np.testing.assert_array_equal(table[~touched], table0[~touched])
    assert touched.any() and np.isfinite(table).all()


@pytest.mark.parametrize("dma_mode", ["on_wait", "eager"])
@pytest.mark.parametrize("name", ["rowwise_adagrad", "lazy_adam"])
def test_tpu_kernel_many_blocks_and_calls(monkeypatch, name, dma_mode):
    """Small blocks and prefetch chunks so one update spans several blocks (double buffering) and several
    kernel calls (the loop over chunks, whose last block index is clamped); DMAs landing at issue or only at
    their wait give the same result."""
    monkeypatch.setattr(scatter_update, "TPU_BLOCK_ROWS", (8,))
    monkeypatch.setattr(scatter_update, "tpu_budget", lambda: small_budget(smem_ids=16))
    params = pltpu.InterpretParams(dma_execution_mode=dma_mode)
    # U = 37: 5 blocks of 8, 2 blocks per call, 3 calls (the third re-reads the clamped last block).
    (table, state), (np_table, np_state), (table0, _), touched = run_steps(
        "pallas_tpu", name, 0.01, 45, 8, 37, seed=11, steps=2, interpret=params)
    np.testing.assert_allclose(table, np_table, rtol=1e-5, atol=1e-6)
    for k in state:
        np.testing.assert_allclose(state[k], np_state[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(table[~touched], table0[~touched])


@pytest.mark.parametrize("impl", ["xla", "pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[6]])
def test_update_reads_the_rows_itself(impl, case):
    """current=None (the forward pooled from the table): each path reads the touched rows from the table -- the
    kernels inside, beside the state rows -- and matches the numpy loop (sgd with decay, row-wise Adagrad, lazy
    Adam)."""
    name, weight_decay, num_rows, dim, num_unique = case
    (table, state), (np_table, np_state), (table0, _), touched = run_steps(
        impl, name, weight_decay, num_rows, dim, num_unique, seed=CASES.index(case), steps=2, pass_current=False)
    np.testing.assert_allclose(table, np_table, rtol=1e-5, atol=1e-6)
    for k in state:
        np.testing.assert_allclose(state[k], np_state[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(table[~touched], table0[~touched])


@pytest.mark.parametrize("read_rows", [False, True])
def test_tpu_kernel_two_cores_merged_runs_without_races(monkeypatch, read_rows):
    """Megacore grid (2 cores x 3 blocks, ("parallel", "arbitrary")) with the slot index in SMEM, under the TPU
    simulator's race detector: sorted distinct ids with runs of 8 adjacent rows (one DMA each: one ending exactly
    at R), a run broken by a gap, one cut by padding. Each core's blocks pipeline reads and writes across its steps;
    the cores write disjoint rows."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as simulator

    monkeypatch.setattr(scatter_update, "TPU_BLOCK_ROWS", (8,))
    monkeypatch.setattr(scatter_update, "tpu_budget", lambda: small_budget(smem_ids=64, num_cores=2))
    num_rows, dim = 48, 8
    ids = np.concatenate([np.arange(0, 8), np.arange(10, 18), [20, 21, 22, 24, 25, 26, 27, 28],
                          np.arange(40, 48), [48, 48, 48, 48, 51]]).astype(np.int32)  # 5 blocks (6 with padding)
    rng = np.random.default_rng(12)
    optimizer = OPTIMIZERS["lazy_adam"](0.01)
    table = rng.normal(size=(num_rows, dim)).astype(np.float32)
    state = {k: np.asarray(v) + rng.uniform(0, 0.1, v.shape).astype(np.float32)
             for k, v in optimizer.init(num_rows, dim).items()}
    grads = rng.normal(size=(ids.size, dim)).astype(np.float32)
    valid = ids < num_rows
    current = None if read_rows else jnp.asarray(np.where(valid[:, None], table[np.minimum(ids, num_rows - 1)], 0))
    visits = set()

    def record(token, grid_point, core):
        visits.add((int(core), *map(int, grid_point)))
        return token

    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, grid_point_recorder=record)
    new_table, new_state = fused_row_update(jnp.asarray(table), {k: jnp.asarray(v) for k, v in state.items()},
                                            jnp.asarray(ids), current, jnp.asarray(grads), folded_rule(optimizer),
                                            optimizer.learning_rate, 2, impl="pallas_tpu", interpret=params)
    np_table, np_state = numpy_update("lazy_adam", table, state, ids, grads, optimizer.learning_rate, 2, 0.01)
    np.testing.assert_allclose(np.asarray(new_table), np_table, rtol=1e-5, atol=1e-6)
    for k in state:
        np.testing.assert_allclose(np.asarray(new_state[k]), np_state[k], rtol=1e-5, atol=1e-6)
    assert not simulator.races.races_found
    assert {core for core, *_ in visits} == {0, 1} and len(visits) == 6, visits


def segmented_case(rng, num_rows, dim, occurrences, sources):
    """The occurrences of one step as the table path's backward sees them: row ids (duplicates, one row 12 times,
    padding ids >= R), for each the gradient row it reads and its weight (some 0); sorted into segments."""
    ids = rng.integers(0, num_rows + 3, occurrences).astype(np.int32)
    ids[rng.choice(occurrences, 12, replace=False)] = num_rows // 2  # a long segment
    source = rng.integers(0, sources, occurrences).astype(np.int32)
    weight = rng.normal(size=occurrences).astype(np.float32)
    weight[rng.random(occurrences) < 0.1] = 0.0
    source_rows = rng.normal(size=(sources, dim)).astype(np.float32)
    unique, inverse, starts, order = map(np.asarray, sorted_segments(jnp.asarray(ids), num_rows))
    segments = SegmentGrads(jnp.asarray(starts), jnp.asarray(source[order]), jnp.asarray(weight[order]),
                            jnp.asarray(source_rows))
    # The oracle's summed gradient of each distinct row, in float64.
    summed = np.zeros((unique.size, dim))
    np.add.at(summed, inverse, weight[:, None].astype(np.float64) * source_rows[source])
    return unique, segments, summed


@pytest.mark.parametrize("impl,name", [*[("pallas_gpu", n) for n in OPTIMIZERS], ("pallas_tpu", "rowwise_adagrad"),
                                       ("xla", "lazy_adam"),
                                       *[pytest.param("pallas_tpu", n, marks=pytest.mark.slow)
                                         for n in ("sgd", "adagrad", "lazy_adam")]])
def test_fused_backward_update_matches_numpy(impl, name):
    """The fused backward + update (`SegmentGrads`): each distinct row's gradient summed over its occurrences'
    weighted source rows, then the optimizer's rule -- against a numpy loop, two steps (the second on the first's
    output). The GPU kernel sums the segments in the program that updates the row (kernel fused_backward_update_gpu);
    the TPU path sums them with XLA, then runs the Mosaic update kernel; padding ids are never written."""
    rng = np.random.default_rng(list(OPTIMIZERS).index(name))
    num_rows, dim = 30, 16
    optimizer = OPTIMIZERS[name](0.02)
    rule = folded_rule(optimizer)
    table0 = rng.normal(size=(num_rows, dim)).astype(np.float32)
    state0 = {k: np.asarray(v) + rng.uniform(0, 0.1, v.shape).astype(np.float32)
              for k, v in optimizer.init(num_rows, dim).items()}
    interpret = impl != "xla"
    update = jax.jit(lambda t, s, u, g, st: fused_row_update(t, s, u, None, g, rule, optimizer.learning_rate, st,
                                                             impl=impl, interpret=interpret), donate_argnums=(0, 1))
    table, state = jnp.asarray(table0), {k: jnp.asarray(v) for k, v in state0.items()}
    np_table, np_state = table0, state0
    touched = np.zeros(num_rows, bool)
    for step in (1, 2):
        unique, segments, summed = segmented_case(rng, num_rows, dim, occurrences=70, sources=24)
        if step == 1 and impl != "xla":
            kernel = "fused_backward_update_gpu" if impl == "pallas_gpu" else "fused_row_update_tpu"
            assert [n for n, _ in pallas_calls(update, table, state, jnp.asarray(unique), segments, 1)] == [kernel]
        touched[unique[unique < num_rows]] = True
        np_table, np_state = numpy_update(name, np_table, np_state, unique, summed, optimizer.learning_rate, step,
                                          optimizer.weight_decay)
        table, state = update(table, state, jnp.asarray(unique), segments, jnp.int32(step))
    np.testing.assert_allclose(np.asarray(table), np_table, rtol=1e-5, atol=1e-6)
    for k in state:
        np.testing.assert_allclose(np.asarray(state[k]), np_state[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(table)[~touched], table0[~touched])
    assert touched.sum() > 5


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_fused_backward_update_lowers(platform):
    """Every rule's fused backward + update exports: on CUDA one Triton call (the segment sum inside) updating the
    donated table and state in place and no XLA scatter; on TPU the XLA segment sum, then the Mosaic update."""
    target = "tpu_custom_call" if platform == "tpu" else TRITON
    for name in OPTIMIZERS:
        optimizer = OPTIMIZERS[name](0.01)
        rule = folded_rule(optimizer)
        table = jax.ShapeDtypeStruct((1000, 64), jnp.float32)
        state = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in optimizer.state_shapes(1000, 64).items()}
        shape = lambda *s, dtype=jnp.int32: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
        update = jax.jit(lambda t, s, u, a, b, c, d, rule=rule: fused_row_update(
            t, s, u, None, SegmentGrads(a, b, c, d), rule, 0.01, 3, impl="pallas"), donate_argnums=(0, 1))
        checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)] if platform == "cuda" else []
        text = jax.export.export(update, platforms=[platform], disabled_checks=checks)(
            table, state, shape(300), shape(301), shape(500), shape(500, dtype=jnp.float32),
            shape(80, 64, dtype=jnp.float32)).mlir_module()
        aliases = kernel_aliases(text, target)
        assert set(aliases) <= donated_args(text) and len(donated_args(text)) == 1 + len(state)
        if platform == "cuda":
            assert len(aliases) == 1 + len(state) and "\"stablehlo.scatter\"(" not in text
        else:
            assert "\"stablehlo.scatter\"(" in text  # the segment sum


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_kernel_single_id(impl):
    """U = 1: the last row alone is updated as numpy says; a lone padding id changes nothing."""
    rng = np.random.default_rng(5)
    optimizer = OPTIMIZERS["rowwise_adagrad"](0.01)
    table = rng.normal(size=(6, 8)).astype(np.float32)
    state = {"accumulator": np.full(6, 0.1, np.float32)}
    grads = rng.normal(size=(1, 8)).astype(np.float32)
    for row in (5, 6):
        current = table[row:row + 1] if row < 6 else np.zeros((1, 8), np.float32)
        new_table, new_state = fused_row_update(jnp.asarray(table), {k: jnp.asarray(v) for k, v in state.items()},
                                                jnp.array([row], jnp.int32), jnp.asarray(current),
                                                jnp.asarray(grads), folded_rule(optimizer), 0.1, 1, impl=impl,
                                                interpret=True)
        np_table, np_state = numpy_update("rowwise_adagrad", table, state, [row], grads, 0.1, 1, 0.01)
        np.testing.assert_allclose(np.asarray(new_table), np_table, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(new_state["accumulator"]), np_state["accumulator"], rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(new_table)[:5], table[:5])
    np.testing.assert_array_equal(np.asarray(new_table), table)  # the padding-only call


def test_auto_on_cpu_is_the_xla_reference():
    (auto_table, auto_state), *_ = run_steps("auto", "lazy_adam", 0.01, 30, 16, 20, seed=3, interpret=False)
    (xla_table, xla_state), *_ = run_steps("xla", "lazy_adam", 0.01, 30, 16, 20, seed=3)
    np.testing.assert_array_equal(auto_table, xla_table)
    for k in xla_state:
        np.testing.assert_array_equal(auto_state[k], xla_state[k])


def test_donated_update_aliases_table_and_state_on_cpu():
    """Compiled with donation, the table and every state array are outputs aliased to their inputs and the
    temporaries stay O(U * D): no table-sized copy."""
    num_rows, dim, num_unique = 1 << 20, 16, 512
    optimizer = OPTIMIZERS["lazy_adam"](0.0)
    rule = folded_rule(optimizer)
    table = jax.ShapeDtypeStruct((num_rows, dim), jnp.float32)
    state = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in optimizer.state_shapes(num_rows, dim).items()}
    rows = jax.ShapeDtypeStruct((num_unique, dim), jnp.float32)
    ids = jax.ShapeDtypeStruct((num_unique,), jnp.int32)
    update = jax.jit(lambda t, s, i, c, g: fused_row_update(t, s, i, c, g, rule, 0.01, 1), donate_argnums=(0, 1))
    memory = update.lower(table, state, ids, rows, rows).compile().memory_analysis()
    table_bytes = 4 * num_rows * dim
    assert memory.alias_size_in_bytes == 3 * table_bytes  # table, m, v
    assert memory.temp_size_in_bytes < table_bytes // 16


def export(platform, rule, table, state, num_unique, impl="auto"):
    """`jax.export` of the donated update for `platform` on this CPU host; returns the StableHLO text."""
    dim = table.shape[1]
    rows = jax.ShapeDtypeStruct((num_unique, dim), jnp.float32)
    update = jax.jit(lambda t, s, i, c, g, lr, st: fused_row_update(t, s, i, c, g, rule, lr, st, impl=impl),
                     donate_argnums=(0, 1))
    # The Triton call carries Triton IR tied to this jaxlib, so export (which promises cross-version stability)
    # refuses it unless told; Mosaic's tpu_custom_call is on export's stable list.
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)] if platform in ("cuda", "rocm") else []
    exported = jax.export.export(update, platforms=[platform], disabled_checks=checks)(
        table, state, jax.ShapeDtypeStruct((num_unique,), jnp.int32), rows, rows,
        jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    return exported.mlir_module()


def kernel_aliases(text, target):
    """For the single `target` custom call: {operand: output} of its output_operand_aliases, operands by name."""
    calls = [line for line in text.splitlines() if f"stablehlo.custom_call @{target}(" in line]
    assert len(calls) == 1, len(calls)
    operands = re.search(rf"@{re.escape(target)}\(([^)]*)\)", calls[0]).group(1).split(", ")
    pairs = re.findall(r"output_tuple_indices = \[(\d*)\], operand_index = (\d+)", calls[0])
    return {operands[int(o)]: int(out or 0) for out, o in pairs}


def donated_args(text):
    return set(re.findall(r"(%arg\d+): tensor<[^>]*> \{tf\.aliasing_output", text))


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_kernels_lower_for_tpu_and_cuda(platform, name):
    """Real Mosaic / Triton lowering of every rule at D in {16, 64, 128}, U in {1, 100}: the kernel is one
    custom call that updates the donated table and state buffers in place."""
    target = "tpu_custom_call" if platform == "tpu" else TRITON
    optimizer = OPTIMIZERS[name](0.01)
    for dim in (16, 64, 128):
        table = jax.ShapeDtypeStruct((1000, dim), jnp.float32)
        state = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in optimizer.state_shapes(1000, dim).items()}
        assert kernel_fallback_reason("tpu" if platform == "tpu" else "gpu", folded_rule(optimizer), table,
                                      state) is None
        for num_unique in (1, 100):
            text = export(platform, folded_rule(optimizer), table, state, num_unique)
            aliases = kernel_aliases(text, target)
            # On TPU, [R] state (row-wise Adagrad) is gathered / scattered by XLA around the kernel (see
            # `_tpu_row_update`); everything else is written by the kernel, straight into the donated buffers.
            in_kernel = 1 + sum(len(s.shape) == 2 or platform == "cuda" for s in state.values())
            assert len(aliases) == in_kernel
            assert set(aliases) <= donated_args(text)
            assert len(donated_args(text)) == 1 + len(state)
            assert text.count("\"stablehlo.scatter\"(") == 1 + len(state) - in_kernel


@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_pallas_and_auto_lower_the_kernel_of_each_platform(impl):
    """Decided when lowered, the same for every kernel family: Mosaic on TPU, Triton on CUDA and ROCm; "auto" is
    XLA on CPU, "pallas" there is Pallas' own error."""
    optimizer = OPTIMIZERS["adagrad"](0.0)
    table = jax.ShapeDtypeStruct((100, 16), jnp.float32)
    state = {"accumulator": jax.ShapeDtypeStruct((100, 16), jnp.float32)}
    assert "tpu_custom_call" in export("tpu", folded_rule(optimizer), table, state, 10, impl=impl)
    assert TRITON in export("cuda", folded_rule(optimizer), table, state, 10, impl=impl)
    assert TRITON in export("rocm", folded_rule(optimizer), table, state, 10, impl=impl)
    if impl == "auto":
        text = export("cpu", folded_rule(optimizer), table, state, 10, impl="auto")
        assert "custom_call" not in text and text.count("\"stablehlo.scatter\"(") == 2
    else:
        with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
            export("cpu", folded_rule(optimizer), table, state, 10, impl="pallas")


def test_documented_fallbacks_take_the_xla_path():
    """Each documented case a kernel cannot express exports as XLA gather/scatter, with the stated reason."""
    optimizer = OPTIMIZERS["rowwise_adagrad"](0.0)
    rule = folded_rule(optimizer)

    def table_and_state(dim):
        return (jax.ShapeDtypeStruct((64, dim), jnp.float32),
                {"accumulator": jax.ShapeDtypeStruct((64,), jnp.float32)})

    # GPU: D not a power of two.
    table, state = table_and_state(24)
    assert "not a power of two" in kernel_fallback_reason("gpu", rule, table, state)
    text = export("cuda", rule, table, state, 10)
    assert TRITON not in text and text.count("\"stablehlo.scatter\"(") == 2
    assert kernel_fallback_reason("tpu", rule, table, state) is None

    # TPU: rows too wide for the VMEM budget even at 8 rows per block.
    table, state = table_and_state(1 << 17)
    assert "VMEM budget" in kernel_fallback_reason("tpu", rule, table, state)
    text = export("tpu", rule, table, state, 10)
    assert "tpu_custom_call" not in text and text.count("\"stablehlo.scatter\"(") == 2

    # TPU: a rule whose (lr, step)-only math is not a scalar (here a per-column schedule).
    def column_schedule(rows, state, grads, lr, step):
        return rows - lr * jnp.arange(1, rows.shape[1] + 1, dtype=jnp.float32) * grads, state

    table, state = table_and_state(16)
    assert "float32[1,16] value" in kernel_fallback_reason("tpu", column_schedule, table, state)
    assert "tpu_custom_call" not in export("tpu", column_schedule, table, state, 10)
    assert TRITON in export("cuda", column_schedule, table, state, 10)

    # Both: tables that are not f32.
    table16 = jax.ShapeDtypeStruct((64, 16), jnp.bfloat16)
    assert "f32" in kernel_fallback_reason("gpu", rule, table16, {})


def test_kernel_package_imports_no_recjax():
    code = "import sys, pallas_kernels; print(sorted({m.split('.')[0] for m in sys.modules} & {'recjax', 'flax'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).parents[1])
    assert out.stdout.strip() == "[]"


def test_unknown_impl_is_an_error():
    args = (jnp.zeros((4, 2)), {}, jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2)), jnp.zeros((1, 2)),
            folded_rule(SGD(0.1)), 0.1, 1)
    with pytest.raises(ValueError, match="unknown impl"):
        fused_row_update(*args, impl="triton")
    with pytest.raises(ValueError, match="impl='auto' names none"):  # a CPU lowering would silently run XLA
        fused_row_update(*args, interpret=True)


def test_traffic_of_the_fused_backward_by_hand():
    """3 ids (2 distinct rows) in 1 bag at D 4, f32, SGD. Unfused table path: rows read 48, pooled out + cotangent 32,
    per-occurrence gradients written + read 96, summed gradients zeroed + read-modify-written 96 and read 32, rows
    written 32, the update's row reads 32: 368 bytes. Fused: the occurrences read their bag's gradient row (48) and
    their source index and weight (24) instead of the 224 bytes of gradient buffers: 216."""
    from pallas_kernels.traffic import training_pass_bytes

    sizes = dict(ids=3, distinct=2, bags=1, dim=4)
    assert training_pass_bytes("table", **sizes) == 368
    assert training_pass_bytes("table", fused_backward=True, **sizes) == 216
    with pytest.raises(ValueError, match="fused_backward is the table path"):
        training_pass_bytes("distinct_rows", fused_backward=True, **sizes)
