"""FIITED mesh runs for tests/test_fiited.py::test_fiited_on_a_mesh..., in a subprocess with 8 CPU devices (the pytest
process keeps its one device, where the single-device run happens).

    python tests/fiited_mesh_runs.py OUT_DIR      (JAX_NUM_CPU_DEVICES=8 set by the caller)

Writes OUT_DIR/reference (data=4,model=2, the pools row-wise, table-wise and replicated, uninterrupted) and
OUT_DIR/resumed (the same run killed after its step-6 save -- the compaction's step -- and resumed).
"""

import contextlib
import pathlib
import sys

import jax
import pytest

from recjax import checkpoint
from recjax.train import train_and_evaluate
from tests.test_checkpoint import crash_after_save, tiny

STEP = 6  # the ramp's end: the pools are compacted, then the run is killed right after that step's save


def fiited_config(mesh: str = ""):
    """tiny()'s run with FIITED on the three tables above 100 ids, compacted once (at the ramp's end)."""
    config = tiny(steps=20, policy="consecutive", keep=10, every_steps=3)
    config.embedding.method = "fiited"
    config.embedding.options.keep = 0.25
    config.embedding.options.chunks = 4
    config.embedding.options.threshold = 100
    config.embedding.options.compact_slack = 10.0
    config.model.dlrm.dropout = 0.0  # a mesh run draws its dropout masks per device: only the single run's differ
    if mesh:
        config.mesh.shape = mesh
        config.sharding.plan = "table"
        config.sharding.tables = "C1/pool=row,C3/pool=table:5,C5/pool=replicated,C2=column"
    return config


def main(out: pathlib.Path) -> None:
    assert jax.device_count() == 8, jax.device_count()
    train_and_evaluate(fiited_config("data=4,model=2"), out / "reference")
    with pytest.MonkeyPatch.context() as patch, contextlib.suppress(KeyboardInterrupt):
        crash_after_save(patch, STEP)
        train_and_evaluate(fiited_config("data=4,model=2"), out / "resumed")
    assert checkpoint.open_checkpoint(out / "resumed" / "checkpoints").step == STEP  # killed there
    train_and_evaluate(fiited_config("data=4,model=2"), out / "resumed")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
