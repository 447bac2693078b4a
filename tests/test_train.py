"""The trainer end to end: learning, determinism, outputs, and that a step's cost ignores vocabulary size."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import random_batch

from experiments.configs.dlrm_synthetic import get_config
from recjax.specs import DatasetSpec, FeatureSpec
from recjax.step import init_state, make_train_step
from recjax.task import build_task
from recjax.train import train_and_evaluate


def tiny_config(steps=300):
    config = get_config()
    config.data.vocab_sizes = (200, 50, 1000, 8, 3000, 20)
    config.data.eval_examples = 8192
    config.embedding.dim = 8
    config.model.dlrm.bottom_mlp = (32, 8)
    config.model.dlrm.top_mlp = (32, 1)
    config.train.batch_size = 256
    config.train.steps = steps
    config.train.eval_every = 100
    config.train.log_every = 50
    config.train.progress_bar = False
    return config


def test_short_run_learns_and_writes_outputs(tmp_path):
    summary = train_and_evaluate(tiny_config(), tmp_path)
    assert summary["auc"] > 0.70, summary["auc"]
    assert summary["auc"] > summary["bayes_auc"] - 0.08
    saved = json.loads((tmp_path / "summary.json").read_text())
    for key in ("auc", "logloss", "ne", "accuracy", "params", "embedding_bytes", "flops_per_example",
                "examples_per_sec", "bayes_auc", "train_flops_per_example"):
        assert np.isfinite(saved[key]), key
    assert saved["embedding_bytes"] == 4 * 8 * (200 + 50 + 1000 + 8 + 3000 + 20)
    assert saved["flops_per_example"] > 2 * (13 * 32 + 32 * 8)  # at least the bottom MLP's multiply-adds
    csv_lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].startswith("step,split")
    evals = [line for line in csv_lines if ",validation," in line]
    assert len(evals) == 3
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 300
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_same_seed_gives_identical_metrics(tmp_path):
    config = tiny_config(steps=60)
    a = train_and_evaluate(config, tmp_path / "a")
    b = train_and_evaluate(config, tmp_path / "b")
    for key in ("auc", "logloss", "ne", "accuracy", "final_train_loss"):
        assert a[key] == b[key], key
    config.seed = 1
    c = train_and_evaluate(config, tmp_path / "c")
    assert c["logloss"] != a["logloss"]


def temp_bytes_of_train_step(vocab_size: int) -> tuple[int, int]:
    """XLA's temp buffer size and output/argument alias size for a train step over one table."""
    config = tiny_config()
    config.embedding.dim = 16
    config.model.dlrm.bottom_mlp = (16,)
    spec = DatasetSpec(num_dense=13, features=(FeatureSpec("C1", vocab_size, bag_size=4),))
    task = build_task(config, spec)
    batch = jax.device_put(random_batch(spec, 64))
    state = init_state(task, jax.random.key(0), batch)
    analysis = make_train_step(task).lower(state, batch).compile().memory_analysis()
    return analysis.temp_size_in_bytes, analysis.alias_size_in_bytes


def test_train_step_memory_does_not_grow_with_vocab():
    """Sparse updates: XLA's scratch memory is the same for a 1k- and a 1M-row table, and the table is
    updated in place (aliased to the output) rather than copied."""
    small_temp, small_alias = temp_bytes_of_train_step(1_000)
    large_temp, large_alias = temp_bytes_of_train_step(1_000_000)
    assert large_temp == small_temp
    table_and_optimizer = 1_000_000 * 16 * 4 * 3  # lazy Adam default: table, m and v
    assert large_alias >= table_and_optimizer


@pytest.mark.slow
def test_launcher_runs_from_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", "--config.train.steps=20",
           "--config.train.eval_every=20", "--config.data.eval_examples=2048", "--config.train.progress_bar=False"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # ~10 s idle, 26 s loaded; 60x
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 20 and 0.5 < summary["auc"] <= 1.0
    assert '"auc"' in result.stdout


def test_launcher_rejects_unknown_override(tmp_path):
    cmd = [sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", "--config.train.stepz=20"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # ~1.5 s idle, 2.6 s loaded; 200x
    assert result.returncode != 0
    assert "stepz" in result.stderr


def test_multi_hot_mean_pooling_run_learns(tmp_path):
    config = tiny_config(steps=300)
    config.data.bag_sizes = (1, 3, 1, 5, 1, 2)
    config.embedding.pooling = "mean"
    summary = train_and_evaluate(config, tmp_path)
    assert summary["auc"] > 0.68, summary["auc"]


def test_bad_config_is_a_clear_error(tmp_path):
    config = tiny_config(steps=5)
    config.model.dlrm.bottom_mlp = (32, 4)  # dot interaction needs 8 == embedding.dim
    with pytest.raises(ValueError, match=r"model.dlrm.bottom_mlp: dot interaction needs the last width to equal "
                                         r"embedding.dim \(8\), got \(32, 4\)"):
        train_and_evaluate(config, tmp_path)
    config = tiny_config(steps=5)
    config.optimizer.sparse.name = "adamax"
    with pytest.raises(ValueError, match=r"optimizer.sparse.name: unknown value 'adamax'"):
        train_and_evaluate(config, tmp_path)


@pytest.mark.slow
def test_launcher_sets_method_options_from_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", "--config.train.steps=5",
           "--config.train.eval_every=5", "--config.data.eval_examples=1024", "--config.train.progress_bar=False",
           "--config.embedding.method=qr", "--config.embedding.options.collisions=4",
           "--config.embedding.options.threshold=2000"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # ~21 s idle, 33 s loaded; 30x
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tables"]["C3"]["method"] == "qr" and summary["tables"]["C1"]["method"] == "full"  # 40000 vs 1460
    assert 2.0 < summary["compression_ratio"] < 4.0
