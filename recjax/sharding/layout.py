"""The mesh layout: a sharding plan over a jax Mesh, behind the step's embedding interface.

The step (recjax/step.py) runs under one `jax.shard_map` over both mesh axes, on each device's share of the batch
(split over every device, `data` major): `route` is the collection's (always deduplicated: what does not pool on
its owner moves as distinct rows), `fetch` / `update` are the exchange's collectives (recjax/sharding/exchange.py:
bags pooled on their tables' owners, the rest as rows; `fetch` returns the bags, `Lookups`, which the step
differentiates; at the owner each group's storage reads and updates its block), `all_reduce` psums the loss and
dense gradients (each device contributes its local mean / n), and every replica applies the same optax update, so
the dense state stays replicated. The state is donated, so each table block is updated where it lives.

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

from recjax.batch import Batch
from recjax.embedding import EmbeddingCollection, Routes
from recjax.embedding_backend import Layout
from recjax.sharding import placement
from recjax.sharding.exchange import Exchange, MeshArray, array_layout, group_layout, mesh_arrays
from recjax.sharding.placement import ALL_AXES, put_global, to_host
from recjax.sharding.plan import ShardingPlan, format_plan, save_plan
from recjax.sharding.relayout import mesh_layout, relayout
from recjax.sparse_optim import SparseOptimizer

# The trainer waits for the mesh step dispatched this many steps earlier: hundreds of queued steps deadlocked
# XLA:CPU's collectives on 8 CPU devices, a few in flight never did and ran as fast
# (benchmarks/RESULTS.md#sharding-steps-in-flight).
MESH_STEPS_IN_FLIGHT = 4

Replan = Callable[[EmbeddingCollection, SparseOptimizer], ShardingPlan]


class MeshLayout(Layout):
    """A collection's tables laid out by `plan` on `mesh`; `replan` makes the plan for a collection whose tables
    changed shape (a dynamic table's compaction)."""

    steps_in_flight = MESH_STEPS_IN_FLIGHT
    single_device_state = False

    def __init__(self, plan: ShardingPlan, mesh: Mesh, exchange_dtype: str = "float32", capacity_factor: float = 0.0,
                 capacity_sigmas: float = 0.0, replan: Replan | None = None):
        self.plan, self.mesh, self.replan = plan, mesh, replan
        self.exchange_dtype, self.capacity_factor, self.capacity_sigmas = exchange_dtype, capacity_factor, \
            capacity_sigmas
        self.shards = mesh.size
        self.extra_arrays: dict[str, MeshArray] = {}  # arrays storages add (a disk tier's caches)
        self.skipped: frozenset[str] = frozenset()  # tables in none of the plan's arrays (a disk tier's cached ones)

    def bind(self, collection: EmbeddingCollection, storage_of: Mapping) -> None:
        super().bind(collection, storage_of)
        arrays = {**mesh_arrays(collection, self.plan, self.skipped), **self.extra_arrays}
        self.exchange = Exchange(collection, self.plan, self.mesh, self.exchange_dtype, self.capacity_factor,
                                 self.capacity_sigmas, arrays, storage_of)
        self.arrays = self.exchange.arrays

    # ------------------------------------------------------------------------------------------- device side
    def route(self, batch, aux: Mapping, *, train: bool) -> Routes:
        return self.collection.route(batch.ids, batch.lengths, aux=aux, dedup=True)

    def fetch(self, tables: Mapping[str, jax.Array], routes: Routes):
        return self.exchange.fetch(tables, routes)

    def update(self, optimizer, tables, opt_state, routes, exchange, rows, row_grads, lr, step):
        return self.exchange.update(optimizer, tables, opt_state, routes, exchange, row_grads, lr, step)

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
        """PartitionSpecs of a placed TrainState: dense parts replicated, tables and their state by array."""
        replicated = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
        return state.replace(
            step=P(), dense_params=replicated(state.dense_params), dense_opt_state=replicated(state.dense_opt_state),
            tables={k: self.arrays[k].spec for k in state.tables},
            sparse_opt_state={k: {f: self.arrays[k].spec for f in v} for k, v in state.sparse_opt_state.items()},
            dirty_rows={k: self.arrays[k].row_spec for k in state.dirty_rows}, dropout_rng=P(),
            aux=replicated(state.aux))

    @staticmethod
    def batch_specs(batch, stacked: bool = False):
        """A batch's PartitionSpecs: its examples split over every device (`stacked`: k batches on a leading axis,
        each split so); what a storage adds to it (a disk tier's map of the batch's rows) replicated."""
        split = placement.batch_spec(stacked)
        if batch is None or type(batch) is Batch:
            return split
        fields = {f: split for f in ("dense", "ids", "lengths", "labels")}
        return batch.replace(**fields, **{f: jax.tree.map(lambda _: P(), getattr(batch, f))
                                          for f in vars(batch) if f not in fields})

    def compile_train(self, train_step: Callable, state, batch, stacked: bool = False) -> Callable:
        specs = self.state_specs(state)
        step = jax.shard_map(train_step, mesh=self.mesh, in_specs=(specs, self.batch_specs(batch, stacked)),
                             out_specs=(specs, P()), check_vma=False)
        return jax.jit(step, donate_argnums=(0,))

    def compile_predict(self, predict_step: Callable, state, batch) -> Callable:
        specs = self.state_specs(state)
        return jax.jit(jax.shard_map(predict_step, mesh=self.mesh, in_specs=(specs, self.batch_specs(batch)),
                                     out_specs=P(ALL_AXES), check_vma=False))

    def _put(self, x):
        replicated = NamedSharding(self.mesh, P())
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(self._put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        return put_global(np.asarray(x), replicated)

    def place_dense(self, state):
        """Every dense part replicated on every device (every process holding the same value)."""
        put = self._put
        return state.replace(step=put(state.step), dense_params=jax.tree.map(put, state.dense_params),
                             dense_opt_state=jax.tree.map(put, state.dense_opt_state),
                             dropout_rng=put(state.dropout_rng), aux=jax.tree.map(put, state.aux))

    def _arrays_of(self, groups) -> dict[str, MeshArray]:
        return {name: s for name, s in self.arrays.items() if s.group in groups}

    def place_tables(self, tables, opt_state, dirty_rows, groups):
        """Single-device tables, optimizer state and dirty-row bitmaps of `groups` -> the plan's arrays, each device
        receiving only its block (in its storage's memory)."""
        arrays = self._arrays_of(groups)
        shard = lambda by_group: {name: put_global(data, self.exchange.sharding(name))  # noqa: E731
                                  for name, data in array_layout(arrays, by_group).items()}
        fields = sorted({f for g in groups for f in opt_state[g]})
        out_tables = shard({g: tables[g] for g in groups})
        by_field = {f: shard({g: opt_state[g][f] for g in groups}) for f in fields}
        out_opt = {name: {f: by_field[f][name] for f in fields} for name in arrays}
        out_dirty = {}
        if any(g in dirty_rows for g in groups):  # tracked for every group or none
            out_dirty = {name: put_global(rows, NamedSharding(self.mesh, arrays[name].row_spec))
                         for name, rows in array_layout(arrays, {g: dirty_rows[g] for g in groups}).items()}
        return out_tables, out_opt, out_dirty

    def gather_tables(self, tables, opt_state, dirty_rows, groups):
        arrays = self._arrays_of(groups)
        fields = sorted({f for name in arrays for f in opt_state[name]})
        unshard = lambda by_name: group_layout(arrays, {n: to_host(a) for n, a in by_name.items()})  # noqa: E731
        out_tables = unshard({name: tables[name] for name in arrays})
        by_field = {f: unshard({name: opt_state[name][f] for name in arrays}) for f in fields}
        out_opt = {g: {f: by_field[f][g] for f in fields} for g in out_tables}
        out_dirty = unshard({name: dirty_rows[name] for name in arrays}) if dirty_rows else {}
        return out_tables, out_opt, out_dirty

    def put_batch(self, batch, stacked: bool = False):
        return placement.put_batch(self.mesh, batch, stacked)

    def put_replicated(self, tree):
        return jax.device_put(tree, NamedSharding(self.mesh, P()))

    def process_rows(self, batch_size: int) -> slice | None:
        return placement.process_rows(self.mesh, batch_size)

    def to_host(self, array: jax.Array) -> np.ndarray:
        return to_host(array)

    def checkpoint_layout(self) -> dict:
        return mesh_layout(self.plan)

    def relayout(self) -> Callable:
        return relayout(self.collection, self.checkpoint_layout(), self.arrays)

    def rebuilt(self, collection: EmbeddingCollection, optimizer: SparseOptimizer) -> "MeshLayout":
        return MeshLayout(self.replan(collection, optimizer), self.mesh, self.exchange_dtype, self.capacity_factor,
                          self.capacity_sigmas, self.replan)

    def table_share(self, names, table_bytes: Mapping[str, int]) -> int:
        """This process's devices' blocks of the tables `names` (a replicated table once per device), by the plan."""
        plan = self.plan
        total = sum(p.device_bytes(d, plan.mesh_shape) for p in plan.placements if p.table.name in names
                    for d in range(plan.devices))
        return total * jax.local_device_count() // jax.device_count()

    def describe(self) -> str:
        return format_plan(self.plan)

    def summary(self) -> dict:
        return {"mesh_shape": dict(self.plan.mesh_shape), "processes": jax.process_count(),
                "exchange_dtype": str(self.exchange.exchange_dtype), "exchange": self.plan.exchange,
                "pooled_tables": sorted(p.table.name for p in self.plan.placements if self.plan.pooled(p.table.name))}

    def save_plan(self, workdir) -> None:
        save_plan(self.plan, workdir)

    # ------------------------------------------------------------------------------------- a storage's cache
    def cache_layouts(self, cached, batch_size, cache_fraction, cache_rows):
        from recjax.tiering.slots import plan_block_layouts

        return plan_block_layouts(self.collection, cached, self.plan, batch_size, cache_fraction, cache_rows)

    def cache_slots(self, layouts) -> dict:
        """Each group's cached tables leave the plan's arrays for a cache array of S slots per block, split like the
        plan's array that held them (recjax/tiering/slots.py `BlockSlots`)."""
        from recjax.tiering.slots import BlockSlots, cache_array, cached_holders

        collection = self.collection
        names = {layout.name: [name for name, *_ in layout.cached] for layout in layouts}
        holders = cached_holders(mesh_arrays(collection, self.plan), names, collection)
        self.skipped = self.skipped | frozenset(n for v in names.values() for n in v)
        arrays = mesh_arrays(collection, self.plan, self.skipped)
        for layout in layouts:
            mine = np.array([p.table.name in names[layout.name] for p in collection.physical_tables()
                             if p.group == layout.name])
            array = cache_array(holders[layout.name], mine, layout.slots)
            self.extra_arrays[array.name] = array
        arrays.update(self.extra_arrays)
        return {layout.name: BlockSlots(layout, holders[layout.name], arrays, self.mesh) for layout in layouts}
