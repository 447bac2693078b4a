"""The sharding planner: the plan with the lowest step cost (the slowest device's) that fits every device's memory.

    result = plan(Problem(tables, topology, batch_size), model=AnalyticCostModel(topology), seed=0)
    result.placements   # TablePlacement per table: a `ShardingPlan`'s, which recjax/sharding/exchange.py runs
    result.cost         # PlanCost: per-device compute, the exchange every device pays, the max

`sharding.plan=auto` calls `auto_placements` (from `make_plan`, below). Costs come from one interface
(recjax/sharding/cost_model.py: the analytic model, or the pre-trained neural one of experiments/planning/cost_net.py).

Search (deterministic given the seed; every move is checked against every device's memory first):
  1. greedy: tables by decreasing standalone cost (the LPT order); each goes where the resulting step cost is lowest
     (ties: the fullest device's memory, then the sum of device costs), among: whole on any device with room; rows
     over the k least-loaded devices with room, for k around its share of the work and of its storage's ids (the
     power of two above it, half and twice that) and k = n; column-wise over all devices (when its dim splits evenly
     and its optimizer state is element-wise); replicated (tables up to `replicate_limit`, when the copies leave room
     for the tables still to come). A split or replica has to lower the step cost by SPLIT_GAIN to beat a whole table.
     The TorchRec-like baseline's plan (below) is a second start: the search goes on from the better of the two, so
     it never ends above that baseline when the baseline fits.
  2. local search: moves of a part from the most loaded device to one of the least loaded ones, swaps of a part
     there with a smaller one, and moves of a part from the owner with the most expected ids of a costly storage to
     the owners with the fewest, while the step cost (then the sum of squared device costs) falls; then `restarts`
     seeded perturbations (random moves off the most loaded devices) each followed by local search, keeping the best.
  3. beam search over split counts (NeuroShard's beam search over column-wise shardings, Zha et al. 2023): a state is
     the plan above; its children split one of the `branch` costliest tables of the slowest device (or of the whole
     task) further -- whole -> rows over 2 devices -> 4 -> ... -> n -> column-wise -- each followed by a short local
     search; the `width` best states are kept for `depth` rounds. NeuroShard halves a table's columns onto two GPUs;
     recjax's exchange splits columns over every device only (recjax/sharding/exchange.py), so a split onto k < n
     devices is row-wise: with `row_split=mod`, or ids not numbered by frequency, each part sees an even share of the
     lookups, as a column shard does.

Baselines (same module, same cost model; the table-wise heuristics as NeuroShard's paper and code define them):
  random               each table on a uniformly random device (seeded), memory not consulted (a plan may not fit)
  size_greedy          tables by decreasing cost, each on the device with the lowest sum of costs among those with
  dim_greedy           room (ties: the least memory used, then the lowest index); cost = bytes, dim, dim x pooling,
  lookup_greedy        dim x pooling x log10(rows) respectively
  size_lookup_greedy
  torchrec_greedy      TorchRec-like: per table the sharding type (table-wise, row-wise, table-row-wise within a host,
                       column-wise, data-parallel) with the lowest estimated cost, shards placed largest first on the
                       device with the lowest accumulated cost; a table whose shard fits nowhere falls back to its next
                       option (by cost) with smaller shards and the partition starts again
"""

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from recjax.errors import ConfigError
from recjax.sharding.cost_model import (
    COLUMN,
    KINDS,
    REPLICATED,
    SHARDED,
    AnalyticCostModel,
    CostModel,
    PartTable,
    PlanCost,
    PlannerTable,
    Problem,
    StorageStats,
    Topology,
    device_memory,
    plan_cost,
)
from recjax.sharding.plan import (
    REPLICATE_BYTES,
    ShardingPlan,
    TableInfo,
    TablePlacement,
    balance_blocks,
    check_fits,
    device_costs,
    owner_costs,
    parse_overrides,
)

AXES = ("data", "model")
SEARCHES = ("greedy", "local", "beam")
KINDS_ALL = frozenset({"table", "row", "column", "replicated"})
BASELINES = ("random", "size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy", "torchrec_greedy")
_REL = 1e-9  # objective improvements smaller than this (relative) do not count: no cycling on float noise
SPLIT_GAIN = 1e-3  # greedy: a split (or replica) must lower the step cost by this share to beat a whole table


@dataclasses.dataclass(frozen=True)
class Choice:
    """A table's sharding in the search: "table" (devices = (d,)), "row" (part j on devices[j]), "column" or
    "replicated" (every device)."""

    kind: str
    devices: tuple[int, ...] = ()

    def placement(self, info: TableInfo, n: int, row_split: str) -> TablePlacement:
        if self.kind == "table":
            return TablePlacement(info, "table", AXES, self.devices)
        if self.kind == "row":
            return TablePlacement(info, "row", AXES, self.devices, row_split)
        if self.kind == "column":
            return TablePlacement(info, "column", AXES, tuple(range(n)))
        return TablePlacement(info, "replicated", (), ())

    @classmethod
    def of(cls, p: TablePlacement) -> "Choice":
        if p.sharding in ("replicated", "data_parallel"):
            return cls("replicated")
        if p.sharding == "column":
            return cls("column")
        if p.axes != AXES:
            raise ValueError(f"table {p.table.name!r}: the planner places row-wise tables over every device, not over "
                             f"{p.axes}")
        return cls("table" if p.sharding == "table" else "row", tuple(p.devices))


@dataclasses.dataclass
class Outcome:
    """What a candidate change would make of the state: the step cost, the fullest device's bytes, the sum and the
    sum of squares of device costs."""

    max: float
    fullest: float
    total: float
    squares: float


class State:
    """A (partial) plan and what the search updates incrementally: each device's parts, memory, summary (the sum of
    its parts' `CostModel.summaries`) and compute, the per-owner slot sums of the table-/row-wise storages and the
    cost of every storage."""

    def __init__(self, problem: Problem, model: CostModel, parts: PartTable | None = None,
                 kinds: frozenset = KINDS_ALL):
        self.problem, self.model = problem, model
        self.kinds = frozenset(kinds)  # the shardings the search may choose
        self.parts = parts or PartTable(problem)
        n = self.n = problem.devices
        self.limit = float(problem.topology.memory_bytes)
        self.choices: dict[int, Choice] = {}
        self.device_parts: list[list[int]] = [[] for _ in range(n)]
        self.mem = np.zeros(n)
        self.sums = np.zeros((n, model.summary_size))
        self.compute = np.zeros(n)
        self.sharded: dict[int, np.ndarray] = {}  # dim -> f64[3, n]: expected, worst, requested slots per owner
        self.members: dict[tuple[int, int], dict[int, float]] = {}  # (dim, kind) -> {table: compact slots}
        self.storage_cost: dict[tuple[int, int], float] = {}
        self._phi = np.zeros((0, model.summary_size))  # summaries of part rows, computed on first use
        self._has_phi = np.zeros(0, bool)
        b = problem.batch_size / n
        self.slots_of_dim: dict[int, float] = {}
        for t in problem.tables:
            self.slots_of_dim[t.info.dim] = self.slots_of_dim.get(t.info.dim, 0.0) + b * t.info.bag_size

    def copy(self) -> "State":
        other = object.__new__(State)
        other.__dict__.update(self.__dict__)
        other.choices = dict(self.choices)
        other.device_parts = [list(p) for p in self.device_parts]
        other.mem, other.sums, other.compute = self.mem.copy(), self.sums.copy(), self.compute.copy()
        other.sharded = {k: v.copy() for k, v in self.sharded.items()}
        other.members = {k: dict(v) for k, v in self.members.items()}
        other.storage_cost = dict(self.storage_cost)
        return other  # the part table and the summary cache are shared (append-only)

    # --------------------------------------------------------------------------------------------- reading
    def parts_of(self, t: int, choice: Choice) -> list[tuple[int, int]]:
        """[(device, part row)] of table t under `choice`."""
        index = self.parts.index
        if choice.kind == "table":
            return [(choice.devices[0], index(t, SHARDED))]
        if choice.kind == "row":
            base = index(t, SHARDED, len(choice.devices), 0)  # part j is row base + j
            return [(d, base + j) for j, d in enumerate(choice.devices)]
        kind = COLUMN if choice.kind == "column" else REPLICATED
        i = index(t, kind)
        return [(d, i) for d in range(self.n)]

    def phi(self, ids: np.ndarray) -> np.ndarray:
        """f64[len(ids), H]: the parts' summaries (cached per part row)."""
        ids = np.asarray(ids, np.int64)
        if self.parts.size > len(self._has_phi):
            grow = max(self.parts.size, 2 * len(self._has_phi)) - len(self._has_phi)
            self._phi = np.concatenate([self._phi, np.zeros((grow, self.model.summary_size))])
            self._has_phi = np.concatenate([self._has_phi, np.zeros(grow, bool)])
        missing = np.unique(ids[~self._has_phi[ids]])
        if missing.size:
            self._phi[missing] = self.model.summaries(self.parts, missing)
            self._has_phi[missing] = True
        return self._phi[ids]

    @property
    def exchange(self) -> float:
        return float(sum(self.storage_cost.values()))

    def totals(self) -> np.ndarray:
        return self.compute + self.exchange

    def objective(self) -> tuple[float, float]:
        totals = self.totals()
        return float(totals.max()), float((totals ** 2).sum())

    def fits(self) -> bool:
        return bool(np.all(self.mem <= self.limit))

    def cost(self) -> PlanCost:
        return PlanCost(self.compute.copy(), self.exchange,
                        {(d, KINDS[k]): c for (d, k), c in sorted(self.storage_cost.items())})

    def placements(self) -> tuple[TablePlacement, ...]:
        p = self.problem
        return tuple(self.choices[t].placement(p.tables[t].info, self.n, p.row_split) for t in range(len(p.tables)))

    # -------------------------------------------------------------------------------------------- changing
    def _effects(self, delta: Mapping[int, Choice | None]):
        """What `delta` ({table: new choice, or None to remove it}) changes: the part moves [(device, row, +-1)],
        the touched devices with their summary and memory changes, and the touched storages' new slot sums /
        members."""
        moves: list[tuple[int, int, int]] = []
        for t, new in delta.items():
            old = self.choices.get(t)
            if old is not None:
                moves += [(d, i, -1) for d, i in self.parts_of(t, old)]
            if new is not None:
                moves += [(d, i, 1) for d, i in self.parts_of(t, new)]
        a = np.array(moves, np.int64).reshape(-1, 3)
        devices, inverse = np.unique(a[:, 0], return_inverse=True)
        signs = a[:, 2].astype(float)
        order = np.argsort(inverse, kind="stable")  # the moves' summaries summed per device (sorted, reduceat)
        starts = np.searchsorted(inverse[order], np.arange(len(devices)))
        dsum = np.add.reduceat(self.phi(a[order, 1]) * signs[order, None], starts, axis=0)
        dmem = np.bincount(inverse, signs * self.parts.mem_bytes[a[:, 1]], len(devices))
        parts = self.parts
        rows = a[:, 1]
        kinds, dims = parts.kind[rows].astype(int), parts.dim[rows].astype(int)
        sharded: dict[int, np.ndarray] = {}
        for dim in np.unique(dims[kinds == SHARDED]).tolist():
            mine = (kinds == SHARDED) & (dims == dim)
            arr = sharded[dim] = self.sharded.get(dim, np.zeros((3, self.n))).copy()
            r, d, w = rows[mine], a[mine, 0], signs[mine]
            for f, field in enumerate((parts.expected_slots, parts.worst_slots, parts.requested)):
                arr[f] += np.bincount(d, w * field[r], self.n)
        members: dict[tuple[int, int], dict[int, float]] = {}
        for j in np.nonzero(kinds != SHARDED)[0].tolist():  # one entry per table (its copies / slices share it)
            key = (int(dims[j]), int(kinds[j]))
            m = members.get(key)
            if m is None:
                m = members[key] = dict(self.members.get(key, {}))
            table = int(parts.table[rows[j]])
            if signs[j] < 0:
                m.pop(table, None)
            else:
                m[table] = float(parts.compact[rows[j]])
        return moves, devices, dsum, dmem, sharded, members

    def _storage_rows(self, sharded: Mapping[int, np.ndarray], members: Mapping[tuple[int, int], dict]
                      ) -> list[tuple[tuple[int, int], tuple]]:
        rows = []
        for dim, arr in sharded.items():
            top = arr.max(axis=1)
            rows.append(((dim, SHARDED), (SHARDED, dim, top[0], top[1], top[2], 0.0)))
        for (dim, kind), m in members.items():
            rows.append(((dim, kind), (kind, dim, 0.0, 0.0, 0.0, min(self.slots_of_dim[dim], sum(m.values())))))
        return rows

    def _storage_costs(self, rows: Sequence[tuple]) -> np.ndarray:
        if not rows:
            return np.zeros(0)
        a = np.array(rows, float)
        return self.model.exchange(StorageStats(a[:, 0].astype(int), a[:, 1], a[:, 2], a[:, 3], a[:, 4], a[:, 5]))

    def apply(self, delta: Mapping[int, Choice | None]) -> None:
        moves, devices, dsum, dmem, sharded, members = self._effects(delta)
        for d, i, sign in moves:
            if sign < 0:
                self.device_parts[d].remove(i)
        for d, i, sign in moves:
            if sign > 0:
                self.device_parts[d].append(i)
        self.mem[devices] += dmem
        self.sums[devices] += dsum
        for d in devices:
            if not self.device_parts[d]:  # no float residue on an emptied device
                self.sums[d] = 0.0
                self.mem[d] = 0.0
        self.compute[devices] = self.model.readout(self.sums[devices])
        for dim, arr in sharded.items():
            if np.any(arr[1] > 1e-9):
                self.sharded[dim] = arr
            else:
                self.sharded.pop(dim, None)
        for key, m in members.items():
            if m:
                self.members[key] = m
            else:
                self.members.pop(key, None)
        for t, c in delta.items():
            if c is None:
                self.choices.pop(t, None)
            else:
                self.choices[t] = c
        keys = [(dim, SHARDED) for dim in sharded] + list(members)
        for key in keys:
            self.storage_cost.pop(key, None)
        rows = self._storage_rows({k: self.sharded[k] for k in sharded if k in self.sharded},
                                  {k: self.members[k] for k in members if k in self.members})
        for (key, _), cost in zip(rows, self._storage_costs([r for _, r in rows]), strict=True):
            self.storage_cost[key] = float(cost)

    def evaluate(self, deltas: Sequence[Mapping[int, Choice | None]]) -> list[Outcome | None]:
        """The outcome of each delta applied alone to this state (None: a device would exceed its memory, or an
        already overfull one would grow). One readout call and one exchange call for all of them."""
        new_sums: list[np.ndarray] = []
        rows: list[tuple] = []
        pending = []
        count = 0
        for delta in deltas:
            _, devices, dsum, dmem, sharded, members = self._effects(delta)
            mem = self.mem[devices] + dmem
            if np.any((mem > self.limit) & (dmem > 0)):
                pending.append(None)
                continue
            new_sums.append(self.sums[devices] + dsum)
            keys = []
            for key, row in self._storage_rows(sharded, members):
                keys.append((key, len(rows)))
                rows.append(row)
            pending.append((devices, slice(count, count + len(devices)), keys, mem))
            count += len(devices)
        compute = self.model.readout(np.concatenate(new_sums)) if new_sums else np.zeros(0)
        storage = self._storage_costs(rows)
        order = np.argsort(-self.compute, kind="stable")
        mem_order = np.argsort(-self.mem, kind="stable")
        exchange = self.exchange
        c_sum, c_sq = float(self.compute.sum()), float((self.compute ** 2).sum())
        out: list[Outcome | None] = []
        for entry in pending:
            if entry is None:
                out.append(None)
                continue
            devices, where, keys, mem = entry
            new_x = exchange + sum(storage[r] - self.storage_cost.get(key, 0.0) for key, r in keys)
            changed = compute[where]
            touched = set(devices.tolist())
            rest = next((self.compute[d] for d in order if d not in touched), -math.inf)
            rest_mem = next((self.mem[d] for d in mem_order if d not in touched), -math.inf)
            old = self.compute[devices]
            s1 = c_sum - old.sum() + changed.sum()
            s2 = c_sq - (old ** 2).sum() + (changed ** 2).sum()
            out.append(Outcome(max(rest, changed.max()) + new_x, max(rest_mem, mem.max()),
                               s1 + self.n * new_x, s2 + 2 * new_x * s1 + self.n * new_x ** 2))
        return out


def _better(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """a < b lexicographically, each component by more than a relative _REL."""
    for x, y in zip(a, b, strict=True):
        if x < y - _REL * max(abs(y), 1e-30):
            return True
        if x > y + _REL * max(abs(y), 1e-30):
            return False
    return False


# ---------------------------------------------------------------------------------------------------- greedy
def standalone_costs(state: State, kind: int = SHARDED) -> np.ndarray:
    """f64[T]: each table's whole-table part alone on an empty device (compute) plus its storage alone (exchange)."""
    parts = state.parts
    ids = np.array([parts.index(t, kind) for t in range(len(state.problem.tables))], np.int64)
    compute = state.model.readout(state.phi(ids))
    rows = [(kind, parts.dim[i], parts.expected_slots[i], parts.worst_slots[i], parts.requested[i],
             parts.compact[i]) for i in ids]
    return compute + state._storage_costs(rows)


def split_counts(n: int) -> list[int]:
    """Row-wise part counts the search offers: 2, 4, 8, ... and n."""
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n] if n > 1 else []


def _lowest(state: State, count: int, need: float, exclude: Sequence[int] = ()) -> list[int] | None:
    """The `count` devices with the lowest compute (then lowest index) that have `need` bytes free."""
    order = np.lexsort((np.arange(state.n), state.compute))
    ok = order[state.mem[order] + need <= state.limit]
    if len(exclude):
        ok = ok[~np.isin(ok, exclude)]
    return ok[:count].tolist() if len(ok) >= count else None


def _row_choice(state: State, t: int, k: int, keep: Sequence[int] = ()) -> Choice | None:
    """Rows of t over k devices: `keep` (its current ones) plus the least loaded with room for the largest part."""
    info = state.problem.tables[t].info
    need = max(state.parts.value("mem_bytes", t, SHARDED, k, j) for j in range(min(k, 2)))
    if info.rows < k:
        return None
    extra = _lowest(state, k - len(keep), need, keep)
    return None if extra is None else Choice("row", (*keep, *extra))


def greedy(problem: Problem, model: CostModel, fixed: Mapping[int, Choice] | None = None,
           parts: PartTable | None = None, kinds: frozenset = KINDS_ALL) -> State:
    """Step 1 of the module docstring, choosing among `kinds`. Tables that fit nowhere even split over every device
    are split so anyway (the state then does not fit: `State.fits`)."""
    state = State(problem, model, parts, kinds)
    fixed = dict(fixed or {})
    if fixed:
        state.apply(fixed)
    alone = standalone_costs(state)
    infos = [t.info for t in problem.tables]
    order = sorted((t for t in range(len(infos)) if t not in fixed),
                   key=lambda t: (-alone[t], -infos[t].bytes, infos[t].name))
    fair = alone.sum() / state.n
    # A table worth splitting: its own cost above a device's fair share, or more ids a step than its storage's fair
    # share per owner (whole, it alone would size every device's buckets to that storage).
    slots = np.array([t.info.bag_size for t in problem.tables], float)
    dims = np.array([t.info.dim for t in problem.tables])
    fair_slots = {d: slots[dims == d].sum() / state.n for d in set(dims.tolist())}
    remaining = sum(infos[t].bytes for t in order)
    for t in order:
        # Parts small enough: each at most a fair share of the work and of its storage's ids (a power of two).
        share = max(alone[t] / fair, slots[t] / fair_slots[int(dims[t])]) if fair > 0 else 1.0
        remaining -= infos[t].bytes
        state.apply({t: _best_choice(state, t, share, remaining)})
    return state


def _best_choice(state: State, t: int, share: float, remaining: float) -> Choice:
    """Where table t goes (step 1): whole on the best device, or rows over k/2, k and 2k devices for the power of
    two k >= `share` (how many times a device's fair share the table is) and over all n, or column-wise, or
    replicated where the copies leave room for the `remaining` bytes of the tables after it."""
    p = state.problem
    info = p.tables[t].info
    n = state.n
    pid = state.parts.index(t, SHARDED)
    need = state.parts.mem_bytes[pid]
    room = np.nonzero(state.mem + need <= state.limit)[0]
    best: tuple[tuple, Choice] | None = None
    kinds = state.kinds
    if room.size and "table" in kinds:
        best = _best_device(state, t, pid, room)
    others: list[Choice] = []
    if "row" in kinds and n > 1:
        k = 2 ** math.ceil(math.log2(max(share, 2.0)))
        ks = [c for c in split_counts(n) if c in (k // 2, k, 2 * k, n)] if room.size else split_counts(n)
        others += [c for k in ks if (c := _row_choice(state, t, k)) is not None]
    column = "column" in kinds and p.column_allowed(t) and n > 1
    if column and np.all(state.mem + state.parts.value("mem_bytes", t, COLUMN) <= state.limit):
        others.append(Choice("column"))
    free_after = (state.limit - state.mem - info.bytes).clip(min=0).sum()
    if ("replicated" in kinds and info.bytes <= replicate_limit(state.limit) and n > 1
            and np.all(state.mem + info.bytes <= state.limit) and free_after >= 1.25 * remaining):
        others.append(Choice("replicated"))
    for choice, outcome in zip(others, state.evaluate([{t: c} for c in others]), strict=True):
        if outcome is None:
            continue
        key = (outcome.max, outcome.fullest, outcome.total)
        # A split must lower the step cost by SPLIT_GAIN to be worth its parts (else: fewer parts, simpler plans).
        if best is None or (key[0] < best[0][0] * (1 - SPLIT_GAIN) if best[1].kind == "table" else _better(key,
                                                                                                          best[0])):
            best = (key, choice)
    if best is None:  # fits nowhere: rows over every device (or whole on the emptiest), and memory says by how much
        if n > 1 and "row" in kinds:
            return Choice("row", tuple(range(n)))
        return Choice("table", (int(np.argmin(state.mem)),))
    return best[1]


def replicate_limit(memory_bytes: float) -> float:
    """Tables up to this size may be replicated: REPLICATE_BYTES, or 1 % of a device's memory if more (a copy on
    every device must not crowd out the tables that have to be placed after it)."""
    return max(REPLICATE_BYTES, 0.01 * memory_bytes)


def _best_device(state: State, t: int, pid: int, room: np.ndarray) -> tuple[tuple, Choice]:
    """The whole table on each device of `room` at once (one readout, one exchange call): the best one."""
    parts = state.parts
    dim = int(parts.dim[pid])
    new_compute = state.model.readout(state.sums[room] + state.phi(np.array([pid]))[0])
    # The table's storage after it joins each candidate owner: the owner's slot sums grow, the max may too.
    arr = state.sharded.get(dim, np.zeros((3, state.n)))
    add = np.array([parts.expected_slots[pid], parts.worst_slots[pid], parts.requested[pid]])
    padded = np.concatenate([arr, np.full((3, 1), -math.inf)], axis=1)
    top2 = -np.sort(-padded, axis=1)[:, :2]
    arg = arr.argmax(axis=1)
    excl = np.where(arg[:, None] == room[None, :], top2[:, 1:2], top2[:, 0:1])  # [3, R] max over the other owners
    tops = np.maximum(excl, arr[:, room] + add[:, None])
    stats = StorageStats(np.full(len(room), SHARDED), np.full(len(room), float(dim)), tops[0], tops[1], tops[2],
                         np.zeros(len(room)))
    new_x = state.exchange - state.storage_cost.get((dim, SHARDED), 0.0) + state.model.exchange(stats)
    comp = state.compute
    order = np.argsort(-comp, kind="stable")
    second = comp[order[1]] if state.n > 1 else -math.inf
    rest = np.where(room == order[0], second, comp[order[0]])
    top = np.maximum(rest, new_compute) + new_x
    mem_after = state.mem[room] + parts.mem_bytes[pid]
    mem_order = np.argsort(-state.mem, kind="stable")
    m2 = state.mem[mem_order[1]] if state.n > 1 else -math.inf
    fullest = np.maximum(np.where(room == mem_order[0], m2, state.mem[mem_order[0]]), mem_after)
    total = comp.sum() - comp[room] + new_compute + state.n * new_x
    r = np.lexsort((room, total, fullest, top))[0]
    return (float(top[r]), float(fullest[r]), float(total[r])), Choice("table", (int(room[r]),))


# ------------------------------------------------------------------------------------------------ local search
def local_search(state: State, rounds: int = 10_000, targets: int = 4, width: int = 8) -> int:
    """Step 2's moves and swaps until none improves the objective (or `rounds` are done): the number applied.
    Each round tries the `width` costliest parts of the slowest device against the `targets` least loaded devices
    (moves, and swaps with up to `width` smaller parts there), and the parts of the owner with the most expected ids
    of each of the two costliest table-/row-wise storages against the `targets` owners with the fewest."""
    applied = 0
    for _ in range(rounds):
        current = state.objective()
        deltas = _compute_moves(state, targets, width) + _exchange_moves(state, targets, width)
        if not deltas:
            break
        best, best_key = None, current
        for delta, outcome in zip(deltas, state.evaluate(deltas), strict=True):
            if outcome is not None and _better((outcome.max, outcome.squares), best_key):
                best, best_key = delta, (outcome.max, outcome.squares)
        if best is None:
            break
        state.apply(best)
        applied += 1
    return applied


def _sharded_parts(state: State, d: int) -> list[tuple[int, int]]:
    """[(table, part row)] of the table- and row-wise parts on device d."""
    parts = state.parts
    return [(int(parts.table[i]), i) for i in state.device_parts[d] if parts.kind[i] == SHARDED]


def _moved(choice: Choice, old: int, new: int) -> Choice:
    pos = choice.devices.index(old)
    return Choice(choice.kind, choice.devices[:pos] + (new,) + choice.devices[pos + 1:])


def _compute_moves(state: State, targets: int, width: int) -> list[dict[int, Choice]]:
    worst = int(np.lexsort((np.arange(state.n), -state.compute))[0])
    light = [int(d) for d in np.lexsort((np.arange(state.n), state.compute)) if d != worst][:targets]

    def by_size(d):  # [(compute alone, table)] of the device's movable parts, largest first
        items = _sharded_parts(state, d)
        if not items:
            return []
        alone = state.model.readout(state.phi(np.array([i for _, i in items])))
        return sorted(zip(alone.tolist(), [t for t, _ in items], strict=True), key=lambda x: (-x[0], x[1]))

    here = by_size(worst)[:width]
    there = {d: by_size(d) for d in light}
    deltas: list[dict[int, Choice]] = []
    for size, t in here:
        ch = state.choices[t]
        for d in light:
            if d in ch.devices:
                continue
            moved = _moved(ch, worst, d)
            deltas.append({t: moved})
            smaller = [t2 for size2, t2 in there[d] if size2 < size and t2 != t
                       and worst not in state.choices[t2].devices][:width]
            deltas += [{t: moved, t2: _moved(state.choices[t2], d, worst)} for t2 in smaller]
    return deltas


def _exchange_moves(state: State, targets: int, width: int) -> list[dict[int, Choice]]:
    deltas: list[dict[int, Choice]] = []
    costly = sorted(((c, key) for key, c in state.storage_cost.items() if key[1] == SHARDED), reverse=True)[:2]
    parts = state.parts
    for _, (dim, _) in costly:
        expected = state.sharded[dim][0]
        owner = int(np.lexsort((np.arange(state.n), -expected))[0])
        emptiest = [int(d) for d in np.lexsort((np.arange(state.n), expected)) if d != owner][:targets]
        mine = sorted(((parts.expected_slots[i], t) for t, i in _sharded_parts(state, owner) if parts.dim[i] == dim),
                      key=lambda x: (-x[0], x[1]))[:width]
        for _, t in mine:
            ch = state.choices[t]
            deltas += [{t: _moved(ch, owner, d)} for d in emptiest if d not in ch.devices]
    return deltas


def perturb(state: State, rng: np.random.Generator, moves: int) -> None:
    """Move `moves` random whole tables off the most loaded devices to random devices with room."""
    for _ in range(moves):
        heavy = np.argsort(-state.compute, kind="stable")[:max(1, state.n // 4)]
        d = int(rng.choice(heavy))
        tables = sorted(t for t, c in state.choices.items() if c.kind == "table" and c.devices == (d,))
        if not tables:
            continue
        t = int(rng.choice(tables))
        need = state.parts.value("mem_bytes", t, SHARDED)
        room = [e for e in range(state.n) if e != d and state.mem[e] + need <= state.limit]
        if room:
            state.apply({t: Choice("table", (int(rng.choice(room)),))})


# ------------------------------------------------------------------------------------------------- beam search
def _next_split(state: State, t: int) -> Choice | None:
    """Whole -> rows over 2 -> 4 -> ... -> n -> column-wise (when allowed); None when there is nothing further."""
    ch, n = state.choices[t], state.n
    rows, columns = "row" in state.kinds and n > 1, "column" in state.kinds and state.problem.column_allowed(t)
    if ch.kind == "table" and rows:
        return _row_choice(state, t, 2, ch.devices)
    if ch.kind == "row" and len(ch.devices) < n:
        return _row_choice(state, t, min(2 * len(ch.devices), n), ch.devices)
    if ch.kind in ("table", "row") and columns and n > 1:
        return Choice("column")
    return None


def beam_search(state: State, width: int = 3, depth: int = 6, branch: int = 6, polish: int = 20) -> State:
    """Step 3 of the module docstring; returns the best state seen (`state` itself if no split helps)."""
    best, beam = state, [state]
    alone = standalone_costs(state)
    seen = {_signature(state)}
    for _ in range(depth):
        children = []
        for s in beam:
            for t in _split_candidates(s, alone, branch):
                new = _next_split(s, t)
                outcome = s.evaluate([{t: new}])[0] if new is not None else None
                if outcome is None:
                    continue
                child = s.copy()
                child.apply({t: new})
                local_search(child, rounds=polish)
                sig = _signature(child)
                if sig not in seen:
                    seen.add(sig)
                    children.append(child)
        if not children:
            break
        children.sort(key=lambda s: s.objective())
        beam = children[:width]
        if _better(beam[0].objective(), best.objective()):
            best = beam[0]
    return best


def _signature(state: State) -> tuple:
    return tuple(sorted((t, c.kind, c.devices) for t, c in state.choices.items()))


def _split_candidates(state: State, alone: np.ndarray, branch: int) -> list[int]:
    """The tables on the slowest device by decreasing standalone cost, then the costliest of the others."""
    worst = int(np.argmax(state.compute))
    splittable = [t for t, c in state.choices.items() if c.kind in ("table", "row")]
    on_worst = sorted((t for t in splittable if worst in state.choices[t].devices), key=lambda t: -alone[t])
    rest = sorted((t for t in splittable if worst not in state.choices[t].devices), key=lambda t: -alone[t])
    return (on_worst + rest)[:branch]


# ----------------------------------------------------------------------------------------------------- driver
@dataclasses.dataclass
class PlannerResult:
    name: str
    placements: tuple[TablePlacement, ...]
    cost: PlanCost
    fits: bool
    seconds: float  # planning wall time

    def placement_of(self, table: str) -> TablePlacement:
        return next(p for p in self.placements if p.table.name == table)

    def to_json(self) -> dict:
        kinds: dict[str, int] = {}
        for p in self.placements:
            kinds[p.sharding] = kinds.get(p.sharding, 0) + 1
        return {"planner": self.name, "fits": self.fits, "plan_seconds": self.seconds, "shardings": kinds,
                **self.cost.to_json()}


def plan(problem: Problem, model: CostModel | None = None, *, search: str = "beam", seed: int = 0,
         fixed: Mapping[int, Choice] | None = None, restarts: int = 2, beam_width: int = 3, beam_depth: int = 6,
         beam_branch: int = 6, judge: CostModel | None = None, kinds: Sequence[str] = tuple(sorted(KINDS_ALL))
         ) -> PlannerResult:
    """The recjax planner (`search`: greedy, local = greedy + local search + restarts, beam = local + beam search)
    over the shardings in `kinds`. `judge` (default `model`) scores the final plan, e.g. the analytic model for a
    plan searched with the neural one."""
    unknown = set(kinds) - KINDS_ALL
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {sorted(KINDS_ALL)}, got {list(kinds)}")
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
    model = model or AnalyticCostModel(problem.topology)
    start = time.perf_counter()
    state = greedy(problem, model, fixed, kinds=frozenset(kinds))
    if search != "greedy":
        # A second start: each table's best sharding on its own (the TorchRec-like construction); search on from
        # the better. Whole storages change kind at once this way, which single-table moves cannot do: a storage's
        # fixed costs (latencies, kernels, bucket margins) make the first table of a new kind never pay off alone.
        choices, _ = torchrec_greedy(problem, model, state.parts, frozenset(kinds))
        other = State(problem, model, state.parts, frozenset(kinds))
        other.apply({t: fixed[t] if fixed and t in fixed else c for t, c in enumerate(choices)})
        if other.fits() and (not state.fits() or _better(other.objective(), state.objective())):
            state = other
        local_search(state)
        rng = np.random.default_rng(seed)
        best = state
        for _ in range(restarts):
            trial = best.copy()
            perturb(trial, rng, moves=max(2, len(problem.tables) // 20))
            local_search(trial)
            if _better(trial.objective(), best.objective()):
                best = trial
        state = best
    if search == "beam":
        state = beam_search(state, beam_width, beam_depth, beam_branch)
    placements = state.placements()
    seconds = time.perf_counter() - start
    if judge is None or judge is model:
        return finish(problem, f"recjax_{search}", placements, None, seconds, state.cost())
    return finish(problem, f"recjax_{search}", placements, judge, seconds)


def finish(problem: Problem, name: str, placements: Sequence[TablePlacement], model: CostModel | None,
           seconds: float, cost: PlanCost | None = None) -> PlannerResult:
    """The result, its memory fit checked with `TablePlacement.device_bytes` and its cost under `model` (or `cost`,
    already known)."""
    fits = bool(np.all(device_memory(problem, placements) <= problem.topology.memory_bytes))
    return PlannerResult(name, tuple(placements), cost or plan_cost(model, problem, placements), fits, seconds)


# --------------------------------------------------------------------------------------------------- baselines
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


def torchrec_greedy(problem: Problem, model: CostModel, parts: PartTable | None = None,
                    allowed: frozenset = KINDS_ALL) -> tuple[list[Choice], bool]:
    """The TorchRec-like baseline (module docstring): (a choice per table, every shard found room)."""
    parts = parts or PartTable(problem)
    n, h = problem.devices, problem.topology.devices_per_host
    limit = float(problem.topology.memory_bytes)
    probe = State(problem, model, parts)
    # Every (table, sharding type) at once: one summary, one readout and one exchange call for all of them.
    candidates: list[tuple[int, str, int, np.ndarray]] = []  # (table, kind, shards, its distinct part rows)
    for t in range(len(problem.tables)):
        kinds = [("table", 1)] if "table" in allowed else []
        if n > 1:
            if "row" in allowed:
                kinds.append(("row", n))
                if 1 < h < n:
                    kinds.append(("host", h))
            if "column" in allowed and problem.column_allowed(t):
                kinds.append(("column", n))
            if "replicated" in allowed:
                kinds.append(("replicated", n))
        for kind, k in kinds or [("table", 1)]:
            sample = {"table": Choice("table", (0,)), "row": Choice("row", tuple(range(n))),
                      "host": Choice("row", tuple(range(h))), "column": Choice("column"),
                      "replicated": Choice("replicated")}[kind]
            candidates.append((t, kind, k, np.unique([i for _, i in probe.parts_of(t, sample)])))
    ids = np.concatenate([c[3] for c in candidates])
    owner = np.repeat(np.arange(len(candidates)), [len(c[3]) for c in candidates])
    copies = np.array([c[2] if c[1] in ("column", "replicated") else 1 for c in candidates], float)
    compute = np.bincount(owner, model.readout(probe.phi(ids)), len(candidates)) * copies  # a copy / slice per device
    exchange = probe._storage_costs([_alone_storage(probe, c[3]) for c in candidates])
    options: list[list[tuple[float, float, str, int]]] = [[] for _ in problem.tables]  # (perf, shard bytes, kind, k)
    for (t, kind, k, rows), perf in zip(candidates, compute + exchange, strict=True):
        options[t].append((float(perf), float(parts.mem_bytes[rows].max()), kind, k))
    options = [sorted(o, key=lambda o: (o[0], o[1])) for o in options]
    current = [0] * len(problem.tables)
    for _ in range(sum(len(o) for o in options)):
        placed = _torchrec_partition(problem, parts, options, current, limit)
        if isinstance(placed, list):
            return placed, True
        t = placed  # the table whose shard found no room: its next option with smaller shards
        shard = options[t][current[t]][1]
        nxt = next((i for i in range(current[t] + 1, len(options[t])) if options[t][i][1] < shard), None)
        if nxt is None:
            break
        current[t] = nxt
    # Nothing fits: the best-perf proposal regardless of memory.
    return _torchrec_partition(problem, parts, options, current, math.inf), False


def _alone_storage(state: State, ids: np.ndarray) -> tuple:
    """The stats row of a storage holding only these parts of one table, each on its own device."""
    parts = state.parts
    i = int(ids[0])
    kind, dim = int(parts.kind[i]), float(parts.dim[i])
    if kind == SHARDED:
        return (kind, dim, parts.expected_slots[ids].max(), parts.worst_slots[ids].max(), parts.requested[ids].max(),
                0.0)
    return (kind, dim, 0.0, 0.0, 0.0, min(state.slots_of_dim[int(dim)], float(parts.compact[i])))


def _torchrec_partition(problem: Problem, parts: PartTable, options, current, limit: float):
    """Shards largest perf first, each table-wise shard on the device (or host) with the lowest accumulated perf
    that has room: the choices, or the index of the first table that found none."""
    n, h = problem.devices, problem.topology.devices_per_host
    perf, used = np.zeros(n), np.zeros(n)
    choices: list[Choice | None] = [None] * len(problem.tables)
    for t in sorted(range(len(problem.tables)), key=lambda t: (-options[t][current[t]][0], t)):
        total, shard, kind, k = options[t][current[t]]
        if kind == "table":
            ok = np.nonzero(used + shard <= limit)[0]
            if not ok.size:
                return t
            d = int(ok[np.lexsort((ok, perf[ok]))[0]])
            choices[t] = Choice("table", (d,))
            devices = [d]
        elif kind == "host":
            hosts = [list(range(g * h, (g + 1) * h)) for g in range(n // h)]
            ok = [g for g, ds in enumerate(hosts) if np.all(used[ds] + shard <= limit)]
            if not ok:
                return t
            g = min(ok, key=lambda g: (perf[hosts[g]].sum(), g))
            devices = hosts[g]
            choices[t] = Choice("row", tuple(devices))
        else:
            if np.any(used + shard > limit):
                return t
            devices = list(range(n))
            choices[t] = Choice("row", tuple(devices)) if kind == "row" else Choice(kind)
        for d in devices:
            perf[d] += total / k
            used[d] += shard
    return choices


def baseline(problem: Problem, name: str, model: CostModel | None = None, seed: int = 0) -> PlannerResult:
    """Run one of BASELINES; its plan scored by `model` (default: the analytic model)."""
    model = model or AnalyticCostModel(problem.topology)
    start = time.perf_counter()
    if name == "random":
        choices = [Choice("table", (d,)) for d in random_baseline(problem, seed)]
    elif name == "torchrec_greedy":
        choices, _ = torchrec_greedy(problem, model)
    elif name in _heuristics():
        choices = [Choice("table", (d,)) for d in greedy_baseline(problem, name)[0]]
    else:
        raise ValueError(f"unknown baseline {name!r}; the baselines are {BASELINES}")
    n = problem.devices
    placements = [c.placement(t.info, n, problem.row_split) for c, t in zip(choices, problem.tables, strict=True)]
    return finish(problem, name, placements, model, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------- sharding.plan
def auto_placements(tables: Sequence[TableInfo], fixed: Mapping[str, TablePlacement], mesh_shape: Mapping[str, int],
                    batch_size: int, device_memory_bytes: int, row_split: str, seed: int = 0
                    ) -> dict[str, TablePlacement]:
    """`sharding.plan=auto` (`make_plan`): placements of the tables not in `fixed` (the
    pinned ones, already placed), searched with the analytic model on this host's CPU topology. The trainer does not
    know the tables' id distributions, so every slot of a bag counts as a lookup and ids are spread evenly."""
    n = math.prod(mesh_shape.values())
    problem = Problem(tuple(PlannerTable(t) for t in tables), Topology.cpu_host(n, device_memory_bytes),
                      batch_size, row_split)
    index = {t.name: i for i, t in enumerate(tables)}
    pinned = {index[name]: Choice.of(p) for name, p in fixed.items()}
    result = plan(problem, search="beam", seed=seed, fixed=pinned)
    return {p.table.name: p for p in result.placements if p.table.name not in fixed}


def make_plan(tables: Sequence[TableInfo], mesh_shape: Mapping[str, int], batch_size: int, *, plan: str = "auto",
              overrides: str = "", row_axes: str = "all", row_split: str = "range",
              device_memory_bytes: int) -> ShardingPlan:
    """Place every table: `plan` for all of them, `overrides` per table.

    auto: the planner of recjax/sharding/planner.py (greedy + local search + beam search over split counts, with
    the analytic cost model of recjax/sharding/cost_model.py) places the tables not pinned by `overrides`. With
    `row_axes="model"` (row-wise tables split over the model axis only) the previous greedy below runs instead,
    in decreasing order of owner work (the LPT greedy): a table whose own work exceeds a device's fair share
    (all tables' work over n) or that fits on no single device is split row-wise; any other goes whole to the
    device, among those with room, that leaves the lowest maximum per-device cost (`device_costs`), then the lowest
    memory on the fullest device, then the lowest total cost; a table of at most REPLICATE_BYTES may be replicated
    instead if that scores better. Then memory is checked per device. Raises ConfigError naming the device and the
    bytes it is short of.

    auto then evens the blocks (`balance_blocks`): while the fullest device of a dim's table- / row-wise storage
    holds more than BLOCK_BALANCE x the mean, its largest whole or partly split (unpinned) table is split by rows
    over every device, so padding to the fullest device costs at most 5% of memory.
    """
    n = math.prod(mesh_shape.values())
    axes_all = ("data", "model")
    row = ("model",) if row_axes == "model" else axes_all
    pinned = parse_overrides(overrides, tables)
    for name, (_, device) in pinned.items():
        if device is not None and device >= n:
            raise ConfigError("sharding.tables", f"{name}=table:{device}: there are only {n} devices (0..{n - 1})")

    def placed(t: TableInfo, kind: str, device: int | None = None) -> TablePlacement:
        if kind == "table":
            return TablePlacement(t, "table", axes_all, (device,))
        if kind == "row":
            return TablePlacement(t, "row", row, tuple(range(mesh_shape[row[-1]] if row == ("model",) else n)),
                                  row_split)
        if kind == "column":
            if t.dim % n:
                raise ConfigError("sharding.tables" if t.name in pinned else "sharding.plan",
                                  f"table {t.name!r} has dim {t.dim}, which {n} devices cannot split column-wise "
                                  "(dim % devices must be 0); shard it by row or table")
            if 0 < t.state_floats < t.dim:
                raise ConfigError("sharding.plan", f"table {t.name!r}: column-wise sharding cannot hold row-wise "
                                                   "optimizer state (one accumulator per row, e.g. rowwise_adagrad); "
                                                   "use adagrad / lazy_adam / sgd or shard it by row")
            return TablePlacement(t, "column", axes_all, tuple(range(n)))
        return TablePlacement(t, kind, (), ())

    room = [float(device_memory_bytes)] * n
    result: dict[str, TablePlacement] = {}

    def commit(p: TablePlacement):
        result[p.table.name] = p
        for d in range(n):
            room[d] -= p.device_bytes(d, mesh_shape)

    def score(p: TablePlacement) -> tuple:
        # Cost first; then memory: a storage's block is as tall as its fullest device, so every device pays for
        # the fullest one.
        after = device_costs([*result.values(), p], mesh_shape, batch_size)
        fullest = max(float(device_memory_bytes) - r + p.device_bytes(d, mesh_shape) for d, r in enumerate(room))
        return max(after), fullest, sum(after)

    def load(d: int) -> float:
        return device_costs(list(result.values()), mesh_shape, batch_size)[d]

    def table_cost(t):
        return max(owner_costs(placed(t, "table", 0), mesh_shape, batch_size))

    # Pinned tables first, then the rest by decreasing cost (largest first: the classic LPT greedy).
    order = sorted(tables, key=lambda t: (t.name not in pinned, -table_cost(t), -t.bytes, t.name))
    fair_share = sum(table_cost(t) for t in tables) / n
    searched = []  # auto's tables for the planner (recjax/sharding/planner.py), placed after the pinned ones
    for t in order:
        kind, device = pinned.get(t.name, (plan, None))
        if kind == "auto" and row_axes == "all":
            searched.append(t)
            continue
        if kind == "auto":  # rows over the `model` axis: the greedy below (the planner splits over any devices)
            # Whole on one device when it fits and its own work is at most a device's fair share; else split.
            candidates = [placed(t, "table", d) for d in range(n) if room[d] >= t.bytes]
            if not candidates or table_cost(t) > fair_share:
                candidates = [placed(t, "row")]
            if t.bytes <= REPLICATE_BYTES:
                candidates.append(placed(t, "replicated"))
            commit(min(candidates, key=score))  # ties: the first, i.e. the lowest device
            continue
        if kind == "table" and device is None:
            fits = [d for d in range(n) if room[d] >= t.bytes] or list(range(n))
            device = min(fits, key=lambda d: (load(d), d))
        commit(placed(t, kind, device))
    if searched:
        for p in auto_placements(tables, dict(result), mesh_shape, batch_size, device_memory_bytes,
                                 row_split).values():
            commit(p)
    if plan == "auto":
        balance_blocks(result, set(pinned), mesh_shape, row_split, device_memory_bytes)
    result_plan = ShardingPlan(dict(mesh_shape), tuple(result[t.name] for t in tables), batch_size,
                               int(device_memory_bytes))
    check_fits(result_plan)
    return result_plan
