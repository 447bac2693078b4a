"""The TFDS builders of the real datasets (prepared offline from `manual_dir`) and how the trainer opens them.

Preprocessing options are part of the builder config's name, so data prepared with different options lives side
by side under the TFDS data dir and is never mixed up; preparing an already prepared config is a no-op.
"""

import hashlib
import json
import os
import pathlib

import ml_collections
import tensorflow_datasets as tfds

from recjax.data.prepared import BlockBuilder, PreparedDataset, blocks_of


def _config_name(prefix: str, options: dict) -> str:
    """A readable, stable config name: the prefix plus a short hash of the options."""
    digest = hashlib.sha1(json.dumps(options, sort_keys=True).encode()).hexdigest()[:10]
    return f"{prefix}-{digest}"


class OptionsBuilder(BlockBuilder, skip_registration=True):
    """A BlockBuilder whose BuilderConfig is made from a dict of preprocessing options."""

    def __init__(self, *, options: dict, **kwargs):
        self.options = dict(options)
        config = tfds.core.BuilderConfig(name=_config_name(self.CONFIG_PREFIX, self.options),
                                         description=json.dumps(self.options, sort_keys=True))
        super().__init__(config=config, **kwargs)

    CONFIG_PREFIX = "options"


class MovielensBlocks(OptionsBuilder, skip_registration=True):
    """MovieLens (100K, 1M or latest-small) ratings as binary click-style examples (recjax/data/movielens.py)."""

    CONFIG_PREFIX = "movielens"
    MANUAL_DOWNLOAD_INSTRUCTIONS = """
    Download and unzip one MovieLens set from https://grouplens.org/datasets/movielens/ and point
    `--config.data.dir` (the TFDS manual_dir) at the unzipped folder:
      ml-100k:       u.data, u.user, u.item
      ml-1m:         ratings.dat, users.dat, movies.dat
      ml-latest-small: ratings.csv, movies.csv
    """
    block_rows = 4096

    def _split_blocks(self, manual_dir):
        from recjax.data.movielens import movielens_dataset

        data = movielens_dataset(ml_collections.ConfigDict({**self.options, "dir": str(manual_dir)}),
                                 seed=int(self.options["split_seed"]))
        self._info_extra = data.info()
        return data.spec, {name: blocks_of(batch, self.block_rows) for name, batch in data.splits.items()}

    def _extra_metadata(self):
        return self._info_extra


class CriteoKaggleBlocks(OptionsBuilder, skip_registration=True):
    """Criteo Kaggle Display Advertising Challenge click logs (train.txt), DLRM preprocessing (data/criteo.py)."""

    CONFIG_PREFIX = "criteo-kaggle"
    MANUAL_DOWNLOAD_INSTRUCTIONS = """
    Get `train.txt` (45,840,617 lines, ~11 GB) of the Criteo Kaggle Display Advertising Challenge dataset
    (e.g. https://ailab.criteo.com/ressources/ -> "Kaggle Display Advertising Challenge dataset", untar dac.tar.gz)
    and point `--config.data.dir` (the TFDS manual_dir) at the folder that holds it.
    """

    def _criteo_options(self):
        from recjax.data.criteo import CriteoOptions

        return CriteoOptions(**{k: v for k, v in self.options.items() if k in CRITEO_OPTION_KEYS})

    def _input_splits(self, manual_dir):
        from recjax.data.criteo import kaggle_splits

        path = pathlib.Path(manual_dir) / "train.txt"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found.\n{self.MANUAL_DOWNLOAD_INSTRUCTIONS}")
        return kaggle_splits(path)

    def _split_blocks(self, manual_dir):
        from recjax.data.criteo import prepare_criteo

        self._prepared = prepare_criteo(self._input_splits(manual_dir), self._criteo_options(),
                                        block_rows=self.block_rows)
        return self._prepared.spec, {s: self._prepared.blocks(s) for s in self._prepared.splits}

    def _extra_metadata(self):
        return {"parse_report": self._prepared.report.to_dict(), "criteo_stats": self._prepared.stats.summary}

    def _finish(self):
        # Per-id train counts (for frequency-aware compression and the sharding planner) beside the data.
        self._prepared.stats.save(pathlib.Path(self.data_dir))
        self._prepared.close()


class CriteoTerabyteBlocks(CriteoKaggleBlocks, skip_registration=True):
    """Criteo 1TB click logs (day_0 ... day_23, plain or .gz), DLRM preprocessing, split by day."""

    CONFIG_PREFIX = "criteo-terabyte"
    MANUAL_DOWNLOAD_INSTRUCTIONS = """
    Get the 24 files `day_0` ... `day_23` (plain or `.gz`) of the Criteo 1TB Click Logs dataset
    (https://ailab.criteo.com/ressources/ -> "Criteo 1TB Click Logs dataset") and point `--config.data.dir`
    (the TFDS manual_dir) at the folder that holds them.
    """

    def _input_splits(self, manual_dir):
        from recjax.data.criteo import terabyte_splits

        return terabyte_splits(manual_dir, train_days=tuple(self.options["train_days"]))


CRITEO_OPTION_KEYS = ("vocab", "frequency_threshold", "max_index", "strict")


def criteo_prepared(config: ml_collections.ConfigDict, seed: int) -> PreparedDataset:
    """Criteo Kaggle (`config.name == "criteo_kaggle"`) or Terabyte, prepared once per preprocessing options."""
    options = {
        "vocab": config.vocab,
        "frequency_threshold": int(config.frequency_threshold),
        "max_index": int(config.max_index) or None,
        "strict": bool(config.strict),
    }
    if config.name == "criteo_terabyte":
        options["train_days"] = list(config.train_days)
        cls = CriteoTerabyteBlocks
    else:
        cls = CriteoKaggleBlocks
    builder = cls(options=options, data_dir=prepared_dir(config), file_format="array_record")
    return open_prepared(builder, config.dir, train_split="train", eval_split=config.eval_split, seed=seed)


def prepared_dir(config: ml_collections.ConfigDict) -> str:
    """Where prepared data lives: config.data.prepared_dir, else $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
    return config.get("prepared_dir") or os.environ.get("TFDS_DATA_DIR") or str(
        pathlib.Path("~/tensorflow_datasets").expanduser())


def open_prepared(builder: BlockBuilder, manual_dir: str, *, train_split: str, eval_split: str, seed: int,
                  read_threads: int = 2) -> PreparedDataset:
    """Prepare the builder's data from `manual_dir` if needed, then open it for training."""
    if not manual_dir:
        raise ValueError(f"{builder.name}: set --config.data.dir to the folder with the raw files.\n"
                         f"{builder.MANUAL_DOWNLOAD_INSTRUCTIONS}")
    manual = pathlib.Path(manual_dir).expanduser()
    if not manual.is_dir():
        raise ValueError(f"{builder.name}: data dir {manual} does not exist.\n{builder.MANUAL_DOWNLOAD_INSTRUCTIONS}")
    tfds.disable_progress_bar()
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=str(manual)))
    return PreparedDataset(builder, train_split=train_split, eval_split=eval_split, seed=seed,
                           read_threads=read_threads)


def movielens_prepared(config: ml_collections.ConfigDict, seed: int) -> PreparedDataset:
    options = {
        "variant": config.get("variant", "auto"),
        "rating_threshold": float(config.get("rating_threshold", 4.0)),
        "split": config.get("split", "random"),
        "test_fraction": float(config.get("test_fraction", 0.1)),
        "split_seed": int(config.get("split_seed", 0)),
        "zip_prefix_length": int(config.get("zip_prefix_length", 3)),
    }
    builder = MovielensBlocks(options=options, data_dir=prepared_dir(config), file_format="array_record")
    return open_prepared(builder, config.dir, train_split="train", eval_split="test", seed=seed)
