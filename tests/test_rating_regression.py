"""Rating regression and matrix factorisation: the regression objective (squared error, mse / rmse / mae), the MF
model, MovieLens' rating target and ids-only features, md_blocks' base-dim search, and the trainer's warning when the
selected step is the last of the budget. Oracles: a numpy MF forward, the metrics and losses by hand."""

import json
import pathlib
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from test_movielens import write_1m

from compression.plan import md_blocks_base_dim
from experiments.configs import dlrm_movielens, mf_movielens
from recjax import metrics
from recjax.batch import Batch, validate_batch
from recjax.data.arrays import ArrayDataset
from recjax.data.movielens import movielens_dataset
from recjax.errors import ConfigError
from recjax.models import MatrixFactorization, make_model
from recjax.specs import DatasetSpec, FeatureSpec
from recjax.step import init_state, make_predict_step, make_train_step
from recjax.task import OBJECTIVES, build_task
from recjax.train import Run, train_and_evaluate


# ------------------------------------------------------------------------------------------------ the model
def test_mf_forward_matches_numpy():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(7, 2, 5)).astype(np.float32)
    dense = np.zeros((7, 0), np.float32)
    model = make_model(ml_collections.ConfigDict({"name": "mf", "mf": {}}), 5)
    assert isinstance(model, MatrixFactorization)
    params = model.init(jax.random.key(0), dense, emb)["params"]
    assert jax.tree.map(jnp.shape, params) == {"mu": ()}
    params = {"mu": jnp.float32(3.5)}
    out = np.asarray(model.apply({"params": params}, dense, emb))
    expected = 3.5 + np.einsum("bd,bd->b", emb[:, 0].astype(np.float64), emb[:, 1].astype(np.float64))
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_mf_refuses_other_fields_and_dense_features():
    model = MatrixFactorization()
    with pytest.raises(ValueError, match=r"^mf scores the inner product of two sparse features \(user, item\), but the "
                                         r"data has 3; use MovieLens with data.features='user_item'"):
        model.init(jax.random.key(0), jnp.zeros((2, 0)), jnp.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match=r"^mf uses the two ids only, but the data has 2 dense features"):
        model.init(jax.random.key(0), jnp.zeros((2, 2)), jnp.zeros((2, 2, 4)))


# ---------------------------------------------------------------------------------------------- metrics
def test_regression_metrics_by_hand():
    labels, predictions = np.array([1.0, 3.0, 5.0, 4.0]), np.array([2.0, 3.0, 3.0, 4.5])
    got = metrics.regression_metrics(labels, predictions)
    # errors 1, 0, -2, 0.5: squares 1, 0, 4, 0.25 (mean 1.3125); absolute 1, 0, 2, 0.5 (mean 0.875)
    assert got == pytest.approx({"mse": 1.3125, "rmse": 1.3125 ** 0.5, "mae": 0.875, "eval_examples": 4,
                                 "eval_mean": 3.25})
    assert metrics.better("mse", 0.8, 0.9) and not metrics.better("mse", 0.9, 0.8)
    assert metrics.better("auc", 0.9, 0.8) and metrics.better("logloss", 0.4, 0.5)


def test_regression_labels_may_be_any_finite_value_binary_ones_only_0_or_1():
    features = (FeatureSpec("user", 4), FeatureSpec("item", 3))
    batch = Batch(dense=np.zeros((2, 0), np.float32), ids={"user": np.array([[0], [3]], np.int32),
                                                           "item": np.array([[1], [2]], np.int32)},
                  lengths={"user": np.ones(2, np.int32), "item": np.ones(2, np.int32)},
                  labels=np.array([4.0, 2.5], np.float32))
    validate_batch(batch, DatasetSpec(0, features, target="regression"))
    with pytest.raises(ValueError, match=r"label of example 0 is 4.0; labels must be 0 or 1"):
        validate_batch(batch, DatasetSpec(0, features))
    nan = batch.replace(labels=np.array([4.0, np.nan], np.float32))
    with pytest.raises(ValueError, match=r"label of example 1 is nan; regression labels must be finite"):
        validate_batch(nan, DatasetSpec(0, features, target="regression"))
    with pytest.raises(ValueError, match="target must be one of"):
        DatasetSpec(0, features, target="ranking")


# ------------------------------------------------------------------------------------------------- data
def test_movielens_rating_target_with_user_and_item_only(tmp_path):
    directory = write_1m(tmp_path / "ml")
    config = dlrm_movielens.data_config()
    config.dir = str(directory)
    config.target, config.features = "rating", "user_item"
    config.split.validation_fraction = config.split.test_fraction = 0.2
    data = movielens_dataset(config)
    assert data.spec.target == "regression" and data.spec.num_dense == 0
    assert [f.name for f in data.spec.features] == ["user", "item"]
    # ratings.dat's five lines (write_1m): users 1, 1, 2, 10, 10 -> 0, 0, 1, 2, 2; movies 1193, 661, 1193, 2, 661
    # -> 2, 1, 2, 0, 1 (dense ids in raw-id order); the stars are the labels.
    stars = {(0, 2): 5.0, (0, 1): 3.0, (1, 2): 4.0, (2, 0): 1.0, (2, 1): 4.0}
    seen = {}
    for split in ("train", "validation", "test"):
        batch = data.splits[split]
        assert batch.dense.shape == (batch.size, 0) and set(batch.ids) == {"user", "item"}
        for u, i, y in zip(batch.ids["user"][:, 0], batch.ids["item"][:, 0], batch.labels, strict=True):
            seen[(int(u), int(i))] = float(y)
    assert seen == stars
    assert data.info()["mean_rating"] == pytest.approx(17 / 5) and data.info()["target"] == "rating"
    # Per-id train counts (md_blocks' popularity), scaled to the examples a run draws, against a plain count.
    train = data.splits["train"]
    counts = data.id_counts(3 * train.size)
    for name in ("user", "item"):
        brute = np.zeros(data.spec.features[0 if name == "user" else 1].vocab_size)
        for x in train.ids[name][:, 0]:
            brute[x] += 3
        np.testing.assert_array_equal(counts[name], brute)

    config.target = "stars"
    with pytest.raises(ConfigError, match=r"^data.target: unknown MovieLens target 'stars'"):
        movielens_dataset(config)


def test_array_dataset_id_counts_count_every_valid_bag_slot():
    spec = DatasetSpec(0, (FeatureSpec("tags", 5, bag_size=3),))
    ids = np.array([[1, 2, 4], [1, 1, 0], [3, 0, 0]], np.int32)
    lengths = np.array([3, 2, 1], np.int32)
    batch = Batch(dense=np.zeros((3, 0), np.float32), ids={"tags": ids}, lengths={"tags": lengths},
                  labels=np.zeros(3, np.float32))
    counts = ArrayDataset(spec, {"train": batch}).id_counts()
    np.testing.assert_array_equal(counts["tags"], [0, 3, 1, 1, 1])  # the padding 0s are not ids


# ------------------------------------------------------------------------------------------------ the step
def small_rating_dataset(n: int = 512, users: int = 30, items: int = 20, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    u, i = rng.integers(0, users, n).astype(np.int32), rng.integers(0, items, n).astype(np.int32)
    p, q = rng.normal(size=(users, 3)), rng.normal(size=(items, 3))
    stars = np.clip(np.round(3.5 + np.einsum("bd,bd->b", p[u], q[i])), 1, 5).astype(np.float32)
    spec = DatasetSpec(0, (FeatureSpec("user", users), FeatureSpec("item", items)), target="regression")

    def part(index):
        return Batch(dense=np.zeros((index.size, 0), np.float32), ids={"user": u[index, None], "item": i[index, None]},
                     lengths={"user": np.ones(index.size, np.int32), "item": np.ones(index.size, np.int32)},
                     labels=stars[index])

    cut = np.split(np.arange(n), [n * 8 // 10, n * 9 // 10])
    return ArrayDataset(spec, dict(zip(("train", "validation", "test"), map(part, cut), strict=True)))


def mf_config(dim: int = 4) -> ml_collections.ConfigDict:
    config = mf_movielens.get_config()
    config.embedding.dim = dim
    config.train.batch_size = 64
    config.optimizer.sparse.name = "sgd"
    config.optimizer.sparse.weight_decay = 0.0
    return config


def test_the_rating_step_minimises_the_squared_error_and_predicts_the_rating():
    """The step's loss is mean((mu + <p_u, q_i> - stars)^2) over the batch, from the state's own rows (numpy), and the
    predict step returns the rating itself (no sigmoid); one SGD step moves each row by -lr * its gradient."""
    data = small_rating_dataset()
    config = mf_config()
    task = build_task(config, data.spec, data, total_steps=10)
    assert task.objective is OBJECTIVES["regression"]
    batch = next(data.train_batches(64))
    state = init_state(task, jax.random.key(0), batch)
    state = state.replace(dense_params={**state.dense_params, "model": {"mu": jnp.float32(3.0)}})
    got = np.asarray(make_predict_step(task)(state, batch), np.float64)
    p_u = _rows_of(task, state, "user", batch.ids["user"][:, 0])
    q_i = _rows_of(task, state, "item", batch.ids["item"][:, 0])
    expected = 3.0 + np.einsum("bd,bd->b", p_u, q_i)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    train = make_train_step(task)
    _, step_metrics = train(state, batch)
    np.testing.assert_allclose(float(step_metrics["loss"]), np.mean((expected - batch.labels) ** 2), rtol=1e-5)


def _rows_of(task, state, feature: str, ids: np.ndarray) -> np.ndarray:
    """f64[B, D]: a full table's rows for `ids`, read from the stacked group at the table's offset (numpy)."""
    (placed,) = [p for p in task.collection.physical_tables() if p.feature == feature]
    return np.asarray(state.tables[placed.group], np.float64)[placed.offset + np.asarray(ids)]


def test_select_on_must_be_the_objectives_metric():
    data = small_rating_dataset()
    config = mf_config()
    config.train.select_on = "auc"
    with pytest.raises(ConfigError, match=r"^train.select_on: 'auc' is not a metric of this dataset's regression "
                                          r"labels \(it reports mse, rmse, mae\); set --config.train.select_on=mse"):
        build_task(config, data.spec, data)


@pytest.mark.slow  # two MF runs on ML-100K (~15 s each idle)
def test_mf_on_ml100k_beats_predicting_the_mean_and_reports_mse(tmp_path):
    from test_movielens import _shared_data

    directory = _shared_data() / "movielens_100k"
    if not (directory / "u.data").is_file():
        pytest.skip(f"ML-100K not found at {directory}")
    config = mf_movielens.get_config()
    config.data.dir = str(directory)
    config.data.prepared_dir = str(tmp_path / "prepared")
    config.train.progress_bar = False
    config.checkpoint.enabled = False
    summary = train_and_evaluate(config, tmp_path / "mf")
    assert summary["select_on"] == "mse" and "auc" not in summary
    test_var = _test_variance(config)
    assert summary["test"]["eval_examples"] == 10_000
    assert summary["mse"] < 0.8 * test_var, (summary["mse"], test_var)  # far better than the mean (~1.27)
    assert summary["rmse"] == pytest.approx(summary["mse"] ** 0.5)
    assert summary["embedding_params"] == (943 + 1682) * 64
    header = (tmp_path / "mf" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header == ["step", "split", "examples", "epoch", "loss", "mse", "rmse", "mae", "examples_per_sec",
                      "elapsed_s"]
    # md_blocks (Ginart et al.'s MF setting) at an eighth of the params: the base dim found for it fits the budget.
    counts = movielens_dataset(config.data).id_counts()
    d0 = md_blocks_base_dim(counts, summary["embedding_params"] / 8, 64, {"alpha": 0.3})
    md = mf_movielens.get_config()
    md.data = config.data
    md.train.progress_bar, md.checkpoint.enabled = False, False
    md.embedding.dim = d0
    md.embedding.method, md.embedding.id_counts = "md_blocks", "dataset"
    md.embedding.options.alpha = 0.3
    small = train_and_evaluate(md, tmp_path / "md")
    assert small["embedding_params"] <= summary["embedding_params"] / 8
    assert small["mse"] < test_var


def _test_variance(config) -> float:
    data = movielens_dataset(config.data)
    return float(np.var(data.splits["test"].labels.astype(np.float64)))


# --------------------------------------------------------------------------------------- md_blocks' base dim
def test_md_blocks_base_dim_is_the_largest_that_fits_by_hand():
    """One table of 100 ids, blocks (0.1, 1.0): block 0 (the 10 hottest, count 10 each) at d0, block 1 (90 ids,
    count 1 each) at round(d0 (1/10)^0.5), projected to d0 when narrower."""
    counts = {"item": np.r_[np.full(10, 10.0), np.ones(90)]}
    options = {"alpha": 0.5, "blocks": (0.1, 1.0)}

    def by_hand(d0):
        d1 = min(max(round(d0 * 0.1 ** 0.5), 1), d0)
        return 10 * d0 + 90 * d1 + (d1 * d0 if d1 < d0 else 0)

    for budget in (100, 400, 1000, 2500):
        want = max(d for d in range(1, 33) if by_hand(d) <= budget)
        assert md_blocks_base_dim(counts, budget, 32, options) == want, budget
    with pytest.raises(ValueError, match=r"md_blocks cannot fit 50 params: at base dim 1 \(every block 1 wide\) its "
                                         r"tables take 100, 32.00x fewer than full tables at dim 32"):
        md_blocks_base_dim(counts, 50, 32, options)


# ------------------------------------------------------------------------------- the last step of the budget
def fake_run(best_step: int, steps: int, evaluations: int, budget_key: str = "epochs"):
    selection = types.SimpleNamespace(best_step=best_step, select_on="mse")
    config = ml_collections.ConfigDict({"train": {"steps": None if budget_key == "epochs" else steps,
                                                  "epochs": 2.0 if budget_key == "epochs" else None}})
    history = [{"split": "validation"}] * evaluations + [{"split": "train"}] * 3
    return types.SimpleNamespace(loop=types.SimpleNamespace(selection=selection), config=config,
                                 budget=types.SimpleNamespace(steps=steps),
                                 log=types.SimpleNamespace(history=history))


def test_a_run_selected_at_its_last_step_says_so():
    late = Run._selected_at_budget_end(fake_run(300, 300, 3), None)
    assert late == ("the selected step 300 is the last of the budget: validation mse was still improving when the "
                    "budget ended, so these test figures understate what this config reaches; raise train.epochs "
                    "(summary.json: selected_step = budget_steps)")
    assert "raise train.steps" in Run._selected_at_budget_end(fake_run(300, 300, 3, "steps"), None)
    assert Run._selected_at_budget_end(fake_run(200, 300, 3), None) is None  # selected earlier
    assert Run._selected_at_budget_end(fake_run(300, 300, 1), None) is None  # one evaluation: nothing to select
    assert Run._selected_at_budget_end(fake_run(300, 300, 3), "training diverged") is None


@pytest.mark.slow  # a short synthetic run end to end
def test_the_warning_reaches_the_summary(tmp_path):
    from experiments.configs import dlrm_synthetic

    config = dlrm_synthetic.get_config()
    config.data.vocab_sizes = (50, 40)
    config.data.eval_examples = 256
    config.train.steps, config.train.eval_every, config.train.batch_size = 40, 20, 64
    config.train.progress_bar, config.checkpoint.enabled = False, False
    summary = train_and_evaluate(config, tmp_path)
    late = [w for w in summary["warnings"] if "is the last of the budget" in w]
    assert bool(late) == (summary["selected_step"] == summary["budget_steps"]), summary["warnings"]
    assert json.loads((pathlib.Path(tmp_path) / "summary.json").read_text())["warnings"] == summary["warnings"]
