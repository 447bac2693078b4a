"""Sharded embeddings and data parallelism on a device mesh (how a lookup crosses it: recjax/sharding/exchange.py).

    mesh.py      config.mesh.shape -> jax Mesh (axes data, model); None for one device (the single-device engine)
    plan.py      the plan format, its bytes-per-step estimate, the printed table, memory checks
    planner.py   make_plan: every table's placement; `auto`: the planner (greedy, local search, beam search over
                 split counts) and its baselines
    cost_model.py the analytic cost model and the interface the neural one shares (its pre-training and the
                 Meta-shaped task set it is benchmarked on: experiments/planning/)
    placement.py placing batches and arrays on the mesh, reading them back (a leaf module)
    exchange.py  the per-device table blocks and the collectives of a lookup and a sparse update
    backend.py   MeshEmbedding: the step's embedding interface on a mesh (shard_map, psum, state layout)
    multihost.py jax.distributed from the launcher's flags or the environment
"""

import os
import pathlib
from collections.abc import Mapping

import jax
import ml_collections

from recjax.errors import CheckpointError, ConfigError
from recjax.sharding.backend import MeshEmbedding
from recjax.sharding.exchange import build_storages, group_layout, storage_layout
from recjax.sharding.mesh import make_mesh, mesh_shape, parse_mesh_shape
from recjax.sharding.placement import to_host
from recjax.sharding.plan import (
    CAPACITY_FACTOR,
    CAPACITY_SIGMAS,
    EXCHANGE_DTYPES,
    PLANS,
    ROW_AXES,
    ROW_SPLITS,
    ShardingPlan,
    TableInfo,
    TablePlacement,
    format_plan,
    save_plan,
)
from recjax.sharding.planner import make_plan
from recjax.validation import check_text, choice, get, integer, known_keys, number

__all__ = ["MeshEmbedding", "check_sharding", "format_plan", "layout", "make_mesh", "mesh_shape", "process_workdir",
           "relayout", "save_plan", "setup", "table_infos", "to_host"]


def process_workdir(workdir: pathlib.Path) -> pathlib.Path:
    """The workdir itself on process 0 (and single-process runs); `workdir/process_<i>` for the others, so their
    logs never overwrite process 0's files."""
    index = jax.process_index()
    return workdir if index == 0 else workdir / f"process_{index}"


def table_infos(collection, optimizer) -> list[TableInfo]:
    """The planner's view of the collection's physical tables."""
    infos = []
    for p in collection.physical_tables():
        state = optimizer.state_bytes(p.table.rows, p.table.dim) // 4 // max(p.table.rows, 1) if optimizer else 0
        infos.append(TableInfo(p.table.name, p.feature, collection.table_specs[p.feature].method, p.table.rows,
                               p.table.dim, collection.slots_per_example(p), state))
    return infos


def device_memory_bytes(value: int) -> int:
    """`sharding.device_memory_bytes`, or when 0 the device's own limit (GPU / TPU memory_stats), else this host's
    physical memory over its local devices (CPU)."""
    if value:
        return int(value)
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // jax.local_device_count()


def check_sharding(config: Mapping) -> None:
    """`mesh` and `sharding` (both optional: a config without them runs on every device with the defaults). The
    mesh against the device count, the table names and the memory fit are checked when the plan is made, before
    any compile (recjax/sharding)."""
    if "mesh" in config:
        known_keys(config, "mesh", {"shape"})
        parse_mesh_shape(get(config, "mesh.shape"))
    if "sharding" in config:
        known_keys(config, "sharding", {"plan", "tables", "row_axes", "row_split", "exchange_dtype",
                                        "device_memory_bytes", "capacity_factor", "capacity_sigmas"})
        choice(config, "sharding.plan", PLANS)
        check_text("sharding.tables", get(config, "sharding.tables"))
        choice(config, "sharding.row_axes", ROW_AXES)
        choice(config, "sharding.row_split", ROW_SPLITS)
        choice(config, "sharding.exchange_dtype", EXCHANGE_DTYPES)
        integer(config, "sharding.device_memory_bytes", 0)
        if "capacity_factor" in get(config, "sharding"):
            factor = number(config, "sharding.capacity_factor", at_least=0.0)
            if 0 < factor < 1:
                raise ConfigError("sharding.capacity_factor", f"must be 0 (always the worst case) or >= 1, got "
                                                              f"{factor}")
        if "capacity_sigmas" in get(config, "sharding"):
            number(config, "sharding.capacity_sigmas", at_least=0.0)


def setup(config: ml_collections.ConfigDict, task) -> MeshEmbedding | None:
    """The run's mesh backend from `config.mesh` and `config.sharding`, or None on a single device."""
    mesh_cfg = config.get("mesh") or ml_collections.ConfigDict({"shape": ""})
    mesh = make_mesh(mesh_cfg.get("shape", ""))
    if mesh is None:
        return None
    sharding = config.get("sharding") or ml_collections.ConfigDict()
    batch_size = int(config.train.batch_size)
    if batch_size % mesh.size:
        raise ConfigError("train.batch_size", f"{batch_size} does not split evenly over the mesh's {mesh.size} "
                                              f"devices; use a multiple of {mesh.size}")
    shape = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    memory = device_memory_bytes(int(sharding.get("device_memory_bytes", 0)))

    def replan(collection, optimizer) -> ShardingPlan:
        return make_plan(table_infos(collection, optimizer), shape, batch_size,
                         plan=sharding.get("plan", "auto"), overrides=sharding.get("tables", ""),
                         row_axes=sharding.get("row_axes", "all"), row_split=sharding.get("row_split", "range"),
                         device_memory_bytes=memory)

    return MeshEmbedding(task.collection, replan(task.collection, task.sparse_optimizer), mesh,
                         sharding.get("exchange_dtype", "float32"),
                         float(sharding.get("capacity_factor", CAPACITY_FACTOR)),
                         float(sharding.get("capacity_sigmas", CAPACITY_SIGMAS)), replan)


# --------------------------------------------------------------------------------------- checkpoint layouts
def layout(sharded) -> dict | None:
    """What a checkpoint records of where the tables' rows are (recjax/checkpoint/ `meta["layout"]`): the mesh
    shape and each physical table's placement; None on one device (tables keyed by stacked group)."""
    if not isinstance(sharded, MeshEmbedding):
        return None
    return {"mesh_shape": dict(sharded.plan.mesh_shape),
            "tables": [{"table": p.table.name, "sharding": p.sharding, "axes": list(p.axes), "devices": list(p.devices),
                        "row_split": p.row_split} for p in sharded.plan.placements]}


def relayout(collection, sharded):
    """(by_key, saved layout) -> by_key in `sharded`'s layout (the single-device one when None), on the host:
    tables (or one optimizer state field) saved by a run on another mesh or plan, or on one device, go through
    the single-device layout {group: rows}. The identity when the layouts are the same."""
    current = layout(sharded)

    def convert(by_key: dict, saved: dict | None) -> dict:
        if saved == current:
            return by_key
        logical = by_key if saved is None else group_layout(_storages_of(collection, saved), by_key)
        return storage_layout(sharded.storages, logical) if isinstance(sharded, MeshEmbedding) else logical

    return convert


def _storages_of(collection, saved: dict):
    """The storages of a checkpoint's layout, rebuilt for `collection` (the same tables, another placement)."""
    infos = {i.name: i for i in table_infos(collection, None)}
    names = [t["table"] for t in saved["tables"]]
    if sorted(names) != sorted(infos):
        raise CheckpointError(f"the checkpoint's tables {sorted(names)} are not this config's {sorted(infos)}; "
                              "restore it with its own config")
    placements = tuple(TablePlacement(infos[t["table"]], t["sharding"], tuple(t["axes"]), tuple(t["devices"]),
                                      t["row_split"]) for t in saved["tables"])
    return build_storages(collection, ShardingPlan(saved["mesh_shape"], placements, batch_size=0,
                                                   device_memory_bytes=0))
