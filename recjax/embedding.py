"""The embedding engine: logical tables -> stacked physical row tables, route, gather, combine, sparse update.

A batch flows through it in four steps (see WORKSPACE.md):

    routes = collection.route(ids, lengths)        # int math; one dedup (sort) per stacked group
    rows   = collection.gather(tables, routes)      # each distinct row once: {group: f32[N, d]}
    emb    = EmbeddingGlue(collection)(rows, routes) # Flax: pool + combine per method -> f32[B, F, D]
    tables, state = collection.sparse_update(...)   # d loss / d rows, scattered into the distinct rows only

Physical tables of equal dim (and equal `decay_scale`) are stacked into one array f32[sum(rows), dim] per *group*
(FBGEMM TBE style), each table at a static row offset, so one gather and one scatter serve many features. Within
a group all the batch's row ids are deduplicated once: `rows` holds each distinct row, bags index into it through
`slots`, and the gradient with respect to `rows` is the exact sum over duplicate ids. Padded bag slots route to
the group's row count, a sentinel that gathers zeros and is dropped by the scatter.

Without dedup (`dedup=False`: the sparse optimizer sums over duplicates, i.e. plain SGD, or a forward-only
step), the route skips the sort, `gather` pools straight from the tables (what it returns is then the pooled
vectors, the values the loss is differentiated against), and `sparse_update` scatter-adds every occurrence's
update into the table: two passes over the touched rows instead of four plus a sort.

With dedup and `pool_from="table"` (see `resolve_pool_from`), the forward also pools straight from the tables (inside
the gather-reduce kernel: no XLA gather reads a table), and the backward and the update are one fused step: the
route sorts the group's ids once with their positions (`sorted_segments`: each distinct row's occurrences are one
segment of the sorted order), and `sparse_update` hands the update each row's segment and, per occurrence, the
pooled gradient it reads and its weight (`SegmentGrads`) -- the GPU kernel sums each row's gradient in f32 and
applies the optimizer in the same program (FBGEMM's table-batched backward); XLA and the TPU kernel sum the segments
with an XLA segment sum first.
"""

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from compression import EmbeddingMethod, PhysicalTable, TableSpec, build_method
from compression.registry import METHODS
from pallas_kernels import SegmentGrads, gather, gather_reduce, sorted_segments, unique_rows
from pallas_kernels.gather_reduce import mosaic_fallback_reason, triton_fallback_reason
from pallas_kernels.traffic import training_pass_bytes
from recjax.sparse_optim import SparseOptimizer, scatter_apply, sparse_apply
from recjax.specs import DatasetSpec
from recjax.validation import check_text, choice, get, integer

POOLINGS = ("sum", "mean")
# What a jitted step does with an id outside [0, vocab_size) of a feature whose method does not hash (the host
# validator in recjax/batch.py rejects such batches before the trainer's steps; these modes guard direct callers):
#   "zero"  the id reads zeros and gets no update, and the step's routes count it in "invalid_ids" (FBGEMM's
#           WARNING bounds-check mode); "error" also raises on the host, naming the feature and the count; "off"
#           trusts the caller (an out-of-range id then reads another feature's rows).
BOUNDS_CHECKS = ("zero", "error", "off")
# Which implementation the gather-reduce and the sparse update use (pallas_kernels/dispatch.py): "xla", "pallas" (the
# platform's kernels, decided when the step is lowered), or one named kernel family, "pallas_tpu" (Mosaic) /
# "pallas_gpu" (Triton) -- on a CPU the Pallas ones run in Pallas's interpreter ("pallas": the Mosaic kernels), slow,
# for tests -- or "auto": chosen by measurement per device kind and step shape, never slower than XLA
# (recjax/kernel_choice.py, which `task.build_task` runs before building the collection). A collection built directly
# with "auto" has had no measurement and runs XLA.
KERNELS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu")
# When `embedding.kernel="auto"` measures (recjax/kernel_choice.py): "auto" (when neither the cache nor the shipped
# table has a choice for the device kind and step shape), "always" (measure again, rewrite the cache entry), "never".
KERNEL_MEASURE = ("auto", "always", "never")
# Where a deduplicated training step's forward pools its bags from: "distinct_rows" (the batch's distinct rows,
# gathered first), "table" (straight from the tables, inside the kernel), or "auto" (`resolve_pool_from`).
POOL_FROM = ("auto", "distinct_rows", "table")
# When the training route deduplicates ids: "auto" (unless the optimizer sums duplicates and the kernel is XLA; see
# `resolve_dedup`) or "always".
DEDUP_MODES = ("auto", "always")
_INIT_CHUNK_ROWS = 1 << 16  # tables are initialised in chunks so peak memory stays ~1x the table


def check_embedding(config: Mapping) -> None:
    integer(config, "embedding.dim", 1)
    choice(config, "embedding.method", sorted(METHODS))
    choice(config, "embedding.pooling", POOLINGS)
    if "bounds_check" in get(config, "embedding"):
        choice(config, "embedding.bounds_check", BOUNDS_CHECKS)
    if "kernel" in get(config, "embedding"):
        choice(config, "embedding.kernel", KERNELS)
    if "kernel_measure" in get(config, "embedding"):
        choice(config, "embedding.kernel_measure", KERNEL_MEASURE)
    if "kernel_cache" in get(config, "embedding"):
        check_text("embedding.kernel_cache", get(config, "embedding.kernel_cache"))
    if "pool_from" in get(config, "embedding"):
        choice(config, "embedding.pool_from", POOL_FROM)
    if "dedup" in get(config, "embedding"):
        choice(config, "embedding.dedup", DEDUP_MODES)


@dataclasses.dataclass(frozen=True)
class Placement:
    """One read of a physical table (one array `route` returns) and where that table lives: its group (stacked
    array) and row offset inside it."""

    feature: str
    index: int  # position among the method's route outputs (the same as table_index unless a table is read twice)
    table: PhysicalTable
    group: str
    offset: int
    table_index: int = -1  # position in the method's physical_tables()


@flax.struct.dataclass
class FeatureRoute:
    """Where one feature's bag slots read: per physical table read, `slots` i32[B, L] (with dedup: positions in
    the group's distinct rows `Routes.unique`; without: stacked row ids in the group's table), and the pooling
    weights f32[B, L] (0 for padding and skipped ids)."""

    slots: tuple[jax.Array, ...]
    weights: jax.Array


@flax.struct.dataclass
class Routes:
    """What `EmbeddingCollection.route` makes of a batch's ids, the pytree every backend and step passes along.

    unique: {group: i32[N_g]} the group's distinct stacked rows (sentinel-padded), or None without dedup.
    unique_slots: see below (pool_from="table" only).
    features: {feature: FeatureRoute} in the collection's feature order.
    invalid_ids: {feature: i32[]} ids outside [0, vocab_size) the bounds check zeroed.
    """

    unique: dict[str, jax.Array] | None
    features: dict[str, FeatureRoute]
    invalid_ids: dict[str, jax.Array]
    # pool_from="table": the features' slots are stacked row ids (the bags pool from the tables), and these say
    # where each slot's row sits in `unique` {feature: (i32[B, L], ...)}; None on the distinct-rows layout.
    unique_slots: dict[str, tuple[jax.Array, ...]] | None = None
    # pool_from="table": per group (starts i32[N_g + 1], order i32[M_g]) of `sorted_segments` -- the group's M_g bag
    # slots (in the route's order: features, then their table reads, each [B, L] flat) sorted by row, and where each
    # distinct row's run of them starts -- what the fused backward + update sums (`segment_grads`).
    segments: dict[str, tuple[jax.Array, jax.Array]] | None = None

    @property
    def deduplicated(self) -> bool:
        return self.unique is not None

    @property
    def pools_from_tables(self) -> bool:
        """The step differentiates against lookups pooled from the tables (no dedup, or pool_from="table")."""
        return self.unique is None or self.unique_slots is not None

    @property
    def batch_size(self) -> int:
        return next(iter(self.features.values())).weights.shape[0]

    @property
    def weights(self) -> dict[str, jax.Array]:
        return {f: r.weights for f, r in self.features.items()}


@flax.struct.dataclass
class Lookups:
    """Bags read by `EmbeddingCollection.lookup`: pooled {"<group>/L<bag>": f32[K, B, d]} per `pool_batches`, and
    per_id {feature: (f32[B, L, d], ...)} for methods that combine per id before pooling."""

    pooled: dict[str, jax.Array]
    per_id: dict[str, tuple[jax.Array, ...]]


def resolve_dedup(mode: str, kernel: str, optimizer: SparseOptimizer, multi_hot: bool = True) -> bool:
    """Whether training routes deduplicate: always, except in "auto" mode when every occurrence's update can simply
    be scatter-added (`optimizer.sums_duplicates`), the update runs in XLA (the Pallas update kernel works on
    distinct rows) and some feature has multi-hot bags (`multi_hot`).

    Measured with SGD: multi-hot steps are much faster without dedup, but the one-hot Kaggle shape is slower
    without, for a reason not yet found -- so one-hot-only data keeps dedup
    (benchmarks/RESULTS.md#dedup-or-not-embeddingdedup--auto).
    """
    if mode not in DEDUP_MODES:
        raise ValueError(f"unknown dedup mode '{mode}'; use one of {DEDUP_MODES}")
    xla = kernel == "xla" or (kernel == "auto" and jax.default_backend() not in ("tpu", "gpu"))
    return mode == "always" or not (optimizer.sums_duplicates and xla and multi_hot)


def resolve_pool_from(mode: str, kernel: str, cases: Sequence[tuple[str, int, int, int]]) -> str:
    """"table" or "distinct_rows". "auto" is "table" when
      - the step runs Pallas kernels (kernel "pallas*" -- on a CPU interpreted --, or "auto" on a TPU / GPU),
      - that platform's kernel takes every lookup in `cases` ((kind "reduce" / "gather", rows, dim, bag size) per
        group and bag size), so no lookup falls back to an XLA gather that reads a whole table, and
      - the analytic traffic of pooling from the table is no larger than that of gathering the distinct rows
        first (pallas_kernels/traffic.py: it is 2 U D itemsize bytes smaller for any batch);
    else "distinct_rows"."""
    if mode not in POOL_FROM:
        raise ValueError(f"unknown pool_from '{mode}'; use one of {POOL_FROM}")
    if mode != "auto":
        return mode
    backend = jax.default_backend()
    # The kernel family the step runs: a named one, else the platform's ("pallas" on a CPU: interpreted Mosaic).
    platform = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}.get(
        kernel, "tpu" if kernel == "pallas" and backend == "cpu" else backend)
    if kernel == "xla" or platform not in ("tpu", "gpu"):
        return "distinct_rows"
    fallback = mosaic_fallback_reason if platform == "tpu" else triton_fallback_reason
    if any(fallback(kind, rows, dim, jnp.float32, bag) for kind, rows, dim, bag in cases):
        return "distinct_rows"
    # The byte count at the extremes of U (every id distinct, one distinct row) for one bag of each case.
    for _, _, dim, bag in cases:
        for distinct in (bag, 1):
            sizes = dict(ids=bag, distinct=distinct, bags=1, dim=dim)
            if training_pass_bytes("table", **sizes) > training_pass_bytes("distinct_rows", **sizes):
                return "distinct_rows"
    return "table"


def group_name(table: PhysicalTable) -> str:
    """"dim16"; tables whose rows take a scaled weight decay stack apart ("dim16_decay0"), so a group has one."""
    return f"dim{table.dim}" if table.decay_scale == 1 else f"dim{table.dim}_decay{table.decay_scale:g}"


class EmbeddingCollection:
    """All sparse features of a model, compiled to stacked physical tables."""

    def __init__(self, spec: DatasetSpec, tables: Sequence[TableSpec], pooling: str = "sum",
                 bounds_check: str = "zero", kernel: str = "auto", dedup: bool = True, pool_from: str = "auto",
                 kernel_choice: Mapping | None = None):
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling '{pooling}'; use one of {POOLINGS}")
        if bounds_check not in BOUNDS_CHECKS:
            raise ValueError(f"unknown bounds_check '{bounds_check}'; use one of {BOUNDS_CHECKS}")
        self.bounds_check = bounds_check
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel '{kernel}'; use one of {KERNELS}")
        if kernel == "auto":  # not chosen by kernel_choice.choose_kernel (see KERNELS): XLA
            kernel_choice = kernel_choice or {"requested": "auto", "kernel": "xla", "source": "default",
                                              "reason": "no measured choice (recjax/kernel_choice.py): the XLA path"}
            kernel = "xla"
        self.kernel = kernel
        # Pallas kernels run interpreted on a CPU (a test exporting the accelerator step from a CPU host sets it off).
        self.interpret = kernel.startswith("pallas") and jax.default_backend() == "cpu"
        self.dedup = dedup  # the training route's default; see the module docstring
        by_name = {t.name: t for t in tables}
        missing = set(spec.feature_names) - set(by_name)
        if missing:
            raise ValueError(f"no embedding table configured for features {sorted(missing)}")
        self.spec = spec
        self.pooling = pooling
        self.table_specs: dict[str, TableSpec] = {f: by_name[f] for f in spec.feature_names}
        self.methods: dict[str, EmbeddingMethod] = {f: build_method(t) for f, t in self.table_specs.items()}
        dims = {t.dim for t in self.table_specs.values()}
        self.dim = dims.pop() if len(dims) == 1 else None  # None: features have different output dims

        # Stack physical tables by dim, in feature order, each at a static offset; one placement per read.
        self.placements: dict[str, tuple[Placement, ...]] = {}
        self.group_rows: dict[str, int] = {}
        self.group_dims: dict[str, int] = {}
        self.group_decay: dict[str, float] = {}  # each group's `decay_scale`
        for feature in spec.feature_names:
            tables, offsets = self.methods[feature].physical_tables(), []
            for table in tables:
                group = group_name(table)
                offsets.append(self.group_rows.get(group, 0))
                self.group_rows[group] = offsets[-1] + table.rows
                self.group_dims[group] = table.dim
                self.group_decay[group] = table.decay_scale
            self.placements[feature] = tuple(
                Placement(feature, i, tables[t], group_name(tables[t]), offsets[t], t)
                for i, t in enumerate(self.methods[feature].read_tables()))
        for group, rows in self.group_rows.items():
            if rows >= np.iinfo(np.int32).max:
                raise ValueError(f"stacked group {group} has {rows} rows, more than int32 row ids can address")
        # What the deduplicated training route's forward pools from (module docstring); resolved once, here.
        self.pool_from = resolve_pool_from(pool_from, kernel, self.lookup_cases())
        # How `kernel` was chosen (recjax/kernel_choice.py; the run's summary reports it).
        self.kernel_choice = dict(kernel_choice) if kernel_choice else {"requested": kernel, "kernel": kernel,
                                                                        "source": "config"}

    def lookup_cases(self) -> list[tuple[str, int, int, int]]:
        """(kind "reduce" / "gather", group rows, dim, bag size) of every distinct lookup the kernels would run."""
        return sorted({("reduce" if self.methods[p.feature].pools_before_combine else "gather",
                        self.group_rows[p.group], p.table.dim,
                        self.spec.features[self.spec.feature_names.index(p.feature)].bag_size)
                       for placed in self.placements.values() for p in placed})

    # ----------------------------------------------------------------------------------------- accounting
    @property
    def any_id_features(self) -> frozenset[str]:
        return frozenset(f for f, m in self.methods.items() if m.accepts_any_id)

    @property
    def aux_features(self) -> tuple[str, ...]:
        """Features whose method keeps `init_aux` arrays (routing that changes during training)."""
        return tuple(f for f, m in self.methods.items() if m.init_aux.__func__ is not EmbeddingMethod.init_aux)

    def physical_tables(self) -> list[Placement]:
        """Each physical table once (its first read), in stacking order."""
        first = {}
        for placed in self.placements.values():
            for p in placed:
                first.setdefault((p.feature, p.table_index), p)
        return list(first.values())

    def slots_per_example(self, table: Placement) -> int:
        """How many row ids one example reads from `table`: its feature's bag size times the reads of the table
        (FIITED reads its pool once per chunk position)."""
        reads = sum(1 for q in self.placements[table.feature] if q.table_index == table.table_index)
        return reads * self.spec.features[self.spec.feature_names.index(table.feature)].bag_size

    def init_aux(self) -> dict[str, dict[str, jax.Array]]:
        """{feature: the method's `init_aux` arrays} for the features that have any."""
        return {f: self.methods[f].init_aux() for f in self.aux_features}

    def accounting(self, optimizer: SparseOptimizer | None = None) -> dict:
        """Params and bytes per logical table and in total (f32 rows, glue params, optimizer state)."""
        per_table, tables = {}, self.physical_tables()
        for feature, method in self.methods.items():
            placed = [p for p in tables if p.feature == feature]
            rows_params = sum(p.table.params for p in placed)
            opt_bytes = sum(optimizer.state_bytes(p.table.rows, p.table.dim) for p in placed) if optimizer else 0
            spec = self.table_specs[feature]
            aux_model, aux_training = method.aux_bytes()
            per_table[feature] = {
                "method": spec.method,
                "vocab_size": spec.vocab_size,
                "dim": spec.dim,
                "physical_tables": {p.table.name: [p.table.rows, p.table.dim] for p in placed},
                "params": rows_params + method.glue_params(),
                "bytes": 4 * (rows_params + method.glue_params()) + aux_model,
                "optimizer_bytes": opt_bytes + aux_training,
                "full_bytes": 4 * spec.vocab_size * spec.dim,
            }
        total = {k: sum(t[k] for t in per_table.values())
                 for k in ("params", "bytes", "optimizer_bytes", "full_bytes")}
        return {"tables": per_table, **total}

    # --------------------------------------------------------------------------------------------- init
    def init_tables(self, rng: jax.Array) -> dict[str, jax.Array]:
        """Stacked tables, each physical table init_center + U(-init_scale, init_scale) (DLRM reference init)."""
        return {group: self.init_group(rng, group) for group in sorted(self.group_rows)}

    def init_group(self, rng: jax.Array, group: str) -> jax.Array:
        """The stacked table `init_tables` gives `group`."""
        scales, centers = self._init_bounds(group, 0, self.group_rows[group])
        return _init_uniform_rows(jax.random.fold_in(rng, sorted(self.group_rows).index(group)),
                                  self.group_rows[group], self.group_dims[group], jnp.asarray(scales),
                                  None if centers is None else jnp.asarray(centers))

    def init_chunks(self, rng: jax.Array, group: str) -> Iterator[tuple[int, np.ndarray]]:
        """The rows `init_tables` gives `group`, bit for bit, as (first row, f32[n, dim]) blocks of up to 64k rows in
        order, without ever holding the whole group (a disk tier writes them to its files one block at a time)."""
        key = jax.random.fold_in(rng, sorted(self.group_rows).index(group))
        rows, dim = self.group_rows[group], self.group_dims[group]
        for i, start in enumerate(range(0, rows, _INIT_CHUNK_ROWS)):
            scales, centers = self._init_bounds(group, start, min(start + _INIT_CHUNK_ROWS, rows))
            yield start, np.asarray(_uniform_block_jit(key, i, scales, centers, dim))

    def _init_bounds(self, group: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows [start, stop) of `group`: each row's init scale f32[n] and center f32[n] (None when every table of
        the group is centered at 0)."""
        members = [p for p in self.physical_tables() if p.group == group]
        scales = np.zeros(stop - start, np.float32)
        centers = np.zeros(stop - start, np.float32)
        for p in members:
            lo, hi = max(p.offset, start), min(p.offset + p.table.rows, stop)
            if lo < hi:
                scales[lo - start: hi - start] = p.table.init_scale
                centers[lo - start: hi - start] = p.table.init_center
        return scales, centers if any(p.table.init_center for p in members) else None

    def init_optimizer(self, optimizer: SparseOptimizer) -> dict[str, dict[str, jax.Array]]:
        return {g: optimizer.init(rows, self.group_dims[g]) for g, rows in sorted(self.group_rows.items())}

    # -------------------------------------------------------------------------------------------- route
    def route(self, ids: Mapping[str, jax.Array], lengths: Mapping[str, jax.Array], *,
              aux: Mapping[str, Mapping[str, jax.Array]] | None = None, dedup: bool | None = None) -> Routes:
        """Logical ids -> distinct stacked rows per group, and per feature where each bag slot reads (`Routes`).

        N_g (the length of a group's `unique`) is the number of bag slots feeding the group, capped at its rows + 1;
        padded slots read the sentinel row (zeros) with weight 0; so do out-of-range ids unless bounds_check is
        "off" (see BOUNDS_CHECKS). With `dedup` False `unique` is None and the slots are the stacked row ids
        themselves, indexing the group's table. `dedup` None (the training step) takes the collection's `dedup` and
        `pool_from`: with "table" the slots are the stacked row ids too, and `unique_slots` say where each slot's row
        sits in `unique`; `dedup` True is always the distinct-rows layout (the mesh exchange works on it). `aux`
        ({feature: arrays}, see `init_aux`) is required when some method keeps routing arrays.
        """
        aux = aux or {}
        missing = set(self.aux_features) - set(aux)
        assert not missing, f"route needs the aux arrays of {sorted(missing)} (TrainState.aux)"
        pool_from_table = dedup is None and self.dedup and self.pool_from == "table"
        dedup = self.dedup if dedup is None else dedup
        stacked_by_group: dict[str, list] = {g: [] for g in self.group_rows}
        weights, invalid = {}, {}
        for feature in self.spec.features:
            name = feature.name
            x, n = ids[name], lengths[name]
            assert x.ndim == 2 and x.shape[1] == feature.bag_size, (name, x.shape)
            valid = jnp.arange(feature.bag_size)[None, :] < n[:, None]
            if self.bounds_check != "off" and not self.methods[name].accepts_any_id:
                bad = valid & ((x < 0) | (x >= feature.vocab_size))
                invalid[name] = jnp.sum(bad, dtype=jnp.int32)
                valid = valid & ~bad
            scale = 1.0 / jnp.maximum(n, 1)[:, None] if self.pooling == "mean" else 1.0
            weights[name] = (valid * scale).astype(jnp.float32)
            local = self.methods[name].route(jnp.where(valid, x, 0), **aux.get(name, {}))
            for r, p in zip(local, self.placements[name], strict=True):
                # A negative local row means "this id has no row in this physical table" (e.g. mixed-dim blocks).
                stacked = jnp.where(valid & (r >= 0), r + p.offset, self.group_rows[p.group]).astype(jnp.int32)
                stacked_by_group[p.group].append(stacked)
        unique, slots_by_group, segments = {}, {}, {}
        for group, parts in stacked_by_group.items():
            if not dedup:
                slots_by_group[group] = parts
                continue
            flat = jnp.concatenate([r.reshape(-1) for r in parts])
            if pool_from_table:  # one sort that also gives each distinct row's occurrences (module docstring)
                unique[group], inverse, starts, order = sorted_segments(flat, self.group_rows[group])
                segments[group] = (starts[: self.group_rows[group] + 2], order)
            else:
                unique[group], inverse = unique_rows(flat, self.group_rows[group])
            # A group has at most group_rows distinct rows plus the sentinel, so a group smaller than the batch's
            # slots (TT cores, QR remainders) gathers and updates only that many (the dropped tail is all sentinel;
            # its segments are empty, so the kept starts still end at M).
            unique[group] = unique[group][: self.group_rows[group] + 1]
            bounds = np.cumsum([0] + [r.size for r in parts])
            slots_by_group[group] = [inverse[a:b].reshape(r.shape)
                                     for a, b, r in zip(bounds[:-1], bounds[1:], parts, strict=True)]
        features, unique_slots = {}, {}
        for name, placed in self.placements.items():
            slots = tuple(slots_by_group[p.group].pop(0) for p in placed)
            if pool_from_table:
                unique_slots[name] = slots
                slots = tuple(stacked_by_group[p.group].pop(0) for p in placed)
            features[name] = FeatureRoute(slots=slots, weights=weights[name])
        if self.bounds_check == "error" and invalid:
            counts = jnp.stack(list(invalid.values()))
            jax.lax.cond(jnp.any(counts > 0), lambda: jax.debug.callback(
                _raise_invalid_ids, tuple(invalid), {f.name: f.vocab_size for f in self.spec.features}, counts),
                lambda: None)
        return Routes(unique=unique if dedup else None, features=features, invalid_ids=invalid,
                      unique_slots=unique_slots if pool_from_table else None,
                      segments=segments if pool_from_table else None)

    @property
    def wants_embedding_grads(self) -> bool:
        """Some method's `update_aux` reads d loss / d its feature's embedding (the train step then computes it)."""
        return any(self.methods[f].wants_embedding_grads for f in self.aux_features)

    def update_aux(self, aux: Mapping, ids: Mapping[str, jax.Array], weights: Mapping[str, jax.Array],
                   g_emb: jax.Array | None, step: jax.Array) -> dict:
        """Each aux feature's arrays after a train step, from its ids i32[B, L] and pooling weights f32[B, L]
        (`Routes.weights`); g_emb f32[B, F, D] = d loss / d the glue's output."""
        names = self.spec.feature_names
        return {f: self.methods[f].update_aux(
            aux[f], ids[f], weights[f], None if g_emb is None else g_emb[:, names.index(f)], step)
            for f in self.aux_features}

    # ------------------------------------------------------------------------------------------- gather
    def gather(self, tables: Mapping[str, jax.Array], routes: Routes) -> "dict[str, jax.Array] | Lookups":
        """What the loss is differentiated against: on the distinct-rows layout, each distinct row once,
        {group: f32[N_g, d]} (the sentinel reads zeros; ids sorted, so the kernels merge runs of adjacent rows into
        one DMA); without dedup or with `pool_from="table"`, the lookups themselves, pooled from the tables (see
        `lookup`)."""
        if routes.pools_from_tables:
            return self.lookup(tables, routes.features)
        return {g: gather(tables[g], u[:, None], impl=self.kernel, interpret=self.interpret)[:, 0]
                for g, u in routes.unique.items()}

    def touched_rows(self, routes: Routes) -> dict[str, jax.Array]:
        """The stacked rows a step reads and updates, {group: i32[N_g]}: with dedup the distinct rows, without it
        every bag slot (duplicates included); padding and skipped ids are the sentinel `group_rows[group]`."""
        if routes.deduplicated:
            return dict(routes.unique)
        parts: dict[str, list[jax.Array]] = {g: [] for g in self.group_rows}
        for name, placed in self.placements.items():
            for p, slots in zip(placed, routes.features[name].slots, strict=True):
                parts[p.group].append(slots.reshape(-1))
        return {g: jnp.concatenate(v) for g, v in parts.items() if v}

    def pool_batches(self, features: Mapping[str, FeatureRoute], reads: frozenset | None = None
                     ) -> dict[str, tuple[tuple[str, int], ...]]:
        """The (feature, physical table index) pairs pooled together: one batch per (group, bag size), for the
        methods that pool before combining. Keys "<group>/L<bag>"; static (from shapes only). `reads`: only these
        (feature, index) pairs (a mesh pools the others on their tables' owners: recjax/sharding/exchange.py)."""
        batches: dict[str, list[tuple[str, int]]] = {}
        for name, method in self.methods.items():
            if method.pools_before_combine:
                for p, slots in zip(self.placements[name], features[name].slots, strict=True):
                    if reads is None or (name, p.index) in reads:
                        batches.setdefault(f"{p.group}/L{slots.shape[1]}", []).append((name, p.index))
        return {k: tuple(v) for k, v in batches.items()}

    def _batch_slots(self, features: Mapping[str, FeatureRoute], members: tuple[tuple[str, int], ...]
                     ) -> tuple[jax.Array, jax.Array]:
        """Slots and weights of a pool batch, stacked feature-major to [K, B, L] (consecutive bags of one feature
        read one table: better locality than interleaving the features)."""
        slots = jnp.stack([features[name].slots[index] for name, index in members])
        weights = jnp.stack([features[name].weights for name, _ in members])
        return slots, weights

    def lookup(self, source: Mapping[str, jax.Array], features: Mapping[str, FeatureRoute],
               reads: frozenset | None = None) -> Lookups:
        """Bags read from `source` ({group: f32[N, d]}: a batch's distinct rows, or whole tables) by the routes'
        slots (`Lookups`). One gather-reduce per pool batch. `reads`: only these (feature, index) pairs (the pool
        batches then hold only them, in `pool_batches(features, reads)`'s order)."""
        pooled = {}
        for key, members in self.pool_batches(features, reads).items():
            slots, weights = self._batch_slots(features, members)
            group = self.placements[members[0][0]][members[0][1]].group
            pooled[key] = gather_reduce(source[group], slots, weights, impl=self.kernel, interpret=self.interpret)
        per_id = {}
        for name, method in self.methods.items():
            if not method.pools_before_combine and (reads is None or (name, 0) in reads):
                per_id[name] = tuple(gather(source[p.group], s, impl=self.kernel, interpret=self.interpret)
                                     for p, s in zip(self.placements[name], features[name].slots, strict=True))
        return Lookups(pooled=pooled, per_id=per_id)

    # ------------------------------------------------------------------------------------ sparse update
    def sparse_update(self, optimizer: SparseOptimizer, tables: dict[str, jax.Array],
                      state: dict[str, dict[str, jax.Array]], routes: Routes, rows: "Mapping[str, jax.Array] | Lookups",
                      row_grads: Mapping[str, jax.Array], lr: jax.Array, step: jax.Array,
                      apply: Mapping | None = None, scatter: Mapping | None = None) -> tuple[dict, dict]:
        """Apply the optimizer to the distinct rows of each group, given d loss / d rows (what `gather` returned).

        Without dedup, `row_grads` are d loss / d lookups: each occurrence's gradient (times its pooling weight)
        is scatter-added by the optimizer's rule into its row (`scatter_apply`; duplicates sum, as in SGD). With
        `pool_from="table"` they are too, and the update sums each distinct row's exact gradient from them itself
        (`segment_grads`: the fused backward + update) and reads the rows' current values itself (`rows` is
        unused). `apply` / `scatter` ({group: fn}, default `sparse_apply` / `scatter_apply`) update a group where its
        rows live (recjax/embedding_backend.py `Storage`: host memory updates its rows on the host)."""
        if not routes.deduplicated:
            return self._scatter_update(optimizer, tables, state, routes.features, row_grads, lr, step, scatter)
        table_path = routes.pools_from_tables
        grads = self.segment_grads(routes, row_grads) if table_path else row_grads
        new_tables, new_state = dict(tables), dict(state)
        for group, unique in routes.unique.items():
            args = (self.group_optimizer(optimizer, group), tables[group], state[group], unique,
                    None if table_path else rows[group], grads[group], lr, step)
            if apply is None:
                new_tables[group], new_state[group] = sparse_apply(*args, kernel=self.kernel, interpret=self.interpret)
            else:
                new_tables[group], new_state[group] = apply[group](*args, self.kernel, self.interpret)
        return new_tables, new_state

    def segment_grads(self, routes: Routes, grads: Lookups) -> dict[str, SegmentGrads]:
        """{group: SegmentGrads}: how the fused update sums d loss / d each distinct row (`pool_from="table"`) from
        d loss / d the lookups pooled from the tables -- each occurrence adds its bag's pooled gradient times its
        pooling weight (per-id methods: its own gradient), duplicates summed exactly in f32, as autodiff does on the
        distinct-rows layout.

        A group's source rows are its pool batches' gradients [K * B, d] then its per-id gradients [B * L, d], each
        flattened; occurrence (b, l) of a pooled table read reads its bag's row, of a per-id read its own. The
        occurrences are numbered in the route's order (`Routes.segments`) and put in sorted order by `order`."""
        features, batch = routes.features, routes.batch_size
        sources: dict[str, list[jax.Array]] = {g: [] for g in routes.unique}
        first_row = dict.fromkeys(routes.unique, 0)
        base: dict[tuple[str, int], int] = {}  # (feature, table read) -> its first source row
        for key, members in self.pool_batches(features).items():
            group = self.placements[members[0][0]][members[0][1]].group
            for k, member in enumerate(members):
                base[member] = first_row[group] + k * batch
            sources[group].append(grads.pooled[key].reshape(-1, self.group_dims[group]))
            first_row[group] += len(members) * batch
        for name, per_table in grads.per_id.items():
            for p, g in zip(self.placements[name], per_table, strict=True):
                base[(name, p.index)] = first_row[p.group]
                sources[p.group].append(g.reshape(-1, self.group_dims[p.group]))
                first_row[p.group] += g.shape[0] * g.shape[1]
        source_of: dict[str, list[jax.Array]] = {g: [] for g in routes.unique}
        weight_of: dict[str, list[jax.Array]] = {g: [] for g in routes.unique}
        for name, placed in self.placements.items():  # the route's order of occurrences
            pooled_first = self.methods[name].pools_before_combine
            for p, slots in zip(placed, features[name].slots, strict=True):
                flat = jnp.arange(slots.size, dtype=jnp.int32)
                length = slots.shape[1]
                # Pooled: occurrence (b, l) reads bag b's gradient; per id: its own (the weight is inside it).
                source_of[p.group].append(base[(name, p.index)] + (flat // length if pooled_first else flat))
                weight_of[p.group].append(features[name].weights.reshape(-1) if pooled_first
                                          else jnp.ones(slots.size, jnp.float32))
        out = {}
        for group, (starts, order) in routes.segments.items():
            out[group] = SegmentGrads(starts, jnp.concatenate(source_of[group])[order],
                                      jnp.concatenate(weight_of[group])[order], jnp.concatenate(sources[group]))
        return out

    def group_optimizer(self, optimizer: SparseOptimizer, group: str) -> SparseOptimizer:
        """`optimizer` with the weight decay the group's rows take (`PhysicalTable.decay_scale`)."""
        scale = self.group_decay[group]
        return optimizer if scale == 1 else dataclasses.replace(optimizer,
                                                                weight_decay=optimizer.weight_decay * scale)

    def _scatter_update(self, optimizer: SparseOptimizer, tables: dict[str, jax.Array], state: dict,
                        features: Mapping[str, FeatureRoute], grads: Lookups, lr: jax.Array, step: jax.Array,
                        scatter: Mapping | None = None) -> tuple[dict, dict]:
        new_tables = dict(tables)
        add = (lambda group: scatter_apply) if scatter is None else scatter.__getitem__  # noqa: E731
        for key, members in self.pool_batches(features).items():
            # One scatter per member: XLA materialises a scatter's updates, and per member that temporary is
            # [B, L, d] rather than [K, B, L, d] (the scatters update the donated table in place, one after another).
            for k, (name, index) in enumerate(members):
                group = self.placements[name][index].group
                ids = features[name].slots[index].reshape(-1)
                per_id = features[name].weights[..., None] * grads.pooled[key][k][:, None, :]  # [B, L, d]
                new_tables[group] = add(group)(optimizer, new_tables[group], ids,
                                               per_id.reshape(-1, per_id.shape[-1]), lr, step)
        for name, per_table in grads.per_id.items():
            for p, slots, g in zip(self.placements[name], features[name].slots, per_table, strict=True):
                new_tables[p.group] = add(p.group)(optimizer, new_tables[p.group], slots.reshape(-1),
                                                   g.reshape(-1, g.shape[-1]), lr, step)
        return new_tables, dict(state)


class EmbeddingGlue(nn.Module):
    """Dense side of the embedding layer: per feature, read its bags (`EmbeddingCollection.lookup`), pool and
    combine (pool first when the method is linear per row, else combine per id and pool after).

    rows: what `EmbeddingCollection.gather` returned -- the distinct rows {group: f32[N_g, d]}, read here by the
    slots, or (without dedup) the `Lookups` already made from the tables; features: `Routes.features`.
    Returns f32[B, F, D] in the dataset's feature order (all features must share D).

    Every (feature, physical table) that pools first is pooled in one gather-reduce per (group, bag size), over
    slots stacked to [K, B, L]: autodiff then transposes one gather into one scatter-add into the group's rows,
    instead of one full-size scatter-add per feature (which made the glue's backward several times costlier with 8
    features in one group: benchmarks/RESULTS.md#embedding-engine-internals).
    """

    collection: EmbeddingCollection

    @nn.compact
    def __call__(self, rows: "Mapping[str, jax.Array] | Lookups", features: Mapping[str, FeatureRoute]) -> jax.Array:
        looked = rows if isinstance(rows, Lookups) else self.collection.lookup(rows, features)
        pooled = {}
        for key, members in self.collection.pool_batches(features).items():
            for k, member in enumerate(members):
                pooled[member] = looked.pooled[key][k]
        outs = []
        for name, method in self.collection.methods.items():
            placed = self.collection.placements[name]
            combine = method.combine_module(name=f"combine_{name}")
            if method.pools_before_combine:
                outs.append(combine(tuple(pooled[(name, p.index)] for p in placed)))
            else:
                outs.append(jnp.einsum("bld,bl->bd", combine(looked.per_id[name]), features[name].weights))
        return jnp.stack(outs, axis=1)


def _raise_invalid_ids(names: tuple[str, ...], vocab_sizes: dict[str, int], counts) -> None:
    bad = [f"feature '{n}': {int(c)} ids outside [0, {vocab_sizes[n]})" for n, c in zip(names, counts, strict=True)
           if c]
    raise ValueError("; ".join(bad) + " (embedding.bounds_check='error'); validate batches with "
                     "recjax.batch.validate_batch, enable hashing for these features or raise their vocab_size")


def _init_uniform_rows(rng: jax.Array, rows: int, dim: int, scales: jax.Array,
                       centers: jax.Array | None = None) -> jax.Array:
    """f32[rows, dim] with row r ~ centers[r] + U(-scales[r], scales[r]) (centers None: 0), built chunk by chunk
    inside one jit.

    Drawing the whole table at once makes XLA hold the random bits and the result together (a peak of several
    tables); chunks keep the peak near one table (benchmarks/RESULTS.md#embedding-engine-internals).
    """
    assert scales.shape == (rows,), (scales.shape, rows)
    chunk = min(_INIT_CHUNK_ROWS, rows)
    n_full, rest = divmod(rows, chunk)

    def block(scales, centers, i, size):
        return _uniform_block(rng, i, jax.lax.dynamic_slice_in_dim(scales, i * chunk, size),
                              None if centers is None else jax.lax.dynamic_slice_in_dim(centers, i * chunk, size), dim)

    @jax.jit
    def build(scales, centers):
        table = jnp.zeros((rows, dim), jnp.float32)
        table = jax.lax.fori_loop(
            0, n_full,
            lambda i, t: jax.lax.dynamic_update_slice_in_dim(t, block(scales, centers, i, chunk), i * chunk, 0),
            table)
        if rest:
            table = jax.lax.dynamic_update_slice_in_dim(table, block(scales, centers, n_full, rest), n_full * chunk,
                                                        0)
        return table

    return build(scales, centers)


def _uniform_block(rng: jax.Array, i, scales: jax.Array, centers: jax.Array | None, dim: int) -> jax.Array:
    """Init chunk i: row r ~ centers[r] + U(-scales[r], scales[r]), f32[len(scales), dim]. One definition for the
    whole-table init and `EmbeddingCollection.init_chunks`, so both give the same bits."""
    u = jax.random.uniform(jax.random.fold_in(rng, i), (scales.shape[0], dim), jnp.float32, -1.0, 1.0)
    u = u * scales[:, None]
    return u if centers is None else u + centers[:, None]


_uniform_block_jit = jax.jit(_uniform_block, static_argnums=(4,))
