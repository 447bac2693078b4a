"""The pre-trained neural cost model (NeuroShard: Zha et al. 2023, "Pre-train and Search: Efficient Embedding Table
Sharding with Pre-trained Neural Cost Models", Sec. 4.1): small MLPs that predict a plan's costs, pre-trained once
on many sampled plans and then used by the search (recjax/sharding/planner.py) in place of the analytic model.

    data = sample_dataset(pool, topology_for, batch, plans=2000, seed=0, labels="analytic", exchange="pooled")
    model, report = train(data, steps=3000, seed=0)      # report: held-out error (plans never trained on)
    model.save("cost_model.msgpack"); NeuralCostModel.load("cost_model.msgpack", topology)

Two nets, as NeuroShard's compute and communication models, for one exchange (recjax/sharding/cost_model.py: the
rows exchange of today's runtime, or the pooled one) and its phases:
  device    a device's seconds in each phase (rows: its lookups + updates; pooled: ids in, pooling, pooled outputs
            out and gradients in, update) from the set of table parts it holds: each part's features
            (`part_features`) through an MLP, summed over the device's parts, a second MLP on the sum (and the part
            count) -> log seconds per phase. The sum is what `CostModel.summaries` returns, so the search adds and
            removes parts incrementally, as with the analytic model. NeuroShard's communication net reads every
            device's sum of dims; here a device's communication is its own phase (under shard_map the busiest
            device's buffers set every device's), so the same sum serves both.
  exchange  a storage's collective seconds from its features (`storage_features`: kind, dim, bucket sizes) ->
            log seconds; a plan's exchange is the sum over its storages.

Pre-training data (NeuroShard's augmentation): tasks of random size drawn from a table pool, each table's dim
re-drawn from {4, ..., 128} and its pooling factor scaled by 2^U(-1, 1), placed by random plans of every sharding
kind with uneven device loads (device weights from a Dirichlet of random concentration). Labels:
  analytic   the analytic model's per-device phases (exact, no tabulation) and per-storage exchange
  benchmark  measured on this machine's CPU devices (`CpuBench`): each device's parts as the runtime runs them (per
             width one stacked table; rows exchange: a gather of its forward rows and a scatter-add of its updated
             rows; pooled: its bags pooled into their outputs and the outputs' gradients added into the rows, ids
             drawn from each part's frequency profile), its all_to_alls on the local devices, and each storage's
             collectives as exchange.py issues them; medians of `repeats` timed runs after a warm-up. Table rows
             and lookups are capped (`BENCH_CAP`) so a sample runs in milliseconds; the benchmark's pool and batch
             are small enough that the caps rarely bind.
Saved with flax.serialization's msgpack (parameters, normalisation, phases, the topology it was trained for, the
report): no pickle. Loading checks the topology: a model pre-trained for other hardware is an error, not a silent
guess.
"""

import dataclasses
import functools
import json
import math
import pathlib
import time
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

from recjax.sharding.cost_model import (
    COLUMN,
    KINDS,
    PHASES,
    REPLICATED,
    SHARDED,
    AnalyticCostModel,
    PartTable,
    PlannerTable,
    Problem,
    StorageStats,
    Topology,
    bucket_capacity,
    storage_stats,
)

FORMAT = 2  # 2: per-phase device outputs, the exchange modelled
DIMS = (4, 8, 16, 32, 64, 128)
BENCH_CAP = {"rows": 1 << 18, "ids": 1 << 16}  # per part: table rows held, forward / updated rows (benchmark labels)
# Topology fields a pre-trained model is specific to (a model is trained across device counts and memory sizes).
HARDWARE = ("memory_bandwidth", "cache_bytes", "cache_bandwidth", "intra_host_bandwidth",
            "inter_host_bandwidth", "collective_latency", "kernel_overhead", "exchange_itemsize", "capacity_factor",
            "capacity_sigmas")


# ---------------------------------------------------------------------------------------------------- features
def part_features(parts: PartTable, ids: np.ndarray) -> np.ndarray:
    """f32[P, 14 + SEGMENTS + 3]: what a part's cost depends on (sizes in logs, its kind, whether it is pooled on
    its device, its lookup profile)."""
    ids = np.asarray(ids, np.int64)
    kind = parts.kind[ids].astype(int)
    lookups = parts.lookups[ids]
    profile = np.cumsum(parts.seg_mass[ids], axis=1) / np.maximum(parts.seg_mass[ids].sum(1, keepdims=True), 1e-30)
    cols = [np.log1p(parts.rows[ids]), np.log2(parts.width[ids]), np.log1p(lookups), np.log1p(parts.fwd_total[ids]),
            np.log1p(parts.upd_total[ids]), np.log1p(parts.fwd_bytes[ids]), np.log1p(parts.upd_bytes[ids]),
            np.log1p(parts.cache_row_bytes[ids]), np.log1p(parts.requested[ids]), parts.pooled[ids],
            np.log1p(parts.id_bytes[ids]), np.log1p(parts.out_floats[ids]), np.log1p(parts.stream_fwd[ids]),
            np.log1p(parts.stream_upd[ids])]
    onehot = np.eye(len(KINDS))[kind]
    return np.concatenate([np.stack(cols, 1), profile, onehot], axis=1).astype(np.float32)


def storage_features(stats: StorageStats, topology: Topology) -> np.ndarray:
    """f32[S, 13]: a storage's kind, dim, the device count, the share of peers on its host, its bucket sizes
    (expected, worst case, used) and whether it has pooled parts."""
    small = bucket_capacity(stats.expected, stats.worst, topology.capacity_factor, topology.capacity_sigmas)
    worst = bucket_capacity(stats.expected, stats.worst, 0.0, 0.0)
    overflow = (stats.requested > small).astype(float)
    used = np.where(overflow > 0, worst, small)
    n, h = topology.devices, topology.devices_per_host
    cols = [np.log2(stats.dim), np.full(len(stats), math.log2(n)), np.full(len(stats), (h - 1) / max(n - 1, 1)),
            np.log1p(stats.expected), np.log1p(worst), np.log1p(used), np.log1p(stats.compact), overflow,
            np.log1p(stats.requested), (stats.pooled > 0).astype(float)]
    onehot = np.eye(len(KINDS))[stats.kind.astype(int)]
    return np.concatenate([np.stack(cols, 1), onehot], axis=1).astype(np.float32)


# -------------------------------------------------------------------------------------------------------- nets
class MLP(nn.Module):
    sizes: tuple[int, ...]
    out: int | None = None  # a final linear layer of this width (none: the last hidden layer is the output)

    @nn.compact
    def __call__(self, x):
        for h in self.sizes:
            x = nn.relu(nn.Dense(h)(x))
        return nn.Dense(self.out)(x) if self.out else x


@dataclasses.dataclass(frozen=True)
class Sizes:
    part: tuple[int, ...] = (64, 32)  # per-part embedding (its last width is the summary size, plus a count)
    device: tuple[int, ...] = (64, 32)
    storage: tuple[int, ...] = (64, 32)


def _nets(sizes: Sizes, phases: int):
    return MLP(sizes.part), MLP(sizes.device, phases), MLP(sizes.storage, 1)


def _pad(n: int) -> int:
    """Arrays are padded to a power of two (at least 64) so few shapes compile."""
    return max(64, 1 << max(0, n - 1).bit_length())


# ------------------------------------------------------------------------------------------------ the model
# Jitted once per net sizes, phase count and array shape, shared by every model instance (a loaded copy compiles
# nothing new).
@functools.partial(jax.jit, static_argnums=(0, 1))
def _embed(sizes: Sizes, phases: int, params, norm, x):
    return _nets(sizes, phases)[0].apply(params["part"], (x - norm["part_mean"]) / norm["part_std"])


@functools.partial(jax.jit, static_argnums=(0, 1))
def _read(sizes: Sizes, phases: int, params, norm, sums):
    count = sums[:, -1:]
    z = _nets(sizes, phases)[1].apply(params["device"], jnp.concatenate([sums[:, :-1], jnp.log1p(count)], 1))
    return jnp.where(count > 0.5, jnp.exp(z * norm["compute_std"] + norm["compute_mean"]), 0.0)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _exch(sizes: Sizes, phases: int, params, norm, x):
    z = _nets(sizes, phases)[2].apply(params["storage"], (x - norm["storage_mean"]) / norm["storage_std"])[:, 0]
    return jnp.exp(z * norm["exchange_std"] + norm["exchange_mean"])


class NeuralCostModel:
    """`CostModel` from pre-trained nets: summaries = [per-part embedding, 1], readout = exp(device net(sum, log(1 +
    count))) per phase (0 for an empty device), exchange = exp(storage net(features)). `phases` and `exchange_kind`
    are those of the labels it was trained on."""

    name = "neural"

    def __init__(self, topology: Topology, params: dict, norm: dict, sizes: Sizes, phases: Sequence[str],
                 exchange_kind: str, report: dict | None = None, labels: str = "analytic"):
        self.topology, self.params, self.sizes = topology, params, sizes
        self.phases, self.exchange_kind = tuple(phases), exchange_kind
        self.norm = {k: jnp.asarray(v, jnp.float32) for k, v in norm.items()}
        self.report, self.labels = report or {}, labels
        self.summary_size = sizes.part[-1] + 1

    def for_topology(self, topology: Topology) -> "NeuralCostModel":
        """This model on `topology` (another device count or memory of the hardware it was trained for)."""
        differs = {k: (getattr(self.topology, k), getattr(topology, k)) for k in HARDWARE
                   if not math.isclose(float(getattr(self.topology, k)), float(getattr(topology, k)), rel_tol=1e-9)}
        if differs:
            raise ValueError(f"the neural cost model was pre-trained for other hardware: {differs} (trained, asked)")
        model = NeuralCostModel(topology, self.params, {}, self.sizes, self.phases, self.exchange_kind, self.report,
                                self.labels)
        model.norm = self.norm
        return model

    def _embed(self, params, x):
        return _embed(self.sizes, len(self.phases), params, self.norm, x)

    def _read(self, params, sums):
        return _read(self.sizes, len(self.phases), params, self.norm, sums)

    def _exch(self, params, x):
        return _exch(self.sizes, len(self.phases), params, self.norm, x)

    def summaries(self, parts: PartTable, ids: np.ndarray) -> np.ndarray:
        x = part_features(parts, ids)
        padded = np.zeros((_pad(len(x)), x.shape[1]), np.float32)
        padded[:len(x)] = x
        phi = np.asarray(self._embed(self.params, padded), np.float64)[:len(x)]
        return np.concatenate([phi, np.ones((len(x), 1))], axis=1)

    def readout(self, sums: np.ndarray) -> np.ndarray:
        sums = np.atleast_2d(sums)
        padded = np.zeros((_pad(len(sums)), sums.shape[1]), np.float32)
        padded[:len(sums)] = sums
        return np.asarray(self._read(self.params, padded), np.float64)[:len(sums)]

    def exchange(self, stats: StorageStats) -> np.ndarray:
        return self.exchange_features(storage_features(stats, self.topology))

    def exchange_features(self, x: np.ndarray) -> np.ndarray:
        """Seconds per storage from its `storage_features` rows."""
        padded = np.zeros((_pad(len(x)), x.shape[1]), np.float32)
        padded[:len(x)] = x
        return np.asarray(self._exch(self.params, padded), np.float64)[:len(x)]

    # ------------------------------------------------------------------------------------------ save / load
    def save(self, path: str | pathlib.Path) -> None:
        """msgpack (flax.serialization): parameters, normalisation, sizes, phases, hardware, report. No pickle."""
        state = {"format": FORMAT, "labels": self.labels, "phases": list(self.phases),
                 "exchange": self.exchange_kind, "hardware": {k: getattr(self.topology, k) for k in HARDWARE},
                 "sizes": {k: list(v) for k, v in dataclasses.asdict(self.sizes).items()},
                 "norm": {k: np.asarray(v) for k, v in self.norm.items()},
                 "params": jax.tree.map(np.asarray, self.params), "report": self.report}
        pathlib.Path(path).write_bytes(serialization.msgpack_serialize(state))

    @classmethod
    def load(cls, path: str | pathlib.Path, topology: Topology) -> "NeuralCostModel":
        """The model at `path`, for `topology` (which must be the hardware it was pre-trained for)."""
        path = pathlib.Path(path)
        try:
            state = serialization.msgpack_restore(path.read_bytes())
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"{path}: not a recjax neural cost model ({error}); pre-train one with "
                             "benchmarks/planner.py --sections neural") from error
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"{path}: not a recjax neural cost model of format {FORMAT}; pre-train one with "
                             "benchmarks/planner.py --sections neural")
        differs = {k: (v, getattr(topology, k)) for k, v in state["hardware"].items()
                   if not math.isclose(float(v), float(getattr(topology, k)), rel_tol=1e-9)}
        if differs:
            raise ValueError(f"{path} was pre-trained for other hardware: {differs} (trained, asked); pre-train one "
                             "for this topology")
        sizes = Sizes(**{k: tuple(int(x) for x in v.values()) if isinstance(v, dict) else tuple(v)
                         for k, v in state["sizes"].items()})
        params = jax.tree.map(jnp.asarray, state["params"])
        phases = state["phases"].values() if isinstance(state["phases"], dict) else state["phases"]
        return cls(topology, params, {k: np.asarray(v) for k, v in state["norm"].items()}, sizes, tuple(phases),
                   state["exchange"], state["report"], state["labels"])


# ------------------------------------------------------------------------------------------------ the data
@dataclasses.dataclass
class Dataset:
    """Sampled plans' features and labels. Per device sample d: its parts are rows part_start[d]:part_start[d+1] of
    `parts`, its label f64[K] seconds per phase; per storage sample s: `storages[s]`. `*_plan` say which plan each
    belongs to (the train / test split is by plan)."""

    parts: np.ndarray  # f32[P, F]
    part_start: np.ndarray  # i64[D + 1]
    compute: np.ndarray  # f64[D, K] seconds per phase
    device_plan: np.ndarray  # i64[D]
    storages: np.ndarray  # f32[S, Fs]
    exchange: np.ndarray  # f64[S] seconds
    storage_plan: np.ndarray  # i64[S]
    topology: Topology
    labels: str
    plans: int
    phases: tuple[str, ...]
    exchange_kind: str

    def save(self, path: str | pathlib.Path) -> None:
        """The samples as numpy arrays (np.savez) and the topology, so a model can be re-trained without sampling
        (or measuring) again."""
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if isinstance(getattr(self, f.name), np.ndarray)}
        meta = {"topology": dataclasses.asdict(self.topology), "labels": self.labels, "plans": self.plans,
                "phases": list(self.phases), "exchange_kind": self.exchange_kind}
        np.savez_compressed(path, meta=np.array(json.dumps(meta)), **arrays)

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "Dataset":
        with np.load(path) as f:
            meta = json.loads(str(f["meta"]))
            arrays = {k: f[k] for k in f.files if k != "meta"}
        return cls(**arrays, topology=Topology(**meta["topology"]), labels=meta["labels"], plans=meta["plans"],
                   phases=tuple(meta["phases"]), exchange_kind=meta["exchange_kind"])


def augmented_problem(pool: Sequence[PlannerTable], topology: Topology, batch: int, rng: np.random.Generator,
                      tables: int, exchange: str = "rows") -> Problem:
    """`tables` tables of `pool` with their dims re-drawn and pooling factors scaled (NeuroShard's augmentation)."""
    chosen = rng.choice(len(pool), size=min(tables, len(pool)), replace=False)
    out = []
    for j, i in enumerate(sorted(chosen.tolist())):
        t = pool[i]
        pooling = t.lookups_per_example * 2.0 ** rng.uniform(-1, 1)
        info = dataclasses.replace(t.info, name=f"a{j}", feature=f"a{j}", dim=int(rng.choice(DIMS)),
                                   bag_size=max(1, round(pooling)))
        out.append(PlannerTable(info, pooling, t.access, t.ordered, t.poolable))
    return Problem(tuple(out), topology, batch, exchange=exchange)


def random_plan(problem: Problem, rng: np.random.Generator) -> list[tuple[str, tuple[int, ...]]]:
    """A random (kind, devices) per table: mostly whole tables, some row-wise over k devices, column-wise and
    replicated ones, on devices drawn with uneven weights (from balanced to a few devices taking most)."""
    n = problem.devices
    weights = rng.dirichlet(np.full(n, 10.0 ** rng.uniform(-1, 1)))
    plan = []
    for t in range(len(problem.tables)):
        kind = rng.choice(["table", "row", "column", "replicated"], p=[0.55, 0.25, 0.1, 0.1]) if n > 1 else "table"
        if kind == "column" and not problem.column_allowed(t):
            kind = "table"
        if kind == "row":
            k = int(2 ** rng.integers(1, int(math.log2(n)) + 1)) if n >= 2 else 1
            plan.append(("row", tuple(rng.choice(n, size=min(k, n), replace=False, p=weights).tolist())))
        elif kind == "table":
            plan.append(("table", (int(rng.choice(n, p=weights)),)))
        else:
            plan.append((str(kind), ()))
    return plan


def plan_parts(problem: Problem, parts: PartTable, plan) -> list[list[int]]:
    """Each device's part rows under a `random_plan`."""
    n = problem.devices
    device_parts: list[list[int]] = [[] for _ in range(n)]
    for t, (kind, devices) in enumerate(plan):
        if kind in ("table", "row"):
            base = parts.index(t, SHARDED, len(devices), 0)
            for j, d in enumerate(devices):
                device_parts[d].append(base + j)
        else:
            i = parts.index(t, COLUMN if kind == "column" else REPLICATED)
            for d in range(n):
                device_parts[d].append(i)
    return device_parts


def sample_dataset(pool: Sequence[PlannerTable], topology_for, batch: int, plans: int, seed: int = 0,
                   devices: Sequence[int] = (4, 8, 16, 32, 64, 128), tables: tuple[int, int] = (10, 200),
                   labels: str = "analytic", repeats: int = 5, exchange: str = "rows", progress=None) -> Dataset:
    """`plans` random plans of augmented tasks (device counts from `devices`, `topology_for(n)` their hardware,
    table counts uniform in `tables`) for `exchange`, labelled by the analytic model or by benchmarks on this
    machine. `progress(k)` is called after each plan."""
    if labels not in ("analytic", "benchmark"):
        raise ValueError(f"labels must be 'analytic' or 'benchmark', got {labels!r}")
    rng = np.random.default_rng(seed)
    feats, starts, compute, device_plan = [], [0], [], []
    s_feats, exchange_cost, storage_plan = [], [], []
    topology = None
    bench = CpuBench(repeats, seed) if labels == "benchmark" else None
    for k in range(plans):
        n = int(rng.choice(devices))
        topology = topology_for(n)
        problem = augmented_problem(pool, topology, batch, rng, int(rng.integers(tables[0], tables[1] + 1)),
                                    exchange)
        parts = PartTable(problem)
        device_parts = plan_parts(problem, parts, random_plan(problem, rng))
        _, stats = storage_stats(problem, parts, device_parts)
        if bench is None:
            analytic = AnalyticCostModel(topology, exchange)
            ids = np.array([i for dp in device_parts for i in dp], np.int64)
            sets = np.array([d for d, dp in enumerate(device_parts) for _ in dp], np.int64)
            device_cost = analytic.exact_compute(parts, ids, sets, n)
            storage_cost = analytic.exchange(stats)
        else:
            device_cost = np.array([bench.device_phases(parts, dp) for dp in device_parts])
            storage_cost = np.array([bench.exchange(stats, r, topology, exchange) for r in range(len(stats))])
        for d, dp in enumerate(device_parts):
            if dp:  # an empty device costs nothing, by construction
                feats.append(part_features(parts, np.array(dp)))
                starts.append(starts[-1] + len(dp))
                compute.append(device_cost[d])
                device_plan.append(k)
        s_feats.append(storage_features(stats, topology))
        exchange_cost.extend(storage_cost.tolist())
        storage_plan.extend([k] * len(stats))
        if progress is not None:
            progress(k)
    phases = PHASES[exchange]
    return Dataset(np.concatenate(feats), np.array(starts), np.array(compute).reshape(-1, len(phases)),
                   np.array(device_plan), np.concatenate(s_feats), np.array(exchange_cost), np.array(storage_plan),
                   topology, labels, plans, phases, exchange)


# ------------------------------------------------------------------------------------------------ training
# Labels below this many seconds (a phase a device does not take part in, e.g. no ids on a device of replicated
# tables only) are trained as this, so their logs do not stretch the normalisation.
FLOOR_SECONDS = 1e-7


def train(data: Dataset, steps: int = 3000, seed: int = 0, sizes: Sizes = Sizes(), batch_devices: int = 256,
          lr: float = 2e-3, test_share: float = 0.2) -> tuple[NeuralCostModel, dict]:
    """Fit both nets on the training plans (MSE of normalised log seconds per phase, Adam) and report their error on
    the held-out plans: median / mean absolute percentage error of each phase's device seconds, of the storages'
    exchange and of the plans' step cost (each phase's slowest device, summed, plus the exchange), and the rank
    correlation of the plans' step costs."""
    rng = np.random.default_rng(seed)
    k = len(data.phases)
    test_plans = set(rng.permutation(data.plans)[:max(1, int(round(test_share * data.plans)))].tolist())
    dev_test = np.isin(data.device_plan, list(test_plans))
    sto_test = np.isin(data.storage_plan, list(test_plans))
    train_parts = np.concatenate([data.parts[data.part_start[d]:data.part_start[d + 1]]
                                  for d in np.nonzero(~dev_test)[0]])
    y_c = np.log(np.maximum(data.compute, FLOOR_SECONDS))
    y_x = np.log(np.maximum(data.exchange, FLOOR_SECONDS))
    norm = {"part_mean": train_parts.mean(0), "part_std": train_parts.std(0) + 1e-6,
            "storage_mean": data.storages[~sto_test].mean(0), "storage_std": data.storages[~sto_test].std(0) + 1e-6,
            "compute_mean": y_c[~dev_test].mean(0), "compute_std": y_c[~dev_test].std(0) + 1e-6,
            "exchange_mean": np.array(y_x[~sto_test].mean()), "exchange_std": np.array(y_x[~sto_test].std() + 1e-6)}
    part_net, device_net, storage_net = _nets(sizes, k)
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    f, fs = data.parts.shape[1], data.storages.shape[1]
    params = {"part": part_net.init(k1, jnp.zeros((1, f))),
              "device": device_net.init(k2, jnp.zeros((1, sizes.part[-1] + 1))),
              "storage": storage_net.init(k3, jnp.zeros((1, fs)))}
    optimizer = optax.adam(optax.cosine_decay_schedule(lr, max(steps, 1)))
    opt_state = optimizer.init(params)
    zc = (y_c - norm["compute_mean"]) / norm["compute_std"]
    zx = (y_x - norm["exchange_mean"]) / norm["exchange_std"]

    @functools.partial(jax.jit, static_argnums=(6,))
    def step(params, opt_state, x, seg, yc, sx, num_sets, yx, mask):
        def loss_fn(params):
            phi = part_net.apply(params["part"], (x - norm["part_mean"]) / norm["part_std"])
            sums = jax.ops.segment_sum(phi, seg, num_sets + 1)[:num_sets]  # the padding's segment is dropped
            count = jax.ops.segment_sum(jnp.ones_like(seg, jnp.float32), seg, num_sets + 1)[:num_sets]
            pc = device_net.apply(params["device"], jnp.concatenate([sums, jnp.log1p(count)[:, None]], 1))
            px = storage_net.apply(params["storage"], (sx - norm["storage_mean"]) / norm["storage_std"])[:, 0]
            return jnp.mean((pc - yc) ** 2) + jnp.sum(mask * (px - yx) ** 2) / jnp.maximum(mask.sum(), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_dev, train_sto = np.nonzero(~dev_test)[0], np.nonzero(~sto_test)[0]
    counts = np.diff(data.part_start)
    cap = _pad(int(np.sort(counts[train_dev])[-batch_devices:].sum()) if len(train_dev) else 1)
    for _ in range(steps):
        devs = rng.choice(train_dev, size=min(batch_devices, len(train_dev)), replace=False)
        x = np.zeros((cap, f), np.float32)
        seg = np.full(cap, len(devs), np.int32)
        at = 0
        for j, d in enumerate(devs):
            rows = data.parts[data.part_start[d]:data.part_start[d + 1]]
            x[at:at + len(rows)], seg[at:at + len(rows)] = rows, j
            at += len(rows)
        sto = rng.choice(train_sto, size=min(batch_devices, len(train_sto)), replace=False)
        sx = np.zeros((batch_devices, fs), np.float32)
        yx = np.zeros(batch_devices, np.float32)
        mask = np.zeros(batch_devices, np.float32)
        sx[:len(sto)], yx[:len(sto)], mask[:len(sto)] = data.storages[sto], zx[sto], 1.0
        params, opt_state, _ = step(params, opt_state, x, seg, zc[devs].astype(np.float32), sx, len(devs), yx, mask)
    model = NeuralCostModel(data.topology, params, norm, sizes, data.phases, data.exchange_kind, labels=data.labels)
    report = evaluate(model, data, dev_test, sto_test)
    model.report = report
    return model, report


def evaluate(model: NeuralCostModel, data: Dataset, dev_mask: np.ndarray, sto_mask: np.ndarray) -> dict:
    """Held-out error of `model` on the masked device and storage samples (and their plans' step costs)."""
    devs = np.nonzero(dev_mask)[0]
    sums = np.zeros((len(devs), model.summary_size))
    for j0 in range(0, len(devs), 256):  # embed a block of devices' parts at once (padded: few shapes compile)
        block = devs[j0:j0 + 256]
        x = np.concatenate([data.parts[data.part_start[d]:data.part_start[d + 1]] for d in block])
        seg = np.repeat(np.arange(len(block)), np.diff(data.part_start)[block])
        padded = np.zeros((_pad(len(x)), x.shape[1]), np.float32)
        padded[:len(x)] = x
        phi = np.asarray(model._embed(model.params, padded), np.float64)[:len(x)]
        np.add.at(sums[j0:j0 + len(block)], seg, np.concatenate([phi, np.ones((len(x), 1))], axis=1))
    pc = model.readout(sums)  # [D, K]
    stos = np.nonzero(sto_mask)[0]
    px = model.exchange_features(data.storages[stos]) if len(stos) else np.zeros(0)
    truth = data.compute[devs]
    plan_true, plan_pred = [], []
    for k in sorted(set(data.device_plan[devs].tolist())):
        dk, sk = data.device_plan[devs] == k, data.storage_plan[stos] == k
        plan_true.append(truth[dk].max(axis=0).sum() + data.exchange[stos][sk].sum())
        plan_pred.append(pc[dk].max(axis=0).sum() + px[sk].sum())

    def ape(pred, true):
        pred, true = np.asarray(pred), np.asarray(true)
        keep = true >= FLOOR_SECONDS  # a phase a device takes no part in has no relative error
        e = np.abs(pred[keep] / true[keep] - 1)
        return {"median": float(np.median(e)), "mean": float(e.mean())} if len(e) else {}

    return {"labels": data.labels, "exchange": data.exchange_kind, "test_plans": len(plan_true),
            "test_devices": len(devs), "test_storages": len(stos),
            "phase_ape": {p: ape(pc[:, j], truth[:, j]) for j, p in enumerate(data.phases)},
            "compute_ape": ape(pc.sum(axis=1), truth.sum(axis=1)),
            "exchange_ape": ape(px, data.exchange[stos]), "plan_ape": ape(plan_pred, plan_true),
            "plan_spearman": spearman(plan_pred, plan_true)}


# ------------------------------------------------------------------------------------ CPU micro-benchmarks
class CpuBench:
    """Times recjax's per-device embedding work and the collectives on this machine's CPU devices.

    rows exchange: a device's work is, per width, one stacked table's gather of its forward rows and scatter-add of
    its updated rows (`run_device_work`); a storage's collectives are exchange.py's (`storage_collectives`).
    pooled exchange: per phase --
      ids / pooled   an all_to_all over the local devices in which every device sends what this one sends (under
                     shard_map the buffers are the busiest device's): timed at power-of-two sizes once
                     (`all_to_all_seconds`), interpolated (log-log) at the device's bytes
      forward        per width, the bags of its parts pooled: every lookup's row gathered and summed into its
                     (example, part) output (`run_pooled_forward`)
      update         per width, each lookup's gradient (its output's) added into its row (`run_pooled_update`)
    Lookups are drawn from each part's frequency profile (rows within a segment uniformly), at most BENCH_CAP.
    Medians of `repeats` timed runs after a warm-up."""

    def __init__(self, repeats: int = 5, seed: int = 0):
        self.repeats = repeats
        self.rng = np.random.default_rng(seed)
        self._compiled: dict = {}
        self._device_work = jax.jit(run_device_work, donate_argnums=0)
        self._forward = jax.jit(run_pooled_forward, static_argnums=2)
        self._update = jax.jit(run_pooled_update, donate_argnums=0)
        self._a2a: tuple[np.ndarray, np.ndarray, int] | None = None  # sizes, seconds, devices

    def _time(self, fn, *args) -> float:
        jax.block_until_ready(fn(*args))  # warm-up
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def _draw(self, parts: PartTable, i: int, count: float, rows: int) -> np.ndarray:
        """min(count, BENCH_CAP) row ids of part i drawn from its profile, in [0, rows)."""
        mass = parts.seg_mass[i] / max(parts.seg_mass[i].sum(), 1e-30)
        edges = np.concatenate([[0.0], np.cumsum(parts.seg_rows[i])])
        edges = edges / max(edges[-1], 1e-30) * rows
        k = int(min(max(1, round(count)), BENCH_CAP["ids"]))
        seg = self.rng.choice(len(mass), size=k, p=mass)
        r = np.floor(edges[seg] + self.rng.random(k) * (edges[seg + 1] - edges[seg])).astype(np.int64)
        return np.clip(r, 0, rows - 1)

    def _groups(self, parts: PartTable, ids: Sequence[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i in ids:
            groups.setdefault(max(1, int(round(parts.width[i]))), []).append(i)
        return dict(sorted(groups.items()))

    def device_work(self, parts: PartTable, ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Rows exchange. Per width: (table f32[R, w], forward ids i32[F], update ids i32[U]) for the parts."""
        work = []
        for width, members in self._groups(parts, ids).items():
            offset, fwd, upd = 0, [], []
            for i in members:
                rows = int(min(max(1, parts.rows[i]), BENCH_CAP["rows"]))
                fwd.append(offset + self._draw(parts, i, parts.fwd_total[i], rows))
                upd.append(offset + self._draw(parts, i, parts.upd_total[i], rows))
                offset += rows
            table = np.zeros((offset, width), np.float32)
            work.append((table, np.concatenate(fwd).astype(np.int32), np.concatenate(upd).astype(np.int32)))
        return work

    def pooled_work(self, parts: PartTable, ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
        """Pooled exchange. Per width: (table f32[R, w], lookups i32[L], their outputs i32[L], outputs O): part
        i's lookups (every one of its rows' lookups) go to its B outputs (its own examples' B / n if replicated),
        each output a uniformly drawn example."""
        problem = parts.problem
        work = []
        for width, members in self._groups(parts, ids).items():
            offset, outputs, lookups, targets = 0, 0, [], []
            for i in members:
                rows = int(min(max(1, parts.rows[i]), BENCH_CAP["rows"]))
                examples = problem.batch_size // (problem.devices if parts.kind[i] == REPLICATED else 1)
                drawn = self._draw(parts, i, parts.fwd_total[i], rows)
                lookups.append(offset + drawn)
                targets.append(outputs + self.rng.integers(0, examples, len(drawn)))
                offset, outputs = offset + rows, outputs + examples
            table = np.zeros((offset, width), np.float32)
            work.append((table, np.concatenate(lookups).astype(np.int32), np.concatenate(targets).astype(np.int32),
                         outputs))
        return work

    def device_phases(self, parts: PartTable, ids: Sequence[int]) -> np.ndarray:
        """f64[K]: seconds of the device's phases under its problem's exchange (zeros for no parts)."""
        exchange = parts.problem.exchange
        if not ids:
            return np.zeros(len(PHASES[exchange]))
        if exchange == "rows":
            return np.array([self.compute(parts, ids)])
        work = self.pooled_work(parts, ids)
        tables = [jnp.asarray(t) for t, _, _, _ in work]
        lookups = [jnp.asarray(x) for _, x, _, _ in work]
        targets = [jnp.asarray(x) for _, _, x, _ in work]
        sizes = tuple(o for *_, o in work)
        forward = self._time(self._forward, tables, lookups, sizes, targets)
        grads = [jnp.ones((o, t.shape[1]), jnp.float32) for t, _, _, o in work]

        def update(tables=tables):
            out = self._update(tables, lookups, targets, grads)
            tables[:] = out  # in place (donated), as the train step updates
            return out
        update_s = self._time(update)
        n = parts.problem.devices
        ids_bytes = float(parts.id_bytes[list(ids)].sum())
        out_bytes = float(parts.out_floats[list(ids)].sum()) * parts.problem.topology.exchange_itemsize
        return np.array([self.all_to_all_seconds(ids_bytes, n), forward,
                         2 * self.all_to_all_seconds(out_bytes, n), update_s])

    def all_to_all_seconds(self, per_device_bytes: float, n: int) -> float:
        """Seconds of an all_to_all over the n local devices, each sending `per_device_bytes` (n equal chunks);
        measured once at power-of-two sizes and interpolated (log-log; 0 for nothing to send or one device)."""
        if per_device_bytes <= 0 or n < 2:
            return 0.0
        if jax.device_count() < n:
            raise ValueError(f"benchmark labels need {n} local devices, there are {jax.device_count()}; set "
                             "--cpu_devices (or JAX_NUM_CPU_DEVICES) or sample plans for fewer devices")
        if self._a2a is None or self._a2a[2] != n:
            sizes = 2.0 ** np.arange(10, 26)  # 1 KiB .. 32 MiB per device
            self._a2a = (sizes, np.array([self._time(all_to_all(int(b), n)) for b in sizes]), n)
        sizes, seconds, _ = self._a2a
        x = np.log(np.clip(per_device_bytes, sizes[0], sizes[-1]))
        t = float(np.exp(np.interp(x, np.log(sizes), np.log(seconds))))
        return t * max(1.0, per_device_bytes / sizes[-1])  # beyond the largest size: in proportion

    def compute(self, parts: PartTable, ids: Sequence[int]) -> float:
        """Rows exchange: seconds of the device's gathers and scatter-adds (0 for no parts)."""
        if not ids:
            return 0.0
        work = self.device_work(parts, ids)
        fn = self._device_work
        tables = [jnp.asarray(t) for t, _, _ in work]
        fwd = [jnp.asarray(f) for _, f, _ in work]
        upd = [jnp.asarray(u) for _, _, u in work]

        def once(tables=tables):
            out = fn(tables, fwd, upd)
            tables[:] = out[0]  # the update is in place (donated), as in the train step
            return out
        return self._time(once)

    def exchange(self, stats: StorageStats, r: int, topology: Topology, exchange: str = "rows") -> float:
        """Seconds of storage r's collectives on the local devices (its device count must be theirs): exchange.py's
        buckets for parts that travel as rows (0 for a storage of pooled parts only: their collectives are the
        devices' phases)."""
        n = jax.device_count()
        if topology.devices != n:
            raise ValueError(f"benchmark exchange labels need plans on the {n} local devices, got {topology.devices};"
                             " set JAX_NUM_CPU_DEVICES or sample plans for this device count")
        kind, dim = int(stats.kind[r]), int(stats.dim[r])
        seconds = 0.0
        rows_part = (stats.worst[r] > 0) if kind == SHARDED else (stats.compact[r] > 0)
        if exchange == "pooled" and not (rows_part or kind == REPLICATED):
            return seconds  # pooled parts' collectives are their devices' phases
        small = int(bucket_capacity(stats.expected[r:r + 1], stats.worst[r:r + 1], topology.capacity_factor,
                                    topology.capacity_sigmas)[0])
        worst = int(bucket_capacity(stats.expected[r:r + 1], stats.worst[r:r + 1], 0.0, 0.0)[0])
        used = worst if stats.requested[r] > small else small
        size = min(used if kind == SHARDED else int(max(1, stats.compact[r])), BENCH_CAP["ids"])
        pad = min(worst if kind == SHARDED else size, BENCH_CAP["ids"])
        fn = self._compiled.get((kind, dim, size, pad))
        if fn is None:
            fn = self._compiled[(kind, dim, size, pad)] = storage_collectives(kind, dim, size, pad, n)
        return seconds + self._time(fn)


def run_device_work(tables, fwd, upd):
    """The owner's work of recjax's step per stacked table: gather the forward rows, scatter-add the updates."""
    out, pooled = [], jnp.zeros((), jnp.float32)
    for table, f, u in zip(tables, fwd, upd, strict=True):
        pooled = pooled + jnp.take(table, f, axis=0).sum()
        out.append(table.at[u].add(jnp.ones((u.shape[0], table.shape[1]), table.dtype)))
    return out, pooled


def run_pooled_forward(tables, lookups, sizes, targets):
    """The pooled exchange's forward per stacked table: each lookup's row summed into its output (f32[O, w])."""
    return [jax.ops.segment_sum(jnp.take(table, x, axis=0), o, num_segments=size)
            for table, x, size, o in zip(tables, lookups, sizes, targets, strict=True)]


def run_pooled_update(tables, lookups, targets, grads):
    """The pooled exchange's update per stacked table: each lookup's output gradient added into its row (SGD)."""
    return [table.at[x].add(-0.01 * jnp.take(g, o, axis=0))
            for table, x, o, g in zip(tables, lookups, targets, grads, strict=True)]


def all_to_all(per_device_bytes: int, n: int):
    """A jitted all_to_all over the n local devices, each sending per_device_bytes in n equal f32 chunks."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((n,), ("d",))
    per_peer = max(1, per_device_bytes // (4 * n))
    fn = jax.jit(jax.shard_map(lambda x: jax.lax.all_to_all(x[0], "d", 0, 0)[None], mesh=mesh, in_specs=P("d"),
                               out_specs=P("d")))
    buf = jax.device_put(jnp.ones((n, n, per_peer), jnp.float32), jax.sharding.NamedSharding(mesh, P("d")))
    return functools.partial(fn, buf)


def storage_collectives(kind: int, dim: int, size: int, pad: int, n: int):
    """A jitted function running one storage's collectives on all n local devices (exchange.py's shapes)."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((n,), ("d",))
    spec = P("d")

    def body(ids, rows):
        if kind == SHARDED:  # ids out, rows back, gradients back; the owner sums over n x pad slots
            got = jax.lax.all_to_all(ids, "d", 0, 0)
            back = jax.lax.all_to_all(rows, "d", 0, 0)
            grads = jax.lax.all_to_all(back, "d", 0, 0)
            flat = jnp.pad(got.reshape(-1), (0, n * (pad - size)))
            summed = jnp.zeros((flat.shape[0], dim), jnp.float32).at[jnp.argsort(flat)].add(
                jnp.pad(grads.reshape(-1, dim), ((0, n * (pad - size)), (0, 0))))
            return summed.sum()
        if kind == REPLICATED:  # ids and gradients all-gathered, every copy sums all of them
            got = jax.lax.all_gather(ids[0], "d", tiled=True)
            grads = jax.lax.all_gather(rows[0], "d", tiled=True)
            return jnp.zeros((got.shape[0], dim), jnp.float32).at[jnp.argsort(got)].add(grads).sum()
        got = jax.lax.all_gather(ids[0], "d", tiled=True)  # column: ids gathered, slices both ways
        part = rows[0].reshape(n, size, -1) if dim % n == 0 else rows[0][None]
        back = jax.lax.all_to_all(part, "d", 0, 0, tiled=True)
        return (got.sum() + jax.lax.all_to_all(back, "d", 0, 0, tiled=True).sum()).astype(jnp.float32)

    fn = jax.jit(jax.shard_map(lambda i, r: body(i[0], r[0])[None], mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    ids = jnp.zeros((n, n, size), jnp.int32)
    rows = jnp.ones((n, n, size, dim), jnp.float32)
    ids = jax.device_put(ids, jax.sharding.NamedSharding(mesh, spec))
    rows = jax.device_put(rows, jax.sharding.NamedSharding(mesh, spec))
    return functools.partial(fn, ids, rows)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan for fewer than 2 points or a constant input."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2:
        return math.nan

    def ranks(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):  # ties share their mean rank
            r[x == v] = r[x == v].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])
