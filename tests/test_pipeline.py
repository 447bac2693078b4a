"""The device prefetcher: batches arrive in order, validation errors reach the consumer, close() stops it."""

import itertools

import numpy as np
import pytest
from conftest import random_batch

from recjax.batch import validate_batch
from recjax.data.pipeline import DevicePrefetcher


def test_order_and_exhaustion(small_spec):
    batches = [random_batch(small_spec, 4, seed=i) for i in range(5)]
    with DevicePrefetcher(iter(batches), lambda b, w: validate_batch(b, small_spec, where=w)) as prefetcher:
        got = list(prefetcher)
    assert len(got) == 5
    for want, have in zip(batches, got, strict=True):
        np.testing.assert_array_equal(np.asarray(have.ids["b"]), want.ids["b"])


def test_invalid_batch_error_names_the_batch(small_spec):
    batches = [random_batch(small_spec, 4, seed=i) for i in range(4)]
    batches[2].ids["a"][1, 0] = 99
    with DevicePrefetcher(iter(batches), lambda b, w: validate_batch(b, small_spec, where=w)) as prefetcher:
        next(prefetcher)
        next(prefetcher)
        with pytest.raises(ValueError, match=r"batch 2: feature 'a': id 99"):
            next(prefetcher)


def test_close_stops_an_endless_stream(small_spec):
    endless = (random_batch(small_spec, 4, seed=0) for _ in itertools.count())
    prefetcher = DevicePrefetcher(endless, lambda b, w: None)
    next(prefetcher)
    prefetcher.close()
    assert not prefetcher._thread.is_alive()
