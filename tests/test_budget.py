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


def brute_force_selection(history, patience):
    """The oracle: first best step of each metric over the evaluations up to an early stop on AUC, and the steps whose
    test is scored (each one improves AUC or logloss over all earlier evaluations)."""
    scored, stop, since = [], len(history), 0
    for i, (step, auc, loss) in enumerate(history):
        earlier = history[:i]
        if not earlier or auc > max(h[1] for h in earlier) or loss < min(h[2] for h in earlier):
            scored.append(step)
        since = 0 if not earlier or auc > max(h[1] for h in earlier) else since + 1
        if patience and since >= patience:
            stop = i + 1
            break
    seen = history[:stop]
    best_auc = max(seen, key=lambda h: (h[1], -h[0]))[0]
    best_loss = min(seen, key=lambda h: (h[2], h[0]))[0]
    return best_auc, best_loss, scored, seen[-1][0]


@pytest.mark.parametrize("seed", range(6))
def test_selection_tracks_both_metrics_and_scores_test_only_where_one_improves(seed):
    """Random validation curves (ties included): the AUC-selected step, the logloss-best step, the steps where test is
    scored and the early stop (on AUC only) all match a brute-force pass; each best keeps its own step's test."""
    import numpy as np

    rng = np.random.default_rng(seed)
    history = [(10 * (i + 1), round(float(rng.uniform(0.6, 0.8)), 2), round(float(rng.uniform(0.4, 0.6)), 2))
               for i in range(12)]
    patience = seed % 3 * 2  # 0 (no early stop), 2, 4
    selection = Selection("auc", patience=patience)
    scored, last = [], None
    for step, auc, loss in history:
        last = step
        if selection.record(step, {"auc": auc, "logloss": loss}):
            scored.append(step)
            selection.record_test(step, {"auc": step / 1000, "logloss": step / 100})  # test that names its step
        if selection.should_stop:
            break
    best_auc, best_loss, expected_scored, expected_last = brute_force_selection(history, patience)
    assert (selection.best_step, scored, last) == (best_auc, expected_scored, expected_last)
    assert selection.by_metric["auc"]["step"] == best_auc and selection.by_metric["logloss"]["step"] == best_loss
    assert selection.test == {"auc": best_auc / 1000, "logloss": best_auc / 100}
    assert selection.by_metric["logloss"]["test"] == {"auc": best_loss / 1000, "logloss": best_loss / 100}
    assert selection.by_metric["logloss"]["validation"]["logloss"] == min(h[2] for h in history if h[0] <= last)


def test_selection_on_auc_past_the_logloss_minimum_warns_with_both_tests():
    """The issue's case: AUC still rising while the validation logloss is well past its minimum (0.343 vs 0.291)."""
    selection = Selection("auc", patience=0)
    history = [(100, 0.80, 0.300), (200, 0.82, 0.291), (300, 0.83, 0.320), (400, 0.84, 0.343)]
    for step, auc, loss in history:
        if selection.record(step, {"auc": auc, "logloss": loss}):
            selection.record_test(step, {"auc": auc - 0.01, "logloss": loss + 0.01})
    assert selection.best_step == 400 and selection.by_metric["logloss"]["step"] == 200
    warning = selection.disagreement(logloss_tolerance=0.02, auc_tolerance=0.002)
    # 0.343 / 0.291 - 1 = 17.9 %
    assert warning == ("selecting on validation auc picked step 400, whose validation logloss 0.3430 is 17.9 % above "
                       "its lowest, 0.2910 (step 200); test at step 400: auc 0.8300, logloss 0.3530, at step 200: "
                       "auc 0.8100, logloss 0.3010 (summary.json: selection)")
    assert selection.disagreement(logloss_tolerance=0.18, auc_tolerance=0.002) is None  # within 18 %


def test_selection_on_logloss_warns_when_its_auc_falls_short():
    selection = Selection("logloss", patience=0)
    for step, auc, loss in [(1, 0.70, 0.50), (2, 0.75, 0.45), (3, 0.78, 0.44), (4, 0.79, 0.46)]:
        if selection.record(step, {"auc": auc, "logloss": loss}):
            selection.record_test(step, {"auc": auc, "logloss": loss})
    assert selection.best_step == 3 and selection.by_metric["auc"]["step"] == 4
    assert "validation auc 0.7800 is 0.0100 below its highest, 0.7900 (step 4)" in selection.disagreement(0.02, 0.002)
    assert selection.disagreement(0.02, 0.01) is None  # 0.01 below: not more than the tolerance
    agreeing = Selection("auc", patience=0)
    agreeing.record(1, {"auc": 0.7, "logloss": 0.5})
    agreeing.record_test(1, {"auc": 0.7, "logloss": 0.5})
    assert agreeing.disagreement(0.0, 0.0) is None


def test_a_nan_auc_is_never_a_tracked_best():
    selection = Selection("auc", patience=0)
    one_class = {"eval_ctr": 0.0, "eval_examples": 4}
    selection.record(1, {"auc": float("nan"), "logloss": 0.5, **one_class})
    selection.record(2, {"auc": float("nan"), "logloss": 0.4, **one_class})
    assert sorted(selection.by_metric) == ["logloss"] and selection.by_metric["logloss"]["step"] == 2
