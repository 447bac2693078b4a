r"""DLRM on the built-in synthetic Criteo-like data (the default of `python -m experiments.train`).

    python -m experiments.train --config=experiments/configs/dlrm_synthetic.py --workdir=runs/synthetic

The preset after a colon picks a reference model shape on data with the matching cardinalities:

    --config=experiments/configs/dlrm_synthetic.py:kaggle      dim 16,  bottom 13-512-256-64-16, top 512-256-1,
                                                               the 26 Criteo Kaggle cardinalities (33.8M rows)
    --config=experiments/configs/dlrm_synthetic.py:terabyte    dim 64,  bottom 13-512-256-64, top 512-512-256-1
    --config=experiments/configs/dlrm_synthetic.py:mlperf      dim 128, bottom 13-512-256-128,
                                                               top 1024-1024-512-256-1

Terabyte and MLPerf use the Kaggle cardinalities capped at `data.vocab_cap` rows (1M) so they fit a laptop.
Any field can be overridden, e.g. `--config.train.steps=100 --config.embedding.dim=32`.
"""

import ml_collections

from compression.plan import option_placeholders
from recjax.data.synthetic import KAGGLE_VOCAB_SIZES

PRESETS = {
    # name: (embedding dim, bottom MLP, top MLP, vocab cap)
    "small": (16, (256, 64, 16), (256, 64, 1), 40_000),
    "kaggle": (16, (512, 256, 64, 16), (512, 256, 1), None),
    "terabyte": (64, (512, 256, 64), (512, 512, 256, 1), 1_000_000),
    "mlperf": (128, (512, 256, 128), (1024, 1024, 512, 256, 1), 1_000_000),
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
    config.data.vocab_sizes = tuple(min(v, cap) if cap else v for v in KAGGLE_VOCAB_SIZES)  # one per feature
    config.data.num_dense = 13  # dense (integer count) features, log(1 + x) transformed
    config.data.bag_sizes = ()  # ids per example per feature; () = all one-hot
    config.data.zipf_exponent = 1.3  # id frequency ~ rank^-s
    config.data.eval_examples = 32_768  # size of the held-out split
    config.data.teacher = ml_collections.ConfigDict()
    config.data.teacher.dim = 4  # k of the planted factorisation machine
    config.data.teacher.pairs = 16  # interacting field pairs in the teacher (0 = all pairs)
    config.data.teacher.tuples = 0  # high-order field tuples (orders 3..order, weights m^-decay); 0 = none
    config.data.teacher.order = 3  # largest interaction order among the tuples
    config.data.teacher.decay = 1.0  # tuple m of the spectrum has weight (m + 1)^-decay
    config.data.teacher.logit_scale = 1.6  # std of the teacher logit: larger = easier task, higher bayes_auc
    config.data.teacher.ctr = 0.25  # mean click probability
    config.data.teacher.weights = (1.0, 0.7, 0.5)  # relative std of the bias, pairwise, dense (, high-order) terms

    config.embedding = ml_collections.ConfigDict()
    config.embedding.dim = dim  # D, the width every feature embeds to
    config.embedding.method = "full"  # compression method (compression/registry.py)
    config.embedding.options = option_placeholders()  # the method's knobs, unset = default (compression/plan.py)
    config.embedding.tables = ml_collections.ConfigDict()  # per-feature overrides: {feature: {method, options}}
    config.embedding.id_counts = ""  # per-id counts for md_blocks: "" (none), "dataset" or an .npz path
    config.embedding.pooling = "sum"  # multi-hot bags: "sum" or "mean"

    config.model = ml_collections.ConfigDict()
    config.model.name = "dlrm"
    config.model.bottom_mlp = bottom  # widths; the last must equal embedding.dim for dot interaction
    config.model.top_mlp = top  # widths; ends in 1 (the logit)
    config.model.interaction = "dot"  # "dot" or "cat"
    config.model.self_interaction = False  # dot: also keep <x_i, x_i>

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.dense = ml_collections.ConfigDict({"name": "adam", "learning_rate": 1e-3})
    # Lazy Adam reaches the teacher faster than row-wise Adagrad here (0.808 vs 0.800 AUC at 4M examples).
    config.optimizer.sparse = ml_collections.ConfigDict({"name": "lazy_adam", "learning_rate": 0.003})
    config.optimizer.warmup_steps = 0  # linear warmup of both learning rates
    config.optimizer.decay = "none"  # "none" or "cosine" (to 0 at train.steps)

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 512
    config.train.steps = 6000  # 3.1M examples: ~70 s on 2 CPU cores
    config.train.eval_every = 1000  # steps between evaluations on the held-out split
    config.train.log_every = 100  # steps between train-loss log lines
    config.train.progress_bar = True
    return config
