"""NeuroShard's setting and search (Zha et al., MLSys 2023, "Pre-train and Search: Efficient Embedding Table Sharding
with Pre-trained Neural Cost Models"; code: github.com/daochenzha/neuroshard), re-implemented to be scored by
recjax's cost models (recjax/sharding/cost_model.py) next to recjax's planner.

Tasks (`neuroshard_tasks`, as its tools/gen_tasks.py draws them): each task draws its table count uniformly from
[10, 60], its tables from the pool *with replacement*, and for each table a dim from {4, 8, 16, 32, 64, 128}; a task
whose tables (rows x dim x 4 bytes, fp32, no optimizer state: SGD) exceed `total_gib` is drawn again. Devices have
`memory_gib` each (NeuroShard: 4 GPUs of 4 GB, at most 15 GB per task -- 4 x 4 - 1); the batch is 65,536. The pool
is recjax's Meta-shaped 856-table set (experiments/planning/meta_tables.py: the published statistics of the same
dataset, not the dataset itself).

Search (`neuroshard_plan`, its neurosharder.py):
  placement  tables (and column halves) by decreasing compute cost alone, each on the device with the lowest
             compute cost so far (the cost model's compute phases of the device's set; ties: less memory used)
             among those with room and whose sum of dims stays under scale x the mean sum of dims per device;
             scales 1.0, 1.05, ..., 1.5 (`search_steps`); the plan with the lowest step cost is kept
  splits     beam search (width `beam`, `depth` rounds) over "halve the columns of one shard": a shard of dim d
             becomes two of d / 2 (d / 2 a multiple of 4), placed independently; each round's candidates are the
             `top` largest and the `top` costliest shards of each state, each child placed as above; the best plan
             of every round is kept.
Everything is scored by one CostModel of the problem's exchange (the pooled one in benchmarks/planner.py's
neuroshard section): a column half is a column slice of its table (`PartTable.index(t, COLUMN, k)`, width d / k).
recjax's runtime splits columns over every device only, so these plans are a baseline to beat, not plans it runs.

`compare(problem)` runs every planner of benchmarks/planner.py's neuroshard section on one task and `summary(...)`
reduces many tasks to the section's figures (the notebook experiments/notebooks/sharding_planner.ipynb uses both).
"""

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from experiments.planning import baselines as B
from experiments.planning.meta_tables import BATCH, DIMS, MetaTable
from recjax.sharding import planner as P
from recjax.sharding.cost_model import (
    COLUMN,
    SHARDED,
    AccessProfile,
    AnalyticCostModel,
    CostModel,
    PartTable,
    PlanCost,
    PlannerTable,
    Problem,
    Topology,
    parts_cost,
)
from recjax.sharding.plan import TableInfo

GIB = 1 << 30
REDRAWS = 10_000  # draws of a task's tables before giving up on fitting them in total_gib
COMPUTE_PHASES = ("compute", "forward", "update")  # a model's phases that are not communication


# -------------------------------------------------------------------------------------------------------- tasks
def neuroshard_tasks(pool: Sequence[MetaTable], count: int = 100, devices: int = 4, seed: int = 0,
                     tables: tuple[int, int] = (10, 60), memory_gib: float = 4.0, total_gib: float | None = None,
                     batch: int = BATCH, topology=Topology.gpu_cluster, exchange: str = "pooled") -> list[Problem]:
    """`count` tasks as NeuroShard draws them (module docstring); `total_gib` defaults to devices x memory - 1."""
    total = (devices * memory_gib - 1) if total_gib is None else total_gib
    rng = np.random.default_rng(seed)
    rows = np.array([t.rows for t in pool], float)
    out = []
    for _ in range(count):
        size = int(rng.integers(tables[0], tables[1] + 1))
        for _ in range(REDRAWS):  # gen_tasks.py: redraw the whole task until it fits the total
            chosen = rng.integers(len(pool), size=size)
            dims = rng.choice(DIMS, size=size)
            if (rows[chosen] * dims * 4).sum() <= total * GIB:
                break
        else:
            raise ValueError(f"no draw of {size} tables out of {REDRAWS} fits in {total} GiB; raise total_gib or "
                             "draw fewer tables")
        task = []
        for j, (i, dim) in enumerate(zip(chosen.tolist(), dims.tolist(), strict=True)):
            t = pool[i]
            name = f"{j}:{t.name}"  # a table drawn twice is two tables
            info = TableInfo(name, name, "full", t.rows, int(dim), max(1, round(t.pooling)), 0)
            task.append(PlannerTable(info, t.pooling, AccessProfile.zipf(t.alpha, t.rows)))
        out.append(Problem(tuple(task), topology(devices, int(memory_gib * GIB)), batch, exchange=exchange))
    return out


# ------------------------------------------------------------------------------------------------------- search
@dataclasses.dataclass
class NeuroShardResult:
    """A NeuroShard plan: `shards` [(table, k, device)]: a column slice of width dim / k of the table (k = 1: the
    whole table) on a device; `splits`: the tables halved, in order."""

    name: str
    shards: list[tuple[int, int, int]]
    splits: list[int]
    cost: PlanCost
    fits: bool
    seconds: float

    def to_json(self) -> dict:
        split = sorted({t for t, k, _ in self.shards if k > 1})
        return {"planner": self.name, "fits": self.fits, "plan_seconds": self.seconds,
                "shardings": {"table": len({t for t, k, _ in self.shards if k == 1}),
                              "column_halves": len(split)}, **self.cost.to_json()}


class _Placer:
    """The greedy under dim caps, run for every cap at once (one readout per shard for all of them)."""

    def __init__(self, problem: Problem, model: CostModel, parts: PartTable, scales: np.ndarray):
        self.problem, self.model, self.parts, self.scales = problem, model, parts, scales
        self.compute_cols = [j for j, p in enumerate(model.phases) if p in COMPUTE_PHASES]
        self._phi: dict[int, np.ndarray] = {}

    def part(self, t: int, k: int) -> int:
        return self.parts.index(t, SHARDED) if k == 1 else self.parts.index(t, COLUMN, k)

    def phi(self, rows: Sequence[int]) -> np.ndarray:
        missing = [i for i in set(rows) if i not in self._phi]
        if missing:
            for i, v in zip(missing, self.model.summaries(self.parts, np.array(missing)), strict=True):
                self._phi[i] = v
        return np.array([self._phi[i] for i in rows])

    def compute(self, sums: np.ndarray) -> np.ndarray:
        return self.model.readout(sums)[:, self.compute_cols].sum(axis=1)

    def alone(self, shards: Sequence[tuple[int, int]]) -> np.ndarray:
        """Each shard's compute cost alone on a device."""
        return self.compute(self.phi([self.part(t, k) for t, k in shards]))

    def place(self, shards: Sequence[tuple[int, int]], alone: np.ndarray) -> tuple[list[int] | None, PlanCost | None]:
        """The best plan over the caps: (device per shard, its cost), or (None, None) when no cap places all."""
        n, s = self.problem.devices, len(self.scales)
        rows = [self.part(t, k) for t, k in shards]
        phi = self.phi(rows)
        size = self.parts.mem_bytes[rows]
        width = self.parts.width[rows]
        cap = self.scales * width.sum() / n
        limit = float(self.problem.topology.memory_bytes)
        sums = np.zeros((s, n, phi.shape[1]))
        mem, dims, load = np.zeros((s, n)), np.zeros((s, n)), np.zeros((s, n))
        alive = np.ones(s, bool)
        where = np.zeros((s, len(shards)), np.int64)
        lanes = np.arange(s)
        for i in sorted(range(len(shards)), key=lambda i: (alone[i], i), reverse=True):  # largest first
            ok = (mem + size[i] <= limit) & (dims + width[i] <= cap[:, None])
            key = np.where(ok, load, np.inf)
            best = key.min(axis=1)
            alive &= np.isfinite(best)
            tie = np.where(key == best[:, None], mem, np.inf)  # ties: the least memory used, then the lowest index
            d = np.argmin(tie, axis=1)
            where[:, i] = d
            sums[lanes, d] += phi[i]
            mem[lanes, d] += size[i]
            dims[lanes, d] += width[i]
            load[lanes, d] = self.compute(sums[lanes, d])
        lanes = np.nonzero(alive)[0]
        if not len(lanes):
            return None, None
        # Each cap's step cost from the devices' summaries already summed; the exchange from the storages (the same
        # for every cap when every part is pooled: none of their collectives depends on the owner).
        phases = self.model.readout(sums[lanes].reshape(len(lanes) * n, -1)).reshape(len(lanes), n, -1)
        if np.all(self.parts.pooled[rows] > 0):
            steps = phases.max(axis=1).sum(axis=1)
        else:
            steps = np.array([self._cost(rows, where[lane]).step for lane in lanes])
        lane = lanes[int(np.argmin(steps))]
        return where[lane].tolist(), self._cost(rows, where[lane])

    def _cost(self, rows: Sequence[int], where: np.ndarray) -> PlanCost:
        device_parts: list[list[int]] = [[] for _ in range(self.problem.devices)]
        for i, d in enumerate(where):
            device_parts[d].append(rows[i])
        return parts_cost(self.model, self.problem, self.parts, device_parts)


def neuroshard_plan(problem: Problem, model: CostModel | None = None, beam: int = 3, top: int = 10, depth: int = 10,
                    search_steps: int = 11, judge: CostModel | None = None) -> NeuroShardResult:
    """NeuroShard's search (module docstring) with `model`; the result scored by `judge` (default `model`)."""
    model = model or AnalyticCostModel(problem.topology, problem.exchange)
    start = time.perf_counter()
    parts = PartTable(problem)
    placer = _Placer(problem, model, parts, np.linspace(1.0, 1.5, search_steps))
    shards = [(t, 1) for t in range(len(problem.tables))]
    where, cost = placer.place(shards, placer.alone(shards))
    best = (cost.step if cost else np.inf, [], shards, where)
    frontier = [([], shards)]
    dims = np.array([t.info.dim for t in problem.tables])
    for _ in range(depth):
        children = []
        for splits, current in frontier:
            alone = placer.alone(current)
            size = parts.mem_bytes[[placer.part(t, k) for t, k in current]]
            picks = sorted(set(np.argsort(-size, kind="stable")[:top].tolist())
                           | set(np.argsort(-alone, kind="stable")[:top].tolist()))
            for i in picks:
                t, k = current[i]
                if (dims[t] // k // 2) % 4 or dims[t] % (2 * k):  # halves must stay multiples of 4
                    continue
                child = [*current[:i], (t, 2 * k), *current[i + 1:], (t, 2 * k)]
                child_alone = placer.alone(child)
                where, cost = placer.place(child, child_alone)
                step = cost.step if cost else np.inf
                children.append((step, [*splits, t], child))
                if step < best[0]:
                    best = (step, [*splits, t], child, where)
        if not children:
            break
        children.sort(key=lambda c: c[0])
        frontier = [(splits, child) for _, splits, child in children[:beam]]
    step, splits, shards, where = best
    seconds = time.perf_counter() - start
    if where is None:  # no cap placed every shard within memory: no plan (NeuroShard counts it out of memory)
        return NeuroShardResult("neuroshard", [], splits, PlanCost(np.zeros((problem.devices, len(model.phases))),
                                                                   np.inf, {}, model.phases), False, seconds)
    device_parts: list[list[int]] = [[] for _ in range(problem.devices)]
    for (t, k), d in zip(shards, where, strict=True):
        device_parts[d].append(placer.part(t, k))
    judge = judge or model
    cost = parts_cost(judge, problem, parts, device_parts)
    used = np.array([parts.mem_bytes[dp].sum() for dp in device_parts])
    fits = bool(np.all(used <= problem.topology.memory_bytes))
    return NeuroShardResult("neuroshard", [(t, k, d) for (t, k), d in zip(shards, where, strict=True)], splits,
                            cost, fits, seconds)


# ---------------------------------------------------------------------------------------------- comparison
HEURISTICS = ("random", "size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy")  # NeuroShard's five


def record(result, wall: float, cpu: float) -> dict:
    """What the comparison keeps of a planner's result."""
    return {"cost": result.cost.step, "fits": result.fits, "wall": wall, "cpu": cpu,
            "shardings": result.to_json()["shardings"], "exchange": result.cost.exchange,
            "phases_ms": result.cost.to_json()["phases_ms"],
            "compute_mean": float(result.cost.compute.sum(axis=1).mean())}


def compare(problem: Problem, seed: int = 0, neural=None, keep: dict | None = None) -> dict[str, dict]:
    """Every planner on one task, each plan scored by the analytic model of the task's exchange: recjax, recjax
    restricted to whole tables, NeuroShard's search, recjax searched with `neural` (a NeuralCostModel, when given),
    and experiments/planning/baselines.py's. {name: record}; `keep` receives {name: result} when given."""
    analytic = AnalyticCostModel(problem.topology, problem.exchange)
    runs = [("recjax", lambda: P.plan(problem, analytic, seed=seed)),
            ("recjax_table", lambda: P.plan(problem, analytic, seed=seed, kinds=("table",))),
            ("neuroshard", lambda: neuroshard_plan(problem, analytic))]
    if neural is not None:
        model = neural.for_topology(problem.topology)
        runs.append(("recjax_neural", lambda: P.plan(problem, model, seed=seed, judge=analytic)))
    runs += [(name, lambda name=name: B.baseline(problem, name, analytic, seed=seed)) for name in B.BASELINES]
    out = {}
    for name, run in runs:
        wall, cpu = time.perf_counter(), time.process_time()
        result = run()
        out[name] = record(result, time.perf_counter() - wall, time.process_time() - cpu)
        if keep is not None:
            keep[name] = result
    return out


def summary(devices: int, runs: Sequence[dict]) -> dict:
    """Many tasks' `compare` records (each with its "tables" count) reduced: fit rates, mean step costs, planning
    seconds, and recjax's (and its variants') cost against the best of NeuroShard's five heuristics on each task,
    the TorchRec-like greedy, NeuroShard and the rest (mean of the per-task ratios, ratio of the mean costs, the
    worst task), over the tasks where both fit."""
    planners = [p for p, v in runs[0].items() if isinstance(v, dict)]  # (records may also carry counts)

    def mean(values) -> float | None:
        values = [v for v in values if v is not None and np.isfinite(v)]
        return float(np.mean(values)) if values else None

    def best_heuristic(r: dict) -> float | None:
        fitting = [r[h]["cost"] for h in HEURISTICS if r[h]["fits"]]
        return min(fitting) if fitting else None

    out = {"devices": devices, "tasks": len(runs), "tables_mean": mean([r["tables"] for r in runs]),
           "fit_rate": {p: float(np.mean([r[p]["fits"] for r in runs])) for p in planners},
           "step_ms_mean": {p: mean([1e3 * r[p]["cost"] for r in runs if r[p]["fits"]]) for p in planners},
           "plan_wall_s_mean": {p: mean([r[p]["wall"] for r in runs]) for p in planners},
           "plan_wall_s_max": {p: float(max(r[p]["wall"] for r in runs)) for p in planners},
           "plan_cpu_s_mean": {p: mean([r[p]["cpu"] for r in runs]) for p in planners}}
    for ours in ("recjax", "recjax_neural", "recjax_table"):
        if ours not in planners:
            continue
        vs = {}
        for other in ("best_heuristic", "torchrec_greedy", "neuroshard", "recjax_table", *HEURISTICS):
            if other == ours:
                continue
            if other == "best_heuristic":
                pairs = [(r[ours]["cost"], best_heuristic(r)) for r in runs if r[ours]["fits"]]
                pairs = [(a, b) for a, b in pairs if b is not None]
            else:
                pairs = [(r[ours]["cost"], r[other]["cost"]) for r in runs if r[ours]["fits"] and r[other]["fits"]]
            if pairs:
                a, b = np.array(pairs).T
                vs[other] = {"mean_ratio": float(np.mean(a / b)), "ratio_of_means": float(a.mean() / b.mean()),
                             "worst_ratio": float(np.max(a / b)), "tasks": len(pairs)}
        out[f"{ours}_vs"] = vs
    return out
