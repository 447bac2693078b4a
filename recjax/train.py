"""The trainer: state, the jitted train/predict steps, evaluation, and the run loop that writes the workdir.

Task pieces (what is trained) are built by `build_task`; `train_and_evaluate` owns the loop, logging and
outputs. A train step is `(state, batch) -> (state, metrics)` with the state donated, so the embedding tables
are updated in place:

    routes = collection.route(ids, lengths)                 # int math + one dedup per stacked group
    rows   = collection.gather(tables, routes)              # each distinct row once
    loss, (g_dense, g_rows) = value_and_grad(loss_fn, (0, 1))(dense_params, rows)
    dense_params, dense_opt = optax update
    tables, sparse_opt = collection.sparse_update(...)      # only the touched rows

Model selection is honest: the budget is `train.steps` or `train.epochs`; every `train.eval_every` steps (or
epoch) the model is scored on the validation split, and the test split is scored only at steps that improve the
validation metric (`train.select_on`), so test numbers never steer anything. The summary reports the test metrics
of the best validation step; `train.early_stopping_patience` stops a run after that many evaluations without
improvement.
"""

import collections
import csv
import dataclasses
import json
import math
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
from recjax import metrics, sharding
from recjax.batch import Batch, pad_batch, validate_batch
from recjax.checkpoint import Checkpointer, ResumePoint, mark_dirty_rows
from recjax.config_check import config_errors, eval_interval, validate_config
from recjax.data import make_dataset
from recjax.data.pipeline import DevicePrefetcher
from recjax.dynamic import DynamicTables
from recjax.embedding import EmbeddingCollection, EmbeddingGlue, resolve_dedup
from recjax.errors import ConfigError
from recjax.models import embedding_dim, make_model
from recjax.sparse_optim import SparseOptimizer, make_sparse_optimizer
from recjax.specs import DatasetSpec

METRICS = ("auc", "logloss", "ne", "accuracy")
# A mesh run waits for the step dispatched this many steps ago (measured on 8 CPU devices, 1M-row tables: unbounded,
# 400 queued steps deadlocked XLA:CPU's collectives; 64 once; 2-16 never in 3 x 1500 steps, at the same speed).
MESH_STEPS_IN_FLIGHT = 4


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # i32[], optimizer steps taken
    dense_params: Any  # {"model": ..., "glue": ...}
    dense_opt_state: Any
    tables: dict[str, jax.Array]  # stacked physical tables, {group: f32[rows, dim]}
    sparse_opt_state: dict[str, dict[str, jax.Array]]
    dropout_rng: jax.Array  # folded with the step for each step's dropout masks
    # Incremental checkpoints: bool[rows] per stacked group, set at the rows each step touches ({} = not tracked).
    dirty_rows: dict[str, jax.Array] = flax.struct.field(default_factory=dict)
    # Routing arrays of dynamic methods, {feature: {name: array}} (FIITED's indirection and utility; {} if none).
    aux: dict[str, dict[str, jax.Array]] = flax.struct.field(default_factory=dict)


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


# ------------------------------------------------------------------------------------------- budget
@dataclasses.dataclass(frozen=True)
class Budget:
    """How long to train and when to evaluate, in steps of `batch_size` examples.

    With `train.epochs`, steps = ceil(epochs * examples_per_epoch / batch_size); epochs follow each other without a
    gap in the train stream, so the budget is exact. An interval of `every_epochs` evaluates after each step that
    crosses a multiple of that many epochs' examples. The last step is always evaluated.
    """

    steps: int
    batch_size: int
    examples_per_epoch: int | None  # None: an endless stream (synthetic data)
    every_steps: int | None = None
    every_epochs: float | None = None

    def is_eval_step(self, step: int) -> bool:
        if step == self.steps:
            return True
        if self.every_steps is not None:
            return step % self.every_steps == 0
        period = self.every_epochs * self.examples_per_epoch
        return math.floor(step * self.batch_size / period) > math.floor((step - 1) * self.batch_size / period)

    def describe(self) -> str:
        examples = self.steps * self.batch_size
        if self.examples_per_epoch:
            text = (f"{self.examples_per_epoch:,} train examples/epoch; {self.steps:,} steps of {self.batch_size} = "
                    f"{examples / self.examples_per_epoch:.3g} epochs")
        else:
            text = f"{self.steps:,} steps of {self.batch_size} = {examples:,} examples"
        if self.every_steps is not None:
            every = f"every {self.every_steps:,} steps"
        else:
            every = "every epoch" if self.every_epochs == 1 else f"every {self.every_epochs:g} epochs"
        return f"{text}; validation {every} and at the end"


def resolve_budget(train: ml_collections.ConfigDict, dataset) -> Budget:
    """The run's Budget from `config.train` and the dataset's train size."""
    batch_size = int(train.batch_size)
    n = dataset.num_examples("train")
    if n == 0:
        raise ConfigError("data", "the train split is empty")
    unit, every = eval_interval(train.eval_every)
    if n is None and (train.epochs is not None or unit == "epochs"):
        raise ConfigError("train.epochs", "this dataset is an endless stream without epochs; set train.steps and an "
                                          "eval_every in steps")
    steps = int(train.steps) if train.steps is not None else math.ceil(float(train.epochs) * n / batch_size)
    if unit == "steps":
        return Budget(steps, batch_size, n, every_steps=int(every))
    return Budget(steps, batch_size, n, every_epochs=every)


# ------------------------------------------------------------------------------------------ building
def table_specs(spec: DatasetSpec, config: ml_collections.ConfigDict, dataset=None,
                train_examples: int | None = None) -> list[TableSpec]:
    """One logical table per sparse feature, planned from `config.embedding` by `compression.plan.plan_tables`
    (default method and options, per-table overrides in `tables`, size thresholds, mixed dims).

    `config.embedding.id_counts` feeds per-id counts to md_blocks tables: "dataset" asks `dataset` for its
    expected counts over the run's `train_examples`; any other non-empty value is the path of an .npz with one
    array per feature.
    """
    embedding = config.embedding
    source = embedding.get("id_counts", "")
    counts = None
    if source == "dataset":
        if dataset is None or not hasattr(dataset, "id_counts"):
            raise ConfigError("embedding.id_counts", f"'dataset', but dataset '{config.data.name}' has no expected id "
                                                     "counts; pass an .npz of per-feature counts instead")
        counts = dataset.id_counts(train_examples)
    elif source:
        counts = load_id_counts(source)
    return plan_tables([f.name for f in spec.features], [f.vocab_size for f in spec.features], embedding_dim(config),
                       embedding, id_counts=counts)


def schedule(base_lr: float, config: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then constant (or cosine to 0 at `total_steps`)."""
    warmup = int(config.optimizer.warmup_steps)
    if config.optimizer.decay == "none":
        if warmup == 0:
            return optax.constant_schedule(base_lr)
        return optax.linear_schedule(0.0, base_lr, warmup)
    if config.optimizer.decay == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, base_lr, max(warmup, 1), total_steps)
    raise ConfigError("optimizer.decay", f"unknown decay '{config.optimizer.decay}'; use 'none' or 'cosine'")


def _is_weight_matrix(params):
    """Decay mask: kernels and other >= 2-d weights decay; biases and LayerNorm scales (1-d) do not."""
    return jax.tree_util.tree_map(lambda x: jnp.ndim(x) >= 2, params)


def make_dense_optimizer(config: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
    """The dense optimizer, with decoupled weight decay (Loshchilov & Hutter 2019: AdamW; for SGD it equals L2)
    scaled by the learning rate schedule like optax.adamw."""
    dense = config.optimizer.dense
    scale_by = {"sgd": optax.identity, "adam": optax.scale_by_adam,
                "adagrad": lambda: optax.scale_by_rss(initial_accumulator_value=0.0, eps=1e-8)}
    if dense.name not in scale_by:
        raise ConfigError("optimizer.dense.name", f"unknown dense optimizer '{dense.name}'; use one of "
                                                  f"{sorted(scale_by)}")
    parts = [scale_by[dense.name]()]
    if dense.get("weight_decay", 0.0):
        parts.append(optax.add_decayed_weights(float(dense.weight_decay), mask=_is_weight_matrix))
    parts.append(optax.scale_by_learning_rate(schedule(dense.learning_rate, config, total_steps)))
    return optax.chain(*parts)


def build_task(config: ml_collections.ConfigDict, spec: DatasetSpec, dataset=None, total_steps: int = 1) -> Task:
    """`dataset` is only consulted for per-id counts (config.embedding.id_counts = "dataset"); `total_steps` sets
    the cosine decay's end and the examples those counts cover."""
    with config_errors("optimizer.sparse"):
        sparse_optimizer = make_sparse_optimizer(config.optimizer.sparse)
    with config_errors("embedding"):
        examples = total_steps * int(config.train.batch_size)
        embedding = config.embedding
        kernel = embedding.get("kernel", "auto")
        collection = EmbeddingCollection(spec, table_specs(spec, config, dataset, examples), embedding.pooling,
                                         embedding.get("bounds_check", "zero"), kernel,
                                         resolve_dedup(embedding.get("dedup", "auto"), kernel, sparse_optimizer,
                                                       multi_hot=any(f.bag_size > 1 for f in spec.features)),
                                         embedding.get("pool_from", "auto"))
    with config_errors("model"):
        model = make_model(config.model, embedding_dim(config))
    return Task(
        spec=spec,
        collection=collection,
        glue=EmbeddingGlue(collection),
        model=model,
        dense_tx=make_dense_optimizer(config, total_steps),
        sparse_optimizer=sparse_optimizer,
        sparse_lr=schedule(config.optimizer.sparse.learning_rate, config, total_steps),
    )


def init_state(task: Task, rng: jax.Array, batch: Batch) -> TrainState:
    """Tables (DLRM init), dense params (from one example batch's shapes) and both optimizer states."""
    table_rng, glue_rng, model_rng, dropout_rng = jax.random.split(rng, 4)
    tables = task.collection.init_tables(table_rng)
    aux = task.collection.init_aux()

    def init_dense(tables, batch):
        routes = task.collection.route(batch.ids, batch.lengths, aux=aux)
        rows = task.collection.gather(tables, routes)
        glue_vars = task.glue.init(glue_rng, rows, routes["features"])
        emb = task.glue.apply(glue_vars, rows, routes["features"])
        model_vars = task.model.init(model_rng, batch.dense, emb)
        return {"glue": glue_vars.get("params", {}), "model": model_vars["params"]}

    with config_errors("model"):
        dense_params = jax.jit(init_dense)(tables, batch)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        dense_params=dense_params,
        dense_opt_state=task.dense_tx.init(dense_params),
        tables=tables,
        sparse_opt_state=task.collection.init_optimizer(task.sparse_optimizer),
        dropout_rng=dropout_rng,
        aux=aux,
    )


# --------------------------------------------------------------------------------------------- steps
def _forward(task: Task, dense_params, rows, routes, dense: jax.Array, dropout_rng: jax.Array | None = None,
             emb_probe: jax.Array | None = None) -> jax.Array:
    """Logits f32[B] from what `collection.gather` returned and the dense features; dropout only with a
    `dropout_rng`. `emb_probe` (zeros f32[B, F, D]) is added to the embeddings so its gradient is theirs."""
    emb = task.glue.apply({"params": dense_params["glue"]}, rows, routes["features"])
    if emb_probe is not None:
        emb = emb + emb_probe
    if dropout_rng is None:
        return task.model.apply({"params": dense_params["model"]}, dense, emb)
    return task.model.apply({"params": dense_params["model"]}, dense, emb, train=True, rngs={"dropout": dropout_rng})


def make_train_step(task: Task):
    """jit((state, batch) -> (state, {"loss"})) with the state donated."""

    collection = task.collection
    probe = collection.wants_embedding_grads  # FIITED's chunk utility reads d loss / d embeddings

    def train_step(state: TrainState, batch: Batch):
        routes = collection.route(batch.ids, batch.lengths, aux=state.aux)
        rows = collection.gather(state.tables, routes)
        dropout_rng = jax.random.fold_in(state.dropout_rng, state.step)

        def loss_fn(dense_params, rows, emb_probe):
            logits = _forward(task, dense_params, rows, routes, batch.dense, dropout_rng, emb_probe)
            return optax.sigmoid_binary_cross_entropy(logits, batch.labels).mean()

        emb_probe = None
        if probe:
            emb_probe = jnp.zeros((batch.size, len(task.spec.features), collection.dim), jnp.float32)
        loss, (g_dense, g_rows, g_emb) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
            state.dense_params, rows, emb_probe)
        updates, dense_opt_state = task.dense_tx.update(g_dense, state.dense_opt_state, state.dense_params)
        dense_params = optax.apply_updates(state.dense_params, updates)
        step = state.step + 1
        tables, sparse_opt_state = task.collection.sparse_update(
            task.sparse_optimizer, state.tables, state.sparse_opt_state, routes, rows, g_rows,
            task.sparse_lr(state.step), step)
        new_state = TrainState(step=step, dense_params=dense_params, dense_opt_state=dense_opt_state,
                               tables=tables, sparse_opt_state=sparse_opt_state, dropout_rng=state.dropout_rng,
                               dirty_rows=mark_dirty_rows(state.dirty_rows, collection.touched_rows(routes)),
                               aux=collection.update_aux(state.aux, batch.ids, routes, g_emb, step))
        invalid = sum(routes["invalid_ids"].values(), jnp.zeros((), jnp.int32))
        return new_state, {"loss": loss, "invalid_ids": invalid}

    return jax.jit(train_step, donate_argnums=(0,))


def make_predict_step(task: Task):
    """jit((state, batch) -> probabilities f32[B])."""

    def predict_step(state: TrainState, batch: Batch):
        # Forward only: no update needs distinct rows, so the bags are pooled straight from the tables.
        routes = task.collection.route(batch.ids, batch.lengths, aux=state.aux, dedup=False)
        rows = task.collection.gather(state.tables, routes)
        return jax.nn.sigmoid(_forward(task, state.dense_params, rows, routes, batch.dense))

    return jax.jit(predict_step)


def _describe_layout(layout: dict | None) -> str:
    if layout is None:
        return "one device"
    return "mesh " + ",".join(f"{axis}={size}" for axis, size in layout["mesh_shape"].items())


def flops_per_example(compiled, batch_size: int) -> float:
    """FLOPs/example from XLA's cost analysis of a compiled step."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax returns one dict per device
        cost = cost[0]
    return float(cost.get("flops", float("nan"))) / batch_size


def evaluate(task: Task, predict_step, state: TrainState, dataset, batch_size: int, split: str,
             put=jax.device_put, rows: slice | None = None) -> dict[str, float]:
    """Exact metrics over the whole `split` (short last batch padded, padding dropped); `put` places a batch (a
    mesh run splits it over the devices). Multi-host, `rows` is this process's share of every batch: each process
    reads only its rows, and every process computes the metrics over all processes' rows, each row once."""
    labels, probs = [], []
    share = {} if rows is None else {"rows": rows}
    local_size = batch_size if rows is None else rows.stop - rows.start
    for i, batch in enumerate(dataset.eval_batches(batch_size, split, **share)):
        validate_batch(batch, task.spec, any_id=task.collection.any_id_features, where=f"{split} batch {i}")
        n = batch.size
        padded = pad_batch(batch, local_size)
        p = sharding.to_host(predict_step(state, put(padded)))
        if rows is None:
            probs.append(p[:n])
            labels.append(batch.labels)
        else:  # every process's labels and which rows are real (a share of the short last batch may be empty)
            label, real = (sharding.to_host(x) for x in put((padded.labels, np.arange(local_size) < n)))
            probs.append(p[real])
            labels.append(label[real])
    labels, probs = np.concatenate(labels), np.concatenate(probs)
    if not np.all(np.isfinite(probs)):
        raise FloatingPointError("model produced non-finite predictions; lower the learning rates")
    return metrics.binary_metrics(labels, probs)


def dense_param_count(params) -> int:
    return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params)))


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass
class Selection:
    """Best-step selection on the validation split, with early stopping after `patience` evaluations without
    improvement (0 = never stop early)."""

    select_on: str
    patience: int
    selectable_from: int = 0  # earlier evaluations are logged only (dynamic tables have not reached their budget)
    best_step: int = 0
    best_validation: dict = dataclasses.field(default_factory=dict)
    test: dict = dataclasses.field(default_factory=dict)
    last_validation: dict = dataclasses.field(default_factory=dict)
    evals_without_improvement: int = 0
    warnings: list[str] = dataclasses.field(default_factory=list)

    def improves(self, validation: dict) -> bool:
        if not self.best_validation:
            return True
        new, best = validation[self.select_on], self.best_validation[self.select_on]
        return new > best if self.select_on == "auc" else new < best

    def record(self, step: int, validation: dict) -> bool:
        """Note an evaluation; True if it is the new best step (then score test for it)."""
        if self.select_on == "auc" and not np.isfinite(validation["auc"]):
            # One class only (e.g. a tiny validation split without clicks): AUC is undefined, logloss is not.
            self.select_on = "logloss"
            self.warnings.append(f"the validation split has one class only (click rate {validation['eval_ctr']:g} "
                                 f"over {validation['eval_examples']} examples), so its AUC is undefined: selecting "
                                 "on validation logloss instead; provide a larger validation split")
            print(f"WARNING: {self.warnings[-1]}", flush=True)
        self.last_validation = validation
        if step < self.selectable_from:
            return False
        if self.improves(validation):
            self.best_step, self.best_validation, self.evals_without_improvement = step, validation, 0
            return True
        self.evals_without_improvement += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.evals_without_improvement >= self.patience


# ---------------------------------------------------------------------------------------------- loop
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
    """Train per `config`, select the best step on validation, write the workdir outputs, return the summary."""
    validate_config(config)  # every config mistake is a ConfigError naming its key, before any work
    root = pathlib.Path(workdir)  # process 0's workdir: the summary and the checkpoints every process shares
    workdir = sharding.process_workdir(root)  # under multi-host, process i > 0 logs to process_i/
    workdir.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(config, root) if config.checkpoint.enabled else None
    resume = checkpointer.resume_point() if checkpointer else None
    if resume and resume.own and resume.finished and (root / "summary.json").exists():
        print(f"run complete: {resume.store.directory / str(resume.step)} is its final checkpoint; nothing to train "
              f"(summary: {root / 'summary.json'})", flush=True)
        checkpointer.close()
        return json.loads((root / "summary.json").read_text())
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")

    # --- data and task ----------------------------------------------------------------------------
    dataset = make_dataset(config.data, seed=config.seed)
    budget = resolve_budget(config.train, dataset)
    print(f"train: {budget.describe()}", flush=True)
    task = build_task(config, dataset.spec, dataset, budget.steps)
    dynamic = DynamicTables.create(task.collection, budget.steps, int(config.seed))
    if resume and dynamic is not None:  # the pools were compacted: restore into the checkpoint's capacities
        task = dynamic.resume(task, resume.meta["loop"]["dynamic"])
    sharded = sharding.setup(config, task)  # None on one device: the single-device engine below, untouched
    validate = lambda b, where: validate_batch(b, task.spec, any_id=task.collection.any_id_features,
                                               where=where)
    if checkpointer is not None:  # where the tables' rows are, and how to restore a checkpoint saved elsewhere
        checkpointer.layout = sharding.layout(sharded)
        checkpointer.relayout = sharding.relayout(task.collection, sharded)
    put = jax.device_put if sharded is None else sharded.put_batch
    # Step i's batch is a pure function of (seed, i), so a resumed run restarts the stream at its step.
    start = resume.step if resume else 0
    # Multi-host: each process reads only its devices' rows of every batch (the batch is the same for any number
    # of processes); the processes' shares make the global arrays (`put`).
    rows = sharded.process_rows(int(config.train.batch_size)) if sharded is not None else None
    share = {} if rows is None else {"rows": rows}
    if rows is not None:
        print(f"data: process {jax.process_index()} of {jax.process_count()} reads rows [{rows.start}, {rows.stop}) "
              f"of every batch of {config.train.batch_size}", flush=True)
    try:
        with DevicePrefetcher(dataset.train_batches(int(config.train.batch_size), start, **share), validate,
                              put=put) as batches:
            return _train_loop(config, workdir, dataset, task, budget, batches, sharded, checkpointer, resume,
                               dynamic)
    finally:
        if checkpointer:
            checkpointer.close()  # waits for a save in flight


def _adjust_on_mesh(config, dynamic: DynamicTables, task: Task, sharded: sharding.ShardedEmbedding, state, step: int,
                    checkpointer: Checkpointer | None):
    """`DynamicTables.adjust` for a mesh run: (task, sharded, state, recompile?). The adjustment works on the
    single-device layout, so the state is gathered to it and laid out again after (every process computes the same
    adjustment); a compaction changes the tables' shapes, so the plan is made anew for them. Checkpoint deltas: the
    re-layout moves rows on every device, so an adjustment marks every row dirty (a compaction starts a baseline)."""
    local = sharding.unshard_state(sharded, state.replace(dirty_rows={}))
    device = lambda tree: jax.tree.map(jnp.asarray, tree)  # noqa: E731
    local = local.replace(tables=device(local.tables), sparse_opt_state=device(local.sparse_opt_state),
                          aux=device(local.aux))
    task, local, compacted = dynamic.adjust(task, local, step)
    if compacted:
        sharded = sharding.setup(config, task)
        if checkpointer is not None:
            checkpointer.layout = sharding.layout(sharded)
            checkpointer.relayout = sharding.relayout(task.collection, sharded)
        new = sharding.shard_state(sharded, local)
        return task, sharded, (checkpointer.track(new) if checkpointer else new), True
    dirty = {k: jnp.ones_like(d) for k, d in state.dirty_rows.items()}
    return task, sharded, sharding.shard_state(sharded, local).replace(dirty_rows=dirty), False


def _train_loop(config: ml_collections.ConfigDict, workdir: pathlib.Path, dataset, task: Task, budget: Budget,
                batches: DevicePrefetcher, sharded: sharding.ShardedEmbedding | None = None,
                checkpointer: Checkpointer | None = None, resume: ResumePoint | None = None,
                dynamic: DynamicTables | None = None) -> dict:
    train_cfg = config.train
    batch_size = budget.batch_size

    # --- state, steps, cost analysis --------------------------------------------------------------
    first = next(batches)
    rows = sharded.process_rows(batch_size) if sharded is not None else None  # multi-host: this process's share
    share = {} if rows is None else {"rows": rows}
    eval_host = pad_batch(next(dataset.eval_batches(batch_size, "validation", **share)),
                          batch_size if rows is None else rows.stop - rows.start)
    make_train = lambda task, state: make_train_step(task)  # noqa: E731
    make_predict = lambda task, state: make_predict_step(task)  # noqa: E731
    put = jax.device_put
    loop = {}  # the loop's own state (selection, history, times), restored with a checkpoint

    def restore_or_track(like):
        """The checkpoint's state placed like `like` (the loop state into `loop`), else `like` with dirty-row
        bitmaps when the checkpoint policy writes deltas."""
        if not resume:
            return checkpointer.track(like) if checkpointer else like
        state, loop_state = checkpointer.restore(resume, like)
        loop.update(loop_state)
        saved = resume.meta.get("layout")
        moved = "" if saved == checkpointer.layout else (
            f"; its tables re-laid out from {_describe_layout(saved)} to {_describe_layout(checkpointer.layout)}")
        print(f"resuming from checkpoint step {resume.step:,} of {budget.steps:,} "
              f"({resume.store.directory / str(resume.step)}){moved}", flush=True)
        return state

    if sharded is not None:  # the single-device initial state laid out by the plan; steps under shard_map
        print(sharding.format_plan(sharded.plan), flush=True)
        sharding.save_plan(sharded.plan, workdir)
        state = init_state(task, jax.random.key(config.seed), eval_host)
        state, _, _, put = sharding.prepare(task, sharded, state, _forward, restore_or_track)
        # `sharded` read when called: a FIITED compaction on a mesh re-plans it (`_adjust_on_mesh`).
        make_train = lambda task, state: sharding.make_train_step(task, sharded, state, _forward)  # noqa: E731
        make_predict = lambda task, state: sharding.make_predict_step(task, sharded, state, _forward)  # noqa: E731
    elif resume:
        state = restore_or_track(jax.eval_shape(lambda batch: init_state(task, jax.random.key(config.seed), batch),
                                                first))
    else:
        state = restore_or_track(init_state(task, jax.random.key(config.seed), first))
    # Compile once, up front: the loop calls the executables, so no step pays for compilation and the
    # compile time and XLA's cost analysis come from exactly what runs.
    t0 = time.perf_counter()
    eval_example = put(eval_host)

    def compile_steps(task, state):
        return (make_predict(task, state).lower(state, eval_example).compile(),
                make_train(task, state).lower(state, first).compile())

    predict_step, train_step = compile_steps(task, state)
    compile_time = time.perf_counter() - t0
    # XLA's cost analysis of a mesh step is per device, which sees batch_size / devices examples.
    examples = batch_size if sharded is None else batch_size // sharded.mesh.size
    forward_flops = flops_per_example(predict_step, examples)
    train_flops = flops_per_example(train_step, examples)

    accounting = task.collection.accounting(task.sparse_optimizer)
    dense_params = dense_param_count(state.dense_params)
    print(f"workdir: {workdir}\nembedding tables: {accounting['params']:,} params ({accounting['bytes'] / 2**20:.1f} "
          f"MiB) + optimizer {accounting['optimizer_bytes'] / 2**20:.1f} MiB; dense params: {dense_params:,}; "
          f"{forward_flops:,.0f} FLOPs/example", flush=True)

    # --- loop -----------------------------------------------------------------------------------
    writer = SummaryWriter(str(workdir))
    csv_path = workdir / "metrics.csv"
    csv_fields = ["step", "split", "examples", "epoch", "loss", *METRICS, "examples_per_sec", "elapsed_s"]
    history = loop.get("history", [])  # metrics.csv's rows up to the restored step (later ones were lost)
    with csv_path.open("w", newline="") as f:
        csv.writer(f).writerow(csv_fields)
        csv.DictWriter(f, csv_fields).writerows(history)

    def log_row(row: dict):
        row["examples"] = row["step"] * batch_size
        if budget.examples_per_epoch:
            row["epoch"] = row["examples"] / budget.examples_per_epoch
        history.append(row)
        with csv_path.open("a", newline="") as f:
            csv.DictWriter(f, csv_fields).writerow(row)
        for k, v in row.items():
            if k not in ("step", "split", "examples", "epoch") and v is not None and np.isfinite(v):
                writer.add_scalar(f"{row['split']}/{k}", v, row["step"])

    def scored(split: str, step: int) -> dict:
        result = evaluate(task, predict_step, state, dataset, batch_size, split, put, rows)
        log_row({"step": step, "split": split, **{k: result[k] for k in METRICS},
                 "elapsed_s": time.perf_counter() - run_start})
        return result

    selection = Selection(**loop.get("selection", {"select_on": train_cfg.select_on,
                                                   "patience": int(train_cfg.early_stopping_patience)}))
    if dynamic is not None:
        selection.selectable_from = dynamic.ramp_end(task.collection)
        if not dynamic.history:  # a resumed run restored its history
            dynamic.record(task.collection, task.sparse_optimizer, state, 0)
        print(f"dynamic tables {', '.join(dynamic.features)}: budgets reached at step {selection.selectable_from:,}; "
              "validation selects from there", flush=True)
    test_warned = loop.get("test_warned", False)
    train_time, run_start = loop.get("train_time", 0.0), time.perf_counter() - loop.get("wall_time", 0.0)
    loss = loop.get("loss", float("nan"))

    def loop_state() -> dict:
        return {"selection": dataclasses.asdict(selection), "test_warned": test_warned, "train_time": train_time,
                "wall_time": time.perf_counter() - run_start, "loss": loss,
                "history": list(history),  # a copy: an async save serialises it while the loop appends
                **({} if dynamic is None else {"dynamic": dynamic.loop_state(task.collection)})}

    start = step = resume.step if resume else 0
    last = start if selection.should_stop else budget.steps  # a run restored after its early stop trains no more
    bar = tqdm.tqdm(initial=start * batch_size, total=budget.steps * batch_size, unit="ex", unit_scale=True,
                    disable=not train_cfg.progress_bar, mininterval=1.0, dynamic_ncols=True)
    batch = first
    window_start, window_examples = time.perf_counter(), 0
    in_flight = collections.deque()  # a mesh run's dispatched steps not known to be done
    for step in range(start + 1, last + 1):
        state, step_metrics = train_step(state, batch)
        if sharded is not None:
            # At most MESH_STEPS_IN_FLIGHT mesh steps queued: on XLA:CPU hundreds of queued steps with collectives
            # can deadlock (one device thread never reaches an all-reduce; XLA aborts after 40 s).
            in_flight.append(step_metrics["loss"])
            if len(in_flight) > MESH_STEPS_IN_FLIGHT:
                in_flight.popleft().block_until_ready()
        window_examples += batch_size
        if dynamic is not None and dynamic.due(task.collection, step):
            compiling = dynamic.timings["adjust_compile_s"] + dynamic.timings["recompile_s"]
            if sharded is None:
                task, state, recompile = dynamic.adjust(task, state, step)
            else:
                task, sharded, state, recompile = _adjust_on_mesh(config, dynamic, task, sharded, state, step,
                                                                  checkpointer)
            if recompile:  # a pool was compacted: new shapes
                t0 = time.perf_counter()
                predict_step, train_step = compile_steps(task, state)
                dynamic.timings["recompile_s"] += time.perf_counter() - t0
            # Compiling is not training time (as the first compile is not).
            window_start += dynamic.timings["adjust_compile_s"] + dynamic.timings["recompile_s"] - compiling
        evaluate_now = budget.is_eval_step(step)
        if step % train_cfg.log_every == 0 or evaluate_now:
            loss = float(step_metrics["loss"])  # blocks: the window's time is real work
            if not np.isfinite(loss):
                raise FloatingPointError(f"training loss is {loss} at step {step}; lower the learning rates")
            elapsed = time.perf_counter() - window_start
            train_time += elapsed
            log_row({"step": step, "split": "train", "loss": loss, "examples_per_sec": window_examples / elapsed,
                     "elapsed_s": time.perf_counter() - run_start})
            if evaluate_now and selection.record(step, scored("validation", step)):
                selection.test = scored("test", step)
                if not np.isfinite(selection.test["auc"]) and not test_warned:
                    test_warned = True
                    selection.warnings.append(
                        f"the test split has one class only (click rate {selection.test['eval_ctr']:g} over "
                        f"{selection.test['eval_examples']} examples): its AUC is undefined (NaN in the summary)")
                    print(f"WARNING: {selection.warnings[-1]}", flush=True)
            postfix = {"loss": f"{loss:.4f}"}
            if selection.best_validation:  # keep showing the best so far between evaluations
                best = selection.best_validation[selection.select_on]
                postfix["best_val"] = f"{best:.4f}@{selection.best_step}"
            bar.set_postfix(postfix)
            window_start, window_examples = time.perf_counter(), 0
        bar.update(batch_size)
        if selection.should_stop:
            break
        if checkpointer and step < budget.steps and checkpointer.due(step):
            jax.block_until_ready(state)
            saving = time.perf_counter()
            state = checkpointer.save(step, state, loop_state())
            window_start += time.perf_counter() - saving  # the save's stall is not training time
        if step < budget.steps:
            batch = next(batches)
    bar.close()
    writer.close()
    if checkpointer:
        state = checkpointer.save(step, state, loop_state(), finished=True)
    stopped_early = step < budget.steps
    print(f"selected step {selection.best_step:,} (best validation {selection.select_on} "
          f"{selection.best_validation[selection.select_on]:.4f})"
          + (f"; stopped early at step {step:,} after {selection.patience} evaluations without improvement"
             if stopped_early else ""), flush=True)

    # --- summary --------------------------------------------------------------------------------
    test = selection.test
    if dynamic is not None:  # the tables as they end (pools compacted to their budget)
        accounting = task.collection.accounting(task.sparse_optimizer)
    summary = {
        # Headline metrics: the test split at the step with the best validation metric.
        **{k: test[k] for k in METRICS},
        "test": {k: test[k] for k in (*METRICS, "eval_examples", "eval_ctr")},
        "validation": {k: selection.best_validation[k] for k in (*METRICS, "eval_examples", "eval_ctr")},
        "last_validation": {k: selection.last_validation[k] for k in METRICS},
        "selected_step": selection.best_step,
        "select_on": selection.select_on,
        "stopped_early": stopped_early,
        "warnings": selection.warnings,
        **dataset.info(),
        "params": dense_params + accounting["params"],
        "dense_params": dense_params,
        "embedding_params": accounting["params"],
        "embedding_bytes": accounting["bytes"],
        "embedding_optimizer_bytes": accounting["optimizer_bytes"],
        "compression_ratio": accounting["full_bytes"] / accounting["bytes"],
        "flops_per_example": forward_flops,
        "train_flops_per_example": train_flops,
        "examples_per_sec": step * batch_size / train_time,
        "compile_time_s": compile_time,
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - run_start,
        "peak_rss_bytes": peak_rss_bytes(),
        "steps": step,
        "budget_steps": budget.steps,
        "batch_size": batch_size,
        "examples_per_epoch": budget.examples_per_epoch,
        "epochs": step * batch_size / budget.examples_per_epoch if budget.examples_per_epoch else None,
        "final_train_loss": loss,
        "tables": accounting["tables"],
        **({} if dynamic is None else {"dynamic_tables": dynamic.summary()}),
        **({} if sharded is None else {"mesh_shape": dict(sharded.plan.mesh_shape), "processes": jax.process_count(),
                                        "exchange_dtype": str(sharded.exchange_dtype)}),
    }
    if jax.process_index() == 0:  # multi-host: one summary
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
