r"""Sweep embedding compression: methods x target compression ratios x seeds -> results.csv and pareto.png.

    python -m experiments.sweep_compression                       # synthetic, every method, 3 seeds
    python -m experiments.sweep_compression --dataset=movielens --data_dir=/path/to/ml-100k \
        --methods=full,hashing,qr,md --ratios=1,4,16 --seeds=0 --workdir=runs/sweep_ml100k
    python -m experiments.sweep_compression --dataset=criteo_kaggle --data_dir=/path/to/kaggle \
        --ratios=4,16 --seeds=0 --steps=20000 --workdir=runs/sweep_kaggle

Datasets: `synthetic` (experiments/configs/dlrm_synthetic.py shrunk by `synthetic_sweep_config` so the default
sweep takes a few minutes on 2 CPU cores), `movielens` (dlrm_movielens.py) and `criteo_kaggle`
(dlrm_criteo_kaggle.py); the real ones need --data_dir.

For every (method, target ratio) `compression_plan` derives the method's knobs so that the model's embedding bytes
come as close as the method allows to (full bytes) / ratio. Tables with vocab_size <= --threshold stay full (as
the facebookresearch/dlrm reference's --qr-threshold / --md-threshold), and the other tables are compressed a bit
harder to make up for them:
  hashing  buckets = round(n / r') per table,
  qr       the remainder rows m (collisions) per table with ceil(n / m) + m rows ~ n / r' (both tables counted;
           with op "concat" each table has half the columns),
  tt       the TT-rank per table (3 cores, default factors; compression/tt.py) with core params ~ n d / r',
where one per-table ratio r' for all compressed tables is found by bisection on the total bytes;
  md       the plan's budget mode (compression/plan.py) with budget = full params / ratio;
  fiited, row_prune, uniform_dim   `keep` = the share of each compressed table's values kept, so that the kept
           values plus the full tables come to full params / ratio: the budget FIITED (Luo et al. 2024) states,
           after the methods' own model bytes (FIITED's packed row offsets, about 1.1 % of a 16-dim table) are
           taken from the budget.
"full" is the baseline and runs once per seed, at ratio 1. A ratio a method cannot reach (QR needs at least
2 sqrt(n) rows, MD at least dim 1 per row, TT rank 1, tables kept full cost what they cost) is never run at some
other ratio: the sweep prints one line with the largest ratio the method reaches on these tables (its plan at
maximum compression) and skips that method's targets beyond it; "reaching" allows REACH_TOLERANCE (5 %) below the
target, as the methods' integer knobs step. Every CSV and the plot report the *achieved* ratio: the run summary's
`compression_ratio` (full bytes / embedding bytes, recjax.train). FIITED's pools start full and shrink to their
budget over the ramp (compression/fiited.py): the ratio planned for it is the one after the ramp, and the log line
says the memory the pools hold until then.

Each run calls `recjax.train.train_and_evaluate` in `<workdir>/<method>_x<ratio>_seed<seed>/`. A run whose
summary.json exists is not trained again (the sweep resumes); if its config.json differs from the config the
sweep would run, the sweep stops rather than mix results. Every (method, target, seed) row is its own run: no run
stands in for another target. The script keeps compiled steps in <workdir>/.jax_cache
(--compilation_cache), so runs that differ only in their seed skip most of the compile. Outputs in --workdir:
  results.csv          one row per (method, target_ratio, seed): method, target_ratio, ratio, params (dense +
                       embedding), embedding_params, embedding_bytes, auc, logloss, ne, examples_per_sec, seed,
                       run (the subdirectory with its summary.json)
  results_summary.csv  one row per (method, target_ratio): runs, ratio, embedding_bytes, mean and std over
                       seeds of auc, logloss, ne (std is the sample std; 0 for a single seed)
  pareto.png           test AUC vs embedding bytes (log x), one line per method, error bars = std over seeds
"""

import csv
import dataclasses
import math
import pathlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
from absl import flags

from compression.base import TableSpec
from compression.plan import plan_tables
from compression.registry import build_method
from experiments.runs import keep_or_remove_on_failure, open_workdir, train_or_resume, write_csv
from recjax import cli
from recjax.data import make_dataset
from recjax.embedding import EmbeddingCollection
from recjax.specs import DatasetSpec

DATASETS = ("synthetic", "movielens", "criteo_kaggle")
METHODS = ("full", "hashing", "qr", "md", "tt", "fiited", "row_prune", "uniform_dim")
# Methods whose knob is `keep`, the share of the embedding values kept (compression/fiited.py).
KEEP_METHODS = ("fiited", "row_prune", "uniform_dim")
RESULT_FIELDS = ("method", "target_ratio", "ratio", "params", "embedding_params", "embedding_bytes", "auc",
                 "logloss", "ne", "examples_per_sec", "seed", "selected_step", "budget_steps", "run")
SUMMARY_METRICS = ("auc", "logloss", "ne")
# The same colour for a method in every plot.
METHOD_COLORS = {"hashing": "tab:blue", "qr": "tab:orange", "md": "tab:green", "tt": "tab:red",
                 "fiited": "tab:purple", "row_prune": "tab:brown", "uniform_dim": "tab:gray"}
DEFAULT_THRESHOLD = 200  # the facebookresearch/dlrm reference's --qr-threshold / --md-threshold default
# A target counts as reached when the planned ratio is at most this far below it (relative): MD's integer dims, QR's
# integer remainders and TT's ranks move the bytes in steps (tests/test_sweep_compression.py: within 2-10 %).
REACH_TOLERANCE = 0.05


class UnreachableRatio(ValueError):
    """A method cannot compress the tables to the target: `largest` is the ratio of `section`, its closest plan --
    its maximum compression, but for uniform_dim, whose ratio moves in steps (what it would run instead, which the
    sweep never does silently)."""

    def __init__(self, method: str, target: float, largest: float, section: ml_collections.ConfigDict):
        if method in REACH_LIMITS:
            text = f"the most it compresses them is {largest:.2f}x ({REACH_LIMITS[method]})"
        else:
            text = f"its closest plan compresses them {largest:.2f}x ({STEP_LIMITS.get(method, 'its knobs step')})"
        super().__init__(f"{method} cannot reach {target:g}x on these tables: {text}")
        self.method, self.target, self.largest, self.section = method, target, largest, section


# Why a method's compression stops where it does (the UnreachableRatio message) ...
REACH_LIMITS = {
    "md": "every table over the threshold at dim 1 plus its projection; the rest full",
    "qr": "every table over the threshold at about 2 sqrt(n) rows; the rest full",
    "tt": "every table over the threshold at TT-rank 1; the rest full",
    "hashing": "one bucket per table over the threshold; the rest full",
    "fiited": "the tables kept full and the packed row offsets alone exceed the budget",
    "row_prune": "the tables kept full and the packed row offsets alone exceed the budget",
}
# ... or, for a method whose ratio moves in steps, why it falls between them.
STEP_LIMITS = {"uniform_dim": "every row round(keep D) columns wide, so the ratio moves in steps of whole columns"}
# The sweep's epoch budget where it differs from the dataset config's (which is sized for the full model, early
# stopped). Compressed tables learn slower -- hashing's shared buckets, FIITED's re-laid-out pools -- and with the
# configs' 10 epochs most compressed runs were selected at their last step, still improving when the budget ended
# (benchmarks/RESULTS.md, "FIITED against hashing on MovieLens"); early stopping ends the runs that peak sooner.
SWEEP_EPOCHS = {"movielens": 20.0}


# -------------------------------------------------------------------------------------------- configs
def synthetic_sweep_config() -> ml_collections.ConfigDict:
    """dlrm_synthetic.py's `small` preset shrunk for a sweep: 8 features (19,900 rows), 250 steps of 512.

    Big enough that compression costs AUC (hashing at 64x is ~0.05 AUC below full in the default sweep), small
    enough that one run (compile, train, evaluate) takes a few seconds on 2 CPU cores.
    """
    from experiments.configs import dlrm_synthetic

    config = dlrm_synthetic.get_config("small")
    config.data.vocab_cap = 0
    config.data.vocab_sizes = (8_000, 6_000, 3_000, 2_000, 600, 250, 40, 10)
    config.data.eval_examples = 16_384
    config.data.teacher.pairs = 8
    config.model.dlrm.bottom_mlp = (64, 16)
    config.model.dlrm.top_mlp = (64, 1)
    config.train.steps = 250
    config.train.eval_every = 250  # one evaluation, at the end
    config.train.log_every = 50
    return config


def base_config(dataset: str, data_dir: str = "", steps: int | None = None,
                prepared_dir: str = "", epochs: float | None = None) -> ml_collections.ConfigDict:
    """The dataset's DLRM config with the progress bar off and the sweep's budget: `steps` overrides train.steps,
    `epochs` train.epochs; neither: SWEEP_EPOCHS for the dataset if it has one, else the config's budget."""
    if dataset == "synthetic":
        config = synthetic_sweep_config()
    elif dataset == "movielens":
        from experiments.configs import dlrm_movielens

        config = dlrm_movielens.get_config()
    elif dataset == "criteo_kaggle":
        from experiments.configs import dlrm_criteo_kaggle

        config = dlrm_criteo_kaggle.get_config()
    else:
        raise ValueError(f"unknown dataset '{dataset}'; choose one of {DATASETS}")
    if dataset != "synthetic":
        if not data_dir:
            raise ValueError(f"dataset '{dataset}' needs --data_dir (the folder with the raw files)")
        config.data.dir = str(pathlib.Path(data_dir).expanduser().resolve())
        if prepared_dir:
            config.data.prepared_dir = prepared_dir
    if steps is not None and epochs is not None:
        raise ValueError("give --steps or --epochs, not both")
    if epochs is None and steps is None and config.train.epochs is not None:
        epochs = SWEEP_EPOCHS.get(dataset)
    if epochs is not None:
        if not epochs > 0 or config.train.epochs is None:
            raise ValueError(f"epochs must be > 0 on a dataset with epochs (movielens, criteo_kaggle), got {epochs} "
                             f"for '{dataset}'")
        config.train.epochs = float(epochs)
    if steps is not None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        every = config.train.eval_every
        config.train.epochs = None
        config.train.steps = steps
        config.train.eval_every = min(every, steps) if isinstance(every, int) else steps
        config.train.log_every = min(int(config.train.log_every), steps)
    config.train.progress_bar = False
    return config


def dataset_spec(config: ml_collections.ConfigDict) -> DatasetSpec:
    """The feature spec of `config.data` (prepares a real dataset on first use, as training would)."""
    return make_dataset(config.data, seed=config.seed).spec


# --------------------------------------------------------------------------------- knobs for a ratio
def table_params(name: str, vocab_size: int, dim: int, method: str, options: dict[str, Any]) -> int:
    """Params of one logical table (physical rows + glue), from the method itself (compression/registry.py)."""
    m = build_method(TableSpec(name, vocab_size, dim, method, options))
    return sum(t.params for t in m.physical_tables()) + m.glue_params()


def _qr_collisions(name: str, n: int, dim: int, op: str, target_params: float) -> int:
    """The QR remainder size m whose table params (ceil(n/m) + m rows) come closest to `target_params` (in log).

    Params fall with m up to ~sqrt(n) (the most QR can compress), so the crossing is found by bisection there.
    """
    params = lambda m: table_params(name, n, dim, "qr", {"collisions": m, "op": op})
    m_best = max(1, math.isqrt(n))  # minimises ceil(n/m) + m up to +-1
    m_best = min((m_best, m_best + 1), key=params)
    if params(1) <= target_params:
        return 1
    if params(m_best) > target_params:
        return m_best
    lo, hi = 1, m_best  # params(lo) > target >= params(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if params(mid) > target_params else (lo, mid)
    return min((lo, hi), key=lambda m: abs(math.log(params(m) / target_params)))


def _tt_rank(name: str, n: int, dim: int, target_params: float) -> int:
    """The TT-rank (every inner rank; default cores and factors) whose core params come closest to `target_params`
    (in log). Params grow with the rank (~ n^(1/3) d r^2 for 3 cores), so the crossing is found by bisection; the
    rank is capped where the cores would exceed the full table (rank 1 is the most TT can compress)."""
    params = lambda r: table_params(name, n, dim, "tt", {"rank": r})
    lo, hi = 1, 2
    while params(hi) < min(target_params, n * dim) and hi < 4096:
        lo, hi = hi, hi * 2
    if params(lo) >= target_params:
        return lo
    if params(hi) <= target_params:
        return hi
    while hi - lo > 1:  # params(lo) < target < params(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if params(mid) < target_params else (lo, mid)
    return min((lo, hi), key=lambda r: abs(math.log(params(r) / target_params)))


def _per_table_knobs(method: str, name: str, n: int, dim: int, table_ratio: float, qr_op: str) -> dict[str, Any]:
    """The knobs compressing one table by about `table_ratio`."""
    if method == "hashing":
        return {"buckets": max(1, min(n, round(n / table_ratio)))}
    if method == "qr":
        return {"collisions": _qr_collisions(name, n, dim, qr_op, n * dim / table_ratio)}
    if method == "tt":
        return {"rank": _tt_rank(name, n, dim, n * dim / table_ratio)}
    raise ValueError(f"no per-table knobs for method '{method}'")


def embedding_section(method: str, spec: DatasetSpec, dim: int, target_ratio: float,
                      threshold: int = DEFAULT_THRESHOLD, qr_op: str = "mult", seed: int = 0,
                      md_alpha: float = 0.3, method_options: Mapping[str, Any] | None = None
                      ) -> ml_collections.ConfigDict:
    """`config.embedding`'s method, options and per-table overrides for `method` at `target_ratio` (see
    `_embedding_section`); an `UnreachableRatio` holding the plan at maximum compression when the method cannot come
    within REACH_TOLERANCE of the target."""
    section = _embedding_section(method, spec, dim, target_ratio, threshold, qr_op, seed, md_alpha, method_options)
    if method == "full":
        return section
    planned = planned_accounting(spec, _with_section(dim, section), after_ramp=True)
    ratio = planned["full_bytes"] / planned["bytes"]
    if ratio < target_ratio * (1 - REACH_TOLERANCE):
        raise UnreachableRatio(method, target_ratio, ratio, section)
    return section


def _with_section(dim: int, section: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A config holding just the embedding section (what `planned_accounting` reads)."""
    config = ml_collections.ConfigDict()
    config.embedding = ml_collections.ConfigDict({"dim": dim, "method": section.method, "options": section.options,
                                                  "tables": section.tables, "pooling": "sum"})
    return config


def _embedding_section(method: str, spec: DatasetSpec, dim: int, target_ratio: float,
                      threshold: int = DEFAULT_THRESHOLD, qr_op: str = "mult", seed: int = 0,
                      md_alpha: float = 0.3, method_options: Mapping[str, Any] | None = None
                      ) -> ml_collections.ConfigDict:
    """`config.embedding`'s method, options and per-table overrides for `method` at `target_ratio`; an
    `UnreachableRatio` (holding the plan at maximum compression) when the method cannot come within REACH_TOLERANCE
    of the target.

    Args:
      method: "full", "hashing", "qr", "md" or "tt".
      spec: the dataset's features (names and vocab sizes).
      dim: config.embedding.dim (D).
      target_ratio: full embedding bytes / wanted embedding bytes (>= 1).
      threshold: tables with vocab_size <= threshold stay full.
      qr_op: the QR combine ("mult", "add" or "concat").
      seed: draws the universal hash (hashing).
      md_alpha: the mixed-dim temperature.
      method_options: more options of the method, the same for every table (e.g. fiited's compact_slack).
    """
    if target_ratio < 1:
        raise ValueError(f"target ratio must be >= 1 (full bytes / compressed bytes), got {target_ratio}")
    names = [f.name for f in spec.features]
    vocab = [f.vocab_size for f in spec.features]
    full_params = sum(vocab) * dim
    section = ml_collections.ConfigDict()
    section.method = method
    section.options = ml_collections.ConfigDict()
    section.tables = ml_collections.ConfigDict()
    if method == "full":
        return section
    section.options.threshold = threshold
    for key, value in (method_options or {}).items():
        section.options[key] = value
    budget = full_params / target_ratio
    compressed = [(name, n) for name, n in zip(names, vocab, strict=True) if n > threshold]
    fixed = sum(n for n in vocab if n <= threshold) * dim  # tables kept full

    if method == "md":
        # Ginart et al. 2019 per-table dims, solved by compression.plan over all tables for the budget; the least
        # it can spend is every compressed table at dim 1 (plus its 1 x D projection).
        section.options.alpha = md_alpha
        floor = fixed + sum(table_params(name, n, dim, "md", {"dim": 1}) for name, n in compressed)
        if budget <= floor:
            section.options.budget = floor
            return section

        def planned_params(md_budget: int) -> int:
            section.options.budget = md_budget
            return sum(table_params(t.name, t.vocab_size, t.dim, t.method, t.options)
                       for t in plan_tables(names, vocab, dim, section))

        # Rounded dims make the planned params a step function of the budget: take the step just under the
        # target or the one just above it, whichever is closer.
        under = int(budget)
        lo, hi = under, full_params  # planned_params(lo) <= budget < planned_params(hi), unless hi is the top
        if planned_params(hi) <= budget:
            section.options.budget = hi
            return section
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if planned_params(mid) <= budget else (lo, mid)
        section.options.budget = min((under, hi), key=lambda b: abs(math.log(planned_params(b) / budget)))
        return section
    if method in KEEP_METHODS:
        # Every compressed table keeps the same share of its values (FIITED's "prune 90 % of the embeddings"), so
        # that they, the full tables and the methods' own model bytes (FIITED's packed row offsets, 0.73 bytes per
        # row at K = 16: compression/chunk_pool.py) come to the target.
        options = {k: v for k, v in section.options.items() if k != "threshold"}
        aux = sum(build_method(TableSpec(name, n, dim, method, options)).aux_bytes()[0] / 4 for name, n in compressed)
        values = sum(n for _, n in compressed) * dim
        if values:
            section.options.keep = min(1.0, max(budget - fixed - aux, 1.0) / values)
        return section
    if method not in ("hashing", "qr", "tt"):
        raise ValueError(f"unknown sweep method '{method}'; choose from {METHODS}")
    if method == "qr":
        section.options.op = qr_op
    elif method == "hashing":
        section.options.seed = seed
    if not compressed:
        return section

    def knobs_at(table_ratio: float) -> list[dict[str, Any]]:
        return [_per_table_knobs(method, name, n, dim, table_ratio, qr_op) for name, n in compressed]

    def total_params(knobs: list[dict[str, Any]]) -> int:
        defaults = _method_options(section)
        return fixed + sum(table_params(name, n, dim, method, {**defaults, **k})
                           for (name, n), k in zip(compressed, knobs, strict=True))

    # One per-table ratio r' for every compressed table; total params fall (weakly) as r' grows.
    lo, hi = 1.0, float(max(n for _, n in compressed))  # hi: every table as small as the method allows
    if total_params(knobs_at(lo)) <= budget:
        best = knobs_at(lo)
    elif total_params(knobs_at(hi)) > budget:
        best = knobs_at(hi)
    else:
        for _ in range(60):  # bisection in log r': total(lo) > budget >= total(hi)
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if total_params(knobs_at(mid)) > budget else (lo, mid)
        best = min((knobs_at(lo), knobs_at(hi)), key=lambda k: abs(math.log(total_params(k) / budget)))
    for (name, _), k in zip(compressed, best, strict=True):
        section.tables[name] = ml_collections.ConfigDict({"options": k})
    return section


def _method_options(section: ml_collections.ConfigDict) -> dict[str, Any]:
    """The section's default options a method object takes (without the planner's threshold)."""
    return {k: v for k, v in section.options.to_dict().items() if k != "threshold"}


def planned_accounting(spec: DatasetSpec, config: ml_collections.ConfigDict, after_ramp: bool = False) -> dict:
    """`EmbeddingCollection.accounting()` of the tables `config.embedding` plans: what the run starts with, or
    (`after_ramp`) what it reports at the end, dynamic pools (FIITED, row_prune) shrunk to their final budget."""
    names = [f.name for f in spec.features]
    tables = plan_tables(names, [f.vocab_size for f in spec.features], config.embedding.dim, config.embedding)
    if after_ramp:  # a dynamic pool ends compacted to exactly its final budget (recjax/dynamic.py)
        tables = [dataclasses.replace(t, options={**t.options, "capacity": method.pool_chunks})
                  if hasattr(method := build_method(t), "pool_chunks") else t for t in tables]
    return EmbeddingCollection(spec, tables, config.embedding.pooling).accounting()


def planned_line(spec: DatasetSpec, config: ml_collections.ConfigDict, target_ratio: float) -> str:
    """What the sweep says before training a run: the target, the planned ratio and bytes, and for dynamic pools
    the ratio after the ramp and the memory they hold during it."""
    start = planned_accounting(spec, config)
    end = planned_accounting(spec, config, after_ramp=True)
    text = (f"target {target_ratio:g}x, planned {end['full_bytes'] / end['bytes']:.2f}x, {end['bytes']:,} embedding "
            "bytes")
    if start["bytes"] != end["bytes"]:
        text += (f" after the ramp; during it the pools start full: {start['full_bytes'] / start['bytes']:.2f}x, "
                 f"peak {start['bytes']:,} bytes (+ {start['optimizer_bytes']:,} bytes of optimizer state and "
                 "utility while training)")
    return text


# ---------------------------------------------------------------------------------------------- runs
def sweep_runs(methods: Sequence[str], ratios: Sequence[float], seeds: Sequence[int]) -> list[tuple[str, float, int]]:
    """(method, target_ratio, seed) of every run, seed-major; "full" runs once per seed, at ratio 1."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown sweep method(s) {unknown}; choose from {list(METHODS)}")
    bad = [r for r in ratios if not r >= 1]
    if bad:
        raise ValueError(f"target ratios must be >= 1 (full bytes / compressed bytes), got {bad}")
    runs = []
    for seed in seeds:
        for method in methods:
            for ratio in [1.0] if method == "full" else ratios:
                runs.append((method, float(ratio), int(seed)))
    return list(dict.fromkeys(runs))  # drop repeats, keep order


def run_name(method: str, target_ratio: float, seed: int) -> str:
    """The run's subdirectory: e.g. `qr_x4_seed0`."""
    return f"{method}_x{target_ratio:g}_seed{seed}"


def run_config(base: ml_collections.ConfigDict, spec: DatasetSpec, method: str, target_ratio: float, seed: int,
               threshold: int = DEFAULT_THRESHOLD, qr_op: str = "mult", md_alpha: float = 0.3,
               method_options: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
    """`base` with the run's seed and the embedding section of `method` at `target_ratio` (an UnreachableRatio when
    the method cannot reach it)."""
    config = ml_collections.ConfigDict(base.to_dict())
    config.seed = seed
    section = embedding_section(method, spec, int(config.embedding.dim), target_ratio, threshold, qr_op, seed,
                                md_alpha, method_options)
    config.embedding.method = section.method
    config.embedding.options = section.options
    config.embedding.tables = section.tables
    return config


def result_row(method: str, target_ratio: float, seed: int, summary: dict, run: str) -> dict[str, Any]:
    """One results.csv row from a run's summary (the ratio is the achieved `compression_ratio`); `run` is the
    subdirectory holding that summary."""
    return {"method": method, "target_ratio": target_ratio, "ratio": summary["compression_ratio"],
            "params": summary["params"], "embedding_params": summary["embedding_params"],
            "embedding_bytes": summary["embedding_bytes"], "auc": summary["auc"], "logloss": summary["logloss"],
            "ne": summary["ne"], "examples_per_sec": summary["examples_per_sec"], "seed": seed,
            "selected_step": summary["selected_step"], "budget_steps": summary["budget_steps"], "run": run}


def run_sweep(base: ml_collections.ConfigDict, workdir: str | pathlib.Path, methods: Sequence[str],
              ratios: Sequence[float], seeds: Sequence[int], threshold: int = DEFAULT_THRESHOLD,
              qr_op: str = "mult", title: str = "", log: Callable[[str], None] = print,
              md_alpha: float = 0.3, unreachable: list[UnreachableRatio] | None = None,
              method_options: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Train every (method, target ratio, seed) not trained yet; write results.csv, results_summary.csv and
    pareto.png to `workdir`; return the results rows. A target a method cannot reach is not run: one line says the
    largest ratio it reaches (and the error is appended to `unreachable` when given)."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec = dataset_spec(base)
    runs = sweep_runs(methods, ratios, seeds)
    rows = []
    said: dict[str, float] = {}  # method -> the smallest target the log has called out of its reach
    for i, (method, target_ratio, seed) in enumerate(runs, 1):
        run_dir = workdir / run_name(method, target_ratio, seed)
        prefix = f"[{i}/{len(runs)}] {run_dir.name}:"
        try:
            config = run_config(base, spec, method, target_ratio, seed, threshold, qr_op, md_alpha,
                                method_options if method != "full" else None)
        except UnreachableRatio as error:
            if target_ratio < said.get(method, math.inf):  # one line covers every larger target of the method
                beyond = sorted({r for m, r, _ in runs if m == method and r >= target_ratio})
                log(f"{prefix} skipped: {error}; not running {method} at {', '.join(f'{r:g}x' for r in beyond)}")
                said[method] = target_ratio
                if unreachable is not None:
                    unreachable.append(error)
            continue
        if not (run_dir / "summary.json").exists():
            log(f"{prefix} training ({planned_line(spec, config, target_ratio)})")
        summary = train_or_resume(config, run_dir, prefix, log, _describe)
        rows.append(result_row(method, target_ratio, seed, summary, run_dir.name))
        write_csv(workdir / "results.csv", rows, RESULT_FIELDS)  # after every run: a long sweep is readable early
    length = f"{int(base.train.steps)} steps" if base.train.steps is not None else f"{base.train.epochs:g} epochs"
    if not rows:
        log("no run was trained (every target out of reach)")
        return rows
    write_outputs(rows, workdir, title or f"{base.data.name}, {length}, seeds {list(seeds)}")
    pinned = list(dict.fromkeys(pinned_runs(rows)))
    if pinned:
        log(f"WARNING: {len(pinned)} of {len(dict.fromkeys(r['run'] for r in rows))} runs were selected at the last "
            f"step of their budget, still improving when it ended ({', '.join(pinned)}): their figures understate "
            "what the method reaches; give a longer budget (--epochs or --steps)")
    return rows


def _describe(summary: dict) -> str:
    return (f"ratio {summary['compression_ratio']:.2f}, auc {summary['auc']:.4f}, logloss {summary['logloss']:.4f}, "
            f"selected step {summary['selected_step']:,} of {summary['budget_steps']:,}")


def pinned_runs(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Runs whose selected step is their budget's last: still improving when the budget ended."""
    return [row["run"] for row in rows if int(row["selected_step"]) == int(row["budget_steps"])]


# ------------------------------------------------------------------------------------------ outputs
def read_results(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """results.csv rows with numbers parsed (target_ratio, ratio, metrics: float; counts and seed: int)."""
    ints = {"params", "embedding_params", "embedding_bytes", "seed", "selected_step", "budget_steps"}
    with pathlib.Path(path).open(newline="") as f:
        return [{k: (int(v) if k in ints else v if k in ("method", "run") else float(v)) for k, v in row.items()}
                for row in csv.DictReader(f)]


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and std over seeds of auc, logloss and ne per (method, target_ratio), in first-seen order."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["method"], float(row["target_ratio"])), []).append(row)
    out = []
    for (method, target_ratio), members in groups.items():
        entry = {"method": method, "target_ratio": target_ratio, "runs": len(members),
                 "ratio": statistics.fmean(float(r["ratio"]) for r in members),
                 "embedding_bytes": statistics.fmean(float(r["embedding_bytes"]) for r in members)}
        for metric in SUMMARY_METRICS:
            values = [float(r[metric]) for r in members]
            entry[f"{metric}_mean"] = statistics.fmean(values)
            entry[f"{metric}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        entry["examples_per_sec_mean"] = statistics.fmean(float(r["examples_per_sec"]) for r in members)
        out.append(entry)
    return out


SUMMARY_FIELDS = ("method", "target_ratio", "runs", "ratio", "embedding_bytes",
                  *(f"{m}_{s}" for m in SUMMARY_METRICS for s in ("mean", "std")), "examples_per_sec_mean")


def plot_pareto(summary: Sequence[dict[str, Any]], path: str | pathlib.Path, title: str = "") -> None:
    """AUC vs embedding bytes (log x), one line per method with std-over-seeds error bars; full is a point and a
    dashed reference line. Drawn on matplotlib's Agg canvas (no display, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    methods = list(dict.fromkeys(s["method"] for s in summary))
    for method in methods:
        points = sorted((s for s in summary if s["method"] == method), key=lambda s: s["embedding_bytes"])
        x = [s["embedding_bytes"] for s in points]
        y = [s["auc_mean"] for s in points]
        yerr = [s["auc_std"] for s in points]
        if method == "full":  # the baseline: a star on top of the other methods' ~1x points, and a reference line
            ax.errorbar(x, y, yerr=yerr, marker="*", markersize=12, color="black", linestyle="none", capsize=3,
                        label=method, zorder=5)
            ax.axhline(y[-1], color="black", linestyle="--", linewidth=0.8)
            continue
        ax.errorbar(x, y, yerr=yerr, marker="o", capsize=3, label=method, color=METHOD_COLORS.get(method),
                    linestyle="-" if len(points) > 1 else "none")
        for s in points:
            if s["ratio"] >= 1.05:  # the ~1x points sit on top of each other next to full's star
                ax.annotate(f"{s['ratio']:.1f}x", (s["embedding_bytes"], s["auc_mean"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("embedding bytes (log scale)")
    ax.set_ylabel("test AUC (mean over seeds, +- std)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)


def write_outputs(rows: Sequence[dict[str, Any]], workdir: str | pathlib.Path, title: str = "") -> None:
    """results.csv, results_summary.csv and pareto.png in `workdir`."""
    workdir = pathlib.Path(workdir)
    write_csv(workdir / "results.csv", rows, RESULT_FIELDS)
    summary = summarize(rows)
    write_csv(workdir / "results_summary.csv", summary, SUMMARY_FIELDS)
    plot_pareto(summary, workdir / "pareto.png", title)


# ------------------------------------------------------------------------------------------------ main
def define_flags() -> None:
    """The command-line flags; defined only when run as a script, so importing this module (tests, notebooks,
    next to experiments/train.py's --workdir) never clashes with other absl flags."""
    flags.DEFINE_enum("dataset", "synthetic", list(DATASETS), "Dataset config to sweep on.")
    flags.DEFINE_string("data_dir", "", "Raw data folder (config.data.dir) for movielens / criteo_kaggle.")
    flags.DEFINE_string("prepared_dir", "", "config.data.prepared_dir; '' = the config's default.")
    flags.DEFINE_string("workdir", None, "Sweep output directory; a fresh temp directory if unset.")
    flags.DEFINE_list("methods", list(METHODS), f"Methods, from {list(METHODS)}.")
    flags.DEFINE_list("ratios", ["1", "2", "4", "8", "16", "64"], "Target compression ratios (>= 1).")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "Run seeds (config.seed).")
    flags.DEFINE_integer("steps", None, "Override train.steps of every run.")
    flags.DEFINE_float("epochs", None, "Override train.epochs of every run (movielens, criteo_kaggle); default: "
                       f"the sweep's budget {SWEEP_EPOCHS} or the dataset config's.")
    flags.DEFINE_integer("threshold", DEFAULT_THRESHOLD, "Tables with vocab_size <= this stay full.")
    flags.DEFINE_enum("qr_op", "mult", ["mult", "add", "concat"], "QR combine op.")
    flags.DEFINE_bool("compilation_cache", True, "Keep XLA executables in <workdir>/.jax_cache: runs that differ "
                      "only in their seed (and resumed sweeps) skip most of the compile time.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {argv[1:]}")
    args = flags.FLAGS
    try:  # flag mistakes are usage errors, not tracebacks
        methods = [m.strip() for m in args.methods]
        ratios = [float(r) for r in args.ratios]
        seeds = [int(s) for s in args.seeds]
        sweep_runs(methods, ratios, seeds)
        base = base_config(args.dataset, args.data_dir, args.steps, args.prepared_dir, args.epochs)
    except ValueError as e:
        cli.fail(str(e))
    workdir = open_workdir(args.workdir, "recjax_sweep_", args.compilation_cache)
    t0 = time.perf_counter()
    with keep_or_remove_on_failure(workdir, chosen=bool(args.workdir)):
        rows = run_sweep(base, workdir, methods, ratios, seeds, args.threshold, args.qr_op,
                         log=lambda line: print(line, flush=True))
    print(f"{len(rows)} runs in {time.perf_counter() - t0:.0f} s")
    with (workdir / "results_summary.csv").open() as f:
        print(f.read(), end="")
    print(f"results: {workdir / 'results.csv'}\nplot: {workdir / 'pareto.png'}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
