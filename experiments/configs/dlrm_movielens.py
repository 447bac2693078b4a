r"""DLRM on MovieLens: does the user rate the movie >= 4 stars?

    python -m experiments.train --config=experiments/configs/dlrm_movielens.py --config.data.dir=/path/to/ml-100k

Sparse features: user, item, the user's age group, gender, occupation and zip prefix, and the movie's genres
(multi-hot, sum-pooled); dense features: the movie's release year and the user's age, standardised (see
recjax/data/movielens.py). Ratings are split at random 80/10/10 into train, validation and test (data.split);
training runs up to `train.epochs` epochs, evaluates on validation every epoch, stops after
`train.early_stopping_patience` epochs without a better validation AUC and reports test at the best epoch.
Any model swaps in: `--config.model.name=lr` (logistic regression, the baseline), `fm`, `dcnv2`, `wukong`; lr and
fm bring the learning rates and regularisation tuned for them here (`config.model_defaults`, printed at the start;
values you set on the command line win), dcnv2 and wukong keep DLRM's with a printed warning.
"""

import ml_collections

from experiments.configs import common


def data_config() -> ml_collections.ConfigDict:
    data = ml_collections.ConfigDict()
    data.name = "movielens"
    data.dir = ""  # the unzipped GroupLens folder (ml-100k, ml-1m or ml-latest-small); required
    data.variant = "auto"  # "auto" (from the files present), "100k", "1m" or "latest-small"
    data.target = "binary"  # "binary": label = rating >= rating_threshold; "rating": the stars (regression, MSE)
    data.features = "all"  # "all" (ids, demographics, genres, dense year and age) or "user_item" (the two ids only)
    data.rating_threshold = 4.0  # label = rating >= threshold
    data.zip_prefix_length = 3  # zip_prefix feature: this many leading characters of the zip code
    data.split = ml_collections.ConfigDict()
    data.split.method = "random"  # "random" (seeded) or "time" (the latest ratings are test, those before validation)
    data.split.validation_fraction = 0.1  # share of the ratings held out for model selection
    data.split.test_fraction = 0.1  # share of the ratings held out for the reported metrics
    data.split.seed = 0  # draws the random split; fixed so the run's seed changes only training
    data.prepared_dir = ""  # where the prepared blocks go; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets
    return data


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # seeds the training order, initialisation and dropout (data.split.seed seeds the split)
    config.data = data_config()
    config.embedding = common.embedding_config(16)
    config.mesh = common.mesh_config()
    config.sharding = common.sharding_config()
    config.tiering = common.tiering_config()
    config.model = common.model_config("dlrm", 16)
    config.model.dlrm.bottom_mlp = (32, 16)
    config.model.dlrm.top_mlp = (64, 1)
    # Chosen on ML-100K's validation split (seed 0): without regularisation DLRM peaks after 2 epochs and then
    # overfits the user and item rows. An L2 of 3e-3 on the touched rows, Adagrad at 0.1 and a cosine decay over the
    # 10-epoch budget raise the best validation AUC; dropout (0.2) and dense weight decay did not help
    # (benchmarks/RESULTS.md#movielens-defaults). Early stopping keeps the epoch budget safe on larger MovieLens sets.
    config.optimizer = common.optimizer_config("adam", 0.003, "adagrad", 0.1, decay="cosine")
    config.optimizer.sparse.weight_decay = 3e-3
    config.train = common.train_config(batch_size=512, epochs=10, eval_every="epoch", log_every=50, patience=3)
    config.checkpoint = common.checkpoint_config()
    # What a --config.model.name swap brings (common.swap_model; lr_movielens.py and fm_movielens.py are these swaps).
    config.model_defaults = common.model_defaults(
        config,
        # Adagrad at 0.1 comes close to scikit-learn's L2 logistic regression on the same one-hot features
        # (benchmarks/RESULTS.md#movielens-defaults);
        # a linear model barely overfits, and any row L2 tried (1e-4 .. 3e-3) lowered its validation AUC.
        lr={"optimizer.dense.learning_rate": 0.01, "optimizer.sparse.learning_rate": 0.1,
            "optimizer.sparse.weight_decay": 0.0, "train.batch_size": 256, "train.epochs": 20},
        # 8 factors per id (embedding.dim = the id's linear weight + factors); the row L2 is the best of 1e-3, 3e-3
        # and 1e-2 on ML-100K's validation split.
        fm={"embedding.dim": 9, "optimizer.dense.learning_rate": 0.01, "optimizer.sparse.learning_rate": 0.1,
            "optimizer.sparse.weight_decay": 1e-3, "train.batch_size": 256},
    )
    return config
