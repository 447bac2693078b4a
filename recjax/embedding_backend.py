"""The interface the train / eval step is written against: where the embedding rows live, seen from the step.

The step (`recjax/step.py`) asks the embedding side for three things and knows nothing else about placement:

    routes      = backend.route(batch, aux, train=...)      # a batch's ids -> typed `Routes` (int math, dedup)
    rows, xchg  = backend.fetch(tables, routes)             # what the loss is differentiated against
    tables, opt, touched = backend.update(optimizer, ...)   # d loss / d rows -> the sparse update, in place

plus the few collective hooks a data-parallel step needs (`all_reduce` of the loss and dense gradients, a per-device
dropout key, the routing arrays' update from the whole batch) and, on the host, how to compile the step, place the
state and the batches.

One class implements it: `recjax.placement.embedding.PlacedEmbedding`, a *layout* (one device, or a mesh) composed
with a *storage* per table group (device memory, host memory, disk behind a RAM cache, read-only serving tables) by
`recjax.placement.build` -- a new placement is a new layout or storage, never a new implementation of this
interface nor a branch in the step (WORKSPACE.md: how to add a storage). The two parts' interfaces are here too:

`Layout` -- where the step runs and how a table group's rows are spread over the devices: one device
(`recjax.placement.layout.OneDevice`) or a mesh (`recjax.sharding.layout.MeshLayout`). A layout owns what does not
depend on the memory the rows are in: compiling the step (jit; on a mesh, jit of shard_map), the collectives a
data-parallel step needs (`all_reduce`, `device_rng`, the routing arrays' update from the whole batch), putting a
batch on the devices, laying a single-device state out (and back) and what a checkpoint records of that layout; and
the lookup and sparse update across its devices (`fetch`, `update`), asking each group's storage to read or update
rows at the device that holds them. A storage that keeps a cache of a group's rows on the device asks the layout
where the slots go (`cache_slots`, recjax/tiering/slots.py).

`Storage` -- what memory a table group's rows live in, and how a step reads and updates them there. A storage covers
the stacked groups `placement.build` gave it (one storage per kind; each group has exactly one). At the device
holding an array, the layout asks the array's storage to

    rows = storage.bring(group, array, ids)           # only when not `resident`: rows f32[n, d] on the device
    array, state = storage.apply(group, optimizer, array, state, ids, current, grads, lr, step, kernel)
    array = storage.scatter_add(group, optimizer, array, ids, grads, lr, step)        # the route without dedup

A `resident` storage's arrays are ordinary device arrays, which the layout gathers from (and the kernels pool from)
in place; the others' rows are brought to the device first (host memory, serving tables stored quantized). On the
host, a storage may place its groups itself (`places`: a disk tier writes rows to files and keeps a cache in the
state), work per batch (`prepares`: a disk tier plans its cache and reads the batch's misses before the step), and
keep its own checkpoint view, accounting, description and summary. The defaults are device memory's
(`DeviceStorage`); a new storage subclasses `Storage`, overrides what differs, and gets one line in
`recjax.placement.STORAGES` (WORKSPACE.md: how to add a storage).
"""

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from recjax.embedding import EmbeddingCollection, Lookups, Routes
from recjax.sparse_optim import SparseOptimizer, scatter_apply, sparse_apply

Rows = Mapping[str, jax.Array] | Lookups  # what `fetch` returns: distinct rows by group, or bags already pooled


class MemoryBytes(NamedTuple):
    """Bytes of embedding rows and optimizer state a process holds in device memory and in host memory."""

    device: int
    host: int


class EmbeddingBackend(abc.ABC):
    """A placement of a collection's physical tables.

    Device side: `route`, `fetch`, `update`, `update_aux`, `all_reduce`, `device_rng` and `step_metrics` run inside
    the compiled step, on one device's share of the batch. Host side: `compile_train` / `compile_predict` turn a
    step written against this interface into an executable, `place_state` / `local_state` move a TrainState between
    the single-device layout and this placement's, `put_batch` places a host batch.
    """

    collection: EmbeddingCollection
    # Devices a batch is split over: each computes its loss as its local mean / shards, and `all_reduce` sums.
    shards: int = 1
    # The trainer waits for the step dispatched this many steps earlier (None: never waits).
    steps_in_flight: int | None = None
    # Why a compiled call runs one step here (None: k steps a call, `compile_train(..., stacked=True)`).
    one_step_only: str | None = None
    # A checkpoint restores into the single-device layout, which `place_state` then lays out; False: into this
    # placement's own layout (a mesh's arrays).
    restores_single_device: bool = True
    # Table groups a restore hands `place_state` as arrays read from the checkpoint by row blocks (`RowBlocks`,
    # recjax/checkpoint/streamed.py) instead of whole: a disk tier's, which need not fit in memory.
    restores_by_rows: frozenset[str] = frozenset()

    # ------------------------------------------------------------------------------------------- device side
    @abc.abstractmethod
    def route(self, batch, aux: Mapping, *, train: bool) -> Routes:
        """The batch's ids routed to stacked rows; `train` False for a forward-only step."""

    @abc.abstractmethod
    def fetch(self, tables: Mapping[str, jax.Array], routes: Routes) -> tuple[Rows, Any]:
        """(rows, exchange): the values the loss is differentiated against, and whatever `update` needs to send
        their gradients back (None when nothing)."""

    @abc.abstractmethod
    def update(self, optimizer: SparseOptimizer, tables: Mapping[str, jax.Array], opt_state: Mapping[str, dict],
               routes: Routes, exchange: Any, rows: Rows, row_grads: Rows, lr: jax.Array, step: jax.Array
               ) -> tuple[dict, dict, dict[str, jax.Array]]:
        """(tables, opt_state, touched): the sparse optimizer applied to the rows the step read, and the rows each
        table array had updated ({key: i32[M]}, padded with an out-of-range id) for the dirty-row bitmaps."""

    @abc.abstractmethod
    def update_aux(self, aux: Mapping, ids: Mapping[str, jax.Array], routes: Routes, g_emb: jax.Array | None,
                   step: jax.Array) -> dict:
        """The dynamic methods' routing arrays after a step (FIITED's utility), from this step's ids."""

    @abc.abstractmethod
    def all_reduce(self, tree):
        """Sum over the devices the batch is split over (the identity on one)."""

    @abc.abstractmethod
    def device_rng(self, rng: jax.Array) -> jax.Array:
        """This device's dropout key from the step's key (the same key on one device)."""

    @abc.abstractmethod
    def step_metrics(self, exchange: Any) -> dict[str, jax.Array]:
        """Extra per-step metrics of the placement (e.g. how many exchanges fell back to worst-case buckets)."""

    # --------------------------------------------------------------------------------------------- host side
    @abc.abstractmethod
    def init_tables(self, rng: jax.Array, optimizer: SparseOptimizer) -> tuple[dict, dict]:
        """The initial tables and their optimizer state ({group: ...}) from the tables' init key, as `place_state`
        takes them (the single-device layout, but groups a storage makes itself: a disk tier's, bit for bit the
        same rows)."""

    @abc.abstractmethod
    def compile_train(self, train_step: Callable, state, stacked: bool = False) -> Callable:
        """jit of `train_step(state, batch) -> (state, metrics)` with the state donated; `state` is an example of
        this placement's state (its structure). `stacked`: the step takes k batches stacked on a new leading axis
        (`put_batch(..., stacked=True)`; recjax/step.py scans over them)."""

    @abc.abstractmethod
    def compile_predict(self, predict_step: Callable, state) -> Callable:
        """jit of `predict_step(state, batch) -> probabilities f32[B]`."""

    @abc.abstractmethod
    def place_state(self, state):
        """A TrainState in the single-device layout ({group: rows}) -> this placement's layout."""

    @abc.abstractmethod
    def local_state(self, state):
        """The inverse of `place_state`: this placement's state in the single-device layout, on the device."""

    @abc.abstractmethod
    def checkpoint_state(self, state):
        """`state` as a checkpoint records it, before a save: the tables, their optimizer state and the dirty-row
        bitmaps in `checkpoint_layout()`."""

    @abc.abstractmethod
    def checkpoint_saved(self, dirty_rows_cleared: bool) -> None:
        """After a save of `checkpoint_state`: the checkpoint policy cleared the dirty-row bitmaps (or kept them)."""

    @abc.abstractmethod
    def checkpoint_layout(self) -> dict | None:
        """What a checkpoint records of where the rows are (`meta["layout"]`; None: the single-device layout)."""

    @abc.abstractmethod
    def relayout(self) -> Callable:
        """(by_key, saved layout) -> by_key in `checkpoint_layout()`: a checkpoint saved under another layout."""

    @abc.abstractmethod
    def put_batch(self, batch, stacked: bool = False):
        """A host batch (multi-host: this process's rows), or one made on the device, -> what the compiled step
        takes. `stacked`: k batches on a leading axis (f32[k, B, ...]), for a k-step call, in one transfer."""

    @abc.abstractmethod
    def process_rows(self, batch_size: int) -> slice | None:
        """The rows of every batch this process reads (None: all of them, one process)."""

    @abc.abstractmethod
    def to_host(self, array: jax.Array) -> np.ndarray:
        """The whole value of an array the step returned, as numpy (on every process)."""

    @abc.abstractmethod
    def rebuilt(self, collection: EmbeddingCollection, optimizer: SparseOptimizer) -> "EmbeddingBackend":
        """This placement for a collection whose tables changed shape (a dynamic table's compaction)."""

    @abc.abstractmethod
    def memory_bytes(self, optimizer: SparseOptimizer | None) -> MemoryBytes:
        """Bytes of tables and sparse-optimizer state this process holds in device and in host memory."""

    @abc.abstractmethod
    def checkpoint_bytes(self, optimizer: SparseOptimizer | None) -> int:
        """Bytes of tables and sparse-optimizer state a checkpoint baseline copies out of this process's state."""

    @abc.abstractmethod
    def describe(self) -> str | None:
        """What to print about the placement at the start of a run (None: nothing)."""

    @abc.abstractmethod
    def summary(self) -> dict:
        """What `summary.json` records about the placement."""

    @abc.abstractmethod
    def save_plan(self, workdir) -> None:
        """Write where the tables are into the run's workdir (a mesh: sharding_plan.txt / .json)."""

    @abc.abstractmethod
    def finish(self, state) -> None:
        """The run trained its last step (`state`): finish what the tables still owe before the summary is read (a
        disk tier writes its cache's dirty rows back to the table files it keeps)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the placement holds open (threads, files); the trainer calls it once, at the end of a run."""


# ----------------------------------------------------------------------------------------------------- layout
class Layout(abc.ABC):
    """Where the step runs. `bind` gives it the collection and each group's storage before first use."""

    # Devices a batch is split over: each computes its loss as its local mean / shards, and `all_reduce` sums.
    shards: int = 1
    # The trainer waits for the step dispatched this many steps earlier (None: never waits).
    steps_in_flight: int | None = None
    # The state's arrays are the single-device layout's ({group: rows}; a storage may keep them in another memory).
    single_device_state: bool = True

    collection: EmbeddingCollection
    storage_of: Mapping

    def bind(self, collection: EmbeddingCollection, storage_of: Mapping) -> None:
        """The collection whose tables this layout holds and {group: its storage}."""
        self.collection, self.storage_of = collection, dict(storage_of)

    # ------------------------------------------------------------------------------------------- device side
    @abc.abstractmethod
    def route(self, batch, aux: Mapping, *, train: bool) -> Routes:
        """The collection's route of this device's share of `batch`."""

    @abc.abstractmethod
    def fetch(self, tables: Mapping[str, jax.Array], routes: Routes):
        """(rows, exchange): what the loss is differentiated against, and what `update` needs to send their
        gradients back."""

    @abc.abstractmethod
    def update(self, optimizer: SparseOptimizer, tables, opt_state, routes: Routes, exchange, rows, row_grads,
               lr: jax.Array, step: jax.Array) -> tuple[dict, dict, dict]:
        """(tables, opt_state, touched): the sparse update where the rows live, and the rows each array had
        updated."""

    def update_aux(self, aux: Mapping, ids: Mapping[str, jax.Array], routes: Routes, g_emb, step: jax.Array) -> dict:
        return self.collection.update_aux(aux, ids, routes.weights, g_emb, step)

    def all_reduce(self, tree):
        return tree

    def device_rng(self, rng: jax.Array) -> jax.Array:
        return rng

    def step_metrics(self, exchange) -> dict[str, jax.Array]:
        return {}

    # --------------------------------------------------------------------------------------------- host side
    @abc.abstractmethod
    def compile_train(self, train_step: Callable, state, batch, stacked: bool = False) -> Callable:
        """jit of `train_step(state, batch)` with the state donated; `state` / `batch` examples of their structure;
        `stacked`: the batch is k batches on a new leading axis (a layout splitting a batch over devices splits its
        second axis)."""

    @abc.abstractmethod
    def compile_predict(self, predict_step: Callable, state, batch) -> Callable:
        """jit of `predict_step(state, batch)`."""

    @abc.abstractmethod
    def place_tables(self, tables: Mapping, opt_state: Mapping, dirty_rows: Mapping, groups) -> tuple:
        """The single-device arrays of `groups` ({group: rows}, their optimizer state and dirty-row bitmaps) in this
        layout, each in its storage's memory: (tables, opt_state, dirty_rows) keyed as the step's state is."""

    @abc.abstractmethod
    def gather_tables(self, tables: Mapping, opt_state: Mapping, dirty_rows: Mapping, groups) -> tuple:
        """The inverse of `place_tables` for `groups`, as host arrays in the single-device layout."""

    def place_dense(self, state):
        """The state's dense parts (params, optimizer state, step, key, routing arrays) in this layout."""
        return state

    def gather_dense(self, state):
        """The inverse of `place_dense`, on the host (prng keys as they are)."""
        host = lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else self.to_host(x)  # noqa: E731
        return state.replace(step=host(state.step), dense_params=jax.tree.map(host, state.dense_params),
                             dense_opt_state=jax.tree.map(host, state.dense_opt_state),
                             aux=jax.tree.map(host, state.aux))

    def put_batch(self, batch, stacked: bool = False):
        """A host batch (multi-host: this process's rows), or one made on the device, -> the device arrays the
        compiled step takes; `stacked`: k batches on a leading axis."""
        return jax.device_put(batch)

    def put_replicated(self, tree):
        """A host pytree every device sees whole (a disk tier's map of a batch's rows)."""
        return jax.device_put(tree)

    def process_rows(self, batch_size: int) -> slice | None:
        """The rows of every batch this process reads (None: all of them, one process)."""
        return None

    def to_host(self, array: jax.Array) -> np.ndarray:
        """The whole value of an array the step returned, as numpy (on every process): an explicit transfer, which
        `jax.transfer_guard` allows where it refuses implicit ones."""
        return np.asarray(jax.device_get(array))

    def checkpoint_layout(self) -> dict | None:
        """What a checkpoint records of where the tables' rows are (None: one device, tables keyed by group)."""
        return None

    @abc.abstractmethod
    def relayout(self) -> Callable:
        """(by_key, saved layout) -> by_key in this layout's checkpoint layout (recjax/sharding/relayout.py)."""

    def rebuilt(self, collection: EmbeddingCollection, optimizer: SparseOptimizer) -> "Layout":
        """This layout for a collection whose tables changed shape (a dynamic table's compaction)."""
        return type(self)()

    def table_share(self, names, table_bytes: Mapping[str, int]) -> int:
        """Of the tables `names` (single-device bytes `table_bytes` {table: rows + optimizer state}), the bytes this
        process's devices hold."""
        return sum(table_bytes[name] for name in names)

    def describe(self) -> str | None:
        return None

    def summary(self) -> dict:
        return {}

    def save_plan(self, workdir) -> None:  # noqa: B027 (a hook)
        """Write what says where the tables are into the run's workdir (a mesh: its sharding plan)."""

    # ------------------------------------------------------------------------------------- a storage's cache
    @abc.abstractmethod
    def cache_layouts(self, cached: Mapping[str, bool], batch_size: int, cache_fraction: float, cache_rows: int):
        """The layouts (recjax/tiering/slots.py `GroupLayout`) of the groups holding the `cached` tables ({physical
        table: its rows in a file?}): their caches' sizes, checked against one step's rows."""

    @abc.abstractmethod
    def cache_slots(self, layouts) -> dict:
        """{group: where its cache slots sit in this layout's arrays} (recjax/tiering/slots.py) for `layouts`."""


# ---------------------------------------------------------------------------------------------------- storage
@dataclasses.dataclass(frozen=True)
class MemoryUse:
    """Where a storage's rows and optimizer state are: tables the layout places in device memory and in host memory
    (it splits them over the devices), and bytes the storage holds itself on this process's devices / in its RAM."""

    device_tables: frozenset[str] = frozenset()
    host_tables: frozenset[str] = frozenset()
    device_extra: int = 0
    host_extra: int = 0


class Storage:
    """The rows of `groups` (stacked group names of `collection`), held in one kind of memory. `context`
    (recjax/placement/__init__.py `Context`) carries what a storage may need to build itself: the sparse optimizer,
    the layout, the `tiering` section, the batch size, each physical table's tier, the dataset."""

    name: str = ""  # the tier name (`recjax.placement.STORAGES`' key)
    # The arrays are device arrays the layout reads in place (gathers, the kernels); False: `bring` brings rows.
    resident: bool = True
    # Where `jax.device_put` puts the arrays (None: the device's default memory).
    memory_kind: str | None = None
    # The storage places its groups itself (`init_tables`, `place`, `local`, `checkpoint_view`); False: the layout
    # lays the single-device arrays out (with `memory_kind`).
    places: bool = False
    # Host work per batch: `put_batch` adds what the storage needs of a batch, `prepare_train` / `prepare_predict`
    # run before each step (the composition wraps the compiled steps).
    prepares: bool = False
    # Tables that cannot change shape (dynamic methods) are refused by this storage.
    static_shapes_only: bool = False
    # The trainer keeps at most this many steps queued (None: the layout's bound).
    steps_in_flight: int | None = None
    # Nothing writes a row (serving tables): train steps are refused.
    read_only: bool = False
    # On a mesh this storage's tables must be split row-wise (or placed table-wise): under `sharding.plan=auto`
    # `recjax.placement.build` pins them row-wise.
    row_wise_on_a_mesh: bool = False

    def __init__(self, collection: EmbeddingCollection, groups: Sequence[str], context=None):
        self.collection = collection
        self.groups = tuple(groups)
        self.context = context


    # ------------------------------------------------------------------------------------------- device side
    def bring(self, group: str, array: jax.Array, ids: jax.Array) -> jax.Array:
        """Rows `ids` i32[n] of `array` (group `group`'s array on this device) as f32[n, d] on the device, ids
        outside the array reading zeros. Only for storages that are not `resident`."""
        raise NotImplementedError(f"the {self.name} storage's arrays are read in place")

    def apply(self, group: str, optimizer: SparseOptimizer, array: jax.Array, state: Mapping[str, jax.Array],
              ids: jax.Array, current: jax.Array | None, grads, lr: jax.Array, step: jax.Array, kernel: str,
              interpret: bool | None = None) -> tuple[jax.Array, dict]:
        """The optimizer's row rule applied to the distinct rows `ids` i32[n] (out of range: padding) of `array` and
        their `state`, in place; `current` f32[n, d] their values (None: read them), `grads` f32[n, d] their summed
        gradients (or the `SegmentGrads` summing them: pool_from="table"); `kernel` / `interpret` as the
        collection's."""
        return sparse_apply(optimizer, array, state, ids, current, grads, lr, step, kernel=kernel, interpret=interpret)

    def scatter_add(self, group: str, optimizer: SparseOptimizer, array: jax.Array, ids: jax.Array,
                    grads: jax.Array, lr: jax.Array, step: jax.Array) -> jax.Array:
        """Every occurrence's update scatter-added into `array` at `ids` i32[n] (duplicates sum; out of range:
        dropped): the route without dedup (plain SGD)."""
        return scatter_apply(optimizer, array, ids, grads, lr, step)

    def rewrite_routes(self, routes: Routes, batch, *, train: bool, premade: bool) -> Routes:
        """The routes with this storage's groups' rows as the step's arrays index them (a disk tier: its cache
        slots; `premade`: a train route `put_batch` made); the identity for arrays holding the stacked rows."""
        return routes

    # --------------------------------------------------------------------------------------------- host side
    def tables(self) -> frozenset[str]:
        """The physical tables of this storage's groups."""
        return frozenset(p.table.name for p in self.collection.physical_tables() if p.group in self.groups)

    def memory_use(self, optimizer: SparseOptimizer | None) -> MemoryUse:
        """Where the rows are (the memory check; summary.json): the layout places them in device memory, or in host
        memory when the storage's `memory_kind` is a host one."""
        if self.memory_kind is None:
            return MemoryUse(device_tables=self.tables())
        return MemoryUse(host_tables=self.tables())

    def checkpoint_bytes(self, optimizer: SparseOptimizer | None) -> int | None:
        """Bytes a checkpoint baseline holds of this storage's groups at once, when it reads them a block at a time
        (a disk tier); None: it copies them whole, as they are held."""
        return None

    # ----------------------------------------------------------- self-placing storages (`places`): a disk tier
    def init_tables(self, rng: jax.Array, optimizer: SparseOptimizer) -> tuple[dict, dict]:
        """The initial arrays of this storage's groups, as `place` takes them."""
        raise NotImplementedError

    def place(self, state) -> tuple[dict, dict, dict]:
        """(tables, optimizer state, dirty-row bitmaps) of this storage's groups in the layout's arrays, from the
        single-device layout (or `init_tables`' arrays)."""
        raise NotImplementedError

    def checkpoint_view(self, state) -> tuple[dict, dict, dict]:
        """(tables, optimizer state, dirty-row bitmaps) of this storage's groups in the single-device layout, as a
        checkpoint records them."""
        raise NotImplementedError

    def checkpoint_saved(self, dirty_rows_cleared: bool) -> None:  # noqa: B027 (a hook)
        """After a save: the checkpoint policy cleared the dirty-row bitmaps (or kept them)."""

    # -------------------------------------------------------------- storages working per batch (`prepares`)
    def put_batch(self, batch) -> tuple[object, Routes | None]:
        """(this storage's host-side view of a batch already on the devices, a train route made ahead or None)."""
        raise NotImplementedError

    def prepare_train(self, state, prepared) -> tuple[object, object]:
        """(state, this storage's part of the step's batch) before a train step on `prepared` (`PreparedBatch`)."""
        raise NotImplementedError

    def prepare_predict(self, state, prepared) -> tuple[object, object]:
        raise NotImplementedError

    def example(self, state, prepared, *, train: bool) -> tuple[object, object]:
        """(state, batch part) of a step's shapes, to lower it (nothing moves)."""
        raise NotImplementedError

    def stepped(self, state) -> None:  # noqa: B027 (a hook)
        """After a train step was dispatched: its output state (a disk tier writes the newest rows back at the end)."""

    def describe(self) -> str | None:
        """What to print about this storage at the start of a run (None: nothing)."""
        return None

    def summary(self) -> dict:
        """What summary.json records about this storage."""
        return {}

    def finish(self, state) -> None:  # noqa: B027 (a hook)
        """The run trained its last step (`state`, the composition's): what the storage still owes before the summary
        is read (a disk tier's final write-back)."""

    def close(self) -> None:  # noqa: B027 (a hook)
        """Release what the storage holds open (threads, files)."""

    def rebuilt(self, collection: EmbeddingCollection) -> "Storage":
        """This storage for a collection whose tables changed shape (a dynamic table's compaction)."""
        return type(self)(collection, self.groups, self.context)


class DeviceStorage(Storage):
    """Device memory: each group one device array (on a mesh: the plan's blocks), read and updated in place."""

    name = "memory"
