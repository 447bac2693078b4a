"""Mesh runs with the disk tier for tests/test_tiering_mesh.py, in a subprocess with 8 CPU devices.

    python tests/tiering_mesh_cases.py OUT_DIR CASE [CASE ...]      (JAX_NUM_CPU_DEVICES=8 is set by the caller)

For each case: the in-memory mesh run (the oracle: `placement.build` of the config without tiers) and the mesh run
with the cached tables on disk (the mesh layout composed with the disk storage) train the same initial state on the
same batches; OUT_DIR/<case>.npz holds both runs' losses, probabilities, tables, optimizer state and dense params, and
the caches' counters.
"""

import json
import pathlib
import sys
import tempfile

import jax
import numpy as np
import pytest
from conftest import random_batch
from sharding_cases import set_keys
from test_tiering_checkpoint import interrupted, overwrite_records, tiny

from experiments.configs.dlrm_synthetic import get_config
from recjax import checkpoint, placement, sharding
from recjax.config_check import validate_config
from recjax.data import make_dataset
from recjax.specs import DatasetSpec, FeatureSpec
from recjax.step import init_state, make_predict_step, make_train_step
from recjax.task import build_task
from recjax.train import train_and_evaluate

BATCH = 32
SPEC = DatasetSpec(num_dense=13, features=(FeatureSpec("C1", 3000), FeatureSpec("C2", 500, bag_size=3),
                                           FeatureSpec("C3", 40), FeatureSpec("C4", 2000)))
# name: (sparse optimizer, mesh, plan, plan overrides, extra config, cache slots per device).
# The cache is the smallest that holds a step on every device, so most steps evict. By hand, the most distinct rows
# one global batch of 32 can bring a device: row-wise over 8 devices, min(375, 32) of C1 + min(63, 32 x 3) of C2 +
# min(250, 32) of C4 = 127; table-wise, C2's owner: 32 x 3 = 96; row-wise over the 4 model columns, 32 + 96 + 32 = 160;
# C1 alone, row-wise over 8: min(375, 32) = 32.
CASES = {
    "rowwise_adagrad-row-4x2": ("rowwise_adagrad", "data=4,model=2", "row", "C3=replicated", {}, 127),
    "lazy_adam-table-4x2": ("lazy_adam", "data=4,model=2", "table", "C1=table:3,C2=table:0,C3=table:1,C4=table:5",
                            {}, 96),
    "sgd-row_mod_model-2x4": ("sgd", "data=2,model=4", "row", "C3=replicated",
                              {"sharding.row_axes": "model", "sharding.row_split": "mod"}, 160),
    # Mixed dims (MD, alpha 0.5): C1's group on disk, the other groups in memory with their plan (and their glue).
    "adagrad-md-row-4x2": ("adagrad", "data=4,model=2", "row", "", {
        "embedding.method": "md", "embedding.options.alpha": 0.5, "tiering.tables": "C1=disk"}, 32),
}
STEPS = 16


def case_config(optimizer: str, mesh: str, plan: str, overrides: str, extra: dict, slots: int, directory: str):
    config = get_config()
    config.embedding.dim = 8
    config.model.dlrm.bottom_mlp = (8, 8)
    config.model.dlrm.top_mlp = (8, 1)
    config.optimizer.sparse.name = optimizer
    config.optimizer.sparse.learning_rate = 0.05
    config.optimizer.sparse.weight_decay = 1e-3 if optimizer == "lazy_adam" else 0.0
    config.train.batch_size = BATCH
    config.mesh.shape = mesh
    config.sharding.plan = plan
    config.sharding.tables = overrides
    config.sharding.capacity_factor = 1.25  # small buckets that overflow now and then: both branches run
    config.sharding.capacity_sigmas = 0.0
    # Every bag pooled on its owner, from its cache slots for the cached tables (`auto` would keep these small
    # tables' rows travelling): the disk run and the memory run pool the same bags in the same order.
    config.sharding.exchange = "pooled"
    config.tiering.tables = "C1=disk,C2=disk,C4=disk"  # C3 stays in memory, in the same stacked group
    set_keys(config, extra)
    config.tiering.cache_rows = slots
    config.tiering.dir = directory
    return config


def batches_with_returning_rows():
    """Random batches, then the first four again: rows leave the small caches and come back."""
    batches = [random_batch(SPEC, BATCH, seed=i) for i in range(STEPS)]
    return batches + batches[:4]


def run(task, backend, state, batches, put):
    first = put(batches[0])
    train = make_train_step(task, backend, state).lower(state, first).compile()
    predict = make_predict_step(task, backend, state).lower(state, first).compile()
    losses, probs = [], []
    for i, batch in enumerate(batches):
        state, metrics = train(state, put(batch))
        losses.append(float(metrics["loss"]))
        if i % 5 == 4:  # predictions between steps (on rows both cached and not), never moving the caches
            probs.append(np.asarray(predict(state, put(random_batch(SPEC, BATCH, seed=1000 + i)))))
    return state, np.array(losses), np.stack(probs)


def run_case(name: str, out: pathlib.Path) -> None:
    directory = tempfile.mkdtemp(prefix="tiering-mesh-")
    config = case_config(*CASES[name], directory)
    validate_config(config)
    task = build_task(config, SPEC)
    batches = batches_with_returning_rows()
    in_memory = config.copy_and_resolve_references()
    in_memory.tiering.tables = ""
    memory = placement.build(in_memory, task)
    assert [s.name for s in memory.storages] == ["memory"] and memory.layout.shards == 8
    state = memory.place_state(init_state(task, jax.random.key(0), batches[0]))
    state, losses, probs = run(task, memory, state, batches, memory.put_batch)
    expected = memory.local_state(state)

    tiered = placement.build(config, task)
    disk = next(s for s in tiered.storages if s.name == "disk")
    assert tiered.layout.shards == 8
    assert [layout.slots for layout in disk.layouts.values()] == [CASES[name][5]]
    state = tiered.place_state(init_state(task, jax.random.key(0), batches[0], tiered))
    state, tiered_losses, tiered_probs = run(task, tiered, state, batches, tiered.put_batch)
    got = tiered.local_state(state)
    result = {"ref_loss": losses, "loss": tiered_losses, "ref_probs": probs, "probs": tiered_probs}
    for group in expected.tables:
        result[f"ref_table/{group}"] = np.asarray(expected.tables[group])
        result[f"table/{group}"] = np.asarray(got.tables[group])
        for field, value in expected.sparse_opt_state[group].items():
            result[f"ref_opt/{group}/{field}"] = np.asarray(value)
            result[f"opt/{group}/{field}"] = np.asarray(got.sparse_opt_state[group][field])
    ref_dense = jax.tree_util.tree_leaves_with_path(expected.dense_params)
    for (path, ref), value in zip(ref_dense, jax.tree_util.tree_leaves(got.dense_params), strict=True):
        key = jax.tree_util.keystr(path)
        result[f"ref_dense/{key}"] = np.asarray(ref)
        result[f"dense/{key}"] = np.asarray(value)
    for key, value in jax.tree_util.tree_leaves_with_path(expected.dense_opt_state):
        result[f"ref_dense_opt/{jax.tree_util.keystr(key)}"] = np.asarray(value)
    for key, value in jax.tree_util.tree_leaves_with_path(got.dense_opt_state):
        result[f"dense_opt/{jax.tree_util.keystr(key)}"] = np.asarray(value)
    stats = tiered.summary()["tiering"]
    group, = stats["groups"].values()
    for key in ("hits", "misses", "evictions", "writebacks", "lookups"):
        result[f"stats/{key}"] = group[key]
    result["stats/eval_misses"] = stats["eval_misses"]
    # The cache storage keeps its sharding through the swaps (each device's block in place).
    cache = next(k for k in state.tables if k.endswith("/cache"))
    result["cache_sharding_kept"] = state.tables[cache].sharding.is_equivalent_to(
        tiered.layout.exchange.sharding(cache), 2)
    tiered.close()
    np.savez(out / f"{name}.npz", **result)


# ------------------------------------------------------------------------------------------- checkpoints
def mesh_run_config(disk: pathlib.Path | None = None):
    """tests/test_tiering_checkpoint.py's 12 steps of 32 (lazy Adam, dropout, consecutive deltas, a checkpoint every 3
    steps) on a data=4 x model=2 mesh, C1 and C4 table-wise on devices 3 and 5, the others row-wise; with `disk`, C1
    and C4 on disk behind caches of 32 rows per device (a step can bring each owner 32 rows: every step evicts)."""
    config = tiny(disk=disk)
    config.mesh.shape = "data=4,model=2"
    config.sharding.plan = "row"
    config.sharding.tables = "C1=table:3,C4=table:5"
    if disk is not None:
        config.tiering.cache_rows = 32
    return config


def single_device_arrays(workdir: pathlib.Path, step: int, collection) -> dict[str, np.ndarray]:
    """`checkpoint.read_arrays` of a checkpoint, its tables and optimizer state in the single-device layout (a mesh
    run's are by storage: `sharding.relayout`)."""
    point = checkpoint.open_checkpoint(workdir / "checkpoints", step)
    arrays, saved = checkpoint.read_arrays(point), point.meta["layout"]
    if saved is None:
        return arrays
    convert = sharding.relayout(collection, None)
    out = {k: v for k, v in arrays.items() if not k.startswith(("tables/", "sparse_opt/"))}
    out.update({f"tables/{g}": t for g, t in convert({k[len("tables/"):]: v for k, v in arrays.items()
                                                      if k.startswith("tables/")}, saved).items()})
    for field in {k.rsplit("/", 1)[1] for k in arrays if k.startswith("sparse_opt/")}:
        by_key = {k[len("sparse_opt/"): -len(field) - 1]: v for k, v in arrays.items()
                  if k.startswith("sparse_opt/") and k.endswith(f"/{field}")}
        out.update({f"sparse_opt/{g}/{field}": v for g, v in convert(by_key, saved).items()})
    return out


def checkpoint_case(out: pathlib.Path) -> None:
    """The in-memory mesh run, uninterrupted; the mesh run with C1 and C4 on disk killed after the save of step 6, its
    table files overwritten (rows no checkpoint holds), resumed. Both runs' checkpoints (single-device layout) and
    summaries go to OUT/checkpoint.npz."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="tiering-mesh-ckpt-"))
    train_and_evaluate(mesh_run_config(), root / "memory")
    with pytest.MonkeyPatch.context() as monkeypatch:
        interrupted(mesh_run_config(root / "tables"), root / "disk", monkeypatch, at_step=6)
    overwrite_records(root / "tables")
    train_and_evaluate(mesh_run_config(root / "tables"), root / "disk")
    config = mesh_run_config()
    dataset = make_dataset(config.data, seed=config.seed)
    collection = build_task(config, dataset.spec).collection
    result = {}
    for name in ("memory", "disk"):
        for step in (3, 6, 9, 12):
            point = checkpoint.open_checkpoint(root / name / "checkpoints", step)
            result[f"{name}/kind/{step}"] = point.meta["kind"]
            for key, value in single_device_arrays(root / name, step, collection).items():
                result[f"{name}/{step}/{key}"] = value
        summary = json.loads((root / name / "summary.json").read_text())
        result[f"{name}/summary"] = json.dumps(summary)
    np.savez(out / "checkpoint.npz", **result)


if __name__ == "__main__":
    out_dir = pathlib.Path(sys.argv[1])
    for case in sys.argv[2:]:
        checkpoint_case(out_dir) if case == "checkpoint" else run_case(case, out_dir)
        print(f"done {case}", flush=True)
