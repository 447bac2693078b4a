"""What a checkpoint records of where the tables' rows are (`meta["layout"]`, recjax/checkpoint/), and moving tables
saved under one layout into another: one device, or any mesh and plan.

    mesh_layout(plan)                       the mesh shape and each physical table's placement
    relayout(collection, layout, arrays)    (by_key, saved layout) -> by_key in `layout` (None: one device,
                                            {group: rows}), through the single-device layout; `arrays` are the
                                            current mesh arrays ({name: MeshArray}) when `layout` is a mesh's
"""

from collections.abc import Callable, Mapping

from recjax.errors import CheckpointError
from recjax.sharding.exchange import MeshArray, array_layout, group_layout, mesh_arrays
from recjax.sharding.plan import ShardingPlan, TableInfo, TablePlacement


def table_infos(collection, optimizer) -> list[TableInfo]:
    """The planner's view of the collection's physical tables (in stacking order)."""
    infos = []
    for p in collection.physical_tables():
        state = optimizer.state_bytes(p.table.rows, p.table.dim) // 4 // max(p.table.rows, 1) if optimizer else 0
        reads = sum(1 for q in collection.placements[p.feature] if q.table_index == p.table_index)
        infos.append(TableInfo(p.table.name, p.feature, collection.table_specs[p.feature].method, p.table.rows,
                               p.table.dim, collection.slots_per_example(p), state, reads=reads,
                               poolable=collection.methods[p.feature].pools_before_combine, group=p.group))
    return infos


def mesh_layout(plan: ShardingPlan) -> dict:
    """The checkpoint's record of a mesh layout: the mesh shape and each physical table's placement."""
    return {"mesh_shape": dict(plan.mesh_shape),
            "tables": [{"table": p.table.name, "sharding": p.sharding, "axes": list(p.axes), "devices": list(p.devices),
                        "row_split": p.row_split} for p in plan.placements]}


def relayout(collection, layout: dict | None, arrays: Mapping[str, MeshArray] | None = None) -> Callable:
    """(by_key, saved layout) -> by_key in `layout` (the single-device one when None), on the host: tables (or one
    optimizer state field) saved by a run on another mesh or plan, or on one device, go through the single-device
    layout {group: rows}. The identity when the layouts are the same."""

    def convert(by_key: dict, saved: dict | None) -> dict:
        if saved == layout:
            return by_key
        logical = by_key if saved is None else group_layout(_arrays_of(collection, saved), by_key)
        return logical if layout is None else array_layout(arrays, logical)

    return convert


def _arrays_of(collection, saved: dict) -> dict[str, MeshArray]:
    """The mesh arrays of a checkpoint's layout, rebuilt for `collection` (the same tables, another placement)."""
    infos = {i.name: i for i in table_infos(collection, None)}
    names = [t["table"] for t in saved["tables"]]
    if sorted(names) != sorted(infos):
        raise CheckpointError(f"the checkpoint's tables {sorted(names)} are not this config's {sorted(infos)}; "
                              "restore it with its own config")
    placements = tuple(TablePlacement(infos[t["table"]], t["sharding"], tuple(t["axes"]), tuple(t["devices"]),
                                      t["row_split"]) for t in saved["tables"])
    return mesh_arrays(collection, ShardingPlan(saved["mesh_shape"], placements, batch_size=0, device_memory_bytes=0))
