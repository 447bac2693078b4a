r"""Wukong (Zhang et al. 2024) on the built-in synthetic Criteo-like data; data, embeddings, optimizer and
training as in dlrm_synthetic.py (small preset: 26 features, dim 16), only `config.model` differs.

    python -m experiments.train --config=experiments/configs/wukong_synthetic.py --workdir=runs/wukong

Test AUC, FLOPs per example and time against DLRM on the same data: benchmarks/RESULTS.md#models-on-the-synthetic-data
(add --config.train.steps=2000 for a shorter run).
Scale it along the paper's axes from the command line, e.g.
`--config.model.wukong.num_layers=4 --config.model.wukong.fm_rank=16`.
"""

import ml_collections

from experiments.configs import dlrm_synthetic


def get_config() -> ml_collections.ConfigDict:
    config = dlrm_synthetic.get_config()
    config.model.name = "wukong"  # knobs: config.model.wukong (experiments/configs/common.py)
    return config
