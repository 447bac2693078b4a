"""The one implementation of the step's embedding interface: a layout and a storage per table group, composed.

    PlacedEmbedding(collection, layout, storages)    `recjax.placement.build` makes it from the config

The layout (recjax/placement/layout.py: `OneDevice`; recjax/sharding/layout.py: `MeshLayout`) routes the batch,
moves rows across its devices and compiles the step; each group's storage (recjax/embedding_backend.py `Storage`)
reads and updates the rows where they live, rewrites the routes where its arrays hold other rows than the group's
stacked ones (a cache), and does its host-side work per batch (`prepares`: the storage's `put_batch`, then
`prepare_train` / `prepare_predict` before each step, which the compiled steps are wrapped in: `PreparedStep`).
Nothing here knows a layout's or a storage's type: whatever differs is theirs.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from recjax.batch import Batch
from recjax.embedding import EmbeddingCollection, Routes
from recjax.embedding_backend import DeviceStorage, EmbeddingBackend, Layout, MemoryBytes, Storage
from recjax.placement.layout import OneDevice
from recjax.sparse_optim import SparseOptimizer


@flax.struct.dataclass
class StepBatch(Batch):
    """A batch as a compiled step takes it when a storage works on the host per batch: what each such storage adds
    ({storage name: pytree}, e.g. a disk tier's map of the batch's rows to its cache slots; a mesh replicates it),
    and a train step's route when `put_batch` made it ahead of the step (None: the step routes the batch)."""

    extras: dict = flax.struct.field(default_factory=dict)
    routes: Routes | None = None


@dataclasses.dataclass
class PreparedBatch:
    """What `put_batch` hands the trainer when a storage prepares batches: the batch on the devices, each such
    storage's host-side view of it ({storage name: ...}), and the train step's route made ahead (or None)."""

    batch: Batch
    extras: dict
    routes: Routes | None = None


def one_step_only(preparing: Sequence[Storage]) -> str:
    """Why a placement with storages working on the host per batch takes one step per call."""
    names = ", ".join(sorted({s.name for s in preparing}))
    return (f"train.steps_per_call must be 1 with tables in the {names} tier: it plans each step's rows on the host "
            "before the step (its cache holds one step's rows), so a call runs one step; set train.steps_per_call=1 "
            "(or \"auto\")")


class PlacedEmbedding(EmbeddingBackend):
    """`collection`'s tables placed by `layout`, each group's rows in the storage of `storages` that covers it."""

    def __init__(self, collection: EmbeddingCollection, layout: Layout, storages: Sequence[Storage]):
        self.collection, self.layout, self.storages = collection, layout, tuple(storages)
        self.storage_of = {g: s for s in self.storages for g in s.groups}
        missing = sorted(set(collection.group_rows) - set(self.storage_of))
        assert not missing and len(self.storage_of) == sum(len(s.groups) for s in self.storages), missing
        layout.bind(collection, self.storage_of)
        self.shards = layout.shards
        limits = [n for n in (layout.steps_in_flight, *(s.steps_in_flight for s in self.storages)) if n is not None]
        self.steps_in_flight = min(limits) if limits else None
        self.preparing = tuple(s for s in self.storages if s.prepares)
        self.one_step_only = one_step_only(self.preparing) if self.preparing else None
        self.placing = tuple(s for s in self.storages if s.places)
        self.restores_single_device = self.checkpoint_layout() is None
        self.restores_by_rows = frozenset(g for s in self.placing for g in s.groups)

    # ------------------------------------------------------------------------------------------- device side
    def route(self, batch, aux: Mapping, *, train: bool) -> Routes:
        premade = train and getattr(batch, "routes", None) is not None
        routes = batch.routes if premade else self.layout.route(batch, aux, train=train)
        for s in self.storages:
            routes = s.rewrite_routes(routes, batch, train=train, premade=premade)
        return routes

    def fetch(self, tables, routes):
        return self.layout.fetch(tables, routes)

    def update(self, optimizer, tables, opt_state, routes, exchange, rows, row_grads, lr, step):
        return self.layout.update(optimizer, tables, opt_state, routes, exchange, rows, row_grads, lr, step)

    def update_aux(self, aux, ids, routes, g_emb, step):
        return self.layout.update_aux(aux, ids, routes, g_emb, step)

    def all_reduce(self, tree):
        return self.layout.all_reduce(tree)

    def device_rng(self, rng: jax.Array) -> jax.Array:
        return self.layout.device_rng(rng)

    def step_metrics(self, exchange) -> dict[str, jax.Array]:
        return self.layout.step_metrics(exchange)

    # --------------------------------------------------------------------------------------------- host side
    def init_tables(self, rng: jax.Array, optimizer: SparseOptimizer) -> tuple[dict, dict]:
        """The single-device tables, except the groups of storages that place themselves (a disk tier writes its
        cached rows to its files, bit for bit the same, and keeps a cache)."""
        collection, tables, opt_state = self.collection, {}, {}
        for s in self.placing:
            t, o = s.init_tables(rng, optimizer)
            tables.update(t)
            opt_state.update(o)
        for g in sorted(collection.group_rows):
            if g not in tables:
                tables[g] = collection.init_group(rng, g)
                opt_state[g] = optimizer.init(collection.group_rows[g], collection.group_dims[g])
        return tables, opt_state

    def compile_train(self, train_step: Callable, state, stacked: bool = False):
        for s in self.storages:
            if s.read_only:
                raise TypeError(f"the {s.name} storage is read-only: it compiles predict steps only")
        if stacked and self.preparing:
            raise ValueError(self.one_step_only)
        if not self.preparing:
            return self.layout.compile_train(train_step, state, None, stacked)
        return PreparedStep(self, lambda batch: self.layout.compile_train(train_step, state, batch), train=True)

    def compile_predict(self, predict_step: Callable, state):
        if not self.preparing:
            return self.layout.compile_predict(predict_step, state, None)
        return PreparedStep(self, lambda batch: self.layout.compile_predict(predict_step, state, batch), train=False)

    def place_state(self, state):
        """A state in the single-device layout ({group: rows}; groups of self-placing storages may come as their
        `init_tables` made them) -> this placement's: each self-placing storage lays its groups out, the layout the
        others (in their storages' memory) and the dense parts."""
        tables, opt_state, dirty = self._per_storage(state, lambda s: s.place(state), self.layout.place_tables)
        state = self.layout.place_dense(state)
        return state.replace(tables=tables, sparse_opt_state=opt_state, dirty_rows=dirty)

    def _per_storage(self, state, own: Callable, others: Callable) -> tuple[dict, dict, dict]:
        """(tables, optimizer state, dirty rows) by group: each self-placing storage's groups from `own(storage)`,
        the other groups from `others(tables, opt_state, dirty_rows, groups)` (the layout's, for their memory)."""
        parts = [own(s) for s in self.placing]
        rest = [g for g in sorted(self.collection.group_rows) if self.storage_of[g] not in self.placing]
        if rest:
            parts.append(others(state.tables, state.sparse_opt_state, state.dirty_rows, rest))
        tables, opt_state, dirty = {}, {}, {}
        for t, o, d in parts:
            tables.update(t)
            opt_state.update(o)
            dirty.update(d)
        return tables, opt_state, dirty

    def _plain(self) -> bool:
        """The state is already the single-device one (one device, every group in device memory)."""
        return self.layout.single_device_state and all(s.resident and s.memory_kind is None and not s.places
                                                for s in self.storages)

    def checkpoint_state(self, state):
        """`state` as a checkpoint records it: as it is in the layout's checkpoint layout (a mesh's arrays); else
        the single-device layout, self-placing storages' groups as they give them (a disk tier's rows read where
        they live, `RowBlocks`), the others gathered to the host."""
        if self.checkpoint_layout() is not None or (self.layout.single_device_state and not self.placing):
            return state
        tables, opt_state, dirty = self._per_storage(state, lambda s: s.checkpoint_view(state),
                                                     self.layout.gather_tables)
        if not state.dirty_rows:
            dirty = {}
        return self.layout.gather_dense(state).replace(tables=tables, sparse_opt_state=opt_state, dirty_rows=dirty)

    def local_state(self, state):
        """The single-device layout of `state`, its tables on the device (every row: holds every table whole; for a
        dynamic table's adjustment, and tests)."""
        if self._plain():
            return state
        view = self.checkpoint_state(state)
        if view is state:
            view = self.layout.gather_dense(state).replace(**dict(zip(
                ("tables", "sparse_opt_state", "dirty_rows"),
                self.layout.gather_tables(state.tables, state.sparse_opt_state, state.dirty_rows,
                                          sorted(self.collection.group_rows)), strict=True)))
        device = lambda tree: jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), tree)  # noqa: E731
        return view.replace(tables=device(view.tables), sparse_opt_state=device(view.sparse_opt_state),
                            dirty_rows=device(view.dirty_rows), aux=device(view.aux))

    def checkpoint_saved(self, dirty_rows_cleared: bool) -> None:
        for s in self.storages:
            s.checkpoint_saved(dirty_rows_cleared)

    def checkpoint_layout(self) -> dict | None:
        """What a checkpoint records of where the rows are: the layout's, unless a storage places its groups itself
        (its view is the single-device layout, and so is the checkpoint's)."""
        return None if any(s.places for s in self.storages) else self.layout.checkpoint_layout()

    def relayout(self) -> Callable:
        """(by_key, saved layout) -> by_key in `checkpoint_layout()` (recjax/sharding/relayout.py)."""
        if self.checkpoint_layout() is None:
            from recjax.sharding.relayout import relayout

            return relayout(self.collection, None)
        return self.layout.relayout()

    def put_batch(self, batch, stacked: bool = False):
        if stacked and self.preparing:
            raise ValueError(self.one_step_only)
        device = self.layout.put_batch(batch, stacked)
        if not self.preparing:
            return device
        extras, routes = {}, None
        for s in self.preparing:
            extras[s.name], made = s.put_batch(device)
            routes = made if made is not None else routes
        return PreparedBatch(device, extras, routes)

    def process_rows(self, batch_size: int) -> slice | None:
        return self.layout.process_rows(batch_size)

    def to_host(self, array: jax.Array) -> np.ndarray:
        return self.layout.to_host(array)

    def rebuilt(self, collection: EmbeddingCollection, optimizer: SparseOptimizer) -> "PlacedEmbedding":
        return PlacedEmbedding(collection, self.layout.rebuilt(collection, optimizer),
                               [s.rebuilt(collection) for s in self.storages])

    # --------------------------------------------------------------------------------------------- accounting
    def _table_bytes(self, optimizer: SparseOptimizer | None) -> tuple[dict[str, int], int]:
        """({physical table: rows + optimizer state bytes}, the rest of the accounting: glue params, aux arrays)."""
        tables = {p.table.name: 4 * p.table.rows * p.table.dim
                  + (optimizer.state_bytes(p.table.rows, p.table.dim) if optimizer else 0)
                  for p in self.collection.physical_tables()}
        accounting = self.collection.accounting(optimizer)
        return tables, accounting["bytes"] + accounting["optimizer_bytes"] - sum(tables.values())

    def memory_bytes(self, optimizer: SparseOptimizer | None) -> MemoryBytes:
        """Bytes of rows and optimizer state this process holds in device memory and in host memory (the memory
        check before a run; a disk tier's files count in neither)."""
        tables, rest = self._table_bytes(optimizer)
        device, host = rest, 0
        for s in self.storages:
            use = s.memory_use(optimizer)
            device += self.layout.table_share(use.device_tables, tables) + use.device_extra
            host += self.layout.table_share(use.host_tables, tables) + use.host_extra
        return MemoryBytes(int(device), int(host))

    def checkpoint_bytes(self, optimizer: SparseOptimizer | None) -> int:
        """Bytes a checkpoint baseline copies out of this process's state (the memory check counts the saves'
        buffers in multiples of it): the state it holds, but a self-placing storage's groups, which a baseline
        reads and writes a block at a time (`Storage.checkpoint_bytes`)."""
        tables, rest = self._table_bytes(optimizer)
        total = rest
        for s in self.storages:
            streamed = s.checkpoint_bytes(optimizer)
            if streamed is not None:
                total += streamed
                continue
            use = s.memory_use(optimizer)
            total += self.layout.table_share(use.device_tables | use.host_tables, tables)
        return max(int(total), 0)

    def describe(self) -> str | None:
        parts = [self.layout.describe(), *(s.describe() for s in self.storages)]
        return "\n".join(p for p in parts if p) or None

    def summary(self) -> dict:
        out = dict(self.layout.summary())
        for s in self.storages:
            out.update(s.summary())
        return out

    def save_plan(self, workdir) -> None:
        self.layout.save_plan(workdir)

    def finish(self, state) -> None:
        for s in self.storages:
            s.finish(state)

    def close(self) -> None:
        errors = []
        for s in self.storages:
            try:
                s.close()
            except BaseException as error:  # close every storage, then raise the first error
                errors.append(error)
        if errors:
            raise errors[0]


class PreparedStep:
    """A compiled step behind the storages' host-side work: each call prepares the batch (`prepare_train` /
    `prepare_predict` of every storage that `prepares`) and runs the step. Lowers and compiles like a jitted function
    (the trainer compiles it up front); `compile` builds the layout's step for the batch's structure."""

    def __init__(self, placed: PlacedEmbedding, compile: Callable, *, train: bool, step=None, compiled=None):
        self.placed, self.compile_for, self.train = placed, compile, train
        self.step, self.compiled = step, compiled

    def _step(self, example):
        if self.step is None:
            self.step = self.compile_for(example)
        return self.step

    def _batch(self, pb: PreparedBatch, extras: dict) -> StepBatch:
        b = pb.batch
        return StepBatch(dense=b.dense, ids=b.ids, lengths=b.lengths, labels=b.labels, extras=extras,
                         routes=pb.routes if self.train else None)

    def lower(self, state, pb: PreparedBatch) -> "_Lowered":
        extras = {}
        for s in self.placed.preparing:
            state, extras[s.name] = s.example(state, pb, train=self.train)
        batch = self._batch(pb, extras)
        return _Lowered(self, self._step(batch).lower(state, batch))

    def __call__(self, state, pb: PreparedBatch):
        extras = {}
        for s in self.placed.preparing:
            state, extras[s.name] = (s.prepare_train if self.train else s.prepare_predict)(state, pb)
        batch = self._batch(pb, extras)
        out = (self.compiled or self._step(batch))(state, batch)
        if self.train:
            for s in self.placed.preparing:
                s.stepped(out[0])
        return out

    def cost_analysis(self):
        return self.compiled.cost_analysis()


@dataclasses.dataclass
class _Lowered:
    owner: PreparedStep
    lowered: object

    def compile(self) -> PreparedStep:
        o = self.owner
        return PreparedStep(o.placed, o.compile_for, train=o.train, step=o.step, compiled=self.lowered.compile())


def one_device(collection: EmbeddingCollection) -> PlacedEmbedding:
    """Every table in device memory on one device (the default of the step and evaluation functions)."""
    return PlacedEmbedding(collection, OneDevice(), [DeviceStorage(collection, sorted(collection.group_rows))])
