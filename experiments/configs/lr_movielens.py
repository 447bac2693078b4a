r"""Logistic regression on MovieLens (the linear baseline DLRM should beat): dlrm_movielens.py swapped to
`model.name = "lr"`, with the learning rates and regularisation that config tuned for a linear model
(its `model_defaults.lr`).

    python -m experiments.train --config=experiments/configs/lr_movielens.py --config.data.dir=/path/to/ml-100k

Each id's weight is its 1-d embedding, so the per-id weights train with the sparse optimizer; the dense-feature
weights and the bias train with the dense one. The same config as `dlrm_movielens.py --config.model.name=lr`.
"""

import ml_collections

from experiments.configs import common, dlrm_movielens


def get_config() -> ml_collections.ConfigDict:
    config = dlrm_movielens.get_config()
    common.swap_model(config, "lr")
    return config
