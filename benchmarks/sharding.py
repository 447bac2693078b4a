r"""Sharded train step on a mesh of CPU devices: step time, bytes each collective moves, memory per device.

    python benchmarks/sharding.py                                   # kaggle_b2048 + reference_random, every plan
    python benchmarks/sharding.py --shapes kaggle_b2048 --plans table,auto --repeats 5 --exchange_dtype bfloat16
    python benchmarks/sharding.py --shapes reference_random --plans table,row --exchange rows   # as before issue 39
    python benchmarks/sharding.py --shapes reference_random --plans row --row_axes model    # 2 owners per table

Prints one JSON line per (shape, plan) to stdout (progress to stderr), with the shape, config and the machine. The
single-device step on the same batch is timed in the same process, interleaved repeat by repeat with the sharded
one (the machine is shared: compare the two, not absolute times). On one CPU host the 8 "devices" share its cores
and memory, so the sharded step measures the exchange's overhead, not a speedup.

Shapes (benchmarks/kernels.py's, shrunk to fit a shared 2-core machine)
  kaggle_b2048      the 26 Criteo Kaggle cardinalities capped at --vocab_cap rows (default 1M: 9.9M rows), dim 16,
                    one id per feature, bottom 13-512-256-64-16, top 512-256-1, batch 2048, SGD.
  reference_random  8 tables x --reference_rows (default 100k) x dim 64, 100 ids per bag, batch 512 (2048 in the
                    reference; 512 keeps the row-wise plan's all_to_all buffers under ~1 GB), the reference MLPs.

Per line
  step_ms / single_device_step_ms    medians of --repeats interleaved steps (state donated)
  collectives                        from the compiled HLO, per op: count and bytes of their results per device
  exchange_bytes                     all-to-all + all-gather bytes per device (the embedding exchange; the
                                     all-reduce is the dense gradients) outside the worst-case buckets' branch,
                                     next to
    predicted_exchange_bytes         the same from the plan alone (recjax/sharding/exchange.py `exchange_bytes`)
    pooled_volume_bytes              the device's bags' pooled vectors, forward and backward (plan.py): the floor
                                     of an exchange that pools every bag on its owner, ids aside
    exchange_over_pooled             exchange_bytes / pooled_volume_bytes
    plan_volume_bytes                what the plan's exchange moves per device without padding (`exchange_volume_
                                     bytes`, the busiest device's)
  pooled_tables                      the tables whose bags their owners pool (`sharding.exchange`, --exchange)
  fallback_exchange_bytes            a step whose buckets overflow `capacity_factor` x the expected ids runs the
                                     worst-case branch instead (these bytes), taken in overflow_steps of timed_steps
  peak_device_bytes                  XLA's memory analysis of the step: arguments + outputs + temporaries - aliased
  table_bytes_max / share            the largest per-device table block (incl. padding to the storage's row count)
                                     vs an even share (all tables / devices), and vs what the plan assigns it
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # this checkout's recjax, not an installed one
SHAPES = {
    "kaggle_b2048": dict(tables=None, dim=16, bag=1, batch=2048, bottom=(512, 256, 64, 16), top=(512, 256, 1)),
    "reference_random": dict(tables=8, dim=64, bag=100, batch=512, bottom=(512, 512, 64), top=(1024, 1024, 1024, 1)),
}
PLANS = ("table", "row", "column", "replicated", "auto")


def _log(message: str) -> None:
    print(f"[sharding] {message}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    import jax

    return {"cpu_count": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": jax.device_count(), "load_average": os.getloadavg()[0]}


def build(shape: dict, args, plan: str, seed: int = 0):
    """(config, task, host batch) for `shape` under `plan`."""
    import ml_collections

    from experiments.configs.dlrm_synthetic import get_config
    from recjax.data.synthetic import KAGGLE_VOCAB_SIZES
    from recjax.specs import DatasetSpec, FeatureSpec
    from recjax.task import build_task

    if shape["tables"] is None:
        sizes = [min(v, args.vocab_cap) for v in KAGGLE_VOCAB_SIZES]
    else:
        sizes = [args.reference_rows] * shape["tables"]
    config = get_config("small")
    config.embedding.dim = shape["dim"]
    config.model.dlrm.bottom_mlp = shape["bottom"]
    config.model.dlrm.top_mlp = shape["top"]
    config.train.batch_size = shape["batch"]
    config.optimizer.dense = ml_collections.ConfigDict({"name": "sgd", "learning_rate": 0.01, "weight_decay": 0.0})
    config.optimizer.sparse = ml_collections.ConfigDict({"name": "sgd", "learning_rate": 0.01, "weight_decay": 0.0})
    config.mesh.shape = args.mesh
    config.sharding.plan = plan
    config.sharding.exchange_dtype = args.exchange_dtype
    config.sharding.exchange = args.exchange
    config.sharding.row_axes = args.row_axes
    config.sharding.capacity_factor = args.capacity_factor
    config.sharding.capacity_sigmas = args.capacity_sigmas
    spec = DatasetSpec(num_dense=13, features=tuple(FeatureSpec(f"C{i + 1}", v, shape["bag"])
                                                   for i, v in enumerate(sizes)))
    task = build_task(config, spec)
    rng = np.random.default_rng(seed)
    from recjax.batch import Batch

    b = shape["batch"]
    batch = Batch(dense=rng.normal(size=(b, 13)).astype(np.float32),
                  ids={f.name: rng.integers(0, f.vocab_size, (b, f.bag_size)).astype(np.int32) for f in spec.features},
                  lengths={f.name: np.full(b, f.bag_size, np.int32) for f in spec.features},
                  labels=(rng.random(b) < 0.25).astype(np.float32))
    return config, task, batch


def measure(name: str, shape: dict, args) -> None:
    import jax

    from recjax import placement
    from recjax.sharding import hlo
    from recjax.sharding.exchange import exchange_bytes
    from recjax.sharding.plan import exchange_volume_bytes, pooled_volume_bytes
    from recjax.step import init_state, make_train_step

    config, task, batch = build(shape, args, "table")
    single_state = init_state(task, jax.random.key(0), jax.device_put(batch, jax.devices()[0]))
    single_batch = jax.device_put(batch, jax.devices()[0])
    single_step = make_train_step(task).lower(single_state, single_batch).compile()
    host_state = jax.device_get(single_state)  # each plan starts from the same initial state
    for plan in args.plans:
        _log(f"{name} / {plan}")
        config.sharding.plan = plan
        try:
            sharded = placement.build(config, task)
        except ValueError as error:  # e.g. a plan that does not fit: report it, go on
            print(json.dumps({"name": name, "plan": plan, "error": str(error)}), flush=True)
            continue
        state = sharded.place_state(host_state)
        train_step = make_train_step(task, sharded, state)
        device_batch = sharded.put_batch(batch)
        t0 = time.perf_counter()
        compiled = train_step.lower(state, device_batch).compile()
        compile_s = time.perf_counter() - t0
        text = compiled.as_text()
        ops: dict[str, dict[str, int]] = {}
        fallback = 0  # the worst-case buckets' branch, run only by a step whose buckets overflow
        for c in hlo.collectives(text):
            if c["fallback"]:
                fallback += c["bytes"]
                continue
            entry = ops.setdefault(c["op"], {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += c["bytes"]
        exchange = sum(ops.get(op, {}).get("bytes", 0) for op in ("all-to-all", "all-gather"))
        itemsize = np.dtype(args.exchange_dtype if args.exchange_dtype != "bfloat16" else "float16").itemsize
        plan_ = sharded.layout.plan
        pooled_volume = pooled_volume_bytes(plan_, itemsize)
        # XLA:CPU widens bf16 / f16 collectives to f32: the compiled HLO's bytes are f32 ones.
        predicted = exchange_bytes(plan_, args.capacity_factor, args.capacity_sigmas, 4,
                                   config.embedding.pooling == "mean")
        memory = compiled.memory_analysis()
        peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
                - memory.alias_size_in_bytes)
        blocks = {k: int(np.prod(v.addressable_shards[0].data.shape)) * 4 for k, v in state.tables.items()}
        # Per device: its table blocks (tables only, padding included) vs the plan's assignment and an even share.
        per_device = [0] * sharded.layout.mesh.size
        for v in state.tables.values():
            for shard in v.addressable_shards:
                per_device[shard.device.id] += int(np.prod(shard.data.shape)) * 4
        total_rows = sum(p.table.rows * p.table.dim * 4 for p in sharded.layout.plan.placements)
        assigned = [sum(p.device_bytes(d, sharded.layout.plan.mesh_shape) * p.table.dim // (p.table.dim
                                                                                   + p.table.state_floats)
                        for p in sharded.layout.plan.placements) for d in range(sharded.layout.mesh.size)]

        states = {"single": single_state, "sharded": state}
        steps = {"single": lambda s: single_step(s, single_batch),
                 "sharded": lambda s, step=compiled, batch=device_batch: step(s, batch)}
        times: dict[str, list[float]] = {"single": [], "sharded": []}
        overflows = []
        for which in states:  # warm up
            states[which], m = steps[which](states[which])
            jax.block_until_ready(m)
        for _ in range(args.repeats):
            for which in states:
                t0 = time.perf_counter()
                states[which], m = steps[which](states[which])
                jax.block_until_ready(m)
                times[which].append(time.perf_counter() - t0)
                if which == "sharded":
                    overflows.append(int(m["bucket_overflows"]))
        single_state = states["single"]
        record = {
            "name": name, "plan": plan, "mesh": dict(sharded.layout.plan.mesh_shape),
            "exchange_dtype": args.exchange_dtype,
            "shardings": sorted({p.sharding for p in sharded.layout.plan.placements}),
            "step_ms": 1000 * statistics.median(times["sharded"]),
            "single_device_step_ms": 1000 * statistics.median(times["single"]),
            "compile_s": compile_s,
            "collectives": ops,
            "exchange": args.exchange, "row_axes": args.row_axes,
            "pooled_tables": sorted(p.table.name for p in plan_.placements if plan_.pooled(p.table.name)),
            "exchange_bytes": exchange, "predicted_exchange_bytes": predicted[0],
            "pooled_volume_bytes": pooled_volume, "exchange_over_pooled": exchange / pooled_volume,
            "plan_volume_bytes": max(exchange_volume_bytes(plan_, itemsize)),
            "capacity_factor": args.capacity_factor, "capacity_sigmas": args.capacity_sigmas,
            "fallback_exchange_bytes": fallback,
            "overflow_steps": sum(o > 0 for o in overflows), "timed_steps": len(overflows),
            "peak_device_bytes": int(peak),
            "table_bytes_max": max(per_device), "table_bytes_share": total_rows / sharded.layout.mesh.size,
            "table_max_over_share": max(per_device) / (total_rows / sharded.layout.mesh.size),
            "table_max_over_assigned": max(b / a for b, a in zip(per_device, assigned, strict=True) if a),
            "blocks": blocks,
            "config": {**{k: v for k, v in shape.items() if k != "tables"}, "rows": [p.table.rows for p in
                                                                                     sharded.layout.plan.placements]},
            "machine": machine(),
        }
        print(json.dumps(record), flush=True)
        del state, states


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)}")
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, from {PLANS}")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices (jax_num_cpu_devices)")
    parser.add_argument("--mesh", default="data=4,model=2", help="config.mesh.shape")
    parser.add_argument("--exchange_dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--exchange", default="auto", choices=("auto", "pooled", "rows"),
                        help="config.sharding.exchange")
    parser.add_argument("--row_axes", default="all", choices=("all", "model"), help="config.sharding.row_axes")
    parser.add_argument("--capacity_factor", type=float, default=1.0, help="config.sharding.capacity_factor")
    parser.add_argument("--capacity_sigmas", type=float, default=7.0, help="config.sharding.capacity_sigmas")
    parser.add_argument("--vocab_cap", type=int, default=1_000_000, help="kaggle_b2048: rows per table at most")
    parser.add_argument("--reference_rows", type=int, default=100_000, help="reference_random: rows per table")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per contender (medians reported)")
    args = parser.parse_args(argv)
    args.plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES] + [p for p in args.plans if p not in PLANS]
    if unknown:
        parser.error(f"unknown shapes / plans {unknown}")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    for name in shapes:
        measure(name, SHAPES[name], args)


if __name__ == "__main__":
    from recjax import cli

    with cli.user_errors():
        main()
