"""Block-based TFDS preparation and the Grain reader: round trip, order, resume, no TensorFlow."""

import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import random_batch

from recjax.data.arrays import concatenate
from recjax.data.prepared import BlockBuilder, PreparedDataset, blocks_of, rebatch
from recjax.errors import DataError
from recjax.specs import DatasetSpec, FeatureSpec

SPEC = DatasetSpec(num_dense=2, features=(FeatureSpec("u", 50), FeatureSpec("g", 9, bag_size=3)))
ROWS = {"train": 1000, "validation": 70, "test": 130}


def source_rows(split: str):
    return random_batch(SPEC, ROWS[split], seed=list(ROWS).index(split))


class ToyBlocks(BlockBuilder, skip_registration=True):
    """A toy dataset for tests."""

    MANUAL_DOWNLOAD_INSTRUCTIONS = "Put toy.txt in the manual dir."
    block_rows = 128

    def _split_blocks(self, manual_dir):
        if not (manual_dir / "toy.txt").exists():
            raise FileNotFoundError(f"toy.txt not in {manual_dir}")
        return SPEC, {split: self._odd_blocks(split) for split in ROWS}

    def _odd_blocks(self, split):
        # Deliberately odd source block sizes: the builder re-cuts them.
        return blocks_of(source_rows(split), 77)

    def _extra_metadata(self):
        return {"note": "hello", "rows": dict(ROWS)}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    manual = tmp_path_factory.mktemp("manual")
    (manual / "toy.txt").write_text("x")
    builder = ToyBlocks(data_dir=str(tmp_path_factory.mktemp("tfds")), file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=str(manual)))
    return builder


def test_round_trip_in_order_and_metadata(prepared):
    ds = PreparedDataset(prepared, seed=0)
    assert ds.spec == SPEC
    assert {split: ds.num_examples(split) for split in ROWS} == ROWS
    got = concatenate(list(ds.eval_batches(50, "test")))
    want = source_rows("test")
    np.testing.assert_array_equal(got.ids["g"], want.ids["g"])
    np.testing.assert_array_equal(got.lengths["g"], want.lengths["g"])
    np.testing.assert_array_equal(got.dense, want.dense)
    assert [b.size for b in ds.eval_batches(50, "test")] == [50, 50, 30]
    assert ds.info()["note"] == "hello"
    assert "tensorflow" not in sys.modules


def test_train_stream_is_a_seeded_permutation_per_epoch_and_resumable(prepared):
    ds = PreparedDataset(prepared, seed=3)
    stream = ds.train_batches(100)
    epoch = concatenate([next(stream) for _ in range(10)])
    # One epoch is a permutation of the train split.
    want = source_rows("train")
    key = lambda b: np.sort(b.dense[:, 0])  # noqa: E731
    np.testing.assert_array_equal(key(epoch), key(want))
    assert not np.array_equal(epoch.dense[:, 0], want.dense[:, 0])
    second = concatenate([next(stream) for _ in range(10)])
    assert not np.array_equal(second.dense[:, 0], epoch.dense[:, 0])  # reshuffled each epoch
    # Resume at step 13 reproduces step 13 of the uninterrupted stream.
    again = ds.train_batches(100)
    batches = [next(again) for _ in range(14)]
    resumed = next(ds.train_batches(100, start_step=13))
    np.testing.assert_array_equal(resumed.dense, batches[13].dense)
    other_seed = next(PreparedDataset(prepared, seed=4).train_batches(100))
    assert not np.array_equal(other_seed.dense, batches[0].dense)


def test_rebatch_exact_sizes():
    blocks = [random_batch(SPEC, n, seed=n) for n in (5, 17, 3, 40)]
    out = list(rebatch(iter(blocks), 16))
    assert [b.size for b in out] == [16, 16, 16, 16, 1]
    np.testing.assert_array_equal(concatenate(out).dense, concatenate(blocks).dense)


def test_missing_manual_files_say_where(tmp_path):
    builder = ToyBlocks(data_dir=str(tmp_path / "tfds"), file_format="array_record")
    with pytest.raises(Exception, match="toy.txt"):
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=str(tmp_path / "none")))


def test_a_split_without_rows_is_a_clear_error(tmp_path):
    class NoValidation(ToyBlocks, skip_registration=True):
        def _odd_blocks(self, split):
            return iter([]) if split == "validation" else super()._odd_blocks(split)

    manual = tmp_path / "manual"
    manual.mkdir()
    (manual / "toy.txt").write_text("x")
    builder = NoValidation(data_dir=str(tmp_path / "tfds"), file_format="array_record")
    with pytest.raises(DataError, match=r"split 'validation' has no rows.*Every split needs at least one row"):
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=str(manual)))


def test_unknown_split(prepared):
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        next(PreparedDataset(prepared, seed=0).eval_batches(10, "dev"))


def test_process_shares_are_disjoint_and_make_the_global_batches(prepared):
    """Multi-host: process i reads rows [i B/n, (i+1) B/n) of every global batch and nothing else; their shares,
    side by side, are the single-process batches (train from a resumed step across epochs, and eval with a short
    last batch, where a process's share may be empty)."""
    ds = PreparedDataset(prepared, seed=5)
    shares = [slice(0, 25), slice(25, 50), slice(50, 75), slice(75, 100)]
    whole = ds.train_batches(100, start_step=7)
    parts = [ds.train_batches(100, start_step=7, rows=r) for r in shares]
    for _ in range(6):  # steps 7..12 cross the first epoch's end (1000 rows)
        batch, local = next(whole), [next(p) for p in parts]
        assert [b.size for b in local] == [25] * 4
        np.testing.assert_array_equal(concatenate(local).dense, batch.dense)
        np.testing.assert_array_equal(concatenate(local).ids["g"], batch.ids["g"])
    for split in ("validation", "test"):  # 70 and 130 rows in batches of 100
        whole = list(ds.eval_batches(100, split))
        local = [list(ds.eval_batches(100, split, rows=r)) for r in shares]
        assert all(len(b) == len(whole) for b in local)
        for i, batch in enumerate(whole):
            np.testing.assert_array_equal(concatenate([b[i] for b in local]).labels, batch.labels)
    assert [[b.size for b in ds.eval_batches(100, "test", rows=r)] for r in shares] == [[25, 25], [25, 5], [25, 0],
                                                                                         [25, 0]]
