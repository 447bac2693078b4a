"""The hashing trick against Python-int oracles and the birthday-bound collision statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compression import TableSpec, build_method
from compression.hashing import MERSENNE_P, universal_hash, universal_hash_params
from recjax.batch import Batch, validate_batch
from recjax.embedding import EmbeddingCollection, EmbeddingGlue
from recjax.sparse_optim import SGD
from recjax.specs import DatasetSpec, FeatureSpec


def hashing(vocab_size=1000, dim=4, **options):
    return build_method(TableSpec("h", vocab_size, dim, "hashing", options))


def python_universal(ids, a, b, m):
    """The Carter-Wegman family with Python's unbounded ints."""
    return np.array([((a * (int(x) % 2**32) + b) % MERSENNE_P) % m for x in ids], np.int64)


def test_universal_hash_is_exact_over_the_int32_range():
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(0, 2**31, 20_000), [0, 1, 2**16 - 1, 2**16, 2**24 + 1, 2**31 - 2, 2**31 - 1]])
    ids = ids.astype(np.int32)
    hash_fn = jax.jit(universal_hash, static_argnums=(1, 2, 3))
    for a, b, m in [(MERSENNE_P - 1, MERSENNE_P - 1, 2**31 - 1), (1, 0, 7), (2**30 + 12345, 5, 97),
                    universal_hash_params(3, "C1", 0) + (100_003,)]:
        np.testing.assert_array_equal(np.asarray(hash_fn(jnp.asarray(ids), a, b, m)), python_universal(ids, a, b, m))


def test_route_matches_python_for_modulo_and_universal_and_sign():
    ids = np.random.default_rng(1).integers(0, 2**31, 5_000).astype(np.int32)
    universal = hashing(buckets=1009, sign=True, seed=7)
    rows, sign_rows = (np.asarray(r) for r in universal.route(jnp.asarray(ids)))
    np.testing.assert_array_equal(rows, python_universal(ids, *universal.hash_params, 1009))
    signs = 1 - 2 * python_universal(ids, *universal.sign_params, 2)
    np.testing.assert_array_equal(sign_rows, np.where(signs > 0, 0, -1))
    assert 0.45 < np.mean(signs > 0) < 0.55
    modulo = hashing(buckets=1009, hash="modulo")
    (rows,) = modulo.route(jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(rows), ids.astype(np.int64) % 1009)
    assert universal.hash_params != hashing(buckets=1009, seed=8).hash_params  # the seed picks the function


def count_collisions(rows: np.ndarray, m: int) -> tuple[int, int]:
    """(occupied buckets, colliding pairs) of a hash of distinct ids."""
    per_bucket = np.bincount(rows, minlength=m)
    return int(np.sum(per_bucket > 0)), int(np.sum(per_bucket * (per_bucket - 1) // 2))


def test_collisions_match_the_birthday_bound():
    """n random distinct ids into m buckets: E[colliding pairs] = n(n-1)/(2m), E[occupied] = m(1 - (1-1/m)^n)."""
    n, m, draws = 20_000, 5_000, 8
    ids = np.random.default_rng(2).choice(2**31 - 1, n, replace=False).astype(np.int32)
    occupied, pairs = [], []
    for seed in range(draws):
        (rows,) = hashing(vocab_size=n, buckets=m, seed=seed).route(jnp.asarray(ids))
        o, p = count_collisions(np.asarray(rows), m)
        occupied.append(o)
        pairs.append(p)
    expected_pairs = n * (n - 1) / (2 * m)  # 39,998
    expected_occupied = m * (1 - (1 - 1 / m) ** n)  # 4,908.4
    # Balls in bins: sd(pairs) ~ sqrt(expected_pairs) ~ 200 per draw, sd(occupied) ~ 9; means over 8 draws.
    assert abs(np.mean(pairs) - expected_pairs) < 4 * np.sqrt(2 * expected_pairs / draws), (pairs, expected_pairs)
    assert abs(np.mean(occupied) - expected_occupied) < 4 * 12 / np.sqrt(draws), (occupied, expected_occupied)


def test_universal_hash_spreads_structured_ids_that_modulo_piles_up():
    """Multiples of m all land in bucket 0 under modulo; the universal hash still obeys the birthday bound
    (Carter-Wegman: E[colliding pairs] <= n(n-1)/(2m) for any fixed id set)."""
    n, m = 4_000, 1_000
    ids = jnp.arange(n, dtype=jnp.int32) * m
    (modulo_rows,) = hashing(vocab_size=n * m, buckets=m, hash="modulo").route(ids)
    assert count_collisions(np.asarray(modulo_rows), m) == (1, n * (n - 1) // 2)
    (rows,) = hashing(vocab_size=n * m, buckets=m, seed=0).route(ids)
    _, pairs = count_collisions(np.asarray(rows), m)
    assert pairs < 1.1 * n * (n - 1) / (2 * m)


def test_ids_beyond_vocab_are_valid_input():
    method = hashing(vocab_size=100, collisions=4)
    assert method.accepts_any_id and method.buckets == 25
    spec = DatasetSpec(0, (FeatureSpec("h", 100),))
    batch = Batch(dense=np.zeros((2, 0), np.float32), ids={"h": np.array([[5], [2**31 - 1]], np.int32)},
                  lengths={"h": np.ones(2, np.int32)}, labels=np.zeros(2, np.float32))
    validate_batch(batch, spec, any_id=frozenset({"h"}))  # no error: hashed features take any id
    with pytest.raises(ValueError, match="outside"):
        validate_batch(batch, spec)
    (rows,) = method.route(jnp.asarray(batch.ids["h"]))
    assert np.all((np.asarray(rows) >= 0) & (np.asarray(rows) < 25))


def test_signed_bags_match_numpy_and_the_sign_row_never_moves():
    """emb = sum_l w_l xi(x_l) W[h(x_l)] (per-id sign, then pool), and an SGD step leaves the sign row alone."""
    spec = DatasetSpec(0, (FeatureSpec("h", 500, bag_size=5),))
    collection = EmbeddingCollection(spec, [TableSpec("h", 500, 4, "hashing", {"buckets": 37, "sign": True})],
                                     pooling="mean")
    method = collection.methods["h"]
    assert not method.pools_before_combine
    tables = collection.init_tables(jax.random.key(0))
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 10**6, (16, 5)).astype(np.int32)
    lengths = rng.integers(0, 6, 16).astype(np.int32)
    glue = EmbeddingGlue(collection)
    target = jax.random.normal(jax.random.key(1), (16, 1, 4))
    optimizer = SGD(0.5)

    @jax.jit
    def forward_and_step(tables, ids, lengths):
        routes = collection.route({"h": ids}, {"h": lengths})
        rows = collection.gather(tables, routes)
        loss = lambda r: jnp.sum(glue.apply({}, r, routes.features) * target)  # noqa: E731
        new_tables, _ = collection.sparse_update(optimizer, tables, collection.init_optimizer(optimizer), routes,
                                                 rows, jax.grad(loss)(rows), jnp.float32(0.5), jnp.int32(1))
        return glue.apply({}, rows, routes.features), new_tables

    emb, new_tables = forward_and_step(tables, jnp.asarray(ids), jnp.asarray(lengths))
    emb = np.asarray(emb)[:, 0]

    main, sign = collection.placements["h"]
    table = np.asarray(tables[main.group])[main.offset: main.offset + 37]
    buckets = python_universal(ids.reshape(-1), *method.hash_params, 37).reshape(ids.shape)
    signs = (1 - 2 * python_universal(ids.reshape(-1), *method.sign_params, 2)).reshape(ids.shape)
    expected = np.zeros((16, 4), np.float32)
    for b in range(16):
        for slot in range(lengths[b]):
            expected[b] += signs[b, slot] * table[buckets[b, slot]] / lengths[b]
    np.testing.assert_allclose(emb, expected, rtol=1e-5, atol=1e-7)

    sign_before = np.asarray(tables[sign.group])[sign.offset]
    np.testing.assert_array_equal(np.asarray(new_tables[sign.group])[sign.offset], sign_before)
    assert sign_before[0] != 0
    assert not np.allclose(np.asarray(new_tables[main.group]), np.asarray(tables[main.group]))


@pytest.mark.parametrize("options, message", [
    ({}, "exactly one of options.buckets"),
    ({"buckets": 10, "collisions": 2}, "exactly one of options.buckets"),
    ({"collisions": 0.5}, "collisions must be >= 1"),
    ({"buckets": 10, "hash": "md5"}, "unknown hash 'md5'"),
    ({"buckets": 10, "bucket": 3}, r"has no option\(s\) \['bucket'\]"),
    ({"buckets": 10, "threshold": 3}, "applied by compression.plan.plan_tables"),
])
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        hashing(**options)
