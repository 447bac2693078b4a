"""Mixed-dimension embeddings: the reference's power rule, the budget mode, projections and frequency blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import embed

from compression import TableSpec, build_method
from compression.mixed_dim import md_budget_dims, md_dims, pow2_round
from compression.plan import plan_tables
from recjax.data.synthetic import SyntheticDataset
from recjax.embedding import EmbeddingCollection
from recjax.specs import DatasetSpec, FeatureSpec

REFERENCE_ROWS = [100_000, 5_000, 300, 50]


def test_power_rule_matches_the_reference_example():
    """facebookresearch/dlrm md_solver(n=[100000, 5000, 300, 50], alpha=0.3, d0=16) -> [2, 4, 9, 16]."""
    assert md_dims(REFERENCE_ROWS, 0.3, 16) == [2, 4, 9, 16]
    assert md_dims(REFERENCE_ROWS[::-1], 0.3, 16) == [16, 9, 4, 2]  # input order is kept
    assert md_dims(REFERENCE_ROWS, 0.3, 16, round_pow2=True) == [2, 4, 8, 16]
    assert md_dims(REFERENCE_ROWS, 0.0, 16) == [16] * 4  # alpha 0: uniform dims
    assert md_dims([50, 5000], 0.3, 16, queries=[1, 100]) == [16, 16]  # popularity is k / n


def test_power_rule_against_a_plain_python_transcription():
    """d_i = round(max(1, d0 * (n_min / n_i)^alpha)), the most popular table exactly d0 (Ginart et al. eq. 5)."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        rows = [int(r) for r in rng.integers(1, 10**7, rng.integers(1, 8))]
        alpha, d0 = float(rng.uniform(0, 1)), int(rng.integers(1, 129))
        expected = [d0 if n == min(rows) else int(np.round(max(1.0, d0 * (min(rows) / n) ** alpha))) for n in rows]
        assert md_dims(rows, alpha, d0) == [min(d, d0) for d in expected]


def md_solver_transcription(rows, alpha, d0, round_dim):
    """facebookresearch/dlrm tricks/md_embedding_bag.py md_solver(n, alpha, d0=d0, round_dim=round_dim), as described:
    sort n ascending; lambda = d0 * n_0^alpha; d = lambda * n^-alpha, the first (sorted) entry set to d0, the others
    floored at 1; torch.round (half to even); with round_dim, 2^round(log2 d) for every entry, d0's too; unsort."""
    order = sorted(range(len(rows)), key=lambda i: rows[i])  # torch.sort; ties do not matter for the values
    n = [float(rows[i]) for i in order]
    lam = d0 * n[0] ** alpha
    d = [float(d0) if j == 0 else max(1.0, lam * x ** -alpha) for j, x in enumerate(n)]
    d = [float(np.round(v)) for v in d]
    if round_dim:
        d = [float(2 ** np.round(np.log2(v))) for v in d]
    out = [0] * len(rows)
    for j, i in enumerate(order):
        out[i] = int(d[j])
    return out


def test_round_pow2_matches_md_solver_except_that_d0_and_the_cap_stay_at_the_base_dim():
    """md_solver rounds d0 too (12 -> 16, 72 -> 64); md_dims keeps the base dim (the model's width) for the most
    popular table and never exceeds it. Otherwise -- a power-of-two base dim, or no rounding -- they agree."""
    assert md_solver_transcription([1000, 50], 0.3, 12, True) == [4, 16]
    assert md_dims([1000, 50], 0.3, 12, round_pow2=True) == [4, 12]
    assert md_solver_transcription([50], 0.3, 72, True) == [64] and md_dims([50], 0.3, 72, round_pow2=True) == [72]
    rng = np.random.default_rng(1)
    differ = cases = 0
    for _ in range(300):
        rows = [int(r) for r in rng.integers(1, 10**6, rng.integers(1, 8))]
        alpha, d0, round_pow2 = float(rng.uniform(0, 1)), int(rng.integers(1, 129)), bool(rng.integers(0, 2))
        ref = md_solver_transcription(rows, alpha, d0, round_pow2)
        ours = md_dims(rows, alpha, d0, round_pow2=round_pow2)
        top = min(rows)
        assert ours == [d0 if n == top else min(r, d0) for n, r in zip(rows, ref, strict=True)], (rows, alpha, d0)
        if not round_pow2 or d0 & (d0 - 1) == 0:
            assert ours == ref, (rows, alpha, d0, round_pow2)
        cases += 1
        differ += ours != ref
    assert 0 < differ < cases  # only rounded, non-power-of-two base dims differ


def test_pow2_rounding_is_in_log_space():
    dims = np.array([1, 2, 3, 5, 6, 9, 11, 12, 22, 23])  # 2^4.5 = 22.6 splits 16 from 32
    np.testing.assert_array_equal(pow2_round(dims), [1, 2, 4, 4, 8, 8, 8, 16, 16, 32])


def md_params(rows, dims, base):
    return sum(n * d + (d * base if d < base else 0) for n, d in zip(rows, dims, strict=True))


@pytest.mark.parametrize("budget", [120_000, 250_000, 700_000, 1_000_000, 2_000_000])
@pytest.mark.parametrize("round_pow2", [False, True])
def test_budget_mode_respects_the_budget(budget, round_pow2):
    dims = md_budget_dims(REFERENCE_ROWS, 0.3, 16, budget, round_pow2=round_pow2)
    assert md_params(REFERENCE_ROWS, dims, 16) <= budget
    assert all(1 <= d <= 16 for d in dims) and dims == sorted(dims)  # larger (rarer-row) tables never wider
    if round_pow2:
        assert all(d & (d - 1) == 0 for d in dims)
    assert md_params(REFERENCE_ROWS, dims, 16) > budget / 4  # uses the budget rather than collapsing to dim 1
    full = md_params(REFERENCE_ROWS, [16] * 4, 16)
    if budget >= full:
        assert dims == [16] * 4


def test_budget_mode_through_the_plan_and_accounting():
    names = ["a", "b", "c", "d"]
    budget = 250_000
    specs = plan_tables(names, REFERENCE_ROWS, 16, {"method": "md", "options": {"budget": budget, "threshold": 60}})
    assert specs[3].method == "full"
    spec = DatasetSpec(0, tuple(FeatureSpec(n, v) for n, v in zip(names, REFERENCE_ROWS, strict=True)))
    accounting = EmbeddingCollection(spec, specs).accounting()
    assert accounting["params"] <= budget
    with pytest.raises(ValueError, match="below the minimum"):
        plan_tables(names, REFERENCE_ROWS, 16, {"method": "md", "options": {"budget": 100_000}})


def test_md_projection_glue_is_counted_exactly():
    spec = DatasetSpec(0, (FeatureSpec("a", 1000, bag_size=3), FeatureSpec("b", 20)))
    tables = [TableSpec("a", 1000, 8, "md", {"dim": 3}), TableSpec("b", 20, 8, "md", {"dim": 8})]
    collection = EmbeddingCollection(spec, tables)
    assert collection.methods["a"].glue_params() == 3 * 8 and collection.methods["b"].glue_params() == 0
    acc = collection.accounting()
    assert acc["tables"]["a"]["params"] == 1000 * 3 + 3 * 8 and acc["tables"]["a"]["bytes"] == 4 * (3000 + 24)
    assert acc["tables"]["b"]["params"] == 20 * 8 and collection.group_rows == {"dim3": 1000, "dim8": 20}
    emb, variables, routes_tables = run_glue(collection, {"a": np.array([[1, 2, 999]] * 2, np.int32),
                                                          "b": np.array([[3], [4]], np.int32)},
                                             {"a": np.array([3, 1], np.int32), "b": np.ones(2, np.int32)})
    leaves = jax.tree_util.tree_leaves_with_path(variables["params"])
    assert sum(x.size for _, x in leaves) == 24 and len(leaves) == 1  # one projection, none for dim == D
    kernel = np.asarray(leaves[0][1])
    table = routes_tables["dim3"]
    np.testing.assert_allclose(emb[0, 0], (table[1] + table[2] + table[999]) @ kernel, rtol=1e-5, atol=1e-7)


def run_glue(collection, ids, lengths):
    tables = collection.init_tables(jax.random.key(0))
    emb, variables = embed(collection, tables, ids, lengths)
    return emb, variables, {g: np.asarray(t) for g, t in tables.items()}


def blocks_method(counts, dim=16, **options):
    return build_method(TableSpec("x", len(counts), dim, "md_blocks", {"counts": counts, **options}))


def test_frequency_blocks_dims_and_routes():
    """1000 ids with counts 1000 / (rank + 1) scattered by a permutation; blocks of the top 10, next 90, rest."""
    n = 1000
    perm = np.random.default_rng(0).permutation(n)
    counts = np.zeros(n)
    counts[perm] = 1000.0 / (np.arange(n) + 1)
    m = blocks_method(counts)
    # By hand: mean count per block p = 1000 (H_10 / 10, (H_100 - H_10) / 90, (H_1000 - H_100) / 900)
    # = (292.90, 25.09, 2.553); d = 16 (p / p_0)^0.3 = (16, 7.66, 3.86) -> (16, 8, 4).
    assert [(t.rows, t.dim) for t in m.physical_tables()] == [(10, 16), (90, 8), (900, 4)]
    p = np.array([counts[perm[:10]].mean(), counts[perm[10:100]].mean(), counts[perm[100:]].mean()])
    assert m.block_dims == tuple(int(np.round(max(1, 16 * (x / p[0]) ** 0.3))) for x in p)
    rows = np.stack([np.asarray(r) for r in m.route(jnp.arange(n, dtype=jnp.int32))], axis=1)  # [n, 3]
    assert np.all((rows >= 0).sum(1) == 1)  # every id lives in exactly one block, -1 in the others
    block = np.argmax(rows >= 0, axis=1)
    assert set(block[perm[:10]]) == {0} and set(block[perm[10:100]]) == {1} and set(block[perm[100:]]) == {2}
    for b, size in enumerate((10, 90, 900)):
        assert sorted(rows[block == b, b]) == list(range(size))  # a bijection onto the block's rows
    assert m.glue_params() == 8 * 16 + 4 * 16 and m.index_bytes() == 4 * n
    pow2 = blocks_method(counts, round_pow2=True, blocks=(0.1, 1.0))
    # p = (51.87, 2.553) -> d = 16 * 0.4052 = 6.48 -> 6 -> 2^round(log2 6) = 8.
    assert [(t.rows, t.dim) for t in pow2.physical_tables()] == [(100, 16), (900, 8)]
    assert blocks_method(np.sort(counts)[::-1].copy()).index_bytes() == 0  # frequency-ranked ids: no index


def test_frequency_blocks_combine_through_the_engine():
    n = 200
    counts = np.random.default_rng(1).zipf(1.5, n).astype(np.float64)
    spec = DatasetSpec(0, (FeatureSpec("x", n, bag_size=4),))
    collection = EmbeddingCollection(spec, [TableSpec("x", n, 8, "md_blocks", {"counts": counts})], "mean")
    method = collection.methods["x"]
    ids = np.random.default_rng(2).integers(0, n, (16, 4)).astype(np.int32)
    lengths = np.random.default_rng(3).integers(1, 5, 16).astype(np.int32)
    emb, variables, tables = run_glue(collection, {"x": ids}, {"x": lengths})
    params = variables["params"]["combine_x"]
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == method.glue_params() > 0
    # numpy oracle: emb(x) = P_b(x) W_b(x)[local row], mean over the bag.
    rank = np.empty(n, int)
    rank[np.argsort(-counts, kind="stable")] = np.arange(n)
    expected = np.zeros((16, 8), np.float32)
    for b in range(16):
        for x in ids[b, : lengths[b]]:
            k = int(np.searchsorted(method.ends, rank[x], side="right"))
            p = collection.placements["x"][k]
            row = tables[p.group][p.offset + rank[x] - method.starts[k]]
            proj = np.asarray(params[f"proj{k}"]["kernel"]) if method.block_dims[k] < 8 else np.eye(8)
            expected[b] += row @ proj / lengths[b]
    np.testing.assert_allclose(emb[:, 0], expected, rtol=1e-5, atol=1e-7)


def test_synthetic_expected_counts_match_sampled_counts():
    data = SyntheticDataset(vocab_sizes=(50, 400), bag_sizes=(1, 4), zipf_exponent=1.3, eval_examples=512)
    steps, batch = 10, 1024
    expected = data.id_counts(steps * batch)
    seen = {k: np.zeros_like(v) for k, v in expected.items()}
    for _, b in zip(range(steps), data.train_batches(batch), strict=False):
        for f in data.spec.features:
            valid = np.arange(f.bag_size)[None, :] < b.lengths[f.name][:, None]
            np.add.at(seen[f.name], b.ids[f.name][valid], 1)
    for name, exp in expected.items():
        assert abs(exp.sum() - seen[name].sum()) < 4 * np.sqrt(exp.sum())
        chi2 = np.sum((seen[name] - exp) ** 2 / np.maximum(exp, 1e-9))
        dof = len(exp) - 1
        assert chi2 < dof + 5 * np.sqrt(2 * dof), (name, chi2, dof)


@pytest.mark.parametrize("options, message", [
    ({}, "md needs options.dim in"),
    ({"dim": 0}, "md needs options.dim in"),
    ({"dim": 17}, "md needs options.dim in"),
    ({"dim": 4, "alpha": 0.3}, r"has no option\(s\) \['alpha'\]"),
])
def test_md_bad_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        build_method(TableSpec("x", 100, 16, "md", options))


def test_md_blocks_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="md_blocks needs per-id counts"):
        build_method(TableSpec("x", 100, 16, "md_blocks", {}))
    with pytest.raises(ValueError, match=r"of shape \(100,\)"):
        build_method(TableSpec("x", 100, 16, "md_blocks", {"counts": np.ones(99)}))
    with pytest.raises(ValueError, match="increasing fractions"):
        blocks_method(np.ones(100), blocks=(0.5, 0.2, 1.0))
    with pytest.raises(ValueError, match="all zero"):
        blocks_method(np.zeros(100))
