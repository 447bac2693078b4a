r"""DLRM on MovieLens: does the user rate the movie >= 4 stars?

    python -m experiments.train --config=experiments/configs/dlrm_movielens.py --config.data.dir=/path/to/ml-100k

Sparse features: user, item, the user's age group, gender, occupation and zip prefix, and the movie's genres
(multi-hot, sum-pooled); dense features: the movie's release year and the user's age, standardised (see
recjax/data/movielens.py). The default is ML-100K's random 90/10 split; compare with
experiments/configs/lr_movielens.py (the linear baseline) and fm_movielens.py.
"""

import ml_collections

from compression.plan import option_placeholders


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # seeds the training order and initialisation (data.split_seed seeds the split)

    config.data = ml_collections.ConfigDict()
    config.data.name = "movielens"
    config.data.dir = ""  # the unzipped GroupLens folder (ml-100k, ml-1m or ml-latest-small); required
    config.data.variant = "auto"  # "auto" (from the files present), "100k", "1m" or "latest-small"
    config.data.rating_threshold = 4.0  # label = rating >= threshold
    config.data.split = "random"  # "random" (seeded) or "time" (the latest ratings are the test split)
    config.data.test_fraction = 0.1  # share of the ratings held out as the test split
    config.data.split_seed = 0  # draws the random split; fixed so the run's seed changes only training
    config.data.zip_prefix_length = 3  # zip_prefix feature: this many leading characters of the zip code
    config.data.prepared_dir = ""  # where the prepared blocks go; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets

    config.embedding = ml_collections.ConfigDict()
    config.embedding.dim = 16  # D, the width every feature embeds to
    config.embedding.method = "full"  # compression method (compression/registry.py)
    config.embedding.options = option_placeholders()  # the method's knobs, unset = default (compression/plan.py)
    config.embedding.tables = ml_collections.ConfigDict()  # per-feature overrides: {feature: {method, options}}
    config.embedding.id_counts = ""  # per-id counts for md_blocks: "" (none), "dataset" or an .npz path
    config.embedding.pooling = "sum"  # genres bag: "sum" or "mean"

    config.model = ml_collections.ConfigDict()
    config.model.name = "dlrm"
    config.model.bottom_mlp = (32, 16)  # widths on the dense features; the last must equal embedding.dim
    config.model.top_mlp = (64, 1)  # widths after the interaction; ends in 1 (the logit)
    config.model.interaction = "dot"  # "dot" or "cat"
    config.model.self_interaction = False  # dot: also keep <x_i, x_i>

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.dense = ml_collections.ConfigDict({"name": "adam", "learning_rate": 0.003})
    # With no weight decay, DLRM overfits ML-100K after ~4 epochs (test AUC falls while train loss keeps
    # dropping); Adagrad's shrinking steps plus the cosine decay stop it near the peak. Lazy Adam at 0.003
    # peaks at the same AUC two epochs in, then loses 0.015 by epoch 6.
    config.optimizer.sparse = ml_collections.ConfigDict({"name": "adagrad", "learning_rate": 0.05})
    config.optimizer.warmup_steps = 0  # linear warmup of both learning rates
    config.optimizer.decay = "cosine"  # "none" or "cosine" (to 0 at train.steps)

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 512
    config.train.steps = 700  # ~4 epochs of ML-100K's 90k training ratings; ~2 s of training on 2 CPU cores
    config.train.eval_every = 175  # steps between evaluations on the test split (one epoch)
    config.train.log_every = 50  # steps between train-loss log lines
    config.train.progress_bar = True
    return config
