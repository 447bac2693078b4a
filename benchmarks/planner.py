r"""The sharding planner (recjax/sharding/planner.py) against NeuroShard's baselines on Meta-shaped tasks, its planning
time, the pre-trained neural cost model's held-out error, and whether its predicted ranking of plans matches measured
step times on 8 CPU devices.

    python benchmarks/planner.py                                   # every section, the default sizes
    python benchmarks/planner.py --sections tasks --tasks 3 --devices 4,8 --tables 10,50
    python benchmarks/planner.py --sections neural --neural_plans 1500 --neural_steps 3000 --out /tmp/planner
    python benchmarks/planner.py --sections neural --neural_labels benchmark --neural_plans 40   # CPU micro-benchmarks
    python benchmarks/planner.py --sections rank --repeats 5       # 8 CPU devices, the synthetic Kaggle shape
    python benchmarks/planner.py --sections measure                # this machine's gather / scatter / all_to_all

One JSON line per measurement on stdout (progress on stderr), with the machine. Sections:
  meta     the 856-table set's statistics next to the published ones (experiments/planning/meta_tables.py)
  tasks    for each device count and table count, `--tasks` tasks sampled from the set (memory per device: its share
           of the task's bytes at 75 % fill; A100-like hosts of 8, recjax/sharding/cost_model.py `gpu_cluster`),
           planned by recjax (beam search; and restricted to whole tables, `recjax_table`, the baselines' space) and
           by each baseline; every plan scored by the analytic model. Per line: each planner's mean cost relative
           to recjax's (cost_ratio_vs: recjax / baseline, over the tasks where both fit; and vs the best fitting
           baseline of each task), fit rate, planning wall and CPU seconds. Then 856 tables on 128 devices.
  neural   pre-trains the neural cost model on augmented plans (labels from the analytic model, or measured on this
           machine with --neural_labels benchmark), prints its held-out error, saves it (msgpack) under --out, and
           plans tasks with it: each plan scored by the analytic model against the plan searched with the analytic
           model itself.
  rank     the synthetic Kaggle shape of benchmarks/sharding.py on 8 CPU devices under 5 plans (table, row, column,
           replicated, auto): the analytic model's predicted step cost (slowest device, and the sum over devices:
           8 CPU "devices" share 2 cores, so they run one after the other) against the measured train-step time;
           Spearman's rank correlation of each.
  measure  gather / scatter-add bandwidth of one CPU device and all_to_all bandwidth over the local devices (what
           `Topology.cpu_host`'s numbers come from).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import numpy as np

SECTIONS = ("meta", "tasks", "neural", "rank", "measure")


def _log(message: str) -> None:
    print(f"[planner] {message}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    import jax

    return {"cpu_count": os.cpu_count(), "jax": jax.__version__, "devices": jax.device_count(),
            "load_average": os.getloadavg()[0]}


def emit(record: dict) -> None:
    print(json.dumps({**record, "machine": machine()}), flush=True)


# ------------------------------------------------------------------------------------------------------- meta
def section_meta(args) -> None:
    from experiments.planning import meta_tables

    emit({"section": "meta", **meta_tables.summary(meta_tables.meta_tables(args.seed))})


# ------------------------------------------------------------------------------------------------------ tasks
def run_planners(problem, seed: int, model=None, judge=None) -> dict[str, dict]:
    """Every planner on one task: {name: {"cost", "fits", "wall", "cpu"}}."""
    from recjax.sharding import planner as P

    out = {}
    runs = [("recjax", lambda: P.plan(problem, model, seed=seed, judge=judge)),
            ("recjax_table", lambda: P.plan(problem, model, seed=seed, judge=judge, kinds=("table",)))]
    runs += [(name, lambda name=name: P.baseline(problem, name, judge or model, seed=seed)) for name in P.BASELINES]
    for name, run in runs:
        cpu = time.process_time()
        result = run()
        out[name] = {"cost": result.cost.max, "fits": result.fits, "wall": result.seconds,
                     "cpu": time.process_time() - cpu, "shardings": result.to_json()["shardings"],
                     "exchange": result.cost.exchange, "compute_mean": float(result.cost.compute.mean())}
    return out


def floors(runs: list[dict[str, dict]]) -> dict:
    """How much lower than the best fitting baseline a plan could go by placement alone, per task averaged: every
    device pays the exchange, and the slowest device's compute is at least the mean device's. `exchange_share`: the
    exchange's share of each planner's step cost; `balanced_floor`: (the best baseline's exchange + its mean device
    compute) / its step cost, what perfectly balancing that plan's compute would reach; `exchange_floor`: its
    exchange / its step cost, what a plan with no compute at all and the same exchange would reach. Below them only
    a smaller exchange (other sharding kinds per storage) goes."""
    from recjax.sharding import planner as P

    planners = list(runs[0])
    record = {"exchange_share": {p: float(np.mean([r[p]["exchange"] / r[p]["cost"] for r in runs if r[p]["fits"]]
                                                  or [np.nan])) for p in planners}}
    balanced, exchange = [], []
    for r in runs:
        fitting = [b for b in P.BASELINES if r[b]["fits"]]
        if fitting:
            best = r[min(fitting, key=lambda b: r[b]["cost"])]
            balanced.append((best["exchange"] + best["compute_mean"]) / best["cost"])
            exchange.append(best["exchange"] / best["cost"])
    record["best_baseline_balanced_floor"] = float(np.mean(balanced)) if balanced else None
    record["best_baseline_exchange_floor"] = float(np.mean(exchange)) if exchange else None
    return record


def summarize(name: str, devices: int, tables: int, runs: list[dict[str, dict]]) -> dict:
    from recjax.sharding import planner as P

    planners = list(runs[0])
    record = {"section": "tasks", "name": name, "devices": devices, "tables": tables, "tasks": len(runs),
              "fit_rate": {p: float(np.mean([r[p]["fits"] for r in runs])) for p in planners},
              "plan_wall_s": {p: float(np.mean([r[p]["wall"] for r in runs])) for p in planners},
              "plan_cpu_s": {p: float(np.mean([r[p]["cpu"] for r in runs])) for p in planners},
              "cost_ms": {p: float(np.mean([1e3 * r[p]["cost"] for r in runs if r[p]["fits"]] or [np.nan]))
                          for p in planners}}
    ratios = {}
    for other in planners[1:]:
        pairs = [r["recjax"]["cost"] / r[other]["cost"] for r in runs if r["recjax"]["fits"] and r[other]["fits"]]
        ratios[other] = float(np.mean(pairs)) if pairs else None
    best = []
    for r in runs:
        fitting = [r[b]["cost"] for b in P.BASELINES if r[b]["fits"]]
        if fitting and r["recjax"]["fits"]:
            best.append(r["recjax"]["cost"] / min(fitting))
    record["cost_ratio_vs"] = ratios
    record.update(floors(runs))
    record["cost_ratio_vs_best_baseline"] = float(np.mean(best)) if best else None
    record["tasks_with_a_fitting_baseline"] = len(best)
    record["recjax_shardings"] = runs[-1]["recjax"]["shardings"]
    return record


def section_tasks(args) -> None:
    from experiments.planning import meta_tables

    tables = meta_tables.meta_tables(args.seed)
    for devices in args.devices:
        for count in args.tables:
            runs = []
            for k in range(args.tasks):
                problem = meta_tables.sample_task(tables, count, devices, seed=args.seed * 1000 + k)
                _log(f"tasks: {count} tables on {devices} devices, task {k}")
                runs.append(run_planners(problem, seed=k))
            emit(summarize("meta_tasks", devices, count, runs))
    if args.full:
        problem = meta_tables.sample_task(tables, len(tables), 128, seed=args.seed)
        _log("tasks: all 856 tables on 128 devices")
        emit(summarize("meta_856_on_128", 128, len(tables), [run_planners(problem, seed=0)]))


# ----------------------------------------------------------------------------------------------------- neural
def section_neural(args) -> None:
    from experiments.planning import cost_net, meta_tables
    from recjax.sharding import planner as P
    from recjax.sharding.cost_model import AnalyticCostModel, Topology

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tables = meta_tables.meta_tables(args.seed)
    if args.neural_labels == "benchmark":  # this machine's CPU devices: rows scaled down to run in milliseconds
        import jax

        n = jax.device_count()
        pool = [t.planner_table() for t in meta_tables.meta_tables(args.seed, rows=(100, 200_000))]
        topology_for = lambda n: Topology.cpu_host(n, 1 << 30)  # noqa: E731
        devices, batch = (n,), 4096
    else:
        pool = [t.planner_table() for t in tables]
        topology_for = lambda n: Topology.gpu_cluster(n, 1 << 34)  # noqa: E731
        devices, batch = (4, 8, 16, 32, 64, 128), meta_tables.BATCH
    _log(f"neural: sampling {args.neural_plans} plans, labels {args.neural_labels}")
    t0, c0 = time.perf_counter(), time.process_time()
    data = cost_net.sample_dataset(pool, topology_for, batch, args.neural_plans, seed=args.seed, devices=devices,
                                   tables=(10, 200) if args.neural_labels == "analytic" else (4, 24),
                                   labels=args.neural_labels)
    sample_s, sample_cpu = time.perf_counter() - t0, time.process_time() - c0
    _log(f"neural: training on {len(data.compute)} devices / {len(data.exchange)} storages")
    t0, c0 = time.perf_counter(), time.process_time()
    model, report = cost_net.train(data, steps=args.neural_steps, seed=args.seed)
    path = out / f"cost_model_{args.neural_labels}.msgpack"
    model.save(path)
    emit({"section": "neural", "labels": args.neural_labels, "plans": args.neural_plans, "steps": args.neural_steps,
          "device_samples": len(data.compute), "storage_samples": len(data.exchange), "sample_s": sample_s,
          "sample_cpu_s": sample_cpu, "train_s": time.perf_counter() - t0, "train_cpu_s": time.process_time() - c0,
          "saved": str(path), "bytes": path.stat().st_size, "held_out": report})
    if args.neural_labels != "analytic":
        return
    for devices_, count in ((8, 50), (32, 100), (128, 200)):
        ratios, times = [], []
        for k in range(args.tasks):
            problem = meta_tables.sample_task(tables, count, devices_, seed=10_000 + k)
            analytic = AnalyticCostModel(problem.topology)
            neural = cost_net.NeuralCostModel.load(path, problem.topology)
            by_neural = P.plan(problem, neural, seed=k, judge=analytic)
            by_analytic = P.plan(problem, analytic, seed=k)
            if by_neural.fits and by_analytic.fits:
                ratios.append(by_neural.cost.max / by_analytic.cost.max)
            times.append(by_neural.seconds)
        emit({"section": "neural_search", "devices": devices_, "tables": count, "tasks": args.tasks,
              "cost_ratio_neural_vs_analytic_search": float(np.mean(ratios)) if ratios else None,
              "plan_wall_s": float(np.mean(times))})


# ------------------------------------------------------------------------------------------------------- rank
def _sharding_benchmark():
    path = pathlib.Path(__file__).with_name("sharding.py")
    spec = importlib.util.spec_from_file_location("sharding_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section_rank(args) -> None:
    import jax

    from recjax import placement, sharding
    from recjax.sharding import cost_model as C
    from recjax.step import init_state, make_train_step

    bench = _sharding_benchmark()
    shape = bench.SHAPES["kaggle_b2048"]
    bargs = argparse.Namespace(vocab_cap=args.vocab_cap, mesh=args.mesh, exchange_dtype="float32",
                               capacity_factor=1.0, capacity_sigmas=7.0)
    config, task, batch = bench.build(shape, bargs, "table")
    host_state = jax.device_get(init_state(task, jax.random.key(0), jax.device_put(batch, jax.devices()[0])))
    plans = ("table", "row", "column", "replicated", "auto")
    runs = {}
    for name in plans:
        config.sharding.plan = name
        sharded = placement.build(config, task)
        state = sharded.place_state(host_state)
        device_batch = sharded.put_batch(batch)
        compiled = make_train_step(task, sharded, state).lower(state, device_batch).compile()
        state, metrics = compiled(state, device_batch)  # warm-up
        jax.block_until_ready(metrics)
        infos = sharding.table_infos(task.collection, task.sparse_optimizer)
        problem = C.Problem(tuple(C.PlannerTable(i) for i in infos),
                            C.Topology.cpu_host(sharded.layout.mesh.size, sharded.layout.plan.device_memory_bytes),
                            int(config.train.batch_size), config.sharding.row_split)
        predicted = C.plan_cost(C.AnalyticCostModel(problem.topology), problem, sharded.layout.plan.placements)
        runs[name] = {"state": state, "step": compiled, "batch": device_batch, "times": [],
                      "predicted_ms": 1e3 * predicted.max, "predicted_sum_ms": 1e3 * float(predicted.devices.sum()),
                      "shardings": sorted({p.sharding for p in sharded.layout.plan.placements})}
        _log(f"rank: {name} compiled, predicted {runs[name]['predicted_ms']:.2f} ms")
    for _ in range(args.repeats):  # round robin: a burst of load on the shared machine hits every plan alike
        for name in plans:
            r = runs[name]
            t0 = time.perf_counter()
            r["state"], metrics = r["step"](r["state"], r["batch"])
            jax.block_until_ready(metrics)
            r["times"].append(time.perf_counter() - t0)
    measured = [1e3 * statistics.median(runs[p]["times"]) for p in plans]
    from experiments.planning.cost_net import spearman

    emit({"section": "rank", "shape": "kaggle_b2048", "vocab_cap": args.vocab_cap, "mesh": args.mesh,
          "repeats": args.repeats, "plans": list(plans), "measured_step_ms": measured,
          "predicted_max_ms": [runs[p]["predicted_ms"] for p in plans],
          "predicted_sum_ms": [runs[p]["predicted_sum_ms"] for p in plans],
          "shardings": {p: runs[p]["shardings"] for p in plans},
          "spearman_max": spearman([runs[p]["predicted_ms"] for p in plans], measured),
          "spearman_sum": spearman([runs[p]["predicted_sum_ms"] for p in plans], measured)})


# ---------------------------------------------------------------------------------------------------- measure
def section_measure(args) -> None:
    import jax
    import jax.numpy as jnp

    def timed(fn, *a):
        jax.block_until_ready(fn(*a))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    rng = np.random.default_rng(0)
    rows, dim, ids = 1 << 22, 32, 1 << 20
    table = jnp.asarray(rng.normal(size=(rows, dim)).astype(np.float32))
    idx = jnp.asarray(rng.integers(0, rows, ids).astype(np.int32))
    hot = jnp.asarray(rng.integers(0, 1 << 12, ids).astype(np.int32))  # a 512 KiB working set: in cache
    gather = jax.jit(lambda t, i: jnp.take(t, i, axis=0).sum())
    scatter = jax.jit(lambda t, i: t.at[i].add(1.0).sum())
    row_bytes = dim * 4
    record = {"section": "measure", "gather_bytes_per_s": ids * row_bytes / timed(gather, table, idx),
              "gather_cached_bytes_per_s": ids * row_bytes / timed(gather, table, hot),
              "scatter_add_bytes_per_s": 2 * ids * row_bytes / timed(scatter, table, idx)}
    n = jax.device_count()
    if n > 1:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as Pspec

        mesh = jax.make_mesh((n,), ("d",))
        slots = 1 << 14
        buf = jax.device_put(jnp.ones((n, n, slots, dim), jnp.float32), NamedSharding(mesh, Pspec("d")))
        a2a = jax.jit(jax.shard_map(lambda x: jax.lax.all_to_all(x[0], "d", 0, 0)[None], mesh=mesh,
                                    in_specs=Pspec("d"), out_specs=Pspec("d")))
        per_device = (n - 1) * slots * row_bytes  # sent to the other devices by each
        record.update({"devices": n, "all_to_all_bytes_per_device_per_s": per_device / timed(a2a, buf)})
    emit(record)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {SECTIONS}")
    parser.add_argument("--devices", default="4,8,32,128", help="tasks: device counts")
    parser.add_argument("--tables", default="10,50,100,200", help="tasks: table counts")
    parser.add_argument("--tasks", type=int, default=5, help="tasks per (device count, table count)")
    parser.add_argument("--no_full", dest="full", action="store_false", help="tasks: skip 856 tables on 128")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--neural_plans", type=int, default=1500)
    parser.add_argument("--neural_steps", type=int, default=3000)
    parser.add_argument("--neural_labels", default="analytic", choices=("analytic", "benchmark"))
    parser.add_argument("--out", default="/tmp/recjax_planner", help="where the neural cost model is saved")
    parser.add_argument("--cpu_devices", type=int, default=8, help="rank / measure / benchmark labels: CPU devices")
    parser.add_argument("--mesh", default="data=4,model=2", help="rank: config.mesh.shape")
    parser.add_argument("--vocab_cap", type=int, default=300_000, help="rank: Kaggle rows per table at most")
    parser.add_argument("--repeats", type=int, default=5, help="rank / measure: timed repeats (medians)")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    args.devices = [int(x) for x in args.devices.split(",")]
    args.tables = [int(x) for x in args.tables.split(",")]
    import jax

    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    for name in sections:
        globals()[f"section_{name}"](args)


if __name__ == "__main__":
    from recjax import cli

    with cli.user_errors():
        main()
