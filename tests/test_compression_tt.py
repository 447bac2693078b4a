"""TT-Rec (compression/tt.py) against numpy contractions, np.unravel_index and a dense jax.grad oracle."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import embed
from test_compression_training import AUC_FLOOR, compressed_config

from compression import TableSpec, build_method
from compression.tt import dim_factors, vocab_factors
from recjax.embedding import EmbeddingCollection, EmbeddingGlue
from recjax.sparse_optim import SGD
from recjax.specs import DatasetSpec, FeatureSpec
from recjax.train import train_and_evaluate


def method(vocab_size, dim=8, **options):
    return build_method(TableSpec("x", vocab_size, dim, "tt", options))


def routed(m, ids) -> np.ndarray:
    """[N, k] routed core rows, one column per core."""
    return np.stack([np.asarray(r) for r in m.route(jnp.asarray(np.asarray(ids, np.int32)))], axis=1)


def numpy_cores(collection, tables, feature="x") -> list[np.ndarray]:
    """Each core as f32[r_{j-1}, n_j, d_j, r_j] (Yin et al.'s layout), read back from the stacked tables."""
    m = collection.methods[feature]
    cores = []
    for p, (r0, n, d, r1) in zip(collection.placements[feature], m.core_shapes(), strict=True):
        block = np.asarray(tables[p.group])[p.offset: p.offset + p.table.rows]  # [n_j, r0 * d * r1]
        cores.append(block.reshape(n, r0, d, r1).transpose(1, 0, 2, 3))
    return cores


def numpy_tt_row(cores: list[np.ndarray], x: int) -> np.ndarray:
    """Row x of the TT-matrix by its definition (Yin et al. eq. 3): for every column tuple (j_1..j_k), the product of
    the r x r slices G_1[i_1, j_1] ... G_k[i_k, j_k], with (i_1..i_k) = np.unravel_index(x, (n_1..n_k))."""
    digits = np.unravel_index(x, tuple(c.shape[1] for c in cores))
    dims = tuple(c.shape[2] for c in cores)
    row = np.zeros(math.prod(dims), np.float64)
    for col, js in enumerate(itertools.product(*(range(d) for d in dims))):  # row-major column order
        chain = np.eye(1)
        for core, i, j in zip(cores, digits, js, strict=True):
            chain = chain @ core[:, i, j, :].astype(np.float64)
        row[col] = chain[0, 0]
    return row


# ------------------------------------------------------------------------------------- factorisation
@pytest.mark.parametrize("n, options", [
    (1000, {}),  # 10 x 10 x 10 exactly
    (1001, {}),  # (11, 9, 11): 1089 row tuples
    (997, {"cores": 2}),
    (5000, {"cores": 4}),
    (600, {"vocab_factors": (5, 12, 10)}),
])
def test_routing_is_an_exact_factorisation(n, options):
    """Exhaustively: every id's digits are in range and equal np.unravel_index (row-major), so distinct ids get
    distinct index tuples."""
    m = method(n, **options)
    rows = routed(m, np.arange(n))
    sizes = np.array([t.rows for t in m.physical_tables()])
    assert np.all(rows >= 0) and np.all(rows < sizes[None, :])
    assert len({tuple(r) for r in rows}) == n
    np.testing.assert_array_equal(rows, np.stack(np.unravel_index(np.arange(n), m.vocab_factors), axis=1))


def test_routing_is_exact_up_to_int32_max():
    n = 2**31 - 1
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(0, n, 20_000), [0, 1, 2**24 + 1, n - 2, n - 1]])
    for cores in (3, 4):
        m = method(n, dim=16, cores=cores)
        assert math.prod(m.vocab_factors) >= n
        expected = np.stack(np.unravel_index(ids.astype(np.int64), m.vocab_factors), axis=1)
        np.testing.assert_array_equal(routed(m, ids), expected)


def test_factor_choice_and_core_shapes():
    assert vocab_factors(10_000_000, 3) == (216, 215, 216)  # 10,031,040 >= 10M; 214 would fall short
    assert vocab_factors(1001, 3) == (11, 9, 11) and vocab_factors(1000, 3) == (10, 10, 10)
    assert vocab_factors(1, 3) == (1, 1, 1)
    assert dim_factors(16, 3) == (4, 2, 2) and dim_factors(64, 3) == (4, 4, 4) and dim_factors(12, 3) == (3, 2, 2)
    assert dim_factors(13, 3) == (13, 1, 1) and dim_factors(64, 4) == (4, 2, 2, 4)
    for n, k in itertools.product([2, 7, 99, 1000, 65_537, 10**7], [2, 3, 4]):
        f = vocab_factors(n, k)
        assert math.prod(f) >= n and all(math.prod(f) // x * (x - 1) < n for x in f if x > 1)  # none can shrink
    m = method(10_000_000, dim=16, rank=16)
    assert m.core_shapes() == ((1, 216, 4, 16), (16, 215, 2, 16), (16, 216, 2, 1))
    assert [(t.name, t.rows, t.dim) for t in m.physical_tables()] == [
        ("x/core0", 216, 64), ("x/core1", 215, 512), ("x/core2", 216, 32)]
    m = method(1000, dim=12, ranks=(3, 5), dim_factors=(2, 3, 2))
    assert m.core_shapes() == ((1, 10, 2, 3), (3, 10, 3, 5), (5, 10, 2, 1))


def test_core_bytes_are_accounted():
    spec = DatasetSpec(0, (FeatureSpec("x", 10_000_000), FeatureSpec("y", 50)))
    collection = EmbeddingCollection(spec, [TableSpec("x", 10_000_000, 16, "tt", {"rank": 16}),
                                            TableSpec("y", 50, 16)])
    acc = collection.accounting()
    params = 216 * 1 * 4 * 16 + 215 * 16 * 2 * 16 + 216 * 16 * 2 * 1  # by hand: 13,824 + 110,080 + 6,912
    assert acc["tables"]["x"]["params"] == params == 130_816
    assert acc["tables"]["x"]["bytes"] == 4 * params
    assert acc["bytes"] == 4 * (params + 50 * 16)
    assert acc["tables"]["x"]["full_bytes"] / acc["tables"]["x"]["bytes"] == pytest.approx(1223.1, abs=0.1)


# ---------------------------------------------------------------------------------------- values
@pytest.mark.parametrize("n, dim, options, pooling", [
    (997, 12, {"ranks": (3, 5)}, "sum"),
    (1000, 8, {"cores": 4, "rank": 3}, "mean"),
    (300, 6, {"cores": 2, "rank": 4, "dim_factors": (3, 2)}, "sum"),
])
def test_rows_equal_an_explicit_contraction_and_bags_pool_after(n, dim, options, pooling):
    spec = DatasetSpec(0, (FeatureSpec("x", n, bag_size=3),))
    collection = EmbeddingCollection(spec, [TableSpec("x", n, dim, "tt", options)], pooling)
    assert not collection.methods["x"].pools_before_combine
    tables = collection.init_tables(jax.random.key(0))
    rng = np.random.default_rng(1)
    ids = rng.integers(0, n, (24, 3)).astype(np.int32)
    ids[0] = [0, n - 1, 0]
    ids[1] = [n - 1, n - 1, 1]
    lengths = rng.integers(0, 4, 24).astype(np.int32)
    lengths[:2] = 3
    ids[np.arange(3)[None, :] >= lengths[:, None]] = 0
    emb, variables = embed(collection, tables, {"x": ids}, {"x": lengths})
    assert jax.tree_util.tree_leaves(variables) == []  # no dense glue: the cores are physical tables
    cores = numpy_cores(collection, tables)
    expected = np.zeros((24, dim))
    for b in range(24):
        w = 1.0 if pooling == "sum" else 1.0 / max(lengths[b], 1)
        for x in ids[b, : lengths[b]]:
            expected[b] += w * numpy_tt_row(cores, int(x))
    np.testing.assert_allclose(emb[:, 0], expected, rtol=1e-5, atol=1e-7)


def test_initial_rows_have_the_full_tables_variance():
    """Core entries U(-s, s) with R (s^2/3)^k = 1/(3V): the product rows have the variance of U(+-1/sqrt(V))."""
    n, dim = 20_000, 16
    spec = DatasetSpec(0, (FeatureSpec("x", n),))
    collection = EmbeddingCollection(spec, [TableSpec("x", n, dim, "tt", {"rank": 16})])
    digits = np.unravel_index(np.arange(n), collection.methods["x"].vocab_factors)
    variances = []
    for seed in range(4):
        g1, g2, g3 = numpy_cores(collection, collection.init_tables(jax.random.key(seed)))
        a = g1[0][digits[0]]  # [V, d_1, r_1]
        b = g2.transpose(1, 0, 2, 3)[digits[1]]  # [V, r_1, d_2, r_2]
        c = g3[..., 0].transpose(1, 0, 2)[digits[2]]  # [V, r_2, d_3]
        rows = np.einsum("xaq,xqbr,xrc->xabc", a, b, c, optimize=True)
        variances.append(rows.var())
    # The rows share core slices, so one draw's variance is noisy; the mean over draws is close.
    assert np.mean(variances) == pytest.approx(1 / (3 * n), rel=0.25), (variances, 1 / (3 * n))


# ------------------------------------------------------------------------------------- gradients
def test_core_row_gradients_and_sgd_step_match_a_dense_oracle():
    """d loss / d (distinct core rows) through the engine equals jax.grad of a dense formulation (whole cores as
    arrays, rows by fancy indexing), and one sparse SGD step equals dense SGD on the cores (untouched slices have
    zero gradient)."""
    n, dim, opts = 100_000, 8, {"ranks": (3, 4)}  # cores of 47 rows: a batch leaves most slices untouched
    spec = DatasetSpec(0, (FeatureSpec("x", n, bag_size=4),))
    collection = EmbeddingCollection(spec, [TableSpec("x", n, dim, "tt", opts)])
    m = collection.methods["x"]
    tables = collection.init_tables(jax.random.key(2))
    rng = np.random.default_rng(3)
    ids = rng.integers(0, n, (16, 4)).astype(np.int32)
    ids[:4, :2] = 7  # duplicates share core rows: their gradients must add up
    lengths = rng.integers(1, 5, 16).astype(np.int32)
    ids[np.arange(4)[None, :] >= lengths[:, None]] = 0
    target = rng.normal(size=(16, dim)).astype(np.float32)
    glue = EmbeddingGlue(collection)


    @jax.jit
    def engine_grads(tables):
        routes = collection.route({"x": jnp.asarray(ids)}, {"x": jnp.asarray(lengths)}, dedup=True)
        rows = collection.gather(tables, routes)
        variables = glue.init(jax.random.key(0), rows, routes.features)

        def engine_loss(rows):
            emb = glue.apply(variables, rows, routes.features)[:, 0]
            return jnp.sum((emb - target) ** 2)

        return routes, rows, jax.grad(engine_loss)(rows)

    routes, rows, row_grads = engine_grads(tables)

    def dense_loss(cores):  # cores: [f32[n_j, r0 * d * r1]], the id's rows picked by unravel_index
        digits = np.unravel_index(ids, m.vocab_factors)
        out = None
        for j, (core, (r0, _, d, r1)) in enumerate(zip(cores, m.core_shapes(), strict=True)):
            g = core[digits[j]].reshape(16, 4, r0, d, r1)
            out = g[:, :, 0] if j == 0 else jnp.einsum("blar,blrcs->blacs", out, g).reshape(16, 4, -1, r1)
        emb = out.reshape(16, 4, dim)
        weight = (np.arange(4)[None, :] < lengths[:, None]).astype(np.float32)
        return jnp.sum((jnp.einsum("bld,bl->bd", emb, weight) - target) ** 2)

    placements = collection.placements["x"]
    cores = [np.asarray(tables[p.group])[p.offset: p.offset + p.table.rows] for p in placements]
    dense_grads = jax.jit(jax.grad(dense_loss))(cores)
    for p, dense in zip(placements, dense_grads, strict=True):
        unique = np.asarray(routes.unique[p.group])
        assert unique.shape == (min(ids.size, collection.group_rows[p.group] + 1),)  # small groups: no wasted slots
        g = np.asarray(row_grads[p.group])
        mine = (unique >= p.offset) & (unique < p.offset + p.table.rows)
        got = np.zeros_like(np.asarray(dense))
        got[unique[mine] - p.offset] = g[mine]
        np.testing.assert_allclose(got, dense, rtol=1e-4, atol=1e-6)
        assert np.count_nonzero(np.abs(dense).sum(1)) <= mine.sum() < p.table.rows  # only touched slices move

    lr = 0.05
    sgd = SGD(lr)
    state = collection.init_optimizer(sgd)
    new_tables, _ = collection.sparse_update(sgd, tables, state, routes, rows, row_grads, jnp.float32(lr),
                                             jnp.int32(1))
    for p, core, dense in zip(placements, cores, dense_grads, strict=True):
        updated = np.asarray(new_tables[p.group])[p.offset: p.offset + p.table.rows]
        np.testing.assert_allclose(updated, core - lr * np.asarray(dense), rtol=1e-5, atol=1e-7)

    # Without dedup (what embedding.dedup="auto" picks for plain SGD): per-occurrence lookups straight from the
    # tables, every occurrence's update scatter-added -- the same step.
    @jax.jit
    def step_without_dedup(tables):
        routes = collection.route({"x": jnp.asarray(ids)}, {"x": jnp.asarray(lengths)}, dedup=False)
        looked = collection.gather(tables, routes)
        grads = jax.grad(lambda looked: jnp.sum((glue.apply(variables, looked, routes.features)[:, 0] - target)
                                                ** 2))(looked)
        return collection.sparse_update(sgd, tables, state, routes, looked, grads, jnp.float32(lr), jnp.int32(1))[0]

    variables = glue.init(jax.random.key(0), rows, routes.features)
    no_dedup_tables = step_without_dedup(tables)
    for g in new_tables:
        np.testing.assert_allclose(np.asarray(no_dedup_tables[g]), np.asarray(new_tables[g]), rtol=1e-5, atol=1e-7)


# -------------------------------------------------------------------------------------- training
def test_tt_learns(tmp_path):
    """tiny_config's tables above 40 ids (C1, C2, C3, C5) as rank-4 TT cores: the model still learns."""
    summary = train_and_evaluate(compressed_config("tt", {"rank": 4, "threshold": 40}), tmp_path)
    assert summary["auc"] > AUC_FLOOR, summary["auc"]
    tables = summary["tables"]
    assert [f for f, t in tables.items() if t["method"] == "tt"] == ["C1", "C2", "C3", "C5"]
    # C5: 3000 ids -> (15, 14, 15), D = 8 -> (2, 2, 2), rank 4: 15*2*4 + 14*4*2*4 + 15*4*2 = 120 + 448 + 120.
    assert tables["C5"]["params"] == 688 and tables["C5"]["physical_tables"]["C5/core1"] == [14, 32]
    assert summary["compression_ratio"] > 1.5
    assert summary["embedding_bytes"] == sum(t["bytes"] for t in tables.values())


# ----------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("options, message", [
    ({"cores": 1}, "cores must be an integer >= 2"),
    ({"rank": 0}, "rank must be an integer >= 1"),
    ({"ranks": (4,)}, r"needs cores - 1 = 2 inner ranks"),
    ({"ranks": (4, 0)}, "ranks must be a tuple of integers >= 1"),
    ({"rank": 4, "ranks": (4, 4)}, "not both"),
    ({"vocab_factors": (10, 10, 9)}, r"product is >= vocab_size 1000, got \(10, 10, 9\)"),
    ({"dim_factors": (2, 2, 3)}, "whose product is dim 8"),
    ({"rnak": 4}, r"table 'x': method 'tt' has no option\(s\) \['rnak'\]"),
])
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        method(1000, **options)
