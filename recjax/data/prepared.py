"""Prepared datasets on disk: TFDS builders that store blocks of examples in array_record, read without TensorFlow.

Each TFDS example is a *block* of up to `block_rows` examples stored as struct-of-arrays (dense f32[n, num_dense],
ids i32[n, sum(L_f)], lengths i32[n, F], labels f32[n]). One example per row would cost TFDS's per-example
Python encoding on every write and read (measured far slower: benchmarks/RESULTS.md#data-prepared-blocks); blocks
write and read at array_record speed. Builders subclass `BlockBuilder` and implement `_split_blocks()`.

Training reads through `PreparedDataset`: `tfds.data_source` (no TensorFlow import) for random access to blocks,
Grain's `MapDataset` to read blocks on worker threads in a seeded order, and a re-batcher that cuts the stream of
rows into fixed-size batches. Order is a pure function of (seed, epoch), so step i is reproducible and a run can
resume at any step. A multi-host process asks for its rows of every batch (`rows=`): blocks without one of them
are not read, and a shared block's rows are cut after the same shuffle, so the shares are disjoint and side by side
are the single-process batch. When a share (B / processes) is smaller than `block_rows` every process still
decodes most blocks; the decode is disjoint only for shares of whole blocks.
"""

import abc
import json
import pathlib
from collections.abc import Iterator, Mapping

import grain
import numpy as np
import tensorflow_datasets as tfds

from recjax.batch import Batch
from recjax.data.arrays import check_rows, cut, eval_shares, rebatch, take
from recjax.errors import DataError
from recjax.specs import SPLITS, DatasetSpec, FeatureSpec

DEFAULT_BLOCK_ROWS = 8192
MAX_REPORTED_LINES = 3  # skipped lines named on the console (summary.json has the first ten)


def spec_to_json(spec: DatasetSpec) -> dict:
    return {"num_dense": spec.num_dense, "target": spec.target,
            "features": [{"name": f.name, "vocab_size": f.vocab_size, "bag_size": f.bag_size} for f in spec.features]}


def spec_from_json(data: Mapping) -> DatasetSpec:
    return DatasetSpec(num_dense=int(data["num_dense"]),
                       features=tuple(FeatureSpec(f["name"], int(f["vocab_size"]), int(f["bag_size"]))
                                      for f in data["features"]),
                       target=data.get("target", "binary"))  # data prepared before targets existed: clicks


def pack_block(batch: Batch, spec: DatasetSpec) -> dict[str, np.ndarray]:
    """Batch -> the stored struct-of-arrays (ids of all features side by side).

    Data without dense features stores one zero column: TFDS loses the shape of a [n, 0] tensor (decoding fails).
    """
    dense = batch.dense.astype(np.float32)
    if dense.shape[1] == 0:
        dense = np.zeros((dense.shape[0], 1), np.float32)
    return {
        "dense": dense,
        "ids": np.concatenate([batch.ids[f.name] for f in spec.features], axis=1).astype(np.int32),
        "lengths": np.stack([batch.lengths[f.name] for f in spec.features], axis=1).astype(np.int32),
        "labels": batch.labels.astype(np.float32),
    }


def unpack_block(block: Mapping[str, np.ndarray], spec: DatasetSpec) -> Batch:
    """The stored struct-of-arrays -> Batch."""
    bounds = np.cumsum([0] + [f.bag_size for f in spec.features])
    ids = np.asarray(block["ids"])
    lengths = np.asarray(block["lengths"])
    return Batch(
        dense=np.asarray(block["dense"], np.float32).reshape(len(block["labels"]), -1)[:, :spec.num_dense],
        ids={f.name: ids[:, a:b] for f, a, b in zip(spec.features, bounds[:-1], bounds[1:], strict=True)},
        lengths={f.name: lengths[:, i] for i, f in enumerate(spec.features)},
        labels=np.asarray(block["labels"], np.float32),
    )


def blocks_of(batch: Batch, rows: int) -> Iterator[Batch]:
    """Consecutive slices of `rows` examples (the last may be shorter)."""
    return (take(batch, slice(a, a + rows)) for a in range(0, batch.size, rows))


class _LocalDatasetInfo(tfds.core.DatasetInfo):
    def initialize_from_bucket(self) -> None:
        """Our datasets are never in gs://tfds-data: skip TFDS's lookup, which leaves an empty `tmp*tfds` directory
        in $TMPDIR on every first prepare (tensorflow_datasets/core/dataset_info.py, initialize_from_bucket)."""


class BlockBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A TFDS builder whose examples are blocks of rows; subclasses describe the data and yield blocks."""

    # TFDS prints "Downloading and preparing dataset Unknown size ..." and "... downloaded and prepared" to stdout,
    # but nothing is downloaded; recjax/data/builders.py prints its own prepare summary instead.
    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    @abc.abstractmethod
    def _split_blocks(self, manual_dir) -> tuple[DatasetSpec, Mapping[str, Iterator[Batch]]]:
        """Read the raw files: the dataset's spec, and split name -> stream of Batch blocks (any sizes)."""

    def _extra_metadata(self) -> dict:
        """JSON-able facts recorded with the data (parse reports, statistics); called after each split ran."""
        return {}

    def _finish(self) -> None:
        """Called once every split has been generated (release temp files, save side outputs)."""

    def _describe_split(self, split: str) -> str:
        """Where a split's rows come from and what it needs, for the error when it turns out empty."""
        return "none of its source rows is a valid example"

    block_rows: int = DEFAULT_BLOCK_ROWS

    def _info(self) -> tfds.core.DatasetInfo:
        # Widths depend on the data (vocabularies, bag sizes) and are only known once the raw files are read;
        # they are recorded in metadata["spec"].
        return _LocalDatasetInfo(
            builder=self,
            description=self.__doc__,
            features=tfds.features.FeaturesDict({
                "dense": tfds.features.Tensor(shape=(None, None), dtype=np.float32, encoding="bytes"),
                "ids": tfds.features.Tensor(shape=(None, None), dtype=np.int32, encoding="bytes"),
                "lengths": tfds.features.Tensor(shape=(None, None), dtype=np.int32, encoding="bytes"),
                "labels": tfds.features.Tensor(shape=(None,), dtype=np.float32),
            }),
            metadata=tfds.core.MetadataDict(),
            # Keep blocks in generation order: eval reads in file order, and only the last block is short.
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        spec, splits = self._split_blocks(dl_manager.manual_dir)
        self.info.metadata["spec"] = spec_to_json(spec)
        self.info.metadata["block_rows"] = self.block_rows
        self._splits_pending = len(splits)
        return {name: self._generate_examples(blocks, spec, name) for name, blocks in splits.items()}

    def _generate_examples(self, blocks: Iterator[Batch], spec: DatasetSpec, split: str):
        count = 0
        for i, block in enumerate(rebatch(blocks, self.block_rows)):
            count += block.size
            yield i, pack_block(block, spec)
        if count == 0:
            self._finish()
            extra = self._extra_metadata().get("parse_report")
            seen = f" (the data read: {report_summary(extra)})" if extra else ""
            raise DataError(f"{self.name}: split '{split}' has no rows: {self._describe_split(split)}{seen}. Every "
                            "split needs at least one row: provide more data")
        # Each split's generator finishes before info is written, so the latest metadata is recorded.
        self.info.metadata["extra"] = json.loads(json.dumps(self._extra_metadata()))
        self._splits_pending -= 1
        if self._splits_pending == 0:
            self._finish()


def report_summary(report: Mapping) -> str:
    """One line from a ParseReport dict: lines read, rows kept, skipped and blank lines, empty files."""
    text = (f"{report['lines_read']:,} lines read, {report['rows_kept']:,} rows kept, {report['skipped']:,} bad "
            f"lines skipped, {report['blank_lines']:,} blank")
    if report.get("empty_files"):
        text += f"; empty files: {', '.join(report['empty_files'])}"
    if report.get("truncated_files"):
        text += "; truncated: " + ", ".join(f"{t['file']} ({t['reason']})" for t in report["truncated_files"])
    return text


class PreparedDataset:
    """Training/eval reader over a prepared BlockBuilder (TFDS data_source + Grain, no TensorFlow).

    Splits are "train", "validation" and "test"; training streams "train", evaluation reads either of the others.
    """

    def __init__(self, builder: BlockBuilder, *, seed: int, read_threads: int = 2):
        self.builder = builder
        metadata = builder.info.metadata
        self.spec = spec_from_json(metadata["spec"])
        self.block_rows = int(metadata["block_rows"])
        sources = builder.as_data_source()
        missing = [name for name in SPLITS if name not in sources]
        if missing:
            raise ValueError(f"prepared dataset {builder.name} lacks the splits {missing}; it has {sorted(sources)}")
        self.sources = sources
        self.seed = seed
        self.read_threads = read_threads
        self._extra = dict(metadata.get("extra", {}))

    def info(self) -> dict:
        return {"dataset": self.builder.name, "prepared_dir": str(self.builder.data_dir),
                "split_sizes": {split: self.num_examples(split) for split in SPLITS}, **self._extra}

    def report_lines(self) -> list[str]:
        """What the console shows after opening: split sizes and what preparation read, kept and skipped."""
        sizes = ", ".join(f"{split} {self.num_examples(split):,}" for split in SPLITS)
        lines = [f"data: {sizes} examples; prepared in {self.builder.data_dir}"]
        report = self._extra.get("parse_report")
        if report:
            lines.append(f"data: {report_summary(report)}")
            for entry in report["first_skipped"][:MAX_REPORTED_LINES]:
                lines.append(f"data:   skipped {entry['file']}:{entry['line']}: {entry['reason']}")
            if report["skipped"]:
                lines.append("data:   the first skipped lines are listed under parse_report in the run's summary.json "
                             f"and in {pathlib.Path(self.builder.data_dir) / 'dataset_info.json'}")
        if "tabular_stats" in self._extra:
            from recjax.data.tabular import summary_lines

            lines += summary_lines(self._extra["tabular_stats"])
        return lines

    def id_counts(self, examples: int | None = None) -> dict[str, np.ndarray]:
        """{feature: f64[vocab_size]}: each id's occurrences in the train split (every valid slot of a bag), scaled
        to `examples` train examples (None: one epoch) -- the popularity mixed-dimension blocks (`md_blocks`) rank
        ids by. Reads the whole train split once."""
        counts = {f.name: np.zeros(f.vocab_size, np.float64) for f in self.spec.features}
        for batch in self.eval_batches(1 << 16, "train"):
            for f in self.spec.features:
                ids, lengths = batch.ids[f.name], batch.lengths[f.name]
                valid = np.arange(ids.shape[1])[None, :] < lengths[:, None]
                counts[f.name] += np.bincount(ids[valid], minlength=f.vocab_size)
        n = self.num_examples("train")
        scale = 1.0 if examples is None or n == 0 else examples / n
        return {name: scale * c for name, c in counts.items()}

    def num_examples(self, split: str) -> int:
        source = self.sources[split]
        n = len(source)
        return 0 if n == 0 else (n - 1) * self.block_rows + len(source[n - 1]["labels"])

    def _block_sizes(self, split: str) -> np.ndarray:
        """i64[n_blocks]: every block holds `block_rows` rows but the split's last."""
        n = len(self.sources[split])
        sizes = np.full(n, self.block_rows, np.int64)
        if n:
            sizes[-1] = self.num_examples(split) - (n - 1) * self.block_rows
        return sizes

    def _read_rows(self, split: str, order: np.ndarray, first_row: int, wanted, shuffle_rows_seed: list[int] | None
                   ) -> Iterator[Batch]:
        """The rows `wanted(position i64[k]) -> bool[k]` of the blocks in `order`, whose rows (shuffled within a
        block with `shuffle_rows_seed`) sit back to back from stream position `first_row`. Blocks without a wanted
        row are never read, so a multi-host process decodes only blocks holding its rows."""
        source, spec = self.sources[split], self.spec
        sizes = self._block_sizes(split)[order]
        starts = first_row + np.cumsum(sizes) - sizes

        def read(k):
            keep = np.flatnonzero(wanted(starts[k] + np.arange(sizes[k])))
            if keep.size == 0:
                return None
            i = int(order[k])
            block = unpack_block(source[i], spec)
            if shuffle_rows_seed is not None:
                keep = np.random.default_rng(shuffle_rows_seed + [i]).permutation(block.size)[keep]
            return block if keep.size == block.size and shuffle_rows_seed is None else take(block, keep)

        dataset = grain.MapDataset.source(list(range(len(order)))).map(read)
        options = grain.ReadOptions(num_threads=self.read_threads, prefetch_buffer_size=4)
        yield from (block for block in dataset.to_iter_dataset(options) if block is not None)

    def train_batches(self, batch_size: int, start_step: int = 0, rows: slice | None = None) -> Iterator[Batch]:
        """Endless stream: each epoch visits blocks in a seeded random order and shuffles rows within blocks.
        Epochs follow each other without a gap, so `steps * batch_size` rows are `steps * batch_size /
        num_examples("train")` epochs exactly. With `rows` (multi-host: this process's share), only those rows of
        each batch -- step i's batch is the same whatever the number of processes, each reads its disjoint part."""
        rows = check_rows(rows, batch_size)
        source = self.sources["train"]
        n_blocks = len(source)
        if n_blocks == 0:
            raise DataError(f"the train split of {self.builder.name} is empty")
        rows_per_epoch = self.num_examples("train")
        skip = start_step * batch_size

        def wanted(position):
            within = position % batch_size
            return (position >= skip) & (within >= rows.start) & (within < rows.stop)

        def blocks():
            epoch = skip // rows_per_epoch
            while True:
                order = np.random.default_rng([self.seed, epoch]).permutation(n_blocks)
                yield from self._read_rows("train", order, epoch * rows_per_epoch, wanted, [self.seed, epoch])
                epoch += 1

        return rebatch(blocks(), rows.stop - rows.start)

    def eval_batches(self, batch_size: int, split: str, rows: slice | None = None) -> Iterator[Batch]:
        """`split` in file order, in batches of `batch_size` (the last one may be shorter); with `rows`, only those
        rows of each batch (one batch per global batch, possibly empty)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split '{split}'; use one of {SPLITS}")
        order = np.arange(len(self.sources[split]))
        if rows is None:
            return rebatch(self._read_rows(split, order, 0, lambda p: np.ones(p.shape, bool), None), batch_size)
        rows = check_rows(rows, batch_size)
        within = lambda p: (p % batch_size >= rows.start) & (p % batch_size < rows.stop)  # noqa: E731
        shares = eval_shares(self.num_examples(split), batch_size, rows)
        return cut(self._read_rows(split, order, 0, within, None), shares, self.spec)
