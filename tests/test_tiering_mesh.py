"""The disk storage on a mesh (recjax/tiering/slots.py `BlockSlots`): each device block's cached rows behind its own
cache equal the in-memory mesh run bit for bit, and what it does not support is a clear ConfigError.

The mesh runs happen in a subprocess with 8 CPU devices (tests/tiering_mesh_cases.py), as tests/test_sharding.py's
do; the default suite runs one case (~45 s on a loaded machine), the rest are `slow`.
"""

import numpy as np
import pytest
from test_sharding import run_devices
from test_tiering import SPEC, BruteForceCache, tiny_config

from recjax import placement, tiering
from recjax.errors import ConfigError
from recjax.sections import read_sections
from recjax.sharding import table_infos
from recjax.sharding.exchange import mesh_arrays
from recjax.sharding.planner import make_plan
from recjax.task import build_task
from recjax.tiering import PartitionedRowCache
from recjax.tiering.slots import cache_array
from tests.tiering_mesh_cases import CASES

BATCH = 32
DEFAULT_CASE = "rowwise_adagrad-row-4x2"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiering_mesh_default")
    run_devices(out, [DEFAULT_CASE], script="tiering_mesh_cases.py")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiering_mesh")
    run_devices(out, sorted(CASES), script="tiering_mesh_cases.py")
    return out


def assert_equals_memory_mesh_run(r, case: str) -> None:
    """Losses, predictions (between steps, on batches partly outside the caches), tables, optimizer state, dense
    params and the dense optimizer state after 20 steps equal the in-memory mesh run's bit for bit; the caches hit,
    missed and wrote dirty rows back, evaluation read rows from the files, and the cache array kept its sharding."""
    keys = [k for k in r.files if k.startswith("ref_")]
    compared = {k.split("/")[0] for k in keys}
    assert compared - {"ref_opt"} == {"ref_loss", "ref_probs", "ref_table", "ref_dense", "ref_dense_opt"}
    assert ("ref_opt" in compared) == (CASES[case][0] != "sgd")  # SGD keeps no optimizer state
    for key in keys:
        np.testing.assert_array_equal(r[key[4:]], r[key], err_msg=key)
    assert r["ref_loss"][0] != r["ref_loss"][-1]  # it trained
    assert r["stats/hits"] > 0 and r["stats/writebacks"] > 0 and r["stats/eval_misses"] > 0
    assert r["stats/lookups"] == r["stats/hits"] + r["stats/misses"]
    assert r["cache_sharding_kept"]


def test_row_wise_adagrad_on_disk_equals_the_memory_mesh_run(default_run):
    assert_equals_memory_mesh_run(np.load(default_run / f"{DEFAULT_CASE}.npz"), DEFAULT_CASE)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_case_equals_the_memory_mesh_run(runs, case):
    """Row-wise Adagrad row-wise over all 8 devices, lazy Adam table-wise, SGD row-wise over the 4 model columns
    (split by modulo, each block's cache replicated over the data rows)."""
    assert_equals_memory_mesh_run(np.load(runs / f"{case}.npz"), case)


@pytest.mark.slow  # three runs on 8 devices, ~75 s
def test_checkpoints_of_a_mesh_disk_run_resume_like_the_memory_mesh_run(tmp_path):
    """A mesh run with C1 and C4 on disk (table-wise, each owner's cache evicting every step) killed after the save of
    step 6, its table files overwritten, and resumed writes the in-memory mesh run's checkpoints -- the single-device
    layout, a baseline then consecutive deltas, every array equal after the relayout of the memory run's storages --
    and ends with its summary (AUC, losses, selection)."""
    import json

    run_devices(tmp_path, ["checkpoint"], script="tiering_mesh_cases.py")
    r = np.load(tmp_path / "checkpoint.npz")
    for step in (3, 6, 9, 12):
        assert r[f"disk/kind/{step}"] == r[f"memory/kind/{step}"] == ("full" if step == 3 else "delta")
        keys = sorted(k.split("/", 1)[1] for k in r.files if k.startswith(f"memory/{step}/"))
        assert keys == sorted(k.split("/", 1)[1] for k in r.files if k.startswith(f"disk/{step}/"))
        assert any("/tables/" in k for k in keys) and any("/sparse_opt/" in k for k in keys)
        for key in keys:
            np.testing.assert_array_equal(r[f"disk/{key}"], r[f"memory/{key}"], err_msg=key, strict=True)
    memory, disk = (json.loads(str(r[f"{name}/summary"])) for name in ("memory", "disk"))
    assert disk["tiering"]["groups"]["dim8"]["evictions"] > 0  # after the resume, rows left the caches
    timing = {"examples_per_sec", "compile_time_s", "train_time_s", "wall_time_s", "peak_rss_bytes",
              "peak_rss_anon_bytes", "peak_rss_file_bytes",
              "flops_per_example", "train_flops_per_example", "tiering", "embedding_device_bytes", "loop"}
    assert {k: v for k, v in disk.items() if k not in timing} == {k: v for k, v in memory.items() if k not in timing}


# ------------------------------------------------------------------------------------------ the caches
def test_partitioned_cache_is_one_brute_force_cache_per_owner():
    """Rows go to their owner's cache; each part evicts as a brute-force LRU of its own size would, and the global
    slots are part x slots + the part's slot."""
    rng = np.random.default_rng(0)
    parts, slots = 3, 12
    owner = lambda rows: (rows % 7) % parts  # noqa: E731 (any fixed map of rows to parts)
    cache = PartitionedRowCache(200, slots, parts, owner, "lru")
    oracles = [BruteForceCache(slots, "lru") for _ in range(parts)]
    for _ in range(40):
        rows = np.unique(rng.integers(0, 200, 20))
        rows = np.concatenate([rows[owner(rows) == k][:slots] for k in range(parts)])
        plan = cache.plan(rows, dirty=True)
        for k, oracle in enumerate(oracles):
            mine = rows[owner(rows) == k]
            misses, evicted = oracle.step(mine.tolist(), dirty=True)
            assert sorted(plan.miss_rows[owner(plan.miss_rows) == k].tolist()) == sorted(misses)
            assert set(plan.evict_rows[owner(plan.evict_rows) == k].tolist()) == evicted
        assert np.all(plan.slots // slots == owner(rows))  # each row in its owner's block
        np.testing.assert_array_equal(cache.slots_of(rows), plan.slots)
        assert len(np.unique(plan.slots)) == len(rows)
    assert cache.lookups == cache.hits + cache.misses and cache.writebacks > 0


# ------------------------------------------------------------------------------------------ what is refused
def mesh_layouts(overrides: str, cache_rows: int, optimizer: str = "rowwise_adagrad", **plan_options):
    """plan_block_layouts for the tiny tables on a data=4 x model=2 mesh (no devices needed: the plan is data)."""
    task = build_task(tiny_config(optimizer), SPEC)
    plan = make_plan(table_infos(task.collection, task.sparse_optimizer), {"data": 4, "model": 2}, BATCH,
                     plan="row", overrides=overrides, device_memory_bytes=1 << 40, **plan_options)
    cached = {"C1": True, "C2": True, "C4": True}  # C3 stays in memory
    return task, plan, tiering.plan_block_layouts(task.collection, cached, plan, BATCH, cache_rows=cache_rows)


def test_mesh_cache_holds_one_step_per_device():
    """By hand: row-wise over 8 devices, the most distinct rows a batch of 32 can bring one device is min(375, 32) of
    C1 + min(63, 96) of C2 + min(250, 32) of C4 = 127, and a device owns 375 + 63 + 250 = 688 cached rows. The last
    device holds 59 rows of C2 (500 in chunks of 63), so a step reads at most 7 x 127 + 123 = 1012 cached rows."""
    task, plan, (layout,) = mesh_layouts("", 127)
    assert layout.slots == 127 and layout.step_rows == 1012
    with pytest.raises(ConfigError, match="cannot hold the 127 distinct rows") as error:
        mesh_layouts("", 126)
    assert error.value.key == "tiering.cache_rows"
    with pytest.raises(ConfigError, match="holds all 688 rows"):
        mesh_layouts("", 688)
    # The cache array: 8 blocks of 127 virtual rows after the group's 5540 stacked rows, located at their owner.
    arrays = mesh_arrays(task.collection, plan)
    holder, = (s for s in arrays.values() if s.kind == "sharded")
    cache = cache_array(holder, np.array([True, True, False, True]), 127)
    member, owner, local = cache.locate(np.array([5539, 5540, 5540 + 127 * 3 + 5, 5540 + 8 * 127]), xp=np)
    np.testing.assert_array_equal(member, [False, True, True, False])
    np.testing.assert_array_equal(owner[member], [0, 3])
    np.testing.assert_array_equal(local[member], [0, 5])


@pytest.mark.parametrize("overrides,message", [
    ("C1=column", "table 'C1' is on the disk / host tier and placed column-wise"),
    ("C4=replicated", "table 'C4' is on the disk / host tier and placed replicated"),
])
def test_cached_tables_placed_column_wise_or_replicated_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        mesh_layouts(overrides, 127, "adagrad")  # column-wise needs element-wise optimizer state
    assert error.value.key == "sharding.tables"


def test_cached_tables_of_one_group_split_over_different_axes_are_refused():
    with pytest.raises(ConfigError, match="split over different mesh axes") as error:
        mesh_layouts("C1=table:3", 200, row_axes="model")  # C1 on one device, C2 and C4 over the model axis
    assert error.value.key == "sharding.tables"


def test_auto_plans_pin_the_cached_tables_row_wise():
    """Under sharding.plan=auto the cached tables the user did not place are pinned row-wise (the planner would weigh
    column-wise and replicated placements too); the user's placements and any other plan are left alone."""
    task = build_task(tiny_config(), SPEC)
    config = tiny_config()
    config.sharding.plan = "auto"
    config.sharding.tables = "C2=table:1"
    sections = read_sections(config)
    assert placement.row_wise_overrides(sections.sharding, task.collection, ["C1", "C2", "C4"]) == \
        "C2=table:1,C1=row,C4=row"
    config.sharding.plan = "table"
    assert placement.row_wise_overrides(read_sections(config).sharding, task.collection, ["C1"]) == "C2=table:1"


class _BlockLayout:
    """A mesh layout's answers about caches (`cache_layouts`, `cache_slots`), for the plan of `mesh_layouts`: what
    the disk storage asks a layout, without devices."""

    def __init__(self, task, plan):
        self.task, self.plan = task, plan

    def cache_layouts(self, cached, batch_size, fraction, rows):
        return tiering.plan_block_layouts(self.task.collection, cached, self.plan, batch_size, fraction, rows)

    def cache_slots(self, layouts):
        arrays = mesh_arrays(self.task.collection, self.plan)
        holder, = (s for s in arrays.values() if s.kind == "sharded")
        return {g.name: tiering.slots.BlockSlots(g, holder, {**arrays, f"{g.name}/cache": cache_array(
            holder, np.array([True, True, False, True]), g.slots)}, None) for g in layouts}


def test_multi_process_and_static_policy_on_a_mesh_are_refused(monkeypatch, tmp_path):
    task, plan, _ = mesh_layouts("", 127)
    config = tiny_config()
    config.tiering.tables = "C1=disk,C2=disk,C4=disk"
    config.tiering.cache_rows = 127
    config.tiering.dir = str(tmp_path)
    config.tiering.policy = "static"
    sections = read_sections(config)
    tiers = {"C1": "disk", "C2": "disk", "C3": "memory", "C4": "disk"}
    context = placement.Context(task.sparse_optimizer, _BlockLayout(task, plan), sections.tiering, BATCH, tiers)
    with pytest.raises(ConfigError, match="not supported on a mesh") as error:
        tiering.DiskStorage(task.collection, ["dim8"], context)
    assert error.value.key == "tiering.policy"
    monkeypatch.setattr(tiering.storage.jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match="runs in one process only") as error:
        tiering.DiskStorage(task.collection, ["dim8"], context)
    assert error.value.key == "mesh.shape"
