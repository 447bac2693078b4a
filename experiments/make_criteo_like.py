r"""Write a synthetic Criteo Kaggle stand-in: `train.txt` in the Kaggle format, with clicks from a planted teacher.

    python -m experiments.make_criteo_like --out=/tmp/criteo_like                 # 1M lines, ~250 MB
    python -m experiments.train --config=experiments/configs/dlrm_criteo_kaggle.py --config.data.dir=/tmp/criteo_like

Criteo's logs may not be redistributed and only 1,999 of Kaggle's 45.8M lines are here, so the paper reproductions
(`python -m experiments.reproduce`) that need Criteo-format data run on this when no `--data_dir` is given. Unlike
benchmarks/data.py's generated lines (random labels, for throughput), these have signal to learn: every line is one
example of recjax/data/synthetic.py's planted teacher (a field-aware factorisation machine over the 26 categorical
features and the 13 dense counts, plus a per-id bias for every id), so embedding compression has a real cost to
measure -- hashing merges ids whose biases and vectors differ, quotient-remainder composes them, a pruned row loses
its vector. Written as Kaggle's train.txt: label, I1..I13 (the counts floor(exp(1.5 z + 1)); Criteo's preprocessing,
log(1 + x), gives back the teacher's dense features), C1..C26 (8 hex digits: a 32-bit hash of the feature and the
id); tab-separated, one example per line. recjax/data/criteo.py then prepares it exactly as the real file: the
reference's 7-day split by line count (days 0-5 train, day 6 halved into test and validation), a frequency
vocabulary fitted on the train days (an id first seen after them reads the out-of-vocabulary row).

Shape (flags): `--lines` (1,000,000), the Kaggle cardinalities capped at `--vocab_cap` (100,000: 1.2M ids in all),
Zipf(`--zipf_exponent` 1.1) id frequencies in a random id order, and dlrm_synthetic.py's `kaggle` teacher (k = 4,
16 interacting field pairs, logit std 1.6, click rate 0.25). The output is a pure function of the flags (`--seed`);
the script prints one JSON line (lines, clicks, distinct ids per feature and in all, and the teacher's test AUC and
log loss on the test lines -- the Bayes ceiling a model can approach) and writes nothing but train.txt into --out
(never the repository: data stays outside it).
"""

import json
import pathlib
from collections.abc import Sequence

import numpy as np
from absl import flags

from recjax import cli, metrics
from recjax.data import criteo
from recjax.data.synthetic import KAGGLE_VOCAB_SIZES, SyntheticDataset

CHUNK = 50_000  # lines generated per block
_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)


def teacher(vocab_cap: int = 100_000, zipf_exponent: float = 1.1, seed: int = 0) -> SyntheticDataset:
    """The planted model: dlrm_synthetic.py's `kaggle` teacher over the capped Kaggle cardinalities."""
    from experiments.configs import dlrm_synthetic

    t = dlrm_synthetic.get_config("kaggle").data.teacher
    return SyntheticDataset(vocab_sizes=[min(v, vocab_cap) for v in KAGGLE_VOCAB_SIZES], num_dense=13,
                            zipf_exponent=zipf_exponent, eval_examples=1, teacher_dim=t.dim, teacher_pairs=t.pairs,
                            logit_scale=t.logit_scale, ctr=t.ctr, weights=t.weights, seed=seed)


def _hex_keys(feature: int, ids: np.ndarray, seed: int) -> np.ndarray:
    """u8[n, 8]: the lowercase hex text of a 32-bit hash of (seed, feature, id): one key per id, like Criteo's."""
    x = (np.uint64(seed) << np.uint64(40)) ^ (np.uint64(feature) << np.uint64(32)) ^ ids.astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser (Steele et al. 2014)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    key = (x ^ (x >> np.uint64(31))) & np.uint64(0xFFFFFFFF)
    shifts = np.arange(28, -1, -4, dtype=np.uint64)
    return _HEX[((key[:, None] >> shifts) & np.uint64(0xF)).astype(np.int64)]


def format_lines(dense: np.ndarray, ids: dict[str, np.ndarray], labels: np.ndarray, seed: int) -> bytes:
    """Kaggle lines for one block: label, the 13 counts (exp(dense) - 1, exact integers), the 26 hex keys."""
    counts = np.rint(np.expm1(dense.astype(np.float64))).astype(np.int64)
    columns = [labels.astype(np.int64).astype(str)] + [counts[:, j].astype(str) for j in range(counts.shape[1])]
    for f, name in enumerate(criteo.CRITEO_FEATURE_NAMES):
        columns.append(_hex_keys(f, ids[name][:, 0], seed).view("S8")[:, 0].astype(str))
    rows = ["\t".join(fields) for fields in zip(*columns, strict=True)]
    return ("\n".join(rows) + "\n").encode()


def write(out: pathlib.Path, lines: int = 1_000_000, vocab_cap: int = 100_000, zipf_exponent: float = 1.1,
          seed: int = 0) -> dict:
    """Write `out`/train.txt; return its statistics (and the teacher's quality on the test lines)."""
    if lines < 14:
        raise ValueError(f"--lines must be >= 14 (7 days, day 6 halved into test and validation), got {lines}")
    if vocab_cap < 1:
        raise ValueError(f"--vocab_cap must be >= 1, got {vocab_cap}")
    out.mkdir(parents=True, exist_ok=True)
    data = teacher(vocab_cap, zipf_exponent, seed)
    path = out / "train.txt"
    logits, labels = [], []
    seen = [np.zeros(f.vocab_size, bool) for f in data.spec.features]
    with path.open("wb") as f:
        for i, batch in enumerate(data.train_batches(CHUNK)):
            n = min(CHUNK, lines - i * CHUNK)
            if n <= 0:
                break
            batch = batch.replace(dense=batch.dense[:n], ids={k: v[:n] for k, v in batch.ids.items()},
                                  lengths={k: v[:n] for k, v in batch.lengths.items()}, labels=batch.labels[:n])
            f.write(format_lines(batch.dense, batch.ids, batch.labels, seed))
            logits.append(data.teacher_logits(batch))
            labels.append(batch.labels)
            for j, feature in enumerate(data.spec.features):
                seen[j][batch.ids[feature.name][:, 0]] = True
    logits, labels = np.concatenate(logits), np.concatenate(labels)
    test = criteo.kaggle_splits(path)["test"][0]
    validation = criteo.kaggle_splits(path)["validation"][0]
    rows = slice(test.first_line - 1, validation.first_line - 1)  # 1-based line numbers -> rows
    probs = 1.0 / (1.0 + np.exp(-logits[rows]))
    return {"path": str(path), "lines": int(lines), "clicks": float(labels.mean()),
            "distinct_ids": int(sum(s.sum() for s in seen)), "vocab_sizes": [f.vocab_size for f in data.spec.features],
            "distinct_ids_per_feature": [int(s.sum()) for s in seen], "zipf_exponent": zipf_exponent,
            "test_lines": int(rows.stop - rows.start), "bayes_auc": metrics.auc(labels[rows], logits[rows]),
            "bayes_logloss": metrics.logloss(labels[rows], probs), "seed": seed}


def define_flags() -> None:
    flags.DEFINE_string("out", None, "Folder to write train.txt into (created; never the repository).")
    flags.DEFINE_integer("lines", 1_000_000, "Lines (examples) to write.")
    flags.DEFINE_integer("vocab_cap", 100_000, "Cap on each feature's cardinality (the Kaggle sizes, capped).")
    flags.DEFINE_float("zipf_exponent", 1.1, "Id frequency ~ rank^-s within each feature.")
    flags.DEFINE_integer("seed", 0, "Seeds the teacher and every draw.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {argv[1:]}")
    args = flags.FLAGS
    if not args.out:
        cli.fail("--out is required: the folder to write train.txt into")
    try:
        stats = write(pathlib.Path(args.out), args.lines, args.vocab_cap, args.zipf_exponent, args.seed)
    except ValueError as error:
        cli.fail(str(error))
    print(json.dumps(stats))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
