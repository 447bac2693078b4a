r"""Factorization machine (Rendle 2010) on MovieLens: logistic regression plus factorised pairwise terms.

    python -m experiments.train --config=experiments/configs/fm_movielens.py --config.data.dir=/path/to/ml-100k

Each id's embedding holds its linear weight (column 0) and its k factors (columns 1..k), so embedding.dim must
be model.factor_dim + 1; see recjax/models/linear.py. Same data and split as lr_movielens.py and
dlrm_movielens.py (labels: rating >= 4, ML-100K's random 90/10 split by default).
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
    config.embedding.dim = 9  # model.factor_dim + 1: the id's linear weight, then its factors
    config.embedding.method = "full"  # compression method (compression/registry.py)
    config.embedding.options = option_placeholders()  # the method's knobs, unset = default (compression/plan.py)
    config.embedding.tables = ml_collections.ConfigDict()  # per-feature overrides: {feature: {method, options}}
    config.embedding.id_counts = ""  # per-id counts for md_blocks: "" (none), "dataset" or an .npz path
    config.embedding.pooling = "sum"  # genres bag: one field whose vector is the sum of its genres'

    config.model = ml_collections.ConfigDict()
    config.model.name = "fm"
    config.model.factor_dim = 8  # k, the factor vector length; embedding.dim must be k + 1

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.dense = ml_collections.ConfigDict({"name": "adam", "learning_rate": 0.01})
    config.optimizer.sparse = ml_collections.ConfigDict({"name": "adagrad", "learning_rate": 0.1})
    config.optimizer.warmup_steps = 0  # linear warmup of both learning rates
    config.optimizer.decay = "cosine"  # "none" or "cosine" (to 0 at train.steps); cosine stops overfitting

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 256
    config.train.steps = 1400  # ~4 epochs of ML-100K's 90k training ratings; ~2 s on 2 CPU cores
    config.train.eval_every = 350  # steps between evaluations on the test split (one epoch)
    config.train.log_every = 50  # steps between train-loss log lines
    config.train.progress_bar = True
    return config
