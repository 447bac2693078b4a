r"""Logistic regression on MovieLens (the linear baseline DLRM should beat).

    python -m experiments.train --config=experiments/configs/lr_movielens.py --config.data.dir=/path/to/ml-100k

Each id's weight is its 1-d embedding (embedding.dim = 1), so the per-id weights train with the sparse
optimizer; the dense-feature weights and the bias train with the dense one. Labels are rating >= 4; the default
is ML-100K's random 90/10 split. Point data.dir at an unzipped ml-1m or ml-latest-small folder to use those.
"""

import ml_collections

from compression.plan import option_placeholders
from experiments.configs import dlrm_movielens


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # seeds the training order and initialisation (data.split_seed seeds the split)

    # The same data, split and preprocessing options as the DLRM config, so the results compare.
    config.data = dlrm_movielens.get_config().data

    config.embedding = ml_collections.ConfigDict()
    config.embedding.dim = 1  # one scalar weight per id
    config.embedding.method = "full"  # compression method (compression/registry.py)
    config.embedding.options = option_placeholders()  # the method's knobs, unset = default (compression/plan.py)
    config.embedding.tables = ml_collections.ConfigDict()  # per-feature overrides: {feature: {method, options}}
    config.embedding.id_counts = ""  # per-id counts for md_blocks: "" (none), "dataset" or an .npz path
    config.embedding.pooling = "sum"  # genres bag: the sum of its genres' weights, as in one-hot LR

    config.model = ml_collections.ConfigDict()
    config.model.name = "logistic_regression"

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.dense = ml_collections.ConfigDict({"name": "adam", "learning_rate": 0.01})
    # Adagrad at 0.1 converges in ~6 epochs to within 0.002 AUC of scikit-learn's L2 logistic regression on the
    # same one-hot features (0.779 at C = 1); a linear model barely overfits, so no decay is needed.
    config.optimizer.sparse = ml_collections.ConfigDict({"name": "adagrad", "learning_rate": 0.1})
    config.optimizer.warmup_steps = 0  # linear warmup of both learning rates
    config.optimizer.decay = "none"  # "none" or "cosine" (to 0 at train.steps)

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 256
    config.train.steps = 2100  # ~6 epochs of ML-100K's 90k ratings: converged; ~3 s on 2 CPU cores
    config.train.eval_every = 700  # steps between evaluations on the test split
    config.train.log_every = 50  # steps between train-loss log lines
    config.train.progress_bar = True
    return config
