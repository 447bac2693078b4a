"""A Meta-shaped embedding table set (856 tables) and sharding tasks sampled from it.

Meta's public DLRM embedding-lookup dataset (github.com/facebookresearch/dlrm_datasets, `fbgemm_t856_bs65536.pt`)
is the benchmark of AutoShard, DreamShard and NeuroShard (Zha et al. 2022, 2022, 2023). It is not downloaded here;
the generator follows the summary numbers published with it and with NeuroShard's processing of it:

  published (dlrm_datasets README + embedding_bag/locality_stats.txt, one batch of 65,536 examples):
    856 tables; 887,017,990 indices per batch, i.e. a mean pooling factor of 15.81 per table and example;
    128,435,723 distinct (table, row) pairs per batch (14.5 % of the indices; a mean reuse of 6.9);
    the share of indices by how often their row recurs in the batch, PUBLISHED_REUSE below
  NeuroShard (github.com/daochenzha/neuroshard, tools/gen_dlrm_data.py, tools/gen_tasks.py): a table's rows are its
    largest index + 1, at least 100; its pooling factor the mean bag length; the data has no dims, each task draws
    them from {4, 8, 16, 32, 64, 128}; sharding tasks sample tables at random
  not published as numbers (our assumptions, calibrated to the published aggregates above):
    rows log-uniform on [ROWS_LOW, ROWS_MAX] (ROWS_LOW >= NeuroShard's floor of 100); pooling factors log-normal
    (sigma POOLING_SIGMA), scaled to the published mean; ids Zipf-distributed with an exponent uniform on
    [ALPHA_LOW, ALPHA_HIGH]; dims uniform on the six sizes. ROWS_LOW, ROWS_MAX, ALPHA_LOW and ALPHA_HIGH minimise
    the distance of the generated set's expected distinct share and reuse histogram (Poisson, for a batch of
    65,536) to the published ones over a grid: `python -m experiments.planning.meta_tables --calibrate` reproduces the
    fit, and benchmarks/RESULTS.md shows both histograms side by side.
"""

import argparse
import dataclasses
import json
import math

import numpy as np
from scipy import stats

from recjax.sharding.cost_model import AccessProfile, PlannerTable, Problem, Topology, zipf_cumulative
from recjax.sharding.plan import TableInfo

TABLES = 856
BATCH = 65_536
PUBLISHED_INDICES = 887_017_990
PUBLISHED_DISTINCT = 128_435_723
MEAN_POOLING = PUBLISHED_INDICES / (BATCH * TABLES)  # 15.81
# Share of the batch's indices whose row occurs (0,1], (1,2], (2,4], ... (16384, 32768], more times in the batch.
REUSE_BINS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
PUBLISHED_REUSE = (0.069, 0.044, 0.068, 0.101, 0.121, 0.104, 0.073, 0.058, 0.052, 0.050, 0.049, 0.048, 0.048, 0.043,
                   0.031, 0.023, 0.019)
DIMS = (4, 8, 16, 32, 64, 128)
POOLING_SIGMA = 1.0
# Fitted by `--calibrate` (seed 0; score 0.375 = L1 distance of the reuse histograms 0.24 + the distinct share's
# relative error 0.136: 12.5 % against the published 14.5 %); see the module docstring.
ROWS_LOW, ROWS_MAX = 10_000, 1_000_000
ALPHA_LOW, ALPHA_HIGH = 0.3, 1.1


@dataclasses.dataclass(frozen=True)
class MetaTable:
    name: str
    rows: int
    dim: int
    pooling: float
    alpha: float

    def planner_table(self, state_floats: int = 0) -> PlannerTable:
        """Bags of the mean length (recjax's fixed-shape batches need a bag size; the mean keeps the exchange's
        buckets at the published volume); SGD (no optimizer state) as in NeuroShard's benchmark, unless told."""
        info = TableInfo(self.name, self.name, "full", self.rows, self.dim, max(1, round(self.pooling)), state_floats)
        return PlannerTable(info, self.pooling, AccessProfile.zipf(self.alpha, self.rows))


def meta_tables(seed: int = 0, rows: tuple[float, float] = (ROWS_LOW, ROWS_MAX),
                alpha: tuple[float, float] = (ALPHA_LOW, ALPHA_HIGH)) -> list[MetaTable]:
    """The 856 tables (deterministic given the seed)."""
    rng = np.random.default_rng(seed)
    rows = np.exp(rng.uniform(math.log(rows[0]), math.log(rows[1]), TABLES)).astype(np.int64)
    pooling = rng.lognormal(0.0, POOLING_SIGMA, TABLES)
    pooling *= MEAN_POOLING / pooling.mean()
    alphas = rng.uniform(*alpha, TABLES)
    dims = rng.choice(DIMS, TABLES)
    return [MetaTable(f"t{i:03d}", int(r), int(d), float(p), float(a))
            for i, (r, d, p, a) in enumerate(zip(rows, dims, pooling, alphas, strict=True))]


def expected_reuse(tables: list[MetaTable], batch: int = BATCH, points: int = 400) -> tuple[float, np.ndarray]:
    """(distinct rows / indices, share of indices per reuse bin) expected for one batch: each row's count is
    Poisson(batch x pooling x its Zipf probability); rows are grouped on a fine log grid of ranks."""
    hist = np.zeros(len(REUSE_BINS) + 1)
    distinct = indices = 0.0
    upper = np.array(REUSE_BINS, float)
    for t in tables:
        edges = np.unique(np.concatenate([[0.0], np.geomspace(1.0, t.rows, points)]))
        mass = np.diff(zipf_cumulative(edges, t.alpha)) / zipf_cumulative(np.array([t.rows]), t.alpha)[0]
        rows = np.diff(edges)
        q = batch * t.pooling
        lam = q * mass / rows  # lookups per row in each group
        distinct += float((rows * -np.expm1(-lam)).sum())
        indices += q
        # E[c 1{lo < c <= hi}] = lam P(lo - 1 < c' <= hi - 1), c' ~ Poisson(lam): the share of indices per bin.
        below = np.concatenate([[0.0], upper])
        cdf_hi = stats.poisson.cdf(np.concatenate([upper, [np.inf]])[:, None] - 1, lam[None, :])
        cdf_lo = stats.poisson.cdf(below[:, None] - 1, lam[None, :])
        hist += ((cdf_hi - cdf_lo) * (rows * lam)[None, :]).sum(axis=1)
    return distinct / indices, hist / hist.sum()


def calibrate(seed: int = 0, points: int = 60) -> dict:
    """Grid search over the rows' range and the Zipf exponents' range for the closest expected statistics (L1
    distance of the reuse histograms + the distinct share's relative error)."""
    target_share = PUBLISHED_DISTINCT / PUBLISHED_INDICES
    best = None
    for low in (1e2, 1e3, 1e4, 1e5):
        for high in (1e6, 1e7, 1e8):
            for a_low in (0.0, 0.3, 0.6, 0.9):
                for width in (0.2, 0.5, 0.8):
                    tables = meta_tables(seed, (low, high), (a_low, a_low + width))
                    share, hist = expected_reuse(tables, points=points)
                    score = float(np.abs(hist - PUBLISHED_REUSE).sum() + abs(share / target_share - 1))
                    if best is None or score < best["score"]:
                        best = {"score": score, "rows": (low, high), "alpha": (a_low, a_low + width)}
    share, hist = expected_reuse(meta_tables(seed, best["rows"], best["alpha"]))
    return {**best, "distinct_share": share, "published_distinct_share": target_share,
            "reuse": hist.round(4).tolist(), "published_reuse": list(PUBLISHED_REUSE)}


def summary(tables: list[MetaTable]) -> dict:
    rows = np.array([t.rows for t in tables])
    pooling = np.array([t.pooling for t in tables])
    share, hist = expected_reuse(tables)
    return {"tables": len(tables), "rows_median": float(np.median(rows)), "rows_max": int(rows.max()),
            "rows_total": int(rows.sum()), "pooling_mean": float(pooling.mean()),
            "pooling_p90": float(np.quantile(pooling, 0.9)),
            "bytes_total_sgd": int(sum(t.rows * t.dim * 4 for t in tables)),
            "dims": {d: sum(t.dim == d for t in tables) for d in DIMS}, "distinct_share": share,
            "published_distinct_share": PUBLISHED_DISTINCT / PUBLISHED_INDICES, "reuse": hist.round(4).tolist(),
            "published_reuse": list(PUBLISHED_REUSE)}


def sample_task(tables: list[MetaTable], count: int, devices: int, seed: int, fill: float = 0.75,
                topology=Topology.gpu_cluster, batch: int = BATCH) -> Problem:
    """`count` tables drawn without replacement; every device gets memory for its share of the task's bytes at
    `fill` (the same headroom for every planner; a single table may still be larger than a device)."""
    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(len(tables), size=count, replace=False).tolist())
    planner_tables = tuple(tables[i].planner_table() for i in chosen)
    total = sum(t.info.bytes for t in planner_tables)
    memory = int(math.ceil(total / (fill * devices)))
    return Problem(planner_tables, topology(devices, memory), batch)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", action="store_true", help="refit ROWS_MAX and the Zipf exponents' range")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(calibrate(args.seed) if args.calibrate else summary(meta_tables(args.seed))))


if __name__ == "__main__":
    main()
