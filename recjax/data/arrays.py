"""An in-memory dataset: named splits held as numpy `Batch`es (MovieLens-sized data, prepared blocks, tests)."""

from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from recjax.batch import Batch
from recjax.specs import DatasetSpec


def take(batch: Batch, index: np.ndarray | slice) -> Batch:
    """Rows `index` of every array of a batch."""
    return Batch(dense=batch.dense[index], ids={k: v[index] for k, v in batch.ids.items()},
                 lengths={k: v[index] for k, v in batch.lengths.items()}, labels=batch.labels[index])


def concatenate(batches: list[Batch]) -> Batch:
    return Batch(dense=np.concatenate([b.dense for b in batches]),
                 ids={k: np.concatenate([b.ids[k] for b in batches]) for k in batches[0].ids},
                 lengths={k: np.concatenate([b.lengths[k] for b in batches]) for k in batches[0].lengths},
                 labels=np.concatenate([b.labels for b in batches]))


def empty_batch(spec: DatasetSpec) -> Batch:
    """A batch of 0 rows (a process's share of a short last eval batch may be empty)."""
    return Batch(dense=np.zeros((0, spec.num_dense), np.float32),
                 ids={f.name: np.zeros((0, f.bag_size), np.int32) for f in spec.features},
                 lengths={f.name: np.zeros(0, np.int32) for f in spec.features}, labels=np.zeros(0, np.float32))


def check_rows(rows: slice | None, batch_size: int) -> slice:
    """`rows` of every global batch of `batch_size` a reader yields (multi-host: this process's devices' rows);
    None = all of them."""
    if rows is None:
        return slice(0, batch_size)
    if not (rows.step in (None, 1) and 0 <= rows.start < rows.stop <= batch_size):
        raise ValueError(f"rows {rows} must be a non-empty [start, stop) within a batch of {batch_size}")
    return rows


def eval_shares(examples: int, batch_size: int, rows: slice) -> list[int]:
    """How many rows of each global eval batch (ceil(examples / batch_size) of them; the last may be short) fall in
    `rows`: a process yields one batch per global batch, possibly empty, so every process runs as many steps."""
    sizes = [min(batch_size, examples - start) for start in range(0, examples, batch_size)]
    return [max(0, min(rows.stop, size) - rows.start) for size in sizes]


def cut(blocks: Iterable[Batch], sizes: Iterable[int], spec: DatasetSpec) -> Iterator[Batch]:
    """Cut a stream of blocks into consecutive batches of the given sizes (0 gives an empty batch)."""
    blocks = iter(blocks)
    pending, have = [], 0
    for size in sizes:
        while have < size:
            block = next(blocks)
            pending.append(block)
            have += block.size
        merged = concatenate(pending) if len(pending) > 1 else (pending[0] if pending else empty_batch(spec))
        yield take(merged, slice(0, size))
        rest = take(merged, slice(size, None))
        pending, have = ([rest] if rest.size else []), rest.size


def rebatch(blocks: Iterable[Batch], batch_size: int, skip_rows: int = 0) -> Iterator[Batch]:
    """Cut a stream of blocks into batches of exactly `batch_size` rows (the final remainder is yielded short)."""
    pending: list[Batch] = []
    have = 0
    for block in blocks:
        if skip_rows:
            drop = min(skip_rows, block.size)
            skip_rows -= drop
            block = take(block, slice(drop, None))
        pending.append(block)
        have += block.size
        while have >= batch_size:
            merged = concatenate(pending) if len(pending) > 1 else pending[0]
            yield take(merged, slice(0, batch_size))
            rest = take(merged, slice(batch_size, None))
            pending, have = ([rest] if rest.size else []), rest.size
    if have:
        yield concatenate(pending)


class ArrayDataset:
    """Splits in memory ("train", "validation", "test"). Training walks seeded per-epoch permutations of train
    back to back (a batch may span two epochs), so batch i is a pure function of (seed, i) and `steps *
    batch_size` rows are exactly that many rows' worth of epochs, as for prepared data."""

    def __init__(self, spec: DatasetSpec, splits: Mapping[str, Batch], *, seed: int = 0, info: Mapping | None = None):
        if "train" not in splits:
            raise ValueError(f"an ArrayDataset needs a 'train' split; got {sorted(splits)}")
        self.spec = spec
        self.splits = dict(splits)
        self.seed = seed
        self._info = dict(info or {})

    def info(self) -> dict:
        return {"split_sizes": {name: batch.size for name, batch in self.splits.items()}, **self._info}

    def num_examples(self, split: str) -> int:
        return self.splits[split].size

    def id_counts(self, examples: int | None = None) -> dict[str, np.ndarray]:
        """{feature: f64[vocab_size]}: how often each id occurs in the train split (every valid slot of a bag),
        scaled to `examples` train examples (a run's steps x batch size; None: one epoch) -- the popularity that
        mixed-dimension blocks (`md_blocks`, config.embedding.id_counts = "dataset") rank ids by."""
        data = self.splits["train"]
        scale = 1.0 if examples is None or data.size == 0 else examples / data.size
        counts = {}
        for feature in self.spec.features:
            ids, lengths = data.ids[feature.name], data.lengths[feature.name]
            valid = np.arange(ids.shape[1])[None, :] < lengths[:, None]
            counts[feature.name] = scale * np.bincount(ids[valid], minlength=feature.vocab_size).astype(np.float64)
        return counts

    def train_batches(self, batch_size: int, start_step: int = 0, rows: slice | None = None) -> Iterator[Batch]:
        """Endless shuffled stream of full batches (only `rows` of each: multi-host, this process's share)."""
        rows = check_rows(rows, batch_size)
        data = self.splits["train"]
        n = data.size
        if n == 0:
            raise ValueError("the train split is empty")
        row = start_step * batch_size  # position in the endless sequence of epoch permutations
        orders: dict[int, np.ndarray] = {}
        while True:
            index = np.empty(batch_size, np.int64)
            filled = 0
            while filled < batch_size:
                epoch, offset = divmod(row, n)
                if epoch not in orders:
                    orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(n)}
                part = orders[epoch][offset:offset + batch_size - filled]
                index[filled:filled + part.size] = part
                filled += part.size
                row += part.size
            yield take(data, index[rows])

    def eval_batches(self, batch_size: int, split: str, rows: slice | None = None) -> Iterator[Batch]:
        data = self.splits[split]
        rows = check_rows(rows, batch_size)
        for start in range(0, data.size, batch_size):
            yield take(data, slice(min(start + rows.start, data.size), min(start + rows.stop, data.size)))
