"""A deterministic, Criteo-shaped synthetic dataset with labels from a planted teacher, made on the device.

Every batch is a pure function of (seed, split, batch index), so runs are reproducible and resumable by step,
and nothing is stored but the held-out "validation" and "test" splits (`eval_examples` each). The generator is one
jitted function (jax.random draws keyed by seed, stream and step; the teacher's per-id values from an integer hash),
so the trainer asks for its batches where the step runs -- `device_batches(B, step, n)`, n steps' batches at once
-- and nothing is made, checked or copied on the host (the ids are in range by construction). The held-out splits
and `train_batches` are the same function's output copied to the host.

Features
  - dense: 13 count-like features, observed as log(1 + floor(exp(1.5 z + 1))), z ~ N(0, 1) (the Criteo
    preprocessing applied to log-normal counts);
  - sparse: one feature per vocabulary size. Id frequencies follow a power law: the rank r of an id is drawn
    from the continuous Zipf density p(r) ~ r^(-s) on [1, V + 1) by inverse CDF, then mapped through a seeded
    random permutation of [0, V), so frequent ids are scattered over the id range as in hashed real data
    (a frequency-sorted layout would flatter modulo hashing). Multi-hot features draw a bag length uniformly
    from 1..L and L ids per example.

Teacher (the planted model, a field-aware factorisation machine plus a dense part and optional high-order terms)
  Every (feature, id) has a bias a_f(id) and a vector u_f(id) in R^k, each value uniform with unit variance,
  derived by hashing (seed, f, id, j) with a 32-bit integer hash (`hash32`, Wellons' lowbias32; jax has no 64-bit
  integers by default), so no table of V entries is stored. With bags mean-pooled and the standardised dense features d:
      logit = c + scale * ( w_bias  * (sum_f a_f)                        / s_bias
                          + w_pair  * (sum_{(i,j) in S} <v_i, v_j>)      / s_pair     v = u_1..u_F, P d
                          + w_dense * (w . d)                            / s_dense
                          + w_high  * (sum_m (m+1)^-decay h_m / s_m)     / s_high )  / ||w||
  S is a seeded random set of `teacher_pairs` field pairs (all pairs if 0): with all 351 pairs of Criteo's
  27 vectors, each pair's effect is too small to learn from a few million examples. Each term is divided by
  its standard deviation on a calibration sample, `scale` sets the logit's spread
  (the task's difficulty) and c is solved so the mean click probability equals `ctr`. Labels are
  Bernoulli(sigmoid(logit)); `bayes_auc` is the teacher logit's AUC on the test split, the ceiling a model
  can approach. Without high-order terms DLRM's dot interaction can represent this teacher exactly; ids seen
  rarely cannot be learned, so the achievable AUC sits below `bayes_auc` by an amount set by the vocabulary and
  exponent.

High-order terms (`teacher_tuples` > 0, the scaling-law sweep's "hard teacher")
  Tuple m = 0, 1, ... is a seeded random set of 3 + m mod (order - 2) distinct vectors among v_1..v_F, P d (the
  orders cycle through 3..`teacher_order`), and contributes the staircase product
      h_m = sum_k prod_{f in tuple m} (1 + v_f[k])
  weighted (m + 1)^-decay: a power-law spectrum of interaction strengths, so a bigger model can capture more of
  it. Expanded, h_m holds every sub-product of its tuple (orders 1..|tuple|), the "staircase" under which
  gradient descent reaches the top order through the lower ones (Abbe et al. 2022). A plain product of zero-mean
  factors is uncorrelated with every lower-order function; in a trial no model learnt any of it from 1M examples.
  No pairwise model (DLRM's dot interaction) can represent the order >= 3 parts; Wukong and DCNv2 can.
"""

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from recjax import metrics
from recjax.batch import Batch
from recjax.data.arrays import check_rows, concatenate
from recjax.specs import DatasetSpec, FeatureSpec

# Per-feature cardinalities of Criteo Kaggle (facebookresearch/dlrm, day-based split).
KAGGLE_VOCAB_SIZES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)

# MLPerf DLRMv2 (DCNv2 on Criteo 1TB) per-feature cardinalities, capped at 40M rows: 204,184,588 rows in all, 52.3 GB
# at dim 64 in f32 (the disk tier's preset, experiments/configs/dlrm_synthetic.py:mlperf52).
MLPERF_VOCAB_SIZES = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938, 155, 4, 976,
    14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)

_EVAL_CHUNK = 4096  # eval examples are generated in fixed chunks so the eval set ignores the eval batch size
_CALIBRATION_EXAMPLES = 16384
_TRAIN, _TEST, _CALIBRATION, _VALIDATION = 0, 1, 2, 3  # stream ids
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive integers before hashing


def hash32(x, xp=jnp):
    """Wellons' lowbias32 integer hash (hash-prospector) on uint32, wrapping; `xp` numpy or jax.numpy."""
    x = x ^ (x >> 16)
    x = x * xp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * xp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def fold(key: jax.Array, x) -> jax.Array:
    """A new u32 key from a u32 key and an integer (a stream, a step, a draw's number)."""
    return hash32(key ^ hash32(jnp.asarray(x).astype(jnp.uint32) + jnp.uint32(_GOLDEN)))


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """f32 uniform on [0, 1) (24 bits) per element: a counter-based generator, hash32(key ^ hash32(counter)) -- as
    keyed and reproducible as jax.random's threefry and ~10x cheaper on a CPU, where making a batch must cost little
    beside the step it feeds."""
    counter = jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape)
    return (hash32(key ^ hash32(counter)) >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """f32 standard normal per element (Box-Muller from two `uniform`s)."""
    u1, u2 = uniform(fold(key, 0), shape), uniform(fold(key, 1), shape)
    # log(1 - u1), not log1p: exact here (u1 is a multiple of 2^-24), and XLA:CPU's fused log1p is ~4x slower.
    return jnp.sqrt(-2.0 * jnp.log(1.0 - u1)) * jnp.cos(jnp.float32(2.0 * np.pi) * u2)


def hashed_uniform(feature_keys, ids, j, xp=jnp):
    """The teacher's value j of each id: uniform on [-sqrt(3), sqrt(3)) (zero mean, unit variance), from
    hash32(hash32(feature key ^ id) + (j + 1) * golden). feature_keys u32[..., 1] broadcast against ids, j u32."""
    base = hash32(feature_keys ^ ids.astype(xp.uint32), xp)
    h = hash32(base + (j + xp.uint32(1)) * xp.uint32(_GOLDEN), xp)
    u = (h >> 8).astype(xp.float32) * xp.float32(2.0**-24)
    return (2.0 * u - 1.0) * xp.float32(np.sqrt(3.0))


class SyntheticDataset:
    """Criteo-like data: `spec`, `train_batches` / `device_batches`, `eval_batches`, and the teacher's `bayes_auc`."""

    def __init__(self, *, vocab_sizes: Sequence[int], num_dense: int = 13, bag_sizes: Sequence[int] = (),
                 zipf_exponent: float = 1.1, eval_examples: int = 32768, teacher_dim: int = 8,
                 teacher_pairs: int = 24, teacher_tuples: int = 0, teacher_order: int = 3,
                 teacher_decay: float = 1.0, logit_scale: float = 2.0, ctr: float = 0.25,
                 weights: Sequence[float] = (0.5, 1.0, 0.5), seed: int = 0):
        vocab_sizes = tuple(int(v) for v in vocab_sizes)
        bag_sizes = tuple(int(b) for b in bag_sizes) or (1,) * len(vocab_sizes)
        if len(bag_sizes) != len(vocab_sizes):
            raise ValueError(f"bag_sizes has {len(bag_sizes)} entries but there are {len(vocab_sizes)} features")
        if zipf_exponent < 0:
            raise ValueError(f"zipf_exponent must be >= 0, got {zipf_exponent}")
        if not 0 < ctr < 1:
            raise ValueError(f"ctr must be in (0, 1), got {ctr}")
        if len(weights) not in (3, 4):
            raise ValueError(f"weights must be (bias, pair, dense) or (bias, pair, dense, high_order), got {weights}")
        if teacher_tuples < 0:
            raise ValueError(f"teacher_tuples must be >= 0, got {teacher_tuples}")
        if teacher_tuples and not 3 <= teacher_order <= len(vocab_sizes) + 1:
            raise ValueError(f"teacher_order must be in [3, {len(vocab_sizes) + 1}] (3 up to the number of sparse "
                             f"features + 1 for the dense vector), got {teacher_order}")
        if not teacher_tuples and len(weights) == 4 and weights[3] != 0:
            raise ValueError(f"weights {tuple(weights)} give the high-order term weight {weights[3]} but "
                             "teacher_tuples is 0; set teacher_tuples > 0 or the 4th weight to 0")
        if teacher_tuples and len(weights) == 3:
            raise ValueError("teacher_tuples > 0 needs a 4th weight (the high-order term's), e.g. (1.0, 0.7, 0.5, 1.0)")
        if max(vocab_sizes) >= 2**31:
            raise ValueError(f"vocab_sizes must be < 2**31 (int32 ids), got {max(vocab_sizes):,}")
        self.spec = DatasetSpec(
            num_dense=num_dense,
            features=tuple(FeatureSpec(f"C{i + 1}", v, b)
                           for i, (v, b) in enumerate(zip(vocab_sizes, bag_sizes, strict=True))),
        )
        self.seed = seed
        self.zipf_exponent = zipf_exponent
        self.eval_examples = eval_examples
        self.teacher_dim = teacher_dim
        self.logit_scale = logit_scale
        self.ctr = ctr
        self.weights = tuple(weights) if len(weights) == 4 else (*weights, 0.0)
        self._vocab = np.asarray(vocab_sizes, np.int64)
        self._max_bag = max(bag_sizes)
        self._bag = np.asarray(bag_sizes, np.int64)

        rng = np.random.default_rng([seed, 99])
        # One permutation per feature, concatenated, kept on the device only (the Kaggle cardinalities: 135 MB);
        # feature f's ranks map through perm[offset_f + r].
        perm_offset = np.concatenate([[0], np.cumsum(self._vocab)[:-1]]).astype(np.int32)
        perm = jax.device_put(np.concatenate([rng.permutation(v).astype(np.int32) for v in vocab_sizes]))
        self._dense_w = rng.normal(size=num_dense)
        self._dense_proj = rng.normal(size=(num_dense, teacher_dim)) / np.sqrt(num_dense)
        self._feature_keys = hash32(rng.integers(0, 2**32, dtype=np.uint64).astype(np.uint32)
                                    + np.arange(len(vocab_sizes), dtype=np.uint32) * np.uint32(_GOLDEN), np)
        # The interacting pairs among the F sparse vectors and the dense vector (index F).
        all_pairs = np.asarray([(i, j) for i in range(len(vocab_sizes) + 1) for j in range(i)])
        if teacher_pairs > 0:
            all_pairs = all_pairs[np.sort(rng.choice(len(all_pairs), min(teacher_pairs, len(all_pairs)),
                                                     replace=False))]
        self._pairs = all_pairs
        # High-order tuples: tuple m (m = 0, 1, ...) joins 3 + m mod (order - 2) distinct vectors (the orders cycle
        # through 3..order) and is weighted (m + 1)^-decay, a power-law spectrum of interaction strengths.
        self._tuples = [np.sort(rng.choice(len(vocab_sizes) + 1, 3 + m % (teacher_order - 2), replace=False))
                        for m in range(teacher_tuples)]
        self._tuple_weights = (np.arange(teacher_tuples) + 1.0) ** -float(teacher_decay)
        self._shape = _Shape(num_dense, vocab_sizes, bag_sizes, float(zipf_exponent), int(teacher_dim),
                             tuple(map(tuple, self._pairs.tolist())), tuple(tuple(t.tolist()) for t in self._tuples),
                             float(logit_scale), tuple(f.name for f in self.spec.features))
        consts = {"key": hash32(np.asarray([seed], np.uint64).astype(np.uint32) ^ np.uint32(0x5EED), np)[0],
                  "perm": perm, "perm_offset": perm_offset,
                  "feature_keys": self._feature_keys, "dense_w": self._dense_w, "dense_proj": self._dense_proj,
                  "tuple_weights": self._tuple_weights, "weights": np.asarray(self.weights)}
        consts = jax.device_put({k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in consts.items()})

        # Calibrate (one compiled call): standardise each teacher term, then solve the offset for the target click rate.
        mean, std, tuple_std, term_std, raw = jax.device_get(_calibration(self._shape, consts, _CALIBRATION_EXAMPLES))
        self._dense_mean, self._dense_std, self._tuple_std, self._term_std = mean, std, tuple_std, term_std
        self._offset = _solve_offset(np.asarray(raw, np.float64), ctr)
        # The constants every batch is made from, on the device once.
        self._c = {**consts, **jax.device_put({"dense_mean": mean, "dense_std": std, "tuple_std": tuple_std,
                                              "term_std": term_std, "offset": np.float32(self._offset)})}

        self._held_out = {"validation": self._make_held_out(_VALIDATION)[0]}
        self._held_out["test"], logits = self._make_held_out(_TEST)
        probs = 1.0 / (1.0 + np.exp(-logits))
        self._bayes_auc = metrics.auc(self._held_out["test"].labels, logits)
        self._bayes_logloss = metrics.logloss(self._held_out["test"].labels, probs)

    # ------------------------------------------------------------------------------------ public API
    @property
    def bayes_auc(self) -> float:
        """AUC of the teacher's own logits on the test split."""
        return self._bayes_auc

    def info(self) -> dict:
        return {"bayes_auc": self._bayes_auc, "bayes_logloss": self._bayes_logloss}

    def num_examples(self, split: str) -> int | None:
        """Held-out split sizes; None for train, which is endless (budgets are in steps, not epochs)."""
        return None if split == "train" else self._held_out[split].size

    def device_batches(self, batch_size: int, start_step: int, steps: int = 1) -> Batch:
        """The train batches of steps start_step .. start_step + steps - 1, made on the default device: stacked on a
        leading axis (f32[steps, B, ...]) when steps > 1, else the one batch. Step i's batch depends only on (seed,
        batch_size, i): the same whatever `steps` groups it with."""
        return _train(self._shape, self._c, jnp.int32(start_step), batch_size, steps)

    def train_batches(self, batch_size: int, start_step: int = 0, rows: slice | None = None) -> Iterator[Batch]:
        """Endless training stream on the host (`device_batches`, one step at a time, copied); batch i depends only
        on (seed, batch_size, i). With `rows` (multi-host: this process's share), only those rows of each batch."""
        rows = check_rows(rows, batch_size)
        step = start_step
        while True:
            batch = jax.device_get(self.device_batches(batch_size, step))
            yield jax.tree.map(lambda x: np.asarray(x)[rows], batch)
            step += 1

    def eval_batches(self, batch_size: int, split: str, rows: slice | None = None) -> Iterator[Batch]:
        """The fixed "validation" or "test" split in batches of `batch_size` (the last one may be shorter); with
        `rows`, only those rows of each batch (possibly none of the last one)."""
        data = self._held_out[split]
        rows = check_rows(rows, batch_size)
        for start in range(0, data.size, batch_size):
            sl = slice(min(start + rows.start, data.size), min(start + rows.stop, data.size))
            yield Batch(dense=data.dense[sl], ids={k: v[sl] for k, v in data.ids.items()},
                        lengths={k: v[sl] for k, v in data.lengths.items()}, labels=data.labels[sl])

    def id_counts(self, examples: int) -> dict[str, np.ndarray]:
        """Expected lookups of every id in `examples` training examples: {feature: f64[vocab_size]}.

        Exact for the generator (up to its f32 inverse CDF): rank r is drawn with P(r) = F(r + 2) - F(r + 1) under the
        continuous Zipf CDF F(x) = (x^(1-s) - 1) / ((V+1)^(1-s) - 1) on [1, V + 1) (log x / log(V + 1) at s = 1),
        goes to id perm[r], and a bag holds (L + 1) / 2 ids on average (lengths uniform on 1..L; 1 for one-hot).
        """
        out = {}
        s = self.zipf_exponent
        offsets = np.asarray(self._c["perm_offset"])
        for i, feature in enumerate(self.spec.features):
            v = int(self._vocab[i])
            edges = np.arange(1, v + 2, dtype=np.float64)  # rank r covers x in [r + 1, r + 2)
            if abs(s - 1.0) < 1e-9:
                cdf = np.log(edges) / np.log(v + 1.0)
            else:
                cdf = (edges ** (1.0 - s) - 1.0) / ((v + 1.0) ** (1.0 - s) - 1.0)
            p_rank = np.diff(cdf)
            mean_bag = (feature.bag_size + 1) / 2 if feature.bag_size > 1 else 1.0
            counts = np.zeros(v, np.float64)
            counts[np.asarray(self._c["perm"][offsets[i]: offsets[i] + v])] = examples * mean_bag * p_rank
            out[feature.name] = counts
        return out

    def teacher_logits(self, batch: Batch) -> np.ndarray:
        """The planted model's logits for a batch (f32 values, as f64[B])."""
        ids = np.zeros((batch.size, len(self._vocab), self._max_bag), np.int32)
        lengths = np.stack([batch.lengths[f.name] for f in self.spec.features], 1).astype(np.int32)
        for i, f in enumerate(self.spec.features):
            ids[:, i, : f.bag_size] = batch.ids[f.name]
        return np.asarray(_teacher_logits(self._shape, self._c, batch.dense, ids, lengths), np.float64)

    # ----------------------------------------------------------------------------------- generation
    def _make_held_out(self, stream: int) -> tuple[Batch, np.ndarray]:
        """`eval_examples` examples of a held-out stream and the teacher's logits for them (chunks of _EVAL_CHUNK,
        keyed by (stream, chunk); the last one cut short)."""
        parts, logits = [], []
        for chunk in range(-(-self.eval_examples // _EVAL_CHUNK)):
            size = min(_EVAL_CHUNK, self.eval_examples - chunk * _EVAL_CHUNK)
            batch, lg = jax.device_get(_held_out(self._shape, self._c, stream, chunk, _EVAL_CHUNK))
            parts.append(jax.tree.map(lambda x, size=size: np.asarray(x)[:size], batch))
            logits.append(np.asarray(lg, np.float64)[:size])
        return concatenate(parts), np.concatenate(logits)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What the generator's compiled code depends on (hashable: datasets of one shape share their executables);
    everything seeded -- the key, permutations, teacher weights, calibration -- is in the constants `c`."""

    num_dense: int
    vocab: tuple[int, ...]
    bags: tuple[int, ...]
    zipf: float
    teacher_dim: int
    pairs: tuple[tuple[int, int], ...]
    tuples: tuple[tuple[int, ...], ...]
    logit_scale: float
    names: tuple[str, ...]

    def key(self, c: dict, stream: int, index) -> jax.Array:
        return fold(fold(c["key"], stream), index)

    def features(self, c: dict, key: jax.Array, n: int):
        """dense f32[n, num_dense], ids i32[n, F, Lmax] (0 past each bag's length), lengths i32[n, F]."""
        z = normal(fold(key, 1), (n, self.num_dense))
        dense = jnp.log(1.0 + jnp.floor(jnp.exp(1.5 * z + 1.0)))  # log1p of a whole count (1 + c is exact)
        num_features, max_bag = len(self.vocab), max(self.bags)
        u = uniform(fold(key, 2), (n, num_features, max_bag))
        ranks = _zipf_ranks(u, jnp.asarray(self.vocab, jnp.int32)[None, :, None], self.zipf, xp=jnp)
        ids = c["perm"][c["perm_offset"][None, :, None] + ranks]
        bag = jnp.asarray(self.bags, jnp.int32)[None, :]
        drawn = jnp.floor(uniform(fold(key, 3), (n, num_features)) * bag).astype(jnp.int32) + 1  # 1..bag
        lengths = jnp.where(bag > 1, drawn, 1)
        ids = jnp.where(jnp.arange(max_bag)[None, None, :] < lengths[:, :, None], ids, 0)
        return dense, ids, lengths

    def vectors(self, c: dict, dense, ids, lengths):
        """The bag-pooled per-id biases f32[n, F], the vectors v_1..v_F, P d as f32[n, F + 1, k], and the
        standardised dense features d."""
        j = jnp.arange(self.teacher_dim + 1, dtype=jnp.uint32)
        values = hashed_uniform(c["feature_keys"][None, :, None, None], ids[..., None], j)  # [n, F, L, k+1]
        mask = (jnp.arange(ids.shape[2])[None, None, :] < lengths[:, :, None]) / lengths[:, :, None]
        pooled = jnp.einsum("nflk,nfl->nfk", values, mask.astype(jnp.float32))  # mean over each bag
        d = (dense - c["dense_mean"]) / c["dense_std"]
        return pooled[..., 0], jnp.concatenate([pooled[..., 1:], (d @ c["dense_proj"])[:, None, :]], axis=1), d

    def parts(self, c: dict, dense, ids, lengths):
        """(the four un-scaled terms f32[4, n]: bias, pairwise, dense, high-order; the tuples' staircase products
        f32[n, tuples])."""
        biases, vectors, d = self.vectors(c, dense, ids, lengths)
        pairs = np.asarray(self.pairs, np.int32).reshape(-1, 2)
        pair = (vectors[:, pairs[:, 0]] * vectors[:, pairs[:, 1]]).sum((1, 2))
        if self.tuples:
            products = jnp.stack([jnp.prod(1.0 + vectors[:, list(t)], axis=1).sum(-1) for t in self.tuples], axis=1)
            high = (products / c["tuple_std"]) @ c["tuple_weights"]
        else:
            products, high = jnp.zeros((dense.shape[0], 0), jnp.float32), jnp.zeros_like(pair)
        return jnp.stack([biases.sum(1), pair, d @ c["dense_w"], high]), products

    def logits(self, c: dict, dense, ids, lengths):
        terms, _ = self.parts(c, dense, ids, lengths)
        w = c["weights"]
        mix = (w[:, None] * terms / c["term_std"][:, None]).sum(0)
        return c["offset"] + self.logit_scale * mix / jnp.sqrt((w * w).sum())

    def examples(self, c: dict, key: jax.Array, n: int) -> tuple[Batch, jax.Array]:
        """(Batch of n examples, the teacher's logits f32[n]) from one key."""
        # The barrier keeps XLA from fusing the draws (pow, exp, log per element) into each of their consumers,
        # which would compute them once per consumer.
        dense, ids, lengths = jax.lax.optimization_barrier(self.features(c, key, n))
        logits = self.logits(c, dense, ids, lengths)
        labels = (uniform(fold(key, 4), (n,)) < jax.nn.sigmoid(logits)).astype(jnp.float32)
        batch = Batch(dense=dense, ids={f: ids[:, i, : b] for i, (f, b) in enumerate(zip(self.names, self.bags,
                                                                                           strict=True))},
                      lengths={f: lengths[:, i] for i, f in enumerate(self.names)}, labels=labels)
        return batch, logits


@functools.partial(jax.jit, static_argnums=(0, 2))
def _calibration(shape: _Shape, c: dict, n: int):
    """The teacher's calibration from n examples of the calibration stream: the dense features' mean and std, the
    tuples' and the four terms' standard deviations (each term divided by its own), and the logits before the offset."""
    dense, ids, lengths = shape.features(c, shape.key(c, _CALIBRATION, 0), n)
    mean, std = dense.mean(0), dense.std(0) + 1e-6
    c = {**c, "dense_mean": mean, "dense_std": std, "tuple_std": jnp.ones(len(shape.tuples), jnp.float32),
         "term_std": jnp.ones(4, jnp.float32), "offset": jnp.float32(0.0)}
    tuple_std = shape.parts(c, dense, ids, lengths)[1].std(0) + 1e-12
    c["tuple_std"] = tuple_std
    term_std = shape.parts(c, dense, ids, lengths)[0].std(1) + 1e-12
    c["term_std"] = term_std
    return mean, std, tuple_std, term_std, shape.logits(c, dense, ids, lengths)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _held_out(shape: _Shape, c: dict, stream: int, chunk, n: int):
    return shape.examples(c, shape.key(c, stream, chunk), n)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _train(shape: _Shape, c: dict, start: jax.Array, batch_size: int, steps: int) -> Batch:
    """The train batches of steps start .. start + steps - 1 (stacked when steps > 1); step i's key folds in the batch
    size and i only, so a batch is the same whatever call makes it."""
    def one(step):
        return shape.examples(c, fold(shape.key(c, _TRAIN, batch_size), step), batch_size)[0]

    return one(start) if steps == 1 else jax.vmap(one)(start + jnp.arange(steps))


@functools.partial(jax.jit, static_argnums=(0,))
def _teacher_logits(shape: _Shape, c: dict, dense, ids, lengths):
    return shape.logits(c, dense, ids, lengths)


def _zipf_ranks(u, vocab, s: float, xp=np):
    """Inverse CDF of p(x) ~ x^(-s) on [1, V+1), floored to ranks 0..V-1; `vocab` integers, `xp` numpy (f64, i64) or
    jax.numpy (f32, i32: a rank a few ulps off in a 10M-row tail is still a tail rank; the clamp is exact)."""
    integer = np.int64 if xp is np else jnp.int32
    v1 = vocab.astype(u.dtype) + 1.0
    # (s -> 1: the log-uniform limit)
    x = v1**u if abs(s - 1.0) < 1e-9 else (1.0 + u * (v1 ** (1.0 - s) - 1.0)) ** (1.0 / (1.0 - s))
    return xp.minimum(xp.floor(x).astype(integer) - 1, vocab.astype(integer) - 1)


def _solve_offset(raw: np.ndarray, ctr: float) -> float:
    """c such that mean(sigmoid(raw + c)) == ctr (bisection; the mean is monotone in c)."""
    lo, hi = -30.0, 30.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if np.mean(1.0 / (1.0 + np.exp(-(raw + mid)))) < ctr:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
