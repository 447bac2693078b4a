"""Crash safety: a training process killed with SIGKILL at random moments -- as a checkpoint save starts, while
one is being written in the background, between steps -- always resumes from the last complete checkpoint and ends
bit-identical to an uninterrupted run (tests/crash_driver.py: one forking process, 10 kills in 2 chains)."""

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
