"""experiments/make_movielens_like.py: the synthetic ML-1M stand-in is read by the MovieLens loader as ML-1M, has the
requested shape (users, movies, ratings, the per-user floor, no repeated (user, movie) pair), ML-1M's star shares,
is a pure function of its seed, and carries signal a model can learn."""

import collections

import numpy as np
import pytest

from experiments import make_movielens_like
from recjax import metrics
from recjax.data.movielens import AGE_GROUPS, prepare_examples, read_movielens

SMALL = {"users": 120, "movies": 150, "ratings": 6_000, "min_user_ratings": 20}


def test_the_files_read_as_movielens_1m_with_the_requested_shape(tmp_path):
    stats = make_movielens_like.write(tmp_path, seed=3, **SMALL)
    tables = read_movielens(tmp_path)
    assert tables.variant == "1m"
    assert tables.ratings.shape[0] == stats["ratings_written"] == 6_000
    assert set(tables.users) == set(range(1, 121)) and set(tables.movies) == set(range(1, 151))
    per_user = collections.Counter(tables.user_ids.tolist())
    assert len(per_user) == 120 and min(per_user.values()) >= 20
    assert max(per_user.values()) <= np.ceil(make_movielens_like.DEFAULTS["max_user_share"] * 150)
    pairs = set(zip(tables.user_ids.tolist(), tables.item_ids.tolist(), strict=True))
    assert len(pairs) == 6_000  # without replacement per user
    assert all(u.age_group in AGE_GROUPS for u in tables.users.values())
    # Stars are cut at the quantiles of ML-1M's shares: each share within one rating of 6,000 (continuous scores).
    shares = np.bincount(tables.ratings.astype(int), minlength=6)[1:] / 6_000
    np.testing.assert_allclose(shares, make_movielens_like.STAR_SHARES, atol=1 / 6_000 + 1e-9)
    assert stats["positive_share"] == pytest.approx(np.mean(tables.ratings >= 4), abs=1e-4)
    spec, batch, _ = prepare_examples(tables)
    assert {f.name: f.vocab_size for f in spec.features}["user"] == 120
    assert batch.labels.shape == (6_000,)


def test_the_set_is_a_pure_function_of_the_seed():
    a, _ = make_movielens_like.generate(1, **SMALL)
    b, _ = make_movielens_like.generate(1, **SMALL)
    c, _ = make_movielens_like.generate(2, **SMALL)
    assert a == b and a["ratings.dat"] != c["ratings.dat"]


def test_labels_carry_the_item_signal_a_model_can_learn():
    """Movies' average label on half the users predicts the other half's labels well above chance (the item bias
    and popularity terms), and the reported Bayes AUC is above what that leaves out."""
    files, stats = make_movielens_like.generate(0, users=400, movies=200, ratings=30_000)
    rows = np.asarray([[int(x) for x in line.split("::")[:3]] for line in files["ratings.dat"]])
    user, movie, label = rows[:, 0], rows[:, 1], (rows[:, 2] >= 4).astype(np.float64)
    fit = user % 2 == 0
    movie_rate = np.bincount(movie[fit], label[fit], minlength=201) / np.maximum(np.bincount(movie[fit],
                                                                                              minlength=201), 1)
    held_out_auc = metrics.auc(label[~fit], movie_rate[movie[~fit]])
    assert 0.6 < held_out_auc < stats["bayes_auc"], (held_out_auc, stats["bayes_auc"])


def test_activity_sums_to_the_ratings_within_the_floor_and_the_cap():
    rng = np.random.default_rng(0)
    counts = make_movielens_like._activity(rng, 500, 40_000, 300, 20, 1.2, 0.5)
    assert counts.sum() == 40_000 and counts.min() >= 20 and counts.max() <= 150
    assert np.median(counts) < counts.mean()  # a heavy tail: a few users rate many movies


def test_impossible_sizes_are_an_error_naming_the_bounds():
    with pytest.raises(ValueError, match=r"ratings 100 must be in \[users x min_user_ratings"):
        make_movielens_like.generate(0, users=10, movies=50, ratings=100)
    with pytest.raises(ValueError, match="unknown parameter"):
        make_movielens_like.generate(0, user=10)
