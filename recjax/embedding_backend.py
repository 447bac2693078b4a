"""Where the embedding rows live, behind the one interface the train / eval step is written against.

The step (`recjax/step.py`) asks the embedding side for three things and knows nothing else about placement:

    routes      = backend.route(batch, aux, train=...)      # a batch's ids -> typed `Routes` (int math, dedup)
    rows, xchg  = backend.fetch(tables, routes)             # what the loss is differentiated against
    tables, opt, touched = backend.update(optimizer, ...)   # d loss / d rows -> the sparse update, in place

plus the few collective hooks a data-parallel step needs (`all_reduce` of the loss and dense gradients, a per-device
dropout key, the routing arrays' update from the whole batch) and, on the host, how to compile the step, place the
state and the batches. Each placement of the physical tables is one subclass:

    LocalEmbedding   one device: the collection's own route / gather / sparse_update (this module)
    MeshEmbedding    a sharding plan over a jax Mesh: per-device blocks and collectives under shard_map
                     (recjax/sharding/backend.py)
    TieredEmbedding  tables on disk (or in host RAM) behind an in-RAM cache of rows: the step sees the cache and
                     cache slots; each batch's misses are read while the previous step runs (recjax/tiering)
    MeshTieredEmbedding  the same on a mesh: each device block's cached rows behind its own cache, the caches one
                     more storage the exchange serves (recjax/tiering/mesh.py)

A new placement (read-only serving tables) is a new subclass, never a branch in the step.
"""

import abc
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from recjax.embedding import EmbeddingCollection, Lookups, Routes
from recjax.sparse_optim import SparseOptimizer

Rows = Mapping[str, jax.Array] | Lookups  # what `fetch` returns: distinct rows by group, or bags already pooled


class EmbeddingBackend(abc.ABC):
    """One placement of a collection's physical tables.

    Device side: `route`, `fetch`, `update`, `update_aux`, `all_reduce`, `device_rng` and `step_metrics` run inside
    the compiled step, on one device's share of the batch. Host side: `compile_train` / `compile_predict` turn a
    step written against this interface into an executable, `place_state` / `local_state` move a TrainState between
    the single-device layout and this backend's, `put_batch` places a host batch.
    """

    collection: EmbeddingCollection
    # Devices a batch is split over: each computes its loss as its local mean / shards, and `all_reduce` sums.
    shards: int = 1
    # The trainer waits for the step dispatched this many steps earlier (None: never waits).
    steps_in_flight: int | None = None
    # A checkpoint restores into the single-device layout, which `place_state` then lays out (a placement whose state
    # does not hold its tables whole: a disk tier writes the restored rows to its files); False: into this layout.
    restores_single_device: bool = False
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

    def update_aux(self, aux: Mapping, ids: Mapping[str, jax.Array], routes: Routes, g_emb: jax.Array | None,
                   step: jax.Array) -> dict:
        """The dynamic methods' routing arrays after a step (FIITED's utility), from this step's ids."""
        return self.collection.update_aux(aux, ids, routes.weights, g_emb, step)

    def all_reduce(self, tree):
        """Sum over the devices the batch is split over (the identity on one)."""
        return tree

    def device_rng(self, rng: jax.Array) -> jax.Array:
        """This device's dropout key from the step's key (the same key on one device)."""
        return rng

    def step_metrics(self, exchange: Any) -> dict[str, jax.Array]:
        """Extra per-step metrics of the placement (e.g. how many exchanges fell back to worst-case buckets)."""
        return {}

    # --------------------------------------------------------------------------------------------- host side
    def init_tables(self, rng: jax.Array, optimizer: SparseOptimizer) -> tuple[dict, dict]:
        """The initial tables and their optimizer state ({group: ...}), made from the tables' init key.

        By default the collection's single-device tables, which `place_state` then lays out. A placement that cannot
        hold every table whole (a disk tier) makes its own layout here, bit for bit the same rows, and its
        `place_state` passes it through."""
        return self.collection.init_tables(rng), self.collection.init_optimizer(optimizer)

    @abc.abstractmethod
    def compile_train(self, train_step: Callable, state, stacked: bool = False) -> Callable:
        """jit of `train_step(state, batch) -> (state, metrics)` with the state donated; `state` is an example of
        this backend's state (its structure). `stacked`: the step takes k batches stacked on a new leading axis
        (`put_batch(..., stacked=True)`; recjax/step.py scans over them), so a placement that splits a batch over
        devices splits its second axis."""

    @abc.abstractmethod
    def compile_predict(self, predict_step: Callable, state) -> Callable:
        """jit of `predict_step(state, batch) -> probabilities f32[B]`."""

    def place_state(self, state):
        """A TrainState in the single-device layout ({group: rows}) -> this backend's layout."""
        return state

    def local_state(self, state):
        """The inverse of `place_state`: this backend's state in the single-device layout, on the device."""
        return state

    def checkpoint_state(self, state):
        """`state` as a checkpoint records it, before a save: the tables, their optimizer state and the dirty-row
        bitmaps in the layout `checkpoint.table_record` describes (the single-device one, or the mesh's storages).
        By default the state itself; a placement whose state does not hold its tables whole (a disk tier) returns
        arrays that read the rows where they live, after writing back what only its cache holds."""
        return state

    def checkpoint_saved(self, dirty_rows_cleared: bool) -> None:  # noqa: B027 (a hook)
        """After a save of `checkpoint_state`: the checkpoint policy cleared the dirty-row bitmaps (or kept them: a
        one-shot delta). A placement keeping bitmaps of its own clears them here."""

    def put_batch(self, batch, stacked: bool = False):
        """A host batch (multi-host: this process's rows), or one made on the device, -> the device arrays the compiled
        step takes. `stacked`: k batches on a leading axis (f32[k, B, ...]), for a k-step call, in one transfer."""
        return jax.device_put(batch)

    def process_rows(self, batch_size: int) -> slice | None:
        """The rows of every batch this process reads (None: all of them, one process)."""
        return None

    def to_host(self, array: jax.Array) -> np.ndarray:
        """The whole value of an array the step returned, as numpy (on every process): an explicit transfer, which
        `jax.transfer_guard` allows where it refuses implicit ones."""
        return np.asarray(jax.device_get(array))

    def rebuilt(self, collection: EmbeddingCollection, optimizer: SparseOptimizer) -> "EmbeddingBackend":
        """This placement for a collection whose tables changed shape (a dynamic table's compaction)."""
        return type(self)(collection)

    def process_state_bytes(self, optimizer: SparseOptimizer) -> int:
        """Bytes of tables and sparse-optimizer state this process holds in memory (the memory check before a run)."""
        accounting = self.collection.accounting(optimizer)
        return accounting["bytes"] + accounting["optimizer_bytes"]

    def checkpoint_bytes(self, optimizer: SparseOptimizer) -> int:
        """Bytes of tables and sparse-optimizer state a checkpoint baseline copies out of this process's state (the
        memory check counts the saves' buffers in multiples of it): by default the state it holds."""
        return self.process_state_bytes(optimizer)

    def describe(self) -> str | None:
        """What to print about the placement at the start of a run (None: nothing)."""
        return None

    def summary(self) -> dict:
        """What `summary.json` records about the placement."""
        return {}

    def close(self) -> None:  # noqa: B027 (a hook: most placements hold nothing open)
        """Release what the placement holds open (threads, files); the trainer calls it once, at the end of a run."""


class LocalEmbedding(EmbeddingBackend):
    """Every table on one device: the collection's route, gather and sparse update as they are.

    Training routes deduplicate unless the collection's `dedup` is off (plain SGD, XLA, multi-hot bags: every
    occurrence scatter-added); forward-only steps never do (bags pool straight from the tables).
    """

    restores_single_device = True

    def __init__(self, collection: EmbeddingCollection):
        self.collection = collection

    def route(self, batch, aux: Mapping, *, train: bool) -> Routes:
        return self.collection.route(batch.ids, batch.lengths, aux=aux, dedup=None if train else False)

    def fetch(self, tables: Mapping[str, jax.Array], routes: Routes) -> tuple[Rows, None]:
        return self.collection.gather(tables, routes), None

    def update(self, optimizer, tables, opt_state, routes, exchange, rows, row_grads, lr, step):
        tables, opt_state = self.collection.sparse_update(optimizer, dict(tables), dict(opt_state), routes, rows,
                                                          row_grads, lr, step)
        return tables, opt_state, self.collection.touched_rows(routes)

    def compile_train(self, train_step: Callable, state, stacked: bool = False) -> Callable:
        return jax.jit(train_step, donate_argnums=(0,))

    def compile_predict(self, predict_step: Callable, state) -> Callable:
        return jax.jit(predict_step)
