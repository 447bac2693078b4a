"""Host-side validation: every bad input is a ValueError naming the feature / value."""

import numpy as np
import pytest
from conftest import random_batch

from recjax.batch import pad_batch, validate_batch


def test_valid_batch_passes_and_one_bad_id_fails_it(small_spec):
    batch = random_batch(small_spec, 8, full_bags=True)
    assert validate_batch(batch, small_spec) is None
    batch.ids["c"][7, 1] = 5  # vocab_size of c is 5
    with pytest.raises(ValueError, match="feature 'c': id 5"):
        validate_batch(batch, small_spec)


@pytest.mark.parametrize("bad_id", [11, 10**9, -1])
def test_out_of_range_id_names_feature_and_value(small_spec, bad_id):
    batch = random_batch(small_spec, 8, full_bags=True)
    batch.ids["b"][5, 2] = bad_id
    with pytest.raises(ValueError, match=rf"feature 'b': id {bad_id} \(example 5, slot 2\) is outside \[0, 11\)"):
        validate_batch(batch, small_spec)


def test_ids_in_padded_slots_are_ignored(small_spec):
    batch = random_batch(small_spec, 8)
    batch.lengths["b"][:] = 1
    batch.ids["b"][:, 1:] = -5
    assert validate_batch(batch, small_spec) is None
    batch.lengths["b"][3] = 2  # slot 1 of example 3 is now a real id
    with pytest.raises(ValueError, match=r"feature 'b': id -5 \(example 3, slot 1\)"):
        validate_batch(batch, small_spec)


def test_any_id_features_skip_the_range_check(small_spec):
    batch = random_batch(small_spec, 8)
    batch.ids["a"][0, 0] = 10**6
    assert validate_batch(batch, small_spec, any_id=frozenset({"a"})) is None
    with pytest.raises(ValueError, match="feature 'a': id 1000000"):
        validate_batch(batch, small_spec)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_dense_is_an_error(small_spec, value):
    batch = random_batch(small_spec, 8)
    batch.dense[3, 1] = value
    with pytest.raises(ValueError, match=rf"dense feature 1 of example 3 is {value}"):
        validate_batch(batch, small_spec, where="file x.txt line 4")


def test_bad_labels_lengths_and_shapes(small_spec):
    batch = random_batch(small_spec, 8)
    batch.labels[2] = 0.5
    with pytest.raises(ValueError, match="label of example 2 is 0.5"):
        validate_batch(batch, small_spec)
    batch = random_batch(small_spec, 8)
    batch.lengths["c"][0] = 3
    with pytest.raises(ValueError, match="feature 'c': lengths must be"):
        validate_batch(batch, small_spec)
    batch = random_batch(small_spec, 8)
    batch.ids["c"] = batch.ids["c"][:, :1]
    with pytest.raises(ValueError, match=r"feature 'c': ids must be i32\[8, 2\]"):
        validate_batch(batch, small_spec)
    batch = random_batch(small_spec, 8)
    del batch.ids["c"]
    with pytest.raises(ValueError, match="do not match"):
        validate_batch(batch, small_spec)


def test_pad_batch(small_spec):
    batch = random_batch(small_spec, 5)
    padded = pad_batch(batch, 8)
    assert padded.size == 8
    assert np.all(padded.lengths["b"][5:] == 0)
    np.testing.assert_array_equal(padded.ids["b"][:5], batch.ids["b"])
    with pytest.raises(ValueError, match="does not fit"):
        pad_batch(batch, 4)
