"""Mesh runs for tests/test_checkpoint_mesh.py, in a subprocess with 8 CPU devices (the pytest process keeps its one
device, where the single-device runs happen).

    python tests/checkpoint_mesh_runs.py OUT_DIR SINGLE_DEVICE_WORKDIR     (JAX_NUM_CPU_DEVICES=8 set by the caller)

Writes OUT_DIR/reference (data=4,model=2, consecutive deltas, uninterrupted), OUT_DIR/resumed (the same run killed
after its step-20 save and resumed, one-shot deltas) and OUT_DIR/from_single (data=2,model=4, started from the
single-device run's step-20 checkpoint), and prints the error of a restore of that checkpoint onto the mesh by a
config whose tables C1 and C2 have each other's sizes ("swapped: <message>").
"""

import contextlib
import pathlib
import sys

import jax
import pytest

from recjax.errors import CheckpointError
from recjax.train import train_and_evaluate
from tests.test_checkpoint import VOCABS, crash_after_save, tiny

STEP = 20  # the interruption, and the checkpoint another layout starts from


def mesh_config(mesh: str, **ckpt):
    """tiny()'s run on a mesh, with a table of every sharding type and Adagrad (a state row per table row)."""
    config = tiny(**{"policy": "consecutive", "keep": 10, **ckpt})
    config.mesh.shape = mesh
    config.sharding.plan = "table"
    config.sharding.tables = "C1=replicated,C2=row,C3=column,C5=row"
    config.optimizer.sparse.name = "adagrad"
    config.model.dlrm.dropout = 0.0  # a mesh run draws its dropout masks per device: only the single run's differ
    return config


def main(out: pathlib.Path, single: pathlib.Path) -> None:
    assert jax.device_count() == 8, jax.device_count()
    train_and_evaluate(mesh_config("data=4,model=2"), out / "reference")

    with pytest.MonkeyPatch.context() as patch, contextlib.suppress(KeyboardInterrupt):
        crash_after_save(patch, STEP)
        train_and_evaluate(mesh_config("data=4,model=2", policy="one_shot"), out / "resumed")
    train_and_evaluate(mesh_config("data=4,model=2", policy="one_shot"), out / "resumed")

    train_and_evaluate(mesh_config("data=2,model=4", restore=str(single / "checkpoints" / str(STEP))),
                       out / "from_single")

    swapped = mesh_config("data=2,model=4", restore=str(single / "checkpoints" / str(STEP)))
    swapped.data.vocab_sizes = (VOCABS[1], VOCABS[0], *VOCABS[2:])
    try:
        train_and_evaluate(swapped, out / "swapped")
    except CheckpointError as error:
        print(f"swapped: {error}", flush=True)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
