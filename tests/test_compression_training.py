"""Every compression method trains end to end on the synthetic data, alone and mixed across tables."""

import ml_collections
import pytest
from test_train import tiny_config

from recjax.task import build_task
from recjax.train import train_and_evaluate

STEPS = 300
# With every id of every feature sharing one row (hashing to 1 bucket) the model only sees the dense features
# and reaches ~0.61 AUC; full tables reach ~0.77 in these 300 steps.
AUC_FLOOR = 0.70


def compressed_config(method: str, options: dict, tables: dict | None = None) -> ml_collections.ConfigDict:
    """tiny_config (vocabs 200, 50, 1000, 8, 3000, 20; D = 8) with one evaluation at the end."""
    config = tiny_config(STEPS)
    config.data.eval_examples = 4096
    config.train.eval_every = STEPS
    config.embedding.method = method
    config.embedding.options = ml_collections.ConfigDict(options)
    if tables:
        config.embedding.tables = ml_collections.ConfigDict(tables)
    if method == "md_blocks" or any(t.get("method") == "md_blocks" for t in (tables or {}).values()):
        config.embedding.id_counts = "dataset"
    return config


# hashing (C1) and qr (C4) also train in test_methods_mix_across_tables_in_one_model below, and signed hashing's and
# qr mult's per-id gradients are exact in test_kernel_dispatch.py (pool_from test): their own runs are slow.
@pytest.mark.parametrize("method, options", [
    pytest.param("hashing", {"collisions": 4, "sign": True, "threshold": 40}, marks=pytest.mark.slow),
    pytest.param("qr", {"collisions": 4, "op": "mult", "threshold": 40}, marks=pytest.mark.slow),
    ("qr_path", {"collisions": 4, "hidden": 4, "threshold": 40}),
    ("md_blocks", {"blocks": (0.1, 1.0), "threshold": 40}),
])
def test_each_method_learns(tmp_path, method, options):
    """Tables above 40 ids (C1, C2, C3, C5) compressed; mixed_radix, crt and md train in the mixed model below."""
    summary = train_and_evaluate(compressed_config(method, options), tmp_path)
    assert summary["auc"] > AUC_FLOOR, (method, summary["auc"])
    tables = summary["tables"]
    assert [f for f, t in tables.items() if t["method"] == method] == ["C1", "C2", "C3", "C5"]
    assert all(tables[f]["bytes"] < tables[f]["full_bytes"] for f in ("C1", "C3", "C5")), tables
    assert summary["compression_ratio"] > 1.5
    assert summary["embedding_bytes"] == sum(t["bytes"] for t in tables.values())


def test_methods_mix_across_tables_in_one_model(tmp_path):
    config = compressed_config("mixed_radix", {"partitions": 3, "op": "add", "threshold": 40}, tables={
        "C1": {"method": "hashing", "options": {"buckets": 64, "hash": "modulo"}},
        "C3": {"method": "crt", "options": {"moduli": (29, 30, 31), "op": "concat"}},
        "C4": {"method": "qr", "options": {"collisions": 3}},  # 8 ids: the override has no threshold
        "C5": {"method": "md", "options": {"dim": 2}},
        "C6": {"options": {"op": "mult", "threshold": 0}},
    })
    task = build_task(config, _spec(config))
    methods = {f: m.spec.method for f, m in task.collection.methods.items()}
    assert methods == {"C1": "hashing", "C2": "mixed_radix", "C3": "crt", "C4": "qr", "C5": "md", "C6": "mixed_radix"}
    assert task.collection.methods["C6"].op == "mult" and task.collection.methods["C2"].op == "add"
    summary = train_and_evaluate(config, tmp_path)
    assert summary["auc"] > AUC_FLOOR, summary["auc"]
    # By hand: C1 64 x 8; C2 digits of 50 in radices (4, 4): 4 + 4 + 4 rows x 8; C3 crt rows 29, 30, 31 x dims
    # (3, 3, 2); C4 qr of 8 ids: 3 + 3 rows x 8; C5 3000 x 2 + projection 2 x 8; C6 digits of 20: 3 + 3 + 3 rows x 8.
    params = 64 * 8 + 12 * 8 + (29 * 3 + 30 * 3 + 31 * 2) + 6 * 8 + (3000 * 2 + 2 * 8) + 9 * 8
    assert summary["embedding_params"] == params
    assert summary["compression_ratio"] == 8 * (200 + 50 + 1000 + 8 + 3000 + 20) / params


def _spec(config):
    from recjax.data import make_dataset

    return make_dataset(config.data, seed=config.seed).spec
