r"""Models side by side on one dataset, selected honestly: model families x seeds (x a grid of any config knobs),
each run with early stopping on the validation split, test reported at the selected step -> results.csv,
results_summary.csv.

    python -m experiments.sweep_models --config=experiments/configs/dlrm_movielens.py \
        --config.data.dir=/path/to/ml-100k --models=dlrm,fm,lr --seeds=0,1,2 \
        --grid=optimizer.sparse.weight_decay=0,0.001,0.003 --workdir=runs/ml100k_models

The dataset config gives everything but the model: `model.name` is swapped per run (each family's knobs come from
the config's `model.<name>` section; `lr` embeds ids in 1 dimension, `fm` uses embedding.dim as weight + factors;
the learning rates and regularisation the config tuned for that family come from its `model_defaults`,
experiments/configs/common.py:swap_model), and any `--config.*` override applies to every run (and wins). Each
`--grid=KEY=V1,V2,...` (repeatable; values are Python literals) multiplies the runs: every (model, seed) trains at
each combination and keeps the run with the best validation metric (`train.select_on`), so each family gets its own
learning rates and regularisation and the test split never chooses anything. Runs go to
`<workdir>/<model>[_<knob><value>...]_seed<s>/` and resume as in every sweep (experiments/runs.py).

Outputs in --workdir:
  results.csv           one row per run: model, seed, the grid's values (`setting`), kept (the (model, seed)'s
                        selected run), selected_step, selected_epoch (the epochs of train data seen at the selected
                        step), epochs (the epochs it trained: to the budget, or to the early stop, `train.
                        early_stopping_patience` evaluations past the selected step), stopped_early, validation_auc,
                        validation_logloss, auc, logloss, ne (test at the selected step), params, examples_per_sec, run
  results_summary.csv   per model over the kept runs: mean and std (over seeds) of test auc and logloss, validation
                        auc, the mean epochs trained and the mean selected epoch, the kept settings; printed as a
                        table
"""

import ast
import copy
import itertools
import pathlib
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from experiments.configs.common import swap_model
from experiments.runs import keep_or_remove_on_failure, open_workdir, train_or_resume, write_csv
from recjax import cli
from recjax.errors import ConfigError
from recjax.models import MODELS

RESULT_FIELDS = ("model", "seed", "setting", "kept", "selected_step", "selected_epoch", "epochs", "stopped_early",
                 "validation_auc", "validation_logloss", "auc", "logloss", "ne", "params", "examples_per_sec", "run")
SUMMARY_FIELDS = ("model", "runs", "auc_mean", "auc_std", "logloss_mean", "logloss_std", "validation_auc_mean",
                  "epochs_mean", "selected_epoch_mean", "kept_settings")


def parse_grid(entries: Sequence[str]) -> dict[str, list[Any]]:
    """["optimizer.sparse.weight_decay=0,0.001", ...] -> {key: [values]} (values as Python literals)."""
    grid: dict[str, list[Any]] = {}
    for entry in entries:
        key, sep, values = entry.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise ValueError(f"--grid: expected KEY=V1,V2,... such as optimizer.sparse.weight_decay=0,0.001, got "
                             f"{entry!r}")
        grid[key.strip()] = [_literal(v.strip()) for v in values.split(",")]
    return grid


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def grid_settings(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values ([{}] for no grid)."""
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def run_config(base: ml_collections.ConfigDict, model: str, seed: int, setting: Mapping[str, Any],
               explicit: Collection[str] = (), log: Callable[[str], None] | None = None) -> ml_collections.ConfigDict:
    """`base` swapped to `model` (with the learning rates and regularisation the config tuned for it, but for the
    `explicit` keys: the command line's overrides and the grid's keys win), `seed` and the grid's `setting`; the
    swap's console lines go to `log`."""
    if model not in MODELS:
        raise ConfigError("--models", f"unknown model '{model}'; use some of {list(MODELS)}")
    config = copy.deepcopy(base)  # keeps the flexible (object-typed) budget fields of experiments/configs/common.py
    config.seed = seed
    for key, value in setting.items():
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            if part not in node:
                raise ConfigError("--grid", f"the config has no field '{key}'")
            node = node[part]
        if leaf not in node:
            raise ConfigError("--grid", f"the config has no field '{key}'")
        node[leaf] = value
    for line in swap_model(config, model, {*explicit, *setting}):
        if log is not None:
            log(line)
    config.train.progress_bar = False
    return config


def run_name(model: str, seed: int, setting: Mapping[str, Any]) -> str:
    knobs = "".join(f"_{key.rsplit('.', 1)[-1]}{value:g}" if isinstance(value, float) else
                    f"_{key.rsplit('.', 1)[-1]}{value}" for key, value in setting.items())
    return f"{model}{knobs}_seed{seed}"


def mark_kept(rows: list[dict[str, Any]], select_on: str) -> list[dict[str, Any]]:
    """Set `kept` on the run with the best validation metric of every (model, seed); ties keep the first."""
    sign = 1.0 if select_on == "auc" else -1.0
    best: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        key = (row["model"], row["seed"])
        if key not in best or sign * row[f"validation_{select_on}"] > sign * best[key][f"validation_{select_on}"]:
            best[key] = row
    for row in rows:
        row["kept"] = row is best[(row["model"], row["seed"])]
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and std over seeds of the kept runs, per model (std 0 for a single seed)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        kept = [r for r in rows if r["model"] == model and r["kept"]]
        std = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)  # noqa: E731
        out.append({
            "model": model, "runs": len(kept),
            "auc_mean": statistics.fmean(r["auc"] for r in kept), "auc_std": std([r["auc"] for r in kept]),
            "logloss_mean": statistics.fmean(r["logloss"] for r in kept),
            "logloss_std": std([r["logloss"] for r in kept]),
            "validation_auc_mean": statistics.fmean(r["validation_auc"] for r in kept),
            "epochs_mean": statistics.fmean(r["epochs"] or 0.0 for r in kept),  # trained, not selected
            "selected_epoch_mean": statistics.fmean(r["selected_epoch"] or 0.0 for r in kept),
            "kept_settings": "; ".join(r["setting"] or "-" for r in kept),
        })
    return out


def run_sweep(base: ml_collections.ConfigDict, workdir: str | pathlib.Path, models: Sequence[str],
              seeds: Sequence[int], grid: Mapping[str, Sequence[Any]] | None = None,
              log: Callable[[str], None] = print, explicit: Collection[str] = ()
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train every run not trained yet; write results.csv and results_summary.csv; return (rows, summary).
    `explicit`: the keys of `base` the user set (they win over a model swap's defaults, as the grid's keys do)."""
    if not models or not seeds:
        raise ConfigError("--models", "the sweep has no runs: give at least one model and one seed")
    settings = grid_settings(grid or {})
    runs = [(model, int(seed), setting) for model in models for seed in seeds for setting in settings]
    # Every grid key is checked before anything trains; each model's swap is printed once.
    first = runs[0][1:]
    configs = [run_config(base, model, seed, setting, explicit, log if (seed, setting) == first else None)
               for model, seed, setting in runs]
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, ((model, seed, setting), config) in enumerate(zip(runs, configs, strict=True), 1):
        run_dir = workdir / run_name(model, seed, setting)
        summary = train_or_resume(config, run_dir, f"[{i}/{len(runs)}] {run_dir.name}:", log, _describe)
        rows.append({
            "model": model, "seed": seed, "setting": " ".join(f"{k}={v}" for k, v in setting.items()),
            "kept": False, "selected_step": summary["selected_step"],
            "selected_epoch": (summary["selected_step"] * summary["batch_size"] / summary["examples_per_epoch"]
                               if summary.get("examples_per_epoch") else None),
            "epochs": summary.get("epochs"),
            "stopped_early": summary["stopped_early"], "validation_auc": summary["validation"]["auc"],
            "validation_logloss": summary["validation"]["logloss"], "auc": summary["auc"],
            "logloss": summary["logloss"], "ne": summary["ne"], "params": summary["params"],
            "examples_per_sec": summary["examples_per_sec"], "run": run_dir.name,
        })
        write_csv(workdir / "results.csv", mark_kept(rows, base.train.select_on), RESULT_FIELDS)
    summary_rows = summarize(rows)
    write_csv(workdir / "results_summary.csv", summary_rows, SUMMARY_FIELDS)
    return rows, summary_rows


def format_table(summary_rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [f"{'model':<8} {'runs':>4}  {'test auc':>17}  {'test logloss':>17}  {'val auc':>7}  {'epochs':>6}  "
             f"{'sel. ep':>7}  kept settings"]
    for r in summary_rows:
        lines.append(f"{r['model']:<8} {r['runs']:>4}  {r['auc_mean']:.4f} ± {r['auc_std']:.4f}  "
                     f"{r['logloss_mean']:.4f} ± {r['logloss_std']:.4f}  {r['validation_auc_mean']:.4f}  "
                     f"{r['epochs_mean']:>6.2f}  {r['selected_epoch_mean']:>7.2f}  {r['kept_settings']}")
    return lines


def _describe(summary: dict) -> str:
    return (f"test auc {summary['auc']:.4f} at step {summary['selected_step']} (validation auc "
            f"{summary['validation']['auc']:.4f})")


# ------------------------------------------------------------------------------------------------ main
def define_flags() -> None:
    """The command-line flags; defined only when run as a script."""
    cli.define_config_flag(pathlib.Path(__file__).parent / "configs" / "dlrm_movielens.py",
                           "The dataset's config (with :preset); --config.* overrides apply to every run.")
    flags.DEFINE_list("models", ["dlrm", "fm", "lr"], f"Model families, from {list(MODELS)}.")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "Run seeds (config.seed: initialisation and order).")
    flags.DEFINE_multi_string("grid", [], "KEY=V1,V2,...: config values to try per (model, seed), kept by "
                              "validation; repeat for a product grid.")
    flags.DEFINE_string("workdir", None, "Sweep output directory; a fresh temp directory if unset.")
    flags.DEFINE_bool("compilation_cache", True, "Keep XLA executables in <workdir>/.jax_cache for resumed sweeps.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {argv[1:]}")
    args = flags.FLAGS
    try:  # flag mistakes are usage errors, not tracebacks
        models = [m.strip() for m in args.models]
        seeds = [int(s) for s in args.seeds]
        grid = parse_grid(args.grid)
    except ValueError as e:
        cli.fail(str(e))
    base = args["config"].value
    workdir = open_workdir(args.workdir, "recjax_models_", args.compilation_cache)
    t0 = time.perf_counter()
    with keep_or_remove_on_failure(workdir, chosen=bool(args.workdir)):
        rows, summary_rows = run_sweep(base, workdir, models, seeds, grid, log=lambda line: print(line, flush=True),
                                       explicit=config_flags.get_override_values(args["config"]))
    print(f"{len(rows)} runs in {time.perf_counter() - t0:.0f} s; test metrics at each kept run's selected step, "
          f"mean ± std over seeds {seeds}:")
    for line in format_table(summary_rows):
        print(line)
    print(f"results: {workdir / 'results.csv'}\nsummary: {workdir / 'results_summary.csv'}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
