"""A disk-tier run whose table file is truncated or removed, or whose disk fills up, while it trains or saves a
checkpoint: the launcher prints one `error:` line naming the file (or the checkpoint directory, the bytes it needs
and the bytes free) and exits with status 2 -- no traceback, no log of Orbax's threads, nothing left running --, the
previous checkpoint stays complete and intact, no partial checkpoint is left, and rerunning the same command resumes
from it to the uninterrupted run's state, bit for bit (tests/fault_driver.py injects each fault at a set moment; a
real full disk is a small tmpfs where this process may mount one)."""

import os
import pathlib
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest
from conftest import HANG_GUARD_S

from recjax import checkpoint

DRIVER = pathlib.Path(__file__).with_name("fault_driver.py")

# 12 steps of 64 examples, a baseline checkpoint every 3 steps (each save reads the disk tables), C3 (1,000 rows) and
# C5 (3,000) on disk behind a cache of 130 rows: a step reads up to 128, so each step evicts the last one's rows.
ARGS = ["--config.data.vocab_sizes=200,50,1000,8,3000,20", "--config.embedding.dim=8",
        "--config.model.dlrm.bottom_mlp=16,8", "--config.model.dlrm.top_mlp=16,1", "--config.model.dlrm.dropout=0.1",
        "--config.train.batch_size=64", "--config.train.steps=12", "--config.train.eval_every=6",
        "--config.train.log_every=3", "--config.train.progress_bar=False", "--config.data.eval_examples=512",
        "--config.checkpoint.every_steps=3", "--config.checkpoint.policy=full",
        "--config.tiering.tables=C3=disk,C5=disk", "--config.tiering.cache_rows=130"]


def launch(workdir: pathlib.Path, fault: str = "", *extra: str, **env: str) -> subprocess.CompletedProcess:
    """The launcher in `workdir` (its table files in workdir/tables), with `fault` injected."""
    return subprocess.run([sys.executable, str(DRIVER), f"--workdir={workdir}", *ARGS,
                           f"--config.tiering.dir={workdir / 'tables'}", *extra],
                          env={**os.environ, "RECJAX_FAULT": fault, **env}, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)


def final_arrays(directory: pathlib.Path) -> dict[str, np.ndarray]:
    return checkpoint.read_arrays(checkpoint.open_checkpoint(directory))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, np.ndarray]:
    """The uninterrupted run's final checkpoint."""
    workdir = tmp_path_factory.mktemp("faults") / "reference"
    result = launch(workdir)
    assert result.returncode == 0 and not result.stderr, result.stderr[-3000:]
    return final_arrays(workdir / "checkpoints")


def assert_one_error_line(result: subprocess.CompletedProcess, *parts: str) -> str:
    """Exit status 2 and stderr exactly one `error:` line holding `parts`: no traceback, no library log."""
    assert result.returncode == 2, (result.returncode, result.stderr[-5000:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-5000:]
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def assert_resumes_to_the_reference(workdir: pathlib.Path, reference: dict, kept: int,
                                    ckpt: pathlib.Path | None = None, *extra: str) -> None:
    """The failed run left its checkpoint of step `kept` complete (its digests checked on read) and no partial one in
    `ckpt` (default: the workdir's); rerunning the command (`extra` flags) resumes from it and ends with the
    uninterrupted run's arrays."""
    ckpt = ckpt or workdir / "checkpoints"
    assert not list(ckpt.glob("*.orbax-checkpoint-tmp*")), sorted(p.name for p in ckpt.iterdir())
    assert checkpoint.open_checkpoint(ckpt).step == kept
    final_arrays(ckpt)  # every array's sha256 checked
    result = launch(workdir, "", *extra)
    assert result.returncode == 0 and not result.stderr, result.stderr[-3000:]
    assert f"resuming from checkpoint step {kept} " in result.stdout
    got = final_arrays(ckpt)
    assert sorted(got) == sorted(reference)
    for k in reference:
        np.testing.assert_array_equal(got[k], reference[k], err_msg=k)


# fault -> (what the error line says, the checkpoint the run leaves: the fault fires after the save of step 3 is
# complete, at the first moment of its kind -- a save's fault at the save of step 6)
FAULTS = {
    "save_truncate": (["table file", "C3.f32 (table C3) is truncated", "rerun the same command to resume"], 3),
    "read_truncate": (["table file", "C3.f32 (table C3) is truncated"], 3),
    "read_delete": (["table file", "C3.f32 (table C3) is missing"], 3),
    "writeback_truncate": (["table file", "C3.f32 (table C3)", "truncated"], None),
    "save_delete": (["table file", "C3.f32 (table C3) is missing"], 3),
    "writeback_enospc": (["table file", "C3.f32 (table C3): the disk is full", "bytes and", "are free"], None),
    "save_enospc": (["checkpoint step 6 in", "the disk is full; the checkpoint needs about", "are free; the checkpoint "
                     "of step 3", "is intact"], 3),
}


@pytest.mark.parametrize("fault", [f if f in ("save_truncate", "writeback_enospc") else
                                   pytest.param(f, marks=pytest.mark.slow) for f in FAULTS])
def test_a_fault_is_one_error_line_and_the_run_resumes_from_the_last_checkpoint(fault, reference, tmp_path):
    workdir = tmp_path / "run"
    parts, kept = FAULTS[fault]
    assert_one_error_line(launch(workdir, fault), *[p.replace("C3.f32", str(workdir / "tables" / "dim8" / "C3.f32"))
                                                    for p in parts])
    if kept is None:  # the write-back's fault fires at a later step: the last complete save before it
        kept = checkpoint.open_checkpoint(workdir / "checkpoints").step
    assert_resumes_to_the_reference(workdir, reference, kept)


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs mounted at tmp_path/disk (skipped where this process may not mount one)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small file system needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", f"recjax-test-{uuid.uuid4().hex[:8]}",
                           str(mount)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.parametrize("policy", ["full", pytest.param("consecutive", marks=pytest.mark.slow)])
def test_a_real_full_disk_during_a_save_is_one_error_line_and_a_resume_after_freeing_space(reference, tmp_path,
                                                                                         small_disk, policy):
    """The checkpoints on a small file system that fills up (a file written beside them after the save of step 3,
    leaving 4 KiB): tensorstore's RESOURCE_EXHAUSTED in Orbax's threads becomes one line naming the directory, the
    bytes the checkpoint needs and the bytes free -- for a baseline, saved while the loop waits, and for a delta,
    saved in the background and found failed when the next save waits for it; once the file is removed the same
    command resumes (to the same arrays whatever the policy: it decides what a save writes, not what is trained)."""
    workdir, ckpt = tmp_path / "run", small_disk / "checkpoints"
    flags = [f"--config.checkpoint.dir={ckpt}", f"--config.checkpoint.policy={policy}"]
    result = launch(workdir, "fill_disk", *flags, RECJAX_FAULT_FILL=str(small_disk / "filler"))
    line = assert_one_error_line(result, f"checkpoint step 6 in {ckpt}: the disk is full; the checkpoint needs "
                                         "about", "are free; the checkpoint of step 3", "is intact")
    need, free = (int(line.split(word)[0].split()[-1].replace(",", "")) for word in (" bytes and", " are free"))
    assert free < need, line
    (small_disk / "filler").unlink()
    assert_resumes_to_the_reference(workdir, reference, 3, ckpt, *flags)


def test_which_errors_the_launcher_reports_itself_and_drops_library_logs_of():
    """`errors.reported` / `disk_full` decide which library log records the launchers drop (recjax/cli.py): those of
    an error the launcher prints as one line; a bug's log stays."""
    import errno
    import logging

    from recjax import cli
    from recjax.errors import CheckpointError, StorageError, disk_full, reported

    tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing "tables.dim8/0.0" in OCDBT database: Failed to write '
                             '562324 bytes to file 9: No space left on device [os_error_code=28]')
    try:
        try:
            raise StorageError("table file t.f32 (table C3) is missing")
        except StorageError as inner:
            raise RuntimeError("the save failed") from inner
    except RuntimeError as error:
        chained = error
    assert disk_full(OSError(errno.ENOSPC, "No space left on device")) and disk_full(tensorstore)
    assert not disk_full(OSError(errno.EIO, "Input/output error")) and not disk_full(RuntimeError("x"))
    for error in (StorageError("x"), CheckpointError("x"), chained, tensorstore, KeyboardInterrupt()):
        assert reported(error), error
    assert not reported(RuntimeError("a bug")) and not reported(None)

    def record(error: BaseException | None, message: str = "failed") -> logging.LogRecord:
        return logging.LogRecord("absl", logging.ERROR, "future.py", 1, message, (),
                                 (type(error), error, None) if error else None)

    keep = cli._REPORTED_ERRORS.filter
    assert not keep(record(StorageError("x"))) and not keep(record(tensorstore))
    assert not keep(record(None, "Waiting for previous save to complete took 1.2 seconds. If this number is high"))
    assert keep(record(RuntimeError("a bug"))) and keep(record(None, "Checkpointer failed"))
