r"""DCN V2 (Wang et al. 2021; the MLPerf DLRMv2 model) on the built-in synthetic Criteo-like data; data,
embeddings, optimizer and training as in dlrm_synthetic.py (small preset: 26 features, dim 16), only
`config.model` differs.

    python -m experiments.train --config=experiments/configs/dcnv2_synthetic.py --workdir=runs/dcnv2

Test AUC, FLOPs per example and time against DLRM on the same data: benchmarks/RESULTS.md#models-on-the-synthetic-data
(add --config.train.steps=2000 for a shorter run).
MLPerf DLRMv2's shape (with dim 128): `--config.model.dcnv2.bottom_mlp=512,256,128 --config.model.dcnv2.low_rank=512
--config.model.dcnv2.num_cross_layers=3 --config.model.dcnv2.deep_mlp=1024,1024,512,256 --config.embedding.dim=128`.
"""

import ml_collections

from experiments.configs import dlrm_synthetic


def get_config() -> ml_collections.ConfigDict:
    config = dlrm_synthetic.get_config()
    config.model.name = "dcnv2"  # knobs: config.model.dcnv2 (experiments/configs/common.py)
    return config
