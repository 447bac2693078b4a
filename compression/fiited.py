"""FIITED: per-row dynamic embedding dimensions during training, stored in a chunk pool that really frees memory
(Luo et al. 2024, "Fine-grained Embedding Dimension Optimization During Training for Recommender Systems").

Each logical row of a V x D table is K chunks of C = D / K columns (`chunks`). The chunks live in one physical
table, the pool f32[capacity, C], packed: row r's live chunks sit at slots offsets[r] .. offsets[r+1] - 1 (the
offsets i32[V + 1] are kept packed in aux["offsets_base"] / aux["counts"]: each row's count in ceil(log2(K + 1))
bits plus an i32 base per ~64 rows, 0.73 bytes per row at K = 16; a chunk past a row's count is pruned: it reads
zeros and gets no update) -- see
compression/chunk_pool.py, whose pure `resize` / `compact` functions this method uses, and why it packs instead of
keeping FIITED's per-(row, chunk) slot table. Rows keep a prefix of their chunks, so the model always sees one
D-wide vector with a zero tail. `route` reads the pool once per chunk position (`read_tables`: (0,) * K) and the
combine concatenates the K pooled chunks, which is linear, so bags pool before combining.

Chunk utility (`utility="gradient"`, FIITED's): every train step, for each row the batch touches and each of its
chunks, u <- gamma^(t - t_last) u + ||g||, where g is the gradient this step gives that chunk's D / K columns -- the
sum over the row's occurrences of (pooling weight) x (d loss / d the feature's embedding). A pruned chunk still has
that gradient (the model sees its zeros), so its utility keeps growing while it is useful and it can come back.
The decay is applied lazily (t_last per row), so a step costs O(rows touched) (`update_aux`). Summed over steps,
the utility is "frequency x gradient", what the paper ranks by.

Adjustment (every `interval` steps, `adjust`): the memory budget falls from all chunks to a share `keep` of them
over the first `ramp` of the run's steps, geometrically (`ramp_shape`): keep^(t / ramp steps), so each of the ten
adjustments prunes the same share of the live chunks; the best `budget(t) V K` chunks by score are kept (ties: lower
row, then lower chunk first), trailing chunks below the cut are pruned and chunks above it are grown (values
`grow_init`: zeros, so the model's function does not jump; their optimizer state starts fresh), and the pool is laid
out again for the new counts (`chunk_pool.resize`: kept chunks move with their optimizer state, freed slots are
zeroed). The selection is one sort of the V K scores, on device, inside the same jitted function as the re-layout.
When the pool holds more than (1 + `compact_slack`) times the budget's chunks, the trainer compacts it to exactly the
budget (`chunk_pool.compact`: a new, smaller array and a re-compile of the steps; recjax/dynamic.py), and at the end
of the ramp to exactly the final budget, so the allocated bytes follow the budget down in a few geometric steps
(slack 1: at most twice the budget; 4 compactions for a ramp to 10 %, each a re-compile of the steps).

Scores (`score`): rows keep a prefix of their chunks, so what an adjustment decides is each row's count. "row" (the
default): chunk k of row r scores U_r / (k + 1)^p, U_r the row's utility summed over its chunks; "chunk": chunk k
scores min over j <= k of u_j / (j + 1)^p, each chunk's own utility with a prefix minimum so kept chunks are
prefixes. With a position discount p a row whose utility is U keeps about (U / threshold)^(1/p) chunks: p = 1 makes
a row's width proportional to its utility, p = 3 to its cube root -- the dims Ginart et al. 2019 (mixed-dimension
embeddings) give a row of frequency f, d ~ f^alpha with their alpha = 0.3. p = 0 is FIITED's plain utility (the
kept chunks then come in whole rows: row pruning, in effect).

Departures from the paper, each measured (benchmarks/RESULTS.md, "FIITED against hashing on MovieLens"):
  - decay 1 (the paper decays per iteration; this code's default was 0.99): the utility is everything a row's
    gradients said since training began. With a half-life of 69 steps it measured *when* a row was last seen: on an
    ML-1M-format set many users ended with zero dimensions at 4x, whatever their frequency. Set `decay` < 1 for a
    stream whose ids drift, with a half-life (ln 2 / -ln gamma steps) over which a typical row recurs many times.
  - score "row" (was "chunk"): with 1-column chunks (the default K = D up to 16) a chunk's utility is one column's
    gradient, and columns are an arbitrary basis: the prefix minimum cut each row at its weakest early column.
  - position discount 3 (was 1): widths follow utility^(1/3), not utility -- mixed-dimension's rule; with p = 1 the
    rarest quarter of the items kept no dimension at 4x.
  - the geometric ramp (was linear): linear, the last of ten adjustments to keep 0.05 pruned 2/3 of the live chunks
    at once and validation AUC fell sharply at the ramp's end.

Shared fallback (`fallback`, a share f of the table's kept values; default 0, off): rows whose chunks are
pruned still read something. A hashed table f32[H, D] of H = round(f keep V) rows (its bytes are part of the
budget: the pool's final budget is keep V K - H K chunks) is read by every id through a universal hash
(compression/hashing.py), and a row's embedding is the hashed row plus its own live chunks (a zero tail past them).
Rare ids, the rows the budget leaves at zero dims, then share hashed rows and frequent ids add their own dims on
top -- the frequency-aware split of Zhang et al. 2020 ("Model Size Reduction Using Frequency Based Double Hashing
for Recommender Systems": frequent ids own rows, the rest share hashed rows), with FIITED deciding the owned widths
from utility instead of a frequency cut. Not in FIITED's paper, and off by default: at 20x on ML-100K half the kept
values in the fallback scored 0.018 test AUC below the pool alone (the hashed rows are few, and the pool's
utility-chosen widths are worth more per byte; benchmarks/RESULTS.md, "FIITED against hashing on MovieLens").

Why K = gcd(16, D): finer chunks raised test AUC on ML-100K (benchmarks/RESULTS.md, "Compression: FIITED").

Baselines FIITED compares with:
  `row_prune`    utility="magnitude", chunks=1: in-training magnitude pruning of whole rows (a row's score is its
                 L2 norm at the adjustment; a pruned row reads zeros and does not come back);
  `uniform_dim`  every row D' = round(keep D) wide with a zero tail (a plain V x D' table, no indirection).

Bytes: the pool rows and the fallback rows (and their optimizer state) are the physical tables; the packed offsets
count as model bytes (`aux_bytes`: 0.73 bytes per row at K = 16, 1.1 % of a full 16-dim table), the utility f32[V, K]
and t_last
i32[V] as training-only bytes (like optimizer state: at K = D the utility is as large as the full table while
training).
"""

import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from compression import chunk_pool
from compression.base import EmbeddingMethod, PhysicalTable, TableSpec, dlrm_init_scale, method_options
from compression.hashing import universal_hash, universal_hash_params
from pallas_kernels import unique_rows

UTILITIES = ("gradient", "magnitude")
RAMP_SHAPES = ("linear", "geometric")
SCORES = ("chunk", "row")
GROW_INITS = ("zeros", "uniform")


class ConcatChunks(nn.Module):
    """Combine: the K pooled chunks f32[..., C] side by side -> f32[..., K C], plus the pooled fallback row f32[...,
    K C] when the table has one (`fallback`: one read more than the K chunks). Linear, so bags pool first."""

    chunks: int

    @nn.compact
    def __call__(self, rows: tuple[jax.Array, ...]) -> jax.Array:
        own = jnp.concatenate(rows[:self.chunks], axis=-1)
        return own if len(rows) == self.chunks else own + rows[self.chunks]


class FiitedEmbedding(EmbeddingMethod):
    """A packed chunk pool f32[capacity, D / K] read through the packed row offsets (aux: offsets_base, counts)."""

    DEFAULTS: ClassVar[dict] = {
        "chunks": None,  # K: chunks per row (D must be divisible by K); None: gcd(16, D), 1-column chunks up to D 16
        "keep": 0.25,  # the memory budget: the share of the V K chunks kept at the end of the ramp
        "capacity": None,  # pool slots; None: V K (every chunk live at the start)
        "utility": "gradient",
        "decay": 1.0,  # gamma, per step: 1 = the utility since training began (< 1 for drifting ids)
        "interval": 0,  # steps between adjustments; 0: ten adjustments over the ramp (`adjust_every`)
        "ramp": 0.3,  # share of the run's steps over which the budget falls from 1 to `keep`
        "compact_slack": 1.0,  # compact when capacity > (1 + slack) x the budget's chunks (and at the ramp's end)
        "grow_init": "zeros",
        "position_discount": 3.0,  # p: chunk k's score is divided by (k + 1)^p (0: FIITED's plain utility)
        "score": "row",  # "row": chunk k of a row scores the row's utility / (k + 1)^p; "chunk": min(u[0..k])
        "ramp_shape": "geometric",  # "geometric": keep^(t / ramp), the same share pruned each adjustment; "linear"
        "fallback": 0.0,  # share of the kept values in a hashed table every id reads too (0: none, the paper's)
        "seed": 0,  # the fallback's hash function
    }

    def __init__(self, spec: TableSpec):
        super().__init__(spec)
        o = method_options(spec, self.DEFAULTS)
        k = math.gcd(16, spec.dim) if o["chunks"] is None else int(o["chunks"])
        if k < 1 or spec.dim % k:
            raise ValueError(f"table '{spec.name}': fiited chunks={k} must divide dim {spec.dim}")
        if not 0 < float(o["keep"]) <= 1:
            raise ValueError(f"table '{spec.name}': fiited keep must be in (0, 1], got {o['keep']}")
        if o["utility"] not in UTILITIES:
            raise ValueError(f"table '{spec.name}': fiited utility '{o['utility']}'; use one of {UTILITIES}")
        if o["grow_init"] not in GROW_INITS:
            raise ValueError(f"table '{spec.name}': fiited grow_init '{o['grow_init']}'; use one of {GROW_INITS}")
        if not 0 < float(o["decay"]) <= 1 or int(o["interval"]) < 0 or not 0 <= float(o["ramp"]) <= 1 \
                or float(o["compact_slack"]) < 0:
            raise ValueError(f"table '{spec.name}': fiited needs 0 < decay <= 1, interval >= 0, 0 <= ramp <= 1 and "
                             f"compact_slack >= 0; got {o}")
        self.chunks, self.chunk_dim = k, spec.dim // k
        self.budget, self.utility = float(o["keep"]), o["utility"]
        self.decay, self.interval, self.ramp = float(o["decay"]), int(o["interval"]), float(o["ramp"])
        self.compact_slack, self.grow_init = float(o["compact_slack"]), o["grow_init"]
        self.position_discount = float(o["position_discount"])
        self.score, self.ramp_shape = o["score"], o["ramp_shape"]
        if self.score not in SCORES:
            raise ValueError(f"table '{spec.name}': fiited score '{self.score}'; use one of {SCORES}")
        if self.ramp_shape not in RAMP_SHAPES:
            raise ValueError(f"table '{spec.name}': fiited ramp_shape '{self.ramp_shape}'; use one of {RAMP_SHAPES}")
        self.wants_embedding_grads = self.utility == "gradient"
        total = spec.vocab_size * k
        self.capacity = int(o["capacity"]) if o["capacity"] is not None else total
        if not 1 <= self.capacity <= total:
            raise ValueError(f"table '{spec.name}': fiited capacity {self.capacity} must be in [1, V K = {total}]")
        fallback = float(o["fallback"])
        if not 0 <= fallback < 1:
            raise ValueError(f"table '{spec.name}': fiited fallback must be in [0, 1) (a share of the kept values), "
                             f"got {o['fallback']}")
        # H hashed rows of D values: the share `fallback` of the keep V D values the table may hold, leaving the
        # pool at least one chunk.
        kept_chunks = math.ceil(self.budget * total - 1e-9)
        self.fallback_rows = min(round(fallback * self.budget * spec.vocab_size), (kept_chunks - 1) // k)
        self.pool_chunks = kept_chunks - self.fallback_rows * k  # the pool's final budget
        self.hash_params = universal_hash_params(int(o["seed"]), spec.name, 0)

    # ------------------------------------------------------------------------------------ the interface
    def physical_tables(self) -> tuple[PhysicalTable, ...]:
        # Every chunk starts as the full table's DLRM init would draw it; the fallback as a hashed table's rows do
        # (compression/hashing.py: the DLRM init of an H-row table).
        pool = PhysicalTable(f"{self.spec.name}/pool", self.capacity, self.chunk_dim,
                             dlrm_init_scale(self.spec.vocab_size))
        if not self.fallback_rows:
            return (pool,)
        return pool, PhysicalTable(f"{self.spec.name}/fallback", self.fallback_rows, self.spec.dim,
                                   dlrm_init_scale(self.fallback_rows))

    def read_tables(self) -> tuple[int, ...]:
        return (0,) * self.chunks + ((1,) if self.fallback_rows else ())

    def route(self, ids: jax.Array, offsets_base: jax.Array, counts: jax.Array, **_) -> tuple[jax.Array, ...]:
        start = chunk_pool.unpack_offsets(offsets_base, counts, self.chunks, self.spec.vocab_size, ids)
        end = start + chunk_pool.unpack_counts(counts, self.chunks, ids)
        slots = chunk_pool.slots(start, end, self.chunks)  # [..., K], -1 = pruned
        reads = tuple(slots[..., k] for k in range(self.chunks))
        if not self.fallback_rows:
            return reads
        return (*reads, universal_hash(ids, *self.hash_params, self.fallback_rows))

    def offsets(self, aux: dict[str, jax.Array]) -> jax.Array:
        """i32[V + 1]: the pool's row offsets, unpacked from aux."""
        return chunk_pool.unpack_offsets(aux["offsets_base"], aux["counts"], self.chunks, self.spec.vocab_size)

    def with_offsets(self, aux: dict[str, jax.Array], offsets: jax.Array) -> dict[str, jax.Array]:
        base, counts = chunk_pool.pack_offsets(jnp.asarray(offsets), self.chunks)
        return {**aux, "offsets_base": base, "counts": counts}

    def combine_module(self, name: str) -> nn.Module:
        return ConcatChunks(self.chunks, name=name)

    def init_aux(self) -> dict[str, jax.Array]:
        """The packed offsets with the pool's slots dealt chunk-major (chunk 0 of every row, then chunk 1, ...)
        while they last -- all of them at the default capacity V K --, and zero utility."""
        v, k = self.spec.vocab_size, self.chunks
        counts = np.clip((self.capacity - np.arange(v) + v - 1) // v, 0, k)  # #{c : c V + r < capacity}
        return self.with_offsets({"utility": jnp.zeros((v, k), jnp.float32), "last": jnp.zeros((v,), jnp.int32)},
                                 chunk_pool.offsets_of(counts))

    def aux_bytes(self) -> tuple[int, int]:
        """(model bytes: the packed offsets, training-only bytes: utility and t_last)."""
        v, k = self.spec.vocab_size, self.chunks
        return chunk_pool.packed_bytes(v, k), 4 * (v * k + v)

    # -------------------------------------------------------------------------------------- the budget
    def budget_at(self, step: int, total_steps: int) -> float:
        """The pool's kept share of chunks after `step` of `total_steps`: 1 -> its final share (`keep`, less the
        fallback's) over the ramp."""
        final = self.pool_chunks / (self.spec.vocab_size * self.chunks)
        ramp_steps = self.ramp * total_steps
        if ramp_steps <= 0 or step >= ramp_steps:
            return final
        if self.ramp_shape == "geometric":
            return final ** (step / ramp_steps)
        return 1.0 - (1.0 - final) * step / ramp_steps

    def ramp_end(self, total_steps: int) -> int:
        """The step at which the budget reaches `keep` (the last adjustment)."""
        return min(total_steps, max(0, round(self.ramp * total_steps)))

    def adjust_every(self, total_steps: int) -> int:
        """Steps between adjustments: `interval`, or (0) a tenth of the ramp, so a run of any length adjusts ten
        times on the way down instead of dropping to its budget at once."""
        return self.interval or max(1, self.ramp_end(total_steps) // 10)

    def adjusts_at(self, step: int, total_steps: int) -> bool:
        end = self.ramp_end(total_steps)
        return 0 < step <= end and (step % self.adjust_every(total_steps) == 0 or step == end)

    def budget_chunks(self, share: float) -> int:
        return max(1, math.ceil(share * self.spec.vocab_size * self.chunks - 1e-9))

    # ---------------------------------------------------------------------------- per step and adjustment
    def update_aux(self, aux: dict[str, jax.Array], ids: jax.Array, weights: jax.Array, g_emb: jax.Array,
                   step: jax.Array) -> dict[str, jax.Array]:
        """Accumulate chunk utility for the rows of a batch: ids i32[B, L], weights f32[B, L] (0 = padding or
        skipped), g_emb f32[B, D] = d loss / d this feature's embedding; `step` is the step just taken."""
        if self.utility != "gradient":
            return aux
        v = self.spec.vocab_size
        rows, inverse = unique_rows(jnp.where(weights > 0, ids, v).reshape(-1), v)
        per_id = (weights[..., None] * g_emb[:, None, :]).reshape(-1, self.spec.dim)
        summed = jax.ops.segment_sum(per_id, inverse, num_segments=rows.shape[0])  # the step's row gradients
        norms = jnp.linalg.norm(summed.reshape(-1, self.chunks, self.chunk_dim), axis=-1)
        age = (step - aux["last"].at[rows].get(mode="fill", fill_value=0)).astype(jnp.float32)
        old = aux["utility"].at[rows].get(mode="fill", fill_value=0.0)
        new = old * (self.decay ** age)[:, None] + norms
        return {**aux, "utility": aux["utility"].at[rows].set(new, mode="drop"),
                "last": aux["last"].at[rows].set(step, mode="drop")}

    def scores(self, pool: chunk_pool.ChunkPool, aux: dict[str, jax.Array], step: jax.Array) -> jax.Array:
        """f32[V, K] chunk scores, non-increasing along each row (a row's chunk k scores min(u[0..k]))."""
        if self.utility == "gradient":
            age = (step - aux["last"]).astype(jnp.float32)
            u = aux["utility"] * (self.decay ** age)[:, None]
        else:  # magnitude: the chunk's L2 norm now (pruned chunks read zeros)
            u = jnp.linalg.norm(chunk_pool.read(pool, jnp.arange(self.spec.vocab_size)).reshape(
                -1, self.chunks, self.chunk_dim), axis=-1)
        if self.score == "row":
            u = jnp.broadcast_to(jnp.sum(u, axis=1, keepdims=True), u.shape)
        u = u / (jnp.arange(1, self.chunks + 1, dtype=jnp.float32) ** self.position_discount)
        return jax.lax.cummin(u, axis=1)

    def adjust(self, pool: chunk_pool.ChunkPool, aux: dict[str, jax.Array], step: jax.Array, keep: jax.Array,
               rng: jax.Array) -> tuple[chunk_pool.ChunkPool, dict[str, jax.Array], jax.Array]:
        """Keep the best `keep` chunks (i32[], <= the pool's capacity) and lay the pool out again: (pool, aux,
        bool[capacity] the slots holding a newly grown chunk)."""
        v, k = self.spec.vocab_size, self.chunks
        order = jnp.argsort(-self.scores(pool, aux, step).reshape(-1), stable=True)
        kept = jnp.zeros(v * k, jnp.bool_).at[order].set(jnp.arange(v * k) < keep).reshape(v, k)
        fill = None
        if self.grow_init == "uniform":
            scale = dlrm_init_scale(v)
            fill = jax.random.uniform(rng, pool.pool.shape, jnp.float32, -scale, scale)
        pool, fresh = chunk_pool.resize(pool, jnp.sum(kept, axis=1, dtype=jnp.int32), fill)
        return pool, self.with_offsets(aux, pool.offsets), fresh


class RowPruneEmbedding(FiitedEmbedding):
    """In-training magnitude pruning of whole rows: FIITED's machinery with one chunk per row scored by its norm."""

    DEFAULTS: ClassVar[dict] = {**FiitedEmbedding.DEFAULTS, "chunks": 1, "utility": "magnitude"}


class ZeroTail(nn.Module):
    """Combine for `uniform_dim`: the D' columns followed by D - D' zeros."""

    dim: int

    @nn.compact
    def __call__(self, rows: tuple[jax.Array, ...]) -> jax.Array:
        (only,) = rows
        return jnp.pad(only, [(0, 0)] * (only.ndim - 1) + [(0, self.dim - only.shape[-1])])


class UniformDimEmbedding(EmbeddingMethod):
    """Uniform dimension reduction: a V x D' table, D' = max(1, round(keep D)), read with a zero tail to D."""

    def __init__(self, spec: TableSpec):
        super().__init__(spec)
        budget = float(method_options(spec, {"keep": 0.25})["keep"])
        if not 0 < budget <= 1:
            raise ValueError(f"table '{spec.name}': uniform_dim keep must be in (0, 1], got {budget}")
        self.reduced_dim = max(1, round(budget * spec.dim))

    def physical_tables(self) -> tuple[PhysicalTable, ...]:
        v = self.spec.vocab_size
        return (PhysicalTable(self.spec.name, v, self.reduced_dim, dlrm_init_scale(v)),)

    def route(self, ids: jax.Array) -> tuple[jax.Array, ...]:
        return (ids,)

    def combine_module(self, name: str) -> nn.Module:
        return ZeroTail(self.spec.dim, name=name)
