"""The disk storage (recjax/tiering): the cache directory against a brute-force LRU, the table files' errors,
bit-exact equality with the in-memory run for every sparse optimizer and QR, the prefetch race, and the config."""

import errno
import os

import jax
import numpy as np
import pytest
from conftest import random_batch

from experiments.configs.dlrm_synthetic import get_config
from recjax import placement, tiering
from recjax.errors import ConfigError, StorageError
from recjax.placement.tiers import TableBytes, resolve_tiers
from recjax.rss import resident
from recjax.sections import TieringSection
from recjax.specs import DatasetSpec, FeatureSpec
from recjax.step import init_state, make_predict_step, make_train_step
from recjax.task import build_task
from recjax.tiering import RowCache, RowStore
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
    layout = tiering.GroupLayout("dim4", rows=20, dim=4, resident=(), cached=(("C1", 0, 20, True),), slots=5,
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


def test_dense_sorted_rows_are_written_back_by_spans(tmp_path, monkeypatch):
    """A write-back of many sorted rows (a full cache's) patches spans of the file (a span of 7 records here), split
    over the pool's threads (a task of 16 rows at least): every row written, every row between them left as it was,
    and the per-row path for sparse or unsorted rows gives the same file."""
    from recjax.tiering import store as store_module

    monkeypatch.setattr(store_module, "_SPAN_BYTES", 7 * 3 * 4)
    monkeypatch.setattr(store_module, "_MIN_ROWS_PER_TASK", 16)
    rng = np.random.default_rng(1)
    reference = rng.normal(size=(1000, 3)).astype(np.float32)
    rows = np.sort(rng.choice(1000, 300, replace=False))  # dense: 300 of 1,000
    new = rng.normal(size=(300, 3)).astype(np.float32)
    expected = reference.copy()
    expected[rows] = new
    original, spans = store_module.TableFile._write_spans, []

    def counted(self, local, records, positions):
        spans.append(len(local))
        original(self, local, records, positions)

    monkeypatch.setattr(store_module.TableFile, "_write_spans", counted)
    for order in (np.arange(300), rng.permutation(300)):  # sorted: by spans; shuffled: row by row
        store = RowStore([("C1", 0, 1000, tmp_path)], width=3, threads=4)
        store.write_initial(0, reference)
        store.open()
        store.write(rows[order], new[order])
        np.testing.assert_array_equal(store.read_range(0, 1000), expected)
        store.close()
    assert sum(spans) == 300 and len(spans) == 4  # the sorted write only, over 4 threads


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


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_file_truncated_during_an_access_is_an_error_never_a_sigbus(tmp_path, monkeypatch, op):
    """The file is truncated after the check that precedes every access, before the rows are read or written (the
    window in which main's numpy access through a mapping died of SIGBUS): a read comes back short, a write extends
    the file again (the blocks the truncation freed stay missing); either way the store names the file."""
    from recjax.tiering import store as store_module

    store = RowStore([("C1", 0, 4000, tmp_path)], width=65, threads=1)
    store.write_initial(0, np.ones((4000, 65), np.float32))
    store.open()
    for name in ("read_rows", "write_rows"):
        original = getattr(store_module.TableFile, name)

        def truncated_first(self, *args, original=original):
            os.truncate(tmp_path / "C1.f32", 65 * 4 * 100)  # rows 0..99 survive
            return original(self, *args)

        monkeypatch.setattr(store_module.TableFile, name, truncated_first)
    rows = np.array([5, 3999, 7])
    with pytest.raises(StorageError, match=r"C1\.f32 \(table C1\) (is truncated: 26,000 bytes|was truncated: it "
                                           r"holds [0-9,]+ bytes of its 1,040,000).*resume"):
        if op == "read":
            store.read(rows)
        else:
            store.write(rows, np.zeros((3, 65), np.float32))
    store.close()


def test_initial_rows_are_written_a_page_at_a_time(tmp_path, monkeypatch):
    """No write of the initial rows crosses a page boundary: a larger one fills the page cache with large folios, each
    of which a row written back later dirties whole (benchmarks/RESULTS.md, "Disk tier: the storage engine"). The
    file holds the rows all the same."""
    writes = []
    pwrite = os.pwrite

    def recorded(fd, data, offset):
        writes.append((offset, len(data)))
        return pwrite(fd, data, offset)

    reference = np.random.default_rng(0).normal(size=(1000, 65)).astype(np.float32)
    store = RowStore([("C1", 0, 1000, tmp_path)], width=65, threads=1)
    monkeypatch.setattr(os, "pwrite", recorded)
    store.write_initial(0, reference)
    monkeypatch.undo()
    page = os.sysconf("SC_PAGE_SIZE")
    assert all(offset // page == (offset + n - 1) // page for offset, n in writes)
    assert sum(n for _, n in writes) == reference.nbytes == 260_000
    np.testing.assert_array_equal(store.read_range(0, 1000), reference)
    store.close()


def test_an_unreadable_table_file_is_an_error_naming_it_and_the_row(tmp_path, monkeypatch):
    """A read the disk fails (EIO) names the file, the table and the row, and says how to go on."""
    store = RowStore([("C1", 0, 100, tmp_path)], width=4, threads=1)
    store.write_initial(0, np.ones((100, 4), np.float32))
    store.open()

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(StorageError, match=r"C1\.f32 \(table C1\): cannot read row 42 \(Input/output error\); "
                                           "rerun the same command to resume"):
        store.read(np.array([42]))
    monkeypatch.undo()
    store.close()


def test_numpy_through_a_truncated_mapping_is_a_sigbus(tmp_path):
    """Why the store does not read through a mapping of the file: the read above, by numpy from a mapped array, kills
    the process."""
    import signal
    import subprocess
    import sys

    code = (f"import mmap, os, numpy as np\n"
            f"fd = os.open({str(tmp_path / 't.f32')!r}, os.O_RDWR | os.O_CREAT)\n"
            "os.ftruncate(fd, 1 << 20)\n"
            "m = mmap.mmap(fd, 1 << 20)\n"
            "a = np.frombuffer(m, np.float32)\n"
            "os.ftruncate(fd, 4096)\n"
            "print(a[[5, 200_000]])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert result.returncode == -signal.SIGBUS, result


def test_reads_and_write_backs_map_nothing_into_the_process(tmp_path):
    """RssFile (the file-backed pages this process maps, /proc/self/status) stays put while the store reads and writes
    back 12,000 random rows of a 10.4 MB file: its pages stay in the page cache, out of the process's RSS (a mapped
    store grew it by up to a large folio a row: most of the file here)."""
    rows, width = 40_000, 65
    reference = np.random.default_rng(0).normal(size=(rows, width)).astype(np.float32)
    picks = np.random.default_rng(1).choice(rows, 12_000, replace=False)
    store = RowStore([("C1", 0, rows, tmp_path)], width=width, threads=4)
    store.write_initial(0, reference)
    store.open()
    before = resident()["file"]
    np.testing.assert_array_equal(store.read(picks), reference[picks])
    store.write(picks[::-1], -reference[picks][::-1])
    np.testing.assert_array_equal(store.read_range(0, rows)[picks], -reference[picks])
    assert resident()["file"] - before < (1 << 20)
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


def disk_placement(config, task, tiers, cache_rows, directory, **fields):
    """The placement of `task`'s tables with `tiers` ({physical table: tier}), a cache of `cache_rows` rows per group
    and the disk tables' files in `directory`, built as a run builds it (`placement.build`)."""
    config = config.copy_and_resolve_references()
    config.train.batch_size = BATCH
    config.tiering.tables = ",".join(f"{name}={tier}" for name, tier in tiers.items())
    config.tiering.cache_rows = cache_rows
    config.tiering.dir = str(directory)
    for key, value in fields.items():
        config.tiering[key] = value
    return placement.build(config, task)


def disk_of(backend):
    """The disk storage of a placement."""
    return next(s for s in backend.storages if s.name == "disk")


def tiered_run(config, task, batches, tiers, cache_rows, directory, **fields):
    backend = disk_placement(config, task, tiers, cache_rows, directory, **fields)
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
    ("rowwise_adagrad", "full", "mixed", "auto"),  # C2 (host tier) grouped with disk tables: in a RAM store, cached
    # The accelerators' layout: bags pooled straight from the tables, so the bag slots are rows to remap too.
    ("lazy_adam", "full", "disk", "table"),
    ("rowwise_adagrad", "qr", "disk", "auto"),  # QR's quotient tables on disk, remainders in memory, one group
])
def test_tiered_run_equals_the_memory_run_bit_for_bit(optimizer, method, tier, pool_from, tmp_path, monkeypatch):
    from recjax.tiering import storage

    monkeypatch.setattr(storage, "_WRITE_BACK_ROWS", 16)  # the final write-back of the 160 cached rows in chunks
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
    cached = {name: tier == "disk" for name, tier in tiers.items() if tier != "memory"}
    layout, = tiering.plan_group_layouts(task.collection, cached, BATCH, cache_rows=160)
    assert layout.step_rows == 160
    backend, state, losses, probs = tiered_run(config, task, batches, tiers, 160, tmp_path)
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


def test_swap_updates_the_cache_in_place(tmp_path):
    """The swap's compiled computations never copy the cache array: a copy per step is O(cache) (2.1 s a step at 8M
    slots), which one computation gathering the victims and scattering the misses into the same donated array got."""
    import re

    task = build_task(tiny_config(), SPEC)
    tiers = {p.table.name: "memory" if p.table.name == "C3" else "disk" for p in task.collection.physical_tables()}
    backend = disk_placement(tiny_config(), task, tiers, 160, tmp_path)
    disk = disk_of(backend)
    state = backend.place_state(init_state(task, jax.random.key(0), random_batch(SPEC, BATCH, seed=0), backend))
    (g, layout), = disk.layouts.items()
    table, group_state = state.tables[g], state.sparse_opt_state[g]
    slots = np.arange(16, dtype=np.int32)
    records = np.zeros((16, disk.widths[g]), np.float32)
    texts = [disk._records_fn.lower(table, group_state, slots).compile().as_text(),
             disk._fill_fn.lower({g: table}, {g: group_state}, {g: slots}, {g: records}).compile().as_text()]
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

    from recjax.tiering import storage as storage_module

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
    original_queue = storage_module.DiskStorage._queue_write

    def queue_write(self, eviction):
        GatedStore.pending |= set(eviction.rows.tolist())
        original_queue(self, eviction)

    monkeypatch.setattr(storage_module, "RowStore", GatedStore)
    monkeypatch.setattr(storage_module.DiskStorage, "_queue_write", queue_write)
    backend = disk_placement(config, task, {"C1": "disk"}, BATCH, tmp_path)
    state = backend.place_state(init_state(task, jax.random.key(0), batches[0], backend))
    step = make_train_step(task, backend)
    losses = []
    for batch in batches:
        state, metrics = step(state, backend.put_batch(batch))
        losses.append(float(metrics["loss"]))
    assert disk_of(backend).stats["rows_from_evictions"] == 6 * BATCH  # steps 3..8: every row from an eviction
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


def test_disk_tier_runs_one_step_per_call(tmp_path):
    """The disk tier plans each step's rows on the host before the step, so a call runs one step: "auto" resolves to
    1 whatever the platform, and an explicit k > 1 is one line naming the key and the tier."""
    from recjax.evaluation import resolve_steps_per_call

    config = tiny_run_config(tmp_path, disk_over_bytes=20_000, cache_fraction=0.3)
    config.train.steps_per_call = 4
    with pytest.raises(ConfigError, match=r"train.steps_per_call: must be 1 with tables in the disk tier") as error:
        train_and_evaluate(config, tmp_path / "k4")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "k4" / tiering.WORKDIR_FOLDER).exists()  # the placement was closed: its files are gone
    reason = "train.steps_per_call must be 1 with tables in the disk tier: ..."
    assert resolve_steps_per_call({"steps_per_call": "auto"}, "gpu", reason) == 1
    assert resolve_steps_per_call({"steps_per_call": "auto"}, "gpu") == 32
    assert resolve_steps_per_call({"steps_per_call": 1}, "gpu", reason) == 1


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
    # The temporary table folder, in the workdir, is gone (and none went to the system's temporary directory).
    assert not (tmp_path / "disk" / tiering.WORKDIR_FOLDER).exists() and list(tmp_path.glob("recjax-tiering-*")) == []
    # The peak RSS and its split, read after the final write-back: each part's peak is at most the whole's.
    assert 0 < tiered["peak_rss_anon_bytes"] <= tiered["peak_rss_bytes"]
    assert 0 < tiered["peak_rss_file_bytes"] <= tiered["peak_rss_bytes"]


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
    rules = TieringSection(default="memory", tables="C2=host,C2/r=memory", disk_over_bytes=6_000,
                           host_over_bytes=500)
    assert resolve_tiers(tables, rules, tuple(placement.STORAGES)) == {
        "C1": "disk", "C2/q": "host", "C2/r": "memory", "C3": "host"}
    with pytest.raises(ConfigError, match="with a tier in"):
        resolve_tiers(tables, TieringSection(tables="C1=tape"), tuple(placement.STORAGES))


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
    assert list(tmp_path.rglob(tiering.WORKDIR_FOLDER)) == list(tmp_path.glob("recjax-tiering-*")) == []  # files gone
