"""Budgets in steps or epochs, evaluation intervals, and best-step selection with early stopping, each against a
brute-force or hand-computed oracle."""

import math

import ml_collections
import pytest

from experiments.configs import common
from recjax.errors import ConfigError
from recjax.evaluation import Budget, Selection, resolve_budget


class Sized:
    """A dataset stand-in that only knows its split sizes."""

    def __init__(self, train: int | None):
        self.train = train

    def num_examples(self, split: str):
        return self.train if split == "train" else 100


def train_config(**fields) -> ml_collections.ConfigDict:
    """The shipped train section (experiments/configs/common.py) with batch size 64 and `fields`."""
    config = common.train_config(batch_size=64)
    config.update(fields)
    return config


def test_epochs_become_steps_rounded_up():
    budget = resolve_budget(train_config(epochs=3), Sized(1000))
    assert budget.steps == math.ceil(3 * 1000 / 64) == 47 and budget.examples_per_epoch == 1000
    assert resolve_budget(train_config(epochs=0.5), Sized(1000)).steps == 8  # 500 / 64 = 7.8
    assert resolve_budget(train_config(steps=10, eval_every=5), Sized(None)).steps == 10


@pytest.mark.parametrize("every", ["epoch", "0.25epoch", "2 epochs"])
def test_epoch_intervals_evaluate_after_each_boundary_crossing(every):
    n, batch = 1000, 64
    budget = resolve_budget(train_config(epochs=5, eval_every=every), Sized(n))
    fraction = {"epoch": 1.0, "0.25epoch": 0.25, "2 epochs": 2.0}[every]
    # Brute force: walk the examples one by one and note the steps in which a multiple of the period is passed.
    period = fraction * n
    expected, boundary = set(), period
    for step in range(1, budget.steps + 1):
        while step * batch >= boundary:
            expected.add(step)
            boundary += period
    expected.add(budget.steps)
    assert {s for s in range(1, budget.steps + 1) if budget.is_eval_step(s)} == expected


def test_step_intervals_and_the_last_step():
    budget = Budget(steps=10, batch_size=8, examples_per_epoch=None, every_steps=4)
    assert [s for s in range(1, 11) if budget.is_eval_step(s)] == [4, 8, 10]


def test_endless_data_has_no_epochs():
    with pytest.raises(ConfigError, match=r"^train.epochs: this dataset is an endless stream"):
        resolve_budget(train_config(epochs=1), Sized(None))
    with pytest.raises(ConfigError, match=r"^train.epochs: this dataset is an endless stream"):
        resolve_budget(train_config(steps=10, eval_every="epoch"), Sized(None))


def test_selection_keeps_the_best_validation_step_and_stops_after_patience():
    selection = Selection("auc", patience=2)
    history = [(10, 0.70), (20, 0.72), (30, 0.71), (40, 0.73), (50, 0.73), (60, 0.725)]
    scored_test, stopped_at = [], None
    for step, auc in history:
        if selection.record(step, {"auc": auc, "logloss": 1 - auc}):
            scored_test.append(step)
        if selection.should_stop:
            stopped_at = step
            break
    # A tie (0.73 at step 50) is no improvement; two evaluations without one stop the run at step 60.
    assert selection.best_step == 40 and scored_test == [10, 20, 40] and stopped_at == 60
    assert selection.last_validation["auc"] == 0.725


def test_selection_on_logloss_and_without_early_stopping():
    selection = Selection("logloss", patience=0)
    for step, loss in [(1, 0.5), (2, 0.4), (3, 0.45), (4, 0.46), (5, 0.47), (6, 0.48)]:
        selection.record(step, {"auc": 0.5, "logloss": loss})
        assert not selection.should_stop
    assert selection.best_step == 2 and selection.evals_without_improvement == 4


def test_a_one_class_validation_split_selects_on_logloss_with_a_warning(capsys):
    selection = Selection("auc", patience=0)
    one_class = {"eval_ctr": 0.0, "eval_examples": 4}
    selection.record(1, {"auc": float("nan"), "logloss": 0.5, **one_class})
    assert not selection.record(2, {"auc": float("nan"), "logloss": 0.6, **one_class})
    assert selection.record(3, {"auc": float("nan"), "logloss": 0.4, **one_class})
    assert selection.select_on == "logloss" and selection.best_step == 3
    assert "one class only" in selection.warnings[0] and "WARNING: the validation split" in capsys.readouterr().out
