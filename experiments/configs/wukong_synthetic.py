r"""Wukong (Zhang et al. 2024) on the built-in synthetic Criteo-like data; data, embeddings, optimizer and
training as in dlrm_synthetic.py (small preset: 26 features, dim 16), only `config.model` differs.

    python -m experiments.train --config=experiments/configs/wukong_synthetic.py --workdir=runs/wukong

Measured (seed 0, 6000 steps = 3.1M examples): AUC 0.802 vs 0.806 for DLRM (bayes_auc 0.829), 0.68 MFLOPs per
example vs 0.31; ~4 min on 2 shared CPU cores (add --config.train.steps=2000 for ~1 min, AUC ~0.776).
Scale it along the paper's axes from the command line, e.g. `--config.model.num_layers=4 --config.model.fm_rank=16`.
"""

import ml_collections

from experiments.configs import dlrm_synthetic


def get_config() -> ml_collections.ConfigDict:
    config = dlrm_synthetic.get_config()
    config.model = ml_collections.ConfigDict()
    config.model.name = "wukong"
    config.model.num_layers = 2  # l, stacked Wukong layers
    config.model.fmb_embeddings = 16  # n_F, embeddings out of each Factorization Machine Block
    config.model.lcb_embeddings = 16  # n_L, embeddings out of each Linear Compression Block
    config.model.fm_rank = 8  # k, rank of the optimized FM X (X^T Y), Y [n, k]
    config.model.fmb_mlp_depth = 2  # Dense layers in each FMB MLP (the last outputs n_F * dim)
    config.model.fmb_mlp_width = 128  # hidden width of each FMB MLP
    config.model.top_mlp = (256, 64, 1)  # widths on the flattened last layer [n_F + n_L, dim]; ends in 1
    config.model.num_dense_embeddings = 2  # dim-wide embeddings made from the 13 dense features
    config.model.dense_mlp = (64,)  # hidden widths before the linear map to num_dense_embeddings * dim
    return config
