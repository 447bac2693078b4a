r"""DLRM on a libFM file in positional-field layout, like Frappe (app usage, 10 context fields).

    python -m experiments.train --config=experiments/configs/dlrm_libfm.py \
        --config.data.dir=/path/to/frappe --workdir=runs/frappe

Data: `frappe.train.libfm`, `frappe.validation.libfm`, `frappe.test.libfm` from the `data/frappe` folder of
github.com/hexiangnan/neural_factorization_machine (288,609 lines: label -1 or 1, then 10 index:1 pairs, the k-th
pair being field k -- user, item, daytime, weekday, ...). Put the three files in data.dir. Labels -1/1 become 0/1
(threshold 0.5); the k-th pair is feature f<k> (data.libsvm.fields = "positional"), indexed by a frequency vocabulary
fitted on the train file; the three files are the three splits (data.split.method = "files").
tests/data/tabular/frappe.*.libfm are small files in this layout.

libFFM files (field:index:value): data.libsvm.fields = "ffm"; one bag of all indices: "bag"; indices whose value is
a dense feature: data.libsvm.dense_indices.
"""

import ml_collections

from experiments.configs import common
from recjax.data.tabular import default_data_config


def data_config() -> ml_collections.ConfigDict:
    data = default_data_config()  # every tabular field with its default and a comment
    data.format = "libsvm"
    data.files = ""  # unused: the split files name every file
    data.libsvm.fields = "positional"
    data.label.threshold = 0.5  # -1 -> 0, 1 -> 1
    data.split.method = "files"
    data.split.train_files = "frappe.train.libfm"
    data.split.validation_files = "frappe.validation.libfm"
    data.split.test_files = "frappe.test.libfm"
    return data


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # seeds the training order, initialisation and dropout
    config.data = data_config()
    config.embedding = common.embedding_config(16)
    config.mesh = common.mesh_config()
    config.sharding = common.sharding_config()
    config.tiering = common.tiering_config()
    config.model = common.model_config("dlrm", 16)
    config.model.dlrm.bottom_mlp = (16,)  # no dense features: the bottom MLP learns a constant vector
    config.model.dlrm.top_mlp = (64, 1)
    config.optimizer = common.optimizer_config("adam", 0.001, "adagrad", 0.05)
    config.train = common.train_config(batch_size=512, epochs=20, eval_every="epoch", log_every=100, patience=3)
    config.checkpoint = common.checkpoint_config()
    return config
