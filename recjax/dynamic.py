"""The trainer's side of embedding tables that change shape during training (FIITED and row pruning,
compression/fiited.py): adjustments between steps, compaction, and the memory they really hold over time.

Every `interval` steps of a dynamic table (and at the step its budget ramp ends), `DynamicTables.adjust` runs the
method's `adjust` -- select the kept chunks, lay the pool out again for the new per-row counts -- in one jitted
function per table, on device: the pool, its optimizer state and the offsets are device arrays, the selection is one
sort of the table's V K chunk scores, and copying them to the host and back every interval would cost more than the
sort. It keeps every shape, so the train step does not re-compile.

When a pool holds more than (1 + compact_slack) times its current budget of chunks, `adjust` also *compacts* it
(`chunk_pool.compact`, on the host): the table's `capacity` option becomes the budget, the collection is rebuilt
from the new table specs, every stacked group is laid out again (the pool's live chunks, packed at slots 0..live-1,
keep their slots and optimizer state; the free tail is cut; the other tables keep their rows) and the caller
re-compiles its steps. Budgets only fall, so with a slack s a ramp from 1 to b compacts about log(1/b) / log(1 + s)
times, plus once at the ramp's end to the exact budget (4 times for b = 10 % and the default s = 1).

On any backend (`adjust_placed`) the adjustment runs on the single-device layout: a mesh gathers the state to it and
lays it out again after (the routing arrays are replicated there, recjax/sharding/layout.py); a compaction re-plans
the placement for the new shapes (`EmbeddingBackend.rebuilt`).

Checkpoints: the routing arrays are saved whole with every checkpoint; an adjustment marks every slot whose values
or state it changed as a dirty row (so deltas carry them: during the ramp a re-layout moves most slots, so a delta
is nearly a full save; after the ramp nothing moves); a compaction changes the tables' shapes, so the next save is a
new baseline; `loop_state` keeps the capacities, which a resume re-sizes the task to before restoring.

`history` records, at the start and after every adjustment, the embedding bytes really allocated -- every
physical table (pools at their current capacity), their optimizer state, and the methods' aux arrays
(`EmbeddingCollection.accounting`) -- with the live chunks, so the run's summary reports memory over time and its
peak, not a mask count.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from compression import chunk_pool
from compression.fiited import FiitedEmbedding
from recjax.embedding import EmbeddingCollection, EmbeddingGlue


@dataclasses.dataclass
class DynamicTables:
    """Adjusts the dynamic tables of a run of `total_steps` steps."""

    features: tuple[str, ...]
    total_steps: int
    seed: int
    history: list[dict] = dataclasses.field(default_factory=list)
    timings: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"adjustments": 0, "adjust_s": 0.0, "adjust_compile_s": 0.0, "compactions": 0,
                                 "compact_s": 0.0, "recompile_s": 0.0})
    _jitted: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def create(cls, collection: EmbeddingCollection, total_steps: int, seed: int) -> "DynamicTables | None":
        features = tuple(f for f, m in collection.methods.items() if isinstance(m, FiitedEmbedding))
        return cls(features, total_steps, seed) if features else None

    def _method(self, collection: EmbeddingCollection, feature: str) -> FiitedEmbedding:
        return collection.methods[feature]

    def ramp_end(self, collection: EmbeddingCollection) -> int:
        """The first step from which every dynamic table holds its final budget (the trainer selects from it)."""
        return max(self._method(collection, f).ramp_end(self.total_steps) for f in self.features)

    def due(self, collection: EmbeddingCollection, step: int) -> bool:
        return any(self._method(collection, f).adjusts_at(step, self.total_steps) for f in self.features)

    # ------------------------------------------------------------------------------------------ memory
    def record(self, collection: EmbeddingCollection, optimizer, state, step: int) -> dict:
        accounting = collection.accounting(optimizer)
        # On the host (numpy offsets): one transfer, no eager ops to compile.
        chunks = {f: chunk_pool.live_chunks(np.asarray(self._method(collection, f).offsets(state.aux[f])))
                  for f in self.features}
        entry = {"step": step, "embedding_bytes": accounting["bytes"],
                 "embedding_optimizer_bytes": accounting["optimizer_bytes"],
                 "allocated_bytes": accounting["bytes"] + accounting["optimizer_bytes"],
                 "live_chunks": {f: int(c.sum()) for f, c in chunks.items()},
                 # rows_by_chunks[f][c]: how many rows hold c live chunks (c = 0..K), i.e. a c D / K wide vector
                 "rows_by_chunks": {f: np.bincount(c, minlength=self._method(collection, f).chunks + 1).tolist()
                                    for f, c in chunks.items()},
                 "capacity": {f: self._method(collection, f).capacity for f in self.features}}
        self.history.append(entry)
        return entry

    def summary(self) -> dict:
        peak = max(self.history, key=lambda e: e["allocated_bytes"])
        return {"features": list(self.features), **self.timings,
                "peak_allocated_bytes": peak["allocated_bytes"], "peak_step": peak["step"],
                "final_allocated_bytes": self.history[-1]["allocated_bytes"], "memory": self.history}

    # -------------------------------------------------------------------------------------- adjustment
    def adjust(self, task, state, step: int):
        """(task, state, recompile?) after adjusting the tables due at `step`; `task` is replaced (and the steps
        must be re-compiled) when a pool was compacted."""
        collection = task.collection
        start, compiling = time.perf_counter(), self.timings["adjust_compile_s"]
        keep, compact = {}, {}
        for f in self.features:
            m = self._method(collection, f)
            if m.adjusts_at(step, self.total_steps):
                keep[f] = m.budget_chunks(m.budget_at(step, self.total_steps))
                last = step == m.ramp_end(self.total_steps)  # the final budget: no slack left allocated
                if m.capacity > (1 + m.compact_slack) * keep[f] or (last and m.capacity > keep[f]):
                    compact[f] = keep[f]
        state = self._adjust_tables(collection, task.sparse_optimizer, state, step, keep)
        jax.block_until_ready(state)
        self.timings["adjustments"] += 1
        self.timings["adjust_s"] += time.perf_counter() - start - (self.timings["adjust_compile_s"] - compiling)
        if compact:
            start = time.perf_counter()
            task, state = self._compact(task, state, compact)
            jax.block_until_ready(state)
            self.timings["compactions"] += 1
            self.timings["compact_s"] += time.perf_counter() - start
        self.record(task.collection, task.sparse_optimizer, state, step)
        return task, state, bool(compact)

    def adjust_placed(self, task, backend, state, step: int):
        """`adjust` for a state placed by `backend`: (task, backend, state, recompile?). The adjustment works on the
        single-device layout (`backend.local_state`, the identity on one device; every process of a multi-host run
        computes the same adjustment), then the state is laid out again; a compaction changes the tables' shapes,
        so the backend is rebuilt for them (a mesh makes a new plan)."""
        task, local, compacted = self.adjust(task, backend.local_state(state), step)
        if compacted:
            backend = backend.rebuilt(task.collection, task.sparse_optimizer)
        return task, backend, backend.place_state(local), compacted

    def _pool_at(self, collection: EmbeddingCollection, feature: str):
        """(group, offset, capacity) of a dynamic table's pool (its physical table 0; a fallback is table 1) in its
        stacked group."""
        (p,) = [q for q in collection.physical_tables() if q.feature == feature and q.table_index == 0]
        return p.group, p.offset, p.table.rows

    def _adjust_tables(self, collection: EmbeddingCollection, optimizer, state, step: int, keep: dict[str, int]):
        """One jitted call adjusting every table in `keep` ({feature: chunks to keep}) in place (donated)."""
        placed = tuple((f, *self._pool_at(collection, f)) for f in sorted(keep))
        key = (placed, tuple(sorted(state.dirty_rows)))
        if key not in self._jitted:
            methods = {f: self._method(collection, f) for f, *_ in placed}
            initial = {k: optimizer.initial_state_value(k) for k in optimizer.state_shapes(1, 1)}

            def run(tables, opt, aux, dirty, step, keep, rng):
                tables, opt, aux, dirty = dict(tables), {g: dict(o) for g, o in opt.items()}, dict(aux), dict(dirty)
                for f, group, offset, cap in placed:
                    before = chunk_pool.ChunkPool(
                        pool=jax.lax.dynamic_slice_in_dim(tables[group], offset, cap),
                        offsets=methods[f].offsets(aux[f]),
                        state={k: jax.lax.dynamic_slice_in_dim(s, offset, cap) for k, s in opt[group].items()},
                        chunks=methods[f].chunks)
                    pool, aux[f], fresh = methods[f].adjust(before, aux[f], step, keep[f],
                                                            jax.random.fold_in(rng, offset))
                    # A grown chunk's optimizer state starts where a new table's does (the re-layout zeroed it).
                    pool = pool.replace(state={k: jnp.where(fresh.reshape(-1, *[1] * (s.ndim - 1)), initial[k], s)
                                               if initial[k] else s for k, s in pool.state.items()})
                    if group in dirty:  # incremental checkpoints: every slot whose contents the re-layout changed
                        changed = jnp.any((pool.pool != before.pool).reshape(cap, -1), axis=1)
                        for k, s in pool.state.items():
                            changed |= jnp.any((s != before.state[k]).reshape(cap, -1), axis=1)
                        dirty[group] = jax.lax.dynamic_update_slice_in_dim(
                            dirty[group], jax.lax.dynamic_slice_in_dim(dirty[group], offset, cap) | changed,
                            offset, 0)
                    tables[group] = jax.lax.dynamic_update_slice_in_dim(tables[group], pool.pool, offset, 0)
                    opt[group] = {k: jax.lax.dynamic_update_slice_in_dim(s, pool.state[k], offset, 0)
                                  for k, s in opt[group].items()}
                return tables, opt, aux, dirty

        args = (state.tables, state.sparse_opt_state, state.aux, state.dirty_rows, jnp.int32(step),
                {f: jnp.int32(k) for f, k in keep.items()}, jax.random.fold_in(jax.random.key(self.seed), step))
        if key not in self._jitted:  # a new layout (the first adjustment, or after a compaction): compile once
            start = time.perf_counter()
            self._jitted[key] = jax.jit(run, donate_argnums=(0, 1, 2, 3)).lower(*args).compile()
            self.timings["adjust_compile_s"] += time.perf_counter() - start
        tables, opt, aux, dirty = self._jitted[key](*args)
        return state.replace(tables=tables, sparse_opt_state=opt, aux=aux, dirty_rows=dirty)

    def _compact(self, task, state, capacities: dict[str, int]):
        """Re-allocate the pools of `capacities` ({feature: new capacity}) and lay every stacked group out anew.
        On the host (numpy): compaction is rare, and eager device ops on ever new shapes would each compile."""
        old = task.collection
        new = self.with_capacities(task, capacities).collection
        host_tables = {g: np.asarray(t) for g, t in state.tables.items()}
        host_opt = {g: {k: np.asarray(s) for k, s in o.items()} for g, o in state.sparse_opt_state.items()}
        moved = {}
        for f, cap in capacities.items():
            group, offset, rows = self._pool_at(old, f)
            moved[f] = chunk_pool.compact(chunk_pool.ChunkPool(
                pool=host_tables[group][offset:offset + rows],
                offsets=np.asarray(self._method(old, f).offsets(state.aux[f])),
                state={k: s[offset:offset + rows] for k, s in host_opt[group].items()},
                chunks=self._method(old, f).chunks), cap)
        old_at = {(p.feature, p.table_index): p for p in old.physical_tables()}

        def layout(group: str, array_of, moved_of) -> jax.Array:
            parts = []
            for p in new.physical_tables():
                if p.group == group:
                    if p.feature in moved and p.table_index == 0:  # the pool (a fallback keeps its rows)
                        parts.append(moved_of(moved[p.feature]))
                    else:
                        q = old_at[(p.feature, p.table_index)]
                        parts.append(array_of(q.group)[q.offset:q.offset + q.table.rows])
            return jnp.asarray(np.concatenate(parts))

        tables = {g: layout(g, host_tables.__getitem__, lambda pool: pool.pool) for g in new.group_rows}
        opt = {g: {k: layout(g, lambda q, k=k: host_opt[q][k], lambda pool, k=k: pool.state[k])
                   for k in host_opt[g]} for g in new.group_rows}
        for g in tables:
            assert tables[g].shape[0] == new.group_rows[g], (g, tables[g].shape, new.group_rows[g])
        task = dataclasses.replace(task, collection=new, glue=EmbeddingGlue(new))
        # New shapes: a checkpointed run's next save is a baseline (recjax/checkpoint/), so the bitmaps restart.
        dirty = {g: jnp.zeros(new.group_rows[g], jnp.bool_) for g in state.dirty_rows}
        return task, state.replace(tables=tables, sparse_opt_state=opt, dirty_rows=dirty)

    @staticmethod
    def with_capacities(task, capacities: dict[str, int]):
        """`task` with the pools of `capacities` ({feature: slots}) re-sized: a new collection and glue."""
        old = task.collection
        specs = [dataclasses.replace(s, options={**s.options, "capacity": int(capacities[f])})
                 if f in capacities else s for f, s in old.table_specs.items()]
        new = EmbeddingCollection(old.spec, specs, old.pooling, old.bounds_check, old.kernel, old.dedup,
                                  old.pool_from, old.kernel_choice)
        return dataclasses.replace(task, collection=new, glue=EmbeddingGlue(new))

    # ------------------------------------------------------------------------------------- checkpoints
    def loop_state(self, collection: EmbeddingCollection) -> dict:
        """What a checkpoint keeps to resume: the pools' capacities (the shapes to restore into), the memory history
        and the timings so far."""
        return {"capacities": {f: self._method(collection, f).capacity for f in self.features},
                "history": list(self.history), "timings": dict(self.timings)}

    def resume(self, task, saved: dict):
        """`task` re-sized to a checkpoint's capacities, with its history and timings restored."""
        self.history, self.timings = list(saved["history"]), {**self.timings, **saved["timings"]}
        return self.with_capacities(task, saved["capacities"])
