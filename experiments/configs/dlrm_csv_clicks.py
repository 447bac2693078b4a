r"""DLRM on a CSV click log in the Avazu layout: will the ad be clicked?

    python -m experiments.train --config=experiments/configs/dlrm_csv_clicks.py \
        --config.data.dir=/path/to/avazu --workdir=runs/avazu

Data: Kaggle's "Click-Through Rate Prediction" competition (Avazu, https://www.kaggle.com/c/avazu-ctr-prediction)
-> `train.gz` (40,428,967 rows, 10 days of October 2014; gzip CSV with a header). Put train.gz in data.dir
(data.files names it; plain `train` or `train.csv` work too with --config.data.files=train.csv). Its columns:

    id, click, hour, C1, banner_pos, site_id, site_domain, site_category, app_id, app_domain, app_category,
    device_id, device_ip, device_model, device_type, device_conn_type, C14, ..., C21

Label `click`; every other column but `id` and `hour` is categorical (a frequency vocabulary fitted on train; values
seen fewer than data.sparse.frequency_threshold times share id 0); no dense features. Split by time on `hour`
(YYMMDDHH): the latest 10% of the rows are test, the 10% before them validation. The first run prepares the data
(tests/data/tabular/clicks.csv is a 40-line file in this layout) into data.prepared_dir; later runs reuse it.

Any other CSV / TSV / Parquet file: change data.files, data.label.column, data.dense.columns, data.sparse.columns
(every knob: recjax/data/tabular.py `default_data_config`, and the README's "Your own data").
"""

import ml_collections

from experiments.configs import common
from recjax.data.tabular import default_data_config

AVAZU_SPARSE = ("C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain",
                "app_category", "device_id", "device_ip", "device_model", "device_type", "device_conn_type", "C14",
                "C15", "C16", "C17", "C18", "C19", "C20", "C21")


def data_config() -> ml_collections.ConfigDict:
    data = default_data_config()  # every tabular field with its default and a comment
    data.format = "csv"
    data.files = "train.gz"  # Kaggle's file, gzip CSV with a header
    data.label.column = "click"
    data.sparse.columns = AVAZU_SPARSE
    data.sparse.frequency_threshold = 2  # device_ip / device_id have millions of values seen once
    data.split.method = "time"
    data.split.time_column = "hour"  # YYMMDDHH: sorts as a number
    return data


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # seeds the training order, initialisation and dropout (data.split.seed seeds a random split)
    config.data = data_config()
    config.embedding = common.embedding_config(16)
    config.mesh = common.mesh_config()
    config.sharding = common.sharding_config()
    config.tiering = common.tiering_config()
    config.model = common.model_config("dlrm", 16)
    config.model.dlrm.bottom_mlp = (16,)  # no dense features: the bottom MLP learns a constant vector
    config.model.dlrm.top_mlp = (256, 64, 1)
    config.optimizer = common.optimizer_config("adam", 0.001, "rowwise_adagrad", 0.05)
    # One epoch is ~15.8k steps of 2048 on Avazu's 32M train rows; validation four times an epoch picks the best.
    config.train = common.train_config(batch_size=2048, epochs=2, eval_every="0.25epoch", log_every=200, patience=3)
    config.checkpoint = common.checkpoint_config()
    return config
