"""The fixed-shape batch and its host-side validation.

    dense:   f32[B, num_dense]     already transformed (e.g. log(1 + x) for Criteo counts)
    ids:     {feature: i32[B, L_f]} padded bags; slots at or beyond `lengths` are ignored
    lengths: {feature: i32[B]}     valid ids per example, 0..L_f
    labels:  f32[B]                in {0, 1} (spec.target "binary"), or any finite value ("regression": ratings)

Validation runs on the host before anything reaches the device, because JAX clamps out-of-range gathers
silently: an id outside [0, vocab_size) would otherwise train some other row without a word.
"""

import dataclasses
import functools
from collections.abc import Mapping

import flax.struct
import numpy as np

from recjax.specs import DatasetSpec


@flax.struct.dataclass
class Batch:
    dense: np.ndarray
    ids: Mapping[str, np.ndarray]
    lengths: Mapping[str, np.ndarray]
    labels: np.ndarray

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])


def validate_batch(batch: Batch, spec: DatasetSpec, *, any_id: frozenset[str] = frozenset(),
                   where: str = "batch") -> None:
    """Raise ValueError naming the feature and the offending value if `batch` does not fit `spec`.

    Vectorised over features: every feature's ids of one bag size are checked as one [B, sum L] array (one-hot
    Criteo: one comparison for all 26), so the cost is a few numpy calls whatever the feature count; only a failing
    check looks for the first offender, to name it.

    Args:
      any_id: features whose embedding method accepts ids outside [0, vocab_size) (e.g. hashing).
      where: a description of the batch's origin for the message (file, line range, step).
    """
    b = batch.labels.shape[0]
    if batch.labels.shape != (b,):
        raise ValueError(f"{where}: labels must be f32[B], got shape {batch.labels.shape}")
    if batch.dense.shape != (b, spec.num_dense):
        raise ValueError(f"{where}: dense must be f32[{b}, {spec.num_dense}], got shape {batch.dense.shape}")
    if not np.isfinite(batch.dense).all():
        row, col = np.argwhere(~np.isfinite(batch.dense))[0]
        raise ValueError(
            f"{where}: dense feature {col} of example {row} is {batch.dense[row, col]}; "
            "dense features must be finite (impute missing values and log-transform counts before training)"
        )
    if spec.target == "regression":
        bad_labels = ~np.isfinite(batch.labels)
        rule = "regression labels must be finite"
    else:
        bad_labels = ~np.isin(batch.labels, (0.0, 1.0))
        rule = "labels must be 0 or 1"
    if np.any(bad_labels):
        row = int(np.argmax(bad_labels))
        raise ValueError(f"{where}: label of example {row} is {batch.labels[row]}; {rule}")
    if set(batch.ids) != set(spec.feature_names) or set(batch.lengths) != set(spec.feature_names):
        raise ValueError(
            f"{where}: sparse features {sorted(batch.ids)} do not match the dataset's {list(spec.feature_names)}"
        )
    for feature in spec.features:  # shapes and dtypes: attributes only
        ids, lengths = batch.ids[feature.name], batch.lengths[feature.name]
        if ids.shape != (b, feature.bag_size):
            raise ValueError(
                f"{where}: feature '{feature.name}': ids must be i32[{b}, {feature.bag_size}], got {ids.shape}"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{where}: feature '{feature.name}': ids must be integers, got {ids.dtype}")
        if lengths.shape != (b,):
            _bad_lengths(where, feature, lengths, b)
    if not spec.features:
        return
    groups = _id_groups(spec, frozenset(any_id))
    lengths = np.stack([batch.lengths[f.name] for f in spec.features], axis=1)  # [B, F]
    if (lengths < 0).any() or (lengths > groups.bags[None, :]).any():
        bad = np.flatnonzero(((lengths < 0) | (lengths > groups.bags[None, :])).any(axis=0))[0]
        _bad_lengths(where, spec.features[bad], lengths[:, bad], b)
    for group in groups.checked:
        ids = np.concatenate([batch.ids[spec.features[f].name] for f in group.features], axis=1)  # [B, sum L]
        valid = group.slot[None, :] < lengths[:, group.feature_of_column]
        bad = valid & ((ids < 0) | (ids >= group.vocab[None, :]))
        if bad.any():
            row, column = np.argwhere(bad)[0]
            feature = spec.features[group.feature_of_column[column]]
            raise ValueError(
                f"{where}: feature '{feature.name}': id {ids[row, column]} (example {row}, slot "
                f"{group.slot[column]}) is outside [0, {feature.vocab_size}); enable hashing for this feature or raise "
                "its vocab_size"
            )


def _bad_lengths(where: str, feature, lengths: np.ndarray, b: int) -> None:
    raise ValueError(
        f"{where}: feature '{feature.name}': lengths must be i32[{b}] in [0, {feature.bag_size}], "
        f"got shape {lengths.shape}, range [{lengths.min()}, {lengths.max()}]"
    )


@dataclasses.dataclass(frozen=True)
class _IdGroup:
    """Features whose ids are checked together: their columns side by side, each column's feature (its index in the
    spec), slot within its bag and vocabulary size."""

    features: tuple[int, ...]
    feature_of_column: np.ndarray
    slot: np.ndarray
    vocab: np.ndarray


@dataclasses.dataclass(frozen=True)
class _IdGroups:
    bags: np.ndarray  # i64[F]: each feature's bag size
    checked: tuple[_IdGroup, ...]  # by bag size, the features whose ids must be in [0, vocab)


@functools.lru_cache(maxsize=64)
def _id_groups(spec: DatasetSpec, any_id: frozenset[str]) -> _IdGroups:
    checked = []
    by_bag: dict[int, list[int]] = {}
    for i, feature in enumerate(spec.features):
        if feature.name not in any_id:
            by_bag.setdefault(feature.bag_size, []).append(i)
    for bag, members in sorted(by_bag.items()):
        checked.append(_IdGroup(
            features=tuple(members),
            feature_of_column=np.repeat(np.asarray(members), bag),
            slot=np.tile(np.arange(bag), len(members)),
            vocab=np.repeat(np.asarray([spec.features[i].vocab_size for i in members], np.int64), bag)))
    return _IdGroups(np.asarray([f.bag_size for f in spec.features], np.int64), tuple(checked))


def pad_batch(batch: Batch, size: int) -> Batch:
    """Pad a short batch to `size` examples (zeros; empty bags) so one compiled step serves it."""
    n = batch.size
    if n == size:
        return batch
    if n > size:
        raise ValueError(f"batch of {n} examples does not fit the compiled batch size {size}")

    def pad(x):
        return np.concatenate([x, np.zeros((size - n,) + x.shape[1:], x.dtype)])

    return Batch(
        dense=pad(batch.dense),
        ids={k: pad(v) for k, v in batch.ids.items()},
        lengths={k: pad(v) for k, v in batch.lengths.items()},
        labels=pad(batch.labels),
    )
