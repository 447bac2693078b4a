"""Evaluation metrics on the host (numpy, float64), exact over the whole eval set: binary classification (clicks)
and regression (ratings). Which set a run reports is its objective's (recjax/task.py OBJECTIVES)."""

import numpy as np

METRICS = ("auc", "logloss", "ne", "accuracy")  # what every binary evaluation reports, in this order
REGRESSION_METRICS = ("mse", "rmse", "mae")  # what every regression evaluation reports, in this order
HIGHER_IS_BETTER = frozenset({"auc", "accuracy"})  # every other metric is a loss: lower is better
_EPS = 1e-7  # probabilities are clipped to [eps, 1 - eps] for log loss, as scikit-learn does for float32


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney U with mid-ranks for ties). NaN if only one class is present."""
    labels = np.asarray(labels, np.float64).ravel()
    scores = np.asarray(scores, np.float64).ravel()
    n_pos = labels.sum()
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # Mid-ranks: tied scores share the mean of the 1-based ranks they span.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    mid = (starts + ends + 1) / 2.0
    ranks = np.empty(scores.size)
    ranks[order] = np.repeat(mid, ends - starts)
    return float((ranks[labels == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def logloss(labels: np.ndarray, probs: np.ndarray) -> float:
    y = np.asarray(labels, np.float64)
    p = np.clip(np.asarray(probs, np.float64), _EPS, 1 - _EPS)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def normalized_entropy(labels: np.ndarray, probs: np.ndarray) -> float:
    """Log loss divided by the entropy of the base rate (He et al. 2014): < 1 beats predicting the CTR."""
    ctr = float(np.mean(labels))
    if ctr in (0.0, 1.0):
        return float("nan")
    base = -(ctr * np.log(ctr) + (1 - ctr) * np.log(1 - ctr))
    return logloss(labels, probs) / base


def accuracy(labels: np.ndarray, probs: np.ndarray, threshold: float = 0.5) -> float:
    return float(np.mean((np.asarray(probs) >= threshold) == (np.asarray(labels) >= 0.5)))


def binary_metrics(labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    """auc, logloss, ne, accuracy, plus the eval set's size and click rate."""
    return {
        "auc": auc(labels, probs),
        "logloss": logloss(labels, probs),
        "ne": normalized_entropy(labels, probs),
        "accuracy": accuracy(labels, probs),
        "eval_examples": int(np.size(labels)),
        "eval_ctr": float(np.mean(labels)),
    }


def regression_metrics(labels: np.ndarray, predictions: np.ndarray) -> dict[str, float]:
    """mse, rmse, mae, plus the eval set's size and mean label (predicting that mean scores mse = its variance)."""
    y = np.asarray(labels, np.float64).ravel()
    error = np.asarray(predictions, np.float64).ravel() - y
    mse = float(np.mean(error * error))
    return {"mse": mse, "rmse": float(np.sqrt(mse)), "mae": float(np.mean(np.abs(error))),
            "eval_examples": int(y.size), "eval_mean": float(np.mean(y))}


def better(metric: str, new: float, best: float) -> bool:
    """Whether `new` improves on `best` for `metric` (higher for AUC and accuracy, lower for the losses)."""
    return new > best if metric in HIGHER_IS_BETTER else new < best
