"""`python -m experiments.reproduce`: the Criteo stand-in against its teacher, the claims table, the data a scale
reads, and each paper's `--scale=tiny` end to end (slow) with its figures checked against hand counts."""

import csv
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments import make_criteo_like, reproduce
from experiments import sweep_compression as sc
from recjax.data import criteo

REPO = pathlib.Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------- the stand-in
def test_criteo_stand_in_is_the_teachers_examples_in_kaggle_format(tmp_path):
    stats = make_criteo_like.write(tmp_path, lines=700, vocab_cap=50, seed=3)
    lines = (tmp_path / "train.txt").read_text().splitlines()
    assert len(lines) == 700 and stats["lines"] == 700
    fields = [line.split("\t") for line in lines]
    assert {len(f) for f in fields} == {40}
    assert all(len(key) == 8 and int(key, 16) >= 0 for f in fields for key in f[14:])
    # The parser Criteo's preparation uses gives back the teacher's examples: labels, log(1 + counts) = its dense
    # features, and one key per (feature, id).
    chunks = list(criteo.parse_file(tmp_path / "train.txt", strict=True))
    labels = np.concatenate([c.labels for c in chunks])
    dense = np.concatenate([c.dense for c in chunks])
    cats = np.concatenate([c.cats for c in chunks])
    teacher = make_criteo_like.teacher(vocab_cap=50, seed=3)
    batch = next(teacher.train_batches(make_criteo_like.CHUNK))
    np.testing.assert_array_equal(labels, batch.labels[:700])
    np.testing.assert_allclose(dense, batch.dense[:700], rtol=1e-6, atol=1e-6)
    for f, name in enumerate(criteo.CRITEO_FEATURE_NAMES):
        ids = batch.ids[name][:700, 0]
        pairs = set(zip(ids.tolist(), cats[:, f].tolist(), strict=True))
        assert len(pairs) == len(set(ids.tolist())) == len({k for _, k in pairs}), name  # a bijection
    assert stats["clicks"] == pytest.approx(labels.mean())
    assert stats["distinct_ids_per_feature"] == [len(set(batch.ids[n][:700, 0].tolist()))
                                                 for n in criteo.CRITEO_FEATURE_NAMES]
    # The teacher's AUC on the reference's test lines (day 6's first half: lines 601..650 of 700).
    logits = teacher.teacher_logits(batch)[:700]
    test = slice(600, 650)
    from recjax import metrics

    assert stats["test_lines"] == 50
    assert stats["bayes_auc"] == pytest.approx(metrics.auc(labels[test], logits[test]))
    with pytest.raises(ValueError, match="--lines must be >= 14"):
        make_criteo_like.write(tmp_path / "x", lines=10)


# ------------------------------------------------------------------------------------------------ claims
def test_every_claim_quotes_a_figure_and_its_source():
    for key, claim in reproduce.CLAIMS.items():
        assert claim.paper in reproduce.PAPERS, key
        assert claim.figure and claim.claim and claim.source, key
        assert "abstract" in claim.source or "README" in claim.source, key  # nothing read off a plot
    assert set(reproduce.REPRODUCERS) == set(reproduce.PAPERS)
    assert {c.paper for c in reproduce.CLAIMS.values()} == set(reproduce.PAPERS)


def test_the_markdown_table_has_a_row_per_claim_and_a_row_per_run():
    report = reproduce.Report(
        rows=[reproduce.claim_row("qr", "ours", "gap", "yes", "data", "tiny"),
              reproduce.claim_row("dlrm", "ours 2", "gap 2", "no", "data", "tiny")],
        runs=[{"run": "a", "auc": 0.71234}, {"run": "b", "auc": 0.7, "extra": 3}], data="the data")
    text = reproduce.markdown(report, "qr", "tiny", 90.0)
    lines = text.splitlines()
    assert lines[2] == "Data: the data. Scale: tiny. Wall time: 1.5 min."
    table = [line for line in lines if line.startswith("| ")]
    assert table[0] == "| claim | paper's figure (source) | ours | gap | holds |"
    assert table[1].startswith(f"| {reproduce.CLAIMS['qr'].claim} | {reproduce.CLAIMS['qr'].figure} (")
    assert table[1].endswith("| ours | gap | yes |")
    assert table[3] == "| run | auc | extra |" and table[4] == "| a | 0.7123 |  |" and table[5] == "| b | 0.7 | 3 |"


def test_a_users_criteo_file_is_read_up_to_the_scales_lines(tmp_path):
    source = tmp_path / "kaggle"
    source.mkdir()
    (source / "train.txt").write_text("".join(f"line {i}\n" for i in range(50)))
    ctx = reproduce.Context("dlrm", "tiny", tmp_path / "out" / "dlrm", str(source), print, (0,))
    original = reproduce.SCALE_SETTINGS["tiny"]["criteo_lines"]
    reproduce.SCALE_SETTINGS["tiny"]["criteo_lines"] = 20
    try:
        folder, described = reproduce.criteo_data(ctx)
    finally:
        reproduce.SCALE_SETTINGS["tiny"]["criteo_lines"] = original
    assert (pathlib.Path(folder) / "train.txt").read_text() == "".join(f"line {i}\n" for i in range(20))
    assert described == f"the first 20 lines of {source / 'train.txt'} (--scale=tiny)"
    with pytest.raises(ValueError, match="has no train.txt"):
        reproduce.criteo_data(reproduce.Context("qr", "tiny", tmp_path / "o", str(tmp_path), print, (0,)))
    with pytest.raises(ValueError, match="reads no --data_dir"):
        reproduce.reproduce("wukong", "tiny", tmp_path / "w", data_dir=str(source))


def test_the_command_line_says_what_is_wrong_in_one_line(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "experiments.reproduce", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=600)

    result = run(f"--workdir={tmp_path}")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: --paper is required")
    result = run("--paper=md,nope", f"--workdir={tmp_path}")
    assert result.returncode == 2 and "error: --paper: unknown ['nope']" in result.stderr


# ------------------------------------------------------------------------------------ each paper, tiny
def read_csv(path: pathlib.Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def outputs(workdir: pathlib.Path, paper: str) -> tuple[list[dict], list[dict]]:
    out = workdir / paper
    assert (out / "reproduction.md").read_text().startswith(f"# {paper}: the paper's figure beside ours")
    assert (out / "reproduction.png").stat().st_size > 1000
    rows, runs = read_csv(out / "reproduction.csv"), read_csv(out / "runs.csv")
    assert rows and all(r["scale"] == "tiny" and r["paper_figure"] and r["holds"] for r in rows)
    return rows, runs


@pytest.mark.slow  # 8 small runs: MF at two uniform dims and md_blocks, DLRM full and md (~1 min idle)
def test_md_tiny(tmp_path):
    report = reproduce.reproduce("md", "tiny", tmp_path, log=lambda _: None)
    rows, runs = outputs(tmp_path, "md")
    assert [r["claim"] for r in rows] == [reproduce.CLAIMS[k].claim for k in ("md_mf", "md_half", "md_16x")]
    assert all("stand-in" in r["data"] for r in rows)
    mf = {r["run"]: r for r in report.runs if r.get("model") == "mf"}
    # Uniform-dim MF: (users + items rated) x dim params, by hand from the stand-in's ratings.
    ratings = np.loadtxt(tmp_path / "data" / "movielens_like_tiny" / "ratings.dat", delimiter=":", usecols=(0, 2),
                         dtype=np.int64)
    rows_total = len(np.unique(ratings[:, 0])) + len(np.unique(ratings[:, 1]))
    assert mf["mf_ud16_seed0"]["embedding_params"] == rows_total * 16
    assert mf["mf_ud2_seed0"]["embedding_params"] == rows_total * 2
    md = mf["mf_md_a0.3_seed0"]
    assert md["embedding_params"] <= rows_total * 16 / reproduce.MD_TARGET  # the budget, never above it
    # 16x is out of per-table md's reach here: the largest ratio by hand (tables over the threshold at dim 1 plus a
    # 1 x 16 projection, the rest full).
    spec = sc.dataset_spec(sc.base_config("movielens", str(tmp_path / "data" / "movielens_like_tiny"),
                                          prepared_dir=str(tmp_path / "prepared")))
    sizes = [f.vocab_size for f in spec.features]
    largest = sum(sizes) * 16 / sum(n + 16 if n > sc.DEFAULT_THRESHOLD else 16 * n for n in sizes)
    assert rows[2]["ours"].startswith(f"not run: md cannot reach 16x on these tables: the most it compresses them is "
                                      f"{largest:.2f}x") and rows[2]["holds"] == "no: out of md's reach here"
    assert {r["embedding"] for r in runs if r["model"] == "dlrm"} == {"full", "md"}


@pytest.mark.slow  # 5 DLRM runs on the Criteo stand-in (~1 min idle)
def test_qr_tiny(tmp_path):
    report = reproduce.reproduce("qr", "tiny", tmp_path, log=lambda _: None)
    rows, _ = outputs(tmp_path, "qr")
    assert [r["claim"].rsplit("(", 1)[1] for r in rows] == ["qr-mult)", "qr-concat)", "qr-add)"]
    hashing = next(r for r in report.runs if r["method"] == "hashing")
    for run in report.runs:
        if run["method"].startswith("qr-"):  # equal parameters: the same target, bytes within the tolerance
            assert abs(run["embedding_bytes"] / hashing["embedding_bytes"] - 1) < 2 * sc.REACH_TOLERANCE
            summary = json.loads((tmp_path / "qr" / run["run"] / "summary.json").read_text())
            assert summary["auc"] == run["test_auc"] and summary["accuracy"] == run["test_accuracy"]


@pytest.mark.slow  # the full model and one FIITED run (its steps re-compile once, at the ramp's end)
def test_fiited_tiny(tmp_path):
    report = reproduce.reproduce("fiited", "tiny", tmp_path, log=lambda _: None)
    rows, _ = outputs(tmp_path, "fiited")
    (fiited,) = [r for r in report.runs if r["method"] == "fiited"]
    assert fiited["ratio"] == pytest.approx(4.0, rel=0.01)  # after the ramp: the budget
    assert fiited["pruned"] == pytest.approx(0.75, abs=0.01)
    assert fiited["peak_ramp_bytes"] >= fiited["full_bytes"]  # the pools start full
    assert "75.00 % pruned" in rows[0]["ours"]


@pytest.mark.slow  # the uninterrupted run and two first-part / resumed pairs (~1 min idle)
def test_checknrun_tiny(tmp_path):
    report = reproduce.reproduce("checknrun", "tiny", tmp_path, log=lambda _: None)
    outputs(tmp_path, "checknrun")
    by = {r["run"]: r for r in report.runs}
    full, f32, four = by["full_seed0"], by["delta32bit_seed0"], by["delta4bit_seed0"]
    # f32 deltas restore the exact state and every batch is a function of (seed, step): the resumed run ends where
    # the uninterrupted one does, to the bit.
    assert f32["test_auc"] == full["test_auc"] and f32["test_logloss"] == full["test_logloss"]
    assert four["bytes_per_interval"] < f32["bytes_per_interval"] < full["bytes_per_interval"]


@pytest.mark.slow  # one DLRM run on the Criteo stand-in
def test_dlrm_tiny(tmp_path):
    report = reproduce.reproduce("dlrm", "tiny", tmp_path, log=lambda _: None)
    rows, _ = outputs(tmp_path, "dlrm")
    summary = json.loads((tmp_path / "dlrm" / "dlrm_seed0" / "summary.json").read_text())
    assert rows[0]["ours"].startswith(f"test accuracy {100 * summary['accuracy']:.2f} %")
    assert rows[0]["gap"] == f"accuracy {100 * (summary['accuracy'] - 0.789):+.2f} points"
    assert rows[0]["holds"] == "not comparable: a stand-in with its own click model"
    assert report.runs[0]["params"] == summary["params"]


@pytest.mark.slow  # the scaling sweep's --tiny setting for two families (6 runs)
def test_wukong_tiny(tmp_path):
    report = reproduce.reproduce("wukong", "tiny", tmp_path, log=lambda _: None)
    rows, runs = outputs(tmp_path, "wukong")
    assert [r["claim"] for r in rows] == [reproduce.CLAIMS[k].claim for k in ("wukong_law", "wukong_vs")]
    assert sorted((r["family"], int(r["size"])) for r in runs) == [(f, s) for f in ("dlrm", "wukong")
                                                                  for s in range(3)]
    fit = json.loads((tmp_path / "wukong" / "fit.json").read_text())
    gap = fit["equal_flops"]["wukong_vs_dlrm"]["measured"]["mean_gap"]
    assert rows[1]["gap"] == f"logloss {-gap:+.4f} (Wukong - DLRM)"
    assert rows[1]["holds"] == ("yes" if gap > 0 else "no")
    assert len(report.runs) == 6
