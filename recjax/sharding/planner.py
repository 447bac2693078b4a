"""The sharding planner: the plan with the lowest step cost that fits every device's memory.

    result = plan(Problem(tables, topology, batch_size), model=AnalyticCostModel(topology), seed=0)
    result.placements   # TablePlacement per table: a `ShardingPlan`'s, which recjax/sharding/exchange.py runs
    result.cost         # PlanCost: per device and phase, the exchange every device pays, the step

The step cost (recjax/sharding/cost_model.py) is each phase's slowest device, summed, plus the exchange; for the
rows exchange of today's runtime there is one phase, so it is the slowest device's. `sharding.plan=auto` calls
`auto_placements` (from `make_plan`, below) with the rows exchange. Costs come from one interface (the analytic
model, or the pre-trained neural one of experiments/planning/cost_net.py).

Search (deterministic given the seed; every move is checked against every device's memory first):
  1. greedy: tables by decreasing standalone cost (the LPT order); each goes where the resulting step cost is lowest
     (ties: the fullest device's memory, then the sum of device costs), among: whole on any device with room; rows
     over the k least-loaded devices with room, for k around its share of the work and of its storage's ids (the
     power of two above it, half and twice that) and k = n; column-wise (`Problem.column_counts`: over every device
     with the rows exchange; with the pooled one also in k slices on the k least-loaded devices, k as for rows) when
     its dim splits evenly and its optimizer state is element-wise; replicated (tables up to `replicate_limit`, when
     the copies leave room for the tables still to come). A split or replica has to lower the step cost by
     SPLIT_GAIN to beat a whole table. The TorchRec-like baseline's plan (below) is a second start: the search goes
     on from the better of the two, so it never ends above that baseline when the baseline fits.
  2. local search: moves of a part from a device that sets a phase's cost to one of the least loaded ones, swaps of
     a part there with a smaller one, and moves of a part from the owner with the most expected ids of a costly
     storage to the owners with the fewest, while the step cost (then the sum of squared device costs) falls; then
     `restarts` seeded perturbations (random moves off the most loaded devices) each followed by local search,
     keeping the best. Under the pooled exchange a move of pooled parts changes no storage's collectives, so the
     moves of a round are evaluated at once (`State._evaluate_moves`).
  Steps 1-2 run twice: over the allowed shardings, and over whole tables only (unless some table is larger than a
  device). The greedy splits early, when a split looks cheap, and single moves cannot merge the splits again, so
  without the whole-table start the search could end above the whole-table plans it contains (issue 40: 1.008 /
  1.026 at 4 devices x 100 / 200 tables).
  3. beam search over split counts (NeuroShard's beam search over column splits, Zha et al. 2023), from both starts:
     a state is a plan; its children split one of the `branch` costliest tables of the slowest device (or of the
     whole task) one step further -- whole -> rows over 2 devices -> 4 -> ... -> n, and whole -> column slices over
     2 -> 4 -> ... -> n devices (the pooled exchange; the rows exchange: column-wise over every device after the
     rows) -- each followed by a short local search; the `width` best states are kept for `depth` rounds. The best
     state of either beam is the plan.

The TorchRec-like greedy (`torchrec_greedy`, the search's second start; also a baseline in benchmarks/planner.py):
per table the sharding type (table-wise, row-wise, table-row-wise within a host, column-wise, data-parallel) with
the lowest estimated cost, shards placed largest first on the device with the lowest accumulated cost; a table whose
shard fits nowhere falls back to its next option (by cost) with smaller shards and the partition starts again.
NeuroShard's table-wise heuristics and its own search, the benchmark's other baselines, are research code:
experiments/planning/baselines.py and neuroshard.py.
"""

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

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
    check_model,
    device_memory,
    member_row,
    plan_cost,
    split_counts,
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
    padded_device_bytes,
    parse_overrides,
    pools_on_owner,
)

AXES = ("data", "model")
SEARCHES = ("greedy", "local", "beam")
KINDS_ALL = frozenset({"table", "row", "column", "replicated"})
_REL = 1e-9  # objective improvements smaller than this (relative) do not count: no cycling on float noise
SPLIT_GAIN = 1e-3  # greedy: a split (or replica) must lower the step cost by this share to beat a whole table


@dataclasses.dataclass(frozen=True)
class Choice:
    """A table's sharding in the search: "table" (devices = (d,)), "row" (part j on devices[j]), "column" (slice j
    of width dim / k on devices[j]; no devices: every device) or "replicated" (every device)."""

    kind: str
    devices: tuple[int, ...] = ()

    def placement(self, info: TableInfo, n: int, row_split: str) -> TablePlacement:
        if self.kind == "table":
            return TablePlacement(info, "table", AXES, self.devices)
        if self.kind == "row":
            return TablePlacement(info, "row", AXES, self.devices, row_split)
        if self.kind == "column":
            return TablePlacement(info, "column", AXES, self.devices or tuple(range(n)))
        return TablePlacement(info, "replicated", (), ())

    @classmethod
    def of(cls, p: TablePlacement, n: int) -> "Choice":
        if p.sharding in ("replicated", "data_parallel"):
            return cls("replicated")
        if p.sharding == "column" and tuple(p.devices) == tuple(range(n)):
            return cls("column")
        if p.axes != AXES:
            raise ValueError(f"table {p.table.name!r}: the planner places row-wise tables over every device, not over "
                             f"{p.axes}")
        return cls({"table": "table", "column": "column"}.get(p.sharding, "row"), tuple(p.devices))


@dataclasses.dataclass
class Outcome:
    """What a candidate change would make of the state: the step cost, the fullest device's bytes, the sum and the
    sum of squares of device costs (a device's cost: its phases summed, plus the exchange)."""

    step: float
    fullest: float
    total: float
    squares: float


def step_of(compute: np.ndarray, exchange: float) -> float:
    """The step cost from f64[n, K] per-device phase seconds: each phase's slowest device, summed (cost_model.py)."""
    return float(compute.max(axis=0).sum() + exchange) if len(compute) else exchange


class State:
    """A (partial) plan and what the search updates incrementally: each device's parts, memory, summary (the sum of
    its parts' `CostModel.summaries`) and per-phase compute, the per-owner slot sums of the table-/row-wise storages
    and the cost of every storage."""

    def __init__(self, problem: Problem, model: CostModel, parts: PartTable | None = None,
                 kinds: frozenset = KINDS_ALL, frozen: frozenset = frozenset()):
        check_model(model, problem)
        self.problem, self.model = problem, model
        self.kinds = frozenset(kinds)  # the shardings the search may choose
        self.frozen = frozenset(frozen)  # tables placed by the caller (pinned): the search never changes them
        self.parts = parts or PartTable(problem)
        n = self.n = problem.devices
        self.limit = float(problem.topology.memory_bytes)
        self.choices: dict[int, Choice] = {}
        self.device_parts: list[list[int]] = [[] for _ in range(n)]
        self.mem = np.zeros(n)
        self.sums = np.zeros((n, model.summary_size))
        self.compute = np.zeros((n, len(model.phases)))  # seconds per device and phase
        # dim -> f64[4, n]: expected, worst, requested slots and pooled parts per owner
        self.sharded: dict[int, np.ndarray] = {}
        # (dim, kind) -> {table: (compact slots, pooled)}
        self.members: dict[tuple[int, int], dict[int, tuple[float, float]]] = {}
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
        if choice.kind == "column" and choice.devices:  # slices of one width share a part row
            i = index(t, COLUMN, len(choice.devices))
            return [(d, i) for d in choice.devices]
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
        has = self._has_phi[ids]
        if not has.all():  # (most calls: every summary already cached, no np.unique)
            missing = np.unique(ids[~has])
            self._phi[missing] = self.model.summaries(self.parts, missing)
            self._has_phi[missing] = True
        return self._phi[ids]

    @property
    def exchange(self) -> float:
        return float(sum(self.storage_cost.values()))

    @property
    def load(self) -> np.ndarray:
        """f64[n]: each device's seconds over all phases (what the search balances)."""
        return self.compute.sum(axis=1)

    def totals(self) -> np.ndarray:
        return self.load + self.exchange

    def objective(self) -> tuple[float, float]:
        """(the step cost, the sum of squared device costs): lexicographically smaller is better."""
        return step_of(self.compute, self.exchange), float((self.totals() ** 2).sum())

    def fits(self) -> bool:
        return bool(np.all(self.mem <= self.limit))

    def cost(self) -> PlanCost:
        return PlanCost(self.compute.copy(), self.exchange,
                        {(d, KINDS[k]): c for (d, k), c in sorted(self.storage_cost.items())}, self.model.phases)

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
            arr = sharded[dim] = self.sharded.get(dim, np.zeros((4, self.n))).copy()
            r, d, w = rows[mine], a[mine, 0], signs[mine]
            for f, field in enumerate((parts.expected_slots, parts.worst_slots, parts.requested, parts.pooled)):
                arr[f] += np.bincount(d, w * field[r], self.n)
        members: dict[tuple[int, int], dict[int, tuple[float, float]]] = {}
        for j in np.nonzero(kinds != SHARDED)[0].tolist():  # one entry per table (its copies / slices share it)
            key = (int(dims[j]), int(kinds[j]))
            m = members.get(key)
            if m is None:
                m = members[key] = dict(self.members.get(key, {}))
            table = int(parts.table[rows[j]])
            if signs[j] < 0:
                m.pop(table, None)
            else:
                m[table] = (float(parts.compact[rows[j]]), float(parts.pooled[rows[j]]))
        return moves, devices, dsum, dmem, sharded, members

    def _storage_rows(self, sharded: Mapping[int, np.ndarray], members: Mapping[tuple[int, int], dict]
                      ) -> list[tuple[tuple[int, int], tuple]]:
        rows = []
        for dim, arr in sharded.items():
            top = arr.max(axis=1)
            rows.append(((dim, SHARDED), (SHARDED, dim, top[0], top[1], top[2], 0.0, top[3])))
        for key, m in members.items():
            rows.append((key, member_row(key, m, self.slots_of_dim)))
        return rows

    def _storage_costs(self, rows: Sequence[tuple]) -> np.ndarray:
        if not rows:
            return np.zeros(0)
        return self.model.exchange(StorageStats.of_rows(rows))

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
            if np.any(arr[1] > 1e-9) or np.any(arr[3] > 0.5):
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

    def evaluate(self, deltas: Sequence[Mapping[int, Choice | None]], moves: Sequence | None = None
                 ) -> list[Outcome | None]:
        """The outcome of each delta applied alone to this state (None: a device would exceed its memory, or an
        already overfull one would grow). One readout call and one exchange call for all of them. `moves`: each
        delta's `_as_moves` when the caller knows it (None: worked out here)."""
        if moves is None:
            moves = [self._as_moves(delta) for delta in deltas]
        simple = [m is not None for m in moves]
        out: list[Outcome | None] = [None] * len(deltas)
        if any(simple):
            for j, outcome in zip(np.nonzero(simple)[0], self._evaluate_moves([m for m in moves if m is not None]),
                                  strict=True):
                out[j] = outcome
        if not all(simple):
            rest = [j for j, ok in enumerate(simple) if not ok]
            for j, outcome in zip(rest, self._evaluate([deltas[j] for j in rest]), strict=True):
                out[j] = outcome
        return out

    def _as_moves(self, delta: Mapping[int, Choice | None]) -> tuple[int, int, list] | None:
        """(device a, device b, [(part row, from, to)]) when `delta` only moves pooled parts between two devices
        (moves and swaps of the local search under the pooled exchange: no storage's collectives change); else
        None."""
        if self.problem.exchange != "pooled" or len(delta) > 2:
            return None
        out, devices = [], set()
        index = self.parts.index
        for t, new in delta.items():
            old = self.choices.get(t)
            if (old is None or new is None or old.kind != new.kind or not old.devices
                    or len(old.devices) != len(new.devices)):
                return None
            j, moved = -1, 0
            for q, (x, y) in enumerate(zip(old.devices, new.devices)):  # noqa: B905 (equal lengths, checked)
                if x != y:
                    j, moved = q, moved + 1
            if moved != 1:
                return None
            if old.kind == "table":
                i = index(t, SHARDED)
            elif old.kind == "row":
                i = index(t, SHARDED, len(old.devices), 0) + j
            else:
                i = index(t, COLUMN, len(old.devices))
            if not self.parts.pooled[i]:
                return None
            out.append((i, old.devices[j], new.devices[j]))
            devices.add(old.devices[j])
            devices.add(new.devices[j])
        if len(devices) != 2:
            return None
        a, b = sorted(devices)
        return a, b, out

    def _evaluate_moves(self, moves: Sequence[tuple[int, int, list]]) -> list[Outcome | None]:
        """`evaluate` for deltas that move pooled parts between two devices a and b, vectorised over the deltas."""
        m = len(moves)
        a = np.array([x[0] for x in moves])
        b = np.array([x[1] for x in moves])
        # Each delta moves one or two parts; +1: the part arrives at a, -1: it leaves a (b sees the opposite).
        part = np.zeros((m, 2), np.int64)
        sign = np.zeros((m, 2))
        for j, (da, _, ms) in enumerate(moves):
            for q, (i, src, dst) in enumerate(ms):
                part[j, q], sign[j, q] = i, (dst == da) - (src == da)
        phi = self.phi(part.reshape(-1)).reshape(m, 2, -1)
        dsum = (sign[:, :, None] * phi).sum(axis=1)  # elementwise, no BLAS call: small and many
        dmem = (sign * self.parts.mem_bytes[part]).sum(axis=1)
        new = self.model.readout(np.concatenate([self.sums[a] + dsum, self.sums[b] - dsum]))
        new_a, new_b = new[:m], new[m:]
        mem_a, mem_b = self.mem[a] + dmem, self.mem[b] - dmem
        bad = ((mem_a > self.limit) & (dmem > 0)) | ((mem_b > self.limit) & (dmem < 0))

        def rest_of(values: np.ndarray) -> np.ndarray:  # [m, K]: the max over the devices other than a and b
            values = values.reshape(self.n, -1)
            top = np.argsort(-values, axis=0, kind="stable")[:3].T  # [K, 3]
            keep = (top[None] != a[:, None, None]) & (top[None] != b[:, None, None])  # [m, K, 3]
            first = np.argmax(keep, axis=2)
            chosen = np.take_along_axis(np.broadcast_to(top, keep.shape), first[..., None], 2)[..., 0]
            value = values[chosen, np.arange(values.shape[1])[None, :]]
            return np.where(keep.any(axis=2), value, -math.inf)

        rest = rest_of(self.compute)
        rest_mem = rest_of(self.mem)[:, 0]
        x = self.exchange
        step = np.maximum(rest, np.maximum(new_a, new_b)).sum(axis=1) + x
        fullest = np.maximum(rest_mem, np.maximum(mem_a, mem_b))
        load = self.load
        la, lb = new_a.sum(axis=1), new_b.sum(axis=1)
        s1 = load.sum() - load[a] - load[b] + la + lb
        s2 = (load ** 2).sum() - load[a] ** 2 - load[b] ** 2 + la ** 2 + lb ** 2
        total, squares = s1 + self.n * x, s2 + 2 * x * s1 + self.n * x ** 2
        return [None if bad[j] else Outcome(float(step[j]), float(fullest[j]), float(total[j]), float(squares[j]))
                for j in range(m)]

    def _evaluate(self, deltas: Sequence[Mapping[int, Choice | None]]) -> list[Outcome | None]:
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
        k = len(self.model.phases)
        compute = self.model.readout(np.concatenate(new_sums)) if new_sums else np.zeros((0, k))
        storage = self._storage_costs(rows)
        orders = np.argsort(-self.compute, axis=0, kind="stable").T  # [K, n]: each phase's devices, slowest first
        mem_order = np.argsort(-self.mem, kind="stable")
        exchange = self.exchange
        load = self.load
        c_sum, c_sq = float(load.sum()), float((load ** 2).sum())
        out: list[Outcome | None] = []
        for entry in pending:
            if entry is None:
                out.append(None)
                continue
            devices, where, keys, mem = entry
            new_x = exchange + sum(storage[r] - self.storage_cost.get(key, 0.0) for key, r in keys)
            changed = compute[where]  # [m, K]
            touched = set(devices.tolist())
            rest = np.array([next((self.compute[d, p] for d in orders[p] if d not in touched), -math.inf)
                             for p in range(k)])
            rest_mem = next((self.mem[d] for d in mem_order if d not in touched), -math.inf)
            old, new = load[devices], changed.sum(axis=1)
            s1 = c_sum - old.sum() + new.sum()
            s2 = c_sq - (old ** 2).sum() + (new ** 2).sum()
            out.append(Outcome(float(np.maximum(rest, changed.max(axis=0)).sum()) + new_x, max(rest_mem, mem.max()),
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
    compute = state.model.readout(state.phi(ids)).sum(axis=1)
    rows = [(kind, parts.dim[i], parts.expected_slots[i], parts.worst_slots[i], parts.requested[i],
             parts.compact[i], parts.pooled[i]) for i in ids]
    return compute + state._storage_costs(rows)


def _lowest(state: State, count: int, need: float, exclude: Sequence[int] = ()) -> list[int] | None:
    """The `count` devices with the lowest load (then lowest index) that have `need` bytes free."""
    order = np.lexsort((np.arange(state.n), state.load))
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


def _column_choice(state: State, t: int, k: int, keep: Sequence[int] = ()) -> Choice | None:
    """Columns of t in k slices (Problem.column_counts): over every device, or with the pooled exchange on `keep`
    (its current devices) plus the least loaded with room for a slice."""
    if k not in state.problem.column_counts(t):
        return None
    if k == state.n:
        return Choice("column")
    extra = _lowest(state, k - len(keep), state.parts.value("mem_bytes", t, COLUMN, k), keep)
    return None if extra is None else Choice("column", (*keep, *extra))


def greedy(problem: Problem, model: CostModel, fixed: Mapping[int, Choice] | None = None,
           parts: PartTable | None = None, kinds: frozenset = KINDS_ALL) -> State:
    """Step 1 of the module docstring, choosing among `kinds`. Tables that fit nowhere even split over every device
    are split so anyway (the state then does not fit: `State.fits`)."""
    fixed = dict(fixed or {})
    state = State(problem, model, parts, kinds, frozen=frozenset(fixed))
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
    if "column" in kinds and n > 1:
        k = 2 ** math.ceil(math.log2(max(share, 2.0)))
        ks = [c for c in p.column_counts(t) if c in (k // 2, k, 2 * k, n)] if room.size else p.column_counts(t)
        others += [c for k in ks if (c := _column_choice(state, t, k)) is not None
                   and (c.devices or np.all(state.mem + state.parts.value("mem_bytes", t, COLUMN) <= state.limit))]
    free_after = (state.limit - state.mem - info.bytes).clip(min=0).sum()
    if ("replicated" in kinds and info.bytes <= replicate_limit(state.limit) and n > 1
            and np.all(state.mem + info.bytes <= state.limit) and free_after >= 1.25 * remaining):
        others.append(Choice("replicated"))
    for choice, outcome in zip(others, state.evaluate([{t: c} for c in others]), strict=True):
        if outcome is None:
            continue
        key = (outcome.step, outcome.fullest, outcome.total)
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
    new_compute = state.model.readout(state.sums[room] + state.phi(np.array([pid]))[0])  # [R, K]
    # The table's storage after it joins each candidate owner: the owner's slot sums grow, the max may too.
    arr = state.sharded.get(dim, np.zeros((4, state.n)))
    add = np.array([parts.expected_slots[pid], parts.worst_slots[pid], parts.requested[pid], parts.pooled[pid]])
    padded = np.concatenate([arr, np.full((4, 1), -math.inf)], axis=1)
    top2 = -np.sort(-padded, axis=1)[:, :2]
    arg = arr.argmax(axis=1)
    excl = np.where(arg[:, None] == room[None, :], top2[:, 1:2], top2[:, 0:1])  # [4, R] max over the other owners
    tops = np.maximum(excl, arr[:, room] + add[:, None])
    stats = StorageStats(np.full(len(room), SHARDED), np.full(len(room), float(dim)), tops[0], tops[1], tops[2],
                         np.zeros(len(room)), tops[3])
    new_x = state.exchange - state.storage_cost.get((dim, SHARDED), 0.0) + state.model.exchange(stats)
    comp = state.compute  # [n, K]: per phase, the slowest of the devices other than the candidate
    padded = np.concatenate([comp, np.full((1, comp.shape[1]), -math.inf)])
    top2 = -np.sort(-padded, axis=0)[:2]  # [2, K]
    arg = comp.argmax(axis=0)  # [K]
    rest = np.where(room[:, None] == arg[None, :], top2[1][None, :], top2[0][None, :])  # [R, K]
    top = np.maximum(rest, new_compute).sum(axis=1) + new_x
    mem_after = state.mem[room] + parts.mem_bytes[pid]
    mem_order = np.argsort(-state.mem, kind="stable")
    m2 = state.mem[mem_order[1]] if state.n > 1 else -math.inf
    fullest = np.maximum(np.where(room == mem_order[0], m2, state.mem[mem_order[0]]), mem_after)
    load = state.load
    total = load.sum() - load[room] + new_compute.sum(axis=1) + state.n * new_x
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
        deltas, moves = _compute_moves(state, targets, width)
        exchange = _exchange_moves(state, targets, width)
        deltas, moves = deltas + exchange, moves + [None] * len(exchange)
        if not deltas:
            break
        best, best_key = None, current
        for delta, outcome in zip(deltas, state.evaluate(deltas, moves), strict=True):
            if outcome is not None and _better((outcome.step, outcome.squares), best_key):
                best, best_key = delta, (outcome.step, outcome.squares)
        if best is None:
            break
        state.apply(best)
        applied += 1
    return applied


def _sharded_parts(state: State, d: int) -> list[tuple[int, int]]:
    """[(table, part row)] of the parts on device d that can move alone: table- and row-wise parts, and column
    slices of a table split over some of the devices."""
    parts = state.parts
    return [(int(parts.table[i]), i) for i in state.device_parts[d] if int(parts.table[i]) not in state.frozen
            and (parts.kind[i] == SHARDED or (parts.kind[i] == COLUMN and state.choices[int(parts.table[i])].devices))]


def _moved(choice: Choice, old: int, new: int) -> Choice:
    pos = choice.devices.index(old)
    return Choice(choice.kind, choice.devices[:pos] + (new,) + choice.devices[pos + 1:])


def slowest_devices(state: State, count: int = 2) -> list[int]:
    """The devices that set the step: each phase's slowest (lowest index on ties), the costliest phase's first, at
    most `count` of them."""
    n = np.arange(state.n)
    out: list[int] = []
    for p in np.argsort(-state.compute.max(axis=0), kind="stable"):
        d = int(np.lexsort((n, -state.compute[:, p]))[0])
        if d not in out:
            out.append(d)
    return out[:count]


def _compute_moves(state: State, targets: int, width: int) -> tuple[list[dict[int, Choice]], list]:
    """The moves and swaps of `local_search` (its docstring), and each one's `State._as_moves` (None under the rows
    exchange, or for a part whose storage's buckets it changes)."""
    hot = slowest_devices(state)
    light = [int(d) for d in np.lexsort((np.arange(state.n), state.load)) if d not in hot][:targets]
    fast = state.problem.exchange == "pooled"

    def by_size(d):  # [(compute alone, table, part row)] of the device's movable parts, largest first
        items = _sharded_parts(state, d)
        if not items:
            return []
        alone = state.model.readout(state.phi(np.array([i for _, i in items]))).sum(axis=1)
        return sorted(((a, t, i) for a, (t, i) in zip(alone.tolist(), items, strict=True)),
                      key=lambda x: (-x[0], x[1]))

    there = {d: by_size(d) for d in light}
    deltas: list[dict[int, Choice]] = []
    moves: list = []
    pooled = state.parts.pooled
    for worst in hot:
        for size, t, i in by_size(worst)[:width]:
            ch = state.choices[t]
            for d in light:
                if d in ch.devices:
                    continue
                moved = _moved(ch, worst, d)
                pair = (min(worst, d), max(worst, d))
                deltas.append({t: moved})
                moves.append((*pair, [(i, worst, d)]) if fast and pooled[i] else None)
                for _, t2, i2 in [x for x in there[d] if x[0] < size and x[1] != t
                                  and worst not in state.choices[x[1]].devices][:width]:
                    deltas.append({t: moved, t2: _moved(state.choices[t2], d, worst)})
                    moves.append((*pair, [(i, worst, d), (i2, d, worst)]) if fast and pooled[i] and pooled[i2]
                                 else None)
    return deltas, moves


def _exchange_moves(state: State, targets: int, width: int) -> list[dict[int, Choice]]:
    deltas: list[dict[int, Choice]] = []
    # Storages whose buckets carry rows (with the pooled exchange, those of tables that cannot pool on the owner).
    costly = sorted(((c, key) for key, c in state.storage_cost.items()
                     if key[1] == SHARDED and np.any(state.sharded[key[0]][1] > 0)), reverse=True)[:2]
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
        heavy = np.argsort(-state.load, kind="stable")[:max(1, state.n // 4)]
        d = int(rng.choice(heavy))
        tables = sorted(t for t, c in state.choices.items()
                        if c.kind == "table" and c.devices == (d,) and t not in state.frozen)
        if not tables:
            continue
        t = int(rng.choice(tables))
        need = state.parts.value("mem_bytes", t, SHARDED)
        room = [e for e in range(state.n) if e != d and state.mem[e] + need <= state.limit]
        if room:
            state.apply({t: Choice("table", (int(rng.choice(room)),))})


# ------------------------------------------------------------------------------------------------- beam search
def _next_splits(state: State, t: int) -> list[Choice]:
    """Table t split one step further. Rows exchange: whole -> rows over 2 -> 4 -> ... -> n -> column-wise (one
    chain). Pooled exchange: the next of each chain, whole -> rows over 2 -> ... -> n and whole -> column slices over
    2 -> 4 -> ... -> n (`Problem.column_counts`)."""
    ch, n = state.choices[t], state.n
    rows = "row" in state.kinds and n > 1
    counts = state.problem.column_counts(t) if "column" in state.kinds else []
    row_next = None
    if ch.kind == "table" and rows:
        row_next = _row_choice(state, t, 2, ch.devices)
    elif ch.kind == "row" and len(ch.devices) < n:
        row_next = _row_choice(state, t, min(2 * len(ch.devices), n), ch.devices)
    if state.problem.exchange == "rows":
        if (ch.kind == "table" and rows) or (ch.kind == "row" and len(ch.devices) < n):
            return [row_next] if row_next is not None else []
        return [Choice("column")] if ch.kind in ("table", "row") and counts else []
    now = 1 if ch.kind == "table" else len(ch.devices) if ch.kind == "column" and ch.devices else None
    bigger = [k for k in counts if now is not None and k > now]
    column_next = _column_choice(state, t, bigger[0], ch.devices) if bigger else None
    return [c for c in (row_next, column_next) if c is not None]


def beam_search(state: State, width: int = 3, depth: int = 6, branch: int = 6, polish: int = 20) -> State:
    """Step 3 of the module docstring; returns the best state seen (`state` itself if no split helps)."""
    best, beam = state, [state]
    alone = standalone_costs(state)
    seen = {_signature(state)}
    for _ in range(depth):
        children = []
        for s in beam:
            for t in _split_candidates(s, alone, branch):
                for new in _next_splits(s, t):
                    if s.evaluate([{t: new}])[0] is None:
                        continue
                    child = s.copy()
                    child.apply({t: new})
                    local_search(child, rounds=polish, width=4)
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
    worst = slowest_devices(state, 1)[0]
    splittable = [t for t, c in state.choices.items() if t not in state.frozen
                  and (c.kind in ("table", "row") or (c.kind == "column" and c.devices))]
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
    model = model or AnalyticCostModel(problem.topology, problem.exchange)
    start = time.perf_counter()
    kinds = frozenset(kinds)
    parts = PartTable(problem)
    state = _local(problem, model, parts, fixed, kinds, search, seed, restarts)
    starts = [state]
    largest = max((t.info.bytes for i, t in enumerate(problem.tables) if not fixed or i not in fixed), default=0)
    if search != "greedy" and "table" in kinds and kinds != {"table"} and largest <= problem.topology.memory_bytes:
        # A third start: the whole-table variant's own plan (the same search with kinds={"table"}). Single moves
        # cannot merge the splits the greedy made early, when a split looked cheap, so the search could end above
        # the whole-table plans it contains; from the better of the two it never does. The beam search splits
        # from both (NeuroShard's search splits from whole tables).
        whole = _local(problem, model, parts, fixed, frozenset({"table"}), search, seed, restarts)
        if whole.fits():  # else some table is larger than a device: no whole-table plan to beat
            whole.kinds = kinds
            starts.append(whole)
    if search == "beam":
        starts = [beam_search(s, beam_width, beam_depth, beam_branch) for s in starts]
    state = starts[0]
    for other in starts[1:]:
        if other.fits() and (not state.fits() or _better(other.objective(), state.objective())):
            state = other
    placements = state.placements()
    seconds = time.perf_counter() - start
    if judge is None or judge is model:
        return finish(problem, f"recjax_{search}", placements, None, seconds, state.cost())
    return finish(problem, f"recjax_{search}", placements, judge, seconds)


def _local(problem: Problem, model: CostModel, parts: PartTable, fixed: Mapping[int, Choice] | None,
           kinds: frozenset, search: str, seed: int, restarts: int) -> State:
    """Steps 1 and 2 of the module docstring over `kinds`: the greedy, then (unless search="greedy") the better of
    it and the TorchRec-like start, local search and `restarts` seeded perturbations."""
    state = greedy(problem, model, fixed, parts, kinds)
    if search == "greedy":
        return state
    # A second start: each table's best sharding on its own (the TorchRec-like construction); search on from the
    # better. Whole storages change kind at once this way, which single-table moves cannot do: a storage's fixed
    # costs (latencies, kernels, bucket margins) make the first table of a new kind never pay off alone.
    choices, _ = torchrec_greedy(problem, model, parts, kinds)
    other = State(problem, model, parts, kinds, frozen=state.frozen)
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
    return best


def finish(problem: Problem, name: str, placements: Sequence[TablePlacement], model: CostModel | None,
           seconds: float, cost: PlanCost | None = None) -> PlannerResult:
    """The result, its memory fit checked with `TablePlacement.device_bytes` and its cost under `model` (or `cost`,
    already known)."""
    fits = bool(np.all(device_memory(problem, placements) <= problem.topology.memory_bytes))
    return PlannerResult(name, tuple(placements), cost or plan_cost(model, problem, placements), fits, seconds)


# ---------------------------------------------------------------------------------------- TorchRec-like start
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
    alone = model.readout(probe.phi(ids)).sum(axis=1)  # each part alone on a device, its phases summed
    compute = np.bincount(owner, alone, len(candidates)) * copies  # a copy / slice per device
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
                0.0, parts.pooled[ids].max())
    return member_row((int(dim), kind), {0: (float(parts.compact[i]), float(parts.pooled[i]))}, state.slots_of_dim)


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


# ---------------------------------------------------------------------------------------------- sharding.plan
def runtime_problem(tables: Sequence[TableInfo], mesh_shape: Mapping[str, int], batch_size: int,
                    device_memory_bytes: int, row_split: str = "range", exchange: str = "rows") -> Problem:
    """The planner's task for what the runtime runs: CPU devices of this host, the runtime's `exchange`
    (sharding.exchange; under "auto" a table is modelled pooled where the runtime pools it whole on one owner,
    `pools_on_owner`: not one-hot tables), column-wise tables split over every device."""
    pooled = exchange != "rows"
    planner_tables = tuple(
        PlannerTable(t, poolable=pooled and pools_on_owner(TablePlacement(t, "table", AXES, (0,)), mesh_shape,
                                                           batch_size, exchange))
        for t in tables)
    topology = Topology.cpu_host(math.prod(mesh_shape.values()), device_memory_bytes)
    return Problem(planner_tables, topology, batch_size, row_split, "pooled" if pooled else "rows",
                   whole_columns=True)


def auto_placements(tables: Sequence[TableInfo], fixed: Mapping[str, TablePlacement], mesh_shape: Mapping[str, int],
                    batch_size: int, device_memory_bytes: int, row_split: str, seed: int = 0, exchange: str = "rows"
                    ) -> dict[str, TablePlacement]:
    """`sharding.plan=auto` (`make_plan`): placements of the tables not in `fixed` (the pinned ones, already
    placed), searched with the analytic model on `runtime_problem` (this host's CPU topology, the runtime's
    `exchange`). The trainer does not know the tables' id distributions, so every slot of a bag counts as a lookup
    and ids are spread evenly."""
    n = math.prod(mesh_shape.values())
    problem = runtime_problem(tables, mesh_shape, batch_size, device_memory_bytes, row_split, exchange)
    index = {t.name: i for i, t in enumerate(tables)}
    pinned = {index[name]: Choice.of(p, n) for name, p in fixed.items()}
    result = plan(problem, search="beam", seed=seed, fixed=pinned)
    return {p.table.name: p for p in result.placements if p.table.name not in fixed}


def make_plan(tables: Sequence[TableInfo], mesh_shape: Mapping[str, int], batch_size: int, *, plan: str = "auto",
              overrides: str = "", row_axes: str = "all", row_split: str = "range", exchange: str = "rows",
              device_memory_bytes: int) -> ShardingPlan:
    """Place every table: `plan` for all of them, `overrides` per table.

    auto: the planner of recjax/sharding/planner.py (greedy + local search + beam search over split counts, with
    the analytic cost model of recjax/sharding/cost_model.py for the runtime's `exchange`) places the tables not
    pinned by `overrides`. With
    `row_axes="model"` (row-wise tables split over the model axis only, a copy per data row) the previous greedy
    below runs instead -- the planner's cost models cover placements over every device, not copies along an axis --
    in decreasing order of owner work (the LPT greedy): a table whose own work exceeds a device's fair share
    (all tables' work over n) or that fits on no single device is split row-wise; any other goes whole to the
    device, among those with room, that leaves the lowest maximum per-device cost (`device_costs`), then the lowest
    memory on the fullest device, then the lowest total cost; a table of at most REPLICATE_BYTES may be replicated
    instead if that scores better. Then memory is checked per device. Raises ConfigError naming the device and the
    bytes it is short of.

    auto then evens the blocks (`balance_blocks`): while the fullest device of a dim's table- / row-wise storage
    holds more than BLOCK_BALANCE x the mean, its largest whole or partly split (unpinned) table is split by rows
    over every device, so padding to the fullest device costs at most 5% of memory -- unless the planner's plan
    fits padded and the evened one would be slower by the planner's cost model (splitting a table over every
    device multiplies its kernels and its exchange).
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
                                 row_split, exchange=exchange).values():
            commit(p)
    if plan == "auto":
        planned = dict(result)
        balance_blocks(result, set(pinned), mesh_shape, row_split, device_memory_bytes)
        fits = max(padded_device_bytes(list(planned.values()), mesh_shape)) <= device_memory_bytes
        if result != planned and row_axes == "all" and fits:
            # Evening the blocks saves memory the plan does not need; keep the planner's plan if it is faster.
            problem = runtime_problem(tables, mesh_shape, batch_size, device_memory_bytes, row_split, exchange)
            model = AnalyticCostModel(problem.topology, problem.exchange)
            step = [plan_cost(model, problem, [r[t.name] for t in tables]).step for r in (planned, result)]
            if step[1] > step[0] * (1 + SPLIT_GAIN):
                result = planned
    result_plan = ShardingPlan(dict(mesh_shape), tuple(result[t.name] for t in tables), batch_size,
                               int(device_memory_bytes))
    check_fits(result_plan)
    return result_plan
