"""experiments/sweep_models.py: per (model, seed) the run with the best validation metric is kept, the summary is
the mean and std of the kept runs' test metrics, and a re-run resumes without training."""

import csv

import numpy as np
import pytest
from test_train import tiny_config

from experiments import sweep_models as sm


def test_sweep_keeps_the_best_validation_run_and_summarizes_test(tmp_path):
    base = tiny_config(steps=20)
    base.train.eval_every = 10
    base.data.eval_examples = 1024
    grid = sm.parse_grid(["optimizer.sparse.learning_rate=0.003,0.03"])
    assert grid == {"optimizer.sparse.learning_rate": [0.003, 0.03]}
    rows, summary = sm.run_sweep(base, tmp_path, ["lr"], [0, 1], grid, log=lambda _: None)
    assert len(rows) == 4 and {r["model"] for r in rows} == {"lr"}
    saved = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(saved) == 4
    for model in ("lr",):
        for seed in (0, 1):
            runs = [r for r in rows if r["model"] == model and r["seed"] == seed]
            best = max(runs, key=lambda r: r["validation_auc"])  # the oracle: validation alone decides
            assert [r["kept"] for r in runs] == [r is best for r in runs]
        kept_auc = [r["auc"] for r in rows if r["model"] == model and r["kept"]]
        line = next(s for s in summary if s["model"] == model)
        assert line["auc_mean"] == pytest.approx(np.mean(kept_auc))
        assert line["auc_std"] == pytest.approx(np.std(kept_auc, ddof=1))
    assert (tmp_path / "results_summary.csv").exists()
    assert sm.format_table(summary)[1].startswith("lr")
    # A synthetic stream has no epochs: neither the epochs trained nor the selected epoch is a number.
    assert all(r["epochs"] is None and r["selected_epoch"] is None for r in rows)
    assert summary[0]["epochs_mean"] == summary[0]["selected_epoch_mean"] == 0.0
    # Resumed: every run is read back, nothing trains.
    messages = []
    again, _ = sm.run_sweep(base, tmp_path, ["lr"], [0, 1], grid, log=messages.append)
    swap, *runs = messages  # the synthetic config has no lr defaults: one warning for the model, then the runs
    assert swap.startswith("WARNING: model.name=lr: this config's learning rates and regularisation were tuned")
    assert all("done before" in m for m in runs) and [r["auc"] for r in again] == [r["auc"] for r in rows]


def test_each_family_gets_the_values_its_config_tuned_for_it_but_the_users_and_the_grids_win():
    from experiments.configs import dlrm_movielens

    base = dlrm_movielens.get_config()
    base.optimizer.dense.learning_rate = 0.002  # as given on the command line
    lines = []
    config = sm.run_config(base, "lr", 1, {"optimizer.sparse.weight_decay": 1e-4}, {"optimizer.dense.learning_rate"},
                           lines.append)
    assert (config.seed, config.model.name, config.optimizer.sparse.weight_decay) == (1, "lr", 1e-4)  # the grid's
    assert config.optimizer.dense.learning_rate == 0.002  # the user's
    assert (config.optimizer.sparse.learning_rate, config.train.batch_size, config.train.epochs) == (0.1, 256, 20)
    assert lines == ["model.name=lr: this config's lr defaults replace those it tuned for dlrm (config.model_defaults"
                     ".lr): train.batch_size 512 -> 256, train.epochs 10 -> 20; kept as set explicitly: "
                     "optimizer.dense.learning_rate=0.002, optimizer.sparse.weight_decay=0.0001"]
    dlrm = sm.run_config(base, "dlrm", 1, {}, (), lines.append)  # the config's own family: nothing to swap
    base.seed, base.train.progress_bar = 1, False  # what run_config sets for every run
    assert dlrm.to_dict() == base.to_dict() and len(lines) == 1


def test_unknown_models_and_empty_sweeps_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'svm'"):
        sm.run_sweep(tiny_config(steps=5), tmp_path, ["svm"], [0], log=lambda _: None)
    with pytest.raises(ValueError, match="no runs"):
        sm.run_sweep(tiny_config(steps=5), tmp_path, [], [0], log=lambda _: None)
    with pytest.raises(ValueError, match="the config has no field 'optimizer.sparse.lr'"):
        sm.run_sweep(tiny_config(steps=5), tmp_path, ["lr"], [0], {"optimizer.sparse.lr": [0.1]}, log=lambda _: None)
    with pytest.raises(ValueError, match="expected KEY=V1,V2"):
        sm.parse_grid(["optimizer.sparse.learning_rate"])
    assert sm.run_name("fm", 2, {"optimizer.sparse.weight_decay": 0.001, "train.batch_size": 256}) == (
        "fm_weight_decay0.001_batch_size256_seed2")
