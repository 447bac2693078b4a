"""Sharded embeddings and data parallelism on a device mesh (how a lookup crosses it: recjax/sharding/exchange.py).

    mesh.py      config.mesh.shape -> jax Mesh (axes data, model); None for one device (the single-device layout)
    plan.py      the plan format, its bytes-per-step estimate, the printed table, memory checks
    planner.py   make_plan: every table's placement; `auto`: the planner (greedy, local search, beam search over
                 split counts) and its baselines
    cost_model.py the analytic cost model and the interface the neural one shares (its pre-training and the
                 Meta-shaped task set it is benchmarked on: experiments/planning/)
    placement.py placing batches and arrays on the mesh, reading them back (a leaf module)
    exchange.py  the per-device arrays of a group (`MeshArray`) and the collectives of a lookup and a sparse update
    layout.py    MeshLayout: the mesh as a layout of the step's embedding interface (shard_map, psum, state layout);
                 `recjax.placement.build` composes it with each group's storage
    relayout.py  what a checkpoint records of a layout, and tables saved under one layout restored under another
    multihost.py jax.distributed from the launcher's flags or the environment
"""

import pathlib

import jax

from recjax.sharding.layout import MeshLayout
from recjax.sharding.mesh import make_mesh, mesh_shape
from recjax.sharding.placement import to_host
from recjax.sharding.plan import format_plan, save_plan
from recjax.sharding.relayout import mesh_layout, relayout, table_infos

__all__ = ["MeshLayout", "format_plan", "make_mesh", "mesh_layout", "mesh_shape", "process_workdir", "relayout",
           "save_plan", "table_infos", "to_host"]


def process_workdir(workdir: pathlib.Path) -> pathlib.Path:
    """The workdir itself on process 0 (and single-process runs); `workdir/process_<i>` for the others, so their
    logs never overwrite process 0's files."""
    index = jax.process_index()
    return workdir if index == 0 else workdir / f"process_{index}"
