r"""A factorization machine on MovieLens: dlrm_movielens.py swapped to `model.name = "fm"`, with 8 factors per id
and the learning rates and regularisation that config tuned for an FM (its `model_defaults.fm`).

    python -m experiments.train --config=experiments/configs/fm_movielens.py --config.data.dir=/path/to/ml-100k

Each id's embedding holds its linear weight and its factor vector (embedding.dim = 1 + factors); the genres bag
enters as one field whose vector is the sum of its genres'. The same config as
`dlrm_movielens.py --config.model.name=fm`.
"""

import ml_collections

from experiments.configs import common, dlrm_movielens


def get_config() -> ml_collections.ConfigDict:
    config = dlrm_movielens.get_config()
    common.swap_model(config, "fm")
    return config
