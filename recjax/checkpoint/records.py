"""What a checkpoint's arrays hold: the embedding tables (`table_record`, compared with this run's before a restore
reads any array) and the dense leaves of the state item (tree paths, empty leaves rebuilt from their shapes)."""

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


def table_record(collection, optimizer, state) -> dict:
    """What the table arrays of a checkpoint hold (meta["tables"]), compared with this run's before a restore reads
    any: tables of equal dim share one stacked array, so equal shapes do not mean equal tables.

        "features": {feature: {"method", "vocab_size", "dim",
                               "physical_tables": [{"name", "rows", "dim", "group", "offset"}, ...]}}
        "groups": {group: {"rows", "dim", "dtype", "sparse_opt": {field: [dtype, shape per row]}}}
        "sparse_optimizer": its name

    `offset` is the table's first row in its stacked group; a mesh run's storages are a function of these and of
    meta["layout"]'s placements (`sharding.relayout` rebuilds them). `state` (arrays or shapes; keyed by group, or
    by storage "<group>/<kind>" on a mesh) gives the dtypes."""
    dtypes = {key.split("/")[0]: str(t.dtype) for key, t in state.tables.items()}
    field_dtypes = {(key.split("/")[0], f): str(v.dtype) for key, fields in state.sparse_opt_state.items()
                    for f, v in fields.items()}
    features: dict[str, dict] = {}
    for p in collection.physical_tables():  # in stacking order
        spec = collection.table_specs[p.feature]
        entry = features.setdefault(p.feature, {"method": spec.method, "vocab_size": spec.vocab_size, "dim": spec.dim,
                                                "physical_tables": []})
        entry["physical_tables"].append({"name": p.table.name, "rows": p.table.rows, "dim": p.table.dim,
                                         "group": p.group, "offset": p.offset})
    groups = {}
    for g in sorted(collection.group_rows):
        shapes = optimizer.state_shapes(1, collection.group_dims[g])
        groups[g] = {"rows": collection.group_rows[g], "dim": collection.group_dims[g], "dtype": dtypes.get(g),
                     "sparse_opt": {f: [field_dtypes.get((g, f)), list(shape[1:])]
                                    for f, shape in sorted(shapes.items())}}
    return {"features": features, "groups": groups, "sparse_optimizer": optimizer.name}


def table_differences(saved: Mapping, now: Mapping) -> list[str]:
    """What differs between a checkpoint's table record and this run's, "saved -> now", one entry per logical table
    (or stacked group, or the optimizer); [] when the checkpoint's arrays hold exactly this run's tables."""
    out = []
    if saved["sparse_optimizer"] != now["sparse_optimizer"]:
        out.append(f"sparse optimizer {saved['sparse_optimizer']} -> {now['sparse_optimizer']}")
    features = [*saved["features"], *(f for f in now["features"] if f not in saved["features"])]
    for f in features:
        a, b = saved["features"].get(f), now["features"].get(f)
        if a is None or b is None:
            out.append(f"table {f}: {'not in the checkpoint' if a is None else 'not in this config'}")
            continue
        what = [f"{k} {a[k]} -> {b[k]}" for k in ("method", "vocab_size", "dim") if a[k] != b[k]]
        names = [[t["name"] for t in x["physical_tables"]] for x in (a, b)]
        if names[0] != names[1]:
            what.append(f"physical tables {names[0]} -> {names[1]}")
        else:
            for ta, tb in zip(a["physical_tables"], b["physical_tables"], strict=True):
                what += [f"{ta['name']} {k} {ta[k]} -> {tb[k]}" for k in ("rows", "dim", "group", "offset")
                         if ta[k] != tb[k]]
        if what:
            out.append(f"table {f}: {', '.join(what)}")
    for g in [*saved["groups"], *(g for g in now["groups"] if g not in saved["groups"])]:
        a, b = saved["groups"].get(g), now["groups"].get(g)
        if a is None or b is None:
            continue  # its tables differ (above)
        what = [f"dtype {a['dtype']} -> {b['dtype']}"] if a["dtype"] != b["dtype"] else []
        if a["sparse_opt"] != b["sparse_opt"] and saved["sparse_optimizer"] == now["sparse_optimizer"]:
            what.append(f"sparse optimizer state {a['sparse_opt']} -> {b['sparse_opt']}")
        if what:
            out.append(f"stacked group {g}: {', '.join(what)}")
    return out


def dense_leaves(state) -> tuple[list[str], list, Any]:
    """Tree paths, leaves and treedef of (dense_params, dense_opt_state)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path((state.dense_params, state.dense_opt_state))
    return [jax.tree_util.keystr(p) for p, _ in with_paths], [leaf for _, leaf in with_paths], treedef


def dense_values(top: Mapping, meta: Mapping) -> list[np.ndarray]:
    """The dense leaves of a state item in tree order, the empty ones (not stored) rebuilt from meta's shapes."""
    return [top["dense"][f"{i:05d}"] if f"{i:05d}" in top.get("dense", {}) else np.zeros(shape, dtype)
            for i, (dtype, shape) in enumerate(meta["dense_shapes"])]
