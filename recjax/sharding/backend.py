"""The mesh backend: the step's embedding interface over a sharding plan on a jax Mesh.

The step (recjax/step.py) runs under one `jax.shard_map` over both mesh axes, on each device's share of the batch
(split over every device, `data` major): `route` is the collection's (always deduplicated: the exchange moves
distinct rows), `fetch` / `update` are the exchange's collectives (recjax/sharding/exchange.py), `all_reduce` psums
the loss and dense gradients (each device contributes its local mean / n), and every replica applies the same
optax update, so the dense state stays replicated. The state is donated, so each table block is updated where it
lives.

Dynamic tables (FIITED, row pruning): their routing arrays (`state.aux`) are replicated. Every device routes its
share with them and updates them from the whole global batch -- the dynamic features' ids, pooling weights and
d loss / d embeddings all-gathered, (2 L + D) x 4 bytes per example and feature -- so the replicas stay identical
and equal to what one device computes. Adjustments between steps run on the single-device layout (`local_state`,
then `place_state`; recjax/dynamic.py).

`check_vma=False`: the sparse update's `lax.platform_dependent` traces the Pallas TPU / GPU branches too, and a
pallas_call's outputs carry no varying-axes type; replication of the dense state holds by construction (every
device applies the same psum'ed gradients) and is checked by the tests against the single-device run.
"""

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from recjax.embedding import EmbeddingCollection, Routes
from recjax.embedding_backend import EmbeddingBackend
from recjax.sharding import placement
from recjax.sharding.exchange import Exchange, storage_layout
from recjax.sharding.placement import ALL_AXES, put_global, to_host
from recjax.sharding.plan import ShardingPlan, format_plan
from recjax.sparse_optim import SparseOptimizer

# The trainer waits for the mesh step dispatched this many steps earlier: hundreds of queued steps deadlocked
# XLA:CPU's collectives on 8 CPU devices, a few in flight never did and ran as fast
# (benchmarks/RESULTS.md#sharding-steps-in-flight).
MESH_STEPS_IN_FLIGHT = 4

Replan = Callable[[EmbeddingCollection, SparseOptimizer], ShardingPlan]


class MeshEmbedding(EmbeddingBackend):
    """A collection's tables laid out by `plan` on `mesh`; `replan` makes the plan for a collection whose tables
    changed shape (a dynamic table's compaction)."""

    steps_in_flight = MESH_STEPS_IN_FLIGHT

    def __init__(self, collection: EmbeddingCollection, plan: ShardingPlan, mesh: Mesh,
                 exchange_dtype: str = "float32", capacity_factor: float = 0.0, capacity_sigmas: float = 0.0,
                 replan: Replan | None = None, storages: Mapping | None = None):
        self.collection = collection
        self.exchange = Exchange(collection, plan, mesh, exchange_dtype, capacity_factor, capacity_sigmas, storages)
        self.plan, self.mesh, self.storages = plan, mesh, self.exchange.storages
        self.shards = mesh.size
        self.replan = replan

    # ------------------------------------------------------------------------------------------- device side
    def route(self, batch, aux: Mapping, *, train: bool) -> Routes:
        return self.collection.route(batch.ids, batch.lengths, aux=aux, dedup=True)

    def fetch(self, tables: Mapping[str, jax.Array], routes: Routes):
        return self.exchange.fetch(tables, routes.unique, routes.batch_size)

    def update(self, optimizer, tables, opt_state, routes, exchange, rows, row_grads, lr, step):
        return self.exchange.update(optimizer, tables, opt_state, exchange, row_grads, lr, step)

    def update_aux(self, aux: Mapping, ids: Mapping[str, jax.Array], routes: Routes, g_emb: jax.Array | None,
                   step: jax.Array) -> dict:
        """The replicated routing arrays after a step, from the whole global batch (the same on every device): each
        device's share of the ids, pooling weights and embedding gradients, all-gathered in the batch's order."""
        collection = self.collection
        if not collection.aux_features:
            return dict(aux)
        everyone = lambda x: jax.lax.all_gather(x, ALL_AXES, tiled=True)  # noqa: E731
        features = collection.aux_features
        if g_emb is not None:  # only the dynamic features' columns cross devices
            columns = np.array([collection.spec.feature_names.index(f) for f in features])
            gathered = everyone(g_emb[:, columns])
            g_emb = jnp.zeros((gathered.shape[0], *g_emb.shape[1:]), g_emb.dtype).at[:, columns].set(gathered)
        return collection.update_aux(aux, {f: everyone(ids[f]) for f in features},
                                     {f: everyone(routes.features[f].weights) for f in features}, g_emb, step)

    def all_reduce(self, tree):
        return jax.lax.psum(tree, ALL_AXES)

    def device_rng(self, rng: jax.Array) -> jax.Array:
        return jax.random.fold_in(rng, jax.lax.axis_index(ALL_AXES))

    def step_metrics(self, exchange) -> dict[str, jax.Array]:
        return {"bucket_overflows": self.exchange.overflows(exchange)}

    # --------------------------------------------------------------------------------------------- host side
    def state_specs(self, state):
        """PartitionSpecs of a placed TrainState: dense parts replicated, tables and their state by storage."""
        replicated = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
        return state.replace(
            step=P(), dense_params=replicated(state.dense_params), dense_opt_state=replicated(state.dense_opt_state),
            tables={k: self.storages[k].spec for k in state.tables},
            sparse_opt_state={k: {f: self.storages[k].spec for f in v} for k, v in state.sparse_opt_state.items()},
            dirty_rows={k: self.storages[k].row_spec for k in state.dirty_rows}, dropout_rng=P(),
            aux=replicated(state.aux))

    def compile_train(self, train_step: Callable, state, stacked: bool = False) -> Callable:
        specs = self.state_specs(state)
        step = jax.shard_map(train_step, mesh=self.mesh, in_specs=(specs, placement.batch_spec(stacked)),
                             out_specs=(specs, P()), check_vma=False)
        return jax.jit(step, donate_argnums=(0,))

    def compile_predict(self, predict_step: Callable, state) -> Callable:
        specs = self.state_specs(state)
        return jax.jit(jax.shard_map(predict_step, mesh=self.mesh, in_specs=(specs, P(ALL_AXES)),
                                     out_specs=P(ALL_AXES), check_vma=False))

    def place_state(self, state):
        """A single-device TrainState (every process holding the same value) -> the plan's layout on the mesh:
        tables, optimizer state and dirty-row bitmaps by storage (each device receiving only its block), the rest
        replicated."""
        replicated = NamedSharding(self.mesh, P())

        def put(x):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
            return put_global(np.asarray(x), replicated)

        fields = sorted({f for v in state.sparse_opt_state.values() for f in v})
        opt_by_field = {f: self.exchange.shard({g: v[f] for g, v in state.sparse_opt_state.items()}) for f in fields}
        dirty = {}
        if state.dirty_rows:  # tracked for every group or none
            dirty = {name: put_global(rows, NamedSharding(self.mesh, self.storages[name].row_spec))
                     for name, rows in storage_layout(self.storages, state.dirty_rows).items()}
        return state.replace(
            step=put(state.step), dense_params=jax.tree.map(put, state.dense_params),
            dense_opt_state=jax.tree.map(put, state.dense_opt_state),
            tables=self.exchange.shard(state.tables),
            sparse_opt_state={k: {f: opt_by_field[f][k] for f in fields} for k in self.storages},
            dirty_rows=dirty, dropout_rng=put(state.dropout_rng), aux=jax.tree.map(put, state.aux))

    def host_state(self, state):
        """The inverse of `place_state`, as numpy (the single-device layout: {group: rows})."""
        fields = sorted({f for v in state.sparse_opt_state.values() for f in v})
        host = lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else to_host(x)  # noqa: E731
        opt = {f: self.exchange.unshard({k: v[f] for k, v in state.sparse_opt_state.items()}) for f in fields}
        groups = sorted(self.collection.group_rows)
        return state.replace(
            step=host(state.step), dense_params=jax.tree.map(host, state.dense_params),
            dense_opt_state=jax.tree.map(host, state.dense_opt_state), tables=self.exchange.unshard(state.tables),
            sparse_opt_state={g: {f: opt[f][g] for f in fields} for g in groups}, dropout_rng=state.dropout_rng,
            dirty_rows=self.exchange.unshard(state.dirty_rows) if state.dirty_rows else {},
            aux=jax.tree.map(host, state.aux))

    def local_state(self, state):
        device = lambda tree: jax.tree.map(jnp.asarray, tree)  # noqa: E731
        local = self.host_state(state)
        return local.replace(tables=device(local.tables), sparse_opt_state=device(local.sparse_opt_state),
                             dirty_rows=device(local.dirty_rows), aux=device(local.aux))

    def put_batch(self, batch, stacked: bool = False):
        return placement.put_batch(self.mesh, batch, stacked)

    def process_rows(self, batch_size: int) -> slice | None:
        return placement.process_rows(self.mesh, batch_size)

    def to_host(self, array: jax.Array) -> np.ndarray:
        return to_host(array)

    def rebuilt(self, collection: EmbeddingCollection, optimizer: SparseOptimizer) -> "MeshEmbedding":
        x = self.exchange
        return MeshEmbedding(collection, self.replan(collection, optimizer), self.mesh, x.exchange_dtype,
                             x.capacity_factor, x.capacity_sigmas, self.replan)

    def process_state_bytes(self, optimizer: SparseOptimizer) -> int:
        # This process's devices' blocks (a replicated table once per device).
        return sum(self.plan.device_bytes()) * jax.local_device_count() // jax.device_count()

    def describe(self) -> str:
        return format_plan(self.plan)

    def summary(self) -> dict:
        return {"mesh_shape": dict(self.plan.mesh_shape), "processes": jax.process_count(),
                "exchange_dtype": str(self.exchange.exchange_dtype)}
