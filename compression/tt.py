"""TT-Rec: tensor-train embeddings (Yin et al. 2021, "TT-Rec: Tensor Train Matrix Decomposition for Embedding
Tables", arXiv:2101.11714).

The V x D table is viewed as a TT-matrix (Yin et al. §3, eq. 2-3): factor the rows V <= n_1 n_2 ... n_k and the
columns D = d_1 d_2 ... d_k; then
    W[(i_1, ..., i_k), (j_1, ..., j_k)] = G_1[i_1, j_1] G_2[i_2, j_2] ... G_k[i_k, j_k],
where each G_j[i, j'] is an r_{j-1} x r_j matrix (r_0 = r_k = 1), i.e. the TT core G_j is f32[r_{j-1}, n_j, d_j, r_j].
Row and column indices are row-major mixed-radix numbers: id = i_1 n_2 ... n_k + ... + i_{k-1} n_k + i_k and
column = j_1 d_2 ... d_k + ... + j_k (core 1 is the most significant digit on both sides). The digits are exact
int32 integer math (floor division and remainder), so distinct ids < n_1 ... n_k always get distinct index tuples.

Physical tables: core j is one table of n_j rows, row i_j being the slice G_j[:, i_j, :, :] flattened to
r_{j-1} d_j r_j values (laid out [r_{j-1}, d_j, r_j]). `route` maps an id to its digit per core; the combine
(`TTContract`) reshapes each gathered slice and contracts the chain per id to f32[..., D]. The product is not
linear in each slice, so the engine combines per id and pools after (`pools_before_combine = False`).

Why a *sparse core update* (cores as physical tables) rather than cores as dense glue: the gradient of a batch
touches only the slices G_j[:, i_j, :, :] of the digits it routes to, so treating slices as rows lets the engine's
dedup aggregate every id sharing a slice exactly, lets the sparse optimizers (SGD, (row-wise) Adagrad, lazy Adam)
update only those slices in place, and gives the cores byte accounting, stacking and the update kernels for free.
With plain SGD the result equals a dense update of the cores (untouched slices have zero gradient); with the
stateful optimizers the state of an untouched slice does not decay (the "lazy" semantics every other table has).
Cores as Flax params would instead get a dense optax update of every core each step: O(sum_j n_j r_{j-1} d_j r_j),
small for small ranks but growing with V^(1/k) and r^2 for nothing, and with Adam the untouched slices would still
move by their momentum. TT-Rec's own library (FBTT-Embedding's TTEmbeddingBag) likewise takes the optimizer (SGD,
exact Adagrad, ...) and applies it inside its backward to the core slices the batch touched.

Options (`method_options`, so a misspelt key names the table):
  cores          k >= 2 (default 3, the setting of most of Yin et al.'s experiments).
  rank           every inner TT-rank r_1 = ... = r_{k-1} (default 8), or
  ranks          the k - 1 inner ranks explicitly (r_0 = r_k = 1 always); exclusive with a non-default rank.
  vocab_factors  n_1..n_k explicitly (product >= vocab_size); default: near-equal factors (below).
  dim_factors    d_1..d_k explicitly (product == dim, each >= 1); default: D's prime factors spread evenly.
  row_decay      the multiple of optimizer.sparse.weight_decay the core slices take (default 0: see
                 compression/base.py FACTOR_ROW_DECAY -- an L2 on every factor of a product collapses it).
Default factor choice: the vocabulary factors are ceil(V^(1/k)) each, then lowered one at a time (the inner cores
first) while the product stays >= V, so n_1 ... n_k - V is small (e.g. V = 10,000,000, k = 3 -> (216, 215, 216):
10,031,040 row tuples); D's prime factors are dealt largest first onto the currently smallest factor. In both, the
larger factors go to the outer cores, because an inner core's slices are r_{j-1} d_j r_j = r^2 d_j wide while the
outer ones are r d_j: D = 16, k = 3 -> (4, 2, 2); D = 64 -> (4, 4, 4). FBTT-Embedding's `suggested_tt_shapes`
searches factorisations of a slightly rounded-up V for the most balanced one; near-equal integer roots are the same
idea without the search (pass vocab_factors / dim_factors to reproduce a shape from the paper).

Initialisation: every core entry U(-s, s) with s chosen so an entry of the product row has the variance of the
full table's DLRM init U(-1/sqrt(V), 1/sqrt(V)), i.e. 1/(3V). An entry of the product is a sum over the R =
r_1 ... r_{k-1} rank paths of k independent zero-mean factors, so its variance is R (s^2/3)^k, hence
s = sqrt(3) (3 V R)^(-1/(2k)). Yin et al. draw the cores from a Gaussian scaled so the product resembles the full
table's initial distribution (they report it trains better than a naive uniform init of the cores); the engine
initialises every physical table uniformly, so here the cores are uniform with that matched variance (the product,
a sum over R paths of k factors, is close to Gaussian anyway). `test_initial_rows_have_the_full_tables_variance`
checks it.

Accounting: core j holds n_j r_{j-1} d_j r_j params (the physical tables' params); there is no other glue.
"""

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from compression.base import (
    FACTOR_ROW_DECAY,
    EmbeddingMethod,
    PhysicalTable,
    TableSpec,
    method_options,
    row_decay_option,
)
from compression.compositional import integer_root_ceil

DEFAULT_CORES = 3
DEFAULT_RANK = 8


def _outer_first(values: Sequence[int]) -> tuple[int, ...]:
    """Place values largest first at the outer positions: (a >= b >= c >= d) -> (a, c, d, b)."""
    ordered = sorted(values, reverse=True)
    out = [0] * len(ordered)
    left, right = 0, len(ordered) - 1
    for i, v in enumerate(ordered):
        if i % 2 == 0:
            out[left], left = v, left + 1
        else:
            out[right], right = v, right - 1
    return tuple(out)


def vocab_factors(vocab_size: int, k: int) -> tuple[int, ...]:
    """k near-equal factors with product >= vocab_size, the larger ones on the outer cores (see module doc)."""
    factors = [max(1, integer_root_ceil(vocab_size, k))] * k
    inner_first = [*range(1, k - 1), 0, k - 1]
    for j in inner_first:  # lower each factor while the product still covers the vocabulary
        while factors[j] > 1 and math.prod(factors) // factors[j] * (factors[j] - 1) >= vocab_size:
            factors[j] -= 1
    return _outer_first(factors)


def dim_factors(dim: int, k: int) -> tuple[int, ...]:
    """D = d_1 ... d_k from D's prime factors, dealt largest first onto the smallest factor; outer cores larger."""
    primes, x, p = [], dim, 2
    while p * p <= x:
        while x % p == 0:
            primes.append(p)
            x //= p
        p += 1
    if x > 1:
        primes.append(x)
    factors = [1] * k
    for prime in sorted(primes, reverse=True):
        factors[factors.index(min(factors))] *= prime
    return _outer_first(factors)


class TTContract(nn.Module):
    """Per id, the TT chain G_1[i_1] G_2[i_2] ... G_k[i_k] (Yin et al. eq. 3): k gathered core slices
    f32[..., r_{j-1} d_j r_j] -> the row f32[..., d_1 ... d_k] (column index row-major in (j_1, ..., j_k))."""

    ranks: tuple[int, ...]  # (r_0 = 1, r_1, ..., r_{k-1}, r_k = 1)
    dims: tuple[int, ...]  # (d_1, ..., d_k)

    @nn.compact
    def __call__(self, rows: tuple[jax.Array, ...]) -> jax.Array:
        assert len(rows) == len(self.dims), (len(rows), self.dims)
        batch = rows[0].shape[:-1]
        out = rows[0].reshape(*batch, self.dims[0], self.ranks[1])  # [..., a = d_1, r_1]
        for j in range(1, len(self.dims)):
            core = rows[j].reshape(*batch, self.ranks[j], self.dims[j] * self.ranks[j + 1])
            # [..., a, r] @ [..., r, b * s] -> [..., a * b, s]: a plain batched matmul (on CPU its backward measured
            # faster than the 4-d einsum's: benchmarks/RESULTS.md); HIGHEST so TPUs do not round the chain to bf16.
            out = jnp.matmul(out, core, precision=jax.lax.Precision.HIGHEST)
            out = out.reshape(*batch, -1, self.ranks[j + 1])
        return out.reshape(*batch, math.prod(self.dims))


def _int_tuple(spec: TableSpec, key: str, value, minimum: int) -> tuple[int, ...]:
    values = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else None
    if values is None or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values):
        raise ValueError(f"table '{spec.name}': option {key} must be a tuple of integers >= {minimum}, got {value!r}")
    return values


class TTEmbedding(EmbeddingMethod):
    """TT-Rec: k TT cores, core j a physical table of n_j rows x r_{j-1} d_j r_j (see the module docstring)."""

    pools_before_combine = False  # the chain product is not linear in each core slice

    def __init__(self, spec: TableSpec):
        super().__init__(spec)
        opts = method_options(spec, {"cores": DEFAULT_CORES, "rank": DEFAULT_RANK, "ranks": (),
                                     "vocab_factors": (), "dim_factors": (), "row_decay": FACTOR_ROW_DECAY})
        self.row_decay = row_decay_option(spec, opts["row_decay"])
        k = opts["cores"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            raise ValueError(f"table '{spec.name}': tt option cores must be an integer >= 2, got {k!r}")
        rank = opts["rank"]
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"table '{spec.name}': tt option rank must be an integer >= 1, got {rank!r}")
        if opts["ranks"]:
            if "rank" in spec.options:
                raise ValueError(f"table '{spec.name}': tt takes options.rank (every inner rank) or options.ranks "
                                 f"(one per inner bond), not both; got rank={rank}, ranks={opts['ranks']}")
            inner = _int_tuple(spec, "ranks", opts["ranks"], 1)
            if len(inner) != k - 1:
                raise ValueError(f"table '{spec.name}': tt options.ranks needs cores - 1 = {k - 1} inner ranks, "
                                 f"got {inner}")
        else:
            inner = (rank,) * (k - 1)
        if opts["vocab_factors"]:
            n = _int_tuple(spec, "vocab_factors", opts["vocab_factors"], 1)
            if len(n) != k or math.prod(n) < spec.vocab_size:
                raise ValueError(f"table '{spec.name}': tt options.vocab_factors must be {k} factors (cores) whose "
                                 f"product is >= vocab_size {spec.vocab_size}, got {n} (product {math.prod(n)})")
        else:
            n = vocab_factors(spec.vocab_size, k)
        if opts["dim_factors"]:
            d = _int_tuple(spec, "dim_factors", opts["dim_factors"], 1)
            if len(d) != k or math.prod(d) != spec.dim:
                raise ValueError(f"table '{spec.name}': tt options.dim_factors must be {k} factors (cores) whose "
                                 f"product is dim {spec.dim}, got {d} (product {math.prod(d)})")
        else:
            d = dim_factors(spec.dim, k)
        if math.prod(n[1:]) >= 2**31:
            raise ValueError(f"table '{spec.name}': tt vocab_factors {n} need digit strides >= 2^31 (int32 ids); "
                             "use more cores")
        self.cores = k
        self.ranks = (1, *inner, 1)
        self.vocab_factors = n
        self.dim_factors = d
        # Row-major digit strides: id = sum_j i_j * stride_j, stride_j = n_{j+1} ... n_k.
        self.strides = tuple(math.prod(n[j + 1:]) for j in range(k))

    def core_shapes(self) -> tuple[tuple[int, int, int, int], ...]:
        """(r_{j-1}, n_j, d_j, r_j) per core, as in Yin et al."""
        r, n, d = self.ranks, self.vocab_factors, self.dim_factors
        return tuple((r[j], n[j], d[j], r[j + 1]) for j in range(self.cores))

    def init_scale(self) -> float:
        """U(-s, s) per core entry so a product entry has variance 1/(3V), the full table's (module docstring)."""
        paths = math.prod(self.ranks)  # r_1 ... r_{k-1} (r_0 = r_k = 1)
        return math.sqrt(3.0) * (3.0 * self.spec.vocab_size * paths) ** (-1.0 / (2 * self.cores))

    def physical_tables(self) -> tuple[PhysicalTable, ...]:
        s = self.init_scale()
        return tuple(PhysicalTable(f"{self.spec.name}/core{j}", n_j, r0 * d_j * r1, s, decay_scale=self.row_decay)
                     for j, (r0, n_j, d_j, r1) in enumerate(self.core_shapes()))

    def route(self, ids: jax.Array) -> tuple[jax.Array, ...]:
        ids = ids.astype(jnp.int32)
        digits = []
        for j, (n_j, stride) in enumerate(zip(self.vocab_factors, self.strides, strict=True)):
            x = ids // stride if stride > 1 else ids
            digits.append((x if j == 0 else x % n_j).astype(jnp.int32))  # ids < prod n: the top digit is < n_1
        return tuple(digits)

    def combine_module(self, name: str) -> nn.Module:
        return TTContract(self.ranks, self.dim_factors, name=name)
