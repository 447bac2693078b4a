"""The embedding engine: logical tables -> stacked physical row tables, route, gather, combine, sparse update.

A batch flows through it in four steps (see WORKSPACE.md):

    routes = collection.route(ids, lengths)       # int math: stacked row ids + pooling weights per feature
    rows   = collection.gather(tables, routes)     # pooled f32[B, d] or un-pooled f32[B, L, d] per physical table
    emb    = EmbeddingGlue(collection)(rows, ...)  # Flax: combine per method, pool if not pooled yet -> [B, F, D]
    tables, state = collection.sparse_update(...)  # gradients w.r.t. `rows` scattered into touched rows only

Physical tables of equal dim are stacked into one array f32[sum(rows), dim] per *group* (FBGEMM TBE style),
each table at a static row offset, so one gather and one scatter serve many features. Padded bag slots route
to the group's row count, a sentinel that gathers zeros and is dropped by the scatter.
"""

import dataclasses
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from compression import EmbeddingMethod, PhysicalTable, TableSpec, build_method
from pallas_kernels import gather_reduce_reference
from recjax.sparse_optim import SparseOptimizer, sparse_apply
from recjax.specs import DatasetSpec

POOLINGS = ("sum", "mean")
_INIT_CHUNK_ROWS = 1 << 16  # tables are initialised in chunks so peak memory stays ~1x the table


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one physical table lives: its group (stacked array) and row offset inside it."""

    feature: str
    index: int  # position in the method's physical_tables()
    table: PhysicalTable
    group: str
    offset: int


def group_name(dim: int) -> str:
    return f"dim{dim}"


class EmbeddingCollection:
    """All sparse features of a model, compiled to stacked physical tables."""

    def __init__(self, spec: DatasetSpec, tables: Sequence[TableSpec], pooling: str = "sum"):
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling '{pooling}'; use one of {POOLINGS}")
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

        # Stack physical tables by dim, in feature order, each at a static offset.
        self.placements: dict[str, tuple[Placement, ...]] = {}
        self.group_rows: dict[str, int] = {}
        self.group_dims: dict[str, int] = {}
        for feature in spec.feature_names:
            placed = []
            for i, table in enumerate(self.methods[feature].physical_tables()):
                group = group_name(table.dim)
                offset = self.group_rows.get(group, 0)
                placed.append(Placement(feature, i, table, group, offset))
                self.group_rows[group] = offset + table.rows
                self.group_dims[group] = table.dim
            self.placements[feature] = tuple(placed)
        for group, rows in self.group_rows.items():
            if rows >= np.iinfo(np.int32).max:
                raise ValueError(f"stacked group {group} has {rows} rows, more than int32 row ids can address")

    # ----------------------------------------------------------------------------------------- accounting
    @property
    def any_id_features(self) -> frozenset[str]:
        return frozenset(f for f, m in self.methods.items() if m.accepts_any_id)

    def physical_tables(self) -> list[Placement]:
        return [p for placed in self.placements.values() for p in placed]

    def accounting(self, optimizer: SparseOptimizer | None = None) -> dict:
        """Params and bytes per logical table and in total (f32 rows, glue params, optimizer state)."""
        per_table = {}
        for feature, placed in self.placements.items():
            method = self.methods[feature]
            rows_params = sum(p.table.params for p in placed)
            opt_bytes = sum(optimizer.state_bytes(p.table.rows, p.table.dim) for p in placed) if optimizer else 0
            spec = self.table_specs[feature]
            per_table[feature] = {
                "method": spec.method,
                "vocab_size": spec.vocab_size,
                "dim": spec.dim,
                "physical_tables": {p.table.name: [p.table.rows, p.table.dim] for p in placed},
                "params": rows_params + method.glue_params(),
                "bytes": 4 * (rows_params + method.glue_params()),
                "optimizer_bytes": opt_bytes,
                "full_bytes": 4 * spec.vocab_size * spec.dim,
            }
        total = {k: sum(t[k] for t in per_table.values())
                 for k in ("params", "bytes", "optimizer_bytes", "full_bytes")}
        return {"tables": per_table, **total}

    # --------------------------------------------------------------------------------------------- init
    def init_tables(self, rng: jax.Array) -> dict[str, jax.Array]:
        """Stacked tables, each physical table U(-init_scale, init_scale) (DLRM reference init)."""
        tables = {}
        for g, group in enumerate(sorted(self.group_rows)):
            members = [p for p in self.physical_tables() if p.group == group]
            scales = np.concatenate([np.full(p.table.rows, p.table.init_scale, np.float32) for p in members])
            tables[group] = _init_uniform_rows(jax.random.fold_in(rng, g), self.group_rows[group],
                                               self.group_dims[group], jnp.asarray(scales))
        return tables

    def init_optimizer(self, optimizer: SparseOptimizer) -> dict[str, dict[str, jax.Array]]:
        return {g: optimizer.init(rows, self.group_dims[g]) for g, rows in sorted(self.group_rows.items())}

    # -------------------------------------------------------------------------------------------- route
    def route(self, ids: Mapping[str, jax.Array], lengths: Mapping[str, jax.Array]) -> dict:
        """Logical ids -> per feature: stacked row ids per physical table and pooling weights.

        Returns {feature: {"rows": (i32[B, L], ...), "weights": f32[B, L]}}; padded slots get row id
        == group row count (a sentinel: gathers zero, scatter drops it) and weight 0.
        """
        routes = {}
        for feature in self.spec.features:
            name = feature.name
            x, n = ids[name], lengths[name]
            assert x.ndim == 2 and x.shape[1] == feature.bag_size, (name, x.shape)
            valid = jnp.arange(feature.bag_size)[None, :] < n[:, None]
            if self.pooling == "mean":
                weights = valid / jnp.maximum(n, 1)[:, None].astype(jnp.float32)
            else:
                weights = valid.astype(jnp.float32)
            local = self.methods[name].route(jnp.where(valid, x, 0))
            rows = tuple(
                jnp.where(valid, r + p.offset, self.group_rows[p.group]).astype(jnp.int32)
                for r, p in zip(local, self.placements[name], strict=True)
            )
            routes[name] = {"rows": rows, "weights": weights.astype(jnp.float32)}
        return routes

    # ------------------------------------------------------------------------------------------- gather
    def gather(self, tables: Mapping[str, jax.Array], routes: Mapping) -> dict[str, tuple[jax.Array, ...]]:
        """Rows per feature and physical table: f32[B, d] pooled, or f32[B, L, d] if the method can't pool."""
        out = {}
        for name, placed in self.placements.items():
            r = routes[name]
            if self.methods[name].pools_before_combine:
                out[name] = tuple(gather_reduce_reference(tables[p.group], rows, r["weights"])
                                  for p, rows in zip(placed, r["rows"], strict=True))
            else:
                out[name] = tuple(jnp.take(tables[p.group], rows, axis=0, mode="fill", fill_value=0)
                                  for p, rows in zip(placed, r["rows"], strict=True))
        return out

    # ------------------------------------------------------------------------------------ sparse update
    def sparse_update(self, optimizer: SparseOptimizer, tables: dict[str, jax.Array],
                      state: dict[str, dict[str, jax.Array]], routes: Mapping,
                      row_grads: Mapping[str, tuple[jax.Array, ...]], lr: jax.Array,
                      step: jax.Array) -> tuple[dict, dict]:
        """Scatter gradients w.r.t. gathered rows into the touched rows of each stacked table.

        A pooled gradient g[b] reaches each id of bag b scaled by its pooling weight (the chain rule of the
        weighted sum); un-pooled gradients arrive per id already.
        """
        ids_by_group: dict[str, list] = {g: [] for g in self.group_rows}
        grads_by_group: dict[str, list] = {g: [] for g in self.group_rows}
        for name, placed in self.placements.items():
            r = routes[name]
            pooled = self.methods[name].pools_before_combine
            for p, rows, g in zip(placed, r["rows"], row_grads[name], strict=True):
                if pooled:
                    g = g[:, None, :] * r["weights"][:, :, None]
                ids_by_group[p.group].append(rows.reshape(-1))
                grads_by_group[p.group].append(g.reshape(-1, p.table.dim))
        new_tables, new_state = dict(tables), dict(state)
        for group in self.group_rows:
            new_tables[group], new_state[group] = sparse_apply(
                optimizer, tables[group], state[group], jnp.concatenate(ids_by_group[group]),
                jnp.concatenate(grads_by_group[group]), lr, step)
        return new_tables, new_state


class EmbeddingGlue(nn.Module):
    """Dense side of the embedding layer: combine each feature's rows (and pool if not pooled yet).

    rows: {feature: (f32[B, d_t] | f32[B, L, d_t], ...)}; weights: {feature: f32[B, L]}.
    Returns f32[B, F, D] in the dataset's feature order (all features must share D).
    """

    collection: EmbeddingCollection

    @nn.compact
    def __call__(self, rows: Mapping, weights: Mapping) -> jax.Array:
        outs = []
        for name, method in self.collection.methods.items():
            x = method.combine_module(name=f"combine_{name}")(tuple(rows[name]))
            if not method.pools_before_combine:
                x = jnp.einsum("bld,bl->bd", x, weights[name])
            outs.append(x)
        return jnp.stack(outs, axis=1)


def _init_uniform_rows(rng: jax.Array, rows: int, dim: int, scales: jax.Array) -> jax.Array:
    """f32[rows, dim] with row r ~ U(-scales[r], scales[r]), built chunk by chunk inside one jit.

    Drawing the whole table at once makes XLA hold the random bits and the result together (4x the table
    at 10M rows); chunks keep the peak near 1x.
    """
    assert scales.shape == (rows,), (scales.shape, rows)
    chunk = min(_INIT_CHUNK_ROWS, rows)
    n_full, rest = divmod(rows, chunk)

    def block(scales, i, size):
        u = jax.random.uniform(jax.random.fold_in(rng, i), (size, dim), jnp.float32, -1.0, 1.0)
        return u * jax.lax.dynamic_slice_in_dim(scales, i * chunk, size)[:, None]

    @jax.jit
    def build(scales):
        table = jnp.zeros((rows, dim), jnp.float32)
        table = jax.lax.fori_loop(
            0, n_full,
            lambda i, t: jax.lax.dynamic_update_slice_in_dim(t, block(scales, i, chunk), i * chunk, 0), table)
        if rest:
            table = jax.lax.dynamic_update_slice_in_dim(table, block(scales, n_full, rest), n_full * chunk, 0)
        return table

    return build(scales)
