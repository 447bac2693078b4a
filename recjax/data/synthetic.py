"""A deterministic, Criteo-shaped synthetic dataset with labels from a planted teacher.

Every batch is a pure function of (seed, split, batch index), so runs are reproducible and resumable by step,
and nothing is stored but the held-out "validation" and "test" splits (`eval_examples` each).

Features
  - dense: 13 count-like features, observed as log(1 + floor(exp(1.5 z + 1))), z ~ N(0, 1) (the Criteo
    preprocessing applied to log-normal counts);
  - sparse: one feature per vocabulary size. Id frequencies follow a power law: the rank r of an id is drawn
    from the continuous Zipf density p(r) ~ r^(-s) on [1, V + 1) by inverse CDF, then mapped through a seeded
    random permutation of [0, V), so frequent ids are scattered over the id range as in hashed real data
    (a frequency-sorted layout would flatter modulo hashing). Multi-hot features draw a bag length uniformly
    from 1..L and L ids per example.

Teacher (the planted model, a field-aware factorisation machine plus a dense part and optional high-order terms)
  Every (feature, id) has a bias a_f(id) and a vector u_f(id) in R^k, derived by hashing (seed, f, id) with
  splitmix64, so no table of V entries is stored. With bags mean-pooled and the standardised dense features d:
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

from collections.abc import Iterator, Sequence

import numpy as np

from recjax import metrics
from recjax.batch import Batch
from recjax.data.arrays import check_rows, concatenate
from recjax.data.vocabulary import splitmix64
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
_TRAIN, _TEST, _CALIBRATION, _VALIDATION = 0, 1, 2, 3  # stream ids; test keeps id 1 (the former eval split)


def _unit_uniform(h: np.ndarray) -> np.ndarray:
    """uint64 hash -> float64 uniform on [-sqrt(3), sqrt(3)) (zero mean, unit variance)."""
    u = (h >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return (2.0 * u - 1.0) * np.sqrt(3.0)


class SyntheticDataset:
    """Criteo-like data: `spec`, `train_batches`, `eval_batches`, and the teacher's `bayes_auc`."""

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
        # One permutation per feature, concatenated; feature f's ranks map through perm[offset_f + r].
        self._perm_offset = np.concatenate([[0], np.cumsum(self._vocab)[:-1]])
        self._perm = np.concatenate([rng.permutation(v).astype(np.int32) for v in vocab_sizes])
        self._dense_w = rng.normal(size=num_dense)
        self._dense_proj = rng.normal(size=(num_dense, teacher_dim)) / np.sqrt(num_dense)
        self._hash_key = np.uint64(rng.integers(0, 2**63))
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
        self._tuple_std = np.ones(teacher_tuples)

        # Calibrate: standardise each teacher term, then solve the offset for the target click rate.
        dense, ids, lengths = self._features(np.random.default_rng([seed, _CALIBRATION]), _CALIBRATION_EXAMPLES)
        self._dense_mean, self._dense_std = dense.mean(0), dense.std(0) + 1e-6
        if self._tuples:
            d = (dense - self._dense_mean) / self._dense_std
            self._tuple_std = self._tuple_products(self._teacher_vectors(d, ids, lengths)[1]).std(0) + 1e-12
        terms = self._teacher_terms(dense, ids, lengths)
        self._term_std = np.asarray([t.std() + 1e-12 for t in terms])
        raw = self._combine(terms, offset=0.0)
        self._offset = _solve_offset(raw, ctr)

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

    def train_batches(self, batch_size: int, start_step: int = 0, rows: slice | None = None) -> Iterator[Batch]:
        """Endless training stream; batch i depends only on (seed, batch_size, i). With `rows` (multi-host: this
        process's share), only those rows of each batch: the random draws of the whole batch are made (they are
        sequential in one generator, and cheap), the features, teacher and labels only for `rows`."""
        rows = check_rows(rows, batch_size)
        step = start_step
        while True:
            batch, _ = self._batch(np.random.default_rng([self.seed, _TRAIN, batch_size, step]), batch_size, rows)
            yield batch
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

        Exact for the generator: rank r is drawn with P(r) = F(r + 2) - F(r + 1) under the continuous Zipf CDF
        F(x) = (x^(1-s) - 1) / ((V+1)^(1-s) - 1) on [1, V + 1) (log x / log(V + 1) at s = 1), goes to id
        perm[r], and a bag holds (L + 1) / 2 ids on average (lengths uniform on 1..L; 1 for one-hot).
        """
        out = {}
        s = self.zipf_exponent
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
            counts[self._perm[self._perm_offset[i]: self._perm_offset[i] + v]] = examples * mean_bag * p_rank
            out[feature.name] = counts
        return out

    def teacher_logits(self, batch: Batch) -> np.ndarray:
        """The planted model's logits for a batch (f64[B])."""
        ids = np.zeros((batch.size, len(self._vocab), self._max_bag), np.int64)
        lengths = np.stack([batch.lengths[f.name] for f in self.spec.features], 1)
        for i, f in enumerate(self.spec.features):
            ids[:, i, : f.bag_size] = batch.ids[f.name]
        return self._combine(self._teacher_terms(batch.dense, ids, lengths), self._offset)

    # ----------------------------------------------------------------------------------- generation
    def _features(self, rng: np.random.Generator, n: int, rows: slice = slice(None)):
        """dense f32[n, num_dense], ids i64[n, F, Lmax], lengths i64[n, F] (only `rows` of the n drawn)."""
        z = rng.standard_normal((n, self.spec.num_dense))[rows]
        dense = np.log1p(np.floor(np.exp(1.5 * z + 1.0))).astype(np.float32)
        num_features = len(self._vocab)
        u = rng.random((n, num_features, self._max_bag))[rows]
        ranks = _zipf_ranks(u, self._vocab[None, :, None], self.zipf_exponent)
        ids = self._perm[self._perm_offset[None, :, None] + ranks].astype(np.int64)
        drawn = rng.integers(1, self._bag[None, :] + 1, (n, num_features))[rows]
        lengths = np.where(self._bag[None, :] > 1, drawn, 1)
        slot = np.arange(self._max_bag)[None, None, :]
        ids = np.where(slot < lengths[:, :, None], ids, 0)
        return dense, ids, lengths

    def _teacher_vectors(self, d, ids, lengths):
        """The bag-pooled per-id biases f64[n, F] and the vectors v_1..v_F, P d as f64[n, F + 1, k]; `d` is the
        standardised dense features."""
        n, num_features, max_bag = ids.shape
        k = self.teacher_dim
        feat = np.arange(num_features, dtype=np.uint64)[None, :, None]
        base = splitmix64(self._hash_key ^ splitmix64(feat * np.uint64(0x100000001B3) + ids.astype(np.uint64)))
        j = np.arange(k + 1, dtype=np.uint64)
        values = _unit_uniform(splitmix64(base[..., None] + j))  # [n, F, L, k+1]: bias and k-vector
        mask = (np.arange(max_bag)[None, None, :] < lengths[:, :, None]) / lengths[:, :, None]
        pooled = np.einsum("nflk,nfl->nfk", values, mask)  # mean over each bag
        return pooled[..., 0], np.concatenate([pooled[..., 1:], (d @ self._dense_proj)[:, None, :]], axis=1)

    def _tuple_products(self, vectors):
        """Each high-order tuple's staircase product sum_k prod_{f in tuple} (1 + v_f[k]): f64[n, teacher_tuples]."""
        return np.stack([np.prod(1.0 + vectors[:, t], axis=1).sum(-1) for t in self._tuples], axis=1)

    def _teacher_terms(self, dense, ids, lengths):
        """The four un-scaled teacher terms (bias, pairwise, dense, high-order), each f64[n]."""
        d = (dense - self._dense_mean) / self._dense_std
        biases, vectors = self._teacher_vectors(d, ids, lengths)
        pair = (vectors[:, self._pairs[:, 0]] * vectors[:, self._pairs[:, 1]]).sum((1, 2))
        high = (self._tuple_products(vectors) / self._tuple_std) @ self._tuple_weights if self._tuples else 0 * pair
        return biases.sum(1), pair, d @ self._dense_w, high

    def _combine(self, terms, offset: float) -> np.ndarray:
        mix = sum(w * t / s for w, t, s in zip(self.weights, terms, self._term_std, strict=True))
        return offset + self.logit_scale * mix / np.sqrt(sum(w * w for w in self.weights))

    def _batch(self, rng: np.random.Generator, n: int, rows: slice = slice(None)) -> tuple[Batch, np.ndarray]:
        dense, ids, lengths = self._features(rng, n, rows)
        logits = self._combine(self._teacher_terms(dense, ids, lengths), self._offset)
        labels = (rng.random(n)[rows] < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        batch = Batch(
            dense=dense,
            ids={f.name: ids[:, i, : f.bag_size].astype(np.int32) for i, f in enumerate(self.spec.features)},
            lengths={f.name: lengths[:, i].astype(np.int32) for i, f in enumerate(self.spec.features)},
            labels=labels,
        )
        return batch, logits

    def _make_held_out(self, stream: int) -> tuple[Batch, np.ndarray]:
        """`eval_examples` examples of a held-out stream and the teacher's logits for them."""
        parts, logits = [], []
        for c in range(-(-self.eval_examples // _EVAL_CHUNK)):
            size = min(_EVAL_CHUNK, self.eval_examples - c * _EVAL_CHUNK)
            batch, lg = self._batch(np.random.default_rng([self.seed, stream, c]), size)
            parts.append(batch)
            logits.append(lg)
        return concatenate(parts), np.concatenate(logits)


def _zipf_ranks(u: np.ndarray, vocab: np.ndarray, s: float) -> np.ndarray:
    """Inverse CDF of p(x) ~ x^(-s) on [1, V+1), floored to ranks 0..V-1."""
    v1 = (vocab + 1).astype(np.float64)
    if abs(s - 1.0) < 1e-9:  # the s -> 1 limit: log-uniform
        return np.minimum(np.floor(v1**u).astype(np.int64) - 1, vocab - 1)
    x = (1.0 + u * (v1 ** (1.0 - s) - 1.0)) ** (1.0 / (1.0 - s))
    return np.minimum(np.floor(x).astype(np.int64) - 1, vocab - 1)


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
