"""Checkpoints of runs with tables on the disk tier: every checkpoint a disk-tier run writes (baselines, f32 and
quantized deltas) holds the same arrays as the in-memory run's, a disk-tier run interrupted and resumed ends
bit-identical to the uninterrupted in-memory run, a checkpoint moves between the tiers, and a restore rewrites table
files that hold rows newer than the checkpoint. The SIGKILL trials are tests/test_checkpoint_crash.py's."""

import json
import pathlib

import numpy as np
import pytest

from recjax import checkpoint
from recjax.train import train_and_evaluate

TIMING = {"examples_per_sec", "compile_time_s", "train_time_s", "wall_time_s", "peak_rss_bytes",
          "peak_rss_anon_bytes", "peak_rss_file_bytes", "loop"}
SAVES = (3, 6, 9, 12)


def tiny(optimizer: str = "lazy_adam", disk: pathlib.Path | None = None, **ckpt):
    """12 steps of 32 examples, a checkpoint every 3; with `disk`, C1 (3000 rows) and C4 (2000) on disk behind a
    cache of 100 rows (a step reads up to 64 of them: most steps evict), their files in `disk`."""
    from experiments.configs.dlrm_synthetic import get_config

    config = get_config()
    config.data.vocab_sizes = (3000, 500, 40, 2000)
    config.data.eval_examples = 256
    config.embedding.dim = 8
    config.model.dlrm.bottom_mlp = (8, 8)
    config.model.dlrm.top_mlp = (8, 1)
    config.model.dlrm.dropout = 0.1  # the dropout RNG must resume too
    config.optimizer.sparse.name = optimizer
    config.optimizer.sparse.learning_rate = 0.05
    config.train.batch_size = 32
    config.train.steps = 12
    config.train.eval_every = 6
    config.train.log_every = 3
    config.train.progress_bar = False
    config.checkpoint.every_steps = 3
    config.checkpoint.keep = 10
    config.checkpoint.policy = "consecutive"
    for key, value in ckpt.items():
        config.checkpoint[key] = value
    if disk is not None:
        config.tiering.tables = "C1=disk,C4=disk"
        config.tiering.cache_rows = 100
        config.tiering.dir = str(disk)
    return config


def interrupted(config, workdir: pathlib.Path, monkeypatch, at_step: int) -> None:
    """Run `config` in `workdir` until the save of `at_step` is done, then die (as if killed)."""
    save = checkpoint.Checkpointer.save

    def dying(self, step, state, loop, finished=False):
        out = save(self, step, state, loop, finished)
        if step == at_step:
            self.wait()
            raise KeyboardInterrupt(f"killed after the save of step {step}")
        return out

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.Checkpointer, "save", dying)
        with pytest.raises(KeyboardInterrupt):
            train_and_evaluate(config, workdir)
    assert checkpoint.open_checkpoint(workdir / "checkpoints").step == at_step


def arrays_at(workdir: pathlib.Path, step: int) -> dict[str, np.ndarray]:
    return checkpoint.read_arrays(checkpoint.open_checkpoint(workdir / "checkpoints", step))


def assert_same_checkpoints(a: pathlib.Path, b: pathlib.Path, steps=SAVES, same_chain: bool = True) -> None:
    """The restore of every step yields the same arrays, and (`same_chain`) each step wrote the same kind, chain and
    delta rows."""
    for step in steps:
        x, y = arrays_at(a, step), arrays_at(b, step)
        assert sorted(x) == sorted(y), step
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=f"step {step}: {k}", strict=True)
        if not same_chain:
            continue
        sa, sb = (checkpoint.open_checkpoint(d / "checkpoints", step) for d in (a, b))
        assert (sa.meta["kind"], sa.meta["chain"], sa.meta["tables"]) == (sb.meta["kind"], sb.meta["chain"],
                                                                          sb.meta["tables"]), step
        if sa.meta["kind"] == "delta":
            ra, rb = (p.store.item(step, "rows", p.meta) for p in (sa, sb))
            assert {g: r["ids"].tolist() for g, r in ra.items()} == {g: r["ids"].tolist() for g, r in rb.items()}


def assert_same_summary(a: pathlib.Path, b: pathlib.Path) -> None:
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    # The tier's own: its summary section, XLA's FLOPs of its step (which maps rows to cache slots), and what it holds
    # in device memory (a cache instead of the disk tables).
    drop = TIMING | {"tiering", "flops_per_example", "train_flops_per_example", "embedding_device_bytes"}
    assert {k: v for k, v in sa.items() if k not in drop} == {k: v for k, v in sb.items() if k not in drop}


@pytest.fixture(scope="module")
def memory_reference(tmp_path_factory) -> pathlib.Path:
    """The uninterrupted in-memory run (lazy Adam, consecutive deltas): the oracle of the resumes below."""
    workdir = tmp_path_factory.mktemp("tiering_ckpt") / "memory"
    train_and_evaluate(tiny(), workdir)
    return workdir


def overwrite_records(tables: pathlib.Path) -> None:
    """Every record of the disk tables' files set to 7.0, a value no row or optimizer state holds: as if the run had
    written rows of later steps to them before it died (write-backs of evicted rows), and then some."""
    files = sorted((tables / "dim8").glob("*.f32"))
    assert [f.name for f in files] == ["C1.f32", "C4.f32"]
    for f in files:
        records = np.memmap(f, np.float32, mode="r+")
        records[:] = 7.0
        records.flush()
        del records


BLOCK_ROWS = 256  # rows of the blocks of the disk-tier runs below (their group has 5,540 rows)
BLOCK_BYTES = BLOCK_ROWS * 24 * 4  # a block: 256 records of lazy Adam's 8 + 8 + 8 f32 (row, m, v)


@pytest.fixture(scope="module")
def disk_resumed(tmp_path_factory) -> pathlib.Path:
    """The same run with C1 and C4 on disk, killed after the save of step 6, its table files overwritten, resumed;
    its checkpoints written and read by blocks of BLOCK_ROWS rows. Records (in `blocks.json` beside the workdir) the
    rows of every block a save read from where the rows live (`CheckpointRows.block`) and of every chunk the restore
    read from the checkpoint (`StoredRows`)."""
    from recjax.checkpoint import streamed
    from recjax.tiering.storage import CheckpointRows

    root = tmp_path_factory.mktemp("tiering_ckpt_disk")
    saved, chunks = [], []
    save_block, restored_block = CheckpointRows.block, streamed.StoredRows.block

    def recorded_save(self, start, stop):
        saved.append(stop - start)
        return save_block(self, start, stop)

    def recorded_restore(self, start, stop):
        chunks.append(self.chunk_rows)
        assert stop - start <= self.chunk_rows  # a block within one chunk: the chunk is what is read
        return restored_block(self, start, stop)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(streamed, "BLOCK_BYTES", BLOCK_BYTES)
        monkeypatch.setattr(CheckpointRows, "block", recorded_save)
        monkeypatch.setattr(streamed.StoredRows, "block", recorded_restore)
        interrupted(tiny(disk=root / "tables"), root / "disk", monkeypatch, at_step=6)
        overwrite_records(root / "tables")
        train_and_evaluate(tiny(disk=root / "tables"), root / "disk")
    (root / "blocks.json").write_text(json.dumps({"saved": saved, "restored_chunks": chunks}))
    return root


def test_disk_tier_run_checkpoints_and_resumes_like_the_memory_run(memory_reference, disk_resumed):
    """Killed after the save of step 6 and resumed, a disk-tier run writes the in-memory run's checkpoints (the
    baseline read from the table files after the cache's dirty rows are written back; the deltas hold the rows
    touched since the previous save, by table row, though the cache evicted and re-read them in between) and ends
    with its state -- trained from the checkpoint's rows, not from its files, which held other values."""
    disk = disk_resumed / "disk"
    summary = json.loads((disk / "summary.json").read_text())
    assert summary["tiering"]["groups"]["dim8"]["evictions"] > 0  # rows left the cache between the saves
    assert_same_checkpoints(memory_reference, disk)
    assert_same_summary(memory_reference, disk)
    kinds = [checkpoint.open_checkpoint(disk / "checkpoints", s).meta["kind"] for s in SAVES]
    assert kinds == ["full", "delta", "delta", "delta"]
    # The files hold the final tables (the run closed with its cache written back): C1's rows, then lazy Adam's m, v.
    final = arrays_at(memory_reference, 12)
    records = np.fromfile(disk_resumed / "tables" / "dim8" / "C1.f32", np.float32).reshape(3000, 24)
    np.testing.assert_array_equal(records[:, :8], final["tables/dim8"][:3000])
    np.testing.assert_array_equal(records[:, 8:16], final["sparse_opt/dim8/m"][:3000])
    np.testing.assert_array_equal(records[:, 16:], final["sparse_opt/dim8/v"][:3000])


def test_disk_tier_checkpoints_are_written_and_read_by_row_blocks(memory_reference, disk_resumed):
    """A baseline of the disk tier reads its 5,540-row arrays BLOCK_ROWS rows at a time (on main: whole, through
    np.asarray), writes them as chunks of BLOCK_ROWS rows, and records the digests the in-memory run records for
    the same arrays written whole (a streamed sha256); the resume reads them back a chunk at a time."""
    blocks = json.loads((disk_resumed / "blocks.json").read_text())
    assert blocks["saved"] and max(blocks["saved"]) <= BLOCK_ROWS < 5540
    assert blocks["restored_chunks"] and set(blocks["restored_chunks"]) == {BLOCK_ROWS}
    disk, memory = (checkpoint.open_checkpoint(d / "checkpoints", 3).meta for d in (disk_resumed / "disk",
                                                                                  memory_reference))
    assert disk["kind"] == memory["kind"] == "full"
    tables = {k: v for k, v in disk["arrays"].items() if "/dim8" in k}
    assert sorted(tables) == ["state/sparse_opt/dim8/m", "state/sparse_opt/dim8/v", "state/tables/dim8"]
    assert tables == {k: memory["arrays"][k] for k in tables}  # dtype, shape, sha256


def memory_and_resumed_disk(tmp_path, monkeypatch, optimizer: str, quantized: bool,
                            **ckpt) -> tuple[pathlib.Path, pathlib.Path]:
    """(the in-memory run's workdir, the disk-tier run's): the disk-tier run killed after the save of step 6 and
    resumed; the in-memory one uninterrupted, or killed at step 6 too when the deltas are quantized (a resume then
    reads the quantized rows), so the two should write the same checkpoints and end alike."""
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    if quantized:
        interrupted(tiny(optimizer, **ckpt), memory, monkeypatch, at_step=6)
    train_and_evaluate(tiny(optimizer, **ckpt), memory)
    interrupted(tiny(optimizer, tmp_path / "tables", **ckpt), disk, monkeypatch, at_step=6)
    train_and_evaluate(tiny(optimizer, tmp_path / "tables", **ckpt), disk)
    return memory, disk


def test_rowwise_adagrad_one_shot_deltas_resume_like_the_memory_run(tmp_path, monkeypatch):
    """One-shot deltas are cumulative: after the resume the restored delta's rows must stay dirty, by table row."""
    memory, disk = memory_and_resumed_disk(tmp_path, monkeypatch, "rowwise_adagrad", False, policy="one_shot")
    assert_same_checkpoints(memory, disk)
    assert_same_summary(memory, disk)
    kinds = [checkpoint.open_checkpoint(disk / "checkpoints", s).meta["kind"] for s in SAVES]
    assert kinds == ["full", "delta", "delta", "delta"]


@pytest.mark.slow  # four runs each
@pytest.mark.parametrize("optimizer, ckpt", [
    ("rowwise_adagrad", {"quantize_bits": 8}),
    ("lazy_adam", {"policy": "intermittent", "baseline_fraction": 0.6, "quantize_optimizer_bits": 8}),
])
def test_quantized_deltas_resume_like_the_memory_run(tmp_path, monkeypatch, optimizer, ckpt):
    memory, disk = memory_and_resumed_disk(tmp_path, monkeypatch, optimizer, True, **ckpt)
    assert_same_checkpoints(memory, disk)
    assert_same_summary(memory, disk)


def test_checkpoint_moves_between_memory_and_disk(memory_reference, disk_resumed, tmp_path):
    """The checkpoint records the single-device layout whatever the tier: a disk-tier run starts from an in-memory
    run's checkpoint and an in-memory run from a disk-tier run's (`checkpoint.restore`); both end with the
    uninterrupted in-memory run's state (each starts a chain of its own: a baseline at step 9)."""
    for name, config, source in (("to_disk", tiny(disk=tmp_path / "tables"), memory_reference),
                                 ("to_memory", tiny(), disk_resumed / "disk")):
        config.checkpoint.restore = str(source / "checkpoints" / "6")
        summary = train_and_evaluate(config, tmp_path / name)
        assert summary["restored_from"]["step"] == 6
        assert_same_checkpoints(memory_reference, tmp_path / name, steps=(9, 12), same_chain=False)
        assert checkpoint.open_checkpoint(tmp_path / name / "checkpoints", 9).meta["kind"] == "full"


def test_a_run_may_change_its_tiers_when_it_resumes():
    """Its own checkpoints resume with tables moved to or from disk: `tiering.*` is a resumable change."""
    from recjax.checkpoint.config import config_dict

    memory, disk = config_dict(tiny()), config_dict(tiny(disk=pathlib.Path("/tables")))
    assert checkpoint.config_differences(memory, disk) == []
    other = tiny(disk=pathlib.Path("/tables"))
    other.embedding.dim = 16
    assert checkpoint.config_differences(memory, config_dict(other)) == ["embedding.dim"]


def test_memory_check_counts_blocks_of_the_disk_tables(monkeypatch, tmp_path):
    """A baseline writes the disk tier's group block by block, so the memory check counts the saves in multiples of
    its blocks, not of its tables (on main: every table whole, 2.5 x 531,840 bytes for async saves, refused here). By
    hand: lazy Adam's rows, m and v are 5,540 x 8 x 4 x 3 = 531,840 bytes, all in the one group that holds the disk
    tables; the state in RAM is that less the 4,900 disk rows the 100 cache slots do not hold (x 96 bytes a record):
    61,440; with blocks of 256 records (24,576 bytes; 8,192 of each array) a save holds per array the records read,
    its block cut from them and the chunk encoded from that, plus the records and block the digest reads:
    (3 + 1) x 24,576 + (2 x 3 + 1) x 8,192 = 155,648 bytes."""
    import math

    from recjax import guards, placement
    from recjax.checkpoint import streamed
    from recjax.errors import ConfigError
    from recjax.specs import DatasetSpec, FeatureSpec
    from recjax.task import build_task

    monkeypatch.setattr(streamed, "BLOCK_BYTES", BLOCK_BYTES)
    config = tiny(disk=tmp_path)
    spec = DatasetSpec(13, tuple(FeatureSpec(f"C{i + 1}", v) for i, v in enumerate(config.data.vocab_sizes)))
    task = build_task(config, spec)
    backend = placement.build(config, task)
    state, saved = 61_440, 155_648
    memory = backend.memory_bytes(task.sparse_optimizer)
    assert memory.device + memory.host == state and memory.host == 0  # the cache and C2, C3 on the (CPU) device
    assert backend.checkpoint_bytes(task.sparse_optimizer) == saved
    need = math.ceil(state * (1 + guards.MEMORY_MARGIN) + 2.5 * saved + guards.MEMORY_MARGIN_BYTES)  # async saves
    monkeypatch.setattr(guards, "host_available_bytes", lambda: need - 1)
    with pytest.raises(ConfigError, match="for async checkpoint saves"):
        guards.check_memory(config, task, backend)
    monkeypatch.setattr(guards, "host_available_bytes", lambda: need)
    guards.check_memory(config, task, backend)
    config.checkpoint.enabled = False
    monkeypatch.setattr(guards, "host_available_bytes", lambda: math.ceil(
        state * (1 + guards.MEMORY_MARGIN) + guards.MEMORY_MARGIN_BYTES))
    guards.check_memory(config, task, backend)
    backend.close()
