"""Power-law fits of loss against compute, and comparisons of model families at equal compute.

    loss(F) = a * F^(-b) + c        F = FLOPs per example, c = the loss the family tends to with unlimited compute

For a fixed exponent b the model is linear in (a, c), so the fit solves ordinary least squares for (a, c) at every
b on a log grid and refines the best b by golden-section search: no starting point to guess, and no SciPy. F is
divided by its geometric mean inside the fit (a is converted back), so the normal equations stay well conditioned
at any FLOPs scale. R^2 = 1 - SS_res / SS_tot on the points fitted.
"""

import math
from collections.abc import Sequence

import numpy as np

B_RANGE = (1e-3, 4.0)  # exponents searched; b -> 0 is a straight line in log F, b = 4 an extremely sharp knee


def fit_power_law(flops: Sequence[float], loss: Sequence[float]) -> dict[str, float]:
    """Least-squares fit of loss = a * flops^(-b) + c.

    Returns a, b, c, r2 (coefficient of determination), rmse, points, the FLOPs range and b_at_bound (the best b
    is an end of B_RANGE: the points do not pin a power law down, e.g. 3 points or a flat family). Needs at least
    3 distinct FLOPs values (3 parameters); a < 0 means the loss grows with compute and is reported as it is.
    """
    x = np.asarray(flops, np.float64)
    y = np.asarray(loss, np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"flops and loss must be 1-d and the same length, got {x.shape} and {y.shape}")
    if not (np.all(np.isfinite(x)) and np.all(x > 0) and np.all(np.isfinite(y))):
        raise ValueError("flops must be finite and > 0 and loss finite to fit a power law")
    if np.unique(x).size < 3:
        raise ValueError(f"a power-law fit (3 parameters) needs >= 3 distinct FLOPs values, got {np.unique(x).size}")
    scale = math.exp(float(np.mean(np.log(x))))
    u = x / scale

    def solve(b: float) -> tuple[float, np.ndarray]:
        basis = np.stack([u ** -b, np.ones_like(u)], axis=1)
        coef, *_ = np.linalg.lstsq(basis, y, rcond=None)
        resid = y - basis @ coef
        return float(resid @ resid), coef

    grid = np.geomspace(*B_RANGE, 200)
    sse = [solve(b)[0] for b in grid]
    i = int(np.argmin(sse))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(80):  # golden-section search in log b between the grid neighbours of the best grid point
        m1 = math.exp(math.log(hi) - ratio * (math.log(hi) - math.log(lo)))
        m2 = math.exp(math.log(lo) + ratio * (math.log(hi) - math.log(lo)))
        lo, hi = (lo, m2) if solve(m1)[0] <= solve(m2)[0] else (m1, hi)
    b = math.sqrt(lo * hi)
    best_sse, (a_scaled, c) = solve(b)
    sst = float(((y - y.mean()) ** 2).sum())
    return {"a": float(a_scaled * scale**b), "b": b, "c": float(c),
            "r2": 1.0 - best_sse / sst if sst > 0 else float("nan"), "rmse": math.sqrt(best_sse / y.size),
            "points": int(y.size), "flops_min": float(x.min()), "flops_max": float(x.max()),
            "b_at_bound": bool(b < B_RANGE[0] * 1.01 or b > B_RANGE[1] / 1.01)}


def predict(fit: dict[str, float], flops) -> np.ndarray:
    """The fitted loss a * flops^(-b) + c."""
    return fit["a"] * np.asarray(flops, np.float64) ** -fit["b"] + fit["c"]


def interpolate_loss(flops: Sequence[float], loss: Sequence[float], at: float) -> float | None:
    """Measured loss at `at` FLOPs by linear interpolation in log FLOPs between the two nearest measured sizes
    (mean over seeds at equal FLOPs); None outside the measured range."""
    by_flops: dict[float, list[float]] = {}
    for f, v in zip(flops, loss, strict=True):
        by_flops.setdefault(float(f), []).append(float(v))
    xs = np.log(sorted(by_flops))
    ys = [float(np.mean(by_flops[f])) for f in sorted(by_flops)]
    if not xs[0] - 1e-12 <= math.log(at) <= xs[-1] + 1e-12:
        return None
    return float(np.interp(math.log(at), xs, ys))


def compare_at_equal_flops(family: str, other: str, points: dict[str, tuple[list[float], list[float]]],
                           fits: dict[str, dict]) -> dict:
    """How `family` does against `other` at equal FLOPs/example, where their measured ranges overlap.

    measured: at each of `family`'s sizes inside `other`'s range, other's loss interpolated in log FLOPs minus
    family's loss (> 0: family is better); fitted: the same gap between the two fitted curves on 50 log-spaced
    FLOPs values of the overlap. `family_better` is the share of those comparisons `family` wins.
    """
    fx, fy = points[family]
    ox, oy = points[other]
    lo, hi = max(min(fx), min(ox)), min(max(fx), max(ox))
    out: dict = {"overlap_flops": [lo, hi] if lo <= hi else None}
    gaps = []
    for f in sorted(set(fx)):
        theirs = interpolate_loss(ox, oy, f)
        if theirs is not None:
            gaps.append(theirs - interpolate_loss(fx, fy, f))
    out["measured"] = {"comparisons": len(gaps), "mean_gap": float(np.mean(gaps)) if gaps else None,
                       "family_better": float(np.mean(np.asarray(gaps) > 0)) if gaps else None}
    if lo < hi and family in fits and other in fits:
        grid = np.geomspace(lo, hi, 50)
        gap = predict(fits[other], grid) - predict(fits[family], grid)
        out["fitted"] = {"mean_gap": float(gap.mean()), "min_gap": float(gap.min()), "max_gap": float(gap.max()),
                         "family_better": float(np.mean(gap > 0))}
    return out
