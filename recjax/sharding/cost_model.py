"""What one training step's embedding work costs each device under a sharding plan, in seconds.

The planner (recjax/sharding/planner.py) searches with one interface, `CostModel`:

    summaries(parts, ids) -> f64[P, H]   each table part's additive contribution to its device's summary
    readout(sums) -> f64[S, K]           a device's seconds in each of the model's K `phases`, from the sum of its
                                         parts' summaries
    exchange(stats) -> f64[S]            each storage's collectives that do not depend on one device, paid by all

and two implementations: `AnalyticCostModel` (below: bytes over bandwidths, mirroring what the runtime runs) and
`NeuralCostModel` (experiments/planning/cost_net.py: small MLPs pre-trained on sampled plans, NeuroShard -- Zha et
al. 2023, "Pre-train and Search: Efficient Embedding Table Sharding with Pre-trained Neural Cost Models").

A plan's step cost: every phase ends in a collective, which no device leaves before the slowest has arrived, so a
phase costs its slowest device, and the step is the sum over phases plus the exchange:

    step = sum_k max_d phase_k(d) + sum_s exchange_s

This is NeuroShard's max over devices of (fwd compute + fwd comm + bwd compute + bwd comm) with each communication
counting the wait for the stragglers: a device's fwd compute plus its wait at the all-to-all is the slowest
device's fwd compute.

Two exchanges (`Problem.exchange`), one model each (`AnalyticCostModel(topology, exchange)`):
  rows    today's runtime (recjax/sharding/exchange.py): ids go to the owners of the rows, rows come back, row
          gradients go back. One phase, "compute" (a device's lookups and updates); the all_to_all buckets are
          sized by the busiest owner's ids and every device pays them (`exchange`).
  pooled  the exchange of ../shared/DESIGN.md ("The exchange"): owners pool the bags of their rows and send one
          vector per (example, table) -- row-wise parts partial sums, column-wise parts pooled slices -- and the
          pooled gradient comes back to be expanded to the rows. Tables that cannot pool on the owner
          (`PlannerTable.poolable`, e.g. methods whose combine is not linear per row) still travel as rows, as in
          `rows`. Phases, each charged per device for what it sends and receives:
            ids      the bag ids of its parts arriving from the other devices (every slot: batches have fixed shapes)
            forward  pooling: each lookup's row read (hot rows from cache), the pooled outputs written
            pooled   the pooled outputs sent and their gradients received: 2 x B x W_d x itemsize x (n - 1) / n,
                     W_d the sum of its parts' output widths (NeuroShard's "sum of dims")
            update   each lookup's gradient added into its row, the touched rows updated with their optimizer state
          Under `jax.shard_map` every device runs one program, so an all_to_all's buffers are as large as the
          busiest device's: the slowest device sets the phase, as the formula says.

Inputs
  PlannerTable   a physical table (`TableInfo`: rows, dim, bag slots, optimizer state floats) with its pooling factor
                 (mean ids per example), id-frequency distribution (`AccessProfile`, uniform when unknown) and
                 whether its bags can be pooled on the owner
  Topology       the devices: how many, per host, memory each, the bandwidths and latencies below
  Problem        tables + topology + global batch + how row-wise tables split their rows (range / mod) + exchange

A table's *part* is what one device holds of it: the whole table (table-wise), one of k row ranges (row-wise over k
devices), one of k column slices of width d / k (column-wise: k = n in the runtime, any power of two for
NeuroShard's halvings) or a copy (replicated). `PartTable` computes each part's arrays once; a device's compute is a
function of the set of parts it holds.

Analytic compute (per device, per step; B the global batch, n devices, q = B x pooling lookups of a table a step):
  rows touched, not rows held, with the skew of the id distribution: the profile splits a table's rows by frequency
  rank into segments g of r_g rows receiving a share m_g of the lookups; x lookups touch r_g (1 - exp(-x m_g / r_g))
  distinct rows of g (Poisson).
    forward (rows)    n requesters x distinct(q / n) rows read, d x 4 bytes each (replicated: only its own q / n):
                      recjax dedups per device before the exchange
    forward (pooled)  every lookup of its rows read (replicated: its own examples' q / n), then B x width x 4 bytes
                      of pooled outputs written
    update            distinct(q) rows read + written with their optimizer state: 2 (d + s) x 4 bytes each (the
                      owner dedups before the update); pooled: plus each lookup's output gradient read (4 x width)
                      and the sort that dedups the ids it received (`id_seconds` each)
  A random row access costs `access_bytes` more than its bytes (its fixed part), so splitting a table by columns
  over k devices, each reading every lookup's slice, costs more than 1 / k of the table's reads each.
  Cache/skew term: each device keeps its most-read rows in `cache_bytes` (an LFU cache), shared by its parts in
  proportion to their lookups; a part's cached rows are its top-ranked ones, so the rows read from the top c
  ranks are served at `cache_bandwidth`, the others at `memory_bandwidth`. Hot tables cost less per lookup than
  uniform ones twice over: fewer distinct rows, and more of them cached. The cache makes a device's compute
  non-linear in the set of parts it holds; with the pooled exchange so does `kernel_overhead`, paid per kernel
  (forward and update) for every width the device holds (the runtime stacks tables of one width into one array,
  one kernel each: FBGEMM's fused multi-table kernel, Zha et al.'s source of non-linearity).
Analytic exchange (per storage = the tables of one dim and kind, as exchange.py stacks them; every device pays it):
  table-/row-wise   static all_to_all buckets of C1 slots per (device, owner): C1 = capacity_factor x E +
  (rows)            capacity_sigmas x sqrt(E), E = the most distinct ids a device is expected to send one owner (per
                    table the owner's share of the rows its b x bag slots hit, ids spread evenly), capped by the worst
                    case C; a step whose distinct requests to some owner exceed C1 takes C instead (the profile gives
                    the expected distinct requests: a hot head split by `range` overflows). Per peer C1 slots carry
                    an id out, a row back and a gradient back: C1 (4 + 2 d x itemsize) bytes, over the intra-host
                    bandwidth to the h - 1 peers of its host and the inter-host bandwidth to the n - h others; the
                    owner's dedup + update then runs over all n x C received slots (the worst case's length).
  replicated        the touched rows' ids and gradients all-gathered: (n - 1) S (4 + d x itemsize) bytes in, and
                    every copy dedups n x S ids; S = the fewer of the device's distinct ids and the storage's rows
  column-wise       the ids all-gathered ((n - 1) S x 4), the column slices of the rows and of their gradients
  (rows)            all_to_all'd ((n - 1) S d / n x itemsize each way)
  pooled parts      nothing here: their bytes are the per-device phases above, and the ids, the outputs and their
                    gradients of every table cross in one all_to_all each (`collective_latency` in those phases)
  plus `collective_latency` per collective, `id_seconds` per id each device (or copy) sorts to dedup its received
  slots, and, with the rows exchange, `kernel_overhead` per storage kernel.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from recjax.sharding.plan import TableInfo, TablePlacement, expected_distinct

# Rank fractions (rows sorted by how often they are read) at which an AccessProfile stores its cumulative share of
# the lookups; log-spaced so the hot head of a 10M-row table is resolved to a few rows.
RANK_GRID = np.array([0.0, 1e-7, 1e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0])
SEGMENTS = len(RANK_GRID) - 1
KINDS = ("sharded", "replicated", "column")  # storage kinds: table-/row-wise, replicated, column-wise
SHARDED, REPLICATED, COLUMN = range(3)
EXCHANGES = ("rows", "pooled")  # Problem.exchange: today's runtime, DESIGN.md's pooled exchange
PHASES = {"rows": ("compute",), "pooled": ("ids", "forward", "pooled", "update")}
# Kernel groups of the pooled model: a part of width w counts in slot round(2 log2 w) (half octaves: the usual
# widths 4, 8, 12, 16, 24, 32, ... get a slot each), and a device pays `kernel_overhead` per occupied slot.
WIDTH_SLOTS = 41
_TINY = 1e-30


# ------------------------------------------------------------------------------------------------------- inputs
@dataclasses.dataclass(frozen=True)
class AccessProfile:
    """An id-frequency distribution: `cdf[g]` = the share of a table's lookups that go to its top RANK_GRID[g]
    fraction of rows (ranked by frequency). Between grid points rows are read equally often."""

    cdf: tuple[float, ...]

    def __post_init__(self):
        c = np.asarray(self.cdf, float)
        if c.shape != RANK_GRID.shape or abs(c[0]) > 1e-12 or abs(c[-1] - 1) > 1e-9 or np.any(np.diff(c) < -1e-12):
            raise ValueError(f"an access profile is {len(RANK_GRID)} non-decreasing cumulative shares from 0 to 1 "
                             f"(at rank fractions {RANK_GRID.tolist()}), got {self.cdf}")

    @classmethod
    def uniform(cls) -> "AccessProfile":
        return cls(tuple(RANK_GRID.tolist()))

    @classmethod
    def zipf(cls, alpha: float, rows: int) -> "AccessProfile":
        """Row of rank i (1-based) read with probability proportional to i^-alpha."""
        if alpha < 0 or rows < 1:
            raise ValueError(f"zipf profile needs alpha >= 0 and rows >= 1, got alpha={alpha}, rows={rows}")
        h = zipf_cumulative(RANK_GRID * rows, alpha)
        return cls(tuple(np.clip(h / h[-1], 0.0, 1.0).tolist()))

    def masses(self) -> np.ndarray:
        """f64[SEGMENTS]: the share of lookups in each rank segment."""
        return np.maximum(np.diff(np.asarray(self.cdf)), 0.0)


def zipf_cumulative(x: np.ndarray, alpha: float, head: int = 4096) -> np.ndarray:
    """H(x) = sum_{i <= x} i^-alpha, continuous in x (linear within [i, i + 1)); exact for the first `head` ranks,
    the integral from head + 1/2 beyond (the midpoint rule's error is below 1e-6 relative there)."""
    x = np.asarray(x, float)
    exact = np.concatenate([[0.0], np.cumsum(np.arange(1, head + 1, dtype=float) ** -alpha)])
    lo = np.minimum(np.floor(x), head).astype(int)
    small = exact[lo] + (np.minimum(x, head) - lo) * (lo + 1.0) ** -alpha
    a, b = head + 0.5, np.maximum(x, head) + 0.5
    tail = np.log(b / a) if alpha == 1 else (b ** (1 - alpha) - a ** (1 - alpha)) / (1 - alpha)
    return np.where(x <= head, small, exact[head] + tail)


@dataclasses.dataclass(frozen=True)
class PlannerTable:
    """A physical table as the planner sees it. `pooling`: mean ids per example (None: every one of the
    `info.bag_size` slots, an upper bound); `ordered`: ids numbered by frequency (a frequency vocabulary), so a
    `range` row split puts the hot head on the first part -- with hashed or permuted ids each part gets an even
    share; `poolable`: the owner may pool its bags (False for a method whose combine is not linear per row: its
    rows travel even under the pooled exchange)."""

    info: TableInfo
    pooling: float | None = None
    access: AccessProfile = dataclasses.field(default_factory=AccessProfile.uniform)
    ordered: bool = False
    poolable: bool = True  # its bags can be pooled where its rows live (the pooled exchange; sum / mean bags)

    @property
    def lookups_per_example(self) -> float:
        return float(self.info.bag_size if self.pooling is None else self.pooling)


@dataclasses.dataclass(frozen=True)
class Topology:
    """The devices a plan runs on. Bandwidths are bytes per second per device."""

    devices: int
    devices_per_host: int
    memory_bytes: int  # tables + optimizer state per device
    memory_bandwidth: float  # table rows read / written
    cache_bytes: int  # hot rows kept on chip (GPU L2, CPU last-level cache share)
    cache_bandwidth: float
    intra_host_bandwidth: float  # to the other devices of its host (NVLink; memory copies between CPU devices)
    inter_host_bandwidth: float  # to devices of other hosts (the network)
    collective_latency: float  # seconds per collective
    kernel_overhead: float  # seconds per kernel (a storage's gather, its update) per step
    exchange_itemsize: int = 4  # bytes per element of rows and gradients between devices (sharding.exchange_dtype)
    capacity_factor: float = 1.0  # sharding.capacity_factor
    capacity_sigmas: float = 7.0  # sharding.capacity_sigmas
    # What a random row access costs beyond its own bytes, in bytes at memory bandwidth (its fixed part: address
    # arithmetic, a cache line's latency not hidden): a column slice of 2 floats costs about a third of a row of 16,
    # not an eighth (`benchmarks/planner.py --sections measure`, gather_rows_per_s_width_*).
    access_bytes: int = 0
    # Seconds per id a device sorts and deduplicates (the owner's dedup before an update, a copy's of the gathered
    # ids): on a CPU this costs more than the row it names (0: not modelled).
    id_seconds: float = 0.0

    def __post_init__(self):
        if self.devices < 1 or self.devices_per_host < 1 or self.devices % self.devices_per_host:
            raise ValueError(f"topology: {self.devices} devices in hosts of {self.devices_per_host}: the device "
                             "count must be a positive multiple of the devices per host")
        for name in ("memory_bandwidth", "cache_bandwidth", "intra_host_bandwidth", "inter_host_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"topology: {name} must be > 0, got {getattr(self, name)}")

    @property
    def hosts(self) -> int:
        return self.devices // self.devices_per_host

    @classmethod
    def cpu_host(cls, devices: int, memory_bytes: int, **changes) -> "Topology":
        """CPU devices of one host (what `jax_num_cpu_devices` makes, and the trainer's default): collectives are
        memory copies. The ratios of the bandwidths are this machine's (`python benchmarks/planner.py --sections
        measure`: random-row gather : gather from a cache-sized working set : all_to_all per device = 1 : 2 : 0.28,
        benchmarks/RESULTS.md "Sharding planner"); the scale is a round 4 GB/s for one core's gather."""
        values = dict(devices=devices, devices_per_host=devices, memory_bytes=int(memory_bytes),
                      memory_bandwidth=4e9, cache_bytes=2 << 20, cache_bandwidth=8e9, intra_host_bandwidth=1.1e9,
                      inter_host_bandwidth=1.1e9, collective_latency=100e-6, kernel_overhead=50e-6,
                      access_bytes=16, id_seconds=40e-9)
        return cls(**{**values, **changes})

    @classmethod
    def gpu_cluster(cls, devices: int, memory_bytes: int, devices_per_host: int = 8, **changes) -> "Topology":
        """A100-like hosts of 8 GPUs (HBM2e ~1.5 TB/s, 40 MB L2, NVLink ~240 GB/s per GPU, 200 Gb/s network per
        GPU): the public spec sheets' round numbers, not a measurement."""
        values = dict(devices=devices, devices_per_host=min(devices_per_host, devices), memory_bytes=int(memory_bytes),
                      memory_bandwidth=1.5e12, cache_bytes=40 << 20, cache_bandwidth=5e12, intra_host_bandwidth=2.4e11,
                      inter_host_bandwidth=2.5e10, collective_latency=20e-6, kernel_overhead=10e-6)
        return cls(**{**values, **changes})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A sharding task: place `tables` on `topology` for a global batch of `batch_size` examples."""

    tables: tuple[PlannerTable, ...]
    topology: Topology
    batch_size: int
    row_split: str = "range"  # how row-wise tables split their rows (sharding.row_split)
    exchange: str = "rows"  # what crosses between devices (EXCHANGES; the module docstring)
    # Column-wise over every device only, as the runtime's column layout splits a table (recjax/sharding/exchange.py);
    # False: with the pooled exchange also over 2, 4, ... devices (NeuroShard's halvings, `column_counts`).
    whole_columns: bool = False

    def __post_init__(self):
        names = [t.info.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {sorted(n for n in names if names.count(n) > 1)}")
        if self.row_split not in ("range", "mod"):
            raise ValueError(f"row_split must be 'range' or 'mod', got {self.row_split!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")

    @property
    def devices(self) -> int:
        return self.topology.devices

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {"data": self.topology.devices, "model": 1}

    def column_allowed(self, t: int, k: int | None = None) -> bool:
        """Column-wise over k devices (default every device): the dim must split evenly and the optimizer state be
        element-wise."""
        info = self.tables[t].info
        return info.dim % (k or self.devices) == 0 and not 0 < info.state_floats < info.dim

    def column_counts(self, t: int) -> list[int]:
        """The column splits a plan may give table t: over every device with the rows exchange or `whole_columns`
        (what recjax/sharding/exchange.py runs); else, with the pooled exchange, each slice is a table of width
        dim / k of its own, so also over 2, 4, 8, ... devices (NeuroShard's halvings, Zha et al. 2023)."""
        n = self.devices
        counts = [n] if self.exchange == "rows" or self.whole_columns else sorted({*split_counts(n), n})
        return [k for k in counts if k > 1 and self.column_allowed(t, k)]


# -------------------------------------------------------------------------------------------------------- parts
class PartTable:
    """Arrays of every table part the search has looked at, one row per (table, kind, parts k, index j); a row does
    not depend on the device that holds it. `index(...)` computes a row on first use."""

    FIELDS_1D = ("table", "kind", "dim", "width", "rows", "mem_bytes", "fwd_bytes", "upd_bytes", "cache_row_bytes",
                 "lookups", "expected_slots", "worst_slots", "requested", "compact", "fwd_total", "upd_total",
                 "shape", "scale", "pooled", "out_floats", "id_bytes", "stream_fwd", "stream_upd", "slot")
    FIELDS_2D = ("seg_rows", "seg_start", "fwd", "upd", "seg_mass")

    def __init__(self, problem: Problem):
        self.problem = problem
        self._base: dict[tuple[int, int, int], int] = {}  # (table, kind, k) -> the row of its part 0
        self.size = 0
        self._cap = 256
        for f in self.FIELDS_1D:
            setattr(self, f, np.zeros(self._cap))
        for f in self.FIELDS_2D:
            setattr(self, f, np.zeros((self._cap, SEGMENTS)))

    def index(self, t: int, kind: int, k: int | None = None, j: int = 0) -> int:
        """The row of part j of table t split into k parts of `kind`: row-wise parts (k = 1: the whole table), or
        column slices of width dim / k (default k = every device; slices of one width share a row); replicated
        copies take no k."""
        if kind == SHARDED:
            k = 1 if k is None else k
        elif kind == COLUMN:
            k, j = (self.problem.devices if k is None else k), 0
        else:
            k, j = 1, 0
        key = (t, kind, k)
        base = self._base.get(key)
        if base is None:
            rows = self._rows(*key)
            count = len(rows["rows"])
            if self.size + count > self._cap:
                self._cap = max(2 * self._cap, self.size + count)
                for f in (*self.FIELDS_1D, *self.FIELDS_2D):
                    old = getattr(self, f)
                    new = np.zeros((self._cap, *old.shape[1:]))
                    new[:self.size] = old[:self.size]
                    setattr(self, f, new)
            for f, v in rows.items():
                getattr(self, f)[self.size:self.size + count] = v
            # Parts of an even split are scaled copies of part 0: every segment holds the same share of its rows
            # and lookups, so rows touched, bytes and cache hits (at a share of the cache in proportion to the
            # lookups) all scale with the part's rows. Models may compute one and scale (`shape`, `scale`).
            even = count > 1 and not (self.problem.row_split == "range" and self.problem.tables[t].ordered)
            held = rows["rows"]
            self.shape[self.size:self.size + count] = self.size if even else np.arange(self.size, self.size + count)
            self.scale[self.size:self.size + count] = held / held[0] if even and held[0] > 0 else 1.0
            base = self._base[key] = self.size
            self.size += count
        return base + j

    def _accessed(self, nbytes: float) -> float:
        """The bytes one random access to `nbytes` costs (`Topology.access_bytes` more)."""
        return float(nbytes + self.problem.topology.access_bytes)

    def value(self, field: str, t: int, kind: int, k: int | None = None, j: int = 0) -> float:
        """One field of a part's row (the row is made first: making it may reallocate the arrays)."""
        i = self.index(t, kind, k, j)
        return float(getattr(self, field)[i])

    def _rows(self, t: int, kind: int, k: int) -> dict:
        """All k parts' rows at once (vectorized over the part index j; one row for column slices)."""
        p = self.problem
        table = p.tables[t]
        info = table.info
        n = p.devices
        q = p.batch_size * table.lookups_per_example
        edges = RANK_GRID * info.rows
        seg_rows = np.diff(edges)[None, :]
        seg_mass = table.access.masses()[None, :]
        held = np.full(1, float(info.rows))
        if kind == COLUMN and (info.dim % k or k < 1):
            raise ValueError(f"table {info.name!r}: dim {info.dim} does not split into {k} column slices")
        if kind == SHARDED and k > 1:
            j = np.arange(k)
            held = part_rows_array(info.rows, k, p.row_split).astype(float)
            if p.row_split == "range" and table.ordered:  # ranks [j chunk, j chunk + held): the hot head on part 0
                start = (j * -(-info.rows // k))[:, None]
                overlap = np.clip(np.minimum(edges[None, 1:], start + held[:, None])
                                  - np.maximum(edges[None, :-1], start), 0, None)
                frac = overlap / np.maximum(seg_rows, _TINY)
            else:  # every part an even share of every segment
                frac = np.repeat(held[:, None] / info.rows, SEGMENTS, axis=1)
            seg_rows, seg_mass = seg_rows * frac, seg_mass * frac
        width = info.dim / k if kind == COLUMN else float(info.dim)
        state = info.state_floats / k if kind == COLUMN else float(info.state_floats)
        local = _distinct(seg_rows, seg_mass * q / n)  # one requester's distinct rows of this part, per segment
        everyone = _distinct(seg_rows, seg_mass * q)  # distinct rows of the whole batch
        pooling = p.exchange == "pooled" and table.poolable  # bags pooled where the rows are read
        if pooling:  # every lookup of its rows read (a replicated copy: its own examples')
            fwd = seg_mass * q / n if kind == REPLICATED else seg_mass * q
        else:
            fwd = local if kind == REPLICATED else n * local
        pooled = pooling and kind != REPLICATED  # its outputs cross the pooled all_to_all
        slots = p.batch_size / n * info.bag_size
        m = len(held)
        seg_start = np.concatenate([np.zeros((m, 1)), np.cumsum(seg_rows, axis=1)[:, :-1]], axis=1)
        full = np.ones(m)
        share = seg_mass.sum(1) / max(float(table.access.masses().sum()), _TINY)  # of the table's lookups
        examples = p.batch_size / n if kind == REPLICATED else p.batch_size
        bucketed = 0.0 if pooled else 1.0  # unpooled table-/row-wise parts fill the row exchange's buckets
        return dict(
            table=t * full, kind=kind * full, dim=info.dim * full, width=width * full, rows=held,
            mem_bytes=full * (info.rows * info.row_bytes // k) if kind == COLUMN else held * info.row_bytes,
            fwd_bytes=self._accessed(4 * width) * full, upd_bytes=2 * self._accessed(4 * (width + state)) * full,
            cache_row_bytes=4 * (width + state) * full,
            lookups=q * seg_mass.sum(1),
            expected_slots=bucketed * held * expected_distinct(info.rows, slots) / info.rows,
            worst_slots=bucketed * np.minimum(held, slots), requested=bucketed * local.sum(1),
            compact=(0.0 if pooled else min(info.rows, slots)) * full,
            fwd_total=fwd.sum(1), upd_total=everyone.sum(1),
            seg_rows=seg_rows, seg_start=seg_start, fwd=fwd, upd=everyone, seg_mass=seg_mass,
            pooled=float(pooled) * full, out_floats=(p.batch_size * width if pooled else 0.0) * full,
            id_bytes=(4.0 * p.batch_size * info.bag_size * share) if pooled else 0.0 * full,
            stream_fwd=(4.0 * examples * width if pooling else 0.0) * full,
            stream_upd=(4.0 * width * fwd.sum(1)) if pooling else 0.0 * full,
            slot=np.clip(np.round(2 * np.log2(max(width, 1.0))), 0, WIDTH_SLOTS - 1) * full)


def split_counts(n: int) -> list[int]:
    """Part counts the planner offers for splitting a table over devices: 2, 4, 8, ... and n."""
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n] if n > 1 else []


def part_rows_array(rows: int, parts: int, split: str) -> np.ndarray:
    """i64[parts]: `plan.part_rows(rows, parts, j, split)` for every j at once (tests check they agree)."""
    j = np.arange(parts)
    if split == "mod":
        return np.maximum(0, -(-(rows - j) // parts))
    chunk = -(-rows // parts)
    return np.clip(np.minimum(rows, (j + 1) * chunk) - j * chunk, 0, None)


def _distinct(rows: np.ndarray, lookups: np.ndarray) -> np.ndarray:
    """Expected distinct rows touched per segment when `lookups` fall evenly (Poisson) on its `rows`."""
    safe = np.maximum(rows, _TINY)
    return np.where(rows > 0, safe * -np.expm1(-lookups / safe), 0.0)


@dataclasses.dataclass
class StorageStats:
    """One row per storage (the tables of one dim and kind): what its collectives' sizes depend on.
    E / C / A: the most slots expected / worst case / distinct ids expected from one device to one owner
    (table-/row-wise parts that travel as rows); S: the compact buffer of replicated and column-wise storages;
    `pooled`: whether any of its parts send pooled outputs (their collectives' latencies)."""

    kind: np.ndarray
    dim: np.ndarray
    expected: np.ndarray
    worst: np.ndarray
    requested: np.ndarray
    compact: np.ndarray
    pooled: np.ndarray | None = None

    def __post_init__(self):
        if self.pooled is None:
            self.pooled = np.zeros(len(self.kind))

    def __len__(self) -> int:
        return len(self.kind)

    @classmethod
    def of_rows(cls, rows: Sequence[Sequence[float]]) -> "StorageStats":
        """From rows (kind, dim, E, C, A, S, pooled)."""
        a = np.array(rows, float).reshape(-1, 7)
        return cls(a[:, 0].astype(int), a[:, 1], a[:, 2], a[:, 3], a[:, 4], a[:, 5], a[:, 6])


# ---------------------------------------------------------------------------------------------------- interface
class CostModel(Protocol):
    """A device's compute is a function of the *sum* of its parts' summary vectors (a DeepSets form: NeuroShard's
    compute net embeds each table, sums and maps the sum to a cost), so the search updates a device by adding or
    subtracting one vector and reads many candidate devices out in one call."""

    name: str
    topology: Topology
    summary_size: int
    phases: tuple[str, ...]  # what readout's columns are; each ends in a collective (module docstring)
    exchange_kind: str  # the Problem.exchange it models

    def summaries(self, parts: PartTable, ids: np.ndarray) -> np.ndarray:
        """f64[P, summary_size]: each part's additive contribution to its device's summary."""

    def readout(self, sums: np.ndarray) -> np.ndarray:
        """f64[S, len(phases)]: seconds of each device's work per phase, from its summary f64[S, summary_size]."""

    def exchange(self, stats: StorageStats) -> np.ndarray:
        """f64[len(stats)]: seconds per storage of its collectives and its padded owner-side work, every device's."""


def check_model(model: CostModel, problem: Problem) -> None:
    """A model is for one exchange: scoring another's plans with it is an error, not a silent guess."""
    if model.exchange_kind != problem.exchange:
        raise ValueError(f"the {model.name} cost model models the {model.exchange_kind!r} exchange, the problem has "
                         f"exchange={problem.exchange!r}; make the model for it")


def device_compute(model: CostModel, parts: PartTable, ids: np.ndarray, sets: np.ndarray, num_sets: int
                   ) -> np.ndarray:
    """f64[num_sets, K]: seconds per phase of each set of parts (`ids` part rows, `sets` which set each belongs
    to): each set is one device's."""
    sums = np.zeros((num_sets, model.summary_size))
    if len(ids):
        np.add.at(sums, np.asarray(sets), model.summaries(parts, np.asarray(ids)))
    return model.readout(sums)


@dataclasses.dataclass(frozen=True)
class PlanCost:
    compute: np.ndarray  # f64[n, K]: per device and phase
    exchange: float  # every device's, summed over storages
    storages: dict  # {(dim, kind name): seconds}
    phases: tuple[str, ...] = ("compute",)

    @property
    def phase_max(self) -> np.ndarray:
        """f64[K]: each phase's slowest device."""
        return self.compute.max(axis=0)

    @property
    def step(self) -> float:
        """The step's embedding seconds: every phase's slowest device, summed, plus the exchange."""
        return float(self.phase_max.sum() + self.exchange)

    @property
    def devices(self) -> np.ndarray:
        """f64[n]: each device's own seconds (its phases summed, plus the exchange); the step is at least their
        max, and more where different devices are the slowest of different phases."""
        return self.compute.sum(axis=1) + self.exchange

    def to_json(self) -> dict:
        return {"step_ms": 1e3 * self.step, "exchange_ms": 1e3 * self.exchange,
                "phases_ms": {k: 1e3 * float(v) for k, v in zip(self.phases, self.phase_max, strict=True)},
                "compute_ms": [1e3 * c for c in self.compute.sum(axis=1).tolist()],
                "storages_ms": {f"dim{d}/{k}": 1e3 * v for (d, k), v in self.storages.items()}}


# A device's cache bytes per lookup at which the analytic model tabulates each part's seconds (log-spaced; beyond the
# ends the nearest value holds).
CACHE_PER_LOOKUP = np.geomspace(1e-4, 1e9, 64)


class AnalyticCostModel:
    """Bytes over bandwidths (the module docstring has the terms), for the `exchange` it is told (EXCHANGES).

    The cache couples a device's parts: each gets the cache in proportion to its lookups, i.e. kappa x its lookups
    bytes, kappa = cache_bytes / the device's lookups. A part's summary is therefore (its lookups, its seconds at
    each kappa of CACHE_PER_LOOKUP); the readout sums, computes the device's kappa and interpolates (linear in log
    kappa). `exact_compute` is the same without the table, the oracle for the interpolation.

    Summary columns: rows exchange [lookups, seconds at each kappa]; pooled exchange [lookups, forward row-read
    seconds at each kappa, update row seconds at each kappa, id bytes, pooled output floats, streamed forward bytes,
    streamed update bytes, one count per width slot]; the pooled outputs' floats are B x the output width."""

    name = "analytic"

    def __init__(self, topology: Topology, exchange: str = "rows"):
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        self.topology, self.exchange_kind = topology, exchange
        self.phases = PHASES[exchange]
        g = len(CACHE_PER_LOOKUP)
        self.summary_size = 1 + g if exchange == "rows" else 1 + 2 * g + 4 + WIDTH_SLOTS

    def summaries(self, parts: PartTable, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        shapes, inverse = np.unique(parts.shape[ids].astype(np.int64), return_inverse=True)
        fwd, upd = self._seconds(parts, shapes, CACHE_PER_LOOKUP[None, :] * parts.lookups[shapes][:, None])
        scale = parts.scale[ids][:, None]
        lookups = parts.lookups[ids][:, None]
        if self.exchange_kind == "rows":
            return np.concatenate([lookups, (fwd + upd)[inverse] * scale], axis=1)
        slots = np.zeros((len(ids), WIDTH_SLOTS))
        slots[np.arange(len(ids)), parts.slot[ids].astype(np.int64)] = 1.0
        extra = np.stack([parts.id_bytes[ids], parts.out_floats[ids], parts.stream_fwd[ids], parts.stream_upd[ids]],
                         axis=1)
        return np.concatenate([lookups, fwd[inverse] * scale, upd[inverse] * scale, extra, slots], axis=1)

    def readout(self, sums: np.ndarray) -> np.ndarray:
        sums = np.atleast_2d(sums)
        lookups = sums[:, 0]
        grid = np.log(CACHE_PER_LOOKUP)
        g = len(grid)
        x = np.clip(np.log(self.topology.cache_bytes / np.maximum(lookups, _TINY)), grid[0], grid[-1])
        i = np.clip(np.searchsorted(grid, x) - 1, 0, g - 2)
        w = (x - grid[i]) / (grid[i + 1] - grid[i])
        rows = np.arange(len(sums))
        busy = lookups > 0

        def at_kappa(first: int) -> np.ndarray:  # the tabulated seconds in columns [first, first + g)
            value = sums[rows, first + i] * (1 - w) + sums[rows, first + 1 + i] * w
            return np.where(busy, value, 0.0)

        if self.exchange_kind == "rows":
            return at_kappa(1)[:, None]
        topo = self.topology
        id_bytes, out_floats, stream_fwd, stream_upd = (sums[:, 1 + 2 * g + c] for c in range(4))
        kernels = (sums[:, 1 + 2 * g + 4:] > 0.5).sum(axis=1) * topo.kernel_overhead
        n = topo.devices
        # One all_to_all each for the ids, the pooled outputs and their gradients, every table's together (each
        # device's buffer holds all its parts'); its own examples' 1 / n stay local.
        latency = topo.collective_latency if n > 1 else 0.0
        ids = self.wire(id_bytes / n) + np.where(id_bytes > 0, latency, 0.0)
        forward = at_kappa(1) + stream_fwd / topo.memory_bandwidth + kernels
        pooled = 2 * (self.wire(out_floats * topo.exchange_itemsize / n) + np.where(out_floats > 0, latency, 0.0))
        update = at_kappa(1 + g) + stream_upd / topo.memory_bandwidth + kernels + id_bytes / 4 * topo.id_seconds
        return np.stack([ids, forward, pooled, update], axis=1)

    def wire(self, per_peer_bytes: np.ndarray) -> np.ndarray:
        """Seconds for a device to send `per_peer_bytes` to each other device (and receive as much): over the
        intra-host bandwidth to the h - 1 peers of its host and the inter-host bandwidth to the n - h others."""
        topo = self.topology
        n, h = topo.devices, topo.devices_per_host
        return per_peer_bytes * ((h - 1) / topo.intra_host_bandwidth + (n - h) / topo.inter_host_bandwidth)

    def exact_compute(self, parts: PartTable, ids: np.ndarray, sets: np.ndarray, num_sets: int) -> np.ndarray:
        """f64[num_sets, K]: seconds per set without the tabulation: each part's cache share from its set's total
        lookups (the pooled phases' other terms are sums, computed as `readout` does)."""
        ids, sets = np.asarray(ids, np.int64), np.asarray(sets, np.int64)
        lookups = parts.lookups[ids]
        total = np.bincount(sets, lookups, num_sets)
        cache = self.topology.cache_bytes * lookups / np.maximum(total[sets], _TINY)
        fwd, upd = self._seconds(parts, ids, cache[:, None])
        fwd = np.bincount(sets, fwd[:, 0], num_sets)
        upd = np.bincount(sets, upd[:, 0], num_sets)
        if self.exchange_kind == "rows":
            return (fwd + upd)[:, None]
        sums = np.zeros((num_sets, self.summary_size))
        np.add.at(sums, sets, self.summaries(parts, ids))
        out = self.readout(sums)
        g = len(CACHE_PER_LOOKUP)
        # Replace the tabulated row seconds (the readout's interpolation) by the exact ones.
        out[:, 1] += fwd - np.where(total > 0, self._interpolated(sums, 1), 0.0)
        out[:, 3] += upd - np.where(total > 0, self._interpolated(sums, 1 + g), 0.0)
        return out

    def _interpolated(self, sums: np.ndarray, first: int) -> np.ndarray:
        grid = np.log(CACHE_PER_LOOKUP)
        x = np.clip(np.log(self.topology.cache_bytes / np.maximum(sums[:, 0], _TINY)), grid[0], grid[-1])
        i = np.clip(np.searchsorted(grid, x) - 1, 0, len(grid) - 2)
        w = (x - grid[i]) / (grid[i + 1] - grid[i])
        rows = np.arange(len(sums))
        return sums[rows, first + i] * (1 - w) + sums[rows, first + 1 + i] * w

    def _seconds(self, parts: PartTable, ids: np.ndarray, cache_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(forward, update) f64[P, K] each: each part's row seconds when it has cache_bytes[:, k] of cache for its
        hottest rows."""
        topo = self.topology
        cache_rows = cache_bytes / parts.cache_row_bytes[ids][:, None]  # [P, K]
        start, rows = parts.seg_start[ids][:, None, :], np.maximum(parts.seg_rows[ids], _TINY)[:, None, :]
        cached = np.clip((cache_rows[:, :, None] - start) / rows, 0.0, 1.0)  # [P, K, G] share of each segment cached
        hot_fwd = (cached * parts.fwd[ids][:, None, :]).sum(-1)
        hot_upd = (cached * parts.upd[ids][:, None, :]).sum(-1)
        fwd_b, upd_b = parts.fwd_bytes[ids][:, None], parts.upd_bytes[ids][:, None]
        fwd = ((parts.fwd_total[ids][:, None] - hot_fwd) * fwd_b / topo.memory_bandwidth
               + hot_fwd * fwd_b / topo.cache_bandwidth)
        upd = ((parts.upd_total[ids][:, None] - hot_upd) * upd_b / topo.memory_bandwidth
               + hot_upd * upd_b / topo.cache_bandwidth)
        return fwd, upd

    def exchange(self, stats: StorageStats) -> np.ndarray:
        topo = self.topology
        n, x = topo.devices, topo.exchange_itemsize
        dim, kind = stats.dim.astype(float), stats.kind
        rows_exchange = self.exchange_kind == "rows"
        worst = bucket_capacity(stats.expected, stats.worst, 0.0, 0.0)
        small = bucket_capacity(stats.expected, stats.worst, topo.capacity_factor, topo.capacity_sigmas)
        used = np.where(stats.requested > small, worst, small)  # an overflowing step takes the worst case
        sharded = (self.wire(used * (4 + 2 * dim * x)) + 3 * topo.collective_latency
                   + n * worst * ((8 + 8 * dim) / topo.memory_bandwidth + topo.id_seconds))
        s = stats.compact
        replicated = (self.wire(s * (4 + dim * x)) + 2 * topo.collective_latency
                      + n * s * ((8 + 8 * dim) / topo.memory_bandwidth + topo.id_seconds))
        column = (self.wire(s * 4 + 2 * s * dim / n * x) + 3 * topo.collective_latency
                  + n * s * ((8 + 8 * dim / n) / topo.memory_bandwidth + topo.id_seconds))
        if not rows_exchange:  # parts that travel as rows pay the above only if the storage has any
            sharded = np.where(stats.worst > 0, sharded, 0.0)
            column = np.where(s > 0, column, 0.0)
        cost = np.select([kind == SHARDED, kind == REPLICATED], [sharded, replicated], column)
        kernels = 2 * topo.kernel_overhead if rows_exchange else 0.0  # pooled: per device, in its phases
        return np.where(n > 1, cost, 0.0) + kernels


def bucket_capacity(expected: np.ndarray, worst: np.ndarray, factor: float, sigmas: float) -> np.ndarray:
    """C1 of recjax/sharding/exchange.py (`Storage.expected_capacity`): factor x E + sigmas x sqrt(E) rounded up,
    at least 1, at most the worst case C; the worst case itself when the factor is 0."""
    worst = np.maximum(1.0, np.floor(np.asarray(worst, float) + 1e-9))
    if not factor:
        return worst
    expected = np.asarray(expected, float)
    return np.maximum(1.0, np.minimum(worst, np.ceil(factor * expected + sigmas * np.sqrt(expected))))


# ------------------------------------------------------------------------------------------------ whole plans
def placement_parts(problem: Problem, parts: PartTable, t: int, p: TablePlacement) -> list[tuple[int, int]]:
    """[(flat device, part row)] of table t under placement p (placements over every mesh axis: flat indices)."""
    n = problem.devices
    if p.sharding in ("replicated", "data_parallel"):
        return [(d, parts.index(t, REPLICATED)) for d in range(n)]
    if p.axes != ("data", "model"):
        raise ValueError(f"table {p.table.name!r}: the planner's cost models cover placements over every device, "
                         f"not over {p.axes}")
    k = len(p.devices)
    if p.sharding == "column":  # a slice of width dim / k on each of its k devices
        return [(d, parts.index(t, COLUMN, k)) for d in p.devices]
    return [(d, parts.index(t, SHARDED, k, j)) for j, d in enumerate(p.devices)]


def storage_stats(problem: Problem, parts: PartTable, device_parts: Sequence[Sequence[int]]
                  ) -> tuple[list[tuple[int, int]], StorageStats]:
    """The storages of a plan given each device's part rows: their keys (dim, kind) and stats."""
    n = problem.devices
    b = problem.batch_size / n
    slots_of_dim: dict[int, float] = {}
    for t in problem.tables:
        slots_of_dim[t.info.dim] = slots_of_dim.get(t.info.dim, 0.0) + b * t.info.bag_size
    sums: dict[tuple[int, int], np.ndarray] = {}
    members: dict[tuple[int, int], dict[int, tuple[float, float]]] = {}
    for d, ids in enumerate(device_parts):
        for i in ids:
            key = (int(parts.dim[i]), int(parts.kind[i]))
            if key[1] == SHARDED:
                acc = sums.setdefault(key, np.zeros((4, n)))
                acc[:, d] += (parts.expected_slots[i], parts.worst_slots[i], parts.requested[i], parts.pooled[i])
            else:
                members.setdefault(key, {})[int(parts.table[i])] = (parts.compact[i], parts.pooled[i])
    keys = sorted(set(sums) | set(members))
    rows = []
    for key in keys:
        if key in sums:
            e, c, a, pooled = sums[key].max(axis=1)
            rows.append((key[1], key[0], e, c, a, 0.0, pooled))
        else:
            rows.append(member_row(key, members[key], slots_of_dim))
    return keys, StorageStats.of_rows(rows)


def member_row(key: tuple[int, int], members: Mapping[int, tuple[float, float]], slots_of_dim: Mapping[int, float]
               ) -> tuple:
    """The stats row of a replicated or column-wise storage from its members {table: (compact slots, pooled)}."""
    compact = min(slots_of_dim[key[0]], sum(c for c, _ in members.values()))
    return (key[1], key[0], 0.0, 0.0, 0.0, compact, max(p for _, p in members.values()))


def parts_cost(model: CostModel, problem: Problem, parts: PartTable, device_parts: Sequence[Sequence[int]]
               ) -> PlanCost:
    """Every device's cost of a plan given each device's part rows."""
    check_model(model, problem)
    n = problem.devices
    ids = np.array([i for dp in device_parts for i in dp], np.int64)
    sets = np.array([d for d, dp in enumerate(device_parts) for _ in dp], np.int64)
    compute = device_compute(model, parts, ids, sets, n)
    keys, stats = storage_stats(problem, parts, device_parts)
    per_storage = model.exchange(stats) if len(stats) else np.zeros(0)
    return PlanCost(compute, float(per_storage.sum()),
                    {(d, KINDS[k]): float(c) for (d, k), c in zip(keys, per_storage, strict=True)}, model.phases)


def plan_cost(model: CostModel, problem: Problem, placements: Sequence[TablePlacement],
              parts: PartTable | None = None) -> PlanCost:
    """Every device's cost of a whole plan (placements in table order) under `model`."""
    parts = parts or PartTable(problem)
    device_parts: list[list[int]] = [[] for _ in range(problem.devices)]
    for t, p in enumerate(placements):
        for d, i in placement_parts(problem, parts, t, p):
            device_parts[d].append(i)
    return parts_cost(model, problem, parts, device_parts)


def device_memory(problem: Problem, placements: Sequence[TablePlacement]) -> np.ndarray:
    """Bytes (rows + optimizer state) per flat device, as `TablePlacement.device_bytes` counts them (vectorised;
    tests compare it with `ShardingPlan.device_bytes`)."""
    n = problem.devices
    used = np.zeros(n)
    for p in placements:
        t = p.table
        if p.sharding in ("replicated", "data_parallel"):
            used += t.bytes
        elif p.sharding == "column":
            used[list(p.devices)] += t.rows * t.row_bytes // len(p.devices)
        else:
            if p.axes != ("data", "model"):
                raise ValueError(f"table {t.name!r}: placements over {p.axes} are not the planner's")
            used[list(p.devices)] += part_rows_array(t.rows, len(p.devices), p.row_split) * t.row_bytes
    return used
