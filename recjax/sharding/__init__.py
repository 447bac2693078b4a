"""Sharded embeddings and data parallelism on a device mesh (see WORKSPACE.md, "How a lookup crosses the mesh").

    mesh.py      config.mesh.shape -> jax Mesh (axes data, model); None for one device (the single-device engine)
    plan.py      the plan format, the analytic cost model, the simple planner, the printed table
    exchange.py  the per-device table blocks and the collectives of a lookup and a sparse update
    step.py      the shard_map'ed train / predict steps; TrainState to and from the mesh layout
    multihost.py jax.distributed from the launcher's flags or the environment
"""

import os
import pathlib

import jax
import ml_collections

from recjax.errors import ConfigError
from recjax.sharding.exchange import ShardedEmbedding, to_host
from recjax.sharding.mesh import make_mesh, mesh_shape
from recjax.sharding.plan import CAPACITY_FACTOR, TableInfo, format_plan, make_plan, save_plan
from recjax.sharding.step import prepare

__all__ = ["ShardedEmbedding", "format_plan", "make_mesh", "mesh_shape", "prepare", "process_workdir", "save_plan",
           "setup", "table_infos", "to_host"]


def process_workdir(workdir: pathlib.Path) -> pathlib.Path:
    """The workdir itself on process 0 (and single-process runs); `workdir/process_<i>` for the others, so their
    logs never overwrite process 0's files."""
    index = jax.process_index()
    return workdir if index == 0 else workdir / f"process_{index}"


def table_infos(collection, optimizer) -> list[TableInfo]:
    """The planner's view of the collection's physical tables."""
    bag = {f.name: f.bag_size for f in collection.spec.features}
    infos = []
    for p in collection.physical_tables():
        state = optimizer.state_bytes(p.table.rows, p.table.dim) // 4 // max(p.table.rows, 1) if optimizer else 0
        infos.append(TableInfo(p.table.name, p.feature, collection.table_specs[p.feature].method, p.table.rows,
                               p.table.dim, bag[p.feature], state))
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


def setup(config: ml_collections.ConfigDict, task) -> ShardedEmbedding | None:
    """The run's sharded embedding from `config.mesh` and `config.sharding`, or None on a single device."""
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
    plan = make_plan(table_infos(task.collection, task.sparse_optimizer), shape, batch_size,
                     plan=sharding.get("plan", "auto"), overrides=sharding.get("tables", ""),
                     row_axes=sharding.get("row_axes", "all"), row_split=sharding.get("row_split", "range"),
                     device_memory_bytes=device_memory_bytes(int(sharding.get("device_memory_bytes", 0))))
    return ShardedEmbedding(task.collection, plan, mesh, sharding.get("exchange_dtype", "float32"),
                            float(sharding.get("capacity_factor", CAPACITY_FACTOR)))
