r"""Raw keys of categorical values and their vocabularies (shared by the Criteo and tabular parsers).

A *raw key* is a non-negative int64 naming one value of one feature: Criteo's 32-bit hex hashes (33 bits with its
missing category), the tabular parser's 63-bit hashes of a value's bytes (`string_keys`), libSVM indices.
A *vocabulary* maps raw keys to the ids a model embeds:

    frequency   fitted on the train split: keys seen >= threshold times get ids 1..K in descending train count
                (ties: ascending key); id 0 is out-of-vocabulary (rare in train, or unseen). Frequency order puts
                the hot rows first, which frequency-aware compression methods use.
    hash        id = key % buckets.

Counting is streaming (`KeyCounter`); `distinct_inverse` and `lookup` are what mapping a block of keys is made of.
Sorting is the cost of all of these. When keys are narrow enough, a key and a small second number are packed into
one int64 and sorted with numpy's vectorised `np.sort` (several times faster than `argsort`); 63-bit keys leave no
room, so the same functions fall back to `argsort` (callers say how wide their keys are with `key_bits`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

KEY_BITS = 63  # string keys are 63-bit hashes: non-negative int64
KEY_MASK = (1 << KEY_BITS) - 1

# splitmix64 (Steele, Lea, Flood 2014): the golden-ratio increment and the finaliser's multipliers.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_LOW_BYTES = np.array([(1 << (8 * k)) - 1 for k in range(9)], np.uint64)  # [k]: the k low bytes set


# ----------------------------------------------------------------------------------------------------------------------
# String keys: a stable 63-bit hash of a value's bytes, vectorised
# ----------------------------------------------------------------------------------------------------------------------


def mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on u64[...] (a bijection with full avalanche); wraps modulo 2**64."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    return x ^ (x >> np.uint64(31))


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's output for state u64[...]: the golden-ratio increment, then `mix64`; wraps modulo 2**64. The
    synthetic teacher's per-id weights and the tabular random split draw from it (one definition: the same seed gives
    the same numbers wherever it is used)."""
    return mix64(x + _GOLDEN)


def string_keys(offsets: np.ndarray, data: np.ndarray) -> np.ndarray:
    """The raw keys of n byte strings, value i = data[offsets[i]:offsets[i+1]] -> i64[n] in [0, 2**63).

        h = mix64(0x9E3779B97F4A7C15 + len)              (mod 2**64: the length is mixed in, so "a" != "a\0")
        for each 8-byte word w of the value, little-endian, the last one padded with zero bytes:
            h = mix64(h ^ w)
        key = h & (2**63 - 1)

    The same bytes give the same key in every chunk, file, run and machine (no seed, no process state). Computed
    a word position at a time over all values (a Python loop over word positions, never over values): 8-byte
    windows are read as unaligned uint64 through a byte-strided view.

    offsets: i64[n + 1] ascending; data: u8[m].
    """
    offsets = np.asarray(offsets, np.int64)
    n = offsets.size - 1
    if n <= 0:
        return np.zeros(0, np.int64)
    base, end = int(offsets[0]), int(offsets[-1])
    padded = np.zeros(end - base + 8, np.uint8)  # 8 zero bytes after the last value: every window is in bounds
    padded[:end - base] = data[base:end]
    words = np.ndarray((padded.size - 7,), np.uint64, buffer=padded, strides=(1,))
    start, length = offsets[:-1] - base, np.diff(offsets)
    h = splitmix64(length.astype(np.uint64))
    last = words.size - 1
    k = 0
    while True:
        rest = length - 8 * k  # bytes from the k-th word on
        active = rest > 0
        count = int(np.count_nonzero(active))
        if count == 0:
            break
        if 2 * count >= n:  # most values have a k-th word: whole-array operations, the others keep their h
            word = words[np.minimum(start + 8 * k, last)] & _LOW_BYTES[np.clip(rest, 0, 8)]
            h = np.where(active, mix64(h ^ word), h)
        else:  # few long values: work on those only
            rows = np.flatnonzero(active)
            word = words[start[rows] + 8 * k] & _LOW_BYTES[np.minimum(rest[rows], 8)]
            h[rows] = mix64(h[rows] ^ word)
        k += 1
    return (h & np.uint64(KEY_MASK)).view(np.int64)


def string_key(value: bytes | str) -> int:
    """The raw key of one value (`string_keys` of a single string); str is encoded as UTF-8."""
    data = value.encode() if isinstance(value, str) else bytes(value)
    return int(string_keys(np.array([0, len(data)]), np.frombuffer(data, np.uint8))[0])


# ----------------------------------------------------------------------------------------------------------------------
# Counting
# ----------------------------------------------------------------------------------------------------------------------


def sum_by_key(keys: np.ndarray, counts: np.ndarray, key_bits: int = KEY_BITS) -> tuple[np.ndarray, np.ndarray]:
    """(keys i64[m], counts i64[m]) with repeats -> (sorted unique keys, summed counts).

    key_bits: keys are < 2**key_bits; with key_bits <= 33 and counts < 2**30, (key, count) pairs are packed into one
    int64 and sorted with np.sort (no argsort).
    """
    if keys.size and key_bits + 30 <= 63 and counts.max() < 2**30:
        packed = np.sort((keys << 30) | counts)
        keys, counts = packed >> 30, packed & (2**30 - 1)
    else:
        order = np.argsort(keys)  # any order of equal keys gives the same sums
        keys, counts = keys[order], counts[order]
    first = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]])) if keys.size else keys
    return keys[first], np.add.reduceat(counts, first) if keys.size else counts


class KeyCounter:
    """Occurrences of each raw key of one feature, fed chunk by chunk (keys may repeat within and across chunks).

    Chunk counts are buffered and summed into the running total (one sort) once the buffer holds as many keys as
    the total (at least `min_buffer`): memory stays within ~3x the distinct keys and each buffered key is sorted
    about once -- measured cheaper than merging every chunk into the total (a log-structured merge;
    benchmarks/RESULTS.md#data-criteo-preprocessing).
    """

    def __init__(self, min_buffer: int = 1 << 20, key_bits: int = KEY_BITS):
        self.keys, self.counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
        self.buffer: list[tuple[np.ndarray, np.ndarray]] = []
        self.buffered = 0
        self.min_buffer = min_buffer
        self.key_bits = key_bits

    def add(self, keys: np.ndarray, counts: np.ndarray) -> None:
        self.buffer.append((keys, counts))
        self.buffered += keys.size
        if self.buffered >= max(self.keys.size, self.min_buffer):
            self._flush()

    def _flush(self) -> None:
        if self.buffer:
            self.keys, self.counts = sum_by_key(np.concatenate([self.keys] + [k for k, _ in self.buffer]),
                                                np.concatenate([self.counts] + [c for _, c in self.buffer]),
                                                self.key_bits)
            self.buffer, self.buffered = [], 0

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys i64[V] ascending, counts i64[V])."""
        self._flush()
        return self.keys, self.counts


def distinct_inverse(column: np.ndarray, key_bits: int = KEY_BITS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """i64[n] -> (ascending distinct values i64[u], their counts i64[u], inverse i64[n]: column = distinct[inverse]).

    With key_bits + bits(n) <= 63, one sort of (value << row_bits | row) words -- numpy's vectorised sort --
    instead of np.unique's argsort.
    """
    n = column.size
    if n == 0:
        return column, np.zeros(0, np.int64), np.zeros(0, np.int64)
    row_bits = max(int(n - 1).bit_length(), 1)
    if key_bits + row_bits <= 63:
        packed = np.sort((column << row_bits) | np.arange(n, dtype=np.int64))
        values, order = packed >> row_bits, packed & ((1 << row_bits) - 1)
    else:
        order = np.argsort(column)
        values = column[order]
    new = np.empty(n, bool)
    new[0], new[1:] = True, values[1:] != values[:-1]
    first = np.flatnonzero(new)
    inverse = np.empty(n, np.int64)
    inverse[order] = np.cumsum(new) - 1
    return values[first], np.diff(first, append=n), inverse


# ----------------------------------------------------------------------------------------------------------------------
# Vocabularies
# ----------------------------------------------------------------------------------------------------------------------


def frequency_vocabulary(raw_keys: np.ndarray, raw_counts: np.ndarray, threshold: int
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Train counts of one feature -> (kept keys i64[K] ascending, their ids i32[K] in 1..K, index_counts i64[K+1]).

    raw_keys: i64[V] ascending distinct keys seen in train; raw_counts: i64[V] their counts. Keys seen >= threshold
    times get ids 1..K in descending count, ties by ascending key; index_counts[0] sums the counts of the others
    (out of vocabulary), index_counts[i] is the train count of id i.
    """
    kept = raw_counts >= threshold
    kept_keys, kept_counts = raw_keys[kept], raw_counts[kept]
    order = np.lexsort((kept_keys, -kept_counts))  # descending count, then ascending key
    ids = np.empty(kept_keys.size, np.int32)
    ids[order] = np.arange(1, kept_keys.size + 1, dtype=np.int32)
    index_counts = np.concatenate([[raw_counts[~kept].sum()], kept_counts[order]]).astype(np.int64)
    return kept_keys, ids, index_counts


def hash_index_counts(raw_keys: np.ndarray, raw_counts: np.ndarray, buckets: int) -> np.ndarray:
    """Train occurrences per id i64[buckets] of the hash vocabulary id = key % buckets."""
    return np.bincount(raw_keys % buckets, weights=raw_counts, minlength=buckets).astype(np.int64)


def lookup(keys: np.ndarray, ids: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Frequency-vocabulary ids i32[u] of raw keys `queries` i64[u] (0 = out of vocabulary).

    keys: i64[K] ascending, ids: i32[K] (from `frequency_vocabulary`). Ascending queries walk `keys` monotonically,
    which is why callers look up distinct keys in ascending order where they can.
    """
    if keys.size == 0:
        return np.zeros(queries.size, np.int32)
    pos = np.minimum(np.searchsorted(keys, queries), keys.size - 1)
    return np.where(keys[pos] == queries, ids[pos], 0).astype(np.int32)


def frequency_histogram(raw_counts: np.ndarray) -> dict[str, Any]:
    """Raw keys bucketed by floor(log2(train count)): bucket b holds keys seen [2^b, 2^(b+1)) times; per bucket
    its lower bound `min_count`, the number of `keys` and their `occurrences` (JSON-able lists)."""
    bucket = np.floor(np.log2(raw_counts)).astype(np.int64) if raw_counts.size else raw_counts.astype(np.int64)
    keys_per_bucket = np.bincount(bucket)
    occurrences_per_bucket = np.bincount(bucket, weights=raw_counts).astype(np.int64)
    return {"min_count": [2**b for b in range(keys_per_bucket.size)], "keys": keys_per_bucket.tolist(),
            "occurrences": occurrences_per_bucket.tolist()}


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays
class VocabularyStats:
    """summary: JSON-able per-feature statistics; index_counts: {feature: i64[vocab_size]} train occurrences per id
    (what frequency-aware compression methods and the sharding planner read)."""

    summary: dict[str, Any]
    index_counts: dict[str, np.ndarray]

    def save(self, directory: str | pathlib.Path) -> None:
        """Write stats.json and index_counts.npz into `directory`."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "stats.json").write_text(json.dumps(self.summary, indent=1))
        np.savez_compressed(directory / "index_counts.npz", **self.index_counts)


def count_column_keys(columns: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per column i64[n] (sorted unique keys i64[u], counts i64[u])."""
    out = []
    for column in columns:
        keys, counts = np.unique(column, return_counts=True)
        out.append((keys, counts.astype(np.int64)))
    return out


__all__ = [
    "KEY_BITS", "KEY_MASK", "KeyCounter", "VocabularyStats", "count_column_keys", "distinct_inverse",
    "frequency_histogram", "frequency_vocabulary", "hash_index_counts", "lookup", "mix64", "splitmix64", "string_key",
    "string_keys",
    "sum_by_key",
]
