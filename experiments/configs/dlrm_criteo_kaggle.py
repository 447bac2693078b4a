r"""DLRM on Criteo Kaggle (the facebookresearch/dlrm Kaggle recipe: dim 16, bottom 13-512-256-64-16,
top 512-256-1, SGD 0.1, batch 128, one epoch).

    python -m experiments.train --config=experiments/configs/dlrm_criteo_kaggle.py \
        --config.data.dir=/path/to/folder/with/train.txt --workdir=runs/kaggle

The first run prepares the data (parse, vocabulary on the train days, blocks) into data.prepared_dir; later runs
with the same preprocessing options reuse it. Splits follow the reference: 7 "days" by line count, days 0-5
train, day 6 halved into test (first half) and validation (second half).
"""

import ml_collections

from experiments.configs import common, dlrm_synthetic


def get_config() -> ml_collections.ConfigDict:
    config = dlrm_synthetic.get_config("kaggle")  # the reference Kaggle model shape

    config.data = ml_collections.ConfigDict()
    config.data.name = "criteo_kaggle"
    config.data.dir = ""  # folder holding train.txt (the TFDS manual_dir); required
    config.data.prepared_dir = ""  # where prepared blocks go; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets
    config.data.vocab = "frequency"  # "frequency" (ids seen >= threshold times in train) or "hash" (mod max_index)
    config.data.frequency_threshold = 1  # frequency vocab: rarer ids share the out-of-vocabulary row 0
    config.data.max_index = 0  # hash vocab: rows per feature (the reference's --max-ind-range); 0 = unused
    config.data.strict = False  # True: a malformed line is an error naming file and line; False: skip + report

    config.optimizer = common.optimizer_config("sgd", 0.1, "sgd", 0.1)

    # One epoch, as the reference; validation five times an epoch picks the best point (and stops early on small
    # files). An epoch of the full file is ~306k steps of 128.
    config.train = common.train_config(batch_size=128, epochs=1, eval_every="0.2epoch", log_every=1000, patience=2)
    config.checkpoint = common.checkpoint_config()
    return config
