r"""Matrix factorisation on MovieLens ratings with a squared-error loss: the collaborative-filtering setting of
Ginart et al. 2019 (mixed-dimension embeddings), `python -m experiments.reproduce --paper=md`'s model.

    python -m experiments.train --config=experiments/configs/mf_movielens.py --config.data.dir=/path/to/ml-100k

Two sparse features, the user and the item (`data.features = "user_item"`), the stars as the label
(`data.target = "rating"`: the dataset's target is "regression", so the step minimises the squared error and every
evaluation reports mse, rmse and mae); the model is mu + <p_user, q_item> (recjax/models/mf.py). Ratings are split at
random 80/10/10 as in dlrm_movielens.py; the step with the lowest validation MSE is selected and its test MSE is the
headline. Mixed dimensions per frequency block (Ginart et al.'s MF setting):
`--config.embedding.method=md_blocks --config.embedding.id_counts=dataset --config.embedding.options.alpha=0.3`.
"""

import ml_collections

from experiments.configs import common, dlrm_movielens


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # seeds the training order, initialisation and dropout (data.split.seed seeds the split)
    config.data = dlrm_movielens.data_config()
    config.data.target = "rating"
    config.data.features = "user_item"
    config.embedding = common.embedding_config(64)
    config.mesh = common.mesh_config()
    config.sharding = common.sharding_config()
    config.tiering = common.tiering_config()
    config.model = common.model_config("mf", 64)
    # Chosen on ML-100K's validation MSE (seed 0; benchmarks/RESULTS.md#movielens-matrix-factorisation): a row L2 of
    # 5e-4 (1e-4 overfits, 1e-3 and up shrinks the factors towards predicting the mean), Adagrad at 0.1; 64 factors
    # beat 32 (validation MSE 0.817 vs 0.826). Dense Adam only learns mu.
    config.optimizer = common.optimizer_config("adam", 0.01, "adagrad", 0.1, decay="cosine")
    config.optimizer.sparse.weight_decay = 5e-4
    config.train = common.train_config(batch_size=512, epochs=20, eval_every="epoch", log_every=50, patience=3)
    config.train.select_on = "mse"
    config.checkpoint = common.checkpoint_config()
    return config
