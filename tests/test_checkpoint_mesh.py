"""Checkpoints of mesh runs: a run on 8 devices killed and resumed ends bit-identical to an uninterrupted one, its
checkpoints (baseline + row deltas by storage) restore to the single-device run's tables at every step, and a
checkpoint restores under another layout: a mesh run's onto one device, a single-device run's onto another mesh.

The mesh runs happen in one subprocess with 8 CPU devices (tests/checkpoint_mesh_runs.py); the single-device runs
here. Single-device and mesh runs agree to float tolerance (tests/test_sharding.py), not bit for bit.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from recjax import checkpoint, sharding
from recjax.data import make_dataset
from recjax.errors import CheckpointError
from recjax.train import build_task, train_and_evaluate
from tests.checkpoint_mesh_runs import STEP, mesh_config
from tests.test_checkpoint import VOCABS, assert_same_run

REPO = pathlib.Path(__file__).resolve().parents[1]
TOL = {"rtol": 2e-4, "atol": 2e-5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("mesh_ckpt")
    train_and_evaluate(mesh_config(""), out / "single")  # one device here
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(REPO / "tests" / "checkpoint_mesh_runs.py"), str(out),
                             str(out / "single")], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-5000:]
    (out / "mesh.log").write_text(result.stdout)
    return out


def by_group(point: checkpoint.ResumePoint) -> dict[str, np.ndarray]:
    """A checkpoint's arrays with its tables and optimizer rows in the single-device layout {group: rows}."""
    arrays = checkpoint.read_arrays(point)
    layout = point.meta["layout"]
    config = mesh_config("")
    task = build_task(config, make_dataset(config.data, seed=config.seed).spec)
    to_groups = sharding.relayout(task.collection, None)
    out = {k: v for k, v in arrays.items() if not k.startswith(("tables/", "sparse_opt/"))}
    tables = to_groups({k[len("tables/"):]: v for k, v in arrays.items() if k.startswith("tables/")}, layout)
    out.update({f"tables/{g}": t for g, t in tables.items()})
    fields = sorted({k.rsplit("/", 1)[1] for k in arrays if k.startswith("sparse_opt/")})
    for field in fields:
        by_key = {k[len("sparse_opt/"):-len(field) - 1]: v for k, v in arrays.items()
                  if k.startswith("sparse_opt/") and k.endswith(f"/{field}")}
        out.update({f"sparse_opt/{g}/{field}": v for g, v in to_groups(by_key, layout).items()})
    return out


def assert_close(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], err_msg=k, **TOL)


def test_killed_mesh_run_resumes_bit_identical(runs):
    assert "resuming from checkpoint step 20" in (runs / "mesh.log").read_text()
    assert_same_run(runs / "reference", runs / "resumed")


def test_mesh_checkpoints_hold_the_single_device_state_at_every_step(runs):
    """Baseline at 10, consecutive row deltas at 20, 30, 40: a row missing from a delta would keep a stale value."""
    store = checkpoint.open_checkpoint(runs / "reference" / "checkpoints").store
    assert store.steps() == [10, 20, 30, 40]
    kinds = [store.meta(s)["kind"] for s in store.steps()]
    assert kinds == ["full", "delta", "delta", "delta"]
    assert store.meta(20)["layout"]["mesh_shape"] == {"data": 4, "model": 2}
    for step in store.steps():
        mesh = by_group(checkpoint.open_checkpoint(runs / "reference" / "checkpoints", step))
        single = by_group(checkpoint.open_checkpoint(runs / "single" / "checkpoints", step))
        assert_close(mesh, single)


def test_mesh_checkpoint_restores_onto_one_device(runs, tmp_path, capsys):
    config = mesh_config("", restore=str(runs / "reference" / "checkpoints" / str(STEP)))
    train_and_evaluate(config, tmp_path)
    assert "re-laid out from mesh data=4,model=2 to one device" in capsys.readouterr().out
    final = lambda d: by_group(checkpoint.open_checkpoint(d / "checkpoints"))
    assert_close(final(tmp_path), final(runs / "single"))
    # The next save after a change of layout is a new baseline.
    assert checkpoint.open_checkpoint(tmp_path / "checkpoints", 30).meta["kind"] == "full"


def test_single_device_checkpoint_restores_onto_another_mesh(runs):
    log = (runs / "mesh.log").read_text()
    assert "re-laid out from one device to mesh data=2,model=4" in log
    final = lambda d: by_group(checkpoint.open_checkpoint(d / "checkpoints"))
    assert_close(final(runs / "from_single"), final(runs / "reference"))


# C1 and C2 with each other's sizes: the storages' shapes stay the same (200 + 50 rows either way).
SWAPPED = (f"holds other embedding tables than this config builds (saved -> now: table C1: vocab_size {VOCABS[0]} -> "
           f"{VOCABS[1]}, C1 rows {VOCABS[0]} -> {VOCABS[1]}; table C2: vocab_size {VOCABS[1]} -> {VOCABS[0]}, C2 rows "
           f"{VOCABS[1]} -> {VOCABS[0]}, C2 offset {VOCABS[0]} -> {VOCABS[1]})")


def test_other_tables_are_refused_across_layouts(runs, tmp_path):
    """The table record is checked whatever the layouts: a mesh checkpoint restored onto one device, and a
    single-device checkpoint restored onto a mesh (in the subprocess)."""
    config = mesh_config("", restore=str(runs / "reference" / "checkpoints" / str(STEP)))
    config.data.vocab_sizes = (VOCABS[1], VOCABS[0], *VOCABS[2:])
    with pytest.raises(CheckpointError) as error:
        train_and_evaluate(config, tmp_path)
    assert f"checkpoint.restore: checkpoint step {STEP} in {runs / 'reference' / 'checkpoints'} {SWAPPED}" in str(
        error.value)
    assert (f"swapped: checkpoint.restore: checkpoint step {STEP} in {runs / 'single' / 'checkpoints'} {SWAPPED}"
            in (runs / "mesh.log").read_text())
