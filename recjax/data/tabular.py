r"""Your own CTR data -- CSV/TSV, Parquet, libSVM/libFM/libFFM -- as recjax blocks with train/validation/test splits.

    from recjax.data import tabular
    config = tabular.default_data_config()          # the `data` section of a config, every field with a comment
    config.dir, config.files = "/data/clicks", "clicks.csv.gz"
    config.label.column, config.dense.columns, config.sparse.columns = "click", ("price",), ("site", "app")
    with tabular.prepare_tabular(tabular.TabularOptions.from_config(config)) as prepared:
        prepared.spec                                # DatasetSpec: dense columns, sparse features, fitted vocab sizes
        for block in prepared.blocks("train"): ...   # recjax.batch.Batch blocks of `block_rows` examples
        prepared.stats.save(directory)               # stats.json + index_counts.npz; prepared.report.to_dict()

Files (`data.dir`, `data.files`: comma-separated globs relative to it, each pattern's matches sorted) are read by
recjax/data/tabular_formats.py (the formats, bad lines, keys and the missing value are described there). A
record cannot span lines: a quoted newline in a CSV file makes two bad lines.

Examples (`recjax.batch.Batch`)
    labels  f32[n]: float(label) >= label.threshold, or (label.positive_values set) the label's text is one of them.
            With the threshold, a label that is not a number ("no") is no bad line but an error once every file is
            read, naming the values seen; a train split of one class is an error too (AUC needs both).
    dense   f32[n, D], columns in `dense.columns` order (libSVM: `libsvm.dense_indices`, named i<idx>). A missing
            cell becomes `dense.missing`, and so does a NaN cell unless `dense.nan` = "skip" makes its line bad
            (both counted per column in the stats), then the column's chain runs in the fixed order clip -> log1p ->
            standardise (`dense.transform`, default "standardise"; per column `dense.transforms`; printed at the
            start of a run and in the stats). Standardising uses the mean and
            (population) std of the train split's values after clip / log1p; a constant column (std 0) is only
            centred.
    ids     {feature: i32[n, L_f]}, lengths {feature: i32[n]}: one-hot features have L = 1 and length 1 (missing is
            a category of its own); multi-valued ones (`sparse.multi_valued`, libSVM "bag") are padded with id 0 to
            L = `sparse.max_bag_size` (longer bags truncated, counted in the stats) or, if 0, to the largest bag in
            any split.
    Vocabularies (per feature, `sparse.overrides` per column; recjax/data/vocabulary.py):
            "frequency": fitted on the train split only; ids 1..K by descending train count (ties: ascending raw
            key), values seen fewer than `frequency_threshold` times in train and values unseen in train -> 0.
            "hash": id = raw key % hash_buckets.

Splits (always "train", "validation" and "test"; every valid row lands in exactly one)
    random  per row, u = uniform [0, 1) from a hash of (split.seed, the row's index among the valid rows in file
            order) (`split_uniform`): train if u < 1 - validation_fraction - test_fraction, test if
            u >= 1 - test_fraction, else validation. The same rows split alike whatever their format (CSV,
            Parquet, libSVM), headers, blank or bad lines and files, and whatever the chunking or threads.
    time    rows sorted by (time, file index, line); the last round(test_fraction * n) rows are test, the
            round(validation_fraction * n) before them validation (halves round up). Times are numbers (unix
            seconds, YYMMDDHH, ...) or ISO-8601 dates/times (naive, or with Z / +hh:mm), never both in one column.
            A column with one value in every row is an error (the split would be file order).
    files   train / validation / test files by their own globs; validation_files "" carves validation_fraction of
            the train files' rows out at random (`split_uniform`, as above).
    Files are read in the order of data.files (method "files": train files, then validation, then test). An empty
    split is an error saying what the split needs.

How it runs (`prepare_tabular`, every pass on `num_threads` threads, results merged in file order)
    1. parse   the files are read once, in blocks; each block's good rows are spilled to a temporary directory as
               raw arrays (labels, dense before standardising, per sparse feature the block's distinct raw keys and
               each value's position among them); random / files splits are drawn here, per row, as the blocks
               come back in file order.
    2. split   the time split sorts every row's time (it needs all of them first); empty splits are errors.
    3. fit     the train rows of each spilled chunk: key counts per feature (vocabularies) and dense moments
               (Chan et al.'s parallel mean / variance).
    4. map     each chunk once: ids of its distinct keys looked up, dense standardised, each split's rows written to
               their own file; `blocks(split)` then only reads that split's files.
    The spill is deleted by `close()`, and on any error. Throughput (`benchmarks/data.py --only tabular_csv`):
    benchmarks/RESULTS.md#data-tabular-preparation.

Statistics (`stats`, a `VocabularyStats`): per feature the vocabulary, vocab size, bag size, train occurrences,
raw distinct values in train, out-of-vocabulary and missing occurrences in train, truncated bags (every split),
a log2 frequency histogram; per dense column its transform, mean and std after clip / log1p on train, and the
missing and NaN cells imputed (every split); per-id train counts (index_counts.npz) for frequency-aware compression.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np
from ml_collections import config_dict

from recjax.batch import Batch
from recjax.data.arrays import ArrayDataset, concatenate, rebatch
from recjax.data.tabular_formats import (
    DENSE_NAN,
    DENSE_STEPS,
    LABEL_VALUES,
    MISSING_INDEX_KEY,
    MISSING_STRING_KEY,
    DenseColumn,
    ParsedChunk,
    ReadPlan,
    bag_positions,
    parse_unit,
    units,
)
from recjax.data.textio import (
    DEFAULT_CHUNK_BYTES,
    ParseReport,
    merge_report,
    ordered_map,
    read_arrays,
    write_arrays,
)
from recjax.data.vocabulary import (
    KeyCounter,
    VocabularyStats,
    frequency_histogram,
    frequency_vocabulary,
    hash_index_counts,
    lookup,
    mix64,
    splitmix64,
)
from recjax.errors import ConfigError, DataError
from recjax.specs import DatasetSpec, FeatureSpec
from recjax.validation import check_boolean, check_choice, check_integer, check_number, check_text

SPLITS = ("train", "validation", "test")
TRAIN, VALIDATION, TEST = 0, 1, 2
FORMATS = ("csv", "parquet", "libsvm")
LIBSVM_FIELDS = ("positional", "ffm", "bag")
VOCABS = ("frequency", "hash")
SPLIT_METHODS = ("random", "time", "files")
OVERRIDE_KEYS = ("vocab", "frequency_threshold", "hash_buckets")


# ----------------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------------


def default_data_config() -> ml_collections.ConfigDict:
    """The `data` section of a tabular config with every default (configs call it and override fields)."""
    data = ml_collections.ConfigDict()
    data.name = "tabular"
    data.dir = ""  # folder holding the files (the TFDS manual_dir); required
    data.prepared_dir = ""  # where prepared blocks go; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets
    data.format = "csv"  # "csv" (CSV/TSV, plain or .gz), "parquet", "libsvm" (libSVM / libFM / libFFM, plain or .gz)
    data.files = "*.csv"  # comma-separated globs relative to dir: the table (split.method "random" / "time")
    data.strict = False  # True: the first bad line is an error naming file, line and reason; False: skip + report

    data.csv = ml_collections.ConfigDict()
    data.csv.delimiter = ","  # any single character; "\t" for TSV
    data.csv.header = True  # False: columns are named by csv.column_names, else "0", "1", ... (positions)
    data.csv.column_names = ()  # names when header=False (as many as the file has columns)

    data.libsvm = ml_collections.ConfigDict()
    data.libsvm.fields = "positional"  # "positional" (k-th idx:val of a line = field f<k>, libFM/Frappe), "ffm"
    #                                    (field:idx:val, feature f<field>), "bag" (all indices in one feature)
    data.libsvm.dense_indices = ()  # indices whose value is a dense feature i<idx>; other values must be 0 or 1

    data.label = ml_collections.ConfigDict()
    data.label.column = "label"  # csv/parquet label column (libsvm: the first token of a line)
    data.label.threshold = 0.5  # label = float(value) >= threshold (0/1, -1/+1 and ratings >= 4 all work)
    data.label.positive_values = ()  # if set: label = the value's text is one of these
    data.dense = ml_collections.ConfigDict()
    data.dense.columns = ()  # dense (numeric) columns, in the order the model sees them
    # "+"-joined chain in the order clip, log1p, standardise, or "none". "standardise" ((x - train mean) / train std)
    # is safe on any column and beat "none" on ML-100K and on the Criteo sample at every seed
    # (benchmarks/RESULTS.md#tabular-data-the-default-datadensetransform); count-like columns gain more from
    # "clip+log1p+standardise" with clip_min 0.
    data.dense.transform = "standardise"
    data.dense.transforms = ml_collections.ConfigDict()  # per-column chain: {column: "log1p"}
    data.dense.clip_min = config_dict.placeholder(float)  # lower bound of "clip" (None = unbounded)
    data.dense.clip_max = config_dict.placeholder(float)  # upper bound of "clip" (None = unbounded)
    data.dense.missing = 0.0  # value of an empty / null dense cell, before the transforms
    # A NaN cell ("nan", "NaN", a float NaN): "impute" = data.dense.missing like an empty cell, counted per column in
    # the summary and on the console (pandas / numpy / Spark write missing floats as NaN, and a skipped row loses
    # its other columns too); "skip" = a bad line, reported like "inf" or "abc".
    data.dense.nan = "impute"

    data.sparse = ml_collections.ConfigDict()
    data.sparse.columns = ()  # categorical columns (names, or positions when csv.header=False)
    data.sparse.multi_valued = ()  # which of them hold several values in one cell
    data.sparse.separator = "|"  # splits a multi-valued cell
    data.sparse.max_bag_size = 0  # 0 = the largest bag in any split; > 0 = truncate longer bags (counted)
    data.sparse.vocab = "frequency"  # "frequency" (fitted on train; 0 = rare / unseen) or "hash" (% hash_buckets)
    data.sparse.frequency_threshold = 1  # frequency: values seen fewer times in train share id 0
    data.sparse.hash_buckets = 0  # hash: rows per feature (required, < 2**31, when vocab = "hash")
    data.sparse.overrides = ml_collections.ConfigDict()  # per column: {column: {vocab, frequency_threshold, ...}}

    data.split = ml_collections.ConfigDict()
    data.split.method = "random"  # "random" (seeded hash of each valid row's index), "time" (latest rows), "files"
    data.split.validation_fraction = 0.1  # share of rows in validation (files: carved from train if no files)
    data.split.test_fraction = 0.1  # share of rows in test (random / time)
    data.split.seed = 0  # seeds the random split (independent of the run's seed)
    data.split.time_column = ""  # method "time": numbers (unix seconds, YYMMDDHH, ...) or ISO-8601 dates/times
    data.split.train_files = ""  # method "files": comma-separated globs relative to dir
    data.split.validation_files = ""  # "" = carve split.validation_fraction of the train rows at random
    data.split.test_files = ""
    return data


def _plain(value: Any) -> Any:
    """ConfigDict / FieldReference -> plain Python (dicts, tuples, scalars)."""
    if isinstance(value, ml_collections.ConfigDict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return tuple(_plain(v) for v in value)
    return value


def _names(key: str, value: Any) -> tuple[str, ...]:
    """A config list of column names (str or int, as positions) -> tuple of str."""
    if isinstance(value, str):
        value = tuple(v.strip() for v in value.split(",") if v.strip())
    if not isinstance(value, tuple) or not all(isinstance(v, str | int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"data.{key}", f"must be a list of column names, got {value!r}")
    return tuple(str(v) for v in value)


# The data section's checks, named by their key under "data." (recjax/config_check.py holds the logic).
def _number(key: str, value: Any, *, optional: bool = False) -> float | None:
    return check_number(f"data.{key}", value, optional=optional)


def _integer(key: str, value: Any, low: int, high: int | None = None) -> int:
    return check_integer(f"data.{key}", value, low, high)


def _choice(key: str, value: Any, choices: Sequence[str]) -> str:
    return check_choice(f"data.{key}", value, choices)


def _flag(key: str, value: Any) -> bool:
    return check_boolean(f"data.{key}", value)


def _text(key: str, value: Any) -> str:
    return check_text(f"data.{key}", value)


def parse_chain(key: str, chain: Any) -> tuple[str, ...]:
    """"clip+log1p+standardise" -> ("clip", "log1p", "standardise"); "none" -> ()."""
    chain = _text(key, chain).strip()
    if chain in ("", "none"):
        return ()
    steps = tuple(step.strip() for step in chain.split("+"))
    unknown = [step for step in steps if step not in DENSE_STEPS]
    if unknown:
        raise ConfigError(f"data.{key}", f"{chain!r} has unknown steps {unknown}; use '+'-joined steps of "
                                         f"{list(DENSE_STEPS)} (or 'none')")
    if list(steps) != sorted(set(steps), key=DENSE_STEPS.index):
        raise ConfigError(f"data.{key}", f"{chain!r}: the steps run in the fixed order clip, log1p, standardise; "
                                         "write them in that order, each once (e.g. 'clip+log1p+standardise')")
    return steps


@dataclasses.dataclass(frozen=True)
class VocabSettings:
    vocab: str = "frequency"
    frequency_threshold: int = 1
    hash_buckets: int = 0


@dataclasses.dataclass(frozen=True)
class TabularOptions:
    """The `data` section of a tabular config, validated (see `default_data_config` for each field).

    Besides the config fields: chunk_bytes (text read per block), num_threads (blocks parsed in parallel),
    spill_dir (where the temporary spill directory is made; None = the system's temp directory).
    """

    dir: str = ""
    prepared_dir: str = ""
    format: str = "csv"
    files: str = "*.csv"
    strict: bool = False
    csv_delimiter: str = ","
    csv_header: bool = True
    csv_column_names: tuple[str, ...] = ()
    libsvm_fields: str = "positional"
    libsvm_dense_indices: tuple[int, ...] = ()
    label_column: str = "label"
    label_threshold: float = 0.5
    label_positive_values: tuple[str, ...] = ()
    dense_columns: tuple[str, ...] = ()
    dense_transform: tuple[str, ...] = ("standardise",)
    dense_transforms: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (column, steps), sorted by column
    dense_clip_min: float | None = None
    dense_clip_max: float | None = None
    dense_missing: float = 0.0
    dense_nan: str = "impute"
    sparse_columns: tuple[str, ...] = ()
    sparse_multi_valued: tuple[str, ...] = ()
    sparse_separator: str = "|"
    sparse_max_bag_size: int = 0
    sparse_vocab: VocabSettings = VocabSettings()
    sparse_overrides: tuple[tuple[str, VocabSettings], ...] = ()  # sorted by column
    split_method: str = "random"
    split_validation_fraction: float = 0.1
    split_test_fraction: float = 0.1
    split_seed: int = 0
    split_time_column: str = ""
    split_train_files: str = ""
    split_validation_files: str = ""
    split_test_files: str = ""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    num_threads: int = 2
    spill_dir: str | None = None

    def __post_init__(self):
        self._check()

    # -- reading a config ----------------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict | Mapping[str, Any], **runtime: Any) -> TabularOptions:
        """Validate a `data` config section (ConfigDict or nested dict, e.g. from `to_dict`); every error names
        its config key. runtime: chunk_bytes, num_threads, spill_dir."""
        data = _plain(config)
        if not isinstance(data, dict):
            raise ConfigError("data", f"must be a config section, got {config!r}")
        defaults = _plain(default_data_config())
        for section, fields in data.items():
            if section not in defaults:
                raise ConfigError(f"data.{section}", f"is not a tabular data option; known: {sorted(defaults)}")
            if isinstance(defaults[section], dict) and section not in ("transforms", "overrides"):
                if not isinstance(fields, dict):
                    raise ConfigError(f"data.{section}", f"must be a section with {sorted(defaults[section])}")
                unknown = sorted(set(fields) - set(defaults[section]))
                if unknown:
                    raise ConfigError(f"data.{section}.{unknown[0]}", f"is not a tabular data option; data.{section} "
                                                                      f"has {sorted(defaults[section])}")
        if data.get("name", "tabular") != "tabular":
            raise ConfigError("data.name", f"must be 'tabular' for these options, got {data.get('name')!r}")

        def get(section: str, field: str | None = None):
            if field is None:
                return data.get(section, defaults[section])
            return data.get(section, {}).get(field, defaults[section][field])

        transforms = get("dense", "transforms") or {}
        if not isinstance(transforms, dict):
            raise ConfigError("data.dense.transforms", f"must map columns to chains, got {transforms!r}")
        overrides = get("sparse", "overrides") or {}
        if not isinstance(overrides, dict):
            raise ConfigError("data.sparse.overrides", f"must map columns to {{vocab, ...}}, got {overrides!r}")
        base = VocabSettings(_choice("sparse.vocab", get("sparse", "vocab"), VOCABS),
                             _integer("sparse.frequency_threshold", get("sparse", "frequency_threshold"), 1),
                             _integer("sparse.hash_buckets", get("sparse", "hash_buckets"), 0, 2**31))
        parsed_overrides = []
        for column, override in sorted(overrides.items()):
            key = f"sparse.overrides.{column}"
            if not isinstance(override, dict) or set(override) - set(OVERRIDE_KEYS):
                raise ConfigError(f"data.{key}", f"must be a section with some of {list(OVERRIDE_KEYS)}, got "
                                                 f"{override!r}")
            parsed_overrides.append((str(column), VocabSettings(
                _choice(f"{key}.vocab", override.get("vocab", base.vocab), VOCABS),
                _integer(f"{key}.frequency_threshold", override.get("frequency_threshold", base.frequency_threshold),
                         1),
                _integer(f"{key}.hash_buckets", override.get("hash_buckets", base.hash_buckets), 0, 2**31))))
        dense_indices = get("libsvm", "dense_indices")
        if isinstance(dense_indices, int):
            dense_indices = (dense_indices,)
        if not isinstance(dense_indices, tuple):
            raise ConfigError("data.libsvm.dense_indices", f"must be a list of indices, got {dense_indices!r}")
        positive = get("label", "positive_values")
        if isinstance(positive, str | int | float):
            positive = (positive,)
        if not isinstance(positive, tuple) or not all(isinstance(v, str | int | float) for v in positive):
            raise ConfigError("data.label.positive_values", f"must be a list of values, got {positive!r}")
        return cls(
            dir=_text("dir", get("dir")), prepared_dir=_text("prepared_dir", get("prepared_dir")),
            format=_choice("format", get("format"), FORMATS), files=_text("files", get("files")),
            strict=_flag("strict", get("strict")),
            csv_delimiter=_text("csv.delimiter", get("csv", "delimiter")),
            csv_header=_flag("csv.header", get("csv", "header")),
            csv_column_names=_names("csv.column_names", get("csv", "column_names")),
            libsvm_fields=_choice("libsvm.fields", get("libsvm", "fields"), LIBSVM_FIELDS),
            libsvm_dense_indices=tuple(_integer("libsvm.dense_indices", i, 0, 10**18) for i in dense_indices),
            label_column=_text("label.column", get("label", "column")),
            label_threshold=_number("label.threshold", get("label", "threshold")),
            label_positive_values=tuple(str(v) for v in positive),
            dense_columns=_names("dense.columns", get("dense", "columns")),
            dense_transform=parse_chain("dense.transform", get("dense", "transform")),
            dense_transforms=tuple((str(c), parse_chain(f"dense.transforms.{c}", chain))
                                   for c, chain in sorted(transforms.items())),
            dense_clip_min=_number("dense.clip_min", get("dense", "clip_min"), optional=True),
            dense_clip_max=_number("dense.clip_max", get("dense", "clip_max"), optional=True),
            dense_missing=_number("dense.missing", get("dense", "missing")),
            dense_nan=_choice("dense.nan", get("dense", "nan"), DENSE_NAN),
            sparse_columns=_names("sparse.columns", get("sparse", "columns")),
            sparse_multi_valued=_names("sparse.multi_valued", get("sparse", "multi_valued")),
            sparse_separator=_text("sparse.separator", get("sparse", "separator")),
            sparse_max_bag_size=_integer("sparse.max_bag_size", get("sparse", "max_bag_size"), 0),
            sparse_vocab=base, sparse_overrides=tuple(parsed_overrides),
            split_method=_choice("split.method", get("split", "method"), SPLIT_METHODS),
            split_validation_fraction=_number("split.validation_fraction", get("split", "validation_fraction")),
            split_test_fraction=_number("split.test_fraction", get("split", "test_fraction")),
            split_seed=_integer("split.seed", get("split", "seed"), 0, 2**63),
            split_time_column=_text("split.time_column", get("split", "time_column")),
            split_train_files=_text("split.train_files", get("split", "train_files")),
            split_validation_files=_text("split.validation_files", get("split", "validation_files")),
            split_test_files=_text("split.test_files", get("split", "test_files")),
            **runtime)

    def to_dict(self, *, location: bool = True) -> dict[str, Any]:
        """The config section as a nested JSON-able dict (`from_config` reads it back). location=False leaves out
        dir and prepared_dir (where the data is, not how it is prepared)."""
        out: dict[str, Any] = {
            "name": "tabular", "format": self.format, "files": self.files, "strict": self.strict,
            "csv": {"delimiter": self.csv_delimiter, "header": self.csv_header,
                    "column_names": list(self.csv_column_names)},
            "libsvm": {"fields": self.libsvm_fields, "dense_indices": list(self.libsvm_dense_indices)},
            "label": {"column": self.label_column, "threshold": self.label_threshold,
                      "positive_values": list(self.label_positive_values)},
            "dense": {"columns": list(self.dense_columns), "transform": "+".join(self.dense_transform) or "none",
                      "transforms": {c: "+".join(s) or "none" for c, s in self.dense_transforms},
                      "clip_min": self.dense_clip_min, "clip_max": self.dense_clip_max, "missing": self.dense_missing,
                      "nan": self.dense_nan},
            "sparse": {"columns": list(self.sparse_columns), "multi_valued": list(self.sparse_multi_valued),
                       "separator": self.sparse_separator, "max_bag_size": self.sparse_max_bag_size,
                       "vocab": self.sparse_vocab.vocab, "frequency_threshold": self.sparse_vocab.frequency_threshold,
                       "hash_buckets": self.sparse_vocab.hash_buckets,
                       "overrides": {c: dataclasses.asdict(v) for c, v in self.sparse_overrides}},
            "split": {"method": self.split_method, "validation_fraction": self.split_validation_fraction,
                      "test_fraction": self.split_test_fraction, "seed": self.split_seed,
                      "time_column": self.split_time_column, "train_files": self.split_train_files,
                      "validation_files": self.split_validation_files, "test_files": self.split_test_files},
        }
        if location:
            out = {"dir": self.dir, "prepared_dir": self.prepared_dir, **out}
        return out

    # -- checks ----------------------------------------------------------------------------------------------------

    def _check(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError("data.format", f"must be one of {list(FORMATS)}, got {self.format!r}")
        if len(self.csv_delimiter) != 1 or self.csv_delimiter in "\r\n\"":
            raise ConfigError("data.csv.delimiter", f"must be one character other than '\"', '\\r', '\\n', got "
                                                    f"{self.csv_delimiter!r} (use \"\\t\" for TSV)")
        if self.csv_column_names and self.csv_header:
            raise ConfigError("data.csv.column_names", "names the columns of files without a header; set "
                                                       "data.csv.header=False, or leave column_names empty to use the "
                                                       "header")
        if len(set(self.csv_column_names)) != len(self.csv_column_names):
            raise ConfigError("data.csv.column_names", f"has repeated names: {list(self.csv_column_names)}")
        if not self.sparse_separator:
            raise ConfigError("data.sparse.separator", "must not be empty")
        for key, fraction in (("validation_fraction", self.split_validation_fraction),
                              ("test_fraction", self.split_test_fraction)):
            if not 0 <= fraction < 1:
                raise ConfigError(f"data.split.{key}", f"must be in [0, 1), got {fraction}")
        if self.split_method in ("random", "time") and self.split_validation_fraction + self.split_test_fraction >= 1:
            raise ConfigError("data.split.test_fraction", f"validation_fraction + test_fraction must be < 1 (train "
                                                          f"needs rows), got {self.split_validation_fraction} + "
                                                          f"{self.split_test_fraction}")
        if self.split_method == "time" and not self.split_time_column:
            raise ConfigError("data.split.time_column", "must name the column to sort by when data.split.method "
                                                        "is 'time'")
        if self.split_method == "files":
            for key in ("train_files", "test_files"):
                if not getattr(self, f"split_{key}").strip():
                    raise ConfigError(f"data.split.{key}", "must give comma-separated globs relative to data.dir "
                                                           "when data.split.method is 'files'")
        for name, settings in (("sparse", self.sparse_vocab),) + tuple(
                (f"sparse.overrides.{c}", v) for c, v in self.sparse_overrides):
            if settings.vocab == "hash" and not 1 <= settings.hash_buckets < 2**31:
                raise ConfigError(f"data.{name}.hash_buckets", f"must be in [1, 2**31) with vocab = 'hash' (ids are "
                                                               f"int32), got {settings.hash_buckets}")
        chains = [("dense.transform", self.dense_transform)] + [(f"dense.transforms.{c}", s)
                                                                 for c, s in self.dense_transforms]
        clipping = [key for key, steps in chains if "clip" in steps]
        if clipping and self.dense_clip_min is None and self.dense_clip_max is None:
            raise ConfigError(f"data.{clipping[0]}", "clips, but data.dense.clip_min and clip_max are both unset")
        if (self.dense_clip_min is not None and self.dense_clip_max is not None
                and self.dense_clip_min > self.dense_clip_max):
            raise ConfigError("data.dense.clip_min", f"({self.dense_clip_min}) must be <= data.dense.clip_max "
                                                     f"({self.dense_clip_max})")
        if self.format == "libsvm":
            self._check_libsvm()
        else:
            self._check_columns()

    def _check_libsvm(self) -> None:
        for key in ("dense_columns", "sparse_columns", "sparse_multi_valued"):
            if getattr(self, key):
                name = key.replace("_", ".", 1)
                raise ConfigError(f"data.{name}", "is for csv/parquet files; libsvm features come from "
                                                  "data.libsvm.fields (and dense ones from data.libsvm.dense_indices)")
        if self.split_method == "time":
            raise ConfigError("data.split.method", "'time' needs a time column, which libsvm files do not have; "
                                                   "use 'random' or 'files'")
        if len(set(self.libsvm_dense_indices)) != len(self.libsvm_dense_indices):
            raise ConfigError("data.libsvm.dense_indices", f"has repeats: {list(self.libsvm_dense_indices)}")
        dense = {f"i{i}" for i in self.libsvm_dense_indices}
        unknown = sorted({c for c, _ in self.dense_transforms} - dense)
        if unknown:
            raise ConfigError("data.dense.transforms", f"names {unknown}, which are not dense features; libsvm dense "
                                                       f"features are {sorted(dense)} (data.libsvm.dense_indices)")

    def _check_columns(self) -> None:
        if not self.label_column:
            raise ConfigError("data.label.column", "must name the label column")
        if not self.sparse_columns:
            raise ConfigError("data.sparse.columns", "is empty: list the categorical columns (the models embed at "
                                                     "least one sparse feature)")
        roles = [("data.label.column", self.label_column)]
        roles += [("data.dense.columns", c) for c in self.dense_columns]
        roles += [("data.sparse.columns", c) for c in self.sparse_columns]
        seen: dict[str, str] = {}
        for key, column in roles:
            if column in seen:
                raise ConfigError(key, f"column {column!r} is also in {seen[column]}; a column has one role")
            seen[column] = key
        if self.split_time_column == self.label_column and self.split_method == "time":
            raise ConfigError("data.split.time_column", f"{self.split_time_column!r} is the label column")
        for key, names, within, where in (
                ("sparse.multi_valued", self.sparse_multi_valued, self.sparse_columns, "data.sparse.columns"),
                ("dense.transforms", [c for c, _ in self.dense_transforms], self.dense_columns, "data.dense.columns"),
                ("sparse.overrides", [c for c, _ in self.sparse_overrides], self.sparse_columns,
                 "data.sparse.columns")):
            unknown = [c for c in names if c not in within]
            if unknown:
                raise ConfigError(f"data.{key}", f"names {unknown}, which are not in {where} {list(within)}")

    # -- derived ---------------------------------------------------------------------------------------------------

    def dense_steps(self, column: str) -> tuple[str, ...]:
        return dict(self.dense_transforms).get(column, self.dense_transform)

    def vocab_settings(self, feature: str) -> VocabSettings:
        return dict(self.sparse_overrides).get(feature, self.sparse_vocab)

    def read_plan(self) -> ReadPlan:
        if self.format == "libsvm":
            dense = tuple(DenseColumn(f"i{i}", self.dense_steps(f"i{i}"), i) for i in self.libsvm_dense_indices)
        else:
            dense = tuple(DenseColumn(c, self.dense_steps(c)) for c in self.dense_columns)
        return ReadPlan(
            format=self.format, label=self.label_column, label_threshold=self.label_threshold,
            positive_values=self.label_positive_values, dense=dense, clip_min=self.dense_clip_min,
            clip_max=self.dense_clip_max, missing=self.dense_missing, nan=self.dense_nan, sparse=self.sparse_columns,
            multi_valued=frozenset(self.sparse_multi_valued), separator=self.sparse_separator,
            max_bag_size=self.sparse_max_bag_size,
            time_column=self.split_time_column if self.split_method == "time" else None,
            delimiter=self.csv_delimiter, header=self.csv_header, column_names=self.csv_column_names,
            libsvm_fields=self.libsvm_fields, chunk_bytes=self.chunk_bytes,
            parquet_batch_rows=max(1024, self.chunk_bytes // 256))


# ----------------------------------------------------------------------------------------------------------------------
# Files and splits
# ----------------------------------------------------------------------------------------------------------------------


def resolve_files(directory: str | pathlib.Path, patterns: str, key: str) -> list[str]:
    """Comma-separated globs relative to `directory` -> the files, each pattern's matches sorted, in pattern order,
    each file once."""
    directory = pathlib.Path(directory).expanduser()
    if not directory.is_dir():
        raise ConfigError("data.dir", f"{str(directory)!r} is not a folder; set it to the folder with the files")
    found: dict[str, None] = {}
    for pattern in (p.strip() for p in patterns.split(",")):
        if not pattern:
            continue
        matches = sorted(str(p) for p in directory.glob(pattern) if p.is_file())
        if not matches:
            there = sorted(p.name for p in directory.iterdir())
            shown = (", ".join(there[:20]) + (", ..." if len(there) > 20 else "")) or "no files"
            raise ConfigError(f"data.{key}", f"pattern {pattern!r} matches no file in {directory} (it has: "
                                             f"{shown}); fix the pattern or data.dir")
        found.update(dict.fromkeys(matches))
    if not found:
        raise ConfigError(f"data.{key}", "is empty; give comma-separated globs relative to data.dir")
    return list(found)


def source_paths(options: TabularOptions, directory: str | pathlib.Path) -> list[str]:
    """Every file the options read from `directory` (data.files, or the split's files for method "files"), in the
    order they are read; a pattern matching nothing is a ConfigError naming its key."""
    return _sources(options, str(directory)).paths


def split_uniform(seed: int, rows: np.ndarray) -> np.ndarray:
    """The random split's uniform draw in [0, 1) per row, f64[n], from the seed and each row's index among the valid
    rows of the data, in the order read (i64[n], 0-based):

        x = mix64(mix64(seed + 0x9E3779B97F4A7C15) ^ row)      (mod 2**64)
        u = (x >> 11) * 2**-53

    The index counts valid rows only -- no header, blank or bad line, file boundary or Parquet row group -- so the
    same rows split alike from CSV, Parquet or libSVM, one file or many. (A hash of each row's content would split
    alike too, but it sends every copy of a frequent duplicate row to one split, and changes with the columns
    chosen, so a feature ablation would be scored on other test rows.)
    """
    salt = splitmix64(np.array([seed], np.uint64))
    x = mix64(salt ^ rows.astype(np.uint64))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _describe_files(paths: Sequence[str], directory: str) -> str:
    names = [str(pathlib.Path(p).relative_to(directory)) if p.startswith(str(directory)) else p for p in paths]
    return ", ".join(names) if len(names) <= 3 else f"{len(names)} files ({names[0]}, ..., {names[-1]})"


@dataclasses.dataclass(frozen=True)
class _Sources:
    """The files to read, and what decides each file's split."""

    paths: list[str]
    file_split: list[int | None]  # method "files": the file's split (None = carve validation at random)
    describe: dict[str, str]  # split -> the files it comes from, for messages


def _sources(options: TabularOptions, directory: str) -> _Sources:
    directory = str(pathlib.Path(directory).expanduser())
    if options.split_method != "files":
        paths = resolve_files(directory, options.files, "files")
        described = _describe_files(paths, directory)
        return _Sources(paths, [None] * len(paths), dict.fromkeys(SPLITS, described))
    per_split = {}
    for split in SPLITS:
        patterns = getattr(options, f"split_{split}_files")
        per_split[split] = resolve_files(directory, patterns, f"split.{split}_files") if patterns.strip() else []
    owner: dict[str, str] = {}
    for split, paths in per_split.items():
        for path in paths:
            if path in owner:
                raise ConfigError(f"data.split.{split}_files", f"{path} is also in data.split.{owner[path]}_files; "
                                                               "a file belongs to one split")
            owner[path] = split
    carve = not per_split["validation"]
    paths, file_split = [], []
    for code, split in enumerate(SPLITS):
        paths += per_split[split]
        file_split += [None if carve and code == TRAIN else code] * len(per_split[split])
    describe = {split: _describe_files(per_split[split], directory) for split in SPLITS}
    if carve:
        describe["validation"] = describe["train"]
    return _Sources(paths, file_split, describe)


def _assign(record: _Spilled, first_row: int, options: TabularOptions, sources: _Sources) -> np.ndarray | None:
    """Split codes u8[n] of a chunk's rows, the first of which is valid row `first_row` of the data (None: decided
    later, by time)."""
    method = options.split_method
    if method == "time":
        return None
    fixed = sources.file_split[record.file_index]
    if fixed is not None:
        return np.full(record.rows, fixed, np.uint8)
    u = split_uniform(options.split_seed, first_row + np.arange(record.rows, dtype=np.int64))
    if method == "files":  # carve validation out of the train files
        return np.where(u < options.split_validation_fraction, VALIDATION, TRAIN).astype(np.uint8)
    train_end = 1.0 - options.split_validation_fraction - options.split_test_fraction
    return np.where(u < train_end, TRAIN, np.where(u < 1.0 - options.split_test_fraction, VALIDATION, TEST)
                    ).astype(np.uint8)


def _rounded(fraction: float, n: int) -> int:
    return int(math.floor(fraction * n + 0.5))


# ----------------------------------------------------------------------------------------------------------------------
# The spill: each parsed chunk's good rows, compactly
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)  # holds arrays
class _Spilled:
    """One parsed chunk in the spill directory, and what stays in memory about it.

    Parsed (`path`, `layout`): labels, dense (before standardising), and per sparse feature j keys_j (distinct
    raw keys), inverse_j (each value's position among them) and, for bags, lengths_j. Finalised (`finals`,
    replacing it): per split its rows as labels, dense, ids_j i32[n, L_j] and, for bags, lengths_j.
    """

    path: pathlib.Path
    layout: dict[str, tuple[int, str, tuple]]
    rows: int
    split: np.ndarray | None  # u8[rows] split codes (None until assigned, in file order)
    time: np.ndarray | None  # f64[rows], until the time split is assigned
    features: tuple[str, ...]  # the sparse features the chunk has (ffm: the fields its lines have)
    max_lengths: dict[str, int]
    truncated: dict[str, int]
    source: str
    file_index: int
    time_numeric_at: int | None
    time_iso_at: int | None
    dense_missing: np.ndarray  # i64[D] missing cells per dense column, imputed
    dense_nan: np.ndarray  # i64[D] NaN cells per dense column, imputed (data.dense.nan = "impute")
    label_values: dict[str, int]  # {the label's text: rows}, the most frequent
    finals: dict[int, tuple[pathlib.Path, dict, int]] = dataclasses.field(default_factory=dict)


def _spill(chunk: ParsedChunk, path: pathlib.Path) -> _Spilled:
    arrays = {"labels": chunk.labels, "dense": chunk.dense}
    for j, values in enumerate(chunk.sparse.values()):
        arrays[f"keys_{j}"] = values.keys
        arrays[f"inverse_{j}"] = values.inverse.astype(np.uint16 if values.keys.size <= 1 << 16 else np.int32)
        if values.lengths is not None:
            arrays[f"lengths_{j}"] = values.lengths
    return _Spilled(path, write_arrays(path, arrays), chunk.size, None, chunk.time, tuple(chunk.sparse),
                    {name: v.max_length for name, v in chunk.sparse.items()},
                    {name: v.truncated for name, v in chunk.sparse.items()}, chunk.path, chunk.file_index,
                    chunk.time_numeric_at,
                    chunk.time_iso_at, chunk.dense_missing, chunk.dense_nan, chunk.label_values)


def _load(record: _Spilled) -> tuple[np.ndarray, np.ndarray, dict[str, tuple]]:
    """(labels f32[n], dense f32[n, D], {feature: (keys i64[u], inverse [m], lengths i32[n] or None)})."""
    arrays = read_arrays(record.path, record.layout)
    sparse = {name: (arrays[f"keys_{j}"], arrays[f"inverse_{j}"], arrays.get(f"lengths_{j}"))
              for j, name in enumerate(record.features)}
    return arrays["labels"], arrays["dense"], sparse


# ----------------------------------------------------------------------------------------------------------------------
# Vocabularies and dense statistics (train split)
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays
class FeatureVocabulary:
    """Raw key -> id of one feature (see the module doc). keys: i64[K] ascending kept keys and ids: i32[K] (frequency);
    index_counts: i64[vocab_size] train occurrences per id; raw_keys / raw_counts: every key seen in train."""

    name: str
    settings: VocabSettings
    bag_size: int
    multi_valued: bool
    missing_key: int
    keys: np.ndarray
    ids: np.ndarray
    index_counts: np.ndarray
    raw_keys: np.ndarray
    raw_counts: np.ndarray
    missing_train: int  # one-hot: rows with the missing value; multi-valued: empty bags

    @property
    def vocab_size(self) -> int:
        return int(self.index_counts.size)

    def ids_of(self, raw_keys: np.ndarray) -> np.ndarray:
        """Distinct raw keys i64[u] -> ids i32[u]."""
        if self.settings.vocab == "hash":
            return (raw_keys % self.settings.hash_buckets).astype(np.int32)
        # Looked up in ascending order: the binary searches then walk the vocabulary monotonically (measured faster
        # than a dictionary's order, the sort included, and than a numpy hash table: benchmarks/RESULTS.md).
        order = np.argsort(raw_keys)
        ids = np.empty(raw_keys.size, np.int32)
        ids[order] = lookup(self.keys, self.ids, raw_keys[order])
        return ids


def _fit_chunk(record: _Spilled, dense_columns: int) -> dict[str, Any] | None:
    """Train statistics of one spilled chunk: per feature (keys, counts) and empty bags; dense (count, mean, M2)."""
    train = record.split == TRAIN
    n = int(train.sum())
    if n == 0:
        return None
    labels, dense, sparse = _load(record)
    counted, empty_bags = {}, {}
    for name, (keys, inverse, lengths) in sparse.items():
        if lengths is None:
            values = inverse[train]
        else:
            values = inverse[np.repeat(train, lengths)]
            empty_bags[name] = int((lengths[train] == 0).sum())
        counts = np.bincount(values, minlength=keys.size)
        seen = counts > 0
        counted[name] = (keys[seen], counts[seen].astype(np.int64))
    x = dense[train].astype(np.float64)
    mean = x.mean(axis=0) if dense_columns else np.zeros(0)
    m2 = ((x - mean) ** 2).sum(axis=0) if dense_columns else np.zeros(0)
    return {"rows": n, "positives": int(labels[train].sum()), "counted": counted, "empty_bags": empty_bags,
            "mean": mean, "m2": m2}


def _merge_moments(a: tuple, b: tuple) -> tuple:
    """Chan et al.'s parallel update of (count, mean, M2) per column."""
    (na, ma, sa), (nb, mb, sb) = a, b
    n = na + nb
    if n == 0:
        return a
    delta = mb - ma
    return n, ma + delta * (nb / n), sa + sb + delta**2 * (na * nb / n)


def _finalize(record: _Spilled, vocabularies: Mapping[str, FeatureVocabulary], shift: np.ndarray,
              scale: np.ndarray) -> None:
    """Map a parsed chunk once -- ids of its distinct keys looked up, dense standardised -- and write each split's
    rows to its own file (`record.finals`); the parsed file is deleted."""
    labels, dense, sparse = _load(record)
    n = record.rows
    out = {"dense": ((dense.astype(np.float64) - shift) / scale).astype(np.float32), "labels": labels}
    for j, (name, vocabulary) in enumerate(vocabularies.items()):
        if name not in sparse:  # ffm: the field is on none of the chunk's lines
            ids = np.zeros((n, vocabulary.bag_size), np.int32)
            ids[:, 0] = vocabulary.ids_of(np.array([vocabulary.missing_key], np.int64))[0]
            out[f"ids_{j}"] = ids
            continue
        keys, inverse, bag = sparse[name]
        distinct_ids = vocabulary.ids_of(keys)
        if bag is None:
            out[f"ids_{j}"] = distinct_ids[inverse][:, None]
            continue
        slot = bag_positions(bag)
        ids = np.zeros((n, vocabulary.bag_size), np.int32)
        ids[np.repeat(np.arange(n), bag), slot] = distinct_ids[inverse]
        out[f"ids_{j}"], out[f"lengths_{j}"] = ids, bag
    for code, split in enumerate(SPLITS):
        rows = np.flatnonzero(record.split == code)
        if rows.size == 0:
            continue
        path = record.path.with_name(f"{record.path.stem}_{split}.bin")
        chosen = out if rows.size == n else {name: array[rows] for name, array in out.items()}
        record.finals[code] = (path, write_arrays(path, chosen), int(rows.size))
    record.path.unlink()


# ----------------------------------------------------------------------------------------------------------------------
# Preparing
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PreparedTabular:
    """The fitted spec, vocabularies and statistics, and the splits as re-iterable streams of blocks.

    Everything is parsed by `prepare_tabular`, so `report` is complete. Blocks come from the temporary spill
    directory: call `close()` (or use `with prepare_tabular(...) as prepared:`) to delete it.
    """

    spec: DatasetSpec
    stats: VocabularyStats = dataclasses.field(repr=False)
    report: ParseReport
    options: TabularOptions
    block_rows: int
    split_rows: dict[str, int]
    vocabularies: dict[str, FeatureVocabulary] = dataclasses.field(repr=False)
    dense_shift: np.ndarray = dataclasses.field(repr=False)  # f64[D]: subtracted (train mean, 0 if not standardised)
    dense_scale: np.ndarray = dataclasses.field(repr=False)  # f64[D]: divided by (train std, 1 if not standardised)
    records: list[_Spilled] = dataclasses.field(repr=False)
    spill_directory: tempfile.TemporaryDirectory | None = dataclasses.field(default=None, repr=False)

    def blocks(self, split: str) -> Iterator[Batch]:
        """Blocks of `block_rows` examples of `split` in file order (the last block may be short)."""
        if split not in SPLITS:
            raise ValueError(f"split '{split}' not found; the prepared data has {list(SPLITS)}")
        if self.spill_directory is None:
            raise ValueError("the prepared data was deleted by close(); prepare it again")
        code = SPLITS.index(split)
        finals = [record.finals[code] for record in self.records if code in record.finals]
        return rebatch(ordered_map(self._batch, finals, self.options.num_threads), self.block_rows)

    def _batch(self, final: tuple[pathlib.Path, dict, int]) -> Batch:
        path, layout, n = final
        arrays = read_arrays(path, layout)
        ones = np.ones(n, np.int32)
        return Batch(dense=arrays["dense"], labels=arrays["labels"],
                     ids={name: arrays[f"ids_{j}"] for j, name in enumerate(self.vocabularies)},
                     lengths={name: arrays.get(f"lengths_{j}", ones) for j, name in enumerate(self.vocabularies)})

    def close(self) -> None:
        """Delete the spill."""
        if self.spill_directory is not None:
            self.spill_directory.cleanup()
            self.spill_directory = None

    def __enter__(self) -> PreparedTabular:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prepare_tabular(options: TabularOptions, *, directory: str | pathlib.Path | None = None,
                    block_rows: int = 8192) -> PreparedTabular:
    """Parse the files of `options` (in `directory`, default `options.dir`), assign the splits, fit the
    vocabularies and dense statistics on train; the blocks are then streamed by `PreparedTabular.blocks(split)`."""
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    directory = str(directory if directory is not None else options.dir)
    if not directory:
        raise ConfigError("data.dir", "is empty; set it to the folder holding the files")
    sources = _sources(options, directory)
    plan = options.read_plan()
    spill_directory = tempfile.TemporaryDirectory(prefix="recjax_tabular_spill_", dir=options.spill_dir)
    try:
        return _prepare(options, plan, sources, directory, spill_directory, block_rows)
    except BaseException:
        spill_directory.cleanup()
        raise


def _prepare(options: TabularOptions, plan: ReadPlan, sources: _Sources, directory: str,
             spill_directory: tempfile.TemporaryDirectory, block_rows: int) -> PreparedTabular:
    # -- pass 1: parse every file once, spill the good rows ---------------------------------------------------------
    report = ParseReport()
    folder = pathlib.Path(spill_directory.name)
    counter = iter(range(1 << 62))  # unique spill names across threads (next() on an iterator is atomic in CPython)

    def parse(unit):
        chunk, block_report = parse_unit(unit, plan)
        record = None
        if chunk.size:
            record = _spill(chunk, folder / f"chunk_{next(counter):07d}.bin")
        unknown = (chunk.unknown_labels, chunk.path, chunk.unknown_label_at)
        return record, block_report, chunk.size, unknown

    expected = {"csv": f"CSV rows (delimiter {options.csv_delimiter!r})", "parquet": "Parquet rows",
                "libsvm": "libSVM lines (label idx:val ...)"}[options.format]
    line_word = "row" if options.format == "parquet" else "line"
    records: list[_Spilled] = []
    valid_rows = 0  # the valid rows before the current chunk, in file order
    unknown_labels: dict[str, int] = {}
    first_unknown = None
    for record, block_report, rows, (unknown, path, at) in ordered_map(parse, units(sources.paths, plan),
                                                                      options.num_threads):
        merge_report(report, block_report, rows, strict=options.strict, expected=expected,
                     lenient_hint="set data.strict=False", line_word=line_word)
        if record is not None:
            record.split = _assign(record, valid_rows, options, sources)
            valid_rows += record.rows
            records.append(record)
        unknown_labels = _add_counts(unknown_labels, unknown)
        if unknown and first_unknown is None:
            first_unknown = (path, at)
    label_values = _label_values(records)
    if unknown_labels:
        raise _unknown_labels_error(options, unknown_labels, first_unknown, label_values, directory, line_word)
    if not records:
        raise DataError(f"no valid rows in {_describe_files(sources.paths, directory)} ({report.summary()}); check "
                         "data.format, data.csv.delimiter and the columns")

    # -- splits ---------------------------------------------------------------------------------------------------
    if options.split_method == "time":
        _assign_by_time(records, options)
    split_rows = {split: sum(int(np.sum(r.split == code)) for r in records) for code, split in enumerate(SPLITS)}
    _check_splits(split_rows, options, sources, report)

    # -- features -------------------------------------------------------------------------------------------------
    if options.format != "libsvm":
        names = list(options.sparse_columns)
    elif options.libsvm_fields == "ffm":
        names = sorted({name for r in records for name in r.features}, key=lambda name: int(name[1:]))
    else:
        names = list(records[0].features)
    unknown = sorted({c for c, _ in options.sparse_overrides} - set(names))
    if unknown:
        raise ConfigError("data.sparse.overrides", f"names {unknown}, which are not features of this data: {names}")
    multi = set(options.sparse_multi_valued) | ({"features"} if options.libsvm_fields == "bag" and
                                                options.format == "libsvm" else set())
    missing_key = MISSING_INDEX_KEY if options.format == "libsvm" else MISSING_STRING_KEY

    # -- pass 2: fit on train -------------------------------------------------------------------------------------
    num_dense = len(plan.dense)
    counters = {name: KeyCounter() for name in names}
    empty_bags = dict.fromkeys(names, 0)
    moments = (0, np.zeros(num_dense), np.zeros(num_dense))
    positives = 0
    for fitted in ordered_map(lambda r: _fit_chunk(r, num_dense), records, options.num_threads):
        if fitted is None:
            continue
        positives += fitted["positives"]
        moments = _merge_moments(moments, (fitted["rows"], fitted["mean"], fitted["m2"]))
        for name in names:
            if name in fitted["counted"]:
                counters[name].add(*fitted["counted"][name])
            else:  # ffm: a field on none of the chunk's lines is missing on every one of them
                counters[name].add(np.array([missing_key], np.int64), np.array([fitted["rows"]], np.int64))
            empty_bags[name] += fitted["empty_bags"].get(name, 0)
    train_rows, mean, m2 = moments
    if positives in (0, train_rows):
        raise DataError(f"data.label: the train split has one class: {positives:,} of {train_rows:,} train rows are "
                        f"positive (label = {_label_rule(options)}; the label's values: {_shown(label_values)}); a "
                        "model cannot learn from one class, and AUC is undefined. Check data.label.column, "
                        "data.label.threshold and data.label.positive_values")
    std = np.sqrt(m2 / max(train_rows, 1))
    standardised = np.array(["standardise" in d.steps for d in plan.dense], bool)
    dense_shift = np.where(standardised, mean, 0.0)
    dense_scale = np.where(standardised & (std > 0), std, 1.0)

    vocabularies = {}
    # The final sort of each feature's counts, on the threads (numpy releases the GIL in sorts).
    counted = dict(zip(names, ordered_map(lambda name: counters[name].result(), names, options.num_threads),
                       strict=True))
    for name in names:
        raw_keys, raw_counts = counted[name]
        settings = options.vocab_settings(name)
        if name in multi:
            seen = max((r.max_lengths.get(name, 0) for r in records), default=0)
            bag_size = options.sparse_max_bag_size or max(seen, 1)
        else:
            bag_size = 1
        if settings.vocab == "hash":
            keys, ids = np.zeros(0, np.int64), np.zeros(0, np.int32)
            index_counts = hash_index_counts(raw_keys, raw_counts, settings.hash_buckets)
        else:
            keys, ids, index_counts = frequency_vocabulary(raw_keys, raw_counts, settings.frequency_threshold)
        missing = empty_bags[name] if name in multi else int(raw_counts[raw_keys == missing_key].sum())
        vocabularies[name] = FeatureVocabulary(name, settings, bag_size, name in multi, missing_key, keys, ids,
                                               index_counts, raw_keys, raw_counts, missing)

    # -- pass 3: every chunk mapped once, each split's rows to its own file ----------------------------------------
    for _ in ordered_map(lambda r: _finalize(r, vocabularies, dense_shift, dense_scale), records,
                         options.num_threads):
        pass

    spec = DatasetSpec(num_dense=num_dense, features=tuple(
        FeatureSpec(name, v.vocab_size, v.bag_size) for name, v in vocabularies.items()))
    stats = _statistics(options, plan, vocabularies, records, split_rows, positives, mean, std, standardised,
                        label_values)
    return PreparedTabular(spec, stats, report, options, block_rows, split_rows, vocabularies, dense_shift,
                           dense_scale, records, spill_directory)


def _add_counts(total: dict[str, int], more: Mapping[str, int]) -> dict[str, int]:
    """Counts of values added, the LABEL_VALUES most frequent kept (ties: first seen)."""
    if not more:
        return total
    merged = dict(total)
    for value, count in more.items():
        merged[value] = merged.get(value, 0) + count
    return dict(sorted(merged.items(), key=lambda item: -item[1])[:LABEL_VALUES])


def _label_values(records: Sequence[_Spilled]) -> dict[str, int]:
    total: dict[str, int] = {}
    for record in records:
        total = _add_counts(total, record.label_values)
    return total


def _shown(counts: Mapping[str, int], limit: int = 10) -> str:
    """{'0': 1600, 'no': 3} -> "'0' x1,600, 'no' x3" (the first `limit`)."""
    text = ", ".join(f"{value!r} x{count:,}" for value, count in list(counts.items())[:limit])
    return (text + (", ..." if len(counts) > limit else "")) or "none"


def _label_name(options: TabularOptions) -> str:
    return "the label (each line's first token)" if options.format == "libsvm" else \
        f"label column {options.label_column!r}"


def _label_rule(options: TabularOptions) -> str:
    """How a label value becomes 1, for messages."""
    if options.label_positive_values:
        return f"{_label_name(options)} in data.label.positive_values {list(options.label_positive_values)}"
    return f"{_label_name(options)} >= data.label.threshold = {options.label_threshold:g}"


def _unknown_labels_error(options: TabularOptions, unknown: Mapping[str, int], first: tuple[str, int],
                          numbers: Mapping[str, int], directory: str, line_word: str) -> DataError:
    path, at = first
    where = _describe_files([path], directory)
    return DataError(f"data.label: {_label_name(options)} holds values that are not numbers: {_shown(unknown)} (the "
                     f"first in {where}, {line_word} {at}); the numbers: {_shown(numbers)}. data.label.threshold "
                     f"({options.label_threshold:g}) needs numbers: set data.label.positive_values to the values that "
                     "mean a click (every other value is 0), or data.label.column to the label's column")


def _assign_by_time(records: list[_Spilled], options: TabularOptions) -> None:
    """Split codes from the times: the latest rows test, the ones before validation (ties: file, then line order)."""
    numeric = next(((r.source, r.time_numeric_at) for r in records if r.time_numeric_at is not None), None)
    iso = next(((r.source, r.time_iso_at) for r in records if r.time_iso_at is not None), None)
    if numeric and iso:
        raise DataError(f"data.split.time_column {options.split_time_column!r} mixes numbers ({numeric[0]}, line / "
                        f"row {numeric[1]}) and ISO-8601 dates ({iso[0]}, line / row {iso[1]}); use one kind")
    times = np.concatenate([r.time for r in records])
    n = times.size
    if n > 1 and times.min() == times.max():
        # Refused rather than noted: every tie is broken by file order, so this "time split" would be a file-order
        # split reported as a time split (summary.json's split_method), and a note on the console is easily missed.
        # The fix is one setting.
        value = str(np.datetime64(int(times[0]), "s")) if iso else \
            f"{int(times[0])}" if times[0] == int(times[0]) else repr(float(times[0]))
        raise DataError(f"data.split.time_column {options.split_time_column!r} holds one value ({value}) in all "
                        f"{n:,} valid rows, so a time split would cut them in file order; set data.split.method to "
                        "'random' (or 'files'), or data.split.time_column to a column whose values vary")
    order = np.argsort(times, kind="stable")  # records are in (file, line) order, so ties keep it
    n_test = _rounded(options.split_test_fraction, n)
    n_validation = _rounded(options.split_validation_fraction, n)
    codes = np.full(n, TRAIN, np.uint8)
    codes[order[n - n_test:]] = TEST
    codes[order[n - n_test - n_validation:n - n_test]] = VALIDATION
    start = 0
    for record in records:
        record.split, record.time = codes[start:start + record.rows], None
        start += record.rows


def _check_splits(split_rows: dict[str, int], options: TabularOptions, sources: _Sources,
                  report: ParseReport) -> None:
    """Every split needs a row: say which is empty, why, and what to change."""
    v, t = options.split_validation_fraction, options.split_test_fraction
    for code, split in enumerate(SPLITS):
        if split_rows[split]:
            continue
        files = sources.describe[split]
        if options.split_method == "files" and (code != VALIDATION or options.split_validation_files.strip()):
            raise DataError(f"data.split: {split} has 0 valid rows (data.split.{split}_files matched {files}; "
                            f"{report.summary()}); fix the files or the pattern")
        if options.split_method == "files":  # validation carved out of the train files
            share, total, key = f"validation_fraction {v:g}", split_rows["train"], "validation_fraction"
        else:
            share, key = {TRAIN: (f"1 - validation_fraction - test_fraction = {1 - v - t:g}",
                                  "validation_fraction and test_fraction"),
                          VALIDATION: (f"validation_fraction {v:g}", "validation_fraction"),
                          TEST: (f"test_fraction {t:g}", "test_fraction")}[code]
            total = sum(split_rows.values())
            if options.split_method == "time" and code != TRAIN:
                share = "the latest " + share if code == TEST else share + " before the test rows"
        raise DataError(f"data.split: {split} has 0 rows ({share} of {total} valid rows in {files}); provide more "
                         f"rows or set data.split.{key} so each split gets at least one row")


def _statistics(options: TabularOptions, plan: ReadPlan, vocabularies: Mapping[str, FeatureVocabulary],
                records: Sequence[_Spilled], split_rows: Mapping[str, int], positives: int, mean: np.ndarray,
                std: np.ndarray, standardised: np.ndarray, label_values: Mapping[str, int]) -> VocabularyStats:
    features = {}
    for name, v in vocabularies.items():
        settings = {"vocab": v.settings.vocab}
        settings.update({"frequency_threshold": v.settings.frequency_threshold} if v.settings.vocab == "frequency"
                        else {"hash_buckets": v.settings.hash_buckets})
        features[name] = {
            **settings, "vocab_size": v.vocab_size, "bag_size": v.bag_size, "multi_valued": v.multi_valued,
            "train_occurrences": int(v.raw_counts.sum()), "raw_distinct_train": int(v.raw_keys.size),
            "out_of_vocabulary_train": int(v.index_counts[0]) if v.settings.vocab == "frequency" else 0,
            "missing_train": v.missing_train,
            "truncated_bags": int(sum(r.truncated.get(name, 0) for r in records)),
            "frequency_histogram": frequency_histogram(v.raw_counts),
        }
    missing = sum((r.dense_missing for r in records), np.zeros(len(plan.dense), np.int64))
    nan = sum((r.dense_nan for r in records), np.zeros(len(plan.dense), np.int64))
    dense = {column.name: {"transform": "+".join(column.steps) or "none", "mean": float(m), "std": float(s),
                           "standardised": bool(z), "missing_imputed": int(k), "nan_imputed": int(q)}
             for column, m, s, z, k, q in zip(plan.dense, mean, std, standardised, missing, nan, strict=True)}
    summary = {"format": options.format, "split_method": options.split_method, "split_rows": dict(split_rows),
               "train_positives": positives, "label": {"positive_when": _label_rule(options),
                                                       "values": dict(label_values)},
               "vocab_sizes": [v.vocab_size for v in vocabularies.values()],
               "features": features, "dense": dense, "dense_missing": options.dense_missing,
               "dense_nan": options.dense_nan}
    return VocabularyStats(summary, {name: v.index_counts for name, v in vocabularies.items()})


def summary_lines(stats: Mapping[str, Any]) -> list[str]:
    """What the console says about prepared tabular data (the summary's `tabular_stats`), after the parse report."""
    lines = []
    dense = stats.get("dense", {})
    if dense:
        chains: dict[str, list[str]] = {}
        for name, column in dense.items():
            chains.setdefault(column["transform"], []).append(name)
        shown = "; ".join(f"{chain} for {', '.join(names[:8])}" + (f", ... ({len(names)} columns)" if len(names) > 8
                                                                    else "") for chain, names in chains.items())
        lines.append(f"data: dense transform (data.dense.transform, per column data.dense.transforms): {shown}")
    else:
        lines.append("data: no dense columns")
    label, train = stats.get("label"), stats["split_rows"]["train"]
    if label:
        lines.append(f"data: label = {label['positive_when']}: {stats['train_positives']:,} of {train:,} train rows "
                     f"positive ({stats['train_positives'] / max(train, 1):.1%}); values: {_shown(label['values'])}")
    imputed = [(name, d["missing_imputed"], d["nan_imputed"]) for name, d in dense.items()
               if d.get("missing_imputed") or d.get("nan_imputed")]
    if imputed:
        cells = ", ".join(f"{name} {k:,} empty / null + {q:,} NaN" for name, k, q in imputed)
        lines.append(f"data: dense cells set to data.dense.missing = {stats['dense_missing']:g}: {cells} "
                     f"(data.dense.nan = {stats['dense_nan']!r}; 'skip' makes a line with a NaN a bad line)")
    return lines


def tabular_array_dataset(options: TabularOptions, *, directory: str | pathlib.Path | None = None, seed: int = 0
                          ) -> ArrayDataset:
    """Small data prepared into memory (tests, notebooks): "train", "validation" and "test"."""
    with prepare_tabular(options, directory=directory) as prepared:
        splits = {split: concatenate(list(prepared.blocks(split))) for split in SPLITS}
        info = {"parse_report": prepared.report.to_dict(), "tabular_stats": prepared.stats.summary}
        return ArrayDataset(prepared.spec, splits, seed=seed, info=info)


__all__ = [
    "FORMATS", "SPLITS", "FeatureVocabulary", "PreparedTabular", "TabularOptions", "VocabSettings",
    "default_data_config", "parse_chain", "prepare_tabular", "resolve_files", "source_paths", "split_uniform",
    "summary_lines", "tabular_array_dataset",
]
