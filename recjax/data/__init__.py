"""Datasets. Each exposes `spec` (DatasetSpec), `train_batches(batch_size, start_step, rows=None)` (endless),
`eval_batches(batch_size, split, rows=None)` for "validation" and "test", `num_examples(split)` (None for an endless
train stream) and `info()` (extra summary fields, e.g. the synthetic teacher's `bayes_auc`, a parse report).
`rows` (a slice of [0, batch_size)) makes a reader yield only those rows of every batch -- a multi-host process's
share -- and eval readers then yield one (possibly empty) share per batch."""

import ml_collections

from recjax.data.synthetic import KAGGLE_VOCAB_SIZES, SyntheticDataset
from recjax.errors import ConfigError
from recjax.validation import boolean, choice, integer, number

PREPARED_DATASETS = ("movielens", "criteo_kaggle", "criteo_terabyte", "tabular")
DATASETS = ("synthetic",) + PREPARED_DATASETS


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
    if config.name in PREPARED_DATASETS:
        from recjax.data.builders import open_dataset

        return open_dataset(config, seed)
    raise ConfigError("data.name", f"unknown dataset {config.name!r}; use one of {list(DATASETS)}")


def check_data_config(config: ml_collections.ConfigDict) -> None:
    """ConfigError naming the first bad `data.*` key, including a data.dir that lacks the dataset's files."""
    data = {"data": config}
    name = choice(data, "data.name", DATASETS)
    if name == "synthetic":
        sizes = config.vocab_sizes
        if not sizes or not all(isinstance(v, int) and v >= 1 for v in sizes):
            raise ConfigError("data.vocab_sizes", f"must be a non-empty tuple of vocabulary sizes >= 1, got {sizes!r}")
        bags = config.bag_sizes
        if bags and (len(bags) != len(sizes) or not all(isinstance(b, int) and b >= 1 for b in bags)):
            raise ConfigError("data.bag_sizes", f"must be () or one bag size >= 1 per feature ({len(sizes)} features "
                                                f"in data.vocab_sizes), got {tuple(bags)!r}")
        integer(data, "data.num_dense", 0)
        integer(data, "data.eval_examples", 1)
        number(data, "data.zipf_exponent", above=0)
        return
    if name == "tabular":
        from recjax.data.tabular import TabularOptions

        TabularOptions.from_config(config)  # every field, each error naming its key
    elif name == "movielens":
        from recjax.data.movielens import FEATURE_SETS, TARGETS, VARIANTS

        choice(data, "data.variant", ("auto", *VARIANTS))
        choice(data, "data.target", TARGETS)
        choice(data, "data.features", FEATURE_SETS)
        number(data, "data.rating_threshold")
        integer(data, "data.zip_prefix_length", 1)
        choice(data, "data.split.method", ("random", "time"))
        validation = number(data, "data.split.validation_fraction", above=0, below=1)
        test = number(data, "data.split.test_fraction", above=0, below=1)
        if validation + test >= 1:
            raise ConfigError("data.split.test_fraction", f"validation_fraction + test_fraction must be < 1 to leave "
                                                          f"a train split, got {validation} + {test}")
        integer(data, "data.split.seed", 0)
    else:
        vocab = choice(data, "data.vocab", ("frequency", "hash"))
        integer(data, "data.frequency_threshold", 1)
        max_index = integer(data, "data.max_index", 0)
        if vocab == "hash" and not 1 <= max_index < 2**31:
            raise ConfigError("data.max_index", f"vocab='hash' needs 1 <= max_index < 2**31 rows per feature, got "
                                                f"{max_index}")
        boolean(data, "data.strict")
    from recjax.data.builders import check_sources

    check_sources(config)


__all__ = ["DATASETS", "KAGGLE_VOCAB_SIZES", "SyntheticDataset", "check_data_config", "make_dataset"]
