"""Crash safety: a training process killed with SIGKILL at random moments -- as a checkpoint save starts, while
one is being written in the background, between steps -- always resumes from the last complete checkpoint and ends
bit-identical to an uninterrupted run (tests/crash_driver.py: one forking process, 10 kills in 2 chains); runs with
tables on the disk tier too, against the uninterrupted in-memory run."""

import json
import pathlib
import subprocess
import sys

import pytest

DRIVER = pathlib.Path(__file__).with_name("crash_driver.py")


@pytest.mark.slow  # a reference run and 12 children, 10 of them killed
def test_sigkill_at_random_moments_always_resumes_to_the_same_state(tmp_path):
    result = subprocess.run([sys.executable, str(DRIVER), f"--workdir={tmp_path}", "--trials=10", "--seed=0"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    kills, chains, total = lines[:-3], lines[-3:-1], lines[-1]
    assert total["kills"] == 10 and total["killed"] == 10, total
    # Every child started from the newest complete checkpoint its killed predecessor left (never a partial one).
    assert all(k["resumed_from_latest"] for k in kills), kills
    assert total["killed_during_save"] >= 5, kills  # the kills really hit saves in flight
    assert all(c["finished"] and c["identical"] for c in chains), chains


@pytest.mark.slow  # a reference run and 5 children, 4 of them killed
def test_sigkill_of_a_disk_tier_run_resumes_to_the_memory_runs_state(tmp_path):
    """The killed runs keep two tables on disk (files in the workdir, left as the kill left them: rows written back
    after the last checkpoint included); every resume ends bit-identical to the uninterrupted in-memory run."""
    result = subprocess.run([sys.executable, str(DRIVER), f"--workdir={tmp_path}", "--trials=4", "--kills_per_chain=4",
                             "--seed=1", "--disk"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    kills, chain, total = lines[:-2], lines[-2], lines[-1]
    assert total["kills"] == 4 and total["killed"] == 4, total
    assert all(k["resumed_from_latest"] for k in kills), kills
    assert total["killed_during_save"] >= 1, kills
    assert chain["finished"] and chain["identical"], chain
    assert "embedding tiers" in (tmp_path / "chain0.final.log").read_text()  # the tables were on disk
