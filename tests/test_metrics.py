import numpy as np
import pytest
from sklearn.metrics import accuracy_score, log_loss, roc_auc_score

from recjax import metrics


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    labels = (rng.random(2000) < 0.3).astype(np.float32)
    scores = np.round(rng.random(2000) + 0.3 * labels, 2)  # rounding creates many ties
    assert metrics.auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)


def test_auc_extremes_and_single_class():
    assert metrics.auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert metrics.auc(np.array([0, 0, 1, 1]), np.array([0.4, 0.3, 0.2, 0.1])) == 0.0
    assert metrics.auc(np.array([0, 1]), np.array([0.5, 0.5])) == 0.5
    assert np.isnan(metrics.auc(np.ones(5), np.arange(5.0)))


def test_logloss_accuracy_match_sklearn():
    rng = np.random.default_rng(0)
    labels = (rng.random(1000) < 0.4).astype(np.float32)
    probs = rng.random(1000)
    assert metrics.logloss(labels, probs) == pytest.approx(log_loss(labels, probs), rel=1e-9)
    assert metrics.accuracy(labels, probs) == pytest.approx(accuracy_score(labels, probs >= 0.5))


def test_normalized_entropy_hand_computed():
    labels = np.array([1, 0, 0, 0], np.float32)
    # Predicting the base rate exactly gives NE = 1.
    assert metrics.normalized_entropy(labels, np.full(4, 0.25)) == pytest.approx(1.0)
    probs = np.array([0.9, 0.1, 0.2, 0.1])
    logloss = -(np.log(0.9) + np.log(0.9) + np.log(0.8) + np.log(0.9)) / 4
    expected = logloss / -(0.25 * np.log(0.25) + 0.75 * np.log(0.75))
    assert metrics.normalized_entropy(labels, probs) == pytest.approx(expected)
