"""An in-memory dataset: named splits held as numpy `Batch`es (MovieLens-sized data, prepared blocks, tests)."""

from collections.abc import Iterator, Mapping

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


class ArrayDataset:
    """Splits in memory. Training reshuffles each epoch from (seed, epoch); batch i is reproducible."""

    def __init__(self, spec: DatasetSpec, splits: Mapping[str, Batch], *, train_split: str = "train",
                 eval_split: str = "test", seed: int = 0, info: Mapping | None = None):
        for name in (train_split, eval_split):
            if name not in splits:
                raise ValueError(f"split '{name}' not found; the dataset has {sorted(splits)}")
        self.spec = spec
        self.splits = dict(splits)
        self.train_split, self.eval_split = train_split, eval_split
        self.seed = seed
        self._info = dict(info or {})

    def info(self) -> dict:
        return dict(self._info)

    def train_batches(self, batch_size: int, start_step: int = 0) -> Iterator[Batch]:
        """Endless shuffled stream of full batches; an epoch's tail that does not fill a batch is dropped."""
        data = self.splits[self.train_split]
        per_epoch = data.size // batch_size
        if per_epoch == 0:
            raise ValueError(f"train split has {data.size} examples, fewer than one batch of {batch_size}")
        step, order_epoch, order = start_step, None, None
        while True:
            epoch, i = divmod(step, per_epoch)
            if epoch != order_epoch:
                order_epoch, order = epoch, np.random.default_rng([self.seed, epoch]).permutation(data.size)
            yield take(data, order[i * batch_size:(i + 1) * batch_size])
            step += 1

    def eval_batches(self, batch_size: int, split: str | None = None) -> Iterator[Batch]:
        data = self.splits[split or self.eval_split]
        for start in range(0, data.size, batch_size):
            yield take(data, slice(start, start + batch_size))
