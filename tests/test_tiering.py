"""The disk / host tier (recjax/tiering): the cache directory against a brute-force LRU, the table files' errors,
bit-exact equality with the in-memory run for every sparse optimizer and QR, the prefetch race, and the config."""

import errno
import os

import jax
import numpy as np
import pytest
from conftest import random_batch

from experiments.configs.dlrm_synthetic import get_config
from recjax import tiering
from recjax.errors import ConfigError, StorageError
from recjax.specs import DatasetSpec, FeatureSpec
from recjax.step import init_state, make_predict_step, make_train_step
from recjax.task import build_task
from recjax.tiering import RowCache, RowStore
from recjax.tiering.tiers import TableBytes, resolve_tiers
from recjax.train import train_and_evaluate

BATCH = 32


# ------------------------------------------------------------------------------------------- the cache directory
class BruteForceCache:
    """A dict of rows with the cache's semantics, by sorting: a step's rows are all in the cache after it; victims are
    the rows the step does not ask for with the least (lru) last use, (lfu) uses since they came in, then last use --
    ties within a step by the order asked; a row a train step asked for is dirty until it leaves."""

    def __init__(self, size: int, policy: str):
        self.size, self.policy, self.tick = size, policy, 0
        self.rows: dict[int, list[int]] = {}  # row -> [uses, last use, position in that step]
        self.dirty: set[int] = set()

    def step(self, rows, dirty: bool):
        self.tick += 1
        asked = set(rows)
        for i, r in enumerate(rows):
            if r in self.rows:
                self.rows[r] = [self.rows[r][0] + 1, self.tick, i]
        misses = [r for r in rows if r not in self.rows]
        key = (lambda r: self.rows[r][1:]) if self.policy == "lru" else (lambda r: self.rows[r])
        candidates = sorted((r for r in self.rows if r not in asked), key=key)
        victims = candidates[: max(0, len(misses) - (self.size - len(self.rows)))]
        evicted_dirty = {r for r in victims if r in self.dirty}
        for r in victims:
            del self.rows[r]
            self.dirty.discard(r)
        for i, r in enumerate(rows):
            if r in misses:
                self.rows[r] = [1, self.tick, i]
        if dirty:
            self.dirty |= asked
        return misses, evicted_dirty


def zipf_steps(rng, rows: int, steps: int, per_step: int, exponent: float = 1.1):
    p = 1.0 / np.arange(1, rows + 1) ** exponent
    p /= p.sum()
    perm = rng.permutation(rows)
    return [np.unique(perm[rng.choice(rows, per_step, p=p)]) for _ in range(steps)]


def check_consistent(cache: RowCache) -> None:
    held = cache.row_of_slot >= 0
    np.testing.assert_array_equal(cache.slot_of_row[cache.row_of_slot[held]], np.flatnonzero(held))
    assert (cache.slot_of_row >= 0).sum() == held.sum()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_plan_matches_a_brute_force_cache(policy):
    rng = np.random.default_rng(0)
    cache, oracle = RowCache(rows=500, slots=60, policy=policy), BruteForceCache(60, policy)
    for i, rows in enumerate(zipf_steps(rng, 500, 300, 40)):
        rows = rng.permutation(rows)  # the order asked breaks ties
        dirty = i % 3 != 0  # some prediction-like steps that dirty nothing
        plan = cache.plan(rows, dirty=dirty)
        misses, evicted_dirty = oracle.step(list(rows), dirty)
        np.testing.assert_array_equal(plan.miss_rows, misses)
        assert set(cache.row_of_slot[cache.row_of_slot >= 0]) == set(oracle.rows)
        assert set(plan.evict_rows) == evicted_dirty
        np.testing.assert_array_equal(cache.row_of_slot[plan.slots], rows)  # every asked row is in its slot
        assert set(plan.miss_slots) <= set(plan.slots)
        check_consistent(cache)
    assert cache.evictions > 0 and cache.writebacks > 0 and cache._log_size <= 4 * 60 + 4 * 40


@pytest.mark.parametrize("policy", ["lru", "lfu", "static"])
def test_victims_are_never_rows_of_the_step_or_pinned(policy):
    rng = np.random.default_rng(1)
    pinned = np.array([3, 7, 11]) if policy == "static" else None
    cache = RowCache(rows=300, slots=50, policy=policy, pinned=pinned)
    for rows in zipf_steps(rng, 300, 200, 40):
        before = cache.row_of_slot.copy()
        plan = cache.plan(rows, dirty=True)
        left = set(before[plan.miss_slots][before[plan.miss_slots] >= 0])
        assert not left & set(rows)  # nothing the step asked for left
        np.testing.assert_array_equal(cache.row_of_slot[plan.slots], rows)
        if pinned is not None:
            np.testing.assert_array_equal(cache.row_of_slot[:3], pinned)
        check_consistent(cache)
    assert cache.hits + cache.misses == cache.lookups and cache.evictions > 0


def test_lfu_evicts_the_least_used_row():
    cache = RowCache(rows=10, slots=3, policy="lfu")
    for rows in ([0, 1, 2], [0, 2], [0, 2], [0], [2]):  # uses: row 0 four times, row 1 once, row 2 four times
        cache.plan(np.array(rows), dirty=False)
    plan = cache.plan(np.array([5]), dirty=False)
    assert list(plan.miss_rows) == [5] and cache.slot_of_row[1] == -1  # by hand: row 1 is the least used
    cache.plan(np.array([5]), dirty=False)
    cache.plan(np.array([5]), dirty=False)  # row 5: 3 uses; rows 0 / 2: 4 uses, row 0 less recent
    cache.plan(np.array([6]), dirty=False)
    assert cache.slot_of_row[5] == -1 and cache.slot_of_row[0] >= 0 and cache.slot_of_row[2] >= 0


def test_cache_too_small_for_a_step_is_an_error():
    cache = RowCache(rows=100, slots=5)
    with pytest.raises(RuntimeError, match="cannot take"):
        cache.plan(np.arange(6), dirty=False)


def test_static_hot_set_is_the_most_read_rows():
    layout = tiering.GroupLayout("dim4", rows=20, dim=4, resident=(), cached=(("C1", 0, 20, "disk"),), slots=5,
                                 step_rows=2)
    batches = [np.array([1, 2, 20]), np.array([2, 3, 20]), np.array([2, 3, 9]), np.array([9, 17, 20])]  # 20: sentinel
    hot = tiering.profile_hot_rows(lambda b: {"dim4": b}, batches, [layout], count=4)
    # By hand: row 2 in 3 batches, rows 3 and 9 in 2; 5 slots - 2 for a step = 3 pinned.
    np.testing.assert_array_equal(hot["dim4"], [2, 3, 9])


# ---------------------------------------------------------------------------------------------- table files
def test_store_reads_and_writes_rows_across_tables(tmp_path):
    store = RowStore([("C1", 0, 100, tmp_path), ("C2", 100, 30, None), ("C3", 130, 50, tmp_path)], width=3,
                     threads=4)
    reference = np.random.default_rng(0).normal(size=(180, 3)).astype(np.float32)
    store.write_initial(0, reference[:130])
    store.write_initial(130, reference[130:])
    store.open()
    rows = np.array([179, 0, 101, 64, 130, 99])
    np.testing.assert_array_equal(store.read(rows), reference[rows])
    new = -np.arange(18, dtype=np.float32).reshape(6, 3)
    store.write(rows, new)
    reference[rows] = new
    np.testing.assert_array_equal(store.read_range(0, 180), reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["C1.f32", "C3.f32"]
    assert (tmp_path / "C3.f32").stat().st_size == 50 * 3 * 4
    store.close()


def test_truncated_or_missing_table_file_is_an_error_naming_it(tmp_path):
    store = RowStore([("C1", 0, 1000, tmp_path)], width=4)
    store.write_initial(0, np.ones((1000, 4), np.float32))
    store.open()
    os.truncate(tmp_path / "C1.f32", 4000)
    with pytest.raises(StorageError, match=r"C1\.f32.*truncated: 4,000 bytes.*16,000"):
        store.read(np.array([999]))
    store.close()
    store = RowStore([("C2/q", 0, 10, tmp_path)], width=4)
    store.write_initial(0, np.ones((10, 4), np.float32))
    store.open()
    (tmp_path / "C2.q.f32").unlink()
    with pytest.raises(StorageError, match=r"C2\.q\.f32 \(table C2/q\) is missing"):
        store.write(np.array([1]), np.zeros((1, 4), np.float32))
    store.close()


def test_full_disk_is_an_error_naming_the_file(tmp_path, monkeypatch):
    def no_space(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(StorageError, match=r"C7\.f32 \(table C7\): the disk is full.*needs 8,000 bytes"):
        RowStore([("C7", 0, 500, tmp_path)], width=4)
    monkeypatch.undo()
    store = RowStore([("C7", 0, 500, tmp_path)], width=4)
    monkeypatch.setattr(os, "pwrite", no_space)
    with pytest.raises(StorageError, match=r"C7\.f32 \(table C7\): the disk is full"):
        store.write_initial(0, np.ones((500, 4), np.float32))
    store.close()


# ----------------------------------------------------------------------------------- equality with memory
SPEC = DatasetSpec(num_dense=13, features=(FeatureSpec("C1", 3000), FeatureSpec("C2", 500, bag_size=3),
                                           FeatureSpec("C3", 40), FeatureSpec("C4", 2000)))


def tiny_config(optimizer: str = "rowwise_adagrad", method: str = "full"):
    config = get_config()
    config.embedding.dim = 8
    config.embedding.method = method
    if method == "qr":
        config.embedding.options.collisions = 4
        config.embedding.options.threshold = 100  # C3 stays full
    config.model.dlrm.bottom_mlp = (8, 8)
    config.model.dlrm.top_mlp = (8, 1)
    config.optimizer.sparse.name = optimizer
    config.optimizer.sparse.learning_rate = 0.05
    config.optimizer.sparse.weight_decay = 1e-3 if optimizer == "lazy_adam" else 0.0
    return config


def batches_with_returning_rows(count: int = 10):
    """Random batches, then the first four again: rows leave the small cache and come back."""
    batches = [random_batch(SPEC, BATCH, seed=i) for i in range(count)]
    return batches + batches[:4]


def memory_run(task, batches):
    state = init_state(task, jax.random.key(0), batches[0])
    step, predict = make_train_step(task), make_predict_step(task)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses, np.asarray(predict(state, batches[1]))


def tiered_run(task, batches, tiers, cache_rows, directory, **kwargs):
    layouts = tiering.plan_layouts(task.collection, tiers, BATCH, cache_rows=cache_rows)
    backend = tiering.TieredEmbedding(task.collection, task.sparse_optimizer, layouts, directory, **kwargs)
    first = backend.put_batch(batches[0])
    state = backend.place_state(init_state(task, jax.random.key(0), batches[0], backend))
    step = make_train_step(task, backend).lower(state, first).compile()
    predict = make_predict_step(task, backend).lower(state, first).compile()
    losses = []
    for batch in batches:
        state, metrics = step(state, backend.put_batch(batch))
        losses.append(float(metrics["loss"]))
    probs = np.asarray(predict(state, backend.put_batch(batches[1])))
    return backend, state, losses, probs


def assert_same_state(expected, got):
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("optimizer,method,tier,pool_from", [
    ("sgd", "full", "disk", "auto"),  # multi-hot C2 with plain SGD: no dedup, every bag slot remapped to its slot
    # Per-element [R, D] state moving with its rows through the cache: lazy_adam's two moments below prove it too.
    pytest.param("adagrad", "full", "disk", "auto", marks=pytest.mark.slow),
    ("rowwise_adagrad", "full", "mixed", "auto"),  # C2 in the host tier's RAM store (on an accelerator; forced here)
    # The accelerators' layout: bags pooled straight from the tables, so the bag slots are rows to remap too.
    ("lazy_adam", "full", "disk", "table"),
    ("rowwise_adagrad", "qr", "disk", "auto"),  # QR's quotient tables on disk, remainders in memory, one group
])
def test_tiered_run_equals_the_memory_run_bit_for_bit(optimizer, method, tier, pool_from, tmp_path):
    config = tiny_config(optimizer, method)
    config.embedding.pool_from = pool_from
    task = build_task(config, SPEC)
    assert task.collection.pool_from == ("table" if pool_from == "table" else "distinct_rows")
    batches = batches_with_returning_rows()
    expected, expected_losses, expected_probs = memory_run(task, batches)
    names = [p.table.name for p in task.collection.physical_tables()]
    if method == "qr":
        tiers = {n: "disk" if n.endswith("/q") else "memory" for n in names}
    else:
        tiers = {n: "memory" if n == "C3" else "host" if tier == "mixed" and n == "C2" else "disk" for n in names}
    # The smallest cache that holds a step, so every step evicts most of what the previous one used. By hand: a step
    # reads at most 32 rows of C1 (or C1/q), 32 x 3 of C2 and 32 of C4.
    layout, = tiering.plan_layouts(task.collection, tiers, BATCH, cache_rows=160)
    assert layout.step_rows == 160
    backend, state, losses, probs = tiered_run(task, batches, tiers, 160, tmp_path)
    assert losses == expected_losses
    np.testing.assert_array_equal(probs, expected_probs)
    assert_same_state(expected, backend.local_state(state))
    stats = backend.summary()["tiering"]["groups"]
    assert all(g["writebacks"] > 0 and g["hits"] > 0 for g in stats.values())
    backend.close()
    # A directory it was given keeps the files, holding the final rows: C1's (or C1/q's) row then its state.
    name = "C1/q" if method == "qr" else "C1"
    p = next(p for p in task.collection.physical_tables() if p.table.name == name)
    files = sorted(f.name for f in (tmp_path / p.group).iterdir())
    assert files == (["C1.q.f32", "C2.q.f32", "C4.q.f32"] if method == "qr" else
                     ["C1.f32", "C4.f32"] if tier == "mixed" else ["C1.f32", "C2.f32", "C4.f32"])
    state_fields = expected.sparse_opt_state[p.group]
    records = np.fromfile(tmp_path / p.group / files[0], np.float32).reshape(p.table.rows, -1)
    rows = slice(p.offset, p.offset + p.table.rows)
    np.testing.assert_array_equal(records[:, :8], expected.tables[p.group][rows])
    np.testing.assert_array_equal(records[:, 8:], np.concatenate(
        [np.asarray(state_fields[k][rows]).reshape(p.table.rows, -1) for k in sorted(state_fields)] or
        [np.zeros((p.table.rows, 0), np.float32)], axis=1))


@pytest.mark.parametrize("optimizer,pool_from", [
    ("rowwise_adagrad", "auto"),
    # The union plan is the same whatever the route: these two prove the bag slots remapped (pooling from the
    # tables) and the no-dedup route's per-step key lookups under it.
    pytest.param("lazy_adam", "table", marks=pytest.mark.slow), pytest.param("sgd", "auto", marks=pytest.mark.slow)])
def test_k_steps_per_call_on_disk_equal_the_memory_run(optimizer, pool_from, tmp_path):
    """Two steps per call (recjax/step.py's scan): the cache takes the union of a call's two batches' rows in one plan
    and one swap, and holds them for the call; the losses and every table, optimizer and dense value equal the
    in-memory run's (one step per call) bit for bit. Plain SGD on the multi-hot C2: no dedup, each step looks its
    stacked rows up in its own `cache_keys`."""
    from recjax.data.pipeline import stack

    config = tiny_config(optimizer)
    config.embedding.pool_from = pool_from
    task = build_task(config, SPEC)
    batches = batches_with_returning_rows()  # 14: seven calls of two
    expected, expected_losses, _ = memory_run(task, batches)
    tiers = {p.table.name: "memory" if p.table.name == "C3" else "disk" for p in task.collection.physical_tables()}
    # By hand: a call of 2 x 32 examples reads at most 64 rows of C1, 64 x 3 of C2 and 64 of C4: 320 (one step: 160).
    layout, = tiering.plan_layouts(task.collection, tiers, BATCH, cache_rows=320, steps_per_call=2)
    assert layout.step_rows == 320
    with pytest.raises(ConfigError, match=r"one call of 2 steps of 32 examples \(train.steps_per_call\)"):
        tiering.plan_layouts(task.collection, tiers, BATCH, cache_rows=319, steps_per_call=2)
    backend = tiering.TieredEmbedding(task.collection, task.sparse_optimizer, [layout], tmp_path)
    state = backend.place_state(init_state(task, jax.random.key(0), batches[0], backend))
    blocks = [stack(batches[i: i + 2]) for i in range(0, len(batches), 2)]
    step = make_train_step(task, backend, state, steps_per_call=2).lower(
        state, backend.put_batch(blocks[0], stacked=True)).compile()
    losses = []
    for block in blocks:
        state, metrics = step(state, backend.put_batch(block, stacked=True))
        losses += np.asarray(metrics["loss"]).tolist()
    assert losses == expected_losses
    assert_same_state(expected, backend.local_state(state))
    stats = backend.summary()["tiering"]
    assert stats["steps"] == 14 and all(g["writebacks"] > 0 and g["hits"] > 0 for g in stats["groups"].values())
    backend.close()


def test_swap_updates_the_cache_in_place(tmp_path):
    """The swap's compiled computations never copy the cache array: a copy per step is O(cache) (2.1 s a step at 8M
    slots), which one computation gathering the victims and scattering the misses into the same donated array got."""
    import re

    task = build_task(tiny_config(), SPEC)
    tiers = {p.table.name: "memory" if p.table.name == "C3" else "disk" for p in task.collection.physical_tables()}
    layouts = tiering.plan_layouts(task.collection, tiers, BATCH, cache_rows=160)
    backend = tiering.TieredEmbedding(task.collection, task.sparse_optimizer, layouts, tmp_path)
    state = backend.place_state(init_state(task, jax.random.key(0), random_batch(SPEC, BATCH, seed=0), backend))
    (g, layout), = backend.layouts.items()
    table, group_state = state.tables[g], state.sparse_opt_state[g]
    slots = np.arange(16, dtype=np.int32)
    records = np.zeros((16, backend.widths[g]), np.float32)
    texts = [backend._records_fn.lower(table, group_state, slots).compile().as_text(),
             backend._fill_fn.lower({g: table}, {g: group_state}, {g: slots}, {g: records}).compile().as_text()]
    cache_shapes = {f"f32[{layout.device_rows},{layout.dim}]", f"f32[{layout.device_rows}]"}
    for text in texts:
        copies = re.findall(r"= (f32\[[0-9,]*\])[^ ]* copy\(", text)
        assert not cache_shapes & set(copies), copies
    backend.close()


class GatedStore(RowStore):
    """A store whose write-backs wait for the test (so evictions stay pending while later steps need their rows) and
    that checks no row is read while a write-back of it is pending."""

    gate = None
    pending: set = set()

    def write(self, rows, records):
        self.gate.wait()
        super().write(rows, records)
        GatedStore.pending -= set(rows.tolist())

    def read(self, rows):
        assert not GatedStore.pending & set(rows.tolist()), "read a row whose write-back is pending"
        return super().read(rows)


def test_prefetch_race_rows_are_never_stale_nor_evicted_before_use(tmp_path, monkeypatch):
    """Steps alternate between two sets of rows, and the cache holds exactly one step's rows: the misses of step i + 1
    are planned (and their victims chosen: all of them rows step i reads and updates) before step i has run, and
    step i + 2 asks again for the rows step i + 1 evicted while their write-back is held back. Equal to the memory run
    only if step i read its rows before their slots were refilled, the swap read step i's updates out, and step i + 2
    got them from the pending eviction, never from the (stale) file."""
    import threading

    from recjax.tiering import backend as backend_module

    spec = DatasetSpec(num_dense=13, features=(FeatureSpec("C1", 1000),))
    config = tiny_config("lazy_adam")
    task = build_task(config, spec)
    rng = np.random.default_rng(3)
    sets = [rng.choice(500, BATCH, replace=False), 500 + rng.choice(500, BATCH, replace=False)]
    batches = []
    for i in range(8):
        batch = random_batch(spec, BATCH, seed=i)
        batches.append(batch.replace(ids={"C1": sets[i % 2][:, None].astype(np.int32)}))
    expected, expected_losses, _ = memory_run(task, batches)

    gate = threading.Event()
    GatedStore.gate, GatedStore.pending = gate, set()
    original_queue = backend_module.TieredEmbedding._queue_write

    def queue_write(self, eviction):
        GatedStore.pending |= set(eviction.rows.tolist())
        original_queue(self, eviction)

    monkeypatch.setattr(backend_module, "RowStore", GatedStore)
    monkeypatch.setattr(backend_module.TieredEmbedding, "_queue_write", queue_write)
    layouts = tiering.plan_layouts(task.collection, {"C1": "disk"}, BATCH, cache_rows=BATCH)
    backend = tiering.TieredEmbedding(task.collection, task.sparse_optimizer, layouts, tmp_path)
    state = backend.place_state(init_state(task, jax.random.key(0), batches[0], backend))
    step = make_train_step(task, backend)
    losses = []
    for batch in batches:
        state, metrics = step(state, backend.put_batch(batch))
        losses.append(float(metrics["loss"]))
    assert backend.stats["rows_from_evictions"] == 6 * BATCH  # steps 3..8 read every row from a pending eviction
    gate.set()
    assert losses == expected_losses
    assert_same_state(expected, backend.local_state(state))
    backend.close()


# ---------------------------------------------------------------------------------------- config and runs
def tiny_run_config(tmp_path, **tiering_fields):
    config = tiny_config("rowwise_adagrad")
    config.data.vocab_sizes = (3000, 500, 40, 2000)
    config.data.eval_examples = 256
    config.train.batch_size = BATCH
    config.train.steps = 12
    config.train.eval_every = 6
    config.train.log_every = 6
    config.train.progress_bar = False
    config.checkpoint.enabled = False
    for key, value in tiering_fields.items():
        config.tiering[key] = value
    return config


def test_train_and_evaluate_on_disk_equals_memory(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the run's temporary table directory goes
    memory = train_and_evaluate(tiny_run_config(tmp_path), tmp_path / "memory")
    tiered = train_and_evaluate(tiny_run_config(tmp_path, disk_over_bytes=20_000, cache_fraction=0.3,
                                                policy="static", profile_batches=3), tmp_path / "disk")
    for key in ("auc", "logloss", "final_train_loss", "selected_step"):
        assert tiered[key] == memory[key], key
    groups = tiered["tiering"]["groups"]
    # By hand: 36 bytes a row (8 floats and a row-wise accumulator), so C1 (3000 rows) and C4 (2000) are over 20,000
    # bytes and C2 (500 rows, 18,000 bytes) is not.
    assert groups["dim8"]["tables"] == {"C1": "disk", "C4": "disk"} and groups["dim8"]["cache_slots"] == 1500
    assert groups["dim8"]["hits"] > 0
    assert list(tmp_path.glob("recjax-tiering-*")) == []  # the temporary table directory is gone
    # Four steps per call (4, 1, 1 to each log / eval point at 6 and 12), the cache sized for a call: the same run.
    config = tiny_run_config(tmp_path, disk_over_bytes=20_000, cache_fraction=0.3)
    config.train.steps_per_call = 4
    called = train_and_evaluate(config, tmp_path / "disk4")
    for key in ("auc", "logloss", "final_train_loss", "selected_step"):
        assert called[key] == memory[key], key
    assert called["loop"]["calls"] == 6 and called["tiering"]["steps"] == 12


@pytest.mark.parametrize("fields,key,message", [
    ({"tables": "C1=tape"}, "tiering.tables", "cannot read 'C1=tape'"),
    ({"policy": "fifo"}, "tiering.policy", "unknown value 'fifo'"),
    ({"cache_fraction": 1.5}, "tiering.cache_fraction", "must be < 1.0"),
])
def test_bad_tiering_config_is_a_clear_error(tmp_path, fields, key, message):
    config = tiny_run_config(tmp_path, **fields)
    with pytest.raises(ConfigError, match=message) as error:
        train_and_evaluate(config, tmp_path)
    assert error.value.key == key


def test_tables_the_tier_cannot_serve_are_clear_errors(tmp_path):
    config = tiny_run_config(tmp_path, tables="C9=disk")
    with pytest.raises(ConfigError, match="unknown table 'C9'"):
        train_and_evaluate(config, tmp_path / "a")
    with pytest.raises(ConfigError, match="cannot hold the 32 distinct rows") as error:
        train_and_evaluate(tiny_run_config(tmp_path, tables="C1=disk", cache_rows=31), tmp_path / "b")
    assert error.value.key == "tiering.cache_rows"
    with pytest.raises(ConfigError, match="holds all 3,000 rows"):
        train_and_evaluate(tiny_run_config(tmp_path, tables="C1=disk", cache_rows=3000), tmp_path / "c")
    config = tiny_run_config(tmp_path, tables="C1=disk")
    config.embedding.method = "fiited"
    with pytest.raises(ConfigError, match="dynamic method"):
        train_and_evaluate(config, tmp_path / "d")


def test_tier_rules():
    tables = [TableBytes("C1", "C1", 10_000), TableBytes("C2/q", "C2", 5_000), TableBytes("C2/r", "C2", 100),
              TableBytes("C3", "C3", 700)]
    rules = {"default": "memory", "tables": "C2=host,C2/r=memory", "disk_over_bytes": 6_000, "host_over_bytes": 500}
    assert resolve_tiers(tables, rules, "gpu") == {"C1": "disk", "C2/q": "host", "C2/r": "memory", "C3": "host"}
    # On a CPU host RAM is the device's memory.
    assert resolve_tiers(tables, rules, "cpu") == {"C1": "disk", "C2/q": "memory", "C2/r": "memory", "C3": "memory"}


# ------------------------------------------------------------------------------------------------ notebook
@pytest.mark.slow
def test_compress_or_offload_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    import json
    import pathlib
    import tempfile

    from conftest import run_notebook

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the kernel inherits TMPDIR below
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    path = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "notebooks" / "compress_or_offload.ipynb"
    notebook = run_notebook(path, tmp_path, monkeypatch)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs)
    assert any("image/png" in o.get("data", {}) for o in outputs), "the notebook shows no plot"
    results = json.loads((tmp_path / "compress_or_offload.json").read_text())
    arms = {a["arm"]: a for a in results["arms"]}
    assert sorted(arms) == ["fiited in RAM", "full", "full, disk tier", "md in RAM", "qr in RAM", "tt in RAM"]
    # The offload arm is the full model (bit-exact), in at most the budget of fast memory; the full model is 4x it.
    assert arms["full, disk tier"]["auc"] == arms["full"]["auc"]
    assert arms["full, disk tier"]["fast_bytes"] <= results["budget_bytes"] < arms["full"]["fast_bytes"]
    assert list(tmp_path.glob("recjax-tiering-*")) == []  # the run's table files are gone
