r"""DLRM on Criteo Terabyte (the reference Terabyte shape: dim 64, bottom 13-512-256-64, top 512-512-256-1,
ids hashed into 10M rows per feature, batch 2048).

    python -m experiments.train --config=experiments/configs/dlrm_criteo_terabyte.py \
        --config.data.dir=/path/to/folder/with/day_0..day_23 --workdir=runs/terabyte

Days 0-22 train; day 23 halved into test (first half) and validation (second half). Hash vocabulary by
default: an exact frequency vocabulary over Terabyte's ~880M distinct raw ids needs ~28 GB while preparing.
The 26 x 10M x 64 f32 tables are 66 GB: shard them over a mesh, compress them, or lower data.max_index.
"""

import ml_collections

from experiments.configs import common, dlrm_synthetic


def get_config() -> ml_collections.ConfigDict:
    config = dlrm_synthetic.get_config("terabyte")  # the reference Terabyte model shape

    config.data = ml_collections.ConfigDict()
    config.data.name = "criteo_terabyte"
    config.data.dir = ""  # folder holding day_0 ... day_23 (plain or .gz; the TFDS manual_dir); required
    config.data.prepared_dir = ""  # where prepared blocks go; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets
    config.data.vocab = "hash"  # "hash" (mod max_index) or "frequency" (ids seen >= threshold times in train)
    config.data.frequency_threshold = 1  # frequency vocab only
    config.data.max_index = 10_000_000  # hash vocab: rows per feature (the reference's --max-ind-range)
    config.data.strict = False  # True: a malformed line is an error naming file and line; False: skip + report
    config.data.train_days = tuple(range(23))  # day 23 is halved into test and validation

    config.optimizer = common.optimizer_config("sgd", 0.1, "sgd", 0.1)

    # One epoch (~2M steps of 2048 over ~4.2B train lines), validation ten times an epoch.
    config.train = common.train_config(batch_size=2048, epochs=1, eval_every="0.1epoch", log_every=1000, patience=2)
    config.checkpoint = common.checkpoint_config()
    return config
