r"""The sharding planner (recjax/sharding/planner.py) measured as NeuroShard measured (Zha et al., MLSys 2023): its
tasks, its baselines, its search, one per-device cost; then its planning time at scale, the neural cost model's
held-out error, and whether the predicted ranking of plans matches measured step times on 8 CPU devices.

    python benchmarks/planner.py --sections neuroshard                  # 100 tasks on 4 and on 8 devices
    python benchmarks/planner.py --sections neuroshard --ns_tasks 10 --ns_devices 4 --no_ns_neural
    python benchmarks/planner.py --sections tasks --tasks 3 --devices 4,8 --tables 100,200   # + 856 tables on 128
    python benchmarks/planner.py --sections neural --neural_labels benchmark --neural_plans 60 --out /tmp/planner
    python benchmarks/planner.py --sections rank --neural_model /tmp/planner/cost_model_benchmark_pooled.msgpack
    python benchmarks/planner.py --sections measure                     # this machine's gather / all_to_all

One JSON line per measurement on stdout (progress on stderr), with the machine. Sections:
  neuroshard  NeuroShard's setting (experiments/planning/neuroshard.py): `--ns_tasks` seeded tasks of 10-60 tables
              drawn with replacement from the Meta-shaped 856-table set, a dim in 4..128 per table per task, at most
              devices x 4 - 1 GiB, `--ns_devices` devices of 4 GiB (A100-like, `Topology.gpu_cluster`; `--topology
              cpu`: this host's CPU devices), batch 65,536, the pooled exchange. Every planner's plan is scored by
              the same analytic model (recjax/sharding/cost_model.py: each phase's slowest device, summed): recjax
              (beam search), recjax searched with the neural cost model (pre-trained here on analytic labels),
              recjax restricted to whole tables, NeuroShard's search re-implemented, NeuroShard's five
              heuristics (random, size, dim, dim x pooling, dim x pooling x log10 rows), the TorchRec-like greedy.
              Per device count: fit rates, mean step costs, recjax's cost relative to the best heuristic of each
              task, to the TorchRec-like greedy and to NeuroShard (mean of the per-task ratios, and the ratio of the
              mean costs), planning seconds. Per-task records go to --out/neuroshard_tasks.jsonl (the notebook's
              figures). Then 856 tables on 128 devices planned under the pooled model.
  tasks       the earlier comparison (issue 28), today's rows exchange: `--tasks` tasks per (device count, table
              count) sampled from the 856 tables, memory per device at 75 % of the task's bytes / devices; recjax
              against `recjax_table` and the baselines; then all 856 tables on 128 devices (the planning-time goal).
  neural      pre-trains the neural cost model for `--exchange` on augmented plans (labels from the analytic model, or
              measured on this machine's CPU devices with --neural_labels benchmark), prints its held-out error per
              phase and per plan, saves it (msgpack) under --out; with analytic labels, plans tasks with it (each
              plan scored by the analytic model, against the plan searched with the analytic model itself).
  rank        a shape of benchmarks/sharding.py (`--rank_shape`: the synthetic Kaggle one, one-hot, by default; or
              reference_random, 8 tables of bags of 100) on 8 CPU devices under >= 10 plans (table, row,
              column, replicated, auto, NeuroShard's table-wise heuristics, random table-wise plans, random mixtures
              of kinds): each plan's predicted step cost -- the analytic model of today's rows exchange, the one of
              the pooled exchange (every table pooled), the model `sharding.plan=auto` plans with (`runtime`:
              recjax/sharding/planner.py `runtime_problem`, the run's exchange table by table) and the neural model
              at --neural_model -- against the measured train step, with Spearman's rank correlation of each. The
              runtime runs `--runtime_exchange` (sharding.exchange, default pooled; the record's runtime_exchange
              says which ran).
  measure     gather / scatter-add bandwidth of one CPU device, all_to_all bandwidth over the local devices, a
              kernel's and a collective's fixed cost, the dedup's seconds per id, random rows of 2 and 16 floats
              gathered per second (what `Topology.cpu_host`'s numbers come from).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

# This checkout's recjax and experiments, not an installed copy's.
_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import numpy as np  # noqa: E402

SECTIONS = ("neuroshard", "tasks", "neural", "rank", "measure", "meta")


def _log(message: str) -> None:
    print(f"[planner] {message}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    import jax

    return {"cpu_count": os.cpu_count(), "jax": jax.__version__, "devices": jax.device_count(),
            "load_average": os.getloadavg()[0]}


RESULTS: list[pathlib.Path] = []  # --out/results.jsonl: every line printed, for the notebook


def emit(record: dict) -> None:
    line = json.dumps({**record, "machine": machine()})
    print(line, flush=True)
    for path in RESULTS:
        with path.open("a") as f:
            f.write(line + "\n")


def _timed(run) -> tuple[Any, float, float]:
    """(result, wall seconds, CPU seconds) of run()."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def _record(result, wall: float, cpu: float) -> dict:
    from experiments.planning.neuroshard import record

    return record(result, wall, cpu)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.mean(values)) if values else None


# -------------------------------------------------------------------------------------------------- neuroshard
def ns_topology(args):
    from recjax.sharding.cost_model import Topology

    return Topology.cpu_host if args.topology == "cpu" else Topology.gpu_cluster


def pretrain_neural(args, topology_for, devices, batch: int, tables: tuple[int, int], exchange: str, name: str):
    """A neural cost model pre-trained on analytic labels for this setting (saved under --out)."""
    from experiments.planning import cost_net, meta_tables

    pool = [t.planner_table() for t in meta_tables.meta_tables(args.seed)]
    _log(f"{name}: pre-training the neural cost model on {args.neural_plans} plans ({exchange} exchange)")
    (data, sample_s, sample_cpu) = _timed(lambda: cost_net.sample_dataset(
        pool, lambda n: topology_for(n, args.ns_memory_gib * (1 << 30)), batch, args.neural_plans, seed=args.seed,
        devices=devices, tables=tables, exchange=exchange))
    (trained, train_s, train_cpu) = _timed(lambda: cost_net.train(data, steps=args.neural_steps, seed=args.seed))
    model, report = trained
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cost_model_{name}.msgpack"
    model.save(path)
    emit({"section": name, "what": "neural_pretraining", "labels": "analytic", "exchange": exchange,
          "plans": args.neural_plans, "steps": args.neural_steps, "device_samples": len(data.compute),
          "sample_s": sample_s, "sample_cpu_s": sample_cpu, "train_s": train_s, "train_cpu_s": train_cpu,
          "saved": str(path), "held_out": report})
    return model


def section_neuroshard(args) -> None:
    from experiments.planning import meta_tables
    from experiments.planning.neuroshard import compare, neuroshard_tasks, summary
    from recjax.sharding import planner as P
    from recjax.sharding.cost_model import AnalyticCostModel, Problem

    pool = meta_tables.meta_tables(args.seed)
    topology_for = ns_topology(args)
    neural = None
    if args.ns_neural and args.ns_neural_model:  # pre-trained by an earlier run of this section
        from experiments.planning.cost_net import NeuralCostModel

        neural = NeuralCostModel.load(args.ns_neural_model, topology_for(4, int(args.ns_memory_gib * (1 << 30))))
    elif args.ns_neural:
        neural = pretrain_neural(args, topology_for, tuple(args.ns_devices), meta_tables.BATCH, (10, 60), "pooled",
                                 f"neuroshard_{args.topology}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_task = (out / "neuroshard_tasks.jsonl").open("w")
    for devices in args.ns_devices:
        tasks = neuroshard_tasks(pool, args.ns_tasks, devices, seed=args.seed, memory_gib=args.ns_memory_gib,
                                 topology=topology_for)
        runs = []
        for k, problem in enumerate(tasks):
            _log(f"neuroshard: {devices} devices, task {k + 1}/{len(tasks)} ({len(problem.tables)} tables)")
            r = {"tables": len(problem.tables), **compare(problem, seed=k, neural=neural)}
            runs.append(r)
            per_task.write(json.dumps({"devices": devices, "task": k, **r}) + "\n")
            per_task.flush()
        emit({"section": "neuroshard", **summary(devices, runs)})
    per_task.close()
    if args.full:  # planning time at scale under the pooled model: every table of the set on 128 devices
        tables = tuple(t.planner_table() for t in pool)
        problem = Problem(tables, topology_for(128, int(args.ns_memory_gib * (1 << 30))), meta_tables.BATCH,
                          exchange="pooled")
        _log("neuroshard: all 856 tables on 128 devices, pooled")
        result, wall, cpu = _timed(lambda: P.plan(problem, AnalyticCostModel(problem.topology, "pooled")))
        emit({"section": "neuroshard_856_on_128", "fits": result.fits, "plan_wall_s": wall, "plan_cpu_s": cpu,
              "step_ms": 1e3 * result.cost.step, "shardings": result.to_json()["shardings"]})


# ------------------------------------------------------------------------------------------------------ tasks
def run_planners(problem, seed: int) -> dict[str, dict]:
    """recjax, its whole-table variant and the baselines on one task (rows exchange, the analytic model)."""
    from experiments.planning import baselines as B
    from recjax.sharding import planner as P

    runs = [("recjax", lambda: P.plan(problem, seed=seed)),
            ("recjax_table", lambda: P.plan(problem, seed=seed, kinds=("table",)))]
    runs += [(name, lambda name=name: B.baseline(problem, name, seed=seed)) for name in B.BASELINES]
    return {name: _record(*_timed(run)) for name, run in runs}


def summarize(name: str, devices: int, tables: int, runs: list[dict[str, dict]]) -> dict:
    from experiments.planning import baselines as B

    planners = list(runs[0])
    record = {"section": "tasks", "name": name, "devices": devices, "tables": tables, "tasks": len(runs),
              "fit_rate": {p: float(np.mean([r[p]["fits"] for r in runs])) for p in planners},
              "plan_wall_s": {p: _mean([r[p]["wall"] for r in runs]) for p in planners},
              "plan_cpu_s": {p: _mean([r[p]["cpu"] for r in runs]) for p in planners},
              "cost_ms": {p: _mean([1e3 * r[p]["cost"] for r in runs if r[p]["fits"]]) for p in planners}}
    ratios = {}
    for other in planners[1:]:
        pairs = [r["recjax"]["cost"] / r[other]["cost"] for r in runs if r["recjax"]["fits"] and r[other]["fits"]]
        ratios[other] = _mean(pairs)
    best = []
    for r in runs:
        fitting = [r[b]["cost"] for b in B.BASELINES if r[b]["fits"]]
        if fitting and r["recjax"]["fits"]:
            best.append(r["recjax"]["cost"] / min(fitting))
    record["cost_ratio_vs"] = ratios
    record["cost_ratio_vs_best_baseline"] = _mean(best)
    record["worst_ratio_vs_recjax_table"] = max((r["recjax"]["cost"] / r["recjax_table"]["cost"] for r in runs
                                                 if r["recjax"]["fits"] and r["recjax_table"]["fits"]), default=None)
    record["exchange_share"] = {p: _mean([r[p]["exchange"] / r[p]["cost"] for r in runs if r[p]["fits"]])
                                for p in planners}
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


def section_meta(args) -> None:
    from experiments.planning import meta_tables

    emit({"section": "meta", **meta_tables.summary(meta_tables.meta_tables(args.seed))})


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
        pool = [t.planner_table() for t in meta_tables.meta_tables(args.seed, rows=(100, 100_000))]
        topology_for = lambda n: Topology.cpu_host(n, 1 << 30)  # noqa: E731
        devices, batch, counts = (n,), args.bench_batch, tuple(args.bench_tables)
    else:
        pool = [t.planner_table() for t in tables]
        topology_for = lambda n: Topology.gpu_cluster(n, 1 << 34)  # noqa: E731
        devices, batch, counts = (4, 8, 16, 32, 64, 128), meta_tables.BATCH, (10, 200)
    _log(f"neural: sampling {args.neural_plans} plans, labels {args.neural_labels}, {args.exchange} exchange")
    data, sample_s, sample_cpu = _timed(lambda: cost_net.sample_dataset(
        pool, topology_for, batch, args.neural_plans, seed=args.seed, devices=devices, tables=counts,
        labels=args.neural_labels, exchange=args.exchange, repeats=args.bench_repeats,
        progress=lambda k: _log(f"neural: plan {k + 1}/{args.neural_plans} labelled")))
    data.save(out / f"samples_{args.neural_labels}_{args.exchange}.npz")  # re-train without measuring again
    _log(f"neural: training on {len(data.compute)} devices / {len(data.exchange)} storages")
    (model, report), train_s, train_cpu = _timed(lambda: cost_net.train(data, steps=args.neural_steps,
                                                                         seed=args.seed))
    path = out / f"cost_model_{args.neural_labels}_{args.exchange}.msgpack"
    model.save(path)
    emit({"section": "neural", "labels": args.neural_labels, "exchange": args.exchange, "plans": args.neural_plans,
          "steps": args.neural_steps, "batch": batch, "device_samples": len(data.compute),
          "storage_samples": len(data.exchange), "sample_s": sample_s, "sample_cpu_s": sample_cpu,
          "train_s": train_s, "train_cpu_s": train_cpu, "saved": str(path), "bytes": path.stat().st_size,
          "held_out": report})
    if args.neural_labels != "analytic":
        return
    for devices_, count in ((8, 50), (32, 100), (128, 200)):
        ratios, times = [], []
        for k in range(args.tasks):
            problem = dataclasses.replace(meta_tables.sample_task(tables, count, devices_, seed=10_000 + k),
                                          exchange=args.exchange)
            analytic = AnalyticCostModel(problem.topology, args.exchange)
            neural = model.for_topology(problem.topology)
            by_neural = P.plan(problem, neural, seed=k, judge=analytic)
            by_analytic = P.plan(problem, analytic, seed=k)
            if by_neural.fits and by_analytic.fits:
                ratios.append(by_neural.cost.step / by_analytic.cost.step)
            times.append(by_neural.seconds)
        emit({"section": "neural_search", "exchange": args.exchange, "devices": devices_, "tables": count,
              "tasks": args.tasks, "cost_ratio_neural_vs_analytic_search": _mean(ratios),
              "plan_wall_s": _mean(times)})


# ------------------------------------------------------------------------------------------------------- rank
def _sharding_benchmark():
    path = pathlib.Path(__file__).with_name("sharding.py")
    spec = importlib.util.spec_from_file_location("sharding_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_plans(infos, devices: int, seed: int, batch: int = 2048) -> list[tuple[str, str, str]]:
    """(name, sharding.plan, sharding.tables) of the plans the rank section measures: the five whole-plan kinds,
    NeuroShard's table-wise heuristics, random table-wise plans and random mixtures of kinds (per-table
    overrides)."""
    from experiments.planning import baselines as B
    from recjax.sharding.cost_model import PlannerTable, Problem, Topology

    problem = Problem(tuple(PlannerTable(i) for i in infos), Topology.cpu_host(devices, 1 << 40), batch)

    def table_wise(devs):
        return ",".join(f"{i.name}=table:{d}" for i, d in zip(infos, devs, strict=True))

    plans = [(p, p, "") for p in ("table", "row", "column", "replicated", "auto")]
    plans += [(h, "table", table_wise(B.greedy_baseline(problem, h)[0])) for h in ("size_greedy", "lookup_greedy")]
    plans += [(f"random_{s}", "table", table_wise(B.random_baseline(problem, seed + s))) for s in range(3)]
    rng = np.random.default_rng(seed)
    for s in range(3):  # a mixture: each table whole on a random device, by rows, by columns or replicated
        kinds = rng.choice(["table", "row", "column", "replicated"], size=len(infos), p=[0.4, 0.2, 0.2, 0.2])
        entries = [f"{i.name}=table:{int(rng.integers(devices))}" if k == "table" else f"{i.name}={k}"
                   for i, k in zip(infos, kinds, strict=True)]
        plans.append((f"mixture_{s}", "table", ",".join(entries)))
    return plans


def section_rank(args) -> None:
    import jax

    from experiments.planning.cost_net import NeuralCostModel, spearman
    from recjax import placement, sharding
    from recjax.sharding import cost_model as C
    from recjax.sharding import planner
    from recjax.step import init_state, make_train_step

    bench = _sharding_benchmark()
    shape = bench.SHAPES[args.rank_shape]
    bargs = argparse.Namespace(vocab_cap=args.vocab_cap, reference_rows=args.reference_rows, mesh=args.mesh,
                               exchange_dtype="float32", capacity_factor=1.0, capacity_sigmas=7.0,
                               row_axes="all", exchange=args.runtime_exchange)  # these two: the pooled runtime's
    config, task, batch = bench.build(shape, bargs, "table")
    host_state = jax.device_get(init_state(task, jax.random.key(0), jax.device_put(batch, jax.devices()[0])))
    infos = sharding.table_infos(task.collection, task.sparse_optimizer)
    n = jax.device_count()
    plans = rank_plans(infos, n, args.seed, shape["batch"])
    neural = None
    if args.neural_model:
        neural = NeuralCostModel.load(args.neural_model, C.Topology.cpu_host(n, 1 << 30))
    runs = {}
    for name, plan, overrides in plans:
        config.sharding.plan, config.sharding.tables = plan, overrides
        sharded = placement.build(config, task)
        state = sharded.place_state(host_state)
        device_batch = sharded.put_batch(batch)
        compiled = make_train_step(task, sharded, state).lower(state, device_batch).compile()
        state, metrics = compiled(state, device_batch)  # warm-up
        jax.block_until_ready(metrics)
        layout = sharded.layout
        topology = C.Topology.cpu_host(layout.mesh.size, layout.plan.device_memory_bytes)
        placements = layout.plan.placements
        predicted = {}
        for exchange in C.EXCHANGES:  # every table pooled (or none), the devices side by side
            problem = C.Problem(tuple(C.PlannerTable(i) for i in infos), topology, int(config.train.batch_size),
                                config.sharding.row_split, exchange)
            predicted[exchange] = C.plan_cost(C.AnalyticCostModel(topology, exchange), problem, placements).step
        # What `sharding.plan=auto` plans with: the runtime's exchange per table, its column layout.
        problem = planner.runtime_problem(infos, layout.plan.mesh_shape, int(config.train.batch_size),
                                          layout.plan.device_memory_bytes, config.sharding.row_split,
                                          config.sharding.exchange)
        runtime_cost = C.plan_cost(C.AnalyticCostModel(problem.topology, problem.exchange), problem, placements)
        predicted["runtime"] = runtime_cost.step
        if neural is not None and neural.exchange_kind == problem.exchange:
            predicted["neural"] = C.plan_cost(neural.for_topology(problem.topology), problem, placements).step
        runs[name] = {"state": state, "step": compiled, "batch": device_batch, "times": [], "predicted": predicted,
                      "runtime_cost": runtime_cost.to_json(),
                      "shardings": {k: sum(p.sharding == k for p in sharded.layout.plan.placements)
                                    for k in sorted({p.sharding for p in sharded.layout.plan.placements})}}
        _log(f"rank: {name} compiled, predicted {json.dumps({k: round(1e3 * v, 3) for k, v in predicted.items()})}")
    names = [p[0] for p in plans]
    for _ in range(args.repeats):  # round robin: a burst of load on the shared machine hits every plan alike
        for name in names:
            r = runs[name]
            t0 = time.perf_counter()
            r["state"], metrics = r["step"](r["state"], r["batch"])
            jax.block_until_ready(metrics)
            r["times"].append(time.perf_counter() - t0)
    measured = [1e3 * statistics.median(runs[p]["times"]) for p in names]
    models = list(runs[names[0]]["predicted"])
    predicted = {m: [1e3 * runs[p]["predicted"][m] for p in names] for m in models}
    emit({"section": "rank", "shape": args.rank_shape, "vocab_cap": args.vocab_cap,
          "reference_rows": args.reference_rows, "mesh": args.mesh,
          "runtime_exchange": config.sharding.get("exchange", "rows"),  # "rows": a runtime before the pooled one
          "repeats": args.repeats, "plans": names, "measured_step_ms": measured,
          "predicted_ms": predicted, "spearman": {m: spearman(predicted[m], measured) for m in models},
          "shardings": {p: runs[p]["shardings"] for p in names},
          "runtime_costs": {p: runs[p]["runtime_cost"] for p in names}})


# ---------------------------------------------------------------------------------------------------- measure
def section_measure(args) -> None:
    import jax
    import jax.numpy as jnp

    def timed(fn, *a, repeats=args.repeats):
        jax.block_until_ready(fn(*a))
        times = []
        for _ in range(repeats):
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
    tiny = jnp.asarray(rng.integers(0, rows, 8).astype(np.int32))
    def dedup(i):  # the owner's dedup before an update: sort, then mark the first of each run
        s = jnp.sort(i)
        return jnp.concatenate([jnp.ones(1, bool), s[1:] != s[:-1]]).sum()

    few = idx[: 1 << 16]  # a step's ids on one device
    record = {"section": "measure", "gather_bytes_per_s": ids * row_bytes / timed(gather, table, idx),
              "gather_cached_bytes_per_s": ids * row_bytes / timed(gather, table, hot),
              "scatter_add_bytes_per_s": 2 * ids * row_bytes / timed(scatter, table, idx),
              "kernel_overhead_s": timed(gather, table, tiny, repeats=10 * args.repeats),
              "dedup_s_per_id": timed(jax.jit(dedup), few) / len(few)}  # Topology.id_seconds
    for width in (2, 16):  # a random row costs its cache lines: 2 floats about as much as 16 (access_bytes), from
        # tables of the same bytes (a column-wise slice holds 8x the rows of a table-wise part of as many bytes)
        shaped = table.reshape(-1, width)[: rows * dim // width]
        wide = jnp.asarray(rng.integers(0, shaped.shape[0], ids).astype(np.int32))
        record[f"gather_rows_per_s_width_{width}"] = ids / timed(gather, shaped, wide)
    n = jax.device_count()
    if n > 1:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as Pspec

        mesh = jax.make_mesh((n,), ("d",))
        a2a = jax.jit(jax.shard_map(lambda x: jax.lax.all_to_all(x[0], "d", 0, 0)[None], mesh=mesh,
                                    in_specs=Pspec("d"), out_specs=Pspec("d")))
        slots = 1 << 14
        buf = jax.device_put(jnp.ones((n, n, slots, dim), jnp.float32), NamedSharding(mesh, Pspec("d")))
        small = jax.device_put(jnp.ones((n, n, 1), jnp.float32), NamedSharding(mesh, Pspec("d")))
        per_device = (n - 1) * slots * row_bytes  # sent to the other devices by each
        record.update({"devices": n, "all_to_all_bytes_per_device_per_s": per_device / timed(a2a, buf),
                       "collective_latency_s": timed(a2a, small, repeats=10 * args.repeats)})
    emit(record)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="neuroshard,tasks,neural,rank",
                        help=f"comma-separated, from {SECTIONS}")
    parser.add_argument("--ns_tasks", type=int, default=100, help="neuroshard: tasks per device count")
    parser.add_argument("--ns_devices", default="4,8", help="neuroshard: device counts")
    parser.add_argument("--ns_memory_gib", type=float, default=4.0, help="neuroshard: memory per device")
    parser.add_argument("--topology", default="gpu", choices=("gpu", "cpu"),
                        help="neuroshard: A100-like GPUs (spec sheets) or this host's CPU devices")
    parser.add_argument("--no_ns_neural", dest="ns_neural", action="store_false",
                        help="neuroshard: skip the planner with the neural cost model (and its pre-training)")
    parser.add_argument("--ns_neural_model", default="",
                        help="neuroshard: the neural cost model an earlier run saved (cost_model_neuroshard_*.msgpack)"
                             " instead of pre-training one")
    parser.add_argument("--devices", default="4,8,32,128", help="tasks: device counts")
    parser.add_argument("--tables", default="10,50,100,200", help="tasks: table counts")
    parser.add_argument("--tasks", type=int, default=3, help="tasks / neural: tasks per setting")
    parser.add_argument("--no_full", dest="full", action="store_false",
                        help="tasks / neuroshard: skip 856 tables on 128 devices")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exchange", default="pooled", choices=("rows", "pooled"), help="neural: the exchange")
    parser.add_argument("--neural_plans", type=int, default=800)
    parser.add_argument("--neural_steps", type=int, default=2000)
    parser.add_argument("--neural_labels", default="analytic", choices=("analytic", "benchmark"))
    parser.add_argument("--bench_batch", type=int, default=1024, help="neural, benchmark labels: the batch")
    parser.add_argument("--bench_tables", default="4,16",
                        help="neural, benchmark labels: tables per sampled plan, lo,hi (the rank task's 26 inside)")
    parser.add_argument("--bench_repeats", type=int, default=3, help="neural, benchmark labels: timed repeats")
    parser.add_argument("--neural_model", default="", help="rank: a neural cost model pre-trained for this host")
    parser.add_argument("--out", default="/tmp/recjax_planner",
                        help="where models, per-task records and results.jsonl (every line printed) go")
    parser.add_argument("--cpu_devices", type=int, default=8, help="rank / measure / benchmark labels: CPU devices")
    parser.add_argument("--mesh", default="data=4,model=2", help="rank: config.mesh.shape")
    parser.add_argument("--runtime_exchange", default="pooled", choices=("auto", "pooled", "rows"),
                        help="rank: config.sharding.exchange of a runtime that has it (before it: rows)")
    parser.add_argument("--rank_shape", default="kaggle_b2048", choices=("kaggle_b2048", "reference_random"),
                        help="rank: benchmarks/sharding.py's shape (one-hot Kaggle tables, or 8 tables of bags of 100)")
    parser.add_argument("--vocab_cap", type=int, default=100_000, help="rank: Kaggle rows per table at most")
    parser.add_argument("--reference_rows", type=int, default=100_000, help="rank: reference_random's rows per table")
    parser.add_argument("--repeats", type=int, default=5, help="rank / measure: timed repeats (medians)")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    args.devices = [int(x) for x in args.devices.split(",")]
    args.tables = [int(x) for x in args.tables.split(",")]
    args.ns_devices = [int(x) for x in args.ns_devices.split(",")]
    args.bench_tables = [int(x) for x in args.bench_tables.split(",")]
    if len(args.bench_tables) != 2 or not 1 <= args.bench_tables[0] <= args.bench_tables[1]:
        parser.error(f"--bench_tables takes lo,hi with 1 <= lo <= hi, got {args.bench_tables}")
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    RESULTS.append(pathlib.Path(args.out) / "results.jsonl")
    import jax

    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    for name in sections:
        globals()[f"section_{name}"](args)


if __name__ == "__main__":
    from recjax import cli

    with cli.user_errors():
        main()
