"""The input pipeline: batches and blocks of them arrive in order, validation errors name the batch and reach the
consumer, close() stops it."""

import functools
import itertools
import time

import numpy as np
import pytest
from conftest import random_batch

from recjax.batch import validate_batch
from recjax.data.pipeline import BlockPrefetcher, DevicePrefetcher, MadeBlocks, stream_blocks


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


# ---------------------------------------------------------------------------------------------- blocks of batches
def test_stream_blocks_stack_each_calls_batches_in_order(small_spec):
    """Calls of 3, 1 and 2 steps: blocks f32[3, B, ...], the 4th batch itself, f32[2, B, ...]; the put is told which
    blocks are stacked, and several workers hand them over in order."""
    batches = [random_batch(small_spec, 4, seed=i) for i in range(6)]
    puts = []

    def put(block, stacked=False):
        puts.append(stacked)
        return block

    jobs = stream_blocks(iter(batches), [3, 1, 2], lambda b, w: validate_batch(b, small_spec, where=w), put)
    with BlockPrefetcher(jobs, workers=3, depth=3) as blocks:
        got = list(blocks)
    assert [n for n, _ in got] == [3, 1, 2] and sorted(puts) == [False, True, True]
    (_, a), (_, b), (_, c) = got
    assert a.ids["b"].shape == (3, 4, 4) and b.ids["b"].shape == (4, 4) and c.labels.shape == (2, 4)
    for i in range(3):
        np.testing.assert_array_equal(a.ids["b"][i], batches[i].ids["b"])
    np.testing.assert_array_equal(b.dense, batches[3].dense)
    np.testing.assert_array_equal(c.lengths["a"][1], batches[5].lengths["a"])


def test_a_bad_batch_in_a_block_is_named_by_its_step(small_spec):
    """Validation runs once over a whole block; an error still names the very batch (its step), as a one-step
    call's would, and arrives after the blocks before it."""
    batches = [random_batch(small_spec, 4, seed=i) for i in range(8)]
    batches[6].ids["a"][2, 0] = 99
    jobs = stream_blocks(iter(batches), [4, 4], lambda b, w: validate_batch(b, small_spec, where=w),
                         lambda b, stacked=False: b, first_step=10)
    with BlockPrefetcher(jobs, workers=2) as blocks:
        assert next(blocks)[0] == 4
        with pytest.raises(ValueError, match=r"^batch 16: feature 'a': id 99 \(example 2, slot 0\)"):
            next(blocks)


def test_workers_keep_the_order_whatever_finishes_first():
    """Jobs that finish out of order (later ones sooner) still come out in order."""
    def job(i):
        time.sleep(0.02 * (5 - i % 5))
        return 1, i

    with BlockPrefetcher((functools.partial(job, i) for i in range(15)), workers=4, depth=6) as blocks:
        assert [i for _, i in blocks] == list(range(15))


def test_made_blocks_ask_for_each_calls_first_step_and_length_one_call_ahead():
    made, warm = [], []

    def make(step, n):
        made.append((step, n))
        return np.full((n, 2) if n > 1 else (2,), step)

    with MadeBlocks(make, [4, 4, 2, 1], lambda b, stacked=False: (b, stacked), first_step=7,
                    warmup=[lambda: warm.append(True)]) as blocks:
        first = next(blocks)
        assert warm == [True]  # waited for before the first block
        assert made == [(7, 4), (11, 4)]  # the next call's block is already asked for
        got = [first, *blocks]
    assert [(n, block[1]) for n, block in got] == [(4, True), (4, True), (2, True), (1, False)]
    assert made == [(7, 4), (11, 4), (15, 2), (17, 1)]
    np.testing.assert_array_equal(got[3][1][0], [17, 17])


def test_an_error_taking_the_next_job_reaches_the_consumer():
    def jobs():
        yield lambda: (1, "first")
        raise OSError("disk gone")

    with BlockPrefetcher(jobs()) as blocks:
        assert next(blocks) == (1, "first")
        with pytest.raises(OSError, match="disk gone"):
            next(blocks)


def test_close_stops_endless_blocks():
    blocks = BlockPrefetcher((lambda: (1, None) for _ in itertools.count()), workers=2)
    next(blocks)
    blocks.close()
    assert not blocks._thread.is_alive()
