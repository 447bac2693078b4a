"""Arrays written and read by row blocks (recjax/checkpoint/streamed.py) against numpy: what Orbax reads back, the
blocks of a stored array at ranges inside and across its chunks, a delta's rows patched over them, and the streamed
sha256 -- all equal to the numpy array's own."""

import hashlib
import pathlib

import numpy as np
import pytest

from recjax.checkpoint import streamed

ROWS, DIM, BLOCK_ROWS = 1037, 8, 100  # 11 blocks, the last one short


class Numpy(streamed.RowBlocks):
    """A numpy array read by row blocks, recording the rows of each block asked for."""

    def __init__(self, array: np.ndarray):
        self.array, self.shape, self.dtype = array, array.shape, array.dtype
        self.asked: list[int] = []

    def block(self, start: int, stop: int) -> np.ndarray:
        self.asked.append(stop - start)
        return np.array(self.array[start:stop])


@pytest.fixture()
def saved(tmp_path, monkeypatch) -> tuple[pathlib.Path, np.ndarray, Numpy]:
    import orbax.checkpoint as ocp

    monkeypatch.setattr(streamed, "BLOCK_BYTES", BLOCK_ROWS * DIM * 4)
    streamed.register_handler()
    array = np.random.default_rng(0).normal(size=(ROWS, DIM)).astype(np.float32)
    rows = Numpy(array)
    manager = ocp.CheckpointManager(tmp_path, item_names=("state",))
    manager.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave({"t": rows, "n": np.arange(3)})))
    manager.wait_until_finished()
    manager.close()
    return tmp_path, array, rows


def restore(directory: pathlib.Path, stored: bool) -> dict:
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(directory, item_names=("state",))
    args = ocp.args.PyTreeRestore()
    if stored:
        args = ocp.args.PyTreeRestore(restore_args={
            "t": ocp.type_handlers.RestoreArgs(restore_type=streamed.StoredRows),
            "n": ocp.type_handlers.RestoreArgs(restore_type=np.ndarray)})
    return manager.restore(1, args=ocp.args.Composite(state=args)).state


def test_a_save_reads_blocks_and_any_reader_gets_the_numpy_array(saved):
    directory, array, rows = saved
    assert rows.asked == [BLOCK_ROWS] * 10 + [ROWS - 10 * BLOCK_ROWS]  # never the whole array
    value = restore(directory, stored=False)
    assert type(value["t"]) is np.ndarray
    np.testing.assert_array_equal(value["t"], array, strict=True)
    np.testing.assert_array_equal(value["n"], np.arange(3))
    assert rows.sha256() == hashlib.sha256(array.tobytes()).hexdigest()


def test_stored_rows_read_blocks_within_and_across_chunks(saved):
    directory, array, _ = saved
    stored = restore(directory, stored=True)["t"]
    assert isinstance(stored, streamed.StoredRows)
    assert (stored.shape, stored.dtype, stored.chunk_rows) == ((ROWS, DIM), np.float32, BLOCK_ROWS)
    for start, stop in [(0, 100), (130, 170), (95, 305), (1000, 1037), (1036, 1037), (0, 1037)]:
        np.testing.assert_array_equal(stored.block(start, stop), array[start:stop], err_msg=f"{start}:{stop}")
    assert stored.sha256() == hashlib.sha256(array.tobytes()).hexdigest()


def test_patched_rows_are_the_delta_over_the_baseline(saved):
    directory, array, _ = saved
    rng = np.random.default_rng(1)
    first_ids, second_ids = rng.choice(ROWS, 50, replace=False), rng.choice(ROWS, 80, replace=False)
    first, second = (rng.normal(size=(len(i), DIM)).astype(np.float32) for i in (first_ids, second_ids))
    expected = array.copy()
    expected[first_ids] = first
    expected[second_ids] = second  # the later delta wins where both hold a row
    patched = restore(directory, stored=True)["t"].patched(first_ids, first).patched(second_ids, second)
    assert patched.block_rows == BLOCK_ROWS
    for start, stop in patched.spans():
        np.testing.assert_array_equal(patched.block(start, stop), expected[start:stop])
    assert patched.sha256() == hashlib.sha256(expected.tobytes()).hexdigest()
