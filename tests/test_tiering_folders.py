"""A disk-tier run's temporary table folder belongs to it (recjax/tiering/folders.py): in its workdir, held while it
runs, removed when it ends, by the next run or resume in the workdir after a kill -9, and by
`python -m experiments.clean_tables`; a folder a live run holds is neither shared nor removed."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from conftest import HANG_GUARD_S
from test_tiering_faults import ARGS, DRIVER

from recjax import placement
from recjax.errors import ConfigError
from recjax.tiering import folders

REPO = pathlib.Path(__file__).resolve().parents[1]


def command(workdir: pathlib.Path, steps: int) -> list[str]:
    """The launcher on the faults' disk-tier config, its table files in the default temporary folder."""
    return [sys.executable, str(DRIVER), f"--workdir={workdir}", *ARGS, f"--config.train.steps={steps}"]


def killed_after_first_checkpoint(workdir: pathlib.Path, env: dict) -> None:
    """Start the run, SIGKILL it once its checkpoint of step 3 is complete (it trains 60 steps: far from done)."""
    run = subprocess.Popen(command(workdir, 60), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    start = time.monotonic()
    while not (workdir / "checkpoints" / "3").is_dir():
        assert run.poll() is None, run.stderr.read()
        assert time.monotonic() - start < HANG_GUARD_S
        time.sleep(0.002)
    run.send_signal(signal.SIGKILL)
    run.wait()
    run.stderr.close()


@pytest.mark.slow  # two launcher runs, one of them killed
def test_a_resume_removes_the_table_folder_a_killed_run_left(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "RECJAX_FAULT": ""}
    (tmp_path / "tmp").mkdir()
    workdir = tmp_path / "run"
    killed_after_first_checkpoint(workdir, env)
    left = workdir / folders.WORKDIR_FOLDER
    assert sorted(p.name for p in (left / "dim8").iterdir()) == ["C3.f32", "C5.f32"]  # what the kill left
    assert folders.owner(left) is None  # held by no live run: the kill released its lock
    resumed = subprocess.run(command(workdir, 60), env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert resumed.returncode == 0 and not resumed.stderr, resumed.stderr[-3000:]
    assert "removed the disk-tier table files" in resumed.stdout and "resuming from checkpoint step" in resumed.stdout
    assert not left.exists()
    assert not list((tmp_path / "tmp").iterdir())  # and nothing in the system's temporary directory


def test_clean_tables_removes_left_folders_and_keeps_held_ones(tmp_path):
    """Three folders: a workdir's left by a killed run (its owner file unlocked), one in the temporary directory left
    the same way, one this process holds; the command removes the first two (the named workdir's, then the temporary
    directory's) and keeps the held one, naming its owner."""
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    workdir = tmp_path / "run"
    for path in (workdir / folders.WORKDIR_FOLDER, tmp_path / "tmp" / f"{folders.TEMP_PREFIX}left"):
        folder = folders.TableFolder(path, temporary=False).take()
        (path / "C1.f32").write_bytes(bytes(1 << 20))
        folder.release()  # as a kill -9 would: the lock gone, the files kept
    held = folders.TableFolder(tmp_path / "tmp" / f"{folders.TEMP_PREFIX}held", temporary=True).take()

    def clean(*flags: str) -> list[str]:
        result = subprocess.run([sys.executable, "-m", "experiments.clean_tables", *flags], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert result.returncode == 0 and not result.stderr, result.stderr
        return result.stdout.splitlines()

    lines = clean(f"--workdir={workdir}")
    assert lines[0].startswith(f"removed {workdir / folders.WORKDIR_FOLDER} (1.0 MiB)") and not (
        workdir / folders.WORKDIR_FOLDER).exists()
    assert lines[-1] == "removed 1 table folder, 1.0 MiB"
    lines = clean()
    assert f"removed {tmp_path / 'tmp' / (folders.TEMP_PREFIX + 'left')} (1.0 MiB)" in lines
    assert f"kept {held.path}: in use by pid {os.getpid()}" in " ".join(lines)
    assert held.path.exists() and not (tmp_path / "tmp" / f"{folders.TEMP_PREFIX}left").exists()
    held.release()
    assert not held.path.exists()
    assert clean() == ["removed 0 table folders, 0.0 MiB"]


def test_two_runs_cannot_share_a_table_folder(tmp_path):
    """A run asking for the folder another live run holds (here this process) is refused, naming that run."""
    from test_tiering import tiny_run_config

    from recjax.specs import DatasetSpec, FeatureSpec
    from recjax.task import build_task

    held = folders.TableFolder(tmp_path / "tables", temporary=False).take()
    config = tiny_run_config(tmp_path, tables="C1=disk", dir=str(tmp_path / "tables"))
    spec = DatasetSpec(13, tuple(FeatureSpec(f"C{i + 1}", v) for i, v in enumerate(config.data.vocab_sizes)))
    with pytest.raises(ConfigError, match=rf"tiering\.dir: {tmp_path / 'tables'} is in use by another run \(pid "
                                          rf"{os.getpid()} "):
        placement.build(config, build_task(config, spec))
    held.release()
    backend = placement.build(config, build_task(config, spec))
    disk, = (s for s in backend.storages if s.name == "disk")
    assert disk.folder.path == tmp_path / "tables" and folders.owner(tmp_path / "tables")["pid"] == os.getpid()
    backend.close()
    assert (tmp_path / "tables").is_dir() and folders.owner(tmp_path / "tables") is None  # kept, released
