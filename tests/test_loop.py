"""The training loop's calls (issue 38): k steps per call give the run of one step per call, calls end wherever the
loop must look at the state, and nothing is read back from the device between log points."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_checkpoint import assert_same_run, tiny

from recjax.checkpoint.config import config_differences
from recjax.evaluation import Budget, resolve_steps_per_call
from recjax.train import Run, train_and_evaluate


def split_calls(steps_per_call: int, steps: int = 40):
    """tests/test_checkpoint.py's tiny run (dropout, lazy Adam, Adam; every checkpoint kept) with a warmup and a cosine
    decay, and log / eval / checkpoint intervals that fall inside calls of 3 or 4 steps: 6, 15 and 10."""
    config = tiny(steps=steps, keep=10, every_steps=10)
    config.train.log_every = 6
    config.train.eval_every = 15
    config.optimizer.warmup_steps = 3
    config.optimizer.decay = "cosine"
    config.train.steps_per_call = steps_per_call
    return config


def test_four_steps_per_call_give_the_run_of_one(tmp_path):
    """Every checkpoint (steps 10-40), the summary and metrics.csv of k = 4 equal k = 1's bit for bit: the scan runs
    the very step, the learning-rate schedule and dropout read the step it carries, and the log, eval and checkpoint
    steps end calls (4, 1, 1 | 4 | 1, 1 | 1, 1, 1 | ... : a call of k only where no such step falls inside it)."""
    one = train_and_evaluate(split_calls(1), tmp_path / "one")
    four = train_and_evaluate(split_calls(4), tmp_path / "four")
    assert one["loop"]["calls"] == 40 and four["loop"]["steps_per_call"] == 4
    assert four["loop"]["calls"] == 22  # 6 calls of 4 steps (at 0, 6, 20, 24, 30, 36), 16 of one
    assert_same_run(tmp_path / "one", tmp_path / "four")
    from test_checkpoint import assert_same_arrays

    from recjax import checkpoint

    for step in (10, 20, 30):
        a, b = (checkpoint.read_arrays(checkpoint.open_checkpoint(tmp_path / d / "checkpoints", step))
                for d in ("one", "four"))
        assert_same_arrays(a, b)


@pytest.mark.slow
def test_three_steps_per_call_give_the_run_of_one_with_dynamic_tables(tmp_path):
    """k = 3 with FIITED, whose adjustments (every 4 steps of its ramp, and a compaction that re-compiles the calls)
    end calls: the same run as k = 1."""
    def config(k):
        c = split_calls(k, steps=24)
        c.embedding.method = "fiited"
        c.embedding.options.keep = 0.25
        c.embedding.options.chunks = 4
        c.embedding.options.threshold = 100
        c.embedding.options.interval = 4
        c.embedding.options.compact_slack = 10.0  # compact only at the ramp's end
        return c

    one = train_and_evaluate(config(1), tmp_path / "one")
    three = train_and_evaluate(config(3), tmp_path / "three")
    assert one["dynamic_tables"]["adjustments"] == three["dynamic_tables"]["adjustments"] > 1
    assert three["dynamic_tables"]["compactions"] == 1
    assert_same_run(tmp_path / "one", tmp_path / "three")


class _Checkpoints:
    """What `Run.call_lengths` asks a checkpointer: a steps interval."""

    def __init__(self, every: int):
        self.every = every

    def due_at(self, step: int) -> bool:
        return step % self.every == 0


@pytest.mark.parametrize("k", [1, 3, 4, 16])
def test_calls_end_at_every_log_eval_and_checkpoint_step(k):
    config = split_calls(k)
    config.train.log_every = 7
    budget = Budget(steps=100, batch_size=8, examples_per_epoch=None, every_steps=25)
    task = types.SimpleNamespace(objective=types.SimpleNamespace(tracked=("auc", "logloss")), collection=None)
    run = Run(config, None, None, task, budget, None, _Checkpoints(11), None, steps_per_call=k)
    lengths = list(run.call_lengths(3, 100))  # a run resumed at step 3
    ends = np.cumsum([3, *lengths])[1:]
    assert ends[-1] == 100
    must_end = {s for s in range(4, 101) if s % 7 == 0 or s % 25 == 0 or s % 11 == 0 or s == 100}
    assert must_end <= set(ends.tolist())  # every such step ends a call ...
    assert set(lengths) <= set(run.call_sizes()) == {1, k}  # ... calls are k steps or 1
    for start, n in zip([3, *ends[:-1].tolist()], lengths, strict=True):  # and k wherever k fit
        room = min(k, min(e for e in must_end if e > start) - start)
        assert n == (k if room == k else 1), (start, n, room)


def test_no_host_sync_between_log_points(tmp_path, monkeypatch):
    """In the loop, device values are read only at log points: one explicit read of the window's losses at each (and
    the evaluations' predictions at eval points). An implicit read (float(x), np.asarray(x): every one goes through
    `ArrayImpl._value`; jax.transfer_guard does not see a CPU device's) or a wait for the device anywhere else in the
    loop fails the test."""
    import threading

    from jax._src.array import ArrayImpl
    from test_train import tiny_config

    reads, waits, runs = [], [], []
    explicit, guard = [0], [False]
    device_get, value, block = jax.device_get, ArrayImpl._value, jax.block_until_ready

    def counted(tree):
        reads.append(runs[-1].stop.step if runs else None)
        explicit[0] += 1
        try:
            return device_get(tree)
        finally:
            explicit[0] -= 1

    def guarded_value(self):
        if guard[0] and not explicit[0] and threading.current_thread() is threading.main_thread():
            raise AssertionError("an implicit read of a device value inside the training loop")
        return value.fget(self)

    def counted_wait(tree):
        waits.append(runs[-1].stop.step if runs else None)
        return block(tree)

    train = Run.train

    def guarded(self, calls):
        runs.append(self)
        guard[0] = True
        try:
            with pytest.raises(AssertionError, match="implicit read"):  # the guard is live in here
                float(jnp.ones(()) + 1)
            return train(self, calls)
        finally:
            guard[0] = False

    monkeypatch.setattr(Run, "train", guarded)
    monkeypatch.setattr(jax, "device_get", counted)
    monkeypatch.setattr(jax, "block_until_ready", counted_wait)
    monkeypatch.setattr(ArrayImpl, "_value", property(guarded_value))
    config = tiny_config(steps=40)
    config.train.log_every = 10
    config.train.eval_every = 20
    config.train.steps_per_call = 4
    config.checkpoint.enabled = False
    summary = train_and_evaluate(config, tmp_path)
    assert summary["loop"]["calls"] == 16  # 4 + 4 + 1 + 1 to each log point
    in_loop = [s for s in reads if s is not None]
    assert set(in_loop) == {10, 20, 30, 40}  # log points only
    assert in_loop.count(10) == in_loop.count(30) == 1  # a log point: the window's losses, once
    validation_batches = 8192 // 256
    assert in_loop.count(20) >= 1 + validation_batches  # an eval point: that, and each validation batch's predictions
    assert [s for s in waits if s is not None] == []


def test_steps_per_call_auto_is_per_platform_and_a_resume_may_change_it():
    config = split_calls(1)
    config.train.steps_per_call = "auto"
    assert resolve_steps_per_call(config.train, "cpu") == 1
    assert resolve_steps_per_call(config.train, "gpu") == resolve_steps_per_call(config.train, "tpu") > 1
    config.train.steps_per_call = 8
    assert resolve_steps_per_call(config.train, "gpu") == 8
    saved = {"train": {"steps_per_call": 1, "input_workers": 2, "steps": 40}}
    assert config_differences(saved, {"train": {"steps_per_call": 8, "input_workers": 4, "steps": 40}}) == []
    assert config_differences(saved, {"train": {"steps_per_call": 8, "input_workers": 2, "steps": 50}}) == [
        "train.steps"]
