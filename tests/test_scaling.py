"""The scaling-law sweep: the power-law fit, equal-FLOPs comparisons, the ladders, a tiny sweep and the notebook."""

import json
import math
import pathlib

import jax
import numpy as np
import pytest
from conftest import run_notebook

from experiments import scaling_fit as sf
from experiments import sweep_scaling as ss
from experiments.configs import scaling
from recjax.data import make_dataset
from recjax.step import init_state, make_predict_step
from recjax.task import build_task
from recjax.train import flops_per_example

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "experiments" / "notebooks" / "scaling_law.ipynb"


# ------------------------------------------------------------------------------------------ the fit
@pytest.mark.parametrize("a,b,c", [(3.0, 0.3, 0.4), (50.0, 0.7, 0.35), (0.8, 0.05, 0.5)])
def test_fit_recovers_an_exact_power_law(a, b, c):
    flops = np.geomspace(2e4, 9e6, 7)
    fit = sf.fit_power_law(flops, a * flops**-b + c)
    assert fit["a"] == pytest.approx(a, rel=1e-4)
    assert fit["b"] == pytest.approx(b, rel=1e-4)
    assert fit["c"] == pytest.approx(c, abs=1e-6)
    assert fit["r2"] == pytest.approx(1.0) and fit["rmse"] < 1e-8
    assert (fit["points"], fit["distinct_flops"], fit["flops_min"], fit["flops_max"]) == (7, 7, 2e4, 9e6)
    assert fit["meaningful"] and fit["warnings"] == []
    np.testing.assert_allclose(sf.predict(fit, flops), a * flops**-b + c, rtol=1e-6)


def test_fit_with_noise_is_close_and_r2_drops():
    rng = np.random.default_rng(0)
    flops = np.repeat(np.geomspace(5e4, 5e6, 6), 3)  # 3 seeds per size
    clean = 2.0 * flops**-0.25 + 0.38
    fit = sf.fit_power_law(flops, clean + rng.normal(0, 2e-3, flops.size))
    assert fit["b"] == pytest.approx(0.25, abs=0.1)
    assert fit["c"] == pytest.approx(0.38, abs=0.02)
    assert 0.8 < fit["r2"] < 1.0


def test_fit_reports_a_loss_that_grows_with_compute_as_it_is():
    flops = np.geomspace(1e4, 1e6, 5)
    growing = sf.fit_power_law(flops, 0.5 - 0.2 * flops**-0.3)
    assert growing["a"] == pytest.approx(-0.2, rel=1e-4)  # not clamped; the verdict says what is wrong
    assert not growing["meaningful"]


F3, F6, F8 = (np.geomspace(1e4, 1e6, n) for n in (3, 6, 8))


def power_law(flops, a=2.0, b=0.3, c=0.4):
    return a * flops**-b + c


# Each case: the data, the floor, and the exact warnings (by their leading phrase) the verdict must give.
VERDICT_CASES = {
    "exact law, 6 sizes": (F6, power_law(F6), 0.0, []),
    "exact law, 3 sizes": (F3, power_law(F3), 0.0, ["too few points"]),
    "exact law, 4 sizes x 2 seeds": (np.repeat(F6[:4], 2), power_law(np.repeat(F6[:4], 2)), 0.0, ["too few points"]),
    "noisy flat": (F8, [0.402, 0.397, 0.401, 0.404, 0.396, 0.400, 0.403, 0.398], 0.0,
                   ["low R^2", "exponent at the search bound"]),  # a sharp knee into the noise is the best it finds
    "all equal": (F6, np.full(6, 0.4), 0.0, ["no variation"]),
    "a step after the first size": (F6, np.where(F6 < 2e4, 0.6, 0.4), 0.0, ["exponent at the search bound"]),
    "rising": (F6, power_law(F6, a=-0.2, c=0.5), 0.0, ["loss does not fall with FLOPs"]),
    # The issue's `8.095 * FLOPs^-0.0010 + -7.4727`: a straight line in log F sends b to 0 and c far below 0.
    "a straight line in log FLOPs": (F6, 0.5 - 0.01 * np.log(F6 / 1e4), 0.0,
                                     ["exponent at the search bound", "asymptote below the floor"]),
    "asymptote below the Bayes floor": (F6, power_law(F6, c=0.1), 0.2, ["asymptote below the floor"]),
}


@pytest.mark.parametrize("flops,loss,floor,expected", VERDICT_CASES.values(), ids=VERDICT_CASES.keys())
def test_fit_verdict_names_every_reason_a_fit_is_not_a_law(flops, loss, floor, expected):
    fit = sf.fit_power_law(flops, loss, floor=floor)
    assert [w.split(":")[0] for w in fit["warnings"]] == expected, fit["warnings"]
    assert fit["meaningful"] == (not expected)
    assert all(len(w) > len(w.split(":")[0]) + 10 for w in fit["warnings"])  # each says why, with the values


def test_verdict_thresholds():
    x = dict(a=1.0, b=0.5, c=0.3, r2=0.9, distinct_flops=5)
    assert sf.fit_warnings(x) == []
    assert sf.fit_warnings({**x, "distinct_flops": 4})[0].startswith("too few points")
    assert sf.fit_warnings({**x, "r2": sf.R2_MIN}) == [] and sf.fit_warnings({**x, "r2": 0.79})[0].startswith("low R^2")
    for b in (sf.B_RANGE[0], sf.B_RANGE[0] * 1.005, sf.B_RANGE[1], sf.B_RANGE[1] / 1.005):
        assert sf.fit_warnings({**x, "b": b})[0].startswith("exponent at the search bound"), b
    assert sf.fit_warnings({**x, "b": sf.B_RANGE[0] * 1.02}) == [] and sf.fit_warnings({**x, "b": 3.9}) == []
    assert sf.fit_warnings({**x, "a": 0.0})[0].startswith("loss does not fall")
    assert sf.fit_warnings({**x, "c": 0.3}, floor=0.3) == [] and sf.fit_warnings({**x, "c": -1e-9}) != []


def test_noise_is_rarely_called_a_law():
    """Sizes with no trend at all (Gaussian losses around one value): the verdict calls few of the fits meaningful,
    and the R^2 threshold is what rejects most of them."""
    rng = np.random.default_rng(0)
    verdicts = [sf.fit_power_law(F6, 0.4 + rng.normal(0, 0.005, 6)) for _ in range(200)]
    assert np.mean([v["meaningful"] for v in verdicts]) < 0.05
    assert np.mean([any(w.startswith("low R^2") for w in v["warnings"]) for v in verdicts]) > 0.9


@pytest.mark.parametrize("flops,loss,match", [
    ([1e4, 1e4, 1e5], [0.5, 0.5, 0.4], "3 distinct FLOPs"),
    ([1e4, 0.0, 1e5], [0.5, 0.45, 0.4], "> 0"),
    ([1e4, 2e4, 1e5], [0.5, float("nan"), 0.4], "finite"),
    ([1e4, 2e4, 1e5], [0.5, 0.4], "same length"),
])
def test_fit_rejects_data_it_cannot_fit(flops, loss, match):
    with pytest.raises(ValueError, match=match):
        sf.fit_power_law(flops, loss)


def test_interpolation_is_linear_in_log_flops_and_averages_seeds():
    flops, loss = [1e4, 1e4, 1e6], [0.50, 0.52, 0.40]
    assert sf.interpolate_loss(flops, loss, 1e5) == pytest.approx(0.5 * (0.51 + 0.40))
    assert sf.interpolate_loss(flops, loss, 1e4) == pytest.approx(0.51)
    assert sf.interpolate_loss(flops, loss, 2e6) is None and sf.interpolate_loss(flops, loss, 5e3) is None


def test_equal_flops_comparison_sees_a_constant_gap_only_on_the_overlap():
    grid = np.geomspace(1e4, 1e7, 7)
    law = lambda x: 2.0 * x**-0.3 + 0.4  # noqa: E731
    points = {"wukong": (list(grid[2:]), list(law(grid[2:]) - 0.01)),  # better by 0.01 everywhere
              "dlrm": (list(grid[:5]), list(law(grid[:5])))}
    fits = {k: sf.fit_power_law(*v) for k, v in points.items()}
    out = sf.compare_at_equal_flops("wukong", "dlrm", points, fits)
    assert out["overlap_flops"] == [pytest.approx(grid[2]), pytest.approx(grid[4])]
    assert out["measured"]["comparisons"] == 3  # wukong sizes 2, 3, 4 lie inside dlrm's range
    assert out["measured"]["mean_gap"] == pytest.approx(0.01, abs=1e-6)
    assert out["measured"]["family_better"] == 1.0
    assert out["fitted"]["mean_gap"] == pytest.approx(0.01, abs=1e-4) and out["fitted"]["family_better"] == 1.0
    assert out["fitted"]["meaningful"] and out["fitted"]["warnings"] == []
    # A fit that is not meaningful carries over to the fitted comparison, named; the measured one is unchanged.
    three = {"wukong": points["wukong"], "dlrm": (list(grid[1:4]), list(law(grid[1:4])))}
    flagged = sf.compare_at_equal_flops("wukong", "dlrm", three, {k: sf.fit_power_law(*v) for k, v in three.items()})
    assert not flagged["fitted"]["meaningful"]
    assert [w.split(":")[0] for w in flagged["fitted"]["warnings"]] == ["dlrm fit"]
    assert "too few points" in flagged["fitted"]["warnings"][0]
    assert flagged["measured"]["mean_gap"] == pytest.approx(0.01, abs=1e-6)
    disjoint = {"wukong": points["wukong"], "dlrm": ([1.0, 2.0, 3.0], [0.6, 0.5, 0.45])}
    none = sf.compare_at_equal_flops("wukong", "dlrm", disjoint, {})
    assert none["overlap_flops"] is None and none["measured"]["comparisons"] == 0 and "fitted" not in none


# ------------------------------------------------------------------------------------ ladders, configs
def test_point_configs_set_every_ladder_knob_and_the_hard_teacher():
    for family, ladder in scaling.LADDERS.items():
        for size, knobs in enumerate(ladder):
            config = scaling.point_config(family, size)
            assert config.model.name == family
            assert {k: config.model[family][k] for k in knobs} == knobs
            assert config.data.teacher.tuples > 0 and max(config.data.vocab_sizes) <= scaling.VOCAB_CAP
            assert (config.train.steps, config.train.batch_size) == (scaling.STEPS, scaling.BATCH_SIZE)
    assert scaling.get_config("dcnv2,2").model.dcnv2.low_rank == scaling.LADDERS["dcnv2"][2]["low_rank"]


@pytest.mark.parametrize("arg,match", [("mlp,0", "unknown model family"), ("wukong,9", "sizes 0..5"),
                                       ("wukong,x", "family,size")])
def test_bad_points_are_rejected(arg, match):
    with pytest.raises(ValueError, match=match):
        scaling.get_config(arg)


def test_a_ladder_knob_the_model_does_not_have_is_rejected():
    with pytest.raises(ValueError, match="'num_heads' is not a field"):
        scaling.point_config("dlrm", 0, {"dlrm": [dict(num_heads=4)]})


def test_sweep_points_validate_families_and_sizes():
    assert ss.sweep_points(["dlrm"], [0, 1], ss.TINY_LADDERS, [0, 2]) == [
        ("dlrm", 0, 0), ("dlrm", 2, 0), ("dlrm", 0, 1), ("dlrm", 2, 1)]
    with pytest.raises(ValueError, match="unknown model family"):
        ss.sweep_points(["transformer"], [0], ss.TINY_LADDERS)
    with pytest.raises(ValueError, match="sizes 0..2"):
        ss.sweep_points(["dlrm"], [0], ss.TINY_LADDERS, [3])


@pytest.mark.slow
def test_ladders_grow_flops_and_span_two_orders_of_magnitude():
    """FLOPs/example from the compiled forward step rise along every ladder; each family covers >= 60x and the
    sweep as a whole >= 100x."""
    dataset = make_dataset(scaling.point_config("dlrm", 0).data, seed=0)
    batch = next(dataset.train_batches(64))
    spans = []
    for family, ladder in scaling.LADDERS.items():
        flops = []
        for size in range(len(ladder)):
            task = build_task(scaling.point_config(family, size), dataset.spec)
            state = jax.eval_shape(lambda task=task: init_state(task, jax.random.key(0), batch))  # shapes only
            flops.append(flops_per_example(make_predict_step(task).lower(state, batch).compile(), 64))
        assert all(b > a for a, b in zip(flops, flops[1:], strict=False)), (family, flops)
        assert flops[-1] / flops[0] >= 60, (family, flops)
        spans.append((flops[0], flops[-1]))
    assert max(hi for _, hi in spans) / min(lo for lo, _ in spans) >= 100


# ---------------------------------------------------------------------------------------- tiny sweep
@pytest.mark.slow  # nine runs and a resume
def test_tiny_sweep_writes_results_fit_and_plot_and_resumes(tmp_path):
    lines = []
    rows, fit = ss.run_sweep(tmp_path, ["wukong", "dlrm"], [0], steps=10, tiny_setting=True, log=lines.append)
    assert [(r["family"], r["size"]) for r in rows] == [(f, s) for f in ("wukong", "dlrm") for s in range(3)]
    results = ss.read_results(tmp_path / "results.csv")
    assert len(results) == 6
    for row in results:
        summary = json.loads((tmp_path / row["run"] / "summary.json").read_text())
        assert row["flops_per_example"] == pytest.approx(summary["flops_per_example"])
        assert row["logloss"] == pytest.approx(summary["logloss"])
        assert row["dense_params"] == summary["params"] - summary["embedding_params"]
        assert json.loads(row["model"]) == json.loads(json.dumps(ss.TINY_LADDERS[row["family"]][row["size"]]))
        assert math.isfinite(row["bayes_logloss"]) and row["bayes_logloss"] < row["logloss"] + 0.05
    for family in ("wukong", "dlrm"):
        flops = [r["flops_per_example"] for r in results if r["family"] == family]
        assert flops == sorted(flops) and flops[-1] > 5 * flops[0]
    saved = json.loads((tmp_path / "fit.json").read_text())
    assert set(saved["fits"]) == {"wukong", "dlrm"} and set(saved["equal_flops"]) == {"wukong_vs_dlrm"}
    assert saved["fits"]["dlrm"]["points"] == 3 and saved["examples_per_run"] == 10 * 128
    # 3 sizes per family: no fit is a law, and the file, the comparison and the console all say so.
    for family, f in saved["fits"].items():
        assert f["meaningful"] is False and f["warnings"][0].startswith("too few points: 3 distinct"), family
        assert f["warnings"] == sf.fit_warnings(f, floor=saved["bayes_logloss"])
    fitted = saved["equal_flops"]["wukong_vs_dlrm"].get("fitted")
    assert fitted is None or (fitted["meaningful"] is False and fitted["warnings"])
    report = lines[6:]  # after the 6 run lines
    assert report == ss.fit_report(saved)
    for family, f in saved["fits"].items():
        fit_line = next(i for i, line in enumerate(report) if line.strip().startswith(f"{family}: logloss ="))
        assert report[fit_line + 1] == f"WARNING: {family} fit is not meaningful: {'; '.join(f['warnings'])}"
    assert saved["flops_range"] == [min(r["flops_per_example"] for r in results),
                                    max(r["flops_per_example"] for r in results)]
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A second call trains nothing and gives the same results.
    again = []
    rows2, _ = ss.run_sweep(tmp_path, ["wukong", "dlrm"], [0], steps=10, tiny_setting=True, log=again.append)
    assert all("done before, skipped" in line for line in again[:6]) and again[6:] == report
    assert [r["logloss"] for r in rows2] == [r["logloss"] for r in rows]
    # Another budget in the same workdir would mix results: refused.
    with pytest.raises(ValueError, match="different config.json"):
        ss.run_sweep(tmp_path, ["dlrm"], [0], steps=11, tiny_setting=True, log=lambda _: None)


def test_mark_best_lr_keeps_the_lowest_validation_logloss_of_each_point():
    rows = [dict(family="dlrm", size=0, seed=0, validation_logloss=0.50, logloss=0.40),
            dict(family="dlrm", size=0, seed=0, validation_logloss=0.48, logloss=0.60),  # test never decides
            dict(family="dlrm", size=1, seed=0, validation_logloss=0.47, logloss=0.47),
            dict(family="dlrm", size=0, seed=1, validation_logloss=0.49, logloss=0.49),
            dict(family="dlrm", size=0, seed=1, validation_logloss=0.49, logloss=0.30)]  # a tie keeps the first
    assert [r["best_lr"] for r in ss.mark_best_lr(rows)] == [False, True, True, True, False]


def test_learning_rate_tuning_trains_each_rate_and_keeps_the_best(tmp_path):
    rows, fit = ss.run_sweep(tmp_path, ["dlrm"], [0], sizes=[0], steps=5, tiny_setting=True,
                             learning_rates=[1e-3, 3e-2], log=lambda _: None)
    assert [(r["run"], r["learning_rate"]) for r in rows] == [("dlrm_size0_lr0.001_seed0", 1e-3),
                                                              ("dlrm_size0_lr0.03_seed0", 3e-2)]
    for row in rows:
        config = json.loads((tmp_path / row["run"] / "config.json").read_text())
        assert config["optimizer"]["dense"]["learning_rate"] == row["learning_rate"]
    assert rows[0]["logloss"] != rows[1]["logloss"]
    best = [r for r in ss.read_results(tmp_path / "results.csv") if r["best_lr"]]
    assert len(best) == 1 and best[0]["logloss"] == min(r["logloss"] for r in rows)
    assert fit["fits"] == {} and fit["learning_rates"] == [1e-3, 3e-2]  # one size: nothing to fit
    with pytest.raises(ValueError, match="learning rates must be > 0"):
        ss.run_config("dlrm", 0, 0, ss.TINY_LADDERS, learning_rate=0.0)


# ------------------------------------------------------------------------------------------- notebook
@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    run_notebook(NOTEBOOK, tmp_path, monkeypatch)
    results = ss.read_results(tmp_path / "results.csv")
    assert sorted({r["family"] for r in results}) == ["dcnv2", "dlrm", "wukong"] and len(results) == 9
    assert set(json.loads((tmp_path / "fit.json").read_text())["fits"]) == {"dcnv2", "dlrm", "wukong"}
    assert (tmp_path / "scaling.png").stat().st_size > 0
