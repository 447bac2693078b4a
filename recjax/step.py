"""The train state and the one train / predict step, written against `EmbeddingBackend` (recjax/embedding_backend.py).

A train step is `(state, batch) -> (state, metrics)` with the state donated, so the tables are updated in place:

    routes = backend.route(batch, state.aux, train=True)     # int math + one dedup per stacked group
    rows, exchange = backend.fetch(state.tables, routes)      # each distinct row once (a mesh: from its owner)
    loss, (g_dense, g_rows) = value_and_grad(loss_fn, (0, 1))(dense_params, rows)
    loss, g_dense = backend.all_reduce((loss, g_dense))       # the identity on one device, psum on a mesh
    dense_params, dense_opt = optax update
    tables, sparse_opt, touched = backend.update(...)         # only the touched rows
    dirty_rows = mark_dirty_rows(dirty_rows, touched)         # Check-N-Run's bitmap, when checkpoints track it

The same function runs on one device (jit) and on a mesh (jit of shard_map, the body on each device's share of the
batch), whatever memory the rows are in; what differs is the backend's layout and storages (recjax/placement), never
this code.
"""

from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from recjax.batch import Batch
from recjax.embedding_backend import EmbeddingBackend
from recjax.placement.embedding import one_device
from recjax.task import Task
from recjax.validation import config_errors


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # i32[], optimizer steps taken
    dense_params: Any  # {"model": ..., "glue": ...}
    dense_opt_state: Any
    tables: dict[str, jax.Array]  # stacked physical tables, {group: f32[rows, dim]} (a mesh: {storage: block})
    sparse_opt_state: dict[str, dict[str, jax.Array]]
    dropout_rng: jax.Array  # folded with the step for each step's dropout masks
    # Incremental checkpoints: bool[rows] per table array, set at the rows each step touches ({} = not tracked).
    dirty_rows: dict[str, jax.Array] = flax.struct.field(default_factory=dict)
    # Routing arrays of dynamic methods, {feature: {name: array}} (FIITED's indirection and utility; {} if none).
    aux: dict[str, dict[str, jax.Array]] = flax.struct.field(default_factory=dict)


def init_state(task: Task, rng: jax.Array, batch: Batch, backend: EmbeddingBackend | None = None) -> TrainState:
    """The initial state: tables (DLRM init), dense params (from one example batch's shapes) and both optimizer
    states. Single-device tables, which a backend lays out with `place_state`, unless the backend makes its own
    (`backend.init_tables`: a disk tier writes the rows to its files and keeps only a cache in the state)."""
    table_rng, glue_rng, model_rng, dropout_rng = jax.random.split(rng, 4)
    backend = backend or one_device(task.collection)
    tables, sparse_opt_state = backend.init_tables(table_rng, task.sparse_optimizer)
    aux = task.collection.init_aux()

    def init_dense(tables, batch):
        # Only the rows' shapes matter here (Flax initialises from the keys); a disk tier's cache gathers zeros.
        routes = task.collection.route(batch.ids, batch.lengths, aux=aux)
        rows = task.collection.gather(tables, routes)
        glue_vars = task.glue.init(glue_rng, rows, routes.features)
        emb = task.glue.apply(glue_vars, rows, routes.features)
        model_vars = task.model.init(model_rng, batch.dense, emb)
        return {"glue": glue_vars.get("params", {}), "model": model_vars["params"]}

    with config_errors("model"):
        dense_params = jax.jit(init_dense)(tables, batch)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        dense_params=dense_params,
        dense_opt_state=task.dense_tx.init(dense_params),
        tables=tables,
        sparse_opt_state=sparse_opt_state,
        dropout_rng=dropout_rng,
        aux=aux,
    )


def forward(task: Task, dense_params, rows, features: Mapping, dense: jax.Array, dropout_rng: jax.Array | None = None,
            emb_probe: jax.Array | None = None) -> jax.Array:
    """Logits f32[B] from what `backend.fetch` returned, the routes' features and the dense features; dropout only
    with a `dropout_rng`. `emb_probe` (zeros f32[B, F, D]) is added to the embeddings so its gradient is theirs."""
    emb = task.glue.apply({"params": dense_params["glue"]}, rows, features)
    if emb_probe is not None:
        emb = emb + emb_probe
    if dropout_rng is None:
        return task.model.apply({"params": dense_params["model"]}, dense, emb)
    return task.model.apply({"params": dense_params["model"]}, dense, emb, train=True, rngs={"dropout": dropout_rng})


def mark_dirty_rows(dirty: Mapping[str, jax.Array], touched: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Set the bitmap bool[rows] of each tracked table array at the rows the step updated (`backend.update`'s
    `touched`; duplicates are harmless, an out-of-range id -- the sentinel, padding -- is dropped). Inside the
    jitted step, with the bitmap donated: O(ids in the batch)."""
    return {k: d.at[touched[k]].set(True, mode="drop") for k, d in dirty.items()}


def make_train_step(task: Task, backend: EmbeddingBackend | None = None, state: TrainState | None = None,
                    steps_per_call: int = 1):
    """The compiled `(state, batch) -> (state, {"loss", "invalid_ids", ...})`, state donated. `backend` defaults to
    one device; `state` is an example of the backend's state (its structure; a mesh needs it).

    `steps_per_call` k > 1: `(state, batches) -> (state, metrics)` over k batches stacked on a leading axis
    (`batches.labels`: f32[k, B]), one `lax.scan` of the same step, each metric f32[k] (step by step, on the device
    until the trainer reads them); the state after it is the state after k calls of the one-step function."""
    backend = backend or one_device(task.collection)
    if steps_per_call < 1:
        raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
    collection = task.collection
    probe = collection.wants_embedding_grads  # FIITED's chunk utility reads d loss / d embeddings

    def train_step(state: TrainState, batch: Batch):
        routes = backend.route(batch, state.aux, train=True)
        rows, exchange = backend.fetch(state.tables, routes)
        dropout_rng = backend.device_rng(jax.random.fold_in(state.dropout_rng, state.step))

        def loss_fn(dense_params, rows, emb_probe):
            logits = forward(task, dense_params, rows, routes.features, batch.dense, dropout_rng, emb_probe)
            # Each device's mean over its share, / shards: the sum over devices is the global batch's mean.
            return task.objective.loss(logits, batch.labels).mean() / backend.shards

        emb_probe = None
        if probe:
            emb_probe = jnp.zeros((routes.batch_size, len(task.spec.features), collection.dim), jnp.float32)
        loss, (g_dense, g_rows, g_emb) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
            state.dense_params, rows, emb_probe)
        loss, g_dense = backend.all_reduce((loss, g_dense))
        updates, dense_opt_state = task.dense_tx.update(g_dense, state.dense_opt_state, state.dense_params)
        dense_params = optax.apply_updates(state.dense_params, updates)
        step = state.step + 1
        tables, sparse_opt_state, touched = backend.update(
            task.sparse_optimizer, state.tables, state.sparse_opt_state, routes, exchange, rows, g_rows,
            task.sparse_lr(state.step), step)
        new_state = state.replace(step=step, dense_params=dense_params, dense_opt_state=dense_opt_state,
                                  tables=tables, sparse_opt_state=sparse_opt_state,
                                  dirty_rows=mark_dirty_rows(state.dirty_rows, touched),
                                  aux=backend.update_aux(state.aux, batch.ids, routes, g_emb, step))
        invalid = backend.all_reduce(sum(routes.invalid_ids.values(), jnp.zeros((), jnp.int32)))
        return new_state, {"loss": loss, "invalid_ids": invalid, **backend.step_metrics(exchange)}

    if steps_per_call == 1:
        return backend.compile_train(train_step, state)

    def train_steps(state: TrainState, batches: Batch):
        # One dispatch for k steps: the host queues one call, not k, and the loop body is the very step above (the
        # learning-rate schedule and dropout read `state.step`, which the scan carries), so the result does not
        # depend on k. Each step's metrics come back stacked, f32[k].
        return jax.lax.scan(train_step, state, batches)

    return backend.compile_train(train_steps, state, stacked=True)


def make_predict_step(task: Task, backend: EmbeddingBackend | None = None, state: TrainState | None = None):
    """The compiled `(state, batch) -> predictions f32[B]` (the objective's: click probabilities, ratings)."""
    backend = backend or one_device(task.collection)

    def predict_step(state: TrainState, batch: Batch):
        routes = backend.route(batch, state.aux, train=False)
        rows, _ = backend.fetch(state.tables, routes)
        return task.objective.predict(forward(task, state.dense_params, rows, routes.features, batch.dense))

    return backend.compile_predict(predict_step, state)
