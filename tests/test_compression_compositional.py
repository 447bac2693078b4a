"""Compositional embeddings (QR, mixed radix, CRT, path-based) against Python-int and numpy oracles."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import embed

from compression import TableSpec, build_method
from recjax.embedding import EmbeddingCollection
from recjax.specs import DatasetSpec, FeatureSpec


def method(kind, vocab_size, dim=8, **options):
    return build_method(TableSpec("x", vocab_size, dim, kind, options))


def routed(m, ids) -> np.ndarray:
    """[N, k] routed local rows, one column per physical table."""
    return np.stack([np.asarray(r) for r in m.route(jnp.asarray(np.asarray(ids, np.int32)))], axis=1)


CASES = [
    ("qr", 1000, {"collisions": 7}),
    ("qr", 1000, {"collisions": 1000}),
    ("qr", 997, {"collisions": 10, "op": "concat"}),
    ("mixed_radix", 1000, {"radices": (3, 5)}),
    ("mixed_radix", 1001, {"partitions": 3}),
    ("crt", 1000, {"moduli": (7, 11, 13)}),
    ("crt", 1000, {"moduli": (8, 9, 25), "op": "add"}),
    ("qr_path", 1000, {"collisions": 6}),
    ("qr_path", 1000, {"collisions": 6, "transform_by": "quotient", "hidden": 3}),
]


@pytest.mark.parametrize("kind, n, options", CASES)
def test_every_id_gets_a_distinct_tuple_of_rows(kind, n, options):
    """Complementary partitions (Shi et al. Def. 1): exhaustively, no two ids share a row in every table,
    and every routed row is inside its table."""
    m = method(kind, n, **options)
    rows = routed(m, np.arange(n))
    assert len({tuple(r) for r in rows}) == n
    sizes = np.array([t.rows for t in m.physical_tables()])
    assert np.all(rows >= 0) and np.all(rows < sizes[None, :])


def test_table_shapes():
    assert [(t.name, t.rows, t.dim) for t in method("qr", 1000, collisions=7).physical_tables()] == [
        ("x/q", 143, 8), ("x/r", 7, 8)]
    assert [(t.rows, t.dim) for t in method("qr", 1000, dim=7, collisions=7, op="concat").physical_tables()] == [
        (143, 4), (7, 3)]
    assert [t.rows for t in method("mixed_radix", 1000, radices=(3, 5)).physical_tables()] == [3, 5, 67]
    assert [t.rows for t in method("mixed_radix", 1001, partitions=3).physical_tables()] == [11, 11, 9]
    assert [(t.name, t.rows) for t in method("crt", 1000, moduli=(7, 11, 13)).physical_tables()] == [
        ("x/mod7", 7), ("x/mod11", 11), ("x/mod13", 13)]
    assert [(t.name, t.rows, t.dim) for t in method("qr_path", 1000, collisions=6).physical_tables()] == [
        ("x/q", 167, 8), ("x/path", 6, 64)]
    assert [(t.name, t.rows, t.dim) for t in method("qr_path", 1000, collisions=6, transform_by="quotient",
                                                    hidden=3).physical_tables()] == [("x/r", 6, 8), ("x/path", 167, 48)]


def python_digits(kind, options, x: int) -> tuple[int, ...]:
    """The partitions with Python's unbounded ints."""
    if kind in ("qr", "qr_path"):
        q, r = divmod(x, options["collisions"])
        return (r, q) if options.get("transform_by") == "quotient" else (q, r)
    if kind == "mixed_radix":
        digits = []
        for radix in options["radices"]:
            x, d = divmod(x, radix)
            digits.append(d)
        return (*digits, x)
    return tuple(x % m for m in options["moduli"])


@pytest.mark.parametrize("kind, options", [
    ("qr", {"collisions": 3}),
    ("qr", {"collisions": 46_341}),
    ("mixed_radix", {"radices": (1000, 999)}),
    ("crt", {"moduli": (2**16 + 1, 2**16, 2**16 - 1)}),
    ("qr_path", {"collisions": 4, "transform_by": "quotient"}),
])
def test_integer_math_is_exact_up_to_int32_max(kind, options):
    n = 2**31 - 1
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(0, n, 20_000), [0, 2**24 - 1, 2**24 + 1, 2**24 + 7, n - 2, n - 1]])
    rows = routed(method(kind, n, **options), ids)
    expected = np.array([python_digits(kind, options, int(x)) for x in ids])
    np.testing.assert_array_equal(rows, expected)


def reference_float32_quotient(ids: np.ndarray, m: int) -> np.ndarray:
    """facebookresearch/dlrm QREmbeddingBag: `(input / m).long()` -- torch true division in float32."""
    return (ids.astype(np.int64).astype(np.float32) / np.float32(m)).astype(np.int64)


def test_float32_quotient_of_the_reference_is_wrong_above_2_24_and_ours_is_not():
    m = 3
    x = 2**24 + 7  # float32 rounds 16777223 up to 16777224 = 3 * 5592408
    assert reference_float32_quotient(np.array([x]), m)[0] == 5_592_408
    assert x // m == 5_592_407
    # The reference's (quotient, remainder) of x is then that of x + 3: two ids share both rows.
    ref_pair = lambda v: (int(reference_float32_quotient(np.array([v]), m)[0]), v % m)  # noqa: E731
    assert ref_pair(x) == ref_pair(x + 3) == (5_592_408, 2)
    ours = method("qr", 2**25, collisions=m)
    np.testing.assert_array_equal(routed(ours, [x, x + 3]), [[5_592_407, 2], [5_592_408, 2]])

    ids = np.arange(2**24, 2**24 + 3000)
    wrong = reference_float32_quotient(ids, m) != ids // m
    assert wrong.sum() > 100  # the reference is wrong for a good share of ids just above 2^24
    assert np.all(reference_float32_quotient(np.arange(0, 2**24, 9973), m) == np.arange(0, 2**24, 9973) // m)
    np.testing.assert_array_equal(routed(ours, ids)[:, 0], ids // m)


def table_block(collection, tables, feature, index):
    p = collection.placements[feature][index]
    return np.asarray(tables[p.group])[p.offset: p.offset + p.table.rows]


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_mult_bags_combine_per_id_then_pool(pooling):
    """QR mult is not linear per row: emb = sum_l w_l (q[x_l // m] * r[x_l % m]), not (sum q) * (sum r)."""
    n, m, d = 300, 7, 4
    spec = DatasetSpec(0, (FeatureSpec("x", n, bag_size=6),))
    collection = EmbeddingCollection(spec, [TableSpec("x", n, d, "qr", {"collisions": m, "op": "mult"})], pooling)
    assert not collection.methods["x"].pools_before_combine
    tables = collection.init_tables(jax.random.key(0))
    rng = np.random.default_rng(4)
    ids = rng.integers(0, n, (32, 6)).astype(np.int32)
    lengths = rng.integers(0, 7, 32).astype(np.int32)
    ids[np.arange(6)[None, :] >= lengths[:, None]] = 0
    emb, _ = embed(collection, tables, {"x": ids}, {"x": lengths})
    q, r = table_block(collection, tables, "x", 0), table_block(collection, tables, "x", 1)
    expected = np.zeros((32, d), np.float32)
    pooled_first = np.zeros((32, d), np.float32)
    for b in range(32):
        w = 1.0 if pooling == "sum" else 1.0 / max(lengths[b], 1)
        bag = ids[b, : lengths[b]]
        for x in bag:
            expected[b] += w * q[x // m] * r[x % m]
        pooled_first[b] = (w * q[bag // m].sum(0)) * (w * r[bag % m].sum(0))
    np.testing.assert_allclose(emb[:, 0], expected, rtol=1e-5, atol=1e-8)
    assert not np.allclose(expected, pooled_first, rtol=1e-3, atol=1e-8)  # pooling first would be a different model


@pytest.mark.parametrize("op", ["concat", "add"])
def test_linear_ops_pool_first_and_match_numpy(op):
    n, d = 200, 5
    spec = DatasetSpec(0, (FeatureSpec("x", n, bag_size=3),))
    collection = EmbeddingCollection(spec, [TableSpec("x", n, d, "mixed_radix", {"radices": (4, 5), "op": op})])
    assert collection.methods["x"].pools_before_combine
    tables = collection.init_tables(jax.random.key(0))
    ids = np.random.default_rng(5).integers(0, n, (16, 3)).astype(np.int32)
    lengths = np.full(16, 3, np.int32)
    emb, _ = embed(collection, tables, {"x": ids}, {"x": lengths})
    t = [table_block(collection, tables, "x", i) for i in range(3)]
    digits = [ids % 4, ids // 4 % 5, ids // 20]
    parts = [t[i][digits[i]].sum(1) for i in range(3)]  # [16, d_i] pooled per table
    expected = np.concatenate(parts, axis=1) if op == "concat" else sum(parts)
    assert expected.shape == (16, d)
    np.testing.assert_allclose(emb[:, 0], expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("hidden", [0, 3])
def test_path_based_applies_each_remainder_class_transform(hidden):
    """Shi et al. §4: emb(x) = M_{x mod m}(W[x // m]) with M a D x D map or a bias-free ReLU MLP."""
    n, m, d = 100, 4, 3
    spec = DatasetSpec(0, (FeatureSpec("x", n, bag_size=2),))
    collection = EmbeddingCollection(
        spec, [TableSpec("x", n, d, "qr_path", {"collisions": m, "hidden": hidden})], pooling="sum")
    tables = collection.init_tables(jax.random.key(0))
    ids = np.random.default_rng(6).integers(0, n, (8, 2)).astype(np.int32)
    lengths = np.array([2, 1, 0, 2, 2, 1, 2, 2], np.int32)
    emb, variables = embed(collection, tables, {"x": ids}, {"x": lengths})
    assert jax.tree_util.tree_leaves(variables) == [] and collection.methods["x"].glue_params() == 0
    w, path = table_block(collection, tables, "x", 0), table_block(collection, tables, "x", 1)
    expected = np.zeros((8, d), np.float32)
    for b in range(8):
        for x in ids[b, : lengths[b]]:
            e, t = w[x // m], path[x % m]
            if hidden == 0:
                expected[b] += t.reshape(d, d) @ e
            else:
                w1, w2 = t[: hidden * d].reshape(hidden, d), t[hidden * d:].reshape(d, hidden)
                expected[b] += w2 @ np.maximum(w1 @ e, 0)
    np.testing.assert_allclose(emb[:, 0], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("op", ["mult", "concat"])
def test_qr_init_bounded_by_default_and_the_references_on_request(op):
    """Default: U(+-n^(-1/4)) for mult, U(+-sqrt(1/n)) for concat. init="reference": facebookresearch/dlrm's
    QREmbeddingBag, U(sqrt(1/n), 1) for both tables whatever the op."""
    n, m, d = 10_000, 50, 8
    spec = DatasetSpec(0, (FeatureSpec("x", n),))
    bound = n ** -0.25 if op == "mult" else math.sqrt(1 / n)
    for init, low, high in (("bounded", -bound, bound), ("reference", math.sqrt(1 / n), 1.0)):
        options = {"collisions": m, "op": op, **({} if init == "bounded" else {"init": init})}
        collection = EmbeddingCollection(spec, [TableSpec("x", n, d, "qr", options)])
        tables = collection.init_tables(jax.random.key(0))
        for i in range(2):
            t = table_block(collection, tables, "x", i)
            assert low <= t.min() and t.max() <= high, (init, i, t.min(), t.max())
            assert t.mean() == pytest.approx((low + high) / 2, abs=0.05 * (high - low)), (init, i)
            assert t.std() == pytest.approx((high - low) / math.sqrt(12), rel=0.1), (init, i)


def test_helpers_are_exact():
    from compression.compositional import integer_root_ceil, split_dims

    for n, k in itertools.product([1, 2, 7, 8, 9, 1000, 1001, 2**31 - 1, 10**18], [2, 3, 4]):
        r = integer_root_ceil(n, k)
        assert r**k >= n and (r == 1 or (r - 1) ** k < n)
    assert split_dims(7, 2) == (4, 3) and sum(split_dims(16, 3)) == 16
    assert math.prod(m.rows for m in method("crt", 10**6, moduli=(100, 101, 103)).physical_tables()) >= 10**6


@pytest.mark.parametrize("kind, options, message", [
    ("qr", {"collisions": 0}, "collisions must be an integer >= 1"),
    ("qr", {}, "collisions must be an integer >= 1"),
    ("qr", {"collisions": 4, "op": "max"}, "unknown compositional op 'max'"),
    ("qr", {"collisions": 4, "init": "positive"}, "unknown qr init 'positive'"),
    ("qr", {"collisions": 4, "collision": 4}, r"has no option\(s\) \['collision'\]"),
    ("mixed_radix", {"radices": (4, 1)}, r"radices\[i\] must be an integer >= 2"),
    ("mixed_radix", {}, "exactly one of options.radices"),
    ("mixed_radix", {"radices": (4,), "partitions": 2}, "exactly one of options.radices"),
    ("crt", {"moduli": (6, 10, 7)}, "pairwise coprime, but 6 and 10 share the factor 2"),
    ("crt", {"moduli": (7, 11)}, r"multiply to 77 < vocab_size 1000"),
    ("crt", {"moduli": (1001,)}, "at least 2 pairwise coprime"),
    ("qr_path", {"collisions": 4, "transform_by": "id"}, "unknown transform_by 'id'"),
])
def test_bad_options_are_clear_errors(kind, options, message):
    with pytest.raises(ValueError, match=message):
        method(kind, 1000, **options)
    with pytest.raises(ValueError, match="needs dim >= the number of partitions"):
        method("mixed_radix", 1000, dim=2, partitions=3, op="concat")
