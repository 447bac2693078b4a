"""Multi-host: 2 processes x 2 CPU devices on 127.0.0.1 (jax.distributed, gloo) train the same model as one process
with 4 devices on the same global batches, each process reading only its half of every batch (train and eval; the
last validation batch of 72 = 2 x 32 + 8 rows lies wholly in process 0's half); only process 0 writes the summary.
Their checkpoint (each process writing its own blocks) restores into another 2-process run, which continues to equal
the single process, and reads in one process. Partial multi-host flags are errors."""

import csv
import json
import os
import socket
import subprocess
import sys

import pytest

from recjax import checkpoint
from recjax.errors import CheckpointError, ConfigError
from recjax.sharding import multihost
from tests.test_sharding import FAST_COMPILE

ARGS = ["--config.train.steps=3", "--config.train.batch_size=32", "--config.train.eval_every=3",
        "--config.train.log_every=1", "--config.data.eval_examples=72", "--config.train.progress_bar=False",
        "--config.data.vocab_sizes=7,300,1000,50,120", "--config.data.bag_sizes=1,3,1,2,1",
        "--config.model.dlrm.bottom_mlp=8,16", "--config.model.dlrm.top_mlp=16,1", "--config.mesh.shape=data=2,model=2",
        "--config.sharding.plan=table", "--config.sharding.tables=C1=row,C2=column,C3=replicated"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(workdir, *flags) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")} | {
        "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()}
    return subprocess.Popen([sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *ARGS, *flags],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> str:
    out, _ = process.communicate(timeout=600)
    assert process.returncode == 0, out[-4000:]
    return out


def rows(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def two_processes(workdir, *flags) -> list[str]:
    port = free_port()
    hosts = [launch(workdir, "--cpu_devices=2", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                    f"--process_id={i}", *flags) for i in (0, 1)]
    return [finish(p) for p in hosts]


def assert_same_metrics(multi: list[dict], single: list[dict]) -> None:
    assert [(r["step"], r["split"]) for r in multi] == [(r["step"], r["split"]) for r in single]
    for m, s in zip(multi, single, strict=True):
        for key in ("loss", "auc", "logloss"):
            if s[key]:
                assert float(m[key]) == pytest.approx(float(s[key]), rel=1e-5, abs=1e-6), (m, s, key)


def test_two_processes_equal_one_process_with_four_devices(tmp_path):
    outputs = two_processes(tmp_path / "multi")
    finish(launch(tmp_path / "single", "--cpu_devices=4", "--config.train.steps=6"))
    assert '"auc"' in outputs[0] and '"auc"' not in outputs[1]  # only process 0 prints the headline
    for i, out in enumerate(outputs):  # disjoint halves of every batch
        assert f"data: process {i} of 2 reads rows [{16 * i}, {16 * i + 16}) of every batch of 32" in out, out[-3000:]
    assert (tmp_path / "multi" / "summary.json").is_file()
    assert not (tmp_path / "multi" / "process_1" / "summary.json").exists()
    multi, single = rows(tmp_path / "multi" / "metrics.csv"), rows(tmp_path / "single" / "metrics.csv")
    assert_same_metrics(multi, single[:len(multi)])  # the single run goes on to step 6 (a constant learning rate)
    summary = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["mesh_shape"] == {"data": 2, "model": 2}
    # Each validation / test row counted once (duplicated rows would leave AUC and logloss unchanged).
    assert summary["validation"]["eval_examples"] == summary["test"]["eval_examples"] == 72


    # Its final checkpoint: each process wrote the blocks its devices hold (Orbax's per-process OCDBT stores), with
    # their sha256s; another 2-process run starts from it and continues to equal the single process.
    step_dir = tmp_path / "multi" / "checkpoints" / "3"
    assert (step_dir / "state" / "ocdbt.process_0").is_dir() and (step_dir / "state" / "ocdbt.process_1").is_dir()
    cont = two_processes(tmp_path / "cont", "--config.train.steps=6",
                         f"--config.checkpoint.restore={tmp_path / 'multi' / 'checkpoints'}")
    assert all("resuming from checkpoint step 3 of 6" in out for out in cont), cont[0][-3000:]
    assert_same_metrics(rows(tmp_path / "cont" / "metrics.csv"), single)
    # One process reads it whole (every block checked against its sha256): the tables of the 4-device layout.
    arrays = checkpoint.read_arrays(checkpoint.open_checkpoint(tmp_path / "multi" / "checkpoints"))
    assert int(arrays["step"]) == 3 and any(k.endswith("/column") for k in arrays if k.startswith("tables/"))
    # A corrupt block (process 1's data files, bytes flipped) is an error naming the step.
    for data in sorted((step_dir / "state" / "ocdbt.process_1" / "d").iterdir()):
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checkpoint step 3: .*corrupt"):
        checkpoint.read_arrays(checkpoint.open_checkpoint(tmp_path / "multi" / "checkpoints"))


def test_partial_multihost_flags_are_config_errors(monkeypatch):
    for env in multihost.ENV.values():
        monkeypatch.delenv(env, raising=False)
    assert multihost.initialize() is False
    with pytest.raises(ConfigError, match=r"--num_processes: multi-host needs .* got --coordinator_address without "
                                          r"--num_processes, --process_id"):
        multihost.initialize("127.0.0.1:1234")
    with pytest.raises(ConfigError, match=r"--process_id: must be in \[0, 2\) for --num_processes=2, got 2"):
        multihost.initialize("127.0.0.1:1234", 2, 2)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(ConfigError, match="got --num_processes without --coordinator_address, --process_id"):
        multihost.initialize()

