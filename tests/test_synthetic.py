"""The synthetic generator: deterministic, valid, power-law ids, a learnable teacher."""

import numpy as np
import pytest

from recjax import metrics
from recjax.batch import validate_batch
from recjax.data.synthetic import SyntheticDataset, _zipf_ranks


def small(seed=0, **kw):
    args = dict(vocab_sizes=(50, 1000, 3), num_dense=4, eval_examples=5000, seed=seed)
    args.update(kw)
    return SyntheticDataset(**args)


def test_same_seed_same_data_and_different_seed_differs():
    a, b, c = small(0), small(0), small(1)
    ba, bb, bc = next(a.train_batches(64)), next(b.train_batches(64)), next(c.train_batches(64))
    for k in ba.ids:
        np.testing.assert_array_equal(ba.ids[k], bb.ids[k])
    np.testing.assert_array_equal(ba.labels, bb.labels)
    np.testing.assert_array_equal(ba.dense, bb.dense)
    assert not np.array_equal(ba.ids["C2"], bc.ids["C2"])
    assert a.bayes_auc == b.bayes_auc


def test_resume_by_step_and_eval_independent_of_batch_size():
    ds = small()
    stream = ds.train_batches(32)
    third = [next(stream) for _ in range(3)][2]
    resumed = next(ds.train_batches(32, start_step=2))
    np.testing.assert_array_equal(third.ids["C2"], resumed.ids["C2"])
    e1 = np.concatenate([b.labels for b in ds.eval_batches(1000)])
    e2 = np.concatenate([b.labels for b in ds.eval_batches(333)])
    np.testing.assert_array_equal(e1, e2)
    assert e1.size == 5000


def test_batches_are_valid_and_multi_hot_lengths_in_range():
    ds = small(bag_sizes=(1, 5, 2))
    for batch in [next(ds.train_batches(256))] + list(ds.eval_batches(2048)):
        validate_batch(batch, ds.spec)
    lengths = next(ds.train_batches(4096)).lengths["C2"]
    assert lengths.min() == 1 and lengths.max() == 5
    assert set(np.unique(lengths)) == {1, 2, 3, 4, 5}


def test_zipf_rank_frequencies_follow_the_power_law():
    rng = np.random.default_rng(0)
    s, vocab = 1.2, 100_000
    ranks = _zipf_ranks(rng.random(2_000_000), np.int64(vocab), s)
    assert ranks.min() >= 0 and ranks.max() < vocab
    # Mass of [r, r+1) under the continuous density ~x^-s on [1, V+1).
    norm = ((vocab + 1) ** (1 - s) - 1) / (1 - s)
    for r in (0, 1, 9, 99):
        expected = ((r + 2) ** (1 - s) - (r + 1) ** (1 - s)) / (1 - s) / norm
        observed = np.mean(ranks == r)
        assert observed == pytest.approx(expected, rel=0.05), r


def test_ids_are_permuted_not_frequency_sorted():
    ds = small()
    ids = np.concatenate([next(ds.train_batches(4096, s)).ids["C2"][:, 0] for s in range(3)])
    counts = np.bincount(ids, minlength=1000)
    assert counts.argmax() != 0  # the most frequent id sits at a random position
    top = np.sort(counts)[::-1]
    assert top[0] > 5 * top[50]  # and the frequencies are heavy-headed


def test_teacher_sets_ctr_and_bayes_auc_is_its_auc():
    ds = small(ctr=0.3, logit_scale=2.0)
    labels = np.concatenate([b.labels for b in ds.eval_batches(1000)])
    logits = np.concatenate([ds.teacher_logits(b) for b in ds.eval_batches(1000)])
    assert labels.mean() == pytest.approx(0.3, abs=0.02)
    assert ds.bayes_auc == pytest.approx(metrics.auc(labels, logits))
    assert 0.75 < ds.bayes_auc < 0.95
    # A harder teacher (smaller logit spread) has a lower ceiling.
    assert small(logit_scale=0.5).bayes_auc < ds.bayes_auc - 0.1


def test_bad_arguments():
    with pytest.raises(ValueError, match="bag_sizes has 2 entries but there are 3 features"):
        small(bag_sizes=(1, 2))
    with pytest.raises(ValueError, match="ctr must be in"):
        small(ctr=1.5)
