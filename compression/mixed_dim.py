"""Mixed-dimension embeddings (Ginart et al. 2019, "Mixed Dimension Embeddings with Application to
Memory-Efficient Recommendation Systems", arXiv:1909.11810).

Popular ids deserve more dimensions than rare ones. Ginart et al. §3.2 (eq. 5) assign block i the dimension
    d_i = lambda * p_i^alpha
for its popularity p_i and a temperature alpha in [0, 1], store block i as f32[n_i, d_i] and project it back
to the base dim D with a bias-free linear map (the "dense glue", eq. 4). Two ways to form blocks:

  "md"         one block per table (the facebookresearch/dlrm `--md-flag` trick). The dims depend on all tables,
               so they are planned collection-wide by `compression.plan.plan_tables` with `md_dims` (the
               reference's `md_solver`) or `md_budget_dims`, and each table receives its `options.dim`.
  "md_blocks"  blocks within one table: ids sorted by frequency (per-id counts, `options.counts`) and cut into a
               few blocks, one physical table of its own dim per block; an id routes to its row in its block
               and to -1 (no row) in every other block, and the combine sums the per-block projections.

What the reference's `md_solver` (tricks/md_embedding_bag.py) does, and `md_dims` reproduces:
  - the popularity proxy of a table is 1 / rows (uniform access inside a table; divided by `k`, the queries per
    inference, when given): tables are sorted by n / k ascending;
  - with a base dim d0: lambda = d0 * (n / k)_min^alpha, so the most popular (smallest) table gets exactly d0 and
    table i gets d0 * ((n / k)_i / (n / k)_min)^(-alpha); every other dim is floored at 1 and rounded to the nearest
    integer (torch.round: half to even);
  - with round_dim: dims are then rounded to the nearest power of two in log space, 2^round(log2 d) -- d0 included,
    and the reference then projects every table to base = max(dims), so d0 = 12 becomes 16 and 72 becomes 64
    (`md_dims` differs here, see its docstring);
  - with a budget B instead: lambda = B / sum (n / k)^(1 - alpha) (sum n_i d_i = B before rounding; the floor at 1
    and rounding may overshoot, and dims are not capped at the base dim).
  - the reference applies the rule to *every* table, then crashes on tables under `--md-threshold` (it passes the
    list of dims as the width of a plain nn.EmbeddingBag); here those tables stay full (see plan.py).
  Example (Ginart et al. / reference): rows [100000, 5000, 300, 50], alpha 0.3, d0 16 -> dims [2, 4, 9, 16].

`md_budget_dims` is this project's budget mode: the largest lambda whose *rounded, clamped* dims keep
sum(rows * d + projection params) <= budget, so the budget is a guarantee rather than a pre-rounding target.
"""

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from compression.base import EmbeddingMethod, PhysicalTable, TableSpec, dlrm_init_scale, method_options

DEFAULT_ALPHA = 0.3  # the reference's --md-temperature default
DEFAULT_BLOCKS = (0.01, 0.1, 1.0)  # md_blocks: cumulative fractions of ids (by frequency rank) ending each block


# ------------------------------------------------------------------------------------------- power rule
def pow2_round(dims: np.ndarray) -> np.ndarray:
    """Nearest power of two in log space, as the reference's pow_2_round: 3 -> 4, 5 -> 4, 6 -> 8, 9 -> 8."""
    return (2 ** np.round(np.log2(np.asarray(dims, np.float64)))).astype(np.int64)


def _finish(raw: np.ndarray, round_pow2: bool) -> np.ndarray:
    """Floor at 1, round half to even (torch.round / np.round), optionally to a power of two."""
    dims = np.round(np.maximum(raw, 1.0)).astype(np.int64)
    return pow2_round(dims) if round_pow2 else dims


def md_dims(rows: Sequence[int], alpha: float, base_dim: int, round_pow2: bool = False,
            queries: Sequence[float] | None = None) -> list[int]:
    """The reference's md_solver with d0 = base_dim: d_i = d0 * ((n/k)_i / (n/k)_min)^(-alpha), in input order.

    Args:
      rows: n_i, rows per table (the popularity proxy is k_i / n_i).
      alpha: temperature >= 0 (0: every table gets base_dim).
      base_dim: d0, the dim of the most popular table and the projection target.
      round_pow2: round to powers of two (the reference's round_dim).
      queries: k_i, average lookups per example (default 1).

    Where this differs from md_solver (only with round_pow2 and a base_dim that is not a power of two): md_solver
    rounds d0 too (12 -> 16, 72 -> 64) and dlrm_s_pytorch then projects every table to max(dims), a width that no
    longer matches the bottom MLP's output d0 (the reference checks that width before calling md_solver, not after).
    Here base_dim is the width every model consumes, so the most popular table keeps exactly base_dim and no dim
    exceeds it: dims = [base_dim for the most popular table, else min(md_solver's dim, base_dim)]. With a
    power-of-two base_dim (or without round_pow2) the dims are md_solver's exactly
    (tests/test_compression_mixed_dim.py checks both against a transcription of md_solver).
    """
    n = np.asarray(rows, np.float64) / (np.ones(len(rows)) if queries is None else np.asarray(queries, np.float64))
    _check_rule(n, alpha, base_dim)
    lam = base_dim * n.min() ** alpha  # Ginart et al. eq. 5 anchored so the most popular table gets d0
    dims = _finish(lam * n ** (-alpha), round_pow2)
    dims[n == n.min()] = base_dim  # the reference sets d[0] = d0 exactly (no float round-trip)
    return [int(min(d, base_dim)) for d in dims]


def md_budget_dims(rows: Sequence[int], alpha: float, base_dim: int, budget: int, round_pow2: bool = False,
                   fixed_params: int = 0) -> list[int]:
    """Dims d_i = clamp(round(lambda * n_i^-alpha), 1, base_dim) for the largest lambda with
    fixed_params + sum_i (n_i d_i + [d_i < base_dim] d_i base_dim) <= budget (rows plus projections).

    Raises ValueError when even all-ones dims exceed the budget.
    """
    n = np.asarray(rows, np.float64)
    _check_rule(n, alpha, base_dim)

    def dims_at(lam: float) -> np.ndarray:
        return np.minimum(_finish(lam * n ** (-alpha), round_pow2), base_dim)

    def params(dims: np.ndarray) -> int:
        return int(fixed_params + np.sum(n.astype(np.int64) * dims) + np.sum(np.where(dims < base_dim,
                                                                                        dims * base_dim, 0)))

    lo, hi = 0.0, 2.0 * base_dim * n.max() ** alpha  # dims_at(0) = all 1; dims_at(hi) = all base_dim
    if params(dims_at(lo)) > budget:
        raise ValueError(f"mixed-dim budget {budget:,} params is below the minimum {params(dims_at(lo)):,} "
                         f"(every table at dim 1 plus projections plus tables kept full); raise options.budget")
    if params(dims_at(hi)) <= budget:
        return [int(d) for d in dims_at(hi)]
    # Invariant: params(dims_at(lo)) <= budget < params(dims_at(hi)). Rounding makes params a step function of
    # lambda, so bisection converges onto the last feasible step.
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if params(dims_at(mid)) <= budget else (lo, mid)
    return [int(d) for d in dims_at(lo)]


def md_budget_floor(rows: Sequence[int], base_dim: int, fixed_params: int = 0) -> int:
    """The fewest params `md_budget_dims` can plan: every table at dim 1 (rows + a 1 x base_dim projection each, none
    when base_dim is 1) plus `fixed_params`."""
    return int(fixed_params + sum(int(n) + (base_dim if base_dim > 1 else 0) for n in rows))


def _check_rule(n: np.ndarray, alpha: float, base_dim: int) -> None:
    if n.size == 0 or np.any(n <= 0):
        raise ValueError(f"mixed-dim rule needs positive table sizes, got {n.tolist()}")
    if alpha < 0:
        raise ValueError(f"mixed-dim alpha (temperature) must be >= 0, got {alpha}")
    if base_dim < 1:
        raise ValueError(f"mixed-dim base dim must be >= 1, got {base_dim}")


# ---------------------------------------------------------------------------------------------- combine
class ProjectBlocks(nn.Module):
    """Sum over blocks of P_i r_i (Ginart et al. eq. 4): rows f32[..., d_i] -> f32[..., dim].

    P_i is a bias-free Dense d_i -> dim with Xavier-uniform init (as the reference's PrEmbeddingBag); a block
    already at `dim` is used as is. A single block is the per-table "md" combine.
    """

    dims: tuple[int, ...]
    dim: int

    @nn.compact
    def __call__(self, rows: tuple[jax.Array, ...]) -> jax.Array:
        out = 0.0
        for i, (r, d) in enumerate(zip(rows, self.dims, strict=True)):
            assert r.shape[-1] == d, (r.shape, d)
            if d == self.dim:
                out = out + r
            else:
                out = out + nn.Dense(self.dim, use_bias=False, kernel_init=nn.initializers.xavier_uniform(),
                                     name=f"proj{i}")(r)
        return out


def projection_params(dims: Sequence[int], dim: int) -> int:
    """Glue params of `ProjectBlocks`: d_i * dim for every block narrower than dim."""
    return sum(d * dim for d in dims if d < dim)


# ---------------------------------------------------------------------------------------------- methods
class MixedDimEmbedding(EmbeddingMethod):
    """One table f32[vocab_size, d] projected to spec.dim (Ginart et al. §3); options.dim = d (from the plan)."""

    def __init__(self, spec: TableSpec):
        super().__init__(spec)
        opts = method_options(spec, {"dim": 0})
        d = opts["dim"]
        if isinstance(d, bool) or not isinstance(d, int | np.integer) or not 1 <= d <= spec.dim:
            raise ValueError(f"table '{spec.name}': md needs options.dim in [1, {spec.dim}] (the table's own "
                             f"width before projection), got {d!r}; compression.plan.plan_tables computes it")
        self.block_dim = int(d)

    def physical_tables(self) -> tuple[PhysicalTable, ...]:
        spec = self.spec
        # The reference initialises MD tables like full ones: U(-sqrt(1/n), sqrt(1/n)) (dlrm_s_pytorch create_emb).
        return (PhysicalTable(spec.name, spec.vocab_size, self.block_dim, dlrm_init_scale(spec.vocab_size)),)

    def route(self, ids: jax.Array) -> tuple[jax.Array, ...]:
        return (ids,)

    def combine_module(self, name: str) -> nn.Module:
        return ProjectBlocks((self.block_dim,), self.spec.dim, name=name)

    def glue_params(self) -> int:
        return projection_params((self.block_dim,), self.spec.dim)


class MixedDimBlocks(EmbeddingMethod):
    """Frequency blocks inside one table, each f32[n_i, d_i] with d_i = D (p_i / p_0)^alpha (Ginart et al. eq. 5).

    Options:
      counts: f64[vocab_size] per-id counts (or expected counts), the popularity estimate (plan.py injects them
        from `config.embedding.id_counts`).
      blocks: cumulative fractions of ids, in frequency order, at which blocks end (default (0.01, 0.1, 1.0):
        the top 1%, the next 9%, the other 90%); empty blocks are dropped.
      alpha: temperature (0.3). round_pow2: round block dims to powers of two.

    A block's popularity p_i is its mean count per id; the hottest block gets D, the others the power rule,
    floored at 1 and rounded as `md_dims`. Route: rank[x] (the id's position in frequency order, a
    non-trainable int32[vocab_size] index embedded in the step; skipped when ids are already frequency-ranked)
    -> the block's local row, -1 in the other blocks.
    """

    def __init__(self, spec: TableSpec):
        super().__init__(spec)
        opts = method_options(spec, {"counts": None, "blocks": DEFAULT_BLOCKS, "alpha": DEFAULT_ALPHA,
                                     "round_pow2": False})
        if opts["counts"] is None:
            raise ValueError(f"table '{spec.name}': md_blocks needs per-id counts; set config.embedding.id_counts "
                             "('dataset' or a .npz path) so plan_tables can pass them, or options.counts")
        counts = np.asarray(opts["counts"], np.float64)
        if counts.shape != (spec.vocab_size,) or not np.all(np.isfinite(counts)) or np.any(counts < 0):
            raise ValueError(f"table '{spec.name}': md_blocks counts must be finite, >= 0 and of shape "
                             f"({spec.vocab_size},), got shape {counts.shape}")
        if counts.max() <= 0:
            raise ValueError(f"table '{spec.name}': md_blocks counts are all zero; no popularity to rank ids by")
        fractions = tuple(float(f) for f in opts["blocks"])
        increasing = all(b > a for a, b in zip(fractions, fractions[1:], strict=False))
        if not fractions or fractions[0] <= 0 or fractions[-1] != 1.0 or not increasing:
            raise ValueError(f"table '{spec.name}': md_blocks options.blocks must be increasing fractions in "
                             f"(0, 1] ending at 1.0, got {fractions}")
        n = spec.vocab_size
        order = np.argsort(-counts, kind="stable")  # ids, most frequent first
        ends = sorted({min(n, max(1, math.ceil(f * n))) for f in fractions})
        self.starts = tuple([0] + ends[:-1])
        self.ends = tuple(ends)
        popularity = np.asarray([counts[order[a:b]].mean() for a, b in zip(self.starts, self.ends, strict=True)])
        alpha = float(opts["alpha"])
        _check_rule(np.ones(1), alpha, spec.dim)
        # Ginart et al. eq. 5, anchored so the hottest block (block 0) gets D: d_i = D (p_i / p_0)^alpha.
        raw = spec.dim * (popularity / popularity[0]) ** alpha
        dims = np.minimum(_finish(raw, bool(opts["round_pow2"])), spec.dim)
        dims[0] = spec.dim
        self.block_dims = tuple(int(d) for d in dims)
        rank = np.empty(n, np.int32)
        rank[order] = np.arange(n, dtype=np.int32)
        self.identity_rank = bool(np.all(order == np.arange(n)))
        self.rank = None if self.identity_rank else jnp.asarray(rank)

    def physical_tables(self) -> tuple[PhysicalTable, ...]:
        spec = self.spec
        return tuple(PhysicalTable(f"{spec.name}/block{i}", b - a, d, dlrm_init_scale(spec.vocab_size))
                     for i, (a, b, d) in enumerate(zip(self.starts, self.ends, self.block_dims, strict=True)))

    def route(self, ids: jax.Array) -> tuple[jax.Array, ...]:
        ids = ids.astype(jnp.int32)
        rank = ids if self.rank is None else jnp.take(self.rank, ids, mode="clip")
        return tuple(jnp.where((rank >= a) & (rank < b), rank - a, -1) for a, b in zip(self.starts, self.ends,
                                                                                         strict=True))

    def combine_module(self, name: str) -> nn.Module:
        return ProjectBlocks(self.block_dims, self.spec.dim, name=name)

    def glue_params(self) -> int:
        return projection_params(self.block_dims, self.spec.dim)

    def index_bytes(self) -> int:
        """Device bytes of the non-trainable id -> rank index (0 when ids are already frequency-ranked)."""
        return 0 if self.rank is None else 4 * self.spec.vocab_size
