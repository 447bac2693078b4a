"""Mesh runs of every storage for tests/test_placement.py, in a subprocess with 8 CPU devices.

    python tests/placement_mesh_cases.py OUT_DIR runs      (JAX_NUM_CPU_DEVICES=8 is set by the caller)

The same short run (`train_and_evaluate`, data=4 x model=2, C1 row-wise, C2 table-wise, the others by the planner)
with its tables in device memory, in host memory (C2's group: every table of the one dim) and on disk behind
per-device caches (C1 and C4); OUT_DIR/runs.json holds, per storage, the summary, whether the workdir has
sharding_plan.txt / .json and the plan's placements, and where the host run's arrays live.
"""

import json
import pathlib
import sys

import jax

from experiments.configs.dlrm_synthetic import get_config
from recjax import placement
from recjax.data import make_dataset
from recjax.step import init_state
from recjax.task import build_task
from recjax.train import train_and_evaluate

STORAGE_TABLES = {"memory": "", "host": "C2=host", "disk": "C1=disk,C4=disk"}


def run_config(tables: str, directory: pathlib.Path):
    config = get_config()
    config.data.vocab_sizes = (3000, 500, 40, 2000)
    config.data.bag_sizes = (1, 3, 1, 1)
    config.data.eval_examples = 64
    config.embedding.dim = 8
    config.model.dlrm.bottom_mlp = (8, 8)
    config.model.dlrm.top_mlp = (8, 1)
    config.optimizer.sparse.name = "rowwise_adagrad"
    config.optimizer.sparse.learning_rate = 0.05
    config.train.batch_size = 32
    config.train.steps = 4
    config.train.eval_every = 4
    config.train.log_every = 2
    config.train.progress_bar = False
    config.checkpoint.every_steps = 2
    config.mesh.shape = "data=4,model=2"
    config.sharding.tables = "C1=row,C2=table:5"
    config.tiering.tables = tables
    config.tiering.cache_rows = 200
    config.tiering.dir = str(directory)
    return config


def runs(out: pathlib.Path) -> None:
    result = {}
    for name, tables in STORAGE_TABLES.items():
        workdir = out / name
        config = run_config(tables, out / f"{name}_tables")
        summary = train_and_evaluate(config, workdir)
        plan = workdir / "sharding_plan.json"
        result[name] = {"summary": summary, "plan_txt": (workdir / "sharding_plan.txt").exists(),
                        "plan": json.loads(plan.read_text())["tables"] if plan.exists() else None}
    # Where the host run keeps its arrays: each of its group's blocks in its device's host memory.
    config = run_config(STORAGE_TABLES["host"], out / "host_tables")
    dataset = make_dataset(config.data, seed=config.seed)
    task = build_task(config, dataset.spec, dataset, 4)
    backend = placement.build(config, task)
    state = backend.place_state(init_state(task, jax.random.key(0), next(dataset.train_batches(32)), backend))
    result["host_memory_kinds"] = {name: a.sharding.memory_kind for name, a in state.tables.items()}
    result["host_storages"] = {s.name: list(s.groups) for s in backend.storages}
    (out / "runs.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    out_dir = pathlib.Path(sys.argv[1])
    for case in sys.argv[2:]:
        runs(out_dir)
        print(f"done {case}", flush=True)
