"""What every sweep script shares: resumable runs in subdirectories, CSV output and the compilation cache.

A sweep trains each of its runs with `recjax.train.train_and_evaluate` in `<workdir>/<run name>/`. A run whose
summary.json exists is not trained again, so an interrupted sweep resumes where it stopped (the run it was in the
middle of resumes from its last checkpoint, recjax/checkpoint/); if that run's config.json differs from the config
the sweep would train now, the sweep stops rather than mix results. A finished run's checkpoints are deleted: its
summary.json is the sweep's result, and dozens of runs' tables would fill a laptop's disk (train a run alone with
`experiments.train` to keep its model).
"""

import contextlib
import csv
import json
import pathlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ml_collections

from recjax.train import train_and_evaluate


def config_json(config: ml_collections.ConfigDict) -> str:
    """The text `train_and_evaluate` writes to config.json, to compare a finished run with a planned one."""
    return config.to_json_best_effort(indent=2, sort_keys=True) + "\n"


def check_same_config(run_dir: pathlib.Path, expected_json: str) -> None:
    saved_path = run_dir / "config.json"
    if not saved_path.exists() or saved_path.read_text() != expected_json:
        raise ValueError(f"{run_dir} holds a finished run with a different config.json than this sweep would "
                         "train (other steps, dataset, knobs or code?); use a new --workdir or delete that run")


def train_or_resume(config: ml_collections.ConfigDict, run_dir: pathlib.Path, prefix: str = "",
                    log: Callable[[str], None] = print, describe: Callable[[dict], str] = lambda s: "",
                    keep_checkpoints: bool = False) -> dict:
    """The run's summary: read from `run_dir` if it finished before (same config), else trained now.

    `describe(summary)` adds the run's headline numbers to the log line; `keep_checkpoints` keeps the finished run's
    checkpoints (what a sweep measures or restores from).
    """
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        check_same_config(run_dir, config_json(config))
        summary = json.loads(summary_path.read_text())
        log(f"{prefix} done before, skipped ({describe(summary)})")
        return summary
    t0 = time.perf_counter()
    summary = train_and_evaluate(config, run_dir)
    log(f"{prefix} {describe(summary)} ({time.perf_counter() - t0:.1f} s)")
    checkpoints = run_dir / "checkpoints"
    if not keep_checkpoints and not config.get("checkpoint", {}).get("dir") and checkpoints.is_dir():
        shutil.rmtree(checkpoints)
    return summary


def write_csv(path: pathlib.Path, rows: Sequence[dict[str, Any]], fields: Sequence[str]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)


def open_workdir(path: str | None, prefix: str, compilation_cache: bool) -> pathlib.Path:
    """The sweep's output directory (`path`, or a fresh temp directory named `prefix`...), printed. With
    `compilation_cache`, XLA executables are kept in <workdir>/.jax_cache, so resumed sweeps and runs that differ
    only in their seed skip most of the compile time."""
    workdir = pathlib.Path(path or tempfile.mkdtemp(prefix=prefix))
    print(f"sweep workdir: {workdir}", flush=True)
    if compilation_cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", str(workdir / ".jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return workdir


@contextlib.contextmanager
def keep_or_remove_on_failure(workdir: pathlib.Path, chosen: bool) -> Iterator[None]:
    """If the sweep fails in a temp workdir the user did not choose: remove it when no run had finished (nothing
    worth keeping), else keep it and say how to resume there."""
    try:
        yield
    except BaseException:
        if not chosen:
            if any(workdir.glob("*/summary.json")):
                print(f"finished runs are kept in {workdir}; resume with --workdir={workdir}", flush=True)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
        raise
