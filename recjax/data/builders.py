"""The TFDS builders of the real datasets (prepared offline from `manual_dir`) and how the trainer opens them.

Prepared data is a cache, and a cache must never answer for the wrong input. A builder config's name is a hash
of everything the prepared blocks depend on:
  - the preprocessing options,
  - the source files: resolved path, size, modification time and a SHA-256 of each file's first and last
    `FINGERPRINT_BYTES` bytes (cheap on a 1 TB day file, and it catches a file replaced in place with one of the
    same size),
  - the builder's `FORMAT_VERSION` (bumped when the preparation code changes what it writes).
So two folders, or a changed file, never share prepared data: the second is prepared again beside the first, and
the console says which sources a run reuses or prepares. Preparing an already prepared config is a no-op.
"""

import hashlib
import json
import logging
import os
import pathlib
import textwrap
from collections.abc import Sequence

import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from recjax.data.arrays import take
from recjax.data.prepared import BlockBuilder, PreparedDataset, blocks_of
from recjax.errors import ConfigError, DataError
from recjax.specs import SPLITS

FINGERPRINT_BYTES = 1 << 16  # head and tail bytes hashed per source file
TRAIN_ORDER_SALT = 0x54524E  # with data.split.seed, draws the order MovieLens train rows are stored in


def file_fingerprint(path: pathlib.Path) -> dict:
    """What identifies a source file's content cheaply: resolved path, size, mtime and a hash of head and tail."""
    path = path.expanduser().resolve()
    stat = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        if stat.st_size > FINGERPRINT_BYTES:
            f.seek(max(stat.st_size - FINGERPRINT_BYTES, FINGERPRINT_BYTES))
            digest.update(f.read(FINGERPRINT_BYTES))
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "head_tail_sha256": digest.hexdigest()}


def cache_key(options: dict, sources: Sequence[dict], format_version: int) -> str:
    """Short hash of what the prepared data depends on (see the module doc)."""
    payload = {"options": options, "sources": list(sources), "format_version": format_version}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


class OptionsBuilder(BlockBuilder, skip_registration=True):
    """A BlockBuilder whose BuilderConfig is named by the hash of its options and its sources' fingerprints."""

    CONFIG_PREFIX = "options"
    FORMAT_VERSION = 1  # bump when the preparation code changes what it writes for the same options and files

    def __init__(self, *, options: dict, sources: Sequence[dict], **kwargs):
        self.options = dict(options)
        self.source_fingerprints = list(sources)
        name = f"{self.CONFIG_PREFIX}-{cache_key(self.options, self.source_fingerprints, self.FORMAT_VERSION)}"
        description = json.dumps({"options": self.options, "sources": self.source_fingerprints}, sort_keys=True)
        super().__init__(config=tfds.core.BuilderConfig(name=name, description=description), **kwargs)

    @classmethod
    def instructions(cls) -> str:
        """Where to get the raw files and what to put in data.dir, as lines after an error message."""
        return "\n" + textwrap.indent(textwrap.dedent(cls.MANUAL_DOWNLOAD_INSTRUCTIONS).strip(), "  ")

    @classmethod
    def source_files(cls, options: dict, manual_dir: pathlib.Path) -> list[pathlib.Path]:
        """The raw files preparation reads; a missing one is a ConfigError saying what to put where."""
        raise NotImplementedError

    def _extra_metadata(self):
        return {"sources": self.source_fingerprints, **self._source_metadata()}

    def _source_metadata(self) -> dict:
        return {}


class MovielensBlocks(OptionsBuilder, skip_registration=True):
    """MovieLens (100K, 1M or latest-small) ratings as binary click-style examples, or the stars to regress
    (recjax/data/movielens.py)."""

    CONFIG_PREFIX = "movielens"
    FORMAT_VERSION = 3  # 2: train / validation / test; 3: train rows stored in a seeded random order
    MANUAL_DOWNLOAD_INSTRUCTIONS = """
    Download and unzip one MovieLens set from https://grouplens.org/datasets/movielens/ and point
    `--config.data.dir` (the TFDS manual_dir) at the unzipped folder:
      ml-100k:       u.data, u.user, u.item
      ml-1m:         ratings.dat, users.dat, movies.dat
      ml-latest-small: ratings.csv, movies.csv
    """
    block_rows = 4096

    @classmethod
    def source_files(cls, options, manual_dir):
        from recjax.data.movielens import VARIANT_FILES, detect_variant

        try:
            variant = detect_variant(manual_dir, options["variant"])
        except ValueError as error:
            raise ConfigError("data.dir", str(error)) from None
        return [manual_dir / name for name in VARIANT_FILES[variant]]

    def _split_blocks(self, manual_dir):
        from recjax.data.movielens import movielens_dataset

        data = movielens_dataset(ml_collections.ConfigDict({**self.options, "dir": str(manual_dir)}))
        self._info_extra = data.info()
        # Training shuffles the blocks and the rows within a block, not rows across blocks. ML-1M's ratings.dat
        # lists each user's ratings together, so train stored in file order reached the model user by user: a
        # user's ratings in one burst of a few steps per epoch, each batch from ~100 users. Stored in a seeded
        # random order, every block is a uniform sample of train.
        splits = dict(data.splits)
        order = np.random.default_rng([int(self.options["split"]["seed"]), TRAIN_ORDER_SALT]).permutation(
            splits["train"].size)
        splits["train"] = take(splits["train"], order)
        return data.spec, {name: blocks_of(batch, self.block_rows) for name, batch in splits.items()}

    def _source_metadata(self):
        return self._info_extra


class CriteoKaggleBlocks(OptionsBuilder, skip_registration=True):
    """Criteo Kaggle Display Advertising Challenge click logs (train.txt), DLRM preprocessing (data/criteo.py)."""

    CONFIG_PREFIX = "criteo-kaggle"
    FORMAT_VERSION = 2  # 2: keyed by source fingerprints
    MANUAL_DOWNLOAD_INSTRUCTIONS = """
    Get `train.txt` (45,840,617 lines, ~11 GB) of the Criteo Kaggle Display Advertising Challenge dataset
    (e.g. https://ailab.criteo.com/ressources/ -> "Kaggle Display Advertising Challenge dataset", untar dac.tar.gz)
    and point `--config.data.dir` (the TFDS manual_dir) at the folder that holds it.
    """

    @classmethod
    def source_files(cls, options, manual_dir):
        path = manual_dir / "train.txt"
        if not path.is_file():
            raise ConfigError("data.dir", f"{path} not found.{cls.instructions()}")
        return [path]

    def _criteo_options(self):
        from recjax.data.criteo import CriteoOptions

        return CriteoOptions(**{k: v for k, v in self.options.items() if k in CRITEO_OPTION_KEYS})

    def _input_splits(self, manual_dir):
        from recjax.data.criteo import kaggle_splits

        path = pathlib.Path(manual_dir) / "train.txt"
        if path.stat().st_size == 0:
            raise DataError(f"{path} is empty (0 bytes); expected Criteo lines (label, 13 integer and 26 hex fields, "
                            "tab-separated)")
        return kaggle_splits(path)

    def _split_blocks(self, manual_dir):
        from recjax.data.criteo import prepare_criteo

        self._prepared = prepare_criteo(self._input_splits(manual_dir), self._criteo_options(),
                                        block_rows=self.block_rows)
        return self._prepared.spec, {s: self._prepared.blocks(s) for s in self._prepared.splits}

    def _source_metadata(self):
        return {"parse_report": self._prepared.report.to_dict(), "criteo_stats": self._prepared.stats.summary}

    SPLIT_RULE = ("train.txt is cut into 7 equal 'days' by line count; days 0-5 are train, day 6's first half test "
                  "and its second half validation")

    def _describe_split(self, split):
        from recjax.data.criteo import KAGGLE_DAYS, count_lines

        pieces = self._prepared.splits[split]
        starts = ", ".join(f"{pathlib.Path(p.path).name} from line {p.first_line}" for p in pieces)
        text = f"its lines ({starts or 'none'}) hold no valid example ({self.SPLIT_RULE})"
        if self.CONFIG_PREFIX == "criteo-kaggle" and pieces:
            lines = count_lines(pieces[0].path)
            text += (f"; {pieces[0].path} has {lines:,} lines, and day 6 needs >= 2 lines for its two halves, so the "
                     f"file needs >= {2 * KAGGLE_DAYS} lines")
        return text

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

    @classmethod
    def source_files(cls, options, manual_dir):
        from recjax.data.criteo import terabyte_files

        try:
            files = terabyte_files(manual_dir)
        except ValueError as error:
            raise ConfigError("data.dir", str(error)) from None
        days = sorted(set(options["train_days"]) | {23})
        missing = [d for d in days if d not in files]
        if missing:
            raise ConfigError("data.dir", f"{manual_dir} has no day_N or day_N.gz for days {missing}."
                                          f"{cls.instructions()}")
        return [pathlib.Path(files[d]) for d in days]

    SPLIT_RULE = "days 0-22 (or data.train_days) are train, day 23's first half test and its second half validation"

    def _input_splits(self, manual_dir):
        from recjax.data.criteo import terabyte_splits

        return terabyte_splits(manual_dir, train_days=tuple(self.options["train_days"]))


CRITEO_OPTION_KEYS = ("vocab", "frequency_threshold", "max_index", "strict")


class TabularBlocks(OptionsBuilder, skip_registration=True):
    """Your own CTR data -- CSV/TSV, Parquet, libSVM/libFM/libFFM -- with the options of recjax/data/tabular.py.

    options: `TabularOptions.to_dict(location=False)` (the whole data section but dir and prepared_dir).
    """

    CONFIG_PREFIX = "tabular"
    FORMAT_VERSION = 2  # 2: random split by valid-row index (was: file and line); NaN / label counts in the stats
    MANUAL_DOWNLOAD_INSTRUCTIONS = """
    Point `--config.data.dir` (the TFDS manual_dir) at the folder holding your files and `--config.data.files`
    (or data.split.train_files / validation_files / test_files) at them: comma-separated globs relative to it.
    Set data.format ("csv", "parquet" or "libsvm") and the columns (data.label.column, data.dense.columns,
    data.sparse.columns); see recjax/data/tabular.py and the README's "Your own data".
    """

    @classmethod
    def source_files(cls, options, manual_dir):
        from recjax.data.tabular import TabularOptions, source_paths

        return [pathlib.Path(p) for p in source_paths(TabularOptions.from_config(options), manual_dir)]

    def _split_blocks(self, manual_dir):
        from recjax.data.tabular import TabularOptions, prepare_tabular

        self._prepared = prepare_tabular(TabularOptions.from_config(self.options), directory=manual_dir,
                                         block_rows=self.block_rows)
        return self._prepared.spec, {split: self._prepared.blocks(split) for split in SPLITS}

    def _source_metadata(self):
        return {"parse_report": self._prepared.report.to_dict(), "tabular_stats": self._prepared.stats.summary}

    def _describe_split(self, split):
        return f"the rows of {split} (data.split.method = {self.options['split']['method']!r})"

    def _finish(self):
        # Per-id train counts (for frequency-aware compression and the sharding planner) beside the data.
        self._prepared.stats.save(pathlib.Path(self.data_dir))
        self._prepared.close()


def criteo_options(config: ml_collections.ConfigDict) -> tuple[type[OptionsBuilder], dict]:
    """Criteo Kaggle (`config.name == "criteo_kaggle"`) or Terabyte: the builder and its preprocessing options."""
    options = {
        "vocab": config.vocab,
        "frequency_threshold": int(config.frequency_threshold),
        "max_index": int(config.max_index) or None,
        "strict": bool(config.strict),
    }
    if config.name == "criteo_terabyte":
        options["train_days"] = list(config.train_days)
        return CriteoTerabyteBlocks, options
    return CriteoKaggleBlocks, options


def movielens_options(config: ml_collections.ConfigDict) -> tuple[type[OptionsBuilder], dict]:
    split = config.split
    options = {
        "variant": config.variant,
        "rating_threshold": float(config.rating_threshold),
        "zip_prefix_length": int(config.zip_prefix_length),
        "split": {"method": split.method, "validation_fraction": float(split.validation_fraction),
                  "test_fraction": float(split.test_fraction), "seed": int(split.seed)},
    }
    # The rating target and the ids-only feature set enter the options (and so the cache key) only when chosen, so
    # data prepared before they existed (binary labels, every feature) keeps its key.
    for key, default in (("target", "binary"), ("features", "all")):
        if config.get(key, default) != default:
            options[key] = config[key]
    return MovielensBlocks, options


def tabular_options(config: ml_collections.ConfigDict) -> tuple[type[OptionsBuilder], dict]:
    """Generic tabular data: the builder and the validated data section (ConfigError naming a bad key)."""
    from recjax.data.tabular import TabularOptions

    return TabularBlocks, TabularOptions.from_config(config).to_dict(location=False)


PREPARED = {"movielens": movielens_options, "criteo_kaggle": criteo_options, "criteo_terabyte": criteo_options,
            "tabular": tabular_options}


def check_sources(config: ml_collections.ConfigDict) -> list[pathlib.Path]:
    """The source files of the prepared dataset `config` describes; ConfigError if data.dir lacks them."""
    cls, options = PREPARED[config.name](config)
    return cls.source_files(options, manual_dir_of(config, cls))


def open_dataset(config: ml_collections.ConfigDict, seed: int) -> PreparedDataset:
    """The prepared dataset `config` (= config.data) names, prepared first if needed."""
    cls, options = PREPARED[config.name](config)
    return open_prepared(cls, options, config, seed)


def prepared_dir(config: ml_collections.ConfigDict) -> str:
    """Where prepared data lives: config.data.prepared_dir, else $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
    return config.get("prepared_dir") or os.environ.get("TFDS_DATA_DIR") or str(
        pathlib.Path("~/tensorflow_datasets").expanduser())


def manual_dir_of(config: ml_collections.ConfigDict, cls: type[OptionsBuilder]) -> pathlib.Path:
    """config.data.dir as an existing directory, or a ConfigError saying what to put there."""
    if not config.get("dir"):
        raise ConfigError("data.dir", f"set --config.data.dir to the folder with the raw files of "
                                      f"'{config.name}'.{cls.instructions()}")
    manual = pathlib.Path(config.dir).expanduser()
    if not manual.is_dir():
        raise ConfigError("data.dir", f"{manual} does not exist.{cls.instructions()}")
    return manual


def open_prepared(cls: type[OptionsBuilder], options: dict, config: ml_collections.ConfigDict, seed: int,
                  read_threads: int = 2, log=print) -> PreparedDataset:
    """Prepare `cls`'s data from config.dir into config.prepared_dir if this (options, source files) pair has not
    been prepared yet, say which sources are used, and open it for training."""
    quiet_tfds_logs()
    manual = manual_dir_of(config, cls)
    sources = [file_fingerprint(path) for path in cls.source_files(options, manual)]
    builder = cls(options=options, sources=sources, data_dir=prepared_dir(config), file_format="array_record")
    where = pathlib.Path(builder.data_dir)
    names = ", ".join(pathlib.Path(s["path"]).name for s in sources)
    reused = (where / "dataset_info.json").exists()
    log(f"data: {'reusing' if reused else 'preparing'} {builder.info.full_name} from {manual} ({names})"
        f"{'' if reused else ' ...'}")
    tfds.disable_progress_bar()
    # Never looked for on GCS (it is ours, prepared here): TFDS 4.9.7 would import TensorFlow to ask.
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=str(manual),
                                                                              try_download_gcs=False))
    dataset = PreparedDataset(builder, seed=seed, read_threads=read_threads)
    for line in dataset.report_lines():
        log(line)
    return dataset


class _DropTfdsInfo(logging.Filter):
    """TFDS logs its progress at INFO through absl ("Generating dataset", "Reusing dataset", "Done writing ...
    Number of examples", which counts blocks, not rows) and warns "Using custom data configuration" on every run
    because our config names are hashes; the project prints its own summary, so those records are dropped while
    every other warning stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}tensorflow_datasets{os.sep}" not in record.pathname:
            return True
        return record.levelno >= logging.WARNING and "Using custom data configuration" not in record.getMessage()


_TFDS_FILTER = _DropTfdsInfo()


def quiet_tfds_logs() -> None:
    """Install the filter above on the absl logger (idempotent)."""
    logger = logging.getLogger("absl")
    if _TFDS_FILTER not in logger.filters:
        logger.addFilter(_TFDS_FILTER)


__all__ = ["PREPARED", "CriteoKaggleBlocks", "CriteoTerabyteBlocks", "MovielensBlocks", "OptionsBuilder",
           "TabularBlocks", "cache_key", "check_sources", "criteo_options", "file_fingerprint", "movielens_options",
           "open_dataset", "open_prepared", "prepared_dir", "tabular_options"]
