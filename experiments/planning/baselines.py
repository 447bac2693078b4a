"""The planners recjax's planner (recjax/sharding/planner.py) is compared with in benchmarks/planner.py, all scored by
the same cost model:

  random               each table on a uniformly random device (seeded), memory not consulted (a plan may not fit)
  size_greedy          NeuroShard's table-wise heuristics (Zha et al. 2023, and its code's sharders): tables by
  dim_greedy           decreasing cost, each on the device with the lowest sum of costs among those with room (ties:
  lookup_greedy        the least memory used, then the lowest index); cost = bytes, dim, dim x pooling,
  size_lookup_greedy   dim x pooling x log10(rows) respectively
  torchrec_greedy      TorchRec-like (recjax/sharding/planner.py `torchrec_greedy`, the search's second start)
  neuroshard           NeuroShard's own search (experiments/planning/neuroshard.py): beam search over halving a
                       table's columns, each state placed by a greedy under a cap on each device's sum of dims

    result = baseline(problem, "size_greedy")      # a PlannerResult, scored by the analytic model of the problem's
                                                   # exchange (or `model`)
"""

import math
import time
from collections.abc import Callable

import numpy as np

from recjax.sharding.cost_model import AnalyticCostModel, CostModel, PlannerTable, Problem
from recjax.sharding.planner import Choice, PlannerResult, finish, torchrec_greedy

HEURISTICS = ("size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy")
BASELINES = ("random", *HEURISTICS, "torchrec_greedy")


def _heuristics() -> dict[str, Callable[[PlannerTable], float]]:
    return {
        "size_greedy": lambda t: float(t.info.bytes),
        "dim_greedy": lambda t: float(t.info.dim),
        "lookup_greedy": lambda t: t.info.dim * t.lookups_per_example,
        "size_lookup_greedy": lambda t: t.info.dim * t.lookups_per_example * math.log10(max(t.info.rows, 1)),
    }


def greedy_baseline(problem: Problem, heuristic: str) -> tuple[list[int], bool]:
    """NeuroShard's greedy heuristics: (device per table, every table found room). A table that fits nowhere goes
    to the device with the most room left (the plan then does not fit)."""
    cost_of = _heuristics()[heuristic]
    tables = problem.tables
    n, limit = problem.devices, problem.topology.memory_bytes
    cost = [cost_of(t) for t in tables]
    size = [float(t.info.bytes) for t in tables]
    order = sorted(range(len(tables)), key=lambda i: (cost[i], size[i], i), reverse=True)
    sums, used = [0.0] * n, [0.0] * n
    devices, ok = [0] * len(tables), True
    for i in order:
        fits = [d for d in range(n) if used[d] + size[i] <= limit]
        if fits:
            d = min(fits, key=lambda d: (sums[d], used[d], d))
        else:
            ok, d = False, min(range(n), key=lambda d: (used[d], d))
        devices[i] = d
        sums[d] += cost[i]
        used[d] += size[i]
    return devices, ok


def random_baseline(problem: Problem, seed: int) -> list[int]:
    """A uniformly random device per table (numpy's default_rng(seed).integers), memory not consulted."""
    return np.random.default_rng(seed).integers(problem.devices, size=len(problem.tables)).tolist()


def baseline(problem: Problem, name: str, model: CostModel | None = None, seed: int = 0) -> PlannerResult:
    """Run one of BASELINES; its plan scored by `model` (default: the analytic model of the problem's exchange)."""
    model = model or AnalyticCostModel(problem.topology, problem.exchange)
    start = time.perf_counter()
    if name == "random":
        choices = [Choice("table", (d,)) for d in random_baseline(problem, seed)]
    elif name == "torchrec_greedy":
        choices, _ = torchrec_greedy(problem, model)
    elif name in HEURISTICS:
        choices = [Choice("table", (d,)) for d in greedy_baseline(problem, name)[0]]
    else:
        raise ValueError(f"unknown baseline {name!r}; the baselines are {BASELINES}")
    n = problem.devices
    placements = [c.placement(t.info, n, problem.row_split) for c, t in zip(choices, problem.tables, strict=True)]
    return finish(problem, name, placements, model, time.perf_counter() - start)
