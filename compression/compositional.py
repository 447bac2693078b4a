"""Compositional embeddings from complementary partitions (Shi et al. 2019, "Compositional Embeddings Using
Complementary Partitions for Memory-Efficient Recommendation Systems", arXiv:1909.02107).

A set of partitions P_1..P_k of the ids is *complementary* when no two distinct ids share a class in every
partition (Shi et al. §3, Def. 1). Each partition gets a small table indexed by the id's class, and the
feature's embedding combines the k rows (§3, eq. 2), so distinct ids get distinct embeddings from
sum_j |P_j| rows instead of n. Methods here:

  "qr"           quotient-remainder trick (§3, Ex. 2): x -> (x // m, x mod m), tables of ceil(n/m) and m rows.
  "mixed_radix"  generalised QR (§3, Ex. 3): the mixed-radix digits of x, x_0 = x mod r_1,
                 x_1 = (x // r_1) mod r_2, ..., x_{k-1} = x // (r_1 ... r_{k-1}); one table per digit.
  "crt"          Chinese-remainder partitions (§3, Ex. 4): x -> (x mod m_1, ..., x mod m_k) for pairwise coprime
                 moduli with m_1 ... m_k >= n; the CRT makes the map injective on [0, m_1 ... m_k).
  "qr_path"      path-based compositional embedding (§4): one partition indexes an embedding table, the other
                 selects a function applied to that row, x_emb = M_{p_2(x)}(W e_{p_1(x)}).

Operations (`options.op`, §3 eq. 2): "concat" (the D columns split over the k tables, so the output is still
D wide), "add" and "mult" (element-wise). concat and add are linear in each row, so the engine pools bags
before combining; mult is not (sum_l q_l * r_l != (sum_l q_l) * (sum_l r_l)), so it combines per id and pools
after (`pools_before_combine = False`). The facebookresearch/dlrm reference (tricks/qr_embedding_bag.py) pools
each table first and multiplies the pooled bags, which is only the same for one-hot features.

Every method here takes `options.row_decay` (default 0): the multiple of optimizer.sparse.weight_decay its tables'
rows take. Their rows are factors shared by many ids, and a row L2 on them collapses the embeddings (see
compression/base.py FACTOR_ROW_DECAY for the measurement); Shi et al. train without weight decay.

Integer arithmetic is exact for every int32 id: floor division and remainder on int32 (the reference computes
the quotient as `(input / m).long()` through float32, which is wrong above 2^24 -- e.g. with m = 3, id
16777223 gets quotient 5592408 instead of 5592407 and shares both rows with id 16777226).
"""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from compression.base import (
    FACTOR_ROW_DECAY,
    EmbeddingMethod,
    PhysicalTable,
    TableSpec,
    dlrm_init_scale,
    method_options,
    row_decay_option,
)

OPS = ("concat", "add", "mult")
TRANSFORM_BY = ("remainder", "quotient")
Partition = tuple[str, int, Callable[[jax.Array], jax.Array]]  # (table part name, rows, ids -> class)


def split_dims(dim: int, parts: int) -> tuple[int, ...]:
    """D columns over `parts` tables for concat, as even as possible: (7, 2) -> (4, 3)."""
    return tuple(dim // parts + (1 if i < dim % parts else 0) for i in range(parts))


def integer_root_ceil(n: int, k: int) -> int:
    """Smallest r with r ** k >= n (exact, no floating point at the boundary)."""
    r = max(1, round(n ** (1.0 / k)))
    while r**k < n:
        r += 1
    while r > 1 and (r - 1) ** k >= n:
        r -= 1
    return r


class ComposeRows(nn.Module):
    """Combine k gathered rows f32[..., d_j] into f32[..., D] by concat, add or element-wise mult (eq. 2)."""

    op: str

    @nn.compact
    def __call__(self, rows: tuple[jax.Array, ...]) -> jax.Array:
        if self.op == "concat":
            return jnp.concatenate(rows, axis=-1)
        out = rows[0]
        for r in rows[1:]:
            out = out + r if self.op == "add" else out * r
        return out


class CompositionalEmbedding(EmbeddingMethod):
    """k tables, one per complementary partition, combined by `op`; subclasses define `partitions()`."""

    extra_options: ClassVar[dict[str, Any]] = {}  # the subclass's knobs and defaults, besides `op`

    def __init__(self, spec: TableSpec):
        super().__init__(spec)
        self.options = method_options(spec, {"op": "mult", "row_decay": FACTOR_ROW_DECAY, **self.extra_options})
        self.op = self.options["op"]
        self.row_decay = row_decay_option(spec, self.options["row_decay"])
        if self.op not in OPS:
            raise ValueError(f"table '{spec.name}': unknown compositional op '{self.op}'; use one of {OPS}")
        self.parts: tuple[Partition, ...] = tuple(self.partitions())
        if self.op == "concat" and spec.dim < len(self.parts):
            raise ValueError(f"table '{spec.name}': op 'concat' splits dim {spec.dim} over {len(self.parts)} "
                             "tables, which needs dim >= the number of partitions; use 'add' or 'mult'")
        self.pools_before_combine = self.op != "mult"

    def partitions(self) -> Sequence[Partition]:
        raise NotImplementedError

    def dims(self) -> tuple[int, ...]:
        k = len(self.parts)
        return split_dims(self.spec.dim, k) if self.op == "concat" else (self.spec.dim,) * k

    def init_scale(self) -> float:
        n, k = self.spec.vocab_size, len(self.parts)
        # mult: each factor U(-n^(-1/2k), n^(-1/2k)) so the product stays within the full table's DLRM bound
        # sqrt(1/n); concat/add: every table at the full table's bound.
        return n ** (-1.0 / (2 * k)) if self.op == "mult" else dlrm_init_scale(n)

    def physical_tables(self) -> tuple[PhysicalTable, ...]:
        scale = self.init_scale()
        return tuple(PhysicalTable(f"{self.spec.name}/{part}", rows, d, scale, decay_scale=self.row_decay)
                     for (part, rows, _), d in zip(self.parts, self.dims(), strict=True))

    def route(self, ids: jax.Array) -> tuple[jax.Array, ...]:
        ids = ids.astype(jnp.int32)
        return tuple(fn(ids).astype(jnp.int32) for _, _, fn in self.parts)

    def combine_module(self, name: str) -> nn.Module:
        return ComposeRows(self.op, name=name)


def _positive_int(spec: TableSpec, key: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"table '{spec.name}': option {key} must be an integer >= {minimum}, got {value!r}")
    return value


QR_INITS = ("bounded", "reference")


class QuotientRemainder(CompositionalEmbedding):
    """Shi et al. §3 Ex. 2: tables q (ceil(n/m) rows, x // m) and r (m rows, x mod m); options.collisions = m.

    options.init: "bounded" (default) draws both tables U(-b, b) with b = n^(-1/4) for mult (each factor's bound, so
    the product stays within the full table's DLRM bound sqrt(1/n)) and b = sqrt(1/n) for concat / add (every entry
    at the full table's bound); "reference" is facebookresearch/dlrm's QREmbeddingBag.reset_parameters,
    U(sqrt(1/n), 1) for both tables whatever the op -- all positive, so with mult every initial embedding lies in
    (1/n, 1)^D, a shared positive offset up to ~sqrt(n) times larger than a full table's entries. "bounded" stays the
    default because it starts QR where a full table starts and learned better in our check (synthetic sweep config,
    QR mult at 4x and 16x, 2 seeds: benchmarks/RESULTS.md#compression-qr-init-bounded-vs-reference).
    """

    extra_options = {"collisions": 0, "init": "bounded"}

    def physical_tables(self) -> tuple[PhysicalTable, ...]:
        if self.options["init"] == "bounded":
            return super().physical_tables()
        low = dlrm_init_scale(self.spec.vocab_size)  # U(low, 1) = (1 + low) / 2 + U(-(1 - low) / 2, (1 - low) / 2)
        return tuple(dataclasses.replace(t, init_scale=(1.0 - low) / 2, init_center=(1.0 + low) / 2)
                     for t in super().physical_tables())

    def partitions(self) -> Sequence[Partition]:
        m = _positive_int(self.spec, "collisions", self.options["collisions"])
        if self.options["init"] not in QR_INITS:
            raise ValueError(f"table '{self.spec.name}': unknown qr init '{self.options['init']}'; use one of "
                             f"{QR_INITS}")
        self.collisions = m
        return (("q", math.ceil(self.spec.vocab_size / m), lambda x: x // m),
                ("r", m, lambda x: x % m))


class MixedRadix(CompositionalEmbedding):
    """Shi et al. §3 Ex. 3, generalised QR: one table per mixed-radix digit of the id.

    options.radices = (r_1, ..., r_{k-1}) (each >= 2), or options.partitions = k for k - 1 equal radices
    r = ceil(n^(1/k)). Table d_j has r_{j+1} rows; the top digit's table has ceil(n / (r_1 ... r_{k-1})) rows.
    """

    extra_options = {"radices": (), "partitions": 0}

    def partitions(self) -> Sequence[Partition]:
        spec, radices, k = self.spec, tuple(self.options["radices"]), self.options["partitions"]
        if bool(radices) == bool(k):
            raise ValueError(f"table '{spec.name}': mixed_radix needs exactly one of options.radices (a tuple of "
                             f"digit bases) or options.partitions (k >= 2); got radices={radices}, partitions={k}")
        if k:
            k = _positive_int(spec, "partitions", k, minimum=2)
            radices = (max(2, integer_root_ceil(spec.vocab_size, k)),) * (k - 1)
        for r in radices:
            _positive_int(spec, "radices[i]", r, minimum=2)
        self.radices = radices
        parts, place = [], 1
        for j, r in enumerate(radices):
            parts.append((f"d{j}", r, lambda x, place=place, r=r: (x // place) % r))
            place *= r
        parts.append((f"d{len(radices)}", math.ceil(spec.vocab_size / place), lambda x, place=place: x // place))
        return parts


class ChineseRemainder(CompositionalEmbedding):
    """Shi et al. §3 Ex. 4: tables of m_j rows indexed by x mod m_j, pairwise coprime with prod m_j >= n."""

    extra_options = {"moduli": ()}

    def partitions(self) -> Sequence[Partition]:
        spec, moduli = self.spec, tuple(self.options["moduli"])
        if len(moduli) < 2:
            raise ValueError(f"table '{spec.name}': crt needs options.moduli with at least 2 pairwise coprime "
                             f"moduli, got {moduli}")
        for m in moduli:
            _positive_int(spec, "moduli[i]", m, minimum=2)
        for i, a in enumerate(moduli):
            for b in moduli[i + 1:]:
                if math.gcd(a, b) != 1:
                    raise ValueError(f"table '{spec.name}': crt moduli must be pairwise coprime, but {a} and {b} "
                                     f"share the factor {math.gcd(a, b)}; e.g. use consecutive integers or primes")
        if math.prod(moduli) < spec.vocab_size:
            raise ValueError(f"table '{spec.name}': crt moduli {moduli} multiply to {math.prod(moduli)} < "
                             f"vocab_size {spec.vocab_size}, so some ids would share every row; add or enlarge moduli")
        self.moduli = moduli
        return tuple((f"mod{m}", m, lambda x, m=m: x % m) for m in moduli)


class PathTransform(nn.Module):
    """Combine of `qr_path`: apply each id's own transform row to its embedding row (Shi et al. §4).

    rows = (e f32[..., D], t f32[..., W]); hidden == 0: t is a D x D matrix M, out = M e (W = D^2);
    hidden = h: t holds W1 (h x D) then W2 (D x h), out = W2 relu(W1 e) (W = 2 D h).
    """

    dim: int
    hidden: int

    @nn.compact
    def __call__(self, rows: tuple[jax.Array, ...]) -> jax.Array:
        e, t = rows
        d, h = self.dim, self.hidden
        if h == 0:
            return jnp.einsum("...ij,...j->...i", t.reshape(*t.shape[:-1], d, d), e)
        w1 = t[..., : h * d].reshape(*t.shape[:-1], h, d)
        w2 = t[..., h * d:].reshape(*t.shape[:-1], d, h)
        return jnp.einsum("...ij,...j->...i", w2, jax.nn.relu(jnp.einsum("...ij,...j->...i", w1, e)))


class PathQuotientRemainder(EmbeddingMethod):
    """Path-based QR (Shi et al. §4): x_emb = M_{p_2(x)}(W e_{p_1(x)}) with the quotient/remainder partitions.

    options.collisions = m; options.transform_by = "remainder" (default: table q of ceil(n/m) rows, one
    transform per remainder class -- m transforms) or "quotient" (table r of m rows, ceil(n/m) transforms);
    options.hidden = h (0: each transform is a D x D linear map; h > 0: a bias-free MLP D -> h -> D).

    The transforms are per-class parameters selected by the id, so they are rows of a physical table
    `<name>/path` gathered by route and updated by the sparse optimizer -- a combine sees rows, never ids, and
    storing them as dense glue would make every step pay for all of them. Glue params: none.
    """

    pools_before_combine = False  # the transform is applied per id

    def __init__(self, spec: TableSpec):
        super().__init__(spec)
        opts = method_options(spec, {"collisions": 0, "hidden": 0, "transform_by": "remainder",
                                     "row_decay": FACTOR_ROW_DECAY})
        self.row_decay = row_decay_option(spec, opts["row_decay"])
        self.collisions = _positive_int(spec, "collisions", opts["collisions"])
        self.hidden = _positive_int(spec, "hidden", opts["hidden"], minimum=0)
        self.transform_by = opts["transform_by"]
        if self.transform_by not in TRANSFORM_BY:
            raise ValueError(f"table '{spec.name}': unknown transform_by '{self.transform_by}'; use one of "
                             f"{TRANSFORM_BY}")

    @property
    def transform_width(self) -> int:
        d, h = self.spec.dim, self.hidden
        return d * d if h == 0 else 2 * d * h

    def physical_tables(self) -> tuple[PhysicalTable, ...]:
        spec, m = self.spec, self.collisions
        quotient_rows = math.ceil(spec.vocab_size / m)
        table_rows, path_rows = (quotient_rows, m) if self.transform_by == "remainder" else (m, quotient_rows)
        part = "q" if self.transform_by == "remainder" else "r"
        # Transforms: Var = 1/D keeps |M e| ~ |e| for the linear map; Glorot's bound sqrt(6 / (D + h)) for the MLP.
        d, h = spec.dim, self.hidden
        path_scale = math.sqrt(3.0 / d) if h == 0 else math.sqrt(6.0 / (d + h))
        return (PhysicalTable(f"{spec.name}/{part}", table_rows, d, dlrm_init_scale(spec.vocab_size),
                              decay_scale=self.row_decay),
                PhysicalTable(f"{spec.name}/path", path_rows, self.transform_width, path_scale,
                              decay_scale=self.row_decay))

    def route(self, ids: jax.Array) -> tuple[jax.Array, ...]:
        ids = ids.astype(jnp.int32)
        q, r = ids // self.collisions, ids % self.collisions
        return (q, r) if self.transform_by == "remainder" else (r, q)

    def combine_module(self, name: str) -> nn.Module:
        return PathTransform(self.spec.dim, self.hidden, name=name)
