"""Multi-host: 2 processes x 2 CPU devices on 127.0.0.1 (jax.distributed, gloo) train the same model as one process
with 4 devices on the same global batches, each process reading only its half of every batch (train and eval; the
last validation batch of 72 = 2 x 32 + 8 rows lies wholly in process 0's half); only process 0 writes the summary.
Their checkpoint (each process writing its own blocks) restores into another 2-process run, which continues to equal
the single process, and reads in one process. Partial multi-host flags are errors."""

import csv
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from recjax import checkpoint, checkpoint_blocks
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
    # Output to a file, not a pipe: a pipe read only after the other process finished fills up (Orbax logs every
    # save), blocks its writer, and the other process waits for it at the next barrier forever.
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by finish)
    process = subprocess.Popen([sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *ARGS, *flags],
                               env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    process.log = log
    return process


def finish(process: subprocess.Popen) -> str:
    try:
        process.wait(timeout=300)  # ~10 s each when idle
        timed_out = False
    except subprocess.TimeoutExpired:
        process.kill()  # a hung process (e.g. waiting on the other) must not outlive the test
        process.wait()
        timed_out = True
    process.log.seek(0)
    out = process.log.read()
    process.log.close()
    assert not timed_out, f"timed out after 300 s:\n{out[-4000:]}"
    assert process.returncode == 0, out[-4000:]
    return out


def rows(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


SAVE_EVERY_STEP = ("--config.checkpoint.every_steps=1", "--config.checkpoint.keep=10")


def arrays_at(workdir, step: int) -> dict:
    return checkpoint.read_arrays(checkpoint.open_checkpoint(workdir / "checkpoints", step))


def assert_close_arrays(a: dict, b: dict, atol: float) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=atol, err_msg=key)


def two_processes(workdir, *flags) -> list[str]:
    port = free_port()
    hosts = [launch(workdir, "--cpu_devices=2", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                    f"--process_id={i}", *flags) for i in (0, 1)]
    try:
        return [finish(p) for p in hosts]
    finally:
        for p in hosts:
            if p.poll() is None:
                p.kill()


def assert_same_metrics(multi: list[dict], single: list[dict]) -> None:
    assert [(r["step"], r["split"]) for r in multi] == [(r["step"], r["split"]) for r in single]
    for m, s in zip(multi, single, strict=True):
        for key in ("loss", "auc", "logloss"):
            if s[key]:
                assert float(m[key]) == pytest.approx(float(s[key]), rel=1e-5, abs=1e-6), (m, s, key)


def test_two_processes_equal_one_process_with_four_devices(tmp_path):
    # Checkpoints after every step: multi writes consecutive row deltas (by blocks), single full ones.
    outputs = two_processes(tmp_path / "multi", *SAVE_EVERY_STEP, "--config.checkpoint.policy=consecutive")
    finish(launch(tmp_path / "single", "--cpu_devices=4", "--config.train.steps=6", *SAVE_EVERY_STEP))
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


    # Its checkpoints: each process wrote the blocks its devices hold (Orbax's per-process OCDBT stores) with their
    # sha256s, a baseline at step 1 and row deltas at 2 and 3; one process reads the chain whole (every block checked)
    # and finds the single process's state. Another 2-process run restores the chain (each process its blocks),
    # continues to equal the single process (with a history of its own: the evaluations after step 3), and writes
    # deltas of 8-bit rows and 8-bit optimizer rows.
    kinds = [checkpoint.open_checkpoint(tmp_path / "multi" / "checkpoints", s).meta["kind"] for s in (1, 2, 3)]
    assert kinds == ["full", "delta", "delta"]
    step_dir = tmp_path / "multi" / "checkpoints" / "1"
    assert (step_dir / "state" / "ocdbt.process_0").is_dir() and (step_dir / "state" / "ocdbt.process_1").is_dir()
    assert (tmp_path / "multi" / "checkpoints" / "3" / "rows" / "ocdbt.process_1").is_dir()
    multi_arrays = arrays_at(tmp_path / "multi", 3)
    assert any(k.endswith("/column") for k in multi_arrays if k.startswith("tables/"))
    assert_close_arrays(multi_arrays, arrays_at(tmp_path / "single", 3), atol=1e-6)
    cont = two_processes(tmp_path / "cont", "--config.train.steps=6", *SAVE_EVERY_STEP,
                         "--config.checkpoint.policy=consecutive", "--config.checkpoint.quantize_bits=8",
                         "--config.checkpoint.quantize_optimizer_bits=8",
                         f"--config.checkpoint.restore={tmp_path / 'multi' / 'checkpoints'}")
    assert all("resuming from checkpoint step 3 of 6" in out for out in cont), cont[0][-3000:]
    assert_same_metrics(rows(tmp_path / "cont" / "metrics.csv"), [r for r in single if int(r["step"]) > 3])
    meta = checkpoint.open_checkpoint(tmp_path / "cont" / "checkpoints").meta
    assert meta["quantize_bits"] == 8 and meta["optimizer_codes"] == {"m": "signed", "v": "unsigned"}
    # 8-bit rows: within a step of their row's range / 255; 8-bit dynamic codes of the optimizer rows: within half a
    # code step of the top decade (0.9 / 64 / 2 of the block's largest value, signed) of the single process's.
    cont_arrays, single_arrays = arrays_at(tmp_path / "cont", 6), arrays_at(tmp_path / "single", 6)
    optimizer = sorted(k for k in single_arrays if k.startswith("sparse_opt/"))
    assert optimizer and sorted(cont_arrays) == sorted(single_arrays)
    assert_close_arrays({k: v for k, v in cont_arrays.items() if k not in optimizer},
                        {k: v for k, v in single_arrays.items() if k not in optimizer}, atol=2e-3)
    for key in optimizer:
        bound = 0.9 / 64 / 2 * np.abs(single_arrays[key]).max(axis=-1, keepdims=True) + 1e-6
        assert np.all(np.abs(cont_arrays[key] - single_arrays[key]) <= bound), key
    # A corrupt delta (a byte flipped in each of its data files) is an error naming the step (unreadable, or a block
    # that does not match its sha256: test_block_digests_name_a_changed_block).
    for data in sorted((tmp_path / "multi" / "checkpoints" / "3" / "rows").glob("**/d/*")):
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checkpoint step 3: .*corrupt"):
        checkpoint.read_arrays(checkpoint.open_checkpoint(tmp_path / "multi" / "checkpoints"))


def test_block_digests_name_a_changed_block():
    """A host array read whole is checked block by block against u8[R, 32 C] (R x C blocks)."""
    table = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    digests = np.stack([np.concatenate([np.frombuffer(hashlib.sha256(
        np.ascontiguousarray(table[r * 2:(r + 1) * 2, c * 3:(c + 1) * 3]).tobytes()).digest(), np.uint8)
        for c in range(2)]) for r in range(4)])
    checkpoint_blocks.check_blocks(table, digests, "t")
    table[5, 4] += 1
    with pytest.raises(CheckpointError, match="t: a block does not match its sha256"):
        checkpoint_blocks.check_blocks(table, digests, "t")


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

