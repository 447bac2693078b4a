"""The data-parallel train / predict steps on a mesh, and moving a TrainState between layouts.

Each device runs the single-device stages on its slice of the global batch (batches are split over every device,
`data` major): route -> `ShardedEmbedding.fetch` (the exchange) -> glue + model -> value_and_grad -> dense
gradients psum'ed (the loss is the global mean: each device contributes its local mean / n) and the same optax
update on every replica -> `ShardedEmbedding.update` (gradients to the row owners, sparse_apply in place). The
state is donated, so every table block is updated where it lives.

Dynamic tables (FIITED, row pruning): their routing arrays (`state.aux`: the packed offsets and the chunk utility)
are replicated. Every device routes its slice with them, and every device updates them from the whole global
batch -- the dynamic features' ids, pooling weights and d loss / d embeddings all-gathered, (2 L + D) x 4 bytes
per example and feature -- so the replicas stay identical and equal to what one device computes for the same
batch. The adjustments between steps run on the single-device layout (recjax/train.py).

`check_vma=False`: the sparse update's `lax.platform_dependent` traces the Pallas TPU / GPU branches too, and a
pallas_call's outputs carry no varying-axes type; replication of the dense state holds by construction (every
device applies the same psum'ed gradients) and is checked by the tests against the single-device run.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from recjax.sharding.exchange import ALL_AXES, ShardedEmbedding, put_global, to_host


def state_specs(sharded: ShardedEmbedding, state):
    """PartitionSpecs of a sharded TrainState: dense parts replicated, tables and their state by storage."""
    replicated = lambda tree: jax.tree.map(lambda _: P(), tree)
    return state.replace(
        step=P(), dense_params=replicated(state.dense_params), dense_opt_state=replicated(state.dense_opt_state),
        tables={k: sharded.storages[k].spec for k in state.tables},
        sparse_opt_state={k: {f: sharded.storages[k].spec for f in v} for k, v in state.sparse_opt_state.items()},
        dirty_rows={k: sharded.storages[k].row_spec for k in state.dirty_rows}, dropout_rng=P(),
        aux=replicated(state.aux))


def batch_sharding(sharded: ShardedEmbedding) -> NamedSharding:
    return NamedSharding(sharded.mesh, P(ALL_AXES))


def process_rows(sharded: ShardedEmbedding, batch_size: int) -> slice | None:
    """The rows of every global batch this process's devices hold -- what its data reader yields (one contiguous
    range, B / processes rows); None in a single-process run (the reader yields whole batches)."""
    if jax.process_count() == 1:
        return None
    spans = sorted((s[0].start, s[0].stop) for s in
                   batch_sharding(sharded).addressable_devices_indices_map((batch_size,)).values())
    if any(a[1] != b[0] for a, b in zip(spans[:-1], spans[1:], strict=True)):
        raise ValueError(f"process {jax.process_index()}'s devices hold rows {spans} of each batch of {batch_size}, "
                         "not one range; order the mesh's devices by process")
    return slice(spans[0][0], spans[-1][1])


def put_batch(sharded: ShardedEmbedding, batch):
    """A host batch -> device arrays split over every device (B/n rows each, data major). Single process: `batch`
    is the global batch. Multi-host: it is this process's rows (`process_rows`), and the processes' shares
    make the global arrays (no process holds another's rows)."""
    sharding = batch_sharding(sharded)
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def shard_state(sharded: ShardedEmbedding, state):
    """A single-device TrainState (every process holding the same value) -> the plan's layout on the mesh."""
    replicated = NamedSharding(sharded.mesh, P())

    def put(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        return put_global(np.asarray(x), replicated)

    fields = sorted({f for v in state.sparse_opt_state.values() for f in v})
    opt_by_field = {f: sharded.shard({g: v[f] for g, v in state.sparse_opt_state.items()}) for f in fields}
    return state.replace(
        step=put(state.step), dense_params=jax.tree.map(put, state.dense_params),
        dense_opt_state=jax.tree.map(put, state.dense_opt_state),
        tables=sharded.shard(state.tables),
        sparse_opt_state={k: {f: opt_by_field[f][k] for f in fields} for k in sharded.storages},
        dropout_rng=put(state.dropout_rng), aux=jax.tree.map(put, state.aux))


def unshard_state(sharded: ShardedEmbedding, state):
    """The inverse of `shard_state`, as numpy (the single-device layout: {group: rows})."""
    fields = sorted({f for v in state.sparse_opt_state.values() for f in v})
    host = lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else to_host(x)
    opt = {f: sharded.unshard({k: v[f] for k, v in state.sparse_opt_state.items()}) for f in fields}
    groups = sorted(sharded.collection.group_rows)
    return state.replace(
        step=host(state.step), dense_params=jax.tree.map(host, state.dense_params),
        dense_opt_state=jax.tree.map(host, state.dense_opt_state), tables=sharded.unshard(state.tables),
        sparse_opt_state={g: {f: opt[f][g] for f in fields} for g in groups}, dropout_rng=state.dropout_rng,
        aux=jax.tree.map(host, state.aux))


def make_train_step(task, sharded: ShardedEmbedding, state, forward: Callable):
    """jit(shard_map((state, batch) -> (state, {"loss", "invalid_ids"}))) with the state donated; `state` is an
    example of the sharded state (for its structure); `forward` is recjax.train._forward."""
    n, collection = sharded.mesh.size, task.collection

    def local_step(state, batch):
        # Owners exchange distinct rows.
        routes = collection.route(batch.ids, batch.lengths, aux=state.aux, dedup=True)
        rows, context = sharded.fetch(state.tables, routes["unique"], batch.labels.shape[0])
        device = jax.lax.axis_index(ALL_AXES)
        dropout_rng = jax.random.fold_in(jax.random.fold_in(state.dropout_rng, state.step), device)

        def loss_fn(dense_params, rows, emb_probe):
            logits = forward(task, dense_params, rows, routes, batch.dense, dropout_rng, emb_probe)
            return optax.sigmoid_binary_cross_entropy(logits, batch.labels).mean() / n

        emb_probe = None  # FIITED's chunk utility reads d loss / d embeddings (recjax/train.py)
        if collection.wants_embedding_grads:
            emb_probe = jnp.zeros((batch.labels.shape[0], len(task.spec.features), collection.dim), jnp.float32)
        loss, (g_dense, g_rows, g_emb) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
            state.dense_params, rows, emb_probe)
        loss, g_dense = jax.lax.psum((loss, g_dense), ALL_AXES)
        updates, dense_opt_state = task.dense_tx.update(g_dense, state.dense_opt_state, state.dense_params)
        dense_params = optax.apply_updates(state.dense_params, updates)
        step = state.step + 1
        tables, sparse_opt_state, touched = sharded.update(task.sparse_optimizer, state.tables,
                                                           state.sparse_opt_state, context, g_rows,
                                                           task.sparse_lr(state.step), step)
        invalid = jax.lax.psum(sum(routes["invalid_ids"].values(), jnp.zeros((), jnp.int32)), ALL_AXES)
        # Checkpoint deltas: each device marks the rows of its block it updated (the sentinel is dropped).
        dirty = {k: d.at[touched[k]].set(True, mode="drop") for k, d in state.dirty_rows.items()}
        new_state = state.replace(step=step, dense_params=dense_params, dense_opt_state=dense_opt_state,
                                  tables=tables, sparse_opt_state=sparse_opt_state, dirty_rows=dirty,
                                  aux=_update_aux(collection, state.aux, batch.ids, routes, g_emb, step))
        return new_state, {"loss": loss, "invalid_ids": invalid, "bucket_overflows": sharded.overflows(context)}

    specs = state_specs(sharded, state)
    step = jax.shard_map(local_step, mesh=sharded.mesh, in_specs=(specs, P(ALL_AXES)), out_specs=(specs, P()),
                         check_vma=False)
    return jax.jit(step, donate_argnums=(0,))


def _update_aux(collection, aux, ids, routes, g_emb, step):
    """The replicated routing arrays after a step, from the whole global batch (the same on every device): each
    device's slice of the ids, pooling weights and embedding gradients, all-gathered in the batch's order."""
    if not collection.aux_features:
        return aux
    everyone = lambda x: jax.lax.all_gather(x, ALL_AXES, tiled=True)  # noqa: E731
    features = collection.aux_features
    if g_emb is not None:  # only the dynamic features' columns cross devices
        columns = np.array([collection.spec.feature_names.index(f) for f in features])
        gathered = everyone(g_emb[:, columns])
        g_emb = jnp.zeros((gathered.shape[0], *g_emb.shape[1:]), g_emb.dtype).at[:, columns].set(gathered)
    return collection.update_aux(
        aux, {f: everyone(ids[f]) for f in features},
        {"features": {f: {"weights": everyone(routes["features"][f]["weights"])} for f in features}}, g_emb, step)


def make_predict_step(task, sharded: ShardedEmbedding, state, forward: Callable):
    """jit(shard_map((state, batch) -> probabilities f32[B])), B split over every device."""

    def local_predict(state, batch):
        routes = task.collection.route(batch.ids, batch.lengths, aux=state.aux, dedup=True)
        rows, _ = sharded.fetch(state.tables, routes["unique"], batch.labels.shape[0])
        return jax.nn.sigmoid(forward(task, state.dense_params, rows, routes, batch.dense))

    specs = state_specs(sharded, state)
    return jax.jit(jax.shard_map(local_predict, mesh=sharded.mesh, in_specs=(specs, P(ALL_AXES)),
                                 out_specs=P(ALL_AXES), check_vma=False))


def prepare(task, sharded: ShardedEmbedding, state, forward: Callable, adapt: Callable = lambda state: state):
    """What the trainer swaps in on a mesh: the sharded state (from the single-device initial `state`, then
    `adapt`ed: e.g. restored from a checkpoint, given dirty-row bitmaps), the jitted train and predict steps for its
    structure (predictions come back as numpy on every process) and the batch placement."""
    state = adapt(shard_state(sharded, state))
    train_step = make_train_step(task, sharded, state, forward)
    predict = make_predict_step(task, sharded, state, forward)
    return state, train_step, predict, lambda batch: put_batch(sharded, batch)
