"""Where the embedding rows live: a layout x a storage per table group, composed once, here (`build`).

    layout.py     OneDevice: the one-device layout (the interfaces, `Layout` and `Storage` with device memory's
                  `DeviceStorage`, are in recjax/embedding_backend.py; the mesh's layout is recjax/sharding/layout.py)
    host.py       HostStorage: host memory through JAX memory kinds, the step's rows brought to the device
    embedding.py  PlacedEmbedding: the one implementation of the step's interface, composing a layout and storages
    tiers.py      which tier each physical table is in (`tiering.default`, `tiering.tables`, the byte rules)

Other storages live with what they need: the disk behind a RAM cache in recjax/tiering/storage.py (DiskStorage),
read-only serving tables in recjax/serving/tables.py (ServingStorage, composed by `serving`).

`build(config, task, dataset)` is the one function that chooses: the mesh (or one device) from `config.mesh` and
`config.sharding`, each physical table's tier from `config.tiering`, and for each stacked group the storage of its
tables' last tier in `STORAGES` (a disk group keeps its host-tier tables in RAM behind the same cache, and its
memory tables on the device). A new storage is one new file and one line in `STORAGES` (WORKSPACE.md).
"""

import dataclasses
import os
from collections.abc import Mapping

import jax

from recjax.embedding_backend import DeviceStorage, Layout, Storage
from recjax.errors import ConfigError
from recjax.placement.embedding import PlacedEmbedding, one_device
from recjax.placement.host import HostStorage
from recjax.placement.layout import OneDevice
from recjax.placement.tiers import resolve_tiers, table_bytes
from recjax.sections import MeshSection, Sections, ShardingSection, TieringSection, read_section, read_sections
from recjax.serving.tables import ServingStorage
from recjax.sharding.layout import MeshLayout
from recjax.sharding.mesh import make_mesh, parse_mesh_shape
from recjax.sharding.plan import (
    EXCHANGE_DTYPES,
    EXCHANGES,
    PLANS,
    ROW_AXES,
    ROW_SPLITS,
    ShardingPlan,
    parse_overrides,
)
from recjax.sharding.planner import make_plan
from recjax.sharding.relayout import table_infos
from recjax.tiering.cache import POLICIES
from recjax.tiering.storage import DiskStorage
from recjax.validation import check_boolean, check_choice, check_integer, check_number, check_text

# Tier name -> the storage of the groups holding such tables. A group whose tables are in several tiers takes the
# last one's storage in this order (it keeps the others' rows as it can: a disk group its memory tables on the device
# and its host tables in RAM behind the cache).
STORAGES: dict[str, type[Storage]] = {
    "memory": DeviceStorage,
    "host": HostStorage,
    "disk": DiskStorage,
}

__all__ = ["STORAGES", "Context", "Layout", "OneDevice", "PlacedEmbedding", "build", "check_placement",
           "one_device", "serving"]


@dataclasses.dataclass(frozen=True)
class Context:
    """What a storage may need to build itself (`STORAGES[tier](collection, groups, context)`)."""

    optimizer: object  # the run's SparseOptimizer
    layout: Layout
    tiering: TieringSection
    batch_size: int
    tiers: Mapping[str, str]  # {physical table: tier}
    dataset: object = None  # the training data (the static cache policy profiles it)
    workdir: object = None  # the run's workdir (pathlib.Path; a disk tier's temporary table folder goes there)


def build(config, task, dataset=None, workdir=None) -> PlacedEmbedding:
    """The run's placement of `task`'s tables: the layout from `config.mesh` / `config.sharding`, a storage per group
    from `config.tiering` (`config`: a ConfigDict or its typed `Sections`). `dataset` gives the static cache policy's
    profiling batches; `workdir` (pathlib.Path) holds a disk tier's temporary table folder (without one, the system's
    temporary directory does)."""
    sections = read_sections(config)
    collection, optimizer = task.collection, task.sparse_optimizer
    tiers = resolve_tiers(table_bytes(collection, optimizer), sections.tiering, tuple(STORAGES))
    order = list(STORAGES)
    group_tier = {}
    for p in collection.physical_tables():
        tier, current = tiers[p.table.name], group_tier.get(p.group)
        if current is None or order.index(tier) > order.index(current):
            group_tier[p.group] = tier
    kinds = {tier: STORAGES[tier] for tier in group_tier.values()}
    fixed = sorted(name for name, cls in kinds.items() if cls.static_shapes_only)
    if collection.aux_features and fixed:
        raise ConfigError("tiering.tables", f"features {list(collection.aux_features)} use a dynamic method (their "
                                            f"tables change shape during training), which the {' / '.join(fixed)} "
                                            "tier does not support; keep every table in memory for this run")
    row_wise = sorted(name for name, tier in tiers.items() if tier != DeviceStorage.name
                      and kinds[group_tier[_group_of(collection, name)]].row_wise_on_a_mesh)
    layout = make_layout(sections, task, row_wise)
    layout.bind(collection, {})  # the collection, for the storages' cache layouts (rebound by the composition)
    context = Context(optimizer, layout, sections.tiering, sections.train.batch_size, tiers, dataset, workdir)
    storages = [STORAGES[tier](collection, sorted(g for g, t in group_tier.items() if t == tier), context)
                for tier in STORAGES if tier in group_tier.values()]
    return PlacedEmbedding(collection, layout, storages)


def _group_of(collection, table: str) -> str:
    return next(p.group for p in collection.physical_tables() if p.table.name == table)


def make_layout(sections: Sections, task, row_wise: list[str] = ()) -> Layout:
    """One device, or the mesh of `mesh.shape` with the plan of `sharding` (the tables of `row_wise` split row-wise
    under `sharding.plan=auto`, where `sharding.tables` does not place them)."""
    mesh = make_mesh(sections.mesh.shape)
    if mesh is None:
        return OneDevice()
    sharding, batch_size = sections.sharding, sections.train.batch_size
    if batch_size % mesh.size:
        raise ConfigError("train.batch_size", f"{batch_size} does not split evenly over the mesh's {mesh.size} "
                                              f"devices; use a multiple of {mesh.size}")
    shape = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    memory = device_memory_bytes(sharding.device_memory_bytes)
    overrides = row_wise_overrides(sharding, task.collection, row_wise)

    def replan(collection, optimizer) -> ShardingPlan:
        plan = make_plan(table_infos(collection, optimizer), shape, batch_size, plan=sharding.plan,
                         overrides=overrides, row_axes=sharding.row_axes, row_split=sharding.row_split,
                         exchange=sharding.exchange, device_memory_bytes=memory)
        return dataclasses.replace(plan, exchange=sharding.exchange)

    return MeshLayout(replan(task.collection, task.sparse_optimizer), mesh, sharding.exchange_dtype,
                      sharding.capacity_factor, sharding.capacity_sigmas, replan)


def row_wise_overrides(sharding: ShardingSection, collection, row_wise) -> str:
    """`sharding.tables` with the tables of `row_wise` the user did not place pinned row-wise under
    `sharding.plan=auto`: a storage whose per-device caches serve the rows their device owns cannot serve the
    column-wise and replicated placements the planner would otherwise weigh. Any other plan is the user's."""
    if sharding.plan != "auto" or not row_wise:
        return sharding.tables
    placed = parse_overrides(sharding.tables, table_infos(collection, None))
    return ",".join(filter(None, [sharding.tables, *(f"{name}=row" for name in row_wise if name not in placed)]))


def device_memory_bytes(value: int) -> int:
    """`sharding.device_memory_bytes`, or when 0 the device's own limit (GPU / TPU memory_stats), else this host's
    physical memory over its local devices (CPU)."""
    if value:
        return int(value)
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // jax.local_device_count()


def serving(collection, fmt: str = "f32", gathered: Mapping[str, int] | None = None) -> PlacedEmbedding:
    """Read-only serving tables of format `fmt` on one device (recjax/serving/tables.py `ServingStorage`); `gathered`
    {group: stored rows}: the step's arrays are the rows each bag slot reads, gathered outside the step."""
    return PlacedEmbedding(collection, OneDevice(),
                           [ServingStorage(collection, sorted(collection.group_rows), fmt, gathered)])


# -------------------------------------------------------------------------------------------------- validators
def check_placement(config: Mapping) -> None:
    """`mesh`, `sharding` and `tiering` (each optional: without them every table is in device memory on every
    device, with the defaults of recjax/sections.py). The mesh against the device count, the table names, the
    caches against a step's rows and the memory fit are checked when the placement is built, before any compile."""
    mesh = read_section(config, "mesh", MeshSection)
    parse_mesh_shape(mesh.shape)
    sharding = read_section(config, "sharding", ShardingSection)
    check_choice("sharding.plan", sharding.plan, PLANS)
    check_text("sharding.tables", sharding.tables)
    check_choice("sharding.row_axes", sharding.row_axes, ROW_AXES)
    check_choice("sharding.row_split", sharding.row_split, ROW_SPLITS)
    check_choice("sharding.exchange", sharding.exchange, EXCHANGES)
    check_choice("sharding.exchange_dtype", sharding.exchange_dtype, EXCHANGE_DTYPES)
    check_integer("sharding.device_memory_bytes", sharding.device_memory_bytes, 0)
    factor = check_number("sharding.capacity_factor", sharding.capacity_factor, at_least=0.0)
    if 0 < factor < 1:
        raise ConfigError("sharding.capacity_factor", f"must be 0 (always the worst case) or >= 1, got {factor}")
    check_number("sharding.capacity_sigmas", sharding.capacity_sigmas, at_least=0.0)
    tiering = read_section(config, "tiering", TieringSection)
    check_choice("tiering.default", tiering.default, list(STORAGES))
    for part in filter(None, (p.strip() for p in tiering.tables.split(","))):
        name, eq, tier = (x.strip() for x in part.partition("="))
        if not eq or not name or tier not in STORAGES:
            raise ConfigError("tiering.tables", f"cannot read {part!r}: write table=tier with a tier in "
                                                f"{list(STORAGES)}, e.g. C3=disk")
    check_integer("tiering.disk_over_bytes", tiering.disk_over_bytes, 0)
    check_integer("tiering.host_over_bytes", tiering.host_over_bytes, 0)
    check_number("tiering.cache_fraction", tiering.cache_fraction, above=0.0, below=1.0)
    check_integer("tiering.cache_rows", tiering.cache_rows, 0)
    check_choice("tiering.policy", tiering.policy, POLICIES)
    check_integer("tiering.profile_batches", tiering.profile_batches, 1)
    check_boolean("tiering.prefetch", tiering.prefetch)
    check_integer("tiering.io_threads", tiering.io_threads, 1)

