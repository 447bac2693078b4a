"""The trainer: state, the jitted train/predict steps, evaluation, and the run loop that writes the workdir.

Task pieces (what is trained) are built by `build_task`; `train_and_evaluate` owns the loop, logging and
outputs. A train step is `(state, batch) -> (state, metrics)` with the state donated, so the embedding tables
are updated in place:

    routes = collection.route(ids, lengths)                 # int math + one dedup per stacked group
    rows   = collection.gather(tables, routes)              # each distinct row once
    loss, (g_dense, g_rows) = value_and_grad(loss_fn, (0, 1))(dense_params, rows)
    dense_params, dense_opt = optax update
    tables, sparse_opt = collection.sparse_update(...)      # only the touched rows
"""

import csv
import dataclasses
import json
import pathlib
import resource
import time
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm
from tensorboardX import SummaryWriter

from compression import TableSpec
from compression.plan import load_id_counts, plan_tables
from recjax import metrics
from recjax.batch import Batch, pad_batch, validate_batch
from recjax.data import make_dataset
from recjax.data.pipeline import DevicePrefetcher
from recjax.embedding import EmbeddingCollection, EmbeddingGlue
from recjax.models import make_model
from recjax.sparse_optim import SparseOptimizer, make_sparse_optimizer
from recjax.specs import DatasetSpec


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # i32[], optimizer steps taken
    dense_params: Any  # {"model": ..., "glue": ...}
    dense_opt_state: Any
    tables: dict[str, jax.Array]  # stacked physical tables, {group: f32[rows, dim]}
    sparse_opt_state: dict[str, dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Task:
    """Everything static a step needs: the embedding collection, the model and both optimizers."""

    spec: DatasetSpec
    collection: EmbeddingCollection
    glue: nn.Module
    model: nn.Module
    dense_tx: optax.GradientTransformation
    sparse_optimizer: SparseOptimizer
    sparse_lr: optax.Schedule


# ------------------------------------------------------------------------------------------ building
def table_specs(spec: DatasetSpec, config: ml_collections.ConfigDict, dataset=None) -> list[TableSpec]:
    """One logical table per sparse feature, planned from `config.embedding` by `compression.plan.plan_tables`
    (default method and options, per-table overrides in `tables`, size thresholds, mixed dims).

    `config.embedding.id_counts` feeds per-id counts to md_blocks tables: "dataset" asks `dataset` for its
    expected counts over the run (`train.steps * train.batch_size` examples); any other non-empty value is the
    path of an .npz with one array per feature.
    """
    embedding = config.embedding
    source = embedding.get("id_counts", "")
    counts = None
    if source == "dataset":
        if dataset is None or not hasattr(dataset, "id_counts"):
            raise ValueError(f"config.embedding.id_counts='dataset', but dataset '{config.data.name}' has no "
                             "expected id counts; pass an .npz of per-feature counts instead")
        counts = dataset.id_counts(int(config.train.steps) * int(config.train.batch_size))
    elif source:
        counts = load_id_counts(source)
    return plan_tables([f.name for f in spec.features], [f.vocab_size for f in spec.features], embedding.dim,
                       embedding, id_counts=counts)


def schedule(base_lr: float, config: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then constant (or cosine to 0 over `train.steps`)."""
    warmup = int(config.optimizer.warmup_steps)
    if config.optimizer.decay == "none":
        if warmup == 0:
            return optax.constant_schedule(base_lr)
        return optax.linear_schedule(0.0, base_lr, warmup)
    if config.optimizer.decay == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, base_lr, max(warmup, 1), int(config.train.steps))
    raise ValueError(f"unknown optimizer.decay '{config.optimizer.decay}'; use 'none' or 'cosine'")


def make_dense_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    dense = config.optimizer.dense
    lr = schedule(dense.learning_rate, config)
    if dense.name == "sgd":
        return optax.sgd(lr)
    if dense.name == "adam":
        return optax.adam(lr)
    if dense.name == "adagrad":
        return optax.adagrad(lr, initial_accumulator_value=0.0, eps=1e-8)
    raise ValueError(f"unknown dense optimizer '{dense.name}'; use 'sgd', 'adam' or 'adagrad'")


def build_task(config: ml_collections.ConfigDict, spec: DatasetSpec, dataset=None) -> Task:
    """`dataset` is only consulted for per-id counts (config.embedding.id_counts = "dataset")."""
    collection = EmbeddingCollection(spec, table_specs(spec, config, dataset), config.embedding.pooling)
    sparse_config = config.optimizer.sparse
    return Task(
        spec=spec,
        collection=collection,
        glue=EmbeddingGlue(collection),
        model=make_model(config.model),
        dense_tx=make_dense_optimizer(config),
        sparse_optimizer=make_sparse_optimizer(sparse_config),
        sparse_lr=schedule(sparse_config.learning_rate, config),
    )


def init_state(task: Task, rng: jax.Array, batch: Batch) -> TrainState:
    """Tables (DLRM init), dense params (from one example batch's shapes) and both optimizer states."""
    table_rng, glue_rng, model_rng = jax.random.split(rng, 3)
    tables = task.collection.init_tables(table_rng)

    def init_dense(tables, batch):
        routes = task.collection.route(batch.ids, batch.lengths)
        rows = task.collection.gather(tables, routes)
        glue_vars = task.glue.init(glue_rng, rows, routes["features"])
        emb = task.glue.apply(glue_vars, rows, routes["features"])
        model_vars = task.model.init(model_rng, batch.dense, emb)
        return {"glue": glue_vars.get("params", {}), "model": model_vars["params"]}

    dense_params = jax.jit(init_dense)(tables, batch)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        dense_params=dense_params,
        dense_opt_state=task.dense_tx.init(dense_params),
        tables=tables,
        sparse_opt_state=task.collection.init_optimizer(task.sparse_optimizer),
    )


# --------------------------------------------------------------------------------------------- steps
def _forward(task: Task, dense_params, rows, routes, dense: jax.Array) -> jax.Array:
    """Logits f32[B] from the distinct gathered rows and dense features."""
    emb = task.glue.apply({"params": dense_params["glue"]}, rows, routes["features"])
    return task.model.apply({"params": dense_params["model"]}, dense, emb)


def make_train_step(task: Task):
    """jit((state, batch) -> (state, {"loss"})) with the state donated."""

    def train_step(state: TrainState, batch: Batch):
        routes = task.collection.route(batch.ids, batch.lengths)
        rows = task.collection.gather(state.tables, routes)

        def loss_fn(dense_params, rows):
            logits = _forward(task, dense_params, rows, routes, batch.dense)
            return optax.sigmoid_binary_cross_entropy(logits, batch.labels).mean()

        loss, (g_dense, g_rows) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state.dense_params, rows)
        updates, dense_opt_state = task.dense_tx.update(g_dense, state.dense_opt_state, state.dense_params)
        dense_params = optax.apply_updates(state.dense_params, updates)
        step = state.step + 1
        tables, sparse_opt_state = task.collection.sparse_update(
            task.sparse_optimizer, state.tables, state.sparse_opt_state, routes, rows, g_rows,
            task.sparse_lr(state.step), step)
        new_state = TrainState(step=step, dense_params=dense_params, dense_opt_state=dense_opt_state,
                               tables=tables, sparse_opt_state=sparse_opt_state)
        return new_state, {"loss": loss}

    return jax.jit(train_step, donate_argnums=(0,))


def make_predict_step(task: Task):
    """jit((state, batch) -> probabilities f32[B])."""

    def predict_step(state: TrainState, batch: Batch):
        routes = task.collection.route(batch.ids, batch.lengths)
        rows = task.collection.gather(state.tables, routes)
        return jax.nn.sigmoid(_forward(task, state.dense_params, rows, routes, batch.dense))

    return jax.jit(predict_step)


def flops_per_example(compiled, batch_size: int) -> float:
    """FLOPs/example from XLA's cost analysis of a compiled step."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax returns one dict per device
        cost = cost[0]
    return float(cost.get("flops", float("nan"))) / batch_size


def evaluate(task: Task, predict_step, state: TrainState, dataset, batch_size: int) -> dict[str, float]:
    """Exact metrics over the whole eval split (short last batch padded, padding dropped)."""
    labels, probs = [], []
    for i, batch in enumerate(dataset.eval_batches(batch_size)):
        validate_batch(batch, task.spec, any_id=task.collection.any_id_features, where=f"eval batch {i}")
        n = batch.size
        p = predict_step(state, jax.device_put(pad_batch(batch, batch_size)))
        probs.append(np.asarray(p)[:n])
        labels.append(batch.labels)
    labels, probs = np.concatenate(labels), np.concatenate(probs)
    if not np.all(np.isfinite(probs)):
        raise FloatingPointError("model produced non-finite predictions; lower the learning rates")
    return metrics.binary_metrics(labels, probs)


def dense_param_count(params) -> int:
    return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params)))


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------------- loop
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
    """Train per `config`, evaluate periodically, write the workdir outputs and return the summary."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")

    # --- data and task ----------------------------------------------------------------------------
    dataset = make_dataset(config.data, seed=config.seed)
    task = build_task(config, dataset.spec, dataset)
    validate = lambda b, where: validate_batch(b, task.spec, any_id=task.collection.any_id_features,
                                               where=where)
    with DevicePrefetcher(dataset.train_batches(int(config.train.batch_size)), validate) as batches:
        return _train_loop(config, workdir, dataset, task, batches)


def _train_loop(config: ml_collections.ConfigDict, workdir: pathlib.Path, dataset, task: Task,
                batches: DevicePrefetcher) -> dict:
    train_cfg = config.train
    batch_size = int(train_cfg.batch_size)

    # --- state, steps, cost analysis --------------------------------------------------------------
    first = next(batches)
    state = init_state(task, jax.random.key(config.seed), first)
    # Compile once, up front: the loop calls the executables, so no step pays for compilation and the
    # compile time and XLA's cost analysis come from exactly what runs.
    t0 = time.perf_counter()
    eval_example = jax.device_put(pad_batch(next(dataset.eval_batches(batch_size)), batch_size))
    predict_step = make_predict_step(task).lower(state, eval_example).compile()
    train_step = make_train_step(task).lower(state, first).compile()
    compile_time = time.perf_counter() - t0
    forward_flops = flops_per_example(predict_step, batch_size)
    train_flops = flops_per_example(train_step, batch_size)

    accounting = task.collection.accounting(task.sparse_optimizer)
    dense_params = dense_param_count(state.dense_params)
    print(f"workdir: {workdir}\nembedding tables: {accounting['params']:,} params ({accounting['bytes'] / 2**20:.1f} "
          f"MiB) + optimizer {accounting['optimizer_bytes'] / 2**20:.1f} MiB; dense params: {dense_params:,}; "
          f"{forward_flops:,.0f} FLOPs/example")

    # --- loop -----------------------------------------------------------------------------------
    writer = SummaryWriter(str(workdir))
    csv_path = workdir / "metrics.csv"
    csv_fields = ["step", "split", "examples", "loss", "auc", "logloss", "ne", "accuracy", "examples_per_sec",
                  "elapsed_s"]
    with csv_path.open("w", newline="") as f:
        csv.writer(f).writerow(csv_fields)

    def log_row(row: dict):
        with csv_path.open("a", newline="") as f:
            csv.DictWriter(f, csv_fields).writerow(row)
        for k, v in row.items():
            if k not in ("step", "split", "examples") and v is not None and np.isfinite(v):
                writer.add_scalar(f"{row['split']}/{k}", v, row["step"])

    steps = int(train_cfg.steps)
    train_time, run_start = 0.0, time.perf_counter()
    eval_metrics: dict[str, float] = {}
    loss_sum, loss_count, loss = 0.0, 0, float("nan")
    bar = tqdm.tqdm(total=steps * batch_size, unit="ex", unit_scale=True, disable=not train_cfg.progress_bar,
                    mininterval=1.0, dynamic_ncols=True)
    batch = first
    window_start, window_examples = time.perf_counter(), 0
    for step in range(1, steps + 1):
        state, step_metrics = train_step(state, batch)
        window_examples += batch_size
        last = step == steps
        if step % train_cfg.log_every == 0 or last or step % train_cfg.eval_every == 0:
            loss = float(step_metrics["loss"])  # blocks: the window's time is real work
            if not np.isfinite(loss):
                raise FloatingPointError(f"training loss is {loss} at step {step}; lower the learning rates")
            elapsed = time.perf_counter() - window_start
            train_time += elapsed
            loss_sum, loss_count = loss_sum + loss, loss_count + 1
            eps = window_examples / elapsed
            log_row({"step": step, "split": "train", "examples": step * batch_size, "loss": loss,
                     "examples_per_sec": eps, "elapsed_s": time.perf_counter() - run_start})
            bar.set_postfix(loss=f"{loss:.4f}", auc=f"{eval_metrics.get('auc', float('nan')):.4f}")
            if step % train_cfg.eval_every == 0 or last:
                eval_metrics = evaluate(task, predict_step, state, dataset, batch_size)
                log_row({"step": step, "split": "eval", "examples": step * batch_size,
                         **{k: eval_metrics[k] for k in ("auc", "logloss", "ne", "accuracy")},
                         "elapsed_s": time.perf_counter() - run_start})
                bar.set_postfix(loss=f"{loss:.4f}", auc=f"{eval_metrics['auc']:.4f}")
            window_start, window_examples = time.perf_counter(), 0
        bar.update(batch_size)
        if not last:
            batch = next(batches)
    bar.close()
    writer.close()

    # --- summary --------------------------------------------------------------------------------
    summary = {
        **{k: eval_metrics[k] for k in ("auc", "logloss", "ne", "accuracy", "eval_examples", "eval_ctr")},
        **dataset.info(),
        "params": dense_params + accounting["params"],
        "dense_params": dense_params,
        "embedding_params": accounting["params"],
        "embedding_bytes": accounting["bytes"],
        "embedding_optimizer_bytes": accounting["optimizer_bytes"],
        "compression_ratio": accounting["full_bytes"] / accounting["bytes"],
        "flops_per_example": forward_flops,
        "train_flops_per_example": train_flops,
        "examples_per_sec": steps * batch_size / train_time,
        "compile_time_s": compile_time,
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - run_start,
        "peak_rss_bytes": peak_rss_bytes(),
        "steps": steps,
        "batch_size": batch_size,
        "final_train_loss": loss,
        "tables": accounting["tables"],
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
