"""The compression sweep: knobs that hit a target ratio, a tiny sweep's outputs, resuming, and the notebook."""

import csv
import json
import math
import pathlib
import struct

import pytest
from conftest import run_notebook

from experiments import runs
from experiments import sweep_compression as sc
from recjax.specs import DatasetSpec, FeatureSpec

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "experiments" / "notebooks" / "compression_pareto.ipynb"
VOCAB = (2000, 1000, 300, 20)  # C4 is under the default threshold (200) and stays full
DIM = 16


def tiny_base(steps: int = 30):
    config = sc.base_config("synthetic", steps=steps)
    config.data.vocab_sizes = VOCAB
    config.data.teacher.pairs = 4
    config.data.eval_examples = 2048
    config.train.batch_size = 256
    return config


def spec_of(vocab) -> DatasetSpec:
    return DatasetSpec(num_dense=13, features=tuple(FeatureSpec(f"C{i + 1}", n) for i, n in enumerate(vocab)))


def planned_ratio(spec: DatasetSpec, method: str, ratio: float, **kwargs) -> float:
    config = tiny_base()
    config.embedding.dim = DIM
    section = sc.embedding_section(method, spec, DIM, ratio, **kwargs)
    config.embedding.method, config.embedding.options, config.embedding.tables = (
        section.method, section.options, section.tables)
    accounting = sc.planned_accounting(spec, config)
    assert accounting["full_bytes"] == 4 * DIM * sum(f.vocab_size for f in spec.features)  # by hand
    return accounting["full_bytes"] / accounting["bytes"]


# ------------------------------------------------------------------------------------ knobs for a ratio
@pytest.mark.parametrize("method", ["hashing", "qr", "md", "tt"])
@pytest.mark.parametrize("ratio", [1, 2, 4, 8])
def test_knobs_hit_the_target_ratio(method, ratio):
    """The compressed tables make up for the one kept full, so the whole collection lands on the target."""
    spec = spec_of((50_000, 20_000, 3_000, 150, 40))
    # md dims are small integers; a TT rank step changes a table's params by ~2/rank
    tolerance = {"hashing": 0.001, "qr": 0.02, "md": 0.1, "tt": 0.1}[method]
    assert planned_ratio(spec, method, ratio) == pytest.approx(ratio, rel=tolerance)


def test_hashing_buckets_and_threshold():
    spec = spec_of((10_000, 4_000, 100))
    section = sc.embedding_section("hashing", spec, DIM, 4.0, threshold=200, seed=3)
    assert section.method == "hashing" and section.options.threshold == 200 and section.options.seed == 3
    assert sorted(section.tables) == ["C1", "C2"]  # C3 (100 ids) stays full
    b1, b2 = section.tables.C1.options.buckets, section.tables.C2.options.buckets
    # Bytes by hand: (b1 + b2 + 100) rows x D = (14_100 x D) / 4, so b1 + b2 = 3425, shared as 10_000 : 4_000.
    assert abs(b1 + b2 - 3425) <= 1
    assert b1 / b2 == pytest.approx(10_000 / 4_000, rel=0.01)


def qr_rows_brute_force(n: int) -> int:
    """The fewest rows QR can store n ids in: min over every m of ceil(n / m) + m."""
    return min(-(-n // m) + m for m in range(1, n + 1))


def test_qr_beyond_its_reach_is_an_error_holding_its_maximum_compression():
    spec = spec_of((5_000, 900))
    with pytest.raises(sc.UnreachableRatio, match=r"^qr cannot reach 1000x on these tables: the most it compresses "
                                                  r"them is \d+\.\d\dx") as caught:
        sc.embedding_section("qr", spec, DIM, 1000.0, threshold=0)
    section = caught.value.section  # the plan at maximum compression, which the sweep never runs in its place
    for name, n in (("C1", 5_000), ("C2", 900)):
        m = section.tables[name].options.collisions
        assert -(-n // m) + m == qr_rows_brute_force(n), (name, m)
    largest = 5_900 / (qr_rows_brute_force(5_000) + qr_rows_brute_force(900))
    assert caught.value.largest == pytest.approx(largest)
    # Within REACH_TOLERANCE of the largest the target counts as reached.
    assert planned_ratio(spec, "qr", largest / (1 - sc.REACH_TOLERANCE) * 0.999, threshold=0) == pytest.approx(largest)


@pytest.mark.parametrize("n, target", [(10_000, 4), (10_000, 33.3), (777, 3), (50_000, 1.5)])
def test_qr_collisions_closest_to_target(n, target):
    """Against a brute-force search over every m up to sqrt(n) (beyond it QR only grows again)."""
    goal = n * DIM / target
    m = sc._qr_collisions("C1", n, DIM, "mult", goal)
    rows = lambda m: -(-n // m) + m
    best = min(range(1, math.isqrt(n) + 2), key=lambda k: abs(math.log(rows(k) * DIM / goal)))
    assert abs(math.log(rows(m) * DIM / goal)) == pytest.approx(abs(math.log(rows(best) * DIM / goal)))


def test_qr_concat_counts_half_width_tables():
    spec = spec_of((40_000,))
    section = sc.embedding_section("qr", spec, DIM, 8.0, threshold=0, qr_op="concat")
    m = section.tables.C1.options.collisions
    assert section.options.op == "concat"
    assert (-(-40_000 // m) + m) * DIM // 2 == pytest.approx(40_000 * DIM / 8, rel=0.01)  # each table D/2 wide


def test_tt_rank_is_solved_per_table_and_bottoms_out_at_rank_one():
    spec = spec_of((50_000, 20_000, 100))
    section = sc.embedding_section("tt", spec, DIM, 8.0)
    ranks = {name: section.tables[name].options.rank for name in section.tables}
    assert sorted(ranks) == ["C1", "C2"] and ranks["C1"] > ranks["C2"] > 1  # C3 stays full
    assert sc._tt_rank("C1", 50_000, DIM, 1.0) == 1  # beyond its reach: rank 1, the most TT compresses
    # By hand: 50,000 ids -> (37, 37, 37), D 16 -> (4, 2, 2); rank r costs 37 (4 r + 2 r^2 + 2 r) params.
    assert sc.table_params("C1", 50_000, DIM, "tt", {"rank": 10}) == 37 * (40 + 200 + 20)
    assert sc._tt_rank("C1", 50_000, DIM, 37 * (40 + 200 + 20)) == 10


def test_md_says_the_largest_ratio_it_reaches_and_never_goes_below_dim_one():
    spec = spec_of((50_000, 20_000, 150))
    full = (50_000 + 20_000 + 150) * DIM
    # Floor by hand: both big tables at dim 1 with a 1 x 16 projection each, C3 full.
    floor = 50_000 + 16 + 20_000 + 16 + 150 * DIM
    for target in (17.0, 1000.0):  # 15.5x at most; 16x is within REACH_TOLERANCE of it
        with pytest.raises(sc.UnreachableRatio) as caught:
            sc.embedding_section("md", spec, DIM, target)
        assert caught.value.largest == pytest.approx(full / floor)
        assert caught.value.section.options.budget == floor and caught.value.section.tables.to_dict() == {}
        assert str(caught.value) == (f"md cannot reach {target:g}x on these tables: the most it compresses them is "
                                     f"{full / floor:.2f}x (every table over the threshold at dim 1 plus its "
                                     "projection; the rest full)")
    assert planned_ratio(spec, "md", 15.0) == pytest.approx(15.0, rel=sc.REACH_TOLERANCE)  # 15x is within reach
    # The plan itself (a run configured by hand) says the same in its error.
    config = tiny_base()
    config.embedding.method, config.embedding.options.budget = "md", floor - 1
    config.embedding.options.threshold = 200
    from compression.plan import plan_tables
    with pytest.raises(ValueError, match=rf"the most md compresses these tables is {full / floor:.2f}x"):
        plan_tables(["C1", "C2", "C3"], [50_000, 20_000, 150], DIM, config.embedding)


def test_the_sweep_budget_on_movielens_is_its_own_and_overridable(tmp_path):
    """Compressed runs learn slower than the full model the dataset config is sized for: the sweep trains MovieLens
    for SWEEP_EPOCHS unless --epochs or --steps says otherwise."""
    assert sc.base_config("movielens", str(tmp_path)).train.epochs == sc.SWEEP_EPOCHS["movielens"] == 20
    assert sc.base_config("movielens", str(tmp_path), epochs=3).train.epochs == 3
    by_steps = sc.base_config("movielens", str(tmp_path), steps=100).train
    assert (by_steps.steps, by_steps.epochs) == (100, None)
    with pytest.raises(ValueError, match="not both"):
        sc.base_config("movielens", str(tmp_path), steps=100, epochs=3)
    with pytest.raises(ValueError, match="epochs must be > 0 on a dataset with epochs"):
        sc.base_config("synthetic", epochs=3)


def test_sweep_runs_full_once_per_seed_and_validates():
    runs = sc.sweep_runs(["full", "hashing"], [1, 4], [0, 1])
    assert runs == [("full", 1.0, 0), ("hashing", 1.0, 0), ("hashing", 4.0, 0),
                    ("full", 1.0, 1), ("hashing", 1.0, 1), ("hashing", 4.0, 1)]
    with pytest.raises(ValueError, match="unknown sweep method"):
        sc.sweep_runs(["fiitde"], [4], [0])
    with pytest.raises(ValueError, match=">= 1"):
        sc.sweep_runs(["qr"], [0.5], [0])
    with pytest.raises(ValueError, match="needs --data_dir"):
        sc.base_config("movielens")


# ---------------------------------------------------------------------------------------- a tiny sweep
def png_size(path: pathlib.Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow  # a sweep of runs and a resume
def test_tiny_sweep_writes_results_plot_and_resumes(tmp_path, monkeypatch):
    base = tiny_base()
    logged = []
    rows = sc.run_sweep(base, tmp_path, ["hashing", "qr"], [2, 8], [0], log=logged.append)

    with (tmp_path / "results.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        results = list(reader)
    required = ["method", "target_ratio", "ratio", "params", "embedding_bytes", "auc", "logloss", "ne",
                "examples_per_sec", "seed"]
    assert set(required) <= set(reader.fieldnames)
    assert [(r["method"], float(r["target_ratio"]), int(r["seed"])) for r in results] == [
        ("hashing", 2.0, 0), ("hashing", 8.0, 0), ("qr", 2.0, 0), ("qr", 8.0, 0)]
    full_bytes = 4 * DIM * sum(VOCAB)
    for r, row in zip(results, rows, strict=True):
        summary = json.loads((tmp_path / r["run"] / "summary.json").read_text())
        ratio = float(r["ratio"])
        assert ratio == pytest.approx(full_bytes / int(r["embedding_bytes"]))  # achieved, not target
        assert ratio == pytest.approx(summary["compression_ratio"]) and float(r["auc"]) == summary["auc"]
        assert abs(ratio / float(r["target_ratio"]) - 1) < 0.05, r
        assert 0.5 < float(r["auc"]) <= 1 and float(r["logloss"]) > 0 and float(r["examples_per_sec"]) > 0
        assert int(r["params"]) > int(r["embedding_bytes"]) // 4  # dense params on top of the tables
        assert row["run"] == r["run"]
        assert (int(r["selected_step"]), int(r["budget_steps"])) == (summary["selected_step"], summary["budget_steps"])
    # One evaluation, at the end: every run is selected at its budget's last step, and the sweep says so.
    assert [int(r["selected_step"]) for r in results] == [int(base.train.steps)] * 4
    warnings = [line for line in logged if line.startswith("WARNING")]
    assert len(warnings) == 1 and "4 of 4 runs were selected at the last step" in warnings[0]
    assert all(r["run"] in warnings[0] for r in results)

    with (tmp_path / "results_summary.csv").open(newline="") as f:
        summary_rows = list(csv.DictReader(f))
    assert len(summary_rows) == 4
    for s, r in zip(summary_rows, results, strict=True):
        assert (s["method"], s["target_ratio"], s["runs"]) == (r["method"], r["target_ratio"], "1")
        assert float(s["auc_mean"]) == float(r["auc"]) and float(s["auc_std"]) == 0.0
    assert png_size(tmp_path / "pareto.png") == (840, 540)

    # Resume: nothing retrains, summaries stay untouched, results are the same.
    mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/summary.json")}
    trained = []
    monkeypatch.setattr(runs, "train_and_evaluate", lambda config, workdir: trained.append(workdir))
    again = sc.run_sweep(base, tmp_path, ["hashing", "qr"], [2, 8], [0], log=lambda _: None)
    assert trained == [] and again == rows
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/summary.json")} == mtimes

    # A sweep with other settings refuses to reuse finished runs.
    with pytest.raises(ValueError, match="different config.json"):
        sc.run_sweep(tiny_base(steps=31), tmp_path, ["hashing"], [2], [0], log=lambda _: None)


def test_summary_aggregates_over_seeds():
    rows = [{"method": "qr", "target_ratio": 4.0, "ratio": 3.9, "embedding_bytes": 100, "auc": auc, "logloss": logloss,
             "ne": 0.9, "examples_per_sec": 10.0} for auc, logloss in ((0.70, 0.5), (0.72, 0.4), (0.74, 0.6))]
    (entry,) = sc.summarize(rows)
    assert entry["runs"] == 3 and entry["auc_mean"] == pytest.approx(0.72)
    assert entry["auc_std"] == pytest.approx(0.02)  # sample std of 0.70, 0.72, 0.74
    assert entry["logloss_std"] == pytest.approx(0.1)


# ------------------------------------------------------------------------------------------- notebook
@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    # Per cell: the sweep cell takes ~35 s idle (the whole test 63 s; 124 s on a loaded machine hit the old 120 s).
    notebook = run_notebook(NOTEBOOK, tmp_path, monkeypatch)
    results = sc.read_results(tmp_path / "results.csv")
    assert sorted((r["method"], r["target_ratio"]) for r in results) == [
        ("hashing", 4.0), ("hashing", 16.0), ("md", 4.0), ("md", 16.0)]
    assert png_size(tmp_path / "pareto.png")[0] > 0
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the notebook shows no plot"
    assert not any(o.get("output_type") == "error" for o in outputs)


def test_targets_out_of_reach_are_skipped_in_one_line_and_no_run_stands_in(tmp_path, monkeypatch):
    """md tops out below 100x here: the sweep says so once, runs nothing for 100x or 1000x and lists no row for
    them (it used to train the maximum once and list it under both targets)."""
    trained = []

    def fake_train(config, workdir):
        trained.append(pathlib.Path(workdir).name)
        workdir.mkdir(parents=True)
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
        summary = {"compression_ratio": 3.9, "params": 9000, "embedding_params": 5000, "embedding_bytes": 20000,
                   "auc": 0.7, "logloss": 0.5, "ne": 0.9, "examples_per_sec": 1e4, "selected_step": 80,
                   "budget_steps": 100}
        (workdir / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(runs, "train_and_evaluate", fake_train)
    logged, unreachable = [], []
    rows = sc.run_sweep(tiny_base(), tmp_path, ["md"], [4, 100, 1000], [0, 1], log=logged.append,
                        unreachable=unreachable)
    assert trained == ["md_x4_seed0", "md_x4_seed1"]
    assert [(r["target_ratio"], r["run"]) for r in rows] == [(4.0, "md_x4_seed0"), (4.0, "md_x4_seed1")]
    skipped = [line for line in logged if "skipped" in line]
    assert len(skipped) == 1 and skipped[0].startswith("[2/6] md_x100_seed0: skipped: md cannot reach 100x")
    assert skipped[0].endswith("; not running md at 100x, 1000x")
    assert [(e.method, e.target) for e in unreachable] == [("md", 100.0)]
    assert not (tmp_path / "md_x100_seed0").exists() and not (tmp_path / "md_x1000_seed0").exists()

    # A base config with an epoch budget (the real datasets' configs) titles its plot in epochs.
    titles = []
    monkeypatch.setattr(sc, "write_outputs", lambda rows, workdir, title: titles.append(title))
    epochs = tiny_base()
    epochs.train.steps, epochs.train.epochs = None, 2
    sc.run_sweep(epochs, tmp_path / "epochs", ["md"], [4], [0], log=lambda _: None)
    assert titles == ["synthetic, 2 epochs, seeds [0]"]


def test_fiited_planned_line_states_the_ratio_after_the_ramp_and_the_peak_during_it():
    spec = spec_of((50_000, 20_000, 150))
    config = tiny_base()
    config.embedding.dim = DIM
    section = sc.embedding_section("fiited", spec, DIM, 8.0)
    config.embedding.method, config.embedding.options, config.embedding.tables = (
        section.method, section.options, section.tables)
    start, end = sc.planned_accounting(spec, config), sc.planned_accounting(spec, config, after_ramp=True)
    full = 4 * DIM * (50_000 + 20_000 + 150)
    assert end["full_bytes"] / end["bytes"] == pytest.approx(8.0, rel=0.01)
    assert start["bytes"] > full  # every chunk live at the start, plus the packed offsets: the full model's memory
    line = sc.planned_line(spec, config, 8.0)
    assert line.startswith(f"target 8x, planned {full / end['bytes']:.2f}x, {end['bytes']:,} embedding bytes after "
                           f"the ramp; during it the pools start full: {full / start['bytes']:.2f}x, peak "
                           f"{start['bytes']:,} bytes")
    assert "after the ramp" not in sc.planned_line(spec, tiny_base(), 1.0)  # a static table: one figure


@pytest.mark.parametrize("method", ["fiited", "row_prune", "uniform_dim"])
def test_keep_methods_keep_the_share_of_values_that_meets_the_budget(method):
    spec = spec_of((50_000, 20_000, 3_000, 150, 40))
    section = sc._embedding_section(method, spec, DIM, 10.0)
    values = (50_000 + 20_000 + 3_000) * DIM
    fixed = (150 + 40) * DIM  # under the threshold: full
    # FIITED's packed row offsets (bit_length(K) bits of count per row in u32 words, an i32 base per block of whole
    # words near 64 rows) come off the budget: K = gcd(16, D) for fiited, 1 for row_prune.
    k = {"fiited": math.gcd(16, DIM), "row_prune": 1}.get(method)
    if k:
        per_word = 32 // k.bit_length()
        block = per_word * (64 // per_word)
    aux = sum(4 * (n // block + 1) + 4 * -(-n // per_word) for n in (50_000, 20_000, 3_000)) / 4 if k else 0
    assert section.options.keep == pytest.approx(((values + fixed) / 10 - fixed - aux) / values)
    # At ratio 1 the offsets still need their bytes: FIITED keeps a little under every value.
    want = min(1.0, (values - aux) / values)
    assert sc.embedding_section(method, spec, DIM, 1.0).options.keep == pytest.approx(want)
    if method == "uniform_dim":  # rows round(keep D) = 2 columns wide: 10x is between its steps (8x, 16x)
        with pytest.raises(sc.UnreachableRatio, match=r"^uniform_dim cannot reach 10x on these tables: its closest "
                                                      r"plan compresses them 7\.86x \(every row"):
            sc.embedding_section(method, spec, DIM, 10.0)
    else:  # a pool keeps any share of its values: the ratio after the ramp is the target
        config = tiny_base()
        config.embedding.dim = DIM
        config.embedding.method, config.embedding.options, config.embedding.tables = (
            section.method, section.options, section.tables)
        end = sc.planned_accounting(spec, config, after_ramp=True)
        assert end["full_bytes"] / end["bytes"] == pytest.approx(10.0, rel=0.01)
