"""Datasets. Each exposes `spec` (DatasetSpec), `train_batches(batch_size, start_step)`,
`eval_batches(batch_size)` and `info()` (extra summary fields, e.g. the synthetic teacher's `bayes_auc`)."""

import ml_collections

from recjax.data.synthetic import KAGGLE_VOCAB_SIZES, SyntheticDataset


def make_dataset(config: ml_collections.ConfigDict, seed: int):
    """The dataset named by `config.name`; `seed` is the run's seed."""
    if config.name == "synthetic":
        return SyntheticDataset(
            vocab_sizes=config.vocab_sizes, num_dense=config.num_dense, bag_sizes=config.bag_sizes,
            zipf_exponent=config.zipf_exponent, eval_examples=config.eval_examples,
            teacher_dim=config.teacher.dim, teacher_pairs=config.teacher.pairs, teacher_tuples=config.teacher.tuples,
            teacher_order=config.teacher.order, teacher_decay=config.teacher.decay,
            logit_scale=config.teacher.logit_scale, ctr=config.teacher.ctr,
            weights=config.teacher.weights, seed=seed)
    if config.name == "movielens":
        from recjax.data.builders import movielens_prepared

        return movielens_prepared(config, seed)
    if config.name in ("criteo_kaggle", "criteo_terabyte"):
        from recjax.data.builders import criteo_prepared

        return criteo_prepared(config, seed)
    raise ValueError(
        f"unknown dataset '{config.name}'; known: ['synthetic', 'movielens', 'criteo_kaggle', 'criteo_terabyte']")


__all__ = ["KAGGLE_VOCAB_SIZES", "SyntheticDataset", "make_dataset"]
