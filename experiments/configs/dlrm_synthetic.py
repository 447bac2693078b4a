r"""DLRM on the built-in synthetic Criteo-like data (the default of `python -m experiments.train`).

    python -m experiments.train --config=experiments/configs/dlrm_synthetic.py --workdir=runs/synthetic

The preset after a colon picks a reference model shape on data with the matching cardinalities:

    --config=experiments/configs/dlrm_synthetic.py:kaggle      dim 16,  bottom 13-512-256-64-16, top 512-256-1,
                                                               the 26 Criteo Kaggle cardinalities (33.8M rows)
    --config=experiments/configs/dlrm_synthetic.py:terabyte    dim 64,  bottom 13-512-256-64, top 512-512-256-1
    --config=experiments/configs/dlrm_synthetic.py:mlperf      dim 128, bottom 13-512-256-128,
                                                               top 1024-1024-512-256-1

Terabyte and MLPerf use the Kaggle cardinalities capped at `data.vocab_cap` rows (1M) so they fit a laptop.
Any field can be overridden, e.g. `--config.train.steps=100 --config.model.name=dcnv2`.

    --config=experiments/configs/dlrm_synthetic.py:mlperf52    the MLPerf DLRMv2 table set (26 tables, 40M-row cap,
                                                               204,184,588 rows; dim 64 f32: 52.3 GB + row-wise
                                                               Adagrad 0.8 GB), the six tables over 256 MiB on disk
                                                               behind a 10 % row cache (recjax/tiering); no checkpoints

The mlperf52 ids are Zipf with exponent 1.05 in every table: the middle of benchmarks/tiering.py's sweep (0.8-1.2),
between the near-uniform tail of a hashed Criteo feature and the steep head of its frequent ones; at 1.05 the hottest
10 % of a 40M-row table's rows draw 91 % of its lookups and the hottest 1 % 82 % (the generator's CDF), so a 10 %
cache can hit often while every step still reads the long tail from disk.
"""

import ml_collections

from experiments.configs import common
from recjax.data.synthetic import KAGGLE_VOCAB_SIZES, MLPERF_VOCAB_SIZES

PRESETS = {
    # name: (embedding dim, bottom MLP, top MLP, vocab cap)
    "small": (16, (256, 64, 16), (256, 64, 1), 40_000),
    "kaggle": (16, (512, 256, 64, 16), (512, 256, 1), None),
    "terabyte": (64, (512, 256, 64), (512, 512, 256, 1), 1_000_000),
    "mlperf": (128, (512, 256, 128), (1024, 1024, 512, 256, 1), 1_000_000),
    "mlperf52": (64, (512, 256, 64), (512, 512, 256, 1), None),
}


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
    preset = preset or "small"
    if preset not in PRESETS:
        raise ValueError(f"unknown preset '{preset}'; choose one of {sorted(PRESETS)}")
    dim, bottom, top, cap = PRESETS[preset]
    config = ml_collections.ConfigDict()
    config.seed = 0  # seeds data, initialisation and everything else

    config.data = ml_collections.ConfigDict()
    config.data.name = "synthetic"
    config.data.vocab_cap = cap or 0  # cap applied to the Kaggle cardinalities (0 = uncapped)
    vocab = MLPERF_VOCAB_SIZES if preset == "mlperf52" else KAGGLE_VOCAB_SIZES
    config.data.vocab_sizes = tuple(min(v, cap) if cap else v for v in vocab)  # one per feature
    config.data.num_dense = 13  # dense (integer count) features, log(1 + x) transformed
    config.data.bag_sizes = ()  # ids per example per feature; () = all one-hot
    config.data.zipf_exponent = 1.3  # id frequency ~ rank^-s
    config.data.eval_examples = 32_768  # size of each held-out split (validation and test)
    config.data.teacher = ml_collections.ConfigDict()
    config.data.teacher.dim = 4  # k of the planted factorisation machine
    config.data.teacher.pairs = 16  # interacting field pairs in the teacher (0 = all pairs)
    config.data.teacher.tuples = 0  # high-order field tuples (orders 3..order, weights m^-decay); 0 = none
    config.data.teacher.order = 3  # largest interaction order among the tuples
    config.data.teacher.decay = 1.0  # tuple m of the spectrum has weight (m + 1)^-decay
    config.data.teacher.logit_scale = 1.6  # std of the teacher logit: larger = easier task, higher bayes_auc
    config.data.teacher.ctr = 0.25  # mean click probability
    config.data.teacher.weights = (1.0, 0.7, 0.5)  # relative std of the bias, pairwise, dense (, high-order) terms

    config.embedding = common.embedding_config(dim)
    config.mesh = common.mesh_config()
    config.sharding = common.sharding_config()
    config.tiering = common.tiering_config()

    config.model = common.model_config("dlrm", dim)
    config.model.dlrm.bottom_mlp = bottom  # widths; the last must equal embedding.dim for dot interaction
    config.model.dlrm.top_mlp = top  # widths; ends in 1 (the logit)

    # Lazy Adam reaches the teacher faster than row-wise Adagrad here (benchmarks/RESULTS.md, synthetic models).
    config.optimizer = common.optimizer_config("adam", 1e-3, "lazy_adam", 0.003)

    # Synthetic data is an endless stream: the budget is in steps (3.1M examples).
    config.train = common.train_config(batch_size=512, steps=6000, eval_every=1000, log_every=100)
    config.checkpoint = common.checkpoint_config()
    if preset == "mlperf52":
        config.data.zipf_exponent = 1.05  # see the module docstring
        config.optimizer = common.optimizer_config("adam", 1e-3, "rowwise_adagrad", 0.05)  # 4 bytes of state a row
        config.tiering.disk_over_bytes = 256 * 2**20  # the five 40M-row tables and the 3.1M-row one
        config.tiering.cache_fraction = 0.1
        config.train = common.train_config(batch_size=4096, steps=1000, eval_every=1000, log_every=50)
        # Checkpoints fit in memory (a baseline writes the disk tables block by block) but not on this machine's
        # disk: a baseline is ~50 GB beside the 52 GB of table files (benchmarks/RESULTS.md, tiering checkpoints).
        config.checkpoint.enabled = False
    return config
