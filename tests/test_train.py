"""The trainer end to end: learning, determinism, outputs, and that a step's cost ignores vocabulary size."""

import json
import math
import re
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import random_batch, train_steps

from experiments.configs.dlrm_synthetic import get_config
from recjax.data import make_dataset
from recjax.guards import Divergence
from recjax.placement import one_device
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
    assert saved["diverged"] is None  # a normal run (its first windows noisy) is not taken for a diverging one
    assert saved["embedding_kernel"]["kernel"] == "xla" and saved["embedding_kernel"]["source"] == "platform"  # CPU
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
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 20 and 0.5 < summary["auc"] <= 1.0
    assert '"auc"' in result.stdout


def test_launcher_rejects_unknown_override(tmp_path):
    cmd = [sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", "--config.train.stepz=20"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode != 0
    assert "stepz" in result.stderr


def test_multi_hot_mean_pooling_run_learns(tmp_path):
    config = tiny_config(steps=300)
    config.data.bag_sizes = (1, 3, 1, 5, 1, 2)
    config.embedding.pooling = "mean"
    summary = train_and_evaluate(config, tmp_path)
    assert summary["auc"] > 0.68, summary["auc"]
    assert summary["diverged"] is None


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
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tables"]["C3"]["method"] == "qr" and summary["tables"]["C1"]["method"] == "full"  # 40000 vs 1460
    assert 2.0 < summary["compression_ratio"] < 4.0


# ------------------------------------------------------------------------------------------------ divergence
def test_divergence_is_a_loss_worse_than_untrained_and_far_above_its_lowest():
    """Hand-made windows: learning, a low-loss model's noisy window (15x its lowest, still better than untrained),
    a warmup's overshoot above step 1 (within the factor) -- none diverged; worse than untrained and past the factor,
    or non-finite, is."""
    d = Divergence(factor=10.0)
    d.start(0.69)  # step 1: the untrained model
    assert d.check(0.5) is None and d.check(0.04) is None
    assert d.check(0.6) is None  # 15x its lowest, but better than untrained
    assert d.check(0.7) == ("the train loss 0.7 (mean of the last log window) is above step 1's 0.69 and 17.5x its "
                            "lowest so far, 0.04 (train.divergence_factor 10)")
    overshoot = Divergence(factor=10.0)
    overshoot.start(0.69)
    assert overshoot.check(0.9) is None and overshoot.check(6.8) is None  # 6.8 < 10 x 0.69
    assert overshoot.check(7.0) is not None
    assert Divergence(factor=10.0).check(float("nan"), "steps 1-5") == "the train loss is nan (mean of steps 1-5)"
    off = Divergence(factor=0.0)
    off.start(0.69)
    assert off.check(1e9) is None and off.check(float("inf")) == "the train loss is inf (mean of the last log window)"


def test_a_diverging_run_stops_checkpoints_nothing_and_names_the_learning_rates(tmp_path):
    """optimizer.sparse.learning_rate=1e9 (the issue's run: train loss 1.7e15, AUC 0.499, exit 0): the check at the
    first checkpoint (step 20, before the first log point) finds it, the run stops there, saves no checkpoint of
    the diverged state and summary.json says why, against step 1's loss computed here outside the loop; with the
    default learning rate the same run checkpoints step 20 and goes on."""
    config = tiny_config(steps=60)
    config.checkpoint.every_steps = 20
    config.optimizer.sparse.learning_rate = 1e9
    summary = train_and_evaluate(config, tmp_path / "diverging")
    dataset = make_dataset(config.data, seed=config.seed)
    step1_loss = train_steps(config, dataset.spec, [next(dataset.train_batches(config.train.batch_size))])[2][0]
    assert re.fullmatch(
        rf"training diverged at step 20: the train loss (\S+) \(mean of steps 1-20\) is above step 1's "
        rf"{step1_loss:.4g} and \S+x its lowest so far, \S+ \(train.divergence_factor 10\); lower the learning "
        r"rates: optimizer.sparse.learning_rate \(1e\+09; its embedding rows reach \|\S+\|\) and "
        r"optimizer.dense.learning_rate \(0.001; its dense weights reach \|\S+\|\); or warm up longer "
        r"\(optimizer.warmup_steps 0\)", summary["diverged"]), summary["diverged"]
    mean = float(summary["diverged"].split("the train loss ")[1].split(" ")[0])
    assert mean > 1e3 * step1_loss
    assert summary["steps"] == 20 and math.isnan(summary["auc"]) and summary["selected_step"] == 0
    assert json.loads((tmp_path / "diverging" / "summary.json").read_text())["diverged"] == summary["diverged"]
    assert not [p for p in (tmp_path / "diverging" / "checkpoints").iterdir() if p.name.isdigit()]

    config.optimizer.sparse.learning_rate = tiny_config().optimizer.sparse.learning_rate
    normal = train_and_evaluate(config, tmp_path / "normal")
    assert normal["diverged"] is None and normal["steps"] == 60
    assert (tmp_path / "normal" / "checkpoints" / "40").is_dir()


def launcher(tmp_path, *flags) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}",
                             "--config.train.progress_bar=False", "--config.data.eval_examples=1024", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # a launcher process (the in-process run above checks the divergence itself)
def test_launcher_exits_3_when_the_run_diverges(tmp_path):
    run = launcher(tmp_path, "--config.optimizer.sparse.learning_rate=1e9", "--config.train.steps=40",
                   "--config.train.log_every=20", "--config.train.eval_every=40")
    out, err = run.communicate()
    assert run.returncode == 3, err[-3000:]
    assert "Traceback" not in err and "ERROR: training diverged at step 20: " in out
    assert err.strip().splitlines()[-1] == (f"error: training diverged at step 20 (why, and which learning rates to "
                                            f"lower: above and in {tmp_path / 'summary.json'} \"diverged\")")


@pytest.mark.slow  # a launcher process (tests/test_checkpoint.py checks the interrupt itself in-process)
def test_ctrl_c_stops_the_launcher_with_one_line_and_status_130(tmp_path):
    """SIGINT once the loop runs: the step is checkpointed, one line says where, exit status 130 (a shell's for
    SIGINT). tests/test_checkpoint.py checks that a rerun resumes from it bit-identical."""
    run = launcher(tmp_path, "--config.train.steps=1000000", "--config.train.eval_every=1000000")
    for line in run.stdout:  # the loop starts right after this line (compiled, tables made)
        if line.startswith("workdir:"):
            break
    run.send_signal(signal.SIGINT)
    out, err = run.communicate()
    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    step = re.fullmatch(r"interrupted at step ([\d,]+); rerun the same command to resume from its checkpoint of "
                        rf"step \1 \({re.escape(str(tmp_path / 'checkpoints'))}/\d+\)", last)
    assert step, err[-3000:]
    assert (tmp_path / "checkpoints" / step.group(1).replace(",", "")).is_dir()


# ---------------------------------------------------------------------------------------------------- memory
def fixed_memory(monkeypatch, available: int) -> None:
    import recjax.guards

    monkeypatch.setattr(recjax.guards, "host_available_bytes", lambda: available)


def test_a_model_too_big_for_memory_is_refused_naming_its_largest_tables(monkeypatch):
    """The issue's run: the kaggle preset at dim 512 (XLA's RESOURCE_EXHAUSTED traceback naming no table, once the
    tables were being made) is a ConfigError before any table exists, with bytes computed here by hand: 33,762,577
    rows x 512 x 4 bytes of tables, lazy Adam's m and v twice that, async checkpoint saves 2.5x both."""
    from recjax.data.synthetic import KAGGLE_VOCAB_SIZES
    from recjax.errors import ConfigError
    from recjax.guards import CHECKPOINT_MEMORY, MEMORY_MARGIN, MEMORY_MARGIN_BYTES, check_memory

    fixed_memory(monkeypatch, 64 << 30)
    config = get_config("kaggle")
    config.embedding.dim = 512
    config.model.dlrm.bottom_mlp = (512, 256, 512)
    task = build_task(config, DatasetSpec(13, tuple(FeatureSpec(f"C{i + 1}", v)
                                                    for i, v in enumerate(KAGGLE_VOCAB_SIZES))))
    rows = 33_762_577
    assert sum(KAGGLE_VOCAB_SIZES) == rows
    tables, adam = rows * 512 * 4, 2 * rows * 512 * 4
    assert CHECKPOINT_MEMORY == {"async": 2.5, "sync": 1.5}
    need = (tables + adam) * (1 + MEMORY_MARGIN) + 2.5 * (tables + adam) + MEMORY_MARGIN_BYTES
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    largest = ", ".join(f"C{i} {v:,} x 512 full {gib(v * 512 * 4 * 3)}" for i, v in ((3, 10_131_227),
                                                                                    (12, 8_351_593),
                                                                                    (21, 7_046_547)))
    expected = (f"embedding: the model does not fit: {gib(tables)} of embedding tables + {gib(adam)} of optimizer "
                f"state (lazy_adam) + {gib(2.5 * (tables + adam))} for async checkpoint saves "
                f"(checkpoint.async_save=False: {gib(1.5 * (tables + adam))}) + margin = {gib(need)}, but 64.0 GiB of "
                f"host memory (MemAvailable in /proc/meminfo) is available. Largest tables: {largest}. Shrink them: "
                f"embedding.dim (512), a compression method (embedding.method: hashing, qr, md, tt, fiited, ...), "
                f"fewer rows (data.vocab_sizes), or shard them over more devices (mesh.shape; the devices of one CPU "
                f"host share its memory, so on CPU that means more hosts), or put tables in host memory or on disk "
                f"(tiering.tables); or train.check_memory=False to start anyway")
    with pytest.raises(ConfigError) as error:
        check_memory(config, task, one_device(task.collection))
    assert str(error.value) == expected
    assert gib(tables) == "64.4 GiB"  # the "69 GB" (decimal)


def test_the_memory_check_at_its_boundary_and_its_opt_outs(monkeypatch, tmp_path):
    """The state (tables + optimizer state), hand-computed for the tiny config, x (1 + margin) + the checkpoint saves
    + the fixed margin, against MemAvailable one byte short and exactly enough; synchronous saves count less, no
    checkpoints nothing; train.check_memory=False skips the check."""
    from recjax.errors import ConfigError
    from recjax.guards import MEMORY_MARGIN, MEMORY_MARGIN_BYTES, check_memory

    config = tiny_config()
    spec = DatasetSpec(13, tuple(FeatureSpec(f"C{i + 1}", v) for i, v in enumerate(config.data.vocab_sizes)))
    task = build_task(config, spec)
    state = sum(config.data.vocab_sizes) * 8 * 4 * 3  # dim 8, lazy Adam: table, m, v
    for async_save, enabled, saves in ((True, True, 2.5), (False, True, 1.5), (True, False, 0.0)):
        config.checkpoint.async_save, config.checkpoint.enabled = async_save, enabled
        need = math.ceil(state * (1 + MEMORY_MARGIN) + saves * state + MEMORY_MARGIN_BYTES)
        fixed_memory(monkeypatch, need - 1)
        with pytest.raises(ConfigError, match="^embedding: the model does not fit"):
            check_memory(config, task, one_device(task.collection))
        fixed_memory(monkeypatch, need)
        check_memory(config, task, one_device(task.collection))
    config.train.check_memory = False
    fixed_memory(monkeypatch, 0)
    check_memory(config, task, one_device(task.collection))
