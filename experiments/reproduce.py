r"""Each seed paper's headline figure beside ours, one command per paper.

    python -m experiments.reproduce --paper=md --scale=cpu --workdir=runs/repro_md
    python -m experiments.reproduce --paper=qr --data_dir=/path/to/criteo_kaggle --scale=full
    python -m experiments.reproduce --paper=all --scale=cpu --workdir=runs/repro     # every paper, one after another

Papers (`--paper`), each with the figure it is measured against (`CLAIMS`: the paper's words, where they are in it):
  md         Ginart et al. 2019, mixed-dimension embeddings: matrix factorisation on MovieLens ratings with a
             squared-error loss (experiments/configs/mf_movielens.py) at uniform dims and at mixed dims per frequency
             block (`md_blocks`) for each temperature alpha, the base dim searched so the tables take 1/8 of the
             full model's params; plus DLRM click prediction on the same ratings (>= 4 stars) at 2x and 16x with
             per-table mixed dims (experiments/sweep_compression.py).
  qr         Shi et al. KDD 2020, compositional embeddings: the quotient-remainder trick with each combining
             operation (mult, concat, add) against hashing at equal parameters, DLRM on Criteo-format data.
  fiited     Luo et al. 2024, FIITED: the share of the embedding memory pruned (after the budget ramp) against test
             AUC, DLRM on Criteo-format data, and the memory the pools hold while the budget ramps down.
  checknrun  Eisenman et al. NSDI 2022, Check-N-Run: bytes written per checkpoint interval by incremental
             checkpoints with 32-, 8-, 4- and 2-bit delta rows against full checkpoints, and the test AUC of training
             resumed from each against the uninterrupted run.
  dlrm       Naumov et al. 2019, DLRM: the reference's Kaggle configuration (experiments/configs/
             dlrm_criteo_kaggle.py: dim 16, bottom 13-512-256-64-16, top 512-256-1, SGD 0.1, batch 128, one
             epoch) on Criteo-format data.
  wukong     Zhang et al. 2024, Wukong: the scaling fit (test logloss against forward FLOPs per example) of Wukong
             and DLRM at equal FLOPs over the sizes a CPU trains (experiments/sweep_scaling.py).

Data (`--data_dir`): a MovieLens folder (md; ML-100K / ML-1M / latest-small) or a folder with Criteo Kaggle's
train.txt (qr, fiited, checknrun, dlrm). Without one, a seeded stand-in is written under the workdir and every
output says so: experiments/make_movielens_like.py (ML-1M's shape) or experiments/make_criteo_like.py (Kaggle's
format and 26 capped cardinalities, clicks from a planted teacher). At `--scale=cpu` a user's Criteo file is read up
to its first SCALES[cpu] lines (written to <workdir>/data/train.txt; the reference's day split then applies to those
lines). wukong runs on the scaling sweep's hard-teacher synthetic data (experiments/configs/scaling.py) only.

Scales (`--scale`): `tiny` (seconds to a minute per paper; the tests run it), `cpu` (what 2 CPU cores train in
minutes: the whole set in under two hours; experiments/REPRODUCTIONS.md has the figures and times) and `full` (the
papers' own data sizes and seeds: days on a CPU, meant for an accelerator or a cluster).

Outputs in --workdir (each paper in <workdir>/<paper>/, runs resumable as in every sweep, experiments/runs.py):
  reproduction.csv   one row per claim: paper, claim, source, paper_figure, ours, gap, holds, data, scale
  reproduction.md    the same as a markdown table, with the data and scale, then the runs behind it
  runs.csv           one row per run: its setting, ratio / params / bytes and test metrics, selected step, budget
  reproduction.png   the paper's figure redrawn from our runs
and the table is printed. `holds` is "yes", "no", or why the figures cannot be compared (another dataset, a
stand-in, a ratio out of the method's reach); a claim that does not hold here says so.
"""

import copy
import dataclasses
import json
import math
import pathlib
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
from absl import flags

from experiments import sweep_compression as sc
from experiments import sweep_scaling
from experiments.runs import keep_or_remove_on_failure, open_workdir, train_or_resume, write_csv
from recjax import cli

PAPERS = ("md", "qr", "fiited", "checknrun", "dlrm", "wukong")
SCALES = ("tiny", "cpu", "full")
ROW_FIELDS = ("paper", "claim", "source", "paper_figure", "ours", "gap", "holds", "data", "scale")


@dataclasses.dataclass(frozen=True)
class Claim:
    """A paper's headline figure, quoted, and where it stands in the paper."""

    paper: str
    claim: str  # what is claimed, briefly
    figure: str  # the paper's own figure
    source: str  # the paper, and where in it


# Every figure below is from the papers' abstracts (their words, shortened) or a published table; nothing is read off
# a plot. experiments/REPRODUCTIONS.md quotes each abstract's sentence verbatim.
CLAIMS = {
    "md_mf": Claim("md", "MF on MovieLens: MD beats the full model with 8x fewer parameters",
                   "higher accuracy while using 8x fewer parameters (collaborative filtering, MovieLens)",
                   "Ginart et al., Mixed Dimension Embeddings with Application to Memory-Efficient Recommendation "
                   "Systems, arXiv:1909.11810 (v1, 2019), abstract"),
    "md_half": Claim("md", "CTR: MD at half the parameters is more accurate", "+0.1 % accuracy with half the "
                     "parameters (CTR, Criteo Kaggle)", "Ginart et al., arXiv:1909.11810, abstract"),
    "md_16x": Claim("md", "CTR: MD at 16x fewer parameters keeps the baseline's accuracy", "baseline accuracy "
                    "with 16x fewer parameters (CTR, Criteo Kaggle)", "Ginart et al., arXiv:1909.11810, abstract"),
    "qr": Claim("qr", "QR beats hashing at equal parameters", "better than the hashing trick in model loss and "
                "accuracy at a similar reduction in the number of parameters",
                "Shi et al., Compositional Embeddings Using Complementary Partitions for Memory-Efficient "
                "Recommendation Systems, KDD 2020, abstract"),
    "fiited": Claim("fiited", "most of the embedding memory pruned without accuracy loss", "prune up to "
                    "93.75 %-99.75 % of the embeddings without significant accuracy loss (public CTR datasets)",
                    "Luo et al., Fine-grained Embedding Dimension Optimization During Training for Recommender "
                    "Systems (FIITED), 2024, abstract"),
    "checknrun": Claim("checknrun", "incremental, quantized checkpoints write far less at no accuracy loss",
                       "6-17x less write bandwidth and 2.5-8x less capacity, without degrading training accuracy",
                       "Eisenman et al., Check-N-Run: a Checkpointing System for Training Deep Learning "
                       "Recommendation Models, NSDI 2022, abstract"),
    "dlrm": Claim("dlrm", "the reference Kaggle DLRM's test accuracy", "78.9 % accuracy (DLRM, PyTorch, Criteo "
                  "Kaggle)", "MLPerf Inference's DLRM reference (mlcommons/inference, recommendation/dlrm/pytorch/"
                  "README.md, 'Supported Models'); Naumov et al. 2019 (arXiv:1906.00091) plot Kaggle accuracy "
                  "against DCN, without a tabulated figure"),
    "wukong_law": Claim("wukong", "Wukong's quality follows a power law in compute", "a scaling law across two "
                        "orders of magnitude in model complexity, beyond 100 GFLOP/example",
                        "Zhang et al., Wukong: Towards a Scaling Law for Large-Scale Recommendation, ICML 2024, "
                        "abstract and Fig. 1"),
    "wukong_vs": Claim("wukong", "Wukong beats the other models at equal compute", "Wukong outperforms "
                       "state-of-the-art models quality-wise (six public datasets; an internal one across scales)",
                       "Zhang et al. 2024, abstract"),
}

# What each scale trains. Data sizes: the stand-ins' (or a cpu-scale prefix of the user's Criteo file).
SCALE_SETTINGS: dict[str, dict[str, Any]] = {
    "tiny": {"criteo_lines": 8_000, "criteo_vocab_cap": 2_000, "criteo_steps": 40, "seeds": (0,),
             "movielens": {"users": 400, "movies": 300, "ratings": 12_000},
             "mf_dim": 16, "mf_ud_dims": (16, 2), "md_alphas": (0.3,), "mf_epochs": 2, "ctr_steps": 30,
             "qr_ratios": (4.0,), "qr_ops": ("mult", "concat", "add"), "fiited_ratios": (4.0,),
             "ckpt_bits": (0, 4), "ckpt_steps": 40, "scaling_sizes": None},
    "cpu": {"criteo_lines": 500_000, "criteo_vocab_cap": 100_000, "criteo_steps": None, "seeds": (0,),
            "movielens": {}, "mf_dim": 64, "mf_ud_dims": (64, 32, 16, 8), "md_alphas": (0.1, 0.2, 0.3, 0.4),
            "mf_epochs": None, "ctr_steps": None, "qr_ratios": (4.0, 16.0), "qr_ops": ("mult", "concat", "add"),
            "fiited_ratios": (2.0, 4.0, 16.0), "ckpt_bits": (0, 8, 4, 2), "ckpt_steps": 2_000,
            # The ladders' five smallest sizes (the fit needs five): the largest alone, 9.4M FLOPs/example for Wukong,
            # would take as long as the other five together on 2 busy cores.
            "scaling_sizes": (0, 1, 2, 3, 4)},
    "full": {"criteo_lines": None, "criteo_vocab_cap": 1_000_000, "criteo_steps": None, "seeds": (0, 1, 2),
             "movielens": {}, "mf_dim": 64, "mf_ud_dims": (128, 64, 32, 16, 8), "md_alphas": (0.1, 0.2, 0.3, 0.4, 0.5),
             "mf_epochs": None, "ctr_steps": None, "qr_ratios": (2.0, 4.0, 8.0, 16.0, 64.0),
             "qr_ops": ("mult", "concat", "add"), "fiited_ratios": (2.0, 4.0, 16.0, 64.0, 400.0),
             "ckpt_bits": (0, 8, 4, 2), "ckpt_steps": None, "scaling_sizes": None},
}
# The stand-in Criteo file at full scale (no --data_dir): Kaggle's 45.8M lines are not here; 8M lines stand in.
FULL_STANDIN_LINES = 8_000_000
SIGNIFICANT_AUC = 0.001  # an AUC change below this is "no significant loss" (Wang et al. 2017, DCN, sec. 4)
MD_TARGET = 8.0  # the MF claim's compression
# FIITED's pools compact once, at the end of the budget ramp: every compaction re-compiles the steps (~3 min each for
# the Kaggle shape's 18 pools on 2 busy cores), and the peak memory -- the pools start full -- is the same either way.
FIITED_OPTIONS = {"compact_slack": 1e9}
MD_CTR_RATIOS = (2.0, 16.0)


@dataclasses.dataclass
class Context:
    """One paper's run: where it writes, at which scale, with which data, and what it logs."""

    paper: str
    scale: str
    workdir: pathlib.Path
    data_dir: str  # the user's, or "" for a stand-in
    log: Callable[[str], None]
    seeds: tuple[int, ...]

    @property
    def settings(self) -> dict[str, Any]:
        return SCALE_SETTINGS[self.scale]


@dataclasses.dataclass
class Report:
    """What a paper's reproduction found: the claim rows, the runs behind them, the data, and its figure."""

    rows: list[dict[str, Any]]
    runs: list[dict[str, Any]]
    data: str
    plot: Callable[[pathlib.Path], None] | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


def claim_row(key: str, ours: str, gap: str, holds: str, data: str, scale: str) -> dict[str, Any]:
    claim = CLAIMS[key]
    return {"paper": claim.paper, "claim": claim.claim, "source": claim.source, "paper_figure": claim.figure,
            "ours": ours, "gap": gap, "holds": holds, "data": data, "scale": scale}


# ------------------------------------------------------------------------------------------------------ data
def movielens_data(ctx: Context) -> tuple[str, str]:
    """(MovieLens folder, how to describe it): the user's, or a seeded ML-1M-shaped stand-in written now."""
    if ctx.data_dir:
        return ctx.data_dir, f"MovieLens at {ctx.data_dir}"
    from experiments import make_movielens_like

    out = ctx.workdir.parent / "data" / f"movielens_like_{ctx.scale}"
    overrides = ctx.settings["movielens"]
    if not (out / "ratings.dat").exists():
        stats = make_movielens_like.write(out, seed=0, **overrides)
        ctx.log(f"data: wrote the ML-1M stand-in {out} ({json.dumps(stats)})")
    shape = ", ".join(f"{k} {v:,}" for k, v in overrides.items()) or "6,040 users, 3,883 movies, 500,000 ratings"
    return str(out), f"ML-1M stand-in (experiments/make_movielens_like.py, seed 0: {shape})"


def criteo_data(ctx: Context) -> tuple[str, str]:
    """(folder with train.txt, how to describe it): the user's (at cpu / tiny scale its first lines), or a seeded
    Kaggle-format stand-in written now."""
    lines = ctx.settings["criteo_lines"]
    if ctx.data_dir:
        source = pathlib.Path(ctx.data_dir).expanduser() / "train.txt"
        if not source.is_file():
            raise ValueError(f"--data_dir={ctx.data_dir} has no train.txt (Criteo Kaggle's file, from dac.tar.gz)")
        if lines is None:
            return str(source.parent), f"Criteo Kaggle train.txt at {source.parent}"
        out = ctx.workdir.parent / "data" / f"criteo_first_{lines}"
        if not (out / "train.txt").exists():
            out.mkdir(parents=True, exist_ok=True)
            with source.open("rb") as src, (out / "train.tmp").open("wb") as dst:
                for i, line in enumerate(src):
                    if i == lines:
                        break
                    dst.write(line)
            (out / "train.tmp").rename(out / "train.txt")
        return str(out), f"the first {lines:,} lines of {source} (--scale={ctx.scale})"
    from experiments import make_criteo_like

    lines = lines or FULL_STANDIN_LINES
    cap = ctx.settings["criteo_vocab_cap"]
    out = ctx.workdir.parent / "data" / f"criteo_like_{lines}_{cap}"
    stats_path = out / "stats.json"
    if not stats_path.exists():
        stats = make_criteo_like.write(out, lines=lines, vocab_cap=cap)
        stats_path.write_text(json.dumps(stats) + "\n")  # beside train.txt: the prepare reads train.txt only
        ctx.log(f"data: wrote the Criteo Kaggle stand-in {out / 'train.txt'}")
    stats = json.loads(stats_path.read_text())
    return str(out), (f"Criteo Kaggle stand-in (experiments/make_criteo_like.py, seed 0: {lines:,} lines, "
                      f"cardinalities capped at {cap:,}; teacher test AUC {stats['bayes_auc']:.4f})")


def criteo_base(ctx: Context, data_dir: str) -> ml_collections.ConfigDict:
    """dlrm_criteo_kaggle.py for `data_dir` (prepared under the workdir), without checkpoints, with the scale's
    budget (tiny: a few steps and one evaluation; otherwise the reference's one epoch, evaluated five times)."""
    config = sc.base_config("criteo_kaggle", data_dir, steps=ctx.settings["criteo_steps"],
                            prepared_dir=str(ctx.workdir.parent / "prepared"))
    config.checkpoint.enabled = False  # a sweep's result is its summary; an interrupted run trains again
    return config


def _fmt(x: float, digits: int = 4) -> str:
    return "nan" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _signed(x: float, digits: int = 4) -> str:
    return "nan" if x is None or not math.isfinite(x) else f"{x:+.{digits}f}"


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


# -------------------------------------------------------------------------------------------------------- md
def reproduce_md(ctx: Context) -> Report:
    """Ginart et al.'s MovieLens MF (MSE) at uniform and mixed dims, then DLRM CTR at 2x and 16x."""
    from compression.plan import md_blocks_base_dim
    from experiments.configs import mf_movielens
    from recjax.data import make_dataset

    data_dir, data = movielens_data(ctx)
    s = ctx.settings
    dim = s["mf_dim"]
    base = mf_movielens.get_config()
    base.data.dir = data_dir
    base.data.prepared_dir = str(ctx.workdir.parent / "prepared")
    base.train.progress_bar = False
    base.checkpoint.enabled = False
    if s["mf_epochs"] is not None:
        base.train.epochs = float(s["mf_epochs"])
    base.embedding.dim = dim
    runs = []

    def train(name: str, config: ml_collections.ConfigDict, setting: dict[str, Any]) -> dict:
        summary = train_or_resume(config, ctx.workdir / name, f"md: {name}:", ctx.log, _describe_mse)
        row = {"run": name, **setting, "embedding_params": summary["embedding_params"],
               "test_mse": summary["mse"], "test_rmse": summary["rmse"],
               "validation_mse": summary["validation"]["mse"], "selected_step": summary["selected_step"],
               "budget_steps": summary["budget_steps"]}
        runs.append(row)
        return row

    # Uniform dims (Ginart et al.'s UD baseline), the full model at `dim` first.
    ud: dict[int, list[dict]] = {}
    for seed in ctx.seeds:
        for d in s["mf_ud_dims"]:
            config = _copy(base, seed)
            config.embedding.dim = d
            row = train(f"mf_ud{d}_seed{seed}", config, {"model": "mf", "embedding": f"uniform dim {d}",
                                                          "alpha": 0.0, "base_dim": d, "seed": seed})
            ud.setdefault(d, []).append(row)
    full_rows = ud[dim]
    full_params = full_rows[0]["embedding_params"]

    # Mixed dims per frequency block: for each temperature, the largest base dim whose tables fit 1/8 of the full
    # model's params ("search alpha and base dim"); the best alpha is chosen on validation MSE, never on test.
    counts = make_dataset(base.data, seed=0).id_counts()
    md: dict[float, list[dict]] = {}
    unreachable = []
    for alpha in s["md_alphas"]:
        try:
            d0 = md_blocks_base_dim(counts, full_params / MD_TARGET, 4 * dim, {"alpha": alpha})
        except ValueError as error:
            unreachable.append(f"alpha {alpha:g}: {error}")
            ctx.log(f"md: alpha {alpha:g} skipped: {error}")
            continue
        for seed in ctx.seeds:
            config = _copy(base, seed)
            config.embedding.dim = d0
            config.embedding.method = "md_blocks"
            config.embedding.id_counts = "dataset"
            config.embedding.options.alpha = alpha
            row = train(f"mf_md_a{alpha:g}_seed{seed}", config, {"model": "mf", "embedding": "md_blocks",
                                                                  "alpha": alpha, "base_dim": d0, "seed": seed})
            md.setdefault(alpha, []).append(row)
    rows = []
    full_mse = _mean([r["test_mse"] for r in full_rows])
    if md:
        best = min(md, key=lambda a: _mean([r["validation_mse"] for r in md[a]]))
        chosen = md[best]
        mse = _mean([r["test_mse"] for r in chosen])
        ratio = full_params / _mean([r["embedding_params"] for r in chosen])
        small = dim // int(MD_TARGET)  # the uniform dim at the same budget
        ud_text = (f"; uniform dim {small} (8x): {_fmt(_mean([r['test_mse'] for r in ud[small]]))}" if small in ud
                   else "")
        rows.append(claim_row(
            "md_mf", f"test MSE {_fmt(mse)} at {ratio:.2f}x fewer embedding params (md_blocks, alpha {best:g} "
                     f"chosen on validation MSE, base dim {chosen[0]['base_dim']}) vs {_fmt(full_mse)} for full "
                     f"dim {dim}{ud_text}",
            f"MSE {_signed(mse - full_mse)} (lower is better)", "yes" if mse <= full_mse else "no",
            f"{data}; MF, {'seeds ' + str(list(ctx.seeds))}", ctx.scale))
    else:
        rows.append(claim_row("md_mf", "md_blocks reaches no 8x plan: " + "; ".join(unreachable), "n/a",
                              "no (out of reach)", data, ctx.scale))

    # DLRM click prediction on the same ratings (rated >= 4 stars) at 2x and 16x, per-table MD (the sweep).
    ctr_base = sc.base_config("movielens", data_dir, steps=s["ctr_steps"],
                              prepared_dir=str(ctx.workdir.parent / "prepared"))
    ctr_base.checkpoint.enabled = False
    out_of_reach: list[sc.UnreachableRatio] = []
    ctr = sc.run_sweep(ctr_base, ctx.workdir / "ctr", ["full", "md"], list(MD_CTR_RATIOS), list(ctx.seeds),
                       log=ctx.log, unreachable=out_of_reach)
    for r in ctr:
        runs.append({"run": f"ctr/{r['run']}", "model": "dlrm", "embedding": r["method"],
                     "alpha": 0.3 if r["method"] == "md" else 0.0, "target_ratio": r["target_ratio"],
                     "ratio": r["ratio"], "embedding_params": r["embedding_params"], "test_auc": r["auc"],
                     "test_accuracy": _accuracy(ctx.workdir / "ctr" / r["run"]), "seed": r["seed"],
                     "selected_step": r["selected_step"], "budget_steps": r["budget_steps"]})
    ctr_runs = runs[-len(ctr):] if ctr else []
    full_ctr = [r for r in ctr_runs if r["embedding"] == "full"]
    full_acc = _mean([r["test_accuracy"] for r in full_ctr])
    full_auc = _mean([r["test_auc"] for r in full_ctr])
    ctr_data = f"{data}; DLRM (dlrm_movielens.py), label rating >= 4 -- not Criteo Kaggle, the paper's CTR data"
    for key, target in (("md_half", 2.0), ("md_16x", 16.0)):
        at = [r for r in ctr_runs if r["embedding"] == "md" and r["target_ratio"] == target]
        if not at:
            error = next((e for e in out_of_reach if e.target <= target), None)
            rows.append(claim_row(key, f"not run: {error}" if error else "not run", "n/a",
                                  "no: out of md's reach here" if error else "n/a", ctr_data, ctx.scale))
            continue
        acc, auc = _mean([r["test_accuracy"] for r in at]), _mean([r["test_auc"] for r in at])
        ratio = _mean([r["ratio"] for r in at])
        gap = acc - full_acc
        holds = gap >= 0.001 if key == "md_half" else gap >= 0.0
        rows.append(claim_row(key, f"test accuracy {100 * acc:.2f} % (AUC {_fmt(auc)}) at {ratio:.2f}x vs "
                                   f"{100 * full_acc:.2f} % (AUC {_fmt(full_auc)}) full",
                              f"accuracy {100 * gap:+.2f} points, AUC {_signed(auc - full_auc)}",
                              ("yes" if holds else "no") + " (another dataset than the paper's)", ctr_data,
                              ctx.scale))

    def plot(path: pathlib.Path) -> None:
        series = {f"uniform dims ({', '.join(str(d) for d in sorted(ud))})":
                  [(_mean([r["embedding_params"] for r in v]), _mean([r["test_mse"] for r in v]))
                   for _, v in sorted(ud.items())]}
        for alpha, v in sorted(md.items()):
            series[f"md_blocks alpha {alpha:g}"] = [(_mean([r["embedding_params"] for r in v]),
                                                     _mean([r["test_mse"] for r in v]))]
        _plot(path, series, "embedding params (log scale)", "test MSE (lower is better)",
              f"MF on {data.split(' (')[0]}: uniform vs mixed dims", logx=True, hline=(full_mse, f"full dim {dim}"))

    return Report(rows, runs, data, plot)


def _accuracy(run_dir: pathlib.Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["accuracy"]


def _copy(config: ml_collections.ConfigDict, seed: int) -> ml_collections.ConfigDict:
    """A deep copy (keeps the budget's flexible fields, experiments/configs/common.py) with the run's seed."""
    out = copy.deepcopy(config)
    out.seed = seed
    return out


def _describe_mse(summary: dict) -> str:
    return (f"{summary['embedding_params']:,} embedding params, test mse {summary['mse']:.4f} at step "
            f"{summary['selected_step']:,} of {summary['budget_steps']:,}")


# -------------------------------------------------------------------------------------------------------- qr
def reproduce_qr(ctx: Context) -> Report:
    """QR with each combining op against hashing at the same ratios (equal params), on Criteo-format data."""
    data_dir, data = criteo_data(ctx)
    base = criteo_base(ctx, data_dir)
    s = ctx.settings
    results = {}
    baseline = sc.run_sweep(base, ctx.workdir / "hashing", ["full", "hashing"], list(s["qr_ratios"]),
                            list(ctx.seeds), log=ctx.log)
    results["hashing"] = [r for r in baseline if r["method"] == "hashing"]
    results["full"] = [r for r in baseline if r["method"] == "full"]
    unreachable: list[sc.UnreachableRatio] = []
    for op in s["qr_ops"]:
        results[f"qr-{op}"] = sc.run_sweep(base, ctx.workdir / f"qr_{op}", ["qr"], list(s["qr_ratios"]),
                                           list(ctx.seeds), qr_op=op, log=ctx.log, unreachable=unreachable)
    runs = []
    for name, rs in results.items():
        for r in rs:
            folder = "hashing" if name in ("hashing", "full") else name.replace("-", "_")
            runs.append({"run": f"{folder}/{r['run']}", "method": name, "target_ratio": r["target_ratio"],
                         "ratio": r["ratio"], "embedding_bytes": r["embedding_bytes"], "test_auc": r["auc"],
                         "test_logloss": r["logloss"],
                         "test_accuracy": _accuracy(ctx.workdir / folder / r["run"]), "seed": r["seed"],
                         "selected_step": r["selected_step"], "budget_steps": r["budget_steps"]})

    def at(method: str, ratio: float, metric: str) -> float:
        return _mean([r[metric] for r in runs if r["method"] == method and r["target_ratio"] == ratio])

    rows = []
    for op in s["qr_ops"]:
        method = f"qr-{op}"
        parts, gaps, wins = [], [], []
        for ratio in s["qr_ratios"]:
            if not any(r["method"] == method and r["target_ratio"] == ratio for r in runs):
                parts.append(f"{ratio:g}x: out of reach")
                continue
            dl = at(method, ratio, "test_logloss") - at("hashing", ratio, "test_logloss")
            da = at(method, ratio, "test_auc") - at("hashing", ratio, "test_auc")
            dacc = at(method, ratio, "test_accuracy") - at("hashing", ratio, "test_accuracy")
            parts.append(f"{ratio:g}x: logloss {_fmt(at(method, ratio, 'test_logloss'))} vs "
                         f"{_fmt(at('hashing', ratio, 'test_logloss'))}, AUC {_fmt(at(method, ratio, 'test_auc'))} "
                         f"vs {_fmt(at('hashing', ratio, 'test_auc'))}")
            gaps.append(f"{ratio:g}x: logloss {_signed(dl)}, AUC {_signed(da)}, accuracy {100 * dacc:+.2f} pts")
            wins.append(dl < 0 and dacc >= 0)
        holds = "yes" if wins and all(wins) else ("no" if wins else "n/a: out of reach")
        if wins and not all(wins) and any(wins):
            holds = f"partly ({sum(wins)} of {len(wins)} ratios)"
        claim = claim_row("qr", f"{method} vs hashing: " + "; ".join(parts), "; ".join(gaps) or "n/a", holds,
                          f"{data}; DLRM (dlrm_criteo_kaggle.py)", ctx.scale)
        claim["claim"] = f"{CLAIMS['qr'].claim} ({method})"
        rows.append(claim)

    def plot(path: pathlib.Path) -> None:
        series = {}
        for method in ["hashing", *(f"qr-{op}" for op in s["qr_ops"])]:
            points = sorted({r["target_ratio"] for r in runs if r["method"] == method})
            series[method] = [(at(method, x, "ratio"), at(method, x, "test_auc")) for x in points]
        full = _mean([r["test_auc"] for r in runs if r["method"] == "full"])
        _plot(path, series, "compression ratio (log scale)", "test AUC", "QR vs hashing at equal parameters",
              logx=True, hline=(full, "full"))

    return Report(rows, runs, data, plot, [str(e) for e in unreachable])


# ---------------------------------------------------------------------------------------------------- fiited
def reproduce_fiited(ctx: Context) -> Report:
    """FIITED at growing shares of the embedding memory pruned, against the full model's test AUC."""
    data_dir, data = criteo_data(ctx)
    base = criteo_base(ctx, data_dir)
    s = ctx.settings
    spec = sc.dataset_spec(base)
    result = sc.run_sweep(base, ctx.workdir, ["full", "fiited"], list(s["fiited_ratios"]), list(ctx.seeds),
                          log=ctx.log, method_options=FIITED_OPTIONS)
    runs = []
    for r in result:
        summary = json.loads((ctx.workdir / r["run"] / "summary.json").read_text())
        dynamic = summary.get("dynamic_tables", {})
        memory = dynamic.get("memory", [])  # the pools' bytes at every adjustment
        config = sc.run_config(base, spec, r["method"], r["target_ratio"], r["seed"],
                               method_options=FIITED_OPTIONS if r["method"] == "fiited" else None)
        start = sc.planned_accounting(spec, config)
        runs.append({"run": r["run"], "method": r["method"], "target_ratio": r["target_ratio"], "ratio": r["ratio"],
                     "pruned": 1.0 - 1.0 / r["ratio"], "embedding_bytes": r["embedding_bytes"],
                     "peak_ramp_bytes": max((e["embedding_bytes"] for e in memory), default=start["bytes"]),
                     # tables + optimizer state + FIITED's utility: what training holds at its peak
                     "peak_allocated_bytes": dynamic.get("peak_allocated_bytes", summary["embedding_bytes"]
                                                         + summary["embedding_optimizer_bytes"]),
                     "full_bytes": start["full_bytes"], "test_auc": r["auc"], "test_logloss": r["logloss"],
                     "seed": r["seed"], "selected_step": r["selected_step"], "budget_steps": r["budget_steps"]})
    full_auc = _mean([r["test_auc"] for r in runs if r["method"] == "full"])
    full_allocated = _mean([r["peak_allocated_bytes"] for r in runs if r["method"] == "full"])
    parts, held = [], []
    for ratio in s["fiited_ratios"]:
        at = [r for r in runs if r["method"] == "fiited" and r["target_ratio"] == ratio]
        if not at:
            continue
        auc, pruned = _mean([r["test_auc"] for r in at]), _mean([r["pruned"] for r in at])
        peak = _mean([r["peak_ramp_bytes"] / r["full_bytes"] for r in at])
        allocated = _mean([r["peak_allocated_bytes"] for r in at]) / full_allocated
        parts.append(f"{100 * pruned:.2f} % pruned: AUC {_fmt(auc)} ({_signed(auc - full_auc)}; during the ramp the "
                     f"tables peak at {peak:.2f}x the full ones, and training holds {allocated:.2f}x the full run's "
                     "tables + optimizer state with FIITED's utility)")
        held.append((pruned, auc - full_auc >= -SIGNIFICANT_AUC))
    most = max((p for p, ok in held if ok), default=None)
    ours = f"full AUC {_fmt(full_auc)}; " + "; ".join(parts)
    holds = ("yes" if held and all(ok for _, ok in held) else
             f"up to {100 * most:.2f} % pruned" if most is not None else "no")
    rows = [claim_row("fiited", ours, f"largest share pruned within {SIGNIFICANT_AUC} AUC of full: "
                      + (f"{100 * most:.2f} %" if most is not None else "none"), holds,
                      f"{data}; DLRM (dlrm_criteo_kaggle.py)", ctx.scale)]

    def plot(path: pathlib.Path) -> None:
        points = sorted((r["pruned"], r["test_auc"]) for r in runs if r["method"] == "fiited")
        _plot(path, {"fiited": points}, "share of the embedding memory pruned (after the ramp)", "test AUC",
              "FIITED: memory pruned vs quality", hline=(full_auc, "full"))

    return Report(rows, runs, data, plot)


# ------------------------------------------------------------------------------------------------- checknrun
def reproduce_checknrun(ctx: Context) -> Report:
    """Bytes per checkpoint interval (full vs incremental deltas at 32/8/4/2 bits) and the test AUC of training
    resumed from each against the uninterrupted run."""
    data_dir, data = criteo_data(ctx)
    s = ctx.settings
    base = criteo_base(ctx, data_dir)
    steps = s["ckpt_steps"]
    if steps is None:  # the reference's one epoch
        spec_base = sc.base_config("criteo_kaggle", data_dir, prepared_dir=str(ctx.workdir.parent / "prepared"))
        from recjax.data import make_dataset

        steps = math.ceil(make_dataset(spec_base.data, seed=0).num_examples("train") / int(base.train.batch_size))
    interval = max(1, steps // 10)
    restore_at = 6 * interval
    base.train.epochs, base.train.steps = None, steps
    base.train.eval_every, base.train.early_stopping_patience = steps, 0  # one evaluation, at the end: every
    base.train.log_every = min(int(base.train.log_every), steps)  # run reports the last step's test metrics
    base.checkpoint.enabled = True
    base.checkpoint.every_steps, base.checkpoint.every_minutes = interval, 0.0
    base.checkpoint.keep, base.checkpoint.keep_selected, base.checkpoint.async_save = 1000, False, False
    runs = []

    def checkpoint_bytes(run_dir: pathlib.Path) -> dict[int, int]:
        root = run_dir / "checkpoints"
        return {int(p.name): sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                for p in root.iterdir() if p.name.isdigit()} if root.is_dir() else {}

    def train(name: str, config: ml_collections.ConfigDict) -> tuple[dict, dict[int, int]]:
        run_dir = ctx.workdir / name
        bytes_path = run_dir / "checkpoint_bytes.json"
        summary = train_or_resume(config, run_dir, f"checknrun: {name}:", ctx.log, _describe_auc,
                                  keep_checkpoints=True)
        if not bytes_path.exists():
            bytes_path.write_text(json.dumps(checkpoint_bytes(run_dir)) + "\n")
        return summary, {int(k): v for k, v in json.loads(bytes_path.read_text()).items()}

    results = {}
    for seed in ctx.seeds:
        config = _copy(base, seed)
        config.checkpoint.policy = "full"
        summary, sizes = train(f"full_seed{seed}", config)
        per_interval = [v for step, v in sorted(sizes.items())]
        runs.append({"run": f"full_seed{seed}", "checkpoints": "full", "bits": 32, "seed": seed,
                     "bytes_per_interval": _mean(per_interval), "chain_bytes": _mean(per_interval),
                     "test_auc": summary["auc"], "test_logloss": summary["logloss"], "resumed_at": None})
        results[("full", seed)] = runs[-1]
        for bits in s["ckpt_bits"]:
            label = f"{bits or 32}bit"
            first = _copy(base, seed)
            first.train.steps = restore_at
            first.train.eval_every = restore_at
            first.checkpoint.policy, first.checkpoint.quantize_bits = "consecutive", bits
            _, sizes = train(f"delta{label}_seed{seed}/first", first)
            chain = [v for _, v in sorted(sizes.items())]
            resumed = _copy(base, seed)  # saves only its last step (deleted after): restoring needs checkpoints on
            resumed.checkpoint.every_steps = 0
            resumed.checkpoint.restore = str(ctx.workdir / f"delta{label}_seed{seed}" / "first" / "checkpoints")
            summary, _ = train(f"delta{label}_seed{seed}/resumed", resumed)
            runs.append({"run": f"delta{label}_seed{seed}", "checkpoints": "consecutive deltas", "bits": bits or 32,
                         "seed": seed, "bytes_per_interval": _mean(chain[1:]), "chain_bytes": sum(chain),
                         "test_auc": summary["auc"], "test_logloss": summary["logloss"], "resumed_at": restore_at})
    full = [r for r in runs if r["checkpoints"] == "full"]
    full_bytes, full_auc = _mean([r["bytes_per_interval"] for r in full]), _mean([r["test_auc"] for r in full])
    parts, gaps, ok = [], [], []
    for bits in s["ckpt_bits"]:
        at = [r for r in runs if r["checkpoints"] != "full" and r["bits"] == (bits or 32)]
        write = full_bytes / _mean([r["bytes_per_interval"] for r in at])
        capacity = _mean([r["chain_bytes"] for r in at]) / full_bytes  # what a restore needs, in full checkpoints
        dauc = _mean([r["test_auc"] for r in at]) - full_auc
        parts.append(f"{bits or 32}-bit deltas: {write:.1f}x less written per interval; the chain a restore reads (a "
                     f"baseline and {restore_at // interval - 1} deltas) holds {capacity:.2f}x one full "
                     f"checkpoint's bytes; resumed AUC {_fmt(full_auc + dauc)}")
        gaps.append(f"{bits or 32}-bit: writes {write:.1f}x less (paper 6-17x), stores {capacity:.2f}x a full "
                    f"checkpoint (paper 2.5-8x less), AUC {_signed(dauc, 5)}")
        ok.append((write >= 6.0, dauc >= -SIGNIFICANT_AUC))
    holds = ", ".join(f"{bits or 32}-bit {'yes' if w and a else 'no (' + ('bytes' if not w else 'AUC') + ')'}"
                      for bits, (w, a) in zip(s["ckpt_bits"], ok, strict=True))
    holds += " (write bandwidth and accuracy; the capacity figure is not met: a consecutive chain keeps every delta)"
    rows = [claim_row("checknrun", f"full checkpoints {full_bytes / 2**20:.1f} MiB per interval of {interval:,} "
                      f"steps, uninterrupted AUC {_fmt(full_auc)}; " + "; ".join(parts), "; ".join(gaps), holds,
                      f"{data}; DLRM (dlrm_criteo_kaggle.py, sparse SGD: no optimizer rows), {steps:,} steps, "
                      f"resumed at step {restore_at:,}", ctx.scale)]

    def plot(path: pathlib.Path) -> None:
        bits = [b or 32 for b in s["ckpt_bits"]]
        write = [full_bytes / _mean([r["bytes_per_interval"] for r in runs if r["checkpoints"] != "full"
                                     and r["bits"] == b]) for b in bits]
        _plot(path, {"write reduction vs full": list(zip(bits, write, strict=True))}, "delta row bits",
              "bytes written per interval: full / incremental", "Check-N-Run: write bandwidth vs bits",
              hline=(6.0, "the paper's lower bound (6x)"))

    return Report(rows, runs, data, plot)


# ------------------------------------------------------------------------------------------------------ dlrm
def reproduce_dlrm(ctx: Context) -> Report:
    """The reference's Kaggle configuration once per seed, its test accuracy against the published 78.9 %."""
    data_dir, data = criteo_data(ctx)
    base = criteo_base(ctx, data_dir)
    runs = []
    for seed in ctx.seeds:
        summary = train_or_resume(_copy(base, seed), ctx.workdir / f"dlrm_seed{seed}", f"dlrm: seed {seed}:",
                                  ctx.log, _describe_auc)
        runs.append({"run": f"dlrm_seed{seed}", "seed": seed, "test_accuracy": summary["accuracy"],
                     "test_auc": summary["auc"], "test_logloss": summary["logloss"],
                     "selected_step": summary["selected_step"], "budget_steps": summary["budget_steps"],
                     "examples_per_epoch": summary["examples_per_epoch"], "params": summary["params"]})
    acc = _mean([r["test_accuracy"] for r in runs])
    auc = _mean([r["test_auc"] for r in runs])
    paper = 0.789
    whole_kaggle = ctx.data_dir and ctx.settings["criteo_lines"] is None
    holds = ("yes" if acc >= paper - 0.001 else "no") if whole_kaggle else (
        "not comparable: " + ("a stand-in with its own click model" if not ctx.data_dir else
                              f"the first {ctx.settings['criteo_lines']:,} lines, not the whole file"))
    rows = [claim_row("dlrm", f"test accuracy {100 * acc:.2f} %, AUC {_fmt(auc)} (seeds {list(ctx.seeds)})",
                      f"accuracy {100 * (acc - paper):+.2f} points", holds,
                      f"{data}; dlrm_criteo_kaggle.py as shipped", ctx.scale)]

    def plot(path: pathlib.Path) -> None:
        import csv

        series = {}
        for r in runs:
            with (ctx.workdir / r["run"] / "metrics.csv").open(newline="") as f:
                points = [(float(x["epoch"] or 0), float(x["accuracy"])) for x in csv.DictReader(f)
                          if x["split"] == "validation"]
            series[f"validation, seed {r['seed']}"] = points
        _plot(path, series, "epoch", "validation accuracy", "DLRM, the reference's Kaggle configuration",
              hline=(paper, "MLPerf reference, test accuracy 78.9 %"))

    return Report(rows, runs, data, plot)


def _describe_auc(summary: dict) -> str:
    return (f"test auc {summary['auc']:.4f}, accuracy {summary['accuracy']:.4f} at step "
            f"{summary['selected_step']:,} of {summary['budget_steps']:,}")


# ---------------------------------------------------------------------------------------------------- wukong
def reproduce_wukong(ctx: Context) -> Report:
    """The scaling sweep's fit for Wukong and DLRM and their gap at equal FLOPs."""
    if ctx.data_dir:
        raise ValueError("--paper=wukong fits its scaling law on the hard-teacher synthetic data "
                         "(experiments/configs/scaling.py), whose interactions separate model sizes; it reads no "
                         "--data_dir")
    tiny = ctx.scale == "tiny"
    learning_rates = (1e-3, 2e-3) if ctx.scale == "full" else None
    steps = 6000 if ctx.scale == "full" else None
    rows_, fit = sweep_scaling.run_sweep(ctx.workdir, ("wukong", "dlrm"), ctx.seeds, ctx.settings["scaling_sizes"],
                                         steps, tiny, learning_rates, log=ctx.log)
    data = ("the scaling sweep's hard-teacher synthetic data (" + ("its --tiny setting" if tiny else
            "experiments/configs/scaling.py") + f"), {fit['examples_per_run']:,} examples per run")
    runs = [{k: r[k] for k in ("run", "family", "size", "learning_rate", "best_lr", "flops_per_example",
                               "logloss", "auc", "seed")} for r in rows_]
    wukong = fit["fits"].get("wukong")
    rows = []
    if wukong:
        law = (f"test logloss = {wukong['a']:.3g} F^-{wukong['b']:.3f} + {wukong['c']:.4f}, R^2 {wukong['r2']:.3f} "
               f"over {wukong['flops_min']:.3g}..{wukong['flops_max']:.3g} FLOPs/example "
               f"({math.log10(wukong['flops_max'] / wukong['flops_min']):.1f} orders)")
        orders = math.log10(wukong["flops_max"] / wukong["flops_min"])
        rows.append(claim_row("wukong_law", law, f"{orders:.1f} orders of magnitude of FLOPs (paper: 2), up to "
                              f"{wukong['flops_max'] / 1e9:.2g} GFLOP/example (paper: beyond 100)",
                              "yes, over this range" if wukong["meaningful"] else
                              "no: " + "; ".join(wukong["warnings"]), data, ctx.scale))
    else:
        rows.append(claim_row("wukong_law", "no fit (fewer than 3 sizes)", "n/a", "n/a", data, ctx.scale))
    versus = fit["equal_flops"].get("wukong_vs_dlrm", {})
    measured = versus.get("measured", {})
    gap = measured.get("mean_gap")
    if gap is not None:
        rows.append(claim_row("wukong_vs", f"DLRM's logloss minus Wukong's at equal FLOPs: {gap:+.4f} on average "
                              f"over {measured['comparisons']} sizes; Wukong better at "
                              f"{100 * measured['family_better']:.0f} % of them",
                              f"logloss {-gap:+.4f} (Wukong - DLRM)", "yes" if gap > 0 else "no", data, ctx.scale))
    else:
        rows.append(claim_row("wukong_vs", "no overlap in FLOPs", "n/a", "n/a", data, ctx.scale))

    def plot(path: pathlib.Path) -> None:
        shutil.copyfile(ctx.workdir / "scaling.png", path)

    return Report(rows, runs, data, plot)


# --------------------------------------------------------------------------------------------------- outputs
def _plot(path: pathlib.Path, series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str, title: str,
          logx: bool = False, hline: tuple[float, str] | None = None) -> None:
    """Lines of points on matplotlib's Agg canvas (no display, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, points in series.items():
        points = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", linestyle="-" if len(points) > 1 else "none", label=label)
    if hline is not None and math.isfinite(hline[0]):
        ax.axhline(hline[0], color="black", linestyle="--", linewidth=0.8, label=hline[1])
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def markdown(report: Report, paper: str, scale: str, seconds: float) -> str:
    """reproduction.md: the claims table, then the runs behind it."""
    lines = [f"# {paper}: the paper's figure beside ours", "",
             f"Data: {report.data}. Scale: {scale}. Wall time: {seconds / 60:.1f} min.", "",
             "| claim | paper's figure (source) | ours | gap | holds |", "|---|---|---|---|---|"]
    for r in report.rows:
        lines.append(f"| {r['claim']} | {r['paper_figure']} ({r['source']}) | {r['ours']} | {r['gap']} | "
                     f"{r['holds']} |")
    for note in report.notes:
        lines += ["", f"- {note}"]
    if report.runs:
        fields = list(dict.fromkeys(k for r in report.runs for k in r))
        lines += ["", "Runs (test metrics at each run's selected step):", "", "| " + " | ".join(fields) + " |",
                  "|" + "---|" * len(fields)]
        for r in report.runs:
            lines.append("| " + " | ".join(_cell(r.get(k)) for k in fields) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return "" if value is None else str(value)


def print_table(rows: Sequence[dict[str, Any]], log: Callable[[str], None]) -> None:
    for r in rows:
        log(f"[{r['paper']}] {r['claim']}\n  paper: {r['paper_figure']}\n         ({r['source']})\n"
            f"  ours:  {r['ours']}\n  gap:   {r['gap']}\n  holds: {r['holds']}\n  data:  {r['data']}; scale "
            f"{r['scale']}")


REPRODUCERS: dict[str, Callable[[Context], Report]] = {
    "md": reproduce_md, "qr": reproduce_qr, "fiited": reproduce_fiited, "checknrun": reproduce_checknrun,
    "dlrm": reproduce_dlrm, "wukong": reproduce_wukong}


def reproduce(paper: str, scale: str, workdir: str | pathlib.Path, data_dir: str = "",
              seeds: Sequence[int] | None = None, log: Callable[[str], None] = print) -> Report:
    """Run one paper's reproduction in `workdir`/<paper>; write reproduction.csv / .md / .png and runs.csv there;
    return the report."""
    if paper not in REPRODUCERS:
        raise ValueError(f"unknown paper '{paper}'; choose one of {list(PAPERS)} or 'all'")
    if scale not in SCALES:
        raise ValueError(f"unknown scale '{scale}'; choose one of {list(SCALES)}")
    out = pathlib.Path(workdir) / paper
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(paper, scale, out, data_dir, log, tuple(seeds or SCALE_SETTINGS[scale]["seeds"]))
    t0 = time.perf_counter()
    report = REPRODUCERS[paper](ctx)
    seconds = time.perf_counter() - t0
    write_csv(out / "reproduction.csv", report.rows, ROW_FIELDS)
    fields = list(dict.fromkeys(k for r in report.runs for k in r))
    write_csv(out / "runs.csv", report.runs, fields)
    (out / "reproduction.md").write_text(markdown(report, paper, scale, seconds))
    if report.plot is not None:
        report.plot(out / "reproduction.png")
    print_table(report.rows, log)
    log(f"{paper}: {seconds / 60:.1f} min; table: {out / 'reproduction.md'}, csv: {out / 'reproduction.csv'}, "
        f"plot: {out / 'reproduction.png'}")
    return report


# ------------------------------------------------------------------------------------------------------ main
def define_flags() -> None:
    flags.DEFINE_string("paper", None, f"Which paper's headline to reproduce: one of {list(PAPERS)}, or 'all'.")
    flags.DEFINE_enum("scale", "cpu", list(SCALES), "tiny (seconds), cpu (minutes on 2 cores), full (the papers').")
    flags.DEFINE_string("data_dir", "", "MovieLens folder (md) or folder with Criteo Kaggle's train.txt (qr, fiited, "
                        "checknrun, dlrm); empty: a seeded stand-in, written under the workdir.")
    flags.DEFINE_string("workdir", None, "Output directory; a fresh temp directory if unset.")
    flags.DEFINE_list("seeds", [], "Run seeds; default: the scale's (tiny, cpu: 0; full: 0, 1, 2).")
    flags.DEFINE_bool("compilation_cache", True, "Keep XLA executables in <workdir>/.jax_cache.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {argv[1:]}")
    args = flags.FLAGS
    if not args.paper:
        cli.fail(f"--paper is required: one of {list(PAPERS)}, or 'all'")
    papers = list(PAPERS) if args.paper == "all" else [p.strip() for p in args.paper.split(",")]
    unknown = [p for p in papers if p not in PAPERS]
    if unknown:
        cli.fail(f"--paper: unknown {unknown}; choose from {list(PAPERS)} or 'all'")
    if args.data_dir and len(papers) > 1:
        cli.fail("--data_dir holds one dataset (MovieLens for md, Criteo for the others): give one --paper with it")
    try:
        seeds = [int(s) for s in args.seeds]
    except ValueError:
        cli.fail(f"--seeds: whole numbers, got {args.seeds}")
    workdir = open_workdir(args.workdir, "recjax_reproduce_", args.compilation_cache)
    log = lambda line: print(line, flush=True)  # noqa: E731
    with keep_or_remove_on_failure(workdir, chosen=bool(args.workdir)):
        for paper in papers:
            try:
                reproduce(paper, args.scale, workdir, args.data_dir, seeds, log)
            except ValueError as error:
                cli.fail(str(error))


if __name__ == "__main__":
    define_flags()
    cli.run(main)


