"""Multi-device runs for tests/test_sharding.py, in a subprocess with 8 CPU devices (the pytest process keeps its one
device, so every other test runs exactly as before).

    python tests/sharding_cases.py OUT_DIR CASE [CASE ...]      (JAX_NUM_CPU_DEVICES=8 is set by the caller)

For each case: the single-device engine (the oracle) and the sharded engine train the same initial state on the same
batches; OUT_DIR/<case>.npz holds both runs' losses, logits, tables, optimizer state and dense params. The case
"hlo" instead writes what the compiled sharded step's HLO says about collectives and temporaries (hlo.json).
"""

import json
import pathlib
import sys

import jax
import ml_collections
import numpy as np

from experiments.configs import dlrm_synthetic
from recjax import placement
from recjax.config_check import validate_config
from recjax.data import make_dataset
from recjax.data.pipeline import stack
from recjax.sharding import hlo
from recjax.sharding.exchange import exchange_collectives
from recjax.step import init_state, make_predict_step, make_train_step
from recjax.task import build_task

BATCH = 32
STEPS = 3
# Cases that also run their STEPS steps as one call (recjax/step.py's scan inside the shard_map), from the same state:
# mixed shardings, and FIITED's replicated routing arrays updated from each step's global batch.
K_STEP_CASES = ("dlrm-full-mixed-4x2", "dlrm-fiited-mixed-4x2")
# name: (model, method, mesh, plan, overrides, extra config)
CASES = {
    "dlrm-full-row_mod_model-2x4": ("dlrm", "full", "data=2,model=4", "row", "",
                                    {"sharding.row_axes": "model", "sharding.row_split": "mod",
                                     "optimizer.sparse.name": "rowwise_adagrad", "embedding.pooling": "mean"}),
    "dlrm-full-mixed-4x2": ("dlrm", "full", "data=4,model=2", "table", "C1=replicated,C2=row,C3=column,C4=table:7",
                            {"optimizer.sparse.name": "adagrad"}),
    "dlrm-qr-mixed-8x1": ("dlrm", "qr", "data=8", "row", "C2/q=table:3,C3=column,C5/r=replicated",
                          {"sharding.row_split": "mod"}),
    "dlrm-md-mixed-2x4": ("dlrm", "md", "data=2,model=4", "row", "C1=replicated,C3=table:1",
                          {"sharding.row_axes": "model", "optimizer.sparse.name": "sgd"}),
    # A mix of methods (hashing, QR, mixed-dim blocks, full), dense Adam.
    "dlrm-methods-mixed-4x2": ("dlrm", "hashing", "data=4,model=2", "row", "C4=column,C2=table:2",
                               {"optimizer.dense.name": "adam", "optimizer.dense.learning_rate": 0.01}),
    # FIITED: replicated routing arrays updated from the global batch; its pool row-wise and on one device.
    "dlrm-fiited-mixed-4x2": ("dlrm", "fiited", "data=4,model=2", "table", "C2/pool=row,C3/pool=table:1,C4=column",
                              {"optimizer.sparse.name": "adagrad"}),
    # Per-id methods that cannot pool on the owner (TT-Rec, signed hashing, path QR, CRT mult: their rows travel)
    # beside QR add (pooled on its factor tables' owners), row-wise by modulo with QR add column-wise.
    "dlrm-tt-perid-4x2": ("dlrm", "tt", "data=4,model=2", "row", "C4=column",
                          {"sharding.row_split": "mod", "optimizer.sparse.name": "adagrad"}),
    # Every table column-wise: pooled slices concatenated.
    "dlrm-full-column-8x1": ("dlrm", "full", "data=8", "column", "", {"optimizer.sparse.name": "adagrad"}),
    "wukong-qr-mixed-8x1": ("wukong", "qr", "data=8", "table", "C1=row,C2=column,C5=replicated", {}),
    "wukong-md-auto-2x4": ("wukong", "md", "data=2,model=4", "auto", "", {}),
    # The planner under a tight memory budget (650 rows of dim 16 + a row-wise Adagrad accumulator per device): C1
    # row-wise over 4 of the 8 devices, C3 over all 8, the rest replicated (recjax/sharding/planner.py).
    "dlrm-full-auto-4x2": ("dlrm", "full", "data=4,model=2", "auto", "",
                           {"optimizer.sparse.name": "rowwise_adagrad", "sharding.device_memory_bytes": 650 * 68}),
    # Reduced-precision exchange: close to the f32 oracle, not equal (tests/test_sharding.py checks both).
    "dlrm-full-mixed-4x2-bf16": ("dlrm", "full", "data=4,model=2", "table", "C1=replicated,C2=row,C3=column",
                                 {"sharding.exchange_dtype": "bfloat16", "optimizer.sparse.name": "sgd"}),
}


def set_keys(config: ml_collections.ConfigDict, values: dict) -> None:
    """config["a.b.c"] = value for each dotted key (a case's extra settings)."""
    for key, value in values.items():
        section, field = key.rsplit(".", 1)
        node = config
        for part in section.split("."):
            node = node[part]
        node[field] = value


def case_config(model: str, method: str, mesh: str, plan: str, overrides: str, extra: dict
                ) -> ml_collections.ConfigDict:
    config = dlrm_synthetic.get_config()
    config.data.vocab_sizes = (7, 300, 1000, 50, 120)  # a 7-id feature: the same ids on every device
    config.data.bag_sizes = (1, 3, 1, 2, 1)  # one-hot and multi-hot bags
    config.data.eval_examples = BATCH
    config.embedding.method = method
    if method == "qr":
        config.embedding.options.collisions = 4
    if method == "md":
        config.embedding.options.alpha = 0.5
    if method == "fiited":
        config.embedding.options.chunks = 4
        config.embedding.options.threshold = 100  # C2, C3 and C5 (300, 1000 and 120 ids)
    if method == "hashing":  # a mix of methods: hashing, QR, mixed-dim blocks and a full table
        config.embedding.options.buckets = 64
        config.embedding.id_counts = "dataset"
        config.embedding.tables = ml_collections.ConfigDict({
            "C2": {"method": "qr", "options": {"collisions": 8}},
            "C3": {"method": "md_blocks", "options": {"blocks": (0.1, 1.0)}},
            "C4": {"method": "full"}})
    if method == "tt":  # TT-Rec beside the other per-id methods and a pooled QR
        config.embedding.tables = ml_collections.ConfigDict({
            "C2": {"method": "hashing", "options": {"buckets": 64, "sign": True}},
            "C3": {"method": "qr_path", "options": {"collisions": 8}},
            "C4": {"method": "qr", "options": {"collisions": 4, "op": "add"}},
            "C5": {"method": "crt", "options": {"moduli": (11, 13)}}})
    config.model.name = model
    config.model.dlrm.bottom_mlp = (8, 16)
    config.model.dlrm.top_mlp = (16, 1)
    config.model.wukong.num_layers = 1
    config.model.wukong.fmb_mlp_width = 16
    config.model.wukong.top_mlp = (16, 1)
    config.optimizer.dense.name = "sgd"  # the dense params move by -lr * gradient: equal params = equal gradients
    config.optimizer.dense.learning_rate = 0.1
    config.optimizer.sparse.learning_rate = 0.05
    config.train.batch_size = BATCH
    config.mesh.shape = mesh
    config.sharding.plan = plan
    config.sharding.tables = overrides
    # A fixed 25 % margin and none in standard deviations: these small buckets then overflow now and then, so both
    # the expected-capacity and the worst-case branch run (test_expected_and_worst_case_buckets_both_ran).
    config.sharding.capacity_factor = 1.25
    config.sharding.capacity_sigmas = 0.0
    # Every bag that can pool on its owner does (these tables are so small that `auto` would keep many as rows);
    # the cases that say otherwise run `auto` and the rows exchange.
    config.sharding.exchange = "pooled"
    set_keys(config, extra)
    return config


def run_case(name: str, out: pathlib.Path) -> None:
    config = case_config(*CASES[name])
    validate_config(config)
    dataset = make_dataset(config.data, seed=0)
    task = build_task(config, dataset.spec, dataset, 10)
    batches = [b for _, b in zip(range(STEPS), dataset.train_batches(BATCH), strict=False)]
    state = init_state(task, jax.random.key(0), jax.device_put(batches[0]))
    sharded = placement.build(config, task)
    assert sharded.layout.shards == 8
    sharded_state = sharded.place_state(state)
    sharded_train = make_train_step(task, sharded, sharded_state)
    sharded_predict = make_predict_step(task, sharded, sharded_state)
    put = sharded.put_batch
    ref_train, ref_predict = make_train_step(task), make_predict_step(task)
    result = {"ref_loss": [], "loss": [], "overflows": []}
    for batch in batches:
        state, ref_metrics = ref_train(state, jax.device_put(batch))
        sharded_state, metrics = sharded_train(sharded_state, put(batch))
        result["ref_loss"].append(float(ref_metrics["loss"]))
        result["loss"].append(float(metrics["loss"]))
        result["overflows"].append(int(metrics["bucket_overflows"]))
    if name in K_STEP_CASES:
        k_state = sharded.place_state(init_state(task, jax.random.key(0), jax.device_put(batches[0])))
        block = sharded.put_batch(stack(batches), stacked=True)
        k_train = make_train_step(task, sharded, k_state, steps_per_call=STEPS)
        k_state, k_metrics = k_train(k_state, block)
        result["k_loss"] = np.asarray(k_metrics["loss"])
        k_back = sharded.local_state(k_state)
        for group in k_back.tables:
            result[f"k_table/{group}"] = np.asarray(k_back.tables[group])
            for field, value in k_back.sparse_opt_state[group].items():
                result[f"k_opt/{group}/{field}"] = np.asarray(value)
        for feature, arrays in k_back.aux.items():
            for key, value in arrays.items():
                result[f"k_aux/{feature}/{key}"] = np.asarray(value)
        for path, value in jax.tree_util.tree_leaves_with_path(k_back.dense_params):
            result[f"k_dense/{jax.tree_util.keystr(path)}"] = np.asarray(value)
    result["ref_logits"] = np.asarray(ref_predict(state, jax.device_put(batches[0])))
    result["logits"] = np.asarray(sharded_predict(sharded_state, put(batches[0])))
    back = sharded.local_state(sharded_state)
    for group in state.tables:
        result[f"ref_table/{group}"] = np.asarray(state.tables[group])
        result[f"table/{group}"] = np.asarray(back.tables[group])
        for field, value in state.sparse_opt_state[group].items():
            result[f"ref_opt/{group}/{field}"] = np.asarray(value)
            result[f"opt/{group}/{field}"] = np.asarray(back.sparse_opt_state[group][field])
    for feature, arrays in state.aux.items():  # FIITED's routing arrays
        for key, value in arrays.items():
            result[f"ref_aux/{feature}/{key}"] = np.asarray(value)
            result[f"aux/{feature}/{key}"] = np.asarray(back.aux[feature][key])
    ref_dense = jax.tree_util.tree_leaves_with_path(state.dense_params)
    dense = jax.tree_util.tree_leaves(back.dense_params)
    for (path, ref), value in zip(ref_dense, dense, strict=True):
        key = jax.tree_util.keystr(path)
        result[f"ref_dense/{key}"] = np.asarray(ref)
        result[f"dense/{key}"] = np.asarray(value)
    result["shardings"] = np.array(sorted({p.sharding for p in sharded.layout.plan.placements}))
    # Arrays whose all_to_all buckets are smaller than the worst case (a step takes the worst case on overflow).
    result["expected_buckets"] = sharded.layout.exchange.bucketed()
    np.savez(out / f"{name}.npz", **result)


# The compiled steps whose exchange bytes are checked against the plan's prediction (`exchange_bytes`): name ->
# (mesh, plan, overrides, bag sizes, extra config). Multi-hot bags pooled on their owners (table-, row-wise over all
# devices or over the model axis, column-wise) and travelling as rows (`exchange=rows`, `auto`).
BYTES_CASES = {
    "pooled-mixed-4x2": ("data=4,model=2", "table", "C1=replicated,C2=row,C3=column", (1, 3, 1, 2, 4), {}),
    "pooled-mean-row_model-2x4": ("data=2,model=4", "row", "C3=table:5", (2, 3, 1, 2, 4),
                                  {"sharding.row_axes": "model", "embedding.pooling": "mean"}),
    "rows-mixed-4x2": ("data=4,model=2", "table", "C1=replicated,C2=row,C3=column", (1, 3, 1, 2, 4),
                       {"sharding.exchange": "rows"}),
    # A memory budget the planner must split tables for (5 x 4096 rows x 16 x 3 floats with lazy Adam's state).
    "auto-8x1": ("data=8", "auto", "", (1, 3, 1, 2, 4),
                 {"sharding.exchange": "auto", "sharding.device_memory_bytes": 700_000}),
}


def hlo_report(out: pathlib.Path) -> None:
    """The compiled sharded step at two table sizes (4096 and 32768 rows; 8 ids per device a step): every
    collective, the largest array of any instruction, temp and aliased bytes, and each device's blocks; and the
    exchange bytes of `BYTES_CASES` beside the plan's prediction."""
    report = {rows: hlo_facts(rows) for rows in (4096, 32768)}
    report["bfloat16"] = hlo_facts(4096, "bfloat16")
    for name, (mesh, plan, overrides, bags, extra) in BYTES_CASES.items():
        report[name] = hlo_facts(4096, "float32", mesh, plan, overrides, bags, extra)
    (out / "hlo.json").write_text(json.dumps(report, indent=1))


def hlo_facts(rows: int, exchange_dtype: str = "float32", mesh: str = "data=4,model=2", plan: str = "table",
              overrides: str = "C1=replicated,C2=row,C3=column", bags=(1, 1, 1, 1, 1), extra=None) -> dict:
    config = case_config("dlrm", "full", mesh, plan, overrides,
                         {"sharding.exchange_dtype": exchange_dtype, **(extra or {})})
    config.data.vocab_sizes = (rows,) * 5
    config.data.bag_sizes = bags
    config.train.batch_size = 64  # 8 examples per device
    dataset = make_dataset(config.data, seed=0)
    task = build_task(config, dataset.spec, dataset, 10)
    batch = next(dataset.train_batches(64))
    state = init_state(task, jax.random.key(0), jax.device_put(batch))
    sharded = placement.build(config, task)
    sharded_state = sharded.place_state(state)
    lowered = make_train_step(task, sharded, sharded_state).lower(sharded_state, sharded.put_batch(batch))
    compiled = lowered.compile()
    text = compiled.as_text()
    # The program as written (StableHLO): which element types its all_to_alls carry. XLA:CPU's float normalization
    # widens bf16 collectives back to f32 in the compiled HLO; GPU / TPU keep them narrow.
    requested = sorted({t for line in lowered.as_text().splitlines() if "all_to_all" in line
                        for t in ("bf16", "f16", "f32") if f"x{t}>" in line})
    collectives = hlo.collectives(text)
    largest = hlo.largest_array_bytes(text)
    blocks = {name: int(np.prod(sharded_state.tables[name].addressable_shards[0].data.shape)) * 4
              for name in sharded_state.tables}
    memory = compiled.memory_analysis()
    # What the exchange's all_to_alls and all_gathers deliver to one device in a step whose buckets fit, and in one
    # that overflows (the worst-case branch replaces the bucketed collectives), beside the plan's prediction (XLA:CPU
    # widens bf16 collectives: f32 bytes).
    exchange = [c for c in collectives if c["op"] in ("all-to-all", "all-gather")]
    predicted = exchange_collectives(sharded.layout.plan, config.sharding.capacity_factor,
                                     config.sharding.capacity_sigmas, 4, config.embedding.pooling == "mean")
    return {
        "exchange_bytes": sum(c["bytes"] for c in exchange if not c["fallback"]),
        "fallback_exchange_bytes": sum(c["bytes"] for c in exchange if c["fallback"]),
        "predicted_exchange_bytes": sum(c["bytes"] for c in predicted if not c["fallback"]),
        "predicted_fallback_exchange_bytes": sum(c["bytes"] for c in predicted if c["fallback"]),
        # the collectives of the expected-capacity buckets, which the worst-case branch replaces
        "predicted_bucketed_exchange_bytes": sum(c["bytes"] for c in predicted if c["bucketed"]),
        "pooled_tables": sorted(p.table.name for p in sharded.layout.plan.placements
                                if sharded.layout.plan.pooled(p.table.name)),
        "table_bytes": rows * 16 * 4,
        "block_bytes": blocks,
        "collectives": [{"op": c["op"], "bytes": c["largest"], "dtypes": c["dtypes"], "fallback": c["fallback"],
                         "line": c["line"]} for c in collectives],
        "largest_instruction_bytes": largest,
        "all_to_all_dtypes_requested": requested,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "shardings": {p.table.name: p.sharding for p in sharded.layout.plan.placements},
    }


if __name__ == "__main__":
    out_dir = pathlib.Path(sys.argv[1])
    for case in sys.argv[2:]:
        hlo_report(out_dir) if case == "hlo" else run_case(case, out_dir)
        print(f"done {case}", flush=True)
