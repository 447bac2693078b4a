"""Sharded embeddings on a mesh equal the single-device engine (the oracle), and their plans and errors.

The multi-device runs happen in one subprocess with 8 CPU devices (tests/sharding_cases.py): setting
`jax_num_cpu_devices` for the whole pytest process would send every other test's `train_and_evaluate` through the
mesh (its default is every device), so they would no longer test the single-device path they were written for. The
tests that read those runs are `slow` (~5 CPU-minutes for the subprocess: 12 cases and the HLO report, each compiling
a single-device and a sharded step); the plans and their errors below are not.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from recjax.errors import ConfigError
from recjax.sharding.mesh import mesh_shape, parse_mesh_shape
from recjax.sharding.plan import TableInfo, format_plan
from recjax.sharding.planner import make_plan
from recjax.sparse_optim import SPARSE_OPTIMIZERS
from tests.sharding_cases import BYTES_CASES, CASES

REPO = pathlib.Path(__file__).resolve().parents[1]


# LLVM -O0 halves XLA:CPU compile time, which is most of these tests' time; both the oracle and the sharded run
# compile under it (it changes how fast the code runs, not what it computes).
FAST_COMPILE = "--xla_backend_optimization_level=0"


def run_devices(out: pathlib.Path, cases: list[str], devices: int = 8, script: str = "sharding_cases.py") -> None:
    """Run tests/`script` OUT CASES... in a subprocess with `devices` CPU devices, for as long as it takes (no time
    limit: on a loaded machine it takes many times its idle time)."""
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip(),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(REPO / "tests" / script), str(out), *cases], env=env,
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-5000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("sharding")
    run_devices(out, [*CASES, "hlo"])
    return out


# ------------------------------------------------------------------------------- equality with one device
EXACT = sorted(c for c in CASES if "bf16" not in c)


# The one case the default suite runs (the full set is `slow`): mixed shardings (table, row, column, replicated)
# on a data=4 x model=2 mesh, full tables, lazy Adam.
DEFAULT_CASE = "dlrm-full-mixed-4x2"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("sharding_default")
    run_devices(out, [DEFAULT_CASE])
    return out


def assert_equals_single_device(r, case: str) -> None:
    """Losses, logits, updated tables + optimizer state and dense params (dense SGD: equal params = equal dense
    gradients) after 3 steps on 8 devices equal the single-device run."""
    np.testing.assert_allclose(r["loss"], r["ref_loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["logits"], r["ref_logits"], rtol=1e-5, atol=1e-5)
    keys = [k for k in r.files if k.startswith(("table/", "opt/", "dense/", "aux/"))]
    assert any(k.startswith("table/") for k in keys) and any(k.startswith("dense/") for k in keys)
    # Adam divides by sqrt(v): for a gradient entry near 0 a different f32 summation order (per-device partial sums
    # here) moves the parameter by up to ~1e-5; SGD / Adagrad cases are held to 1e-6.
    extra = CASES[case][5]
    dense_atol = 1e-4 if extra.get("optimizer.dense.name") == "adam" else 1e-6
    table_atol = 2e-5 if extra.get("optimizer.sparse.name", "lazy_adam") == "lazy_adam" else 1e-6
    for key in keys:
        atol = dense_atol if key.startswith("dense/") else table_atol
        np.testing.assert_allclose(r[key], r[f"ref_{key}"], rtol=1e-4, atol=atol, err_msg=key)
    # The run really trained: tables moved from one step to the next (guards against comparing two no-ops).
    assert r["ref_loss"][0] != r["ref_loss"][-1]


def assert_k_steps_equal_one_per_call(r) -> None:
    """The STEPS steps as one call on the mesh (a scan inside the shard_map) give the losses, tables, optimizer state,
    routing arrays and dense params of one call per step on the mesh, bit for bit."""
    keys = [k for k in r.files if k.startswith("k_")]
    assert any(k.startswith("k_table/") for k in keys) and any(k.startswith("k_dense/") for k in keys)
    np.testing.assert_array_equal(r["k_loss"], r["loss"])
    for key in keys:
        np.testing.assert_array_equal(r[key], r[key[2:]], err_msg=key)


def test_the_default_mesh_case_equals_single_device(default_run):
    assert_equals_single_device(np.load(default_run / f"{DEFAULT_CASE}.npz"), DEFAULT_CASE)
    assert_k_steps_equal_one_per_call(np.load(default_run / f"{DEFAULT_CASE}.npz"))


@pytest.mark.slow
def test_k_steps_per_call_on_a_mesh_with_dynamic_tables(runs):
    assert_k_steps_equal_one_per_call(np.load(runs / "dlrm-fiited-mixed-4x2.npz"))


@pytest.mark.slow
@pytest.mark.parametrize("case", EXACT)
def test_sharded_training_equals_single_device(runs, case):
    assert_equals_single_device(np.load(runs / f"{case}.npz"), case)


@pytest.mark.slow
def test_bfloat16_exchange_is_close_to_float32(runs):
    """Rows and row gradients cross devices in bfloat16 (accumulation f32): the run stays within bf16 rounding of the
    f32 single-device run, and is not identical to it (the exchange really is narrower)."""
    r = np.load(runs / "dlrm-full-mixed-4x2-bf16.npz")
    np.testing.assert_allclose(r["loss"], r["ref_loss"], rtol=1e-2)
    np.testing.assert_allclose(r["logits"], r["ref_logits"], atol=1e-2)
    np.testing.assert_allclose(r["table/dim16"], r["ref_table/dim16"], atol=1e-3)
    assert np.abs(r["logits"] - r["ref_logits"]).max() > 0
    report = json.loads((runs / "hlo.json").read_text())
    # The program asks for bf16 all_to_alls (XLA:CPU then widens them to f32; GPU / TPU keep them narrow).
    assert "bf16" in report["bfloat16"]["all_to_all_dtypes_requested"]
    assert "bf16" not in report["4096"]["all_to_all_dtypes_requested"]


def test_cases_cover_every_mesh_model_and_method():
    assert {c[2] for c in CASES.values()} == {"data=8", "data=4,model=2", "data=2,model=4"}
    assert {c[0] for c in CASES.values()} == {"dlrm", "wukong"}
    assert {"full", "qr", "md", "hashing", "tt", "fiited"} <= {c[1] for c in CASES.values()}
    assert {"table", "row", "column", "auto"} <= {c[3] for c in CASES.values()}
    assert set(SPARSE_OPTIMIZERS) == {c[5].get("optimizer.sparse.name", "lazy_adam") for c in CASES.values()}


@pytest.mark.slow
def test_every_sharding_type_ran(runs):
    kinds = set()
    for case in CASES:
        kinds |= set(np.load(runs / f"{case}.npz")["shardings"].tolist())
    assert kinds == {"table", "row", "column", "replicated"}


@pytest.mark.slow
def test_expected_and_worst_case_buckets_both_ran(runs):
    """sharding.capacity_factor 1.25 (sigmas 0, tests/sharding_cases.py): steps whose ids fit the expected buckets and
    steps that overflowed
    them into the worst-case branch both happened in the cases above, which equal the single-device run."""
    small_steps = overflow_steps = 0
    for case in EXACT:
        r = np.load(runs / f"{case}.npz")
        small_steps += int((r["overflows"] < r["expected_buckets"]).sum())
        overflow_steps += int((r["overflows"] > 0).sum())
    assert small_steps > 0 and overflow_steps > 0, (small_steps, overflow_steps)


# ------------------------------------------------------------------------------------------- compiled HLO
@pytest.mark.slow
def test_no_collective_or_temporary_has_a_table_size(runs):
    """In the compiled step (table-, row-, column-wise and replicated tables on a 4 x 2 mesh), every collective moves
    less than a table, no instruction holds more than the device's own block, the temporaries do not grow with
    the tables (4096 vs 32768 rows), and the blocks are updated in place (aliased)."""
    report = json.loads((runs / "hlo.json").read_text())
    small, large = report["4096"], report["32768"]
    for facts in (small, large):
        assert facts["collectives"], "no collectives: the step is not sharded"
        for c in facts["collectives"]:
            assert c["bytes"] < small["table_bytes"], c["line"]
        assert facts["largest_instruction_bytes"] <= max(facts["block_bytes"].values())
        assert facts["alias_bytes"] >= sum(facts["block_bytes"].values())
    assert [c["bytes"] for c in small["collectives"]] == [c["bytes"] for c in large["collectives"]]
    assert small["temp_bytes"] == large["temp_bytes"]
    assert large["block_bytes"]["dim16/column"] == large["table_bytes"] // 8  # a slice of the column-wise table
    # The row-wise buckets of a step without overflow move less than the worst-case branch that replaces them (the
    # compiled bytes equal these predicted ones: test_exchange_bytes_in_the_compiled_step_equal_the_plans_prediction).
    assert 0 < small["predicted_bucketed_exchange_bytes"] < small["fallback_exchange_bytes"]


@pytest.mark.slow
def test_exchange_bytes_in_the_compiled_step_equal_the_plans_prediction(runs):
    """The all_to_alls and all_gathers of each compiled step (pooled multi-hot bags table-, row- and column-wise, sum
    and mean, rows travelling, `auto`; bf16 widened on CPU) deliver to a device exactly the bytes the plan alone
    predicts (recjax/sharding/exchange.py `exchange_collectives`), in the step whose buckets fit and in the worst-case
    branch."""
    report = json.loads((runs / "hlo.json").read_text())
    names = ["4096", "32768", "bfloat16", *BYTES_CASES]
    for name in names:
        facts = report[name]
        assert facts["exchange_bytes"] > 0, name
        assert facts["exchange_bytes"] == facts["predicted_exchange_bytes"], name
        assert facts["fallback_exchange_bytes"] == facts["predicted_fallback_exchange_bytes"], name
    # The cases really differ in what they pool: every table's bags on their owners, none, and some.
    assert report["pooled-mixed-4x2"]["pooled_tables"] == ["C2", "C3", "C4", "C5"]  # C1 is replicated
    assert report["rows-mixed-4x2"]["pooled_tables"] == []
    assert report["pooled-mixed-4x2"]["exchange_bytes"] != report["rows-mixed-4x2"]["exchange_bytes"]


# ------------------------------------------------------------------------------------------ plans (1 device)
def tables(rows=(1000, 40, 5000, 7), bag=(1, 3, 1, 2), dim=16, state=32) -> list[TableInfo]:
    return [TableInfo(f"C{i}", f"C{i}", "full", r, dim, b, state) for i, (r, b) in enumerate(zip(rows, bag,
                                                                                               strict=True))]


MESH = {"data": 4, "model": 2}


def test_plan_places_every_table_and_fits():
    plan = make_plan(tables(), MESH, 64, device_memory_bytes=2**30)
    assert [p.table.name for p in plan.placements] == ["C0", "C1", "C2", "C3"]
    used = plan.device_bytes()
    # Every table's bytes are somewhere: replicated ones on each device, the rest once.
    once = sum(p.table.bytes for p in plan.placements if p.sharding not in ("replicated", "data_parallel"))
    everywhere = sum(p.table.bytes for p in plan.placements if p.sharding in ("replicated", "data_parallel"))
    assert sum(used) == once + 8 * everywhere
    text = format_plan(plan)
    for word in ("table", "method", "rows", "dim", "sharding", "devices", "bytes", "est. cost", "C2"):
        assert word in text


def test_row_wise_split_by_range_and_modulo():
    for split in ("range", "mod"):
        plan = make_plan(tables(rows=(1001,), bag=(1,)), MESH, 64, plan="row", row_split=split,
                         device_memory_bytes=2**30)
        per_device = [b // (4 * (16 + 32)) for b in plan.device_bytes()]
        assert sum(per_device) == 1001 and max(per_device) == 126  # ceil(1001 / 8)


def test_auto_splits_a_table_too_big_for_one_device():
    big = tables(rows=(100_000, 50), bag=(1, 1))
    row_bytes = 4 * (16 + 32)
    plan = make_plan(big, MESH, 64, device_memory_bytes=20_000 * row_bytes)
    # Split by rows or, where the dim divides and the optimizer state is element-wise, by columns: the planner
    # (recjax/sharding/planner.py) picks whichever its cost model finds cheaper.
    assert plan.placement("C0").sharding in ("row", "column")


def test_auto_evens_the_blocks_where_that_is_not_slower():
    """A storage is one [n L, d] array, so every device pays for the fullest: auto evens the blocks (splits the
    fullest device's largest whole tables by rows until no block holds more than 1.05x the mean) unless the
    planner's own plan fits with its blocks padded and the cost model of the runtime says the evened plan is slower;
    `plan=table` keeps whole tables, and a pinned table stays where it was pinned."""
    from recjax.sharding import planner
    from recjax.sharding.cost_model import AnalyticCostModel, plan_cost
    from recjax.sharding.plan import balance_blocks, padded_device_bytes, storage_rows

    sizes = (1_000_000, 900_000, 12_517, 633, 93_145, 5683, 800_000, 3194, 286_181, 142_572, 14_992, 700_000)
    infos = [TableInfo(f"C{i}", f"C{i}", "full", rows, 16, 1, 0) for i, rows in enumerate(sizes)]
    table = make_plan(infos, MESH, 2048, plan="table", device_memory_bytes=2**34)
    assert {p.sharding for p in table.placements} == {"table"}
    rows = storage_rows(table.placements, 16, 8)
    assert max(rows) > 1.3 * sum(rows) / 8  # whole tables: the 1M-row one alone is 2x the mean
    for exchange in ("rows", "pooled"):
        auto = make_plan(infos, MESH, 2048, overrides="C2=table:3", exchange=exchange, device_memory_bytes=2**34)
        rows = storage_rows(auto.placements, 16, 8)
        assert sum(rows) + sum(p.table.rows for p in auto.placements if p.sharding == "replicated") == sum(sizes)
        assert auto.placement("C2").devices == (3,)
        evened = {p.table.name: p for p in auto.placements}
        balance_blocks(evened, {"C2"}, MESH, "range", 2**34)
        problem = planner.runtime_problem(infos, MESH, 2048, 2**34, "range", exchange)
        model = AnalyticCostModel(problem.topology, problem.exchange)
        kept, even = (plan_cost(model, problem, placements).step
                      for placements in (auto.placements, [evened[t.name] for t in infos]))
        if max(rows) > 1.05 * sum(rows) / 8:  # kept uneven: it fits padded and evening it would be slower
            assert max(padded_device_bytes(auto.placements, MESH)) <= 2**34
            assert even > kept * (1 + planner.SPLIT_GAIN), (exchange, kept, even)
        else:
            assert even == kept


def test_padded_device_bytes_pad_each_storage_to_its_fullest_device():
    """Worked by hand: dim-16 tables A (300 rows) on device 0 and B (100) on 1, dim-8 C (200) on 1 and a
    replicated D (10 rows of dim 8) on both: the dim-16 block is 300 rows on each device, the dim-8 one 200."""
    from recjax.sharding.plan import TablePlacement, padded_device_bytes

    a, b = (TableInfo(n, n, "full", r, 16, 1, 0) for n, r in (("A", 300), ("B", 100)))
    c, d = (TableInfo(n, n, "full", r, 8, 1, 0) for n, r in (("C", 200), ("D", 10)))
    placements = [TablePlacement(a, "table", ("data", "model"), (0,)), TablePlacement(b, "table", ("data", "model"),
                                                                                          (1,)),
                  TablePlacement(c, "table", ("data", "model"), (1,)), TablePlacement(d, "replicated", (), ())]
    each = 300 * 64 + 200 * 32 + 10 * 32
    assert padded_device_bytes(placements, {"data": 2, "model": 1}) == [each, each]


def test_plan_that_cannot_fit_names_the_device_and_the_bytes():
    row_bytes = 4 * (16 + 32)
    with pytest.raises(ConfigError, match=r"sharding.plan: device 0 would hold 19,200,000 bytes .* has 19,199,952 "
                                          r".*: 48 bytes too many"):
        make_plan(tables(rows=(100_000,), bag=(1,)), MESH, 64, plan="table", device_memory_bytes=100_000 * row_bytes
                  - 48)
    with pytest.raises(ConfigError, match=r"device \d would hold"):  # too big even split over every device
        make_plan(tables(rows=(100_000,), bag=(1,)), MESH, 64, device_memory_bytes=10_000 * row_bytes)


def test_plan_overrides_and_their_errors():
    plan = make_plan(tables(), MESH, 64, plan="table", overrides="C0=row, C1=replicated,C2=table:6, C3=column",
                     device_memory_bytes=2**30)
    assert [(p.sharding, p.devices) for p in plan.placements] == [
        ("row", tuple(range(8))), ("replicated", ()), ("table", (6,)), ("column", tuple(range(8)))]
    with pytest.raises(ConfigError, match=r"sharding.tables: unknown table 'C9'"):
        make_plan(tables(), MESH, 64, overrides="C9=row", device_memory_bytes=2**30)
    with pytest.raises(ConfigError, match=r"sharding.tables: cannot read 'C1=diagonal'"):
        make_plan(tables(), MESH, 64, overrides="C1=diagonal", device_memory_bytes=2**30)
    with pytest.raises(ConfigError, match=r"sharding.tables: C1=table:8: there are only 8 devices"):
        make_plan(tables(), MESH, 64, overrides="C1=table:8", device_memory_bytes=2**30)
    with pytest.raises(ConfigError, match=r"dim 12, which 8 devices cannot split column-wise"):
        make_plan(tables(dim=12), MESH, 64, plan="column", device_memory_bytes=2**30)
    with pytest.raises(ConfigError, match="row-wise optimizer state"):
        make_plan(tables(state=1), MESH, 64, plan="column", device_memory_bytes=2**30)


def test_a_table_placed_twice_is_refused_naming_it():
    """The last entry used to win silently; each physical table now takes one entry, whether the same name is given
    twice or a feature is named beside one of its own physical tables (a feature's name covers all of them)."""
    qr = tables()[:2] + [TableInfo("C7/q", "C7", "qr", 100, 16, 1, 32), TableInfo("C7/r", "C7", "qr", 10, 16, 1, 32)]
    cases = [
        ("C1=row,C1=column", r"table 'C1' is named twice \('C1=row' and 'C1=column'\)"),
        ("C1=table:2, C1=table:2", r"table 'C1' is named twice"),  # even with the same placement
        ("C7=row,C7/q=column", r"'C7/q=column' and 'C7=row' both place physical table 'C7/q'"),
        ("C7/r=replicated,C0=row,C7=row", r"'C7/r=replicated' and 'C7=row' both place physical table 'C7/r'"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=rf"^sharding.tables: {message}"):
            make_plan(qr, MESH, 64, overrides=overrides, device_memory_bytes=2**30)
    # Distinct physical tables of one feature, each named once, are fine.
    plan = make_plan(qr, MESH, 64, overrides="C7/q=row,C7/r=replicated,C1=table:3", device_memory_bytes=2**30)
    assert [(p.sharding, p.devices) for p in plan.placements[1:]] == [
        ("table", (3,)), ("row", tuple(range(8))), ("replicated", ())]


def test_mesh_shape_and_its_errors():
    assert parse_mesh_shape("") == {}
    assert mesh_shape("", 8) == {"data": 8, "model": 1}
    assert mesh_shape("model=2", 8) == {"data": 4, "model": 2}
    assert mesh_shape(" data=2 , model=4", 8) == {"data": 2, "model": 4}
    with pytest.raises(ConfigError, match=r"mesh.shape: 'data=4,model=4' is 4 x 4 = 16 devices, but 8 are "):
        mesh_shape("data=4,model=4", 8)
    with pytest.raises(ConfigError, match=r"mesh.shape: unknown axis 'pipe'"):
        parse_mesh_shape("pipe=2")
    with pytest.raises(ConfigError, match=r"mesh.shape: cannot read 'data4'"):
        parse_mesh_shape("data4")


def test_config_errors_name_the_key():
    from experiments.configs import dlrm_synthetic
    from recjax.config_check import validate_config

    def config_with(**changes) -> ml_collections.ConfigDict:
        config = dlrm_synthetic.get_config()
        for key, value in changes.items():
            section, field = key.split("__")
            config[section][field] = value
        return config

    validate_config(config_with())
    for changes, match in [({"sharding__plan": "diagonal"}, "sharding.plan: unknown value 'diagonal'"),
                           ({"sharding__exchange_dtype": "int8"}, "sharding.exchange_dtype: unknown value"),
                           ({"sharding__exchange": "unpooled"}, "sharding.exchange: unknown value 'unpooled'"),
                           ({"sharding__row_axes": "data"}, "sharding.row_axes: unknown value"),
                           ({"mesh__shape": "data=x"}, "mesh.shape: cannot read"),
                           ({"sharding__device_memory_bytes": -1}, "sharding.device_memory_bytes: must be >= 0"),
                           ({"sharding__capacity_factor": 0.5}, r"sharding.capacity_factor: must be 0 \(always the "
                                                                r"worst case\) or >= 1, got 0.5")]:
        with pytest.raises(ConfigError, match=match):
            validate_config(config_with(**changes))


def test_one_device_runs_the_single_device_engine():
    """On one device (this pytest process) no mesh is made: the trainer's single-device steps run untouched."""
    import jax

    from recjax.sharding.mesh import make_mesh

    assert jax.device_count() == 1
    assert make_mesh("") is None
    with pytest.raises(ConfigError, match="is 2 x 1 = 2 devices, but 1 are available"):
        make_mesh("data=2")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_buckets_are_ragged_all_to_alls_on_gpu_and_tpu_and_static_on_cpu(platform):
    """The exchange's bucketed all_to_all lowers to `ragged_all_to_all` for GPU and TPU (only each bucket's filled rows
    move) and for CPU to the static all_to_all of the whole buckets (XLA:CPU cannot run the ragged one), whose result
    is the buckets, moved whole (a one-device mesh here: the device sends itself its bucket; the 8-device runs of
    tests/sharding_cases.py exercise the CPU path's exchange)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from recjax.sharding.exchange import _bucket_all_to_all

    mesh = Mesh(np.array(jax.devices()), ("x",))
    step = jax.jit(jax.shard_map(lambda x, filled: _bucket_all_to_all(x, filled, ("x",)), mesh=mesh,
                                 in_specs=(P("x"), P("x")), out_specs=P("x")))
    x = jax.device_put(jnp.arange(12, dtype=jnp.float32).reshape(1, 4, 3), NamedSharding(mesh, P("x")))
    filled = jax.device_put(jnp.array([2], jnp.int32), NamedSharding(mesh, P("x")))
    ragged = jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")
    module = jax.export.export(step, platforms=[platform], disabled_checks=[ragged])(x, filled).mlir_module()
    assert "@ragged_all_to_all" in module
    cpu = jax.export.export(step, platforms=["cpu"])(x, filled).mlir_module()
    assert "@ragged_all_to_all" not in cpu  # (a one-device all_to_all is elided: no collective is left)
    np.testing.assert_array_equal(np.asarray(step(x, filled)), np.asarray(x))


def test_plan_charges_each_device_what_its_exchange_sends_and_receives():
    """recjax/sharding/plan.py `table_exchange` against the bytes worked out by hand: 8 devices (data=4 x model=2),
    global batch 64 (b = 8 examples per device), a table of 1000 rows x dim 16 read in bags of 4 ids (32 slots per
    device), f32."""
    from recjax.sharding.plan import TablePlacement, expected_distinct, pools_on_owner, table_exchange

    mesh = {"data": 4, "model": 2}
    multi = TableInfo("C1", "C1", "full", 1000, 16, 4, 0)
    one_hot = TableInfo("C2", "C2", "full", 1000, 16, 1, 0)
    whole = TablePlacement(multi, "table", ("data", "model"), (3,))
    # Pooled, table-wise on device 3: every device gets back its 8 bags' sums (8 x 16 x 4 = 512 bytes); the owner
    # also receives every device's 32 ids (8 x 128) and 8 bag gradients (8 x 512).
    assert table_exchange(whole, mesh, 64, True) == [512.0] * 3 + [512.0 + 8 * (128 + 512)] + [512.0] * 4
    # As rows: a device asks for the distinct rows of its 32 ids and receives them; the owner receives every device's
    # distinct ids and their gradients (4 + 64 bytes each).
    a = float(expected_distinct(1000, 32))
    assert table_exchange(whole, mesh, 64, False) == pytest.approx([a * 64] * 3 + [a * 64 + 8 * a * 68] + [a * 64] * 4)
    # Row-wise over all 8 devices: each device receives 8 partial sums of its 8 bags, and as an owner of 1/8 of the
    # rows, 1/8 of every device's ids (8 x 4 x 4), every device's 8 bag counts (8 x 32) and bag gradients (8 x 512).
    split = TablePlacement(multi, "row", ("data", "model"), tuple(range(8)))
    assert table_exchange(split, mesh, 64, True) == pytest.approx([8 * 512 + 8 * (16 + 32 + 512)] * 8)
    # Column-wise: every device's 32 ids all-gathered (8 x 128), and its bags' slices out and gradients back.
    column = TablePlacement(multi, "column", ("data", "model"), tuple(range(8)))
    assert table_exchange(column, mesh, 64, True) == [8 * 128 + 2 * 512] * 8
    # auto pools the multi-hot table and keeps the one-hot one as rows (a pooled bag of one id is one row's bytes,
    # and rows are deduplicated); never a replicated table, nor a method that combines per id.
    assert pools_on_owner(whole, mesh, 64) and not pools_on_owner(TablePlacement(one_hot, "table", whole.axes, (3,)),
                                                                   mesh, 64)
    assert pools_on_owner(TablePlacement(one_hot, "table", whole.axes, (3,)), mesh, 64, "pooled")
    assert not pools_on_owner(whole, mesh, 64, "rows")
    assert not pools_on_owner(TablePlacement(multi, "replicated", (), ()), mesh, 64, "pooled")
    assert not pools_on_owner(TablePlacement(dataclasses.replace(multi, poolable=False), "table", whole.axes, (3,)),
                              mesh, 64, "pooled")
