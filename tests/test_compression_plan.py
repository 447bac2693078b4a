"""Collection planning (config layout, overrides, thresholds), byte accounting per method, glue param counts."""

import jax
import ml_collections
import numpy as np
import pytest
from conftest import embed

from compression import TableSpec
from compression.plan import plan_tables
from recjax.embedding import EmbeddingCollection
from recjax.sparse_optim import RowwiseAdagrad
from recjax.specs import DatasetSpec, FeatureSpec

NAMES = ["a", "b", "c", "d"]
VOCABS = [100_000, 5_000, 300, 50]


def embedding_config(method, options=None, tables=None) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.dim = 16
    config.method = method
    config.options = ml_collections.ConfigDict(options or {})
    if tables is not None:
        config.tables = ml_collections.ConfigDict(tables)
    config.pooling = "sum"
    return config


def test_default_method_with_per_table_overrides():
    config = embedding_config("qr", {"collisions": 4, "op": "add", "threshold": 300}, tables={
        "a": {"method": "hashing", "options": {"buckets": 1000}},  # other method: options start empty
        "b": {"options": {"collisions": 16}},  # same method: merged over the defaults
        "d": {"method": "crt", "options": {"moduli": (7, 8)}},  # under qr's threshold, but crt has none
    })
    specs = plan_tables(NAMES, VOCABS, 16, config)
    assert [(s.name, s.vocab_size, s.dim, s.method, dict(s.options)) for s in specs] == [
        ("a", 100_000, 16, "hashing", {"buckets": 1000}),
        ("b", 5_000, 16, "qr", {"collisions": 16, "op": "add"}),
        ("c", 300, 16, "full", {}),  # vocab_size <= threshold stays full (the reference's n > threshold test)
        ("d", 50, 16, "crt", {"moduli": (7, 8)}),
    ]


def test_threshold_keeps_small_tables_full_for_every_method():
    for method, options in [("hashing", {"collisions": 2}), ("qr", {"collisions": 4}),
                            ("mixed_radix", {"partitions": 2}), ("qr_path", {"collisions": 4}),
                            ("md", {}), ("crt", {"moduli": (317, 318, 319)})]:
        specs = plan_tables(NAMES, VOCABS, 16, embedding_config(method, {**options, "threshold": 5_000}))
        assert [s.method for s in specs] == [method, "full", "full", "full"], method


def test_md_over_a_threshold_keeps_the_reference_dims_and_does_not_crash():
    """The reference solves dims over every table, then crashes on tables under --md-threshold; here they
    stay full and the others keep the reference's dims [2, 4, 9]."""
    specs = plan_tables(NAMES, VOCABS, 16, embedding_config("md", {"threshold": 200}))
    assert [(s.method, dict(s.options)) for s in specs] == [("md", {"dim": 2}), ("md", {"dim": 4}),
                                                            ("md", {"dim": 9}), ("full", {})]
    specs = plan_tables(NAMES, VOCABS, 16, embedding_config("md", {"round_pow2": True}, tables={
        "b": {"options": {"dim": 12}}}))  # a fixed dim leaves the rule
    assert [s.options["dim"] for s in specs] == [2, 12, 8, 16]


@pytest.mark.parametrize("config, message", [
    (embedding_config("qr", {"collisions": 4}, tables={"zz": {"options": {}}}), r"unknown feature\(s\) \['zz'\]"),
    (embedding_config("qrr"), "unknown embedding method 'qrr'"),
    (embedding_config("qr", {"collisions": 4}, tables={"a": {"method": "full", "dim": 4}}), r"key\(s\) \['dim'\]"),
    (embedding_config("md", tables={"a": {"options": {"alpha": 0.5}}}), "md option 'alpha' must be the same"),
    (embedding_config("md", {"alpah": 0.5}), r"method 'md' has no option\(s\) \['alpah'\]"),
    (embedding_config("qr", {"collisions": 4, "threshold": -1}), "threshold must be an integer >= 0"),
    (embedding_config("md_blocks"), "md_blocks needs per-id counts"),
    (embedding_config("qr", {"collisions": 0}), "collisions must be an integer >= 1"),
    (embedding_config("crt", {"moduli": (10, 15, 7)}), "pairwise coprime, but 10 and 15 share the factor 5"),
])
def test_bad_configs_are_clear_errors(config, message):
    spec = DatasetSpec(0, tuple(FeatureSpec(n, v) for n, v in zip(NAMES, VOCABS, strict=True)))
    with pytest.raises(ValueError, match=message):
        EmbeddingCollection(spec, plan_tables(NAMES, VOCABS, 16, config))


ZIPF_COUNTS = 1000.0 / (np.arange(1000) + 1)  # md_blocks at D = 8: blocks 10 / 90 / 900 rows, dims 8 / 4 / 2

# (method, options, params by hand: rows x dim of every physical table + glue, physical rows)
ACCOUNTING_CASES = [
    ("full", {}, 1000 * 8, 1000),
    ("hashing", {"buckets": 100}, 100 * 8, 100),
    ("hashing", {"collisions": 3, "sign": True}, 334 * 8 + 1 * 1, 335),
    ("qr", {"collisions": 7}, 143 * 8 + 7 * 8, 150),
    ("qr", {"collisions": 7, "op": "concat"}, 143 * 4 + 7 * 4, 150),
    ("mixed_radix", {"radices": (10, 10)}, 3 * 10 * 8, 30),
    ("crt", {"moduli": (7, 11, 13)}, (7 + 11 + 13) * 8, 31),
    ("qr_path", {"collisions": 4}, 250 * 8 + 4 * 8 * 8, 254),
    ("qr_path", {"collisions": 4, "hidden": 2, "transform_by": "quotient"}, 4 * 8 + 250 * 2 * 8 * 2, 254),
    ("md", {"dim": 3}, 1000 * 3 + 3 * 8, 1000),
    ("md_blocks", {"counts": ZIPF_COUNTS}, 10 * 8 + 90 * 4 + 900 * 2 + (4 + 2) * 8, 1000),
]


@pytest.mark.parametrize("method, options, params, rows", ACCOUNTING_CASES)
def test_byte_accounting_matches_hand_computed_values(method, options, params, rows):
    spec = DatasetSpec(0, (FeatureSpec("x", 1000),))
    collection = EmbeddingCollection(spec, [TableSpec("x", 1000, 8, method, options)])
    acc = collection.accounting(RowwiseAdagrad(0.1))
    assert acc["params"] == params and acc["bytes"] == 4 * params
    assert acc["optimizer_bytes"] == 4 * rows  # one row-wise accumulator per physical row
    assert acc["full_bytes"] == 4 * 1000 * 8
    assert acc["tables"]["x"]["method"] == method


def test_mixed_methods_in_one_collection_count_glue_exactly():
    """Every method in one model: the Flax params of the glue equal the sum of the methods' glue_params()."""
    spec = DatasetSpec(0, tuple(FeatureSpec(f"f{i}", 1000, bag_size=2) for i in range(len(ACCOUNTING_CASES))))
    tables = [TableSpec(f"f{i}", 1000, 8, m, o) for i, (m, o, _, _) in enumerate(ACCOUNTING_CASES)]
    collection = EmbeddingCollection(spec, tables)
    rng = np.random.default_rng(0)
    ids = {f.name: rng.integers(0, 1000, (4, 2)).astype(np.int32) for f in spec.features}
    lengths = {f.name: np.array([2, 1, 0, 2], np.int32) for f in spec.features}
    emb, variables = embed(collection, collection.init_tables(jax.random.key(1)), ids, lengths)
    assert emb.shape == (4, len(tables), 8) and np.all(np.isfinite(np.asarray(emb)))
    assert np.all(np.asarray(emb)[2] == 0)  # empty bags embed to zero under every method
    per_feature = {name: sum(x.size for x in jax.tree_util.tree_leaves(p))
                   for name, p in variables.get("params", {}).items()}
    for f, method in collection.methods.items():
        assert per_feature.get(f"combine_{f}", 0) == method.glue_params(), f
    assert sum(m.glue_params() for m in collection.methods.values()) == 3 * 8 + (4 + 2) * 8
