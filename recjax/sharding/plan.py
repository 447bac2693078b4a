"""The sharding plan: where each physical table lives on the mesh, its format, the cost model and a simple planner.

A plan assigns every physical table (what `compression` methods produce: a full table, QR's two tables, MD's
blocks, ...) one sharding:

    table         the whole table on one device (`devices` = that device's flat index)
    row           rows split over `axes` (every device, or the `model` axis and replicated along `data`),
                  by contiguous ranges (`row_split=range`) or id modulo the part count (`mod`)
    column        the dim split over every device (each holds a slice of every row); needs dim % devices == 0
    replicated    a full copy on every device; lookups are local, the touched rows' gradients are all-gathered
    data_parallel the same mechanism as `replicated` (the torchrec name for it)

Optimizer state rows always live with their table rows. The plan is plain data (`ShardingPlan`), printed as a
table (`format_plan`) and saved as `sharding_plan.txt` / `.json` in the workdir; `recjax/sharding/exchange.py`
turns it into the per-device arrays and the collectives. A stronger planner only has to return a `ShardingPlan`.

What crosses devices (`pools_on_owner`, `sharding.exchange`): a table's owners pool its bags and send one vector per
(example, bag) -- row-wise owners partial sums, column-wise owners slices -- unless its method combines each id's
rows before pooling, it is replicated, or ("auto") its rows move fewer bytes (one-hot bags, tables with fewer rows
than a step's ids). The rest travel as distinct rows.

Cost model (`device_costs`), per training step, in bytes each device touches or receives; B is the global batch, n
the devices, b = B / n; a table t has dim d, bag size L (ids per example), s optimizer state floats per row element;
q = B * L lookups of t a step (ids are assumed spread evenly over a table's rows, access skew is ignored):
  - owner work: a device holding a fraction f of t's rows looks up, returns and updates f * q rows:
    f * q * (4 + 4 d (3 + s)) (table-wise f = 1 on one device, row-wise 1 / parts on each part; over the `model`
    axis each data row of devices serves its own requests, f / n_data); replicated and column-wise tables as below;
  - exchange (`table_exchange`): what the table's collectives bring each device, per device and without the static
    buffers' padding -- pooled: the (partial) sums of its own bags and, on an owner, its share of every device's
    ids and the pooled gradients of the bags it serves; rows: the distinct rows it asks for and, on an owner, its
    share of every device's distinct ids and row gradients; replicated / column-wise rows: the all-gathered ids
    and gradients. So plans differ: a table-wise table's owner receives every device's ids, a row-wise one's k
    owners each a k-th of them but every device receives k partial sums per bag.
`pooled_volume_bytes` is the floor of an exchange that pools every bag (its pooled vectors, forward and backward);
`exchange_volume_bytes` what the plan's exchange moves per device; recjax/sharding/exchange.py `exchange_bytes` the
bytes of the static buffers the compiled step really allocates (what its HLO says, recjax/sharding/hlo.py).
The planner minimises the largest per-device sum (the slowest device sets the step time) subject to memory, then
evens each storage's blocks to within BLOCK_BALANCE of the mean (`balance_blocks`) where the plan would not fit
padded (`padded_device_bytes`) or evening them is not slower (recjax/sharding/planner.py `make_plan`).
"""

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

from recjax.errors import ConfigError

SHARDINGS = ("table", "row", "column", "replicated", "data_parallel")
PLANS = ("auto", "table", "row", "column", "replicated")
ROW_AXES = ("all", "model")
ROW_SPLITS = ("range", "mod")
EXCHANGE_DTYPES = ("float32", "bfloat16", "float16")
# sharding.exchange: pool bags on their tables' owners "auto" (where it moves fewer bytes), "pooled" (wherever the
# method allows) or never ("rows": every distinct row travels, as before issue 39); `pools_on_owner`.
EXCHANGES = ("auto", "pooled", "rows")
# Row-wise / table-wise all_to_all buckets hold this many times the ids a device is expected to send an owner; a step
# where some device has more takes the worst-case buckets instead (exact either way; recjax/sharding/exchange.py).
CAPACITY_FACTOR = 1.0
CAPACITY_SIGMAS = 7.0
# auto: tables whose rows + optimizer state are at most this many bytes are replicated (lookups stay local).
REPLICATE_BYTES = 64 * 1024
# auto: every device's block of a storage (tables of one dim) holds at most this x the mean rows per device; a storage
# is one [n L, d] array, so every device pays for the fullest one (recjax/sharding/exchange.py).
BLOCK_BALANCE = 1.05


@dataclasses.dataclass(frozen=True)
class TableInfo:
    """What the planner needs to know about one physical table."""

    name: str  # physical table name: "<feature>" or "<feature>/<part>"
    feature: str
    method: str
    rows: int
    dim: int
    bag_size: int  # ids per example read from it (the feature's bag size x the table's reads, e.g. FIITED's K)
    state_floats: int  # optimizer state floats per row (0 sgd, 1 row-wise Adagrad, dim Adagrad, 2 dim lazy Adam)
    reads: int = 1  # bags per example read from it (FIITED reads its pool once per chunk): bag_size / reads ids each
    poolable: bool = True  # its method pools a bag before combining (linear per row), so an owner may pool its bags
    group: str = ""  # the stacked group it is in (tables of one dim and weight decay); "" = "dim<dim>"

    @property
    def group_name(self) -> str:
        return self.group or f"dim{self.dim}"

    @property
    def bag(self) -> int:
        """Ids of one bag (one read of one example)."""
        return self.bag_size // self.reads

    @property
    def row_bytes(self) -> int:
        return 4 * (self.dim + self.state_floats)

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes


@dataclasses.dataclass(frozen=True)
class TablePlacement:
    """One physical table's sharding. `devices`: positions along `axes` holding a part (flat device indices when
    `axes` is both axes); empty for replicated tables."""

    table: TableInfo
    sharding: str
    axes: tuple[str, ...]
    devices: tuple[int, ...]
    row_split: str = "range"

    def device_bytes(self, device: int, mesh_shape: Mapping[str, int]) -> int:
        """Bytes (rows + optimizer state) this table puts on flat device `device`."""
        t = self.table
        if self.sharding in ("replicated", "data_parallel"):
            return t.bytes
        position = _position(device, self.axes, mesh_shape)
        if position not in self.devices:
            return 0
        if self.sharding == "column":  # a slice of width dim / k on each of its k devices
            return t.rows * t.row_bytes // len(self.devices)
        k = len(self.devices)
        j = self.devices.index(position)
        return part_rows(t.rows, k, j, self.row_split) * t.row_bytes


def part_rows(rows: int, parts: int, j: int, split: str) -> int:
    """Rows of part j when `rows` are split into `parts` (range: ceil-sized chunks, the last ones shorter)."""
    if split == "mod":
        return max(0, -(-(rows - j) // parts))
    chunk = -(-rows // parts)
    return max(0, min(rows, (j + 1) * chunk) - j * chunk)


def _position(device: int, axes: tuple[str, ...], mesh_shape: Mapping[str, int]) -> int:
    """Position of flat device `device` (data-major) along `axes`."""
    if axes == ("data", "model"):
        return device
    if axes == ("model",):
        return device % mesh_shape["model"]
    raise ValueError(axes)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    mesh_shape: Mapping[str, int]  # {"data": n_data, "model": n_model}
    placements: tuple[TablePlacement, ...]
    batch_size: int  # global
    device_memory_bytes: int
    exchange: str = "auto"  # what crosses devices: EXCHANGES (`pools_on_owner`; recjax/sharding/exchange.py)

    @property
    def devices(self) -> int:
        return math.prod(self.mesh_shape.values())

    def placement(self, table: str) -> TablePlacement:
        return next(p for p in self.placements if p.table.name == table)

    def device_bytes(self) -> list[int]:
        return [sum(p.device_bytes(d, self.mesh_shape) for p in self.placements) for d in range(self.devices)]

    def device_costs(self) -> list[float]:
        return device_costs(self.placements, self.mesh_shape, self.batch_size, self.exchange)

    def pooled(self, table: str) -> bool:
        """Whether the owners of `table` pool its bags (`pools_on_owner`)."""
        return pools_on_owner(self.placement(table), self.mesh_shape, self.batch_size, self.exchange)

    def to_json(self) -> dict:
        return {
            "mesh_shape": dict(self.mesh_shape), "batch_size": self.batch_size,
            "device_memory_bytes": self.device_memory_bytes, "exchange": self.exchange,
            "tables": [{"table": p.table.name, "feature": p.table.feature, "method": p.table.method,
                        "rows": p.table.rows, "dim": p.table.dim, "sharding": p.sharding, "axes": list(p.axes),
                        "devices": list(p.devices), "row_split": p.row_split, "bytes": p.table.bytes,
                        "pooled": self.pooled(p.table.name),
                        "estimated_cost": sum(placement_costs(p, self.mesh_shape, self.batch_size, self.exchange))}
                       for p in self.placements],
            "device_bytes": self.device_bytes(), "device_costs": self.device_costs(),
        }


# ------------------------------------------------------------------------------------------------- cost model
def owner_costs(p: TablePlacement, mesh_shape: Mapping[str, int], batch_size: int) -> list[float]:
    """Bytes each flat device touches per step serving table `p` (lookups, updates, replicated all-gathers)."""
    n = math.prod(mesh_shape.values())
    t = p.table
    q = batch_size * t.bag_size
    s = t.state_floats / t.dim
    if p.sharding in ("replicated", "data_parallel"):
        return [q * (4 + 4 * t.dim) + q * 4 * t.dim * (1 + s)] * n
    if p.sharding == "column":
        return [q * (4 + 4 * t.dim / n * (3 + s))] * n
    costs = []
    for d in range(n):
        position = _position(d, p.axes, mesh_shape)
        share = 0.0
        if position in p.devices:
            share = part_rows(t.rows, len(p.devices), p.devices.index(position), p.row_split) / t.rows
            if p.axes == ("model",):  # each data row of devices owns a full copy and serves its own requests
                share /= mesh_shape["data"]
        costs.append(share * q * (4 + 4 * t.dim * (3 + s)))
    return costs


def expected_distinct(rows, draws):
    """How many distinct rows `draws` ids drawn uniformly from `rows` rows hit: rows (1 - (1 - 1 / rows)^draws)
    (numpy arrays or numbers). Uniform ids hit the most distinct rows in expectation (the sum of 1 - (1 - p_i)^draws
    is concave in p), so skewed ids hit fewer."""
    rows = np.maximum(np.asarray(rows, float), 1.0)
    return rows * -np.expm1(np.asarray(draws, float) * np.log1p(-1.0 / np.maximum(rows, 1.0 + 1e-12)))


def table_exchange(p: TablePlacement, mesh_shape: Mapping[str, int], batch_size: int, pooled: bool,
                   itemsize: int = 4) -> list[float]:
    """Bytes each flat device receives per step for table `p` (its all_to_all / all_gather results, its own slice
    included), ids spread evenly over the rows, no padding: what a device really sends and receives, whatever the
    static buffers round it to (recjax/sharding/exchange.py `exchange_bytes` counts those).

    b = batch_size / n examples per device, a table of d columns read in r bags of L ids per example:
      pooled, table- / row-wise over k owners: a requester receives k x b r pooled (partial) sums of d; the owner of a
        share f of the rows receives f of every requester's b r L ids (4 bytes; split tables add b r bag counts per
        requester) and the pooled gradients of every bag it serves (b r d per requester);
      pooled, column-wise: every device receives every device's b r L ids (all-gathered), and its pooled vectors and
        gradients' slices (b r d in all);
      rows, table- / row-wise: a requester receives the A rows it asks for (A: the expected distinct rows of its b r L
        ids); an owner receives its share of every requester's A ids and row gradients;
      rows, column-wise: every device's S = min(rows, b r L) ids all-gathered, S rows' slices and gradients' slices;
      replicated: every device's S ids and row gradients all-gathered (no forward exchange).
    A row-wise table over the `model` axis has a copy per data row: each copy gathers what its replicas received."""
    n = math.prod(mesh_shape.values())
    t = p.table
    b = batch_size / n
    slots, bags, d = b * t.bag_size, b * t.reads, t.dim
    if p.sharding in ("replicated", "data_parallel"):
        s = min(t.rows, slots)
        return [n * s * (4 + d * itemsize)] * n
    if p.sharding == "column":
        if pooled:
            return [n * slots * 4 + 2 * bags * d * itemsize] * n
        s = min(t.rows, slots)
        return [n * s * 4 + 2 * s * d * itemsize] * n
    parts = n if p.axes == ("data", "model") else mesh_shape["model"]
    replicas = n // parts
    k = len(p.devices)
    asked = float(expected_distinct(t.rows, slots))
    requester = k * bags * d * itemsize if pooled else asked * d * itemsize
    out = []
    for device in range(n):
        position = _position(device, p.axes, mesh_shape)
        owner = 0.0
        if position in p.devices:
            share = part_rows(t.rows, k, p.devices.index(position), p.row_split) / t.rows
            if pooled:
                owner = parts * (slots * share * 4 + (bags * 4 if k > 1 else 0) + bags * d * itemsize)
            else:
                owner = parts * asked * share * (4 + d * itemsize)
        out.append(requester + replicas * owner)
    return out


def pools_on_owner(p: TablePlacement, mesh_shape: Mapping[str, int], batch_size: int, exchange: str = "auto"
                   ) -> bool:
    """Whether the owners of table `p` pool its bags and send one vector per (example, bag) -- row-wise owners a
    partial sum, column-wise owners a slice -- instead of the rows (DESIGN.md "The exchange"). Never for a method
    that is not linear per row (`TableInfo.poolable`: it combines each id's rows before pooling) nor for a
    replicated table (read where it is); `exchange` "pooled": every other table; "rows": none (the exchange before
    issue 39); "auto": where it moves fewer bytes over all devices (`table_exchange`, in f32): a bag of one id
    (one-hot features) moves as many bytes pooled as a row, and rows are deduplicated, so one-hot tables and tables
    with fewer rows than a step's ids stay rows; a table split over k owners pays k partial sums per bag."""
    if exchange not in EXCHANGES:
        raise ValueError(f"unknown exchange {exchange!r}; use one of {EXCHANGES}")
    if exchange == "rows" or not p.table.poolable or p.sharding in ("replicated", "data_parallel"):
        return False
    if exchange == "pooled":
        return True
    pooled = sum(table_exchange(p, mesh_shape, batch_size, True))
    return pooled < sum(table_exchange(p, mesh_shape, batch_size, False))


def placement_costs(p: TablePlacement, mesh_shape: Mapping[str, int], batch_size: int, exchange: str = "auto"
                    ) -> list[float]:
    """A table's own estimate per device: its owner work plus the bytes its exchange brings each device."""
    moved = table_exchange(p, mesh_shape, batch_size, pools_on_owner(p, mesh_shape, batch_size, exchange))
    return [c + m for c, m in zip(owner_costs(p, mesh_shape, batch_size), moved, strict=True)]


def device_costs(placements: Sequence[TablePlacement], mesh_shape: Mapping[str, int], batch_size: int,
                 exchange: str = "auto") -> list[float]:
    """The plan's estimated bytes per flat device and step: owner work plus what its exchange brings that device
    (`table_exchange`: pooled where the runtime pools, per device, not the busiest owner's bucket times every
    peer)."""
    n = math.prod(mesh_shape.values())
    costs = [0.0] * n
    for p in placements:
        for d, c in enumerate(placement_costs(p, mesh_shape, batch_size, exchange)):
            costs[d] += c
    return costs


def pooled_volume_bytes(plan: "ShardingPlan", itemsize: int = 4) -> float:
    """Bytes per device and step of the pooled vectors alone: each of the device's b examples' bags, one vector of d
    per bag read, forward and backward (2 b r d itemsize per table). Any exchange that pools every bag on its owner
    moves at least this much besides the ids (benchmarks/sharding.py prints the exchange's bytes beside it)."""
    b = plan.batch_size / plan.devices
    return float(sum(2 * b * p.table.reads * p.table.dim * itemsize for p in plan.placements))


def exchange_volume_bytes(plan: "ShardingPlan", itemsize: int = 4) -> list[float]:
    """Bytes each device receives per step from the plan's exchange (`table_exchange` summed over the tables, pooled
    where `pools_on_owner` says), before the static buffers' padding."""
    out = [0.0] * plan.devices
    for p in plan.placements:
        for d, x in enumerate(table_exchange(p, plan.mesh_shape, plan.batch_size, plan.pooled(p.table.name),
                                             itemsize)):
            out[d] += x
    return out


# ----------------------------------------------------------------------------------------------------- planner
def parse_overrides(text: str, tables: Sequence[TableInfo]) -> dict[str, tuple[str, int | None]]:
    """`sharding.tables` = "C3=row,C4=table:2,C5/q=replicated" -> {physical table: (sharding, device or None)}.

    A logical (feature) name applies to all of that feature's physical tables. Each physical table takes at most one
    entry: a name given twice, or a feature named beside one of its own physical tables ("C7=row,C7/q=column"), is an
    error rather than "the last entry wins", which would silently drop what the user asked for first.
    """
    if not isinstance(text, str):
        raise ConfigError("sharding.tables", f"must be a string such as 'C3=row,C4=table:2', got {text!r}")
    names = {t.name for t in tables}
    features = {t.feature for t in tables}
    out: dict[str, tuple[str, int | None]] = {}
    entry_of: dict[str, str] = {}  # physical table -> the entry that placed it
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name, value = name.strip(), value.strip()
        kind, _, device = value.partition(":")
        if not eq or kind not in SHARDINGS:
            raise ConfigError("sharding.tables", f"cannot read {part!r}: write table=sharding with a sharding in "
                                                 f"{list(SHARDINGS)} (table:DEVICE pins a device), e.g. C3=row")
        if device and (kind != "table" or not device.isdigit()):
            raise ConfigError("sharding.tables", f"{part!r}: only 'table' takes a device, as table:DEVICE")
        targets = [name] if name in names else [t.name for t in tables if t.feature == name]
        if name not in names and name not in features:
            raise ConfigError("sharding.tables", f"unknown table {name!r}; the tables are {sorted(features)} (and "
                                                 f"their physical tables {sorted(names - features)})")
        for target in targets:
            if target in entry_of:
                raise ConfigError("sharding.tables", _duplicate_entry(target, entry_of[target], part))
            entry_of[target] = part
            out[target] = (kind, int(device) if device else None)
    return out


def _duplicate_entry(table: str, first: str, second: str) -> str:
    """Why `second` may not place `table` after `first` did, in one line."""
    first_name, second_name = (entry.partition("=")[0].strip() for entry in (first, second))
    if first_name == second_name:
        return f"table {table!r} is named twice ({first!r} and {second!r}); give each table one entry"
    feature, physical = (first, second) if first_name != table else (second, first)
    return (f"{physical!r} and {feature!r} both place physical table {table!r} (a feature's name covers all its "
            f"physical tables); name either the feature or its physical tables")


def storage_rows(placements, dim: int, n: int) -> list[int]:
    """Rows each flat device holds of the table- / row-wise-over-all tables of one dim (one storage's blocks)."""
    rows = [0] * n
    for p in placements:
        if p.table.dim == dim and p.sharding in ("table", "row") and p.axes == ("data", "model"):
            for k, device in enumerate(p.devices):
                rows[device] += part_rows(p.table.rows, len(p.devices), k, p.row_split)
    return rows


def padded_device_bytes(placements: Sequence[TablePlacement], mesh_shape: Mapping[str, int]) -> list[int]:
    """Bytes per flat device with each dim's table- / row-wise storage as the runtime allocates it: every device's
    block as tall as the fullest one's (`storage_rows`), plus its replicated and column-wise tables."""
    n = math.prod(mesh_shape.values())
    in_block = [p.sharding in ("table", "row") and p.axes == ("data", "model") for p in placements]
    stacked = [p for p, b in zip(placements, in_block, strict=True) if b]
    out = [sum(p.device_bytes(d, mesh_shape) for p, b in zip(placements, in_block, strict=True) if not b)
           for d in range(n)]
    for dim in {p.table.dim for p in stacked}:
        tall = max(storage_rows(stacked, dim, n)) * max(p.table.row_bytes for p in stacked if p.table.dim == dim)
        out = [b + tall for b in out]
    return out


def balance_blocks(result: dict[str, TablePlacement], pinned: set[str], mesh_shape: Mapping[str, int],
                   row_split: str, device_memory_bytes: float = math.inf) -> None:
    """Split the largest block of the fullest device, a whole table or a part of a table split over fewer than every
    device (the planner's row-wise splits over k < n devices), by rows over every device until no device's block of
    a storage exceeds BLOCK_BALANCE x the storage's mean rows (blocks of at most REPLICATE_BYTES are left alone), as
    long as no device then holds more than `device_memory_bytes`. Terminates: each split puts one table over every
    device, and a device above the mean holds a block of a table that is not (parts over all n are at most the
    mean)."""
    n = math.prod(mesh_shape.values())
    every = tuple(range(n))

    def widened(p: TablePlacement) -> TablePlacement:
        return TablePlacement(p.table, "row", ("data", "model"), every, row_split)

    for dim in sorted({p.table.dim for p in result.values()}):
        while True:
            rows = storage_rows(result.values(), dim, n)
            fullest = max(range(n), key=lambda d: (rows[d], -d))
            row_bytes = max((p.table.row_bytes for p in result.values() if p.table.dim == dim), default=0)
            if rows[fullest] <= BLOCK_BALANCE * sum(rows) / n or rows[fullest] * row_bytes <= REPLICATE_BYTES:
                break
            blocks = [p for p in result.values() if p.table.dim == dim and p.sharding in ("table", "row")
                      and p.axes == ("data", "model") and fullest in p.devices and len(p.devices) < n
                      and p.table.name not in pinned]
            used = [sum(p.device_bytes(d, mesh_shape) for p in result.values()) for d in range(n)]
            blocks = [p for p in blocks if all(
                used[d] - p.device_bytes(d, mesh_shape) + widened(p).device_bytes(d, mesh_shape) <= device_memory_bytes
                for d in range(n))]
            if not blocks:
                break
            big = max(blocks, key=lambda p: (p.device_bytes(fullest, mesh_shape) // p.table.row_bytes, p.table.name))
            result[big.table.name] = widened(big)


def check_fits(plan: ShardingPlan) -> None:
    """ConfigError naming the first device whose tables and optimizer state exceed its memory, and by how much."""
    for d, used in enumerate(plan.device_bytes()):
        if used > plan.device_memory_bytes:
            on = [p.table.name for p in plan.placements if p.device_bytes(d, plan.mesh_shape)]
            biggest = max(plan.placements, key=lambda p: p.device_bytes(d, plan.mesh_shape))
            raise ConfigError("sharding.plan", (
                f"device {d} would hold {used:,} bytes of tables + optimizer state ({len(on)} tables, the largest "
                f"{biggest.table.name!r} {biggest.sharding}-wise: {biggest.device_bytes(d, plan.mesh_shape):,} "
                f"bytes) but has {plan.device_memory_bytes:,} (sharding.device_memory_bytes): "
                f"{used - plan.device_memory_bytes:,} bytes too many; shard the large tables by row, add devices "
                "or compress them"))


# ------------------------------------------------------------------------------------------------------ format
def format_plan(plan: ShardingPlan) -> str:
    """The plan as a readable table, then bytes and estimated cost per device."""
    n = plan.devices
    header = ("table", "method", "rows", "dim", "sharding", "devices", "exchange", "bytes", "est. cost")
    lines = []
    for p in plan.placements:
        if p.sharding in ("replicated", "data_parallel"):
            devices = f"all {n}"
        elif p.axes == ("model",):
            devices = f"model 0-{len(p.devices) - 1} x data"
        elif len(p.devices) == 1:
            devices = str(p.devices[0])
        else:
            devices = f"0-{len(p.devices) - 1}"
        kind = p.sharding + (f" ({p.row_split})" if p.sharding == "row" else "")
        exchange = "pooled" if plan.pooled(p.table.name) else "rows"
        cost = sum(placement_costs(p, plan.mesh_shape, plan.batch_size, plan.exchange))
        lines.append((p.table.name, p.table.method, f"{p.table.rows:,}", str(p.table.dim), kind, devices, exchange,
                      _size(p.table.bytes), _size(cost)))
    widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(header)]

    def fmt(row):
        return "  ".join(c.ljust(w) if i < 7 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    out = [f"sharding plan: mesh data={plan.mesh_shape['data']} x model={plan.mesh_shape['model']}, global batch "
           f"{plan.batch_size}; exchange = what crosses devices (pooled bags or rows); bytes = rows + optimizer "
           "state; est. cost = bytes touched or received per step (recjax/sharding/plan.py)", fmt(header),
           fmt(tuple("-" * w for w in widths))]
    out += [fmt(row) for row in lines]
    used, costs = plan.device_bytes(), plan.device_costs()
    out.append("per device: " + ", ".join(f"{d}: {_size(b)} / {_size(c)}" for d, (b, c) in
                                          enumerate(zip(used, costs, strict=True)))
               + f" (bytes / est. cost; memory {_size(plan.device_memory_bytes)} each)")
    return "\n".join(out)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def save_plan(plan: ShardingPlan, workdir) -> None:
    import pathlib

    workdir = pathlib.Path(workdir)
    (workdir / "sharding_plan.txt").write_text(format_plan(plan) + "\n")
    (workdir / "sharding_plan.json").write_text(json.dumps(plan.to_json(), indent=2) + "\n")
