"""Collection-level planning: the config's `embedding` section -> one `TableSpec` per sparse feature.

Config layout (an ml_collections.ConfigDict or a plain dict):

    config.embedding.dim = 16              # D, the width every feature embeds to (the MD base dim)
    config.embedding.method = "qr"         # default method for every table (compression/registry.py)
    config.embedding.options = ConfigDict({"collisions": 4, "op": "mult", "threshold": 200})
                                           # that method's knobs; threshold: tables with vocab_size <= threshold
                                           # stay full (the reference's `n > --qr-threshold` test)
    config.embedding.tables = ConfigDict({ # optional per-feature overrides
        "C3": ConfigDict({"method": "hashing", "options": ConfigDict({"buckets": 100_000})}),
        "C7": ConfigDict({"options": ConfigDict({"collisions": 16})}),   # same method, options merged
    })
    config.embedding.id_counts = ""        # per-id counts for md_blocks: "" (none), "dataset" or an .npz path
                                           # (read by recjax.train.table_specs, passed here as `id_counts`)
    config.embedding.pooling = "sum"

An override that names a different method starts from empty options (knobs do not carry across methods); one
that keeps the method merges its options over the defaults.

Methods and their options (each method rejects keys it does not take):
    full         -
    hashing      buckets | collisions, hash ("universal" | "modulo"), seed, sign
    qr           collisions (m), op ("concat" | "add" | "mult"), init ("bounded" | "reference")
    mixed_radix  radices | partitions, op
    crt          moduli, op
    qr_path      collisions, hidden, transform_by ("remainder" | "quotient")
                 (the qr family and tt also take row_decay (0): the multiple of optimizer.sparse.weight_decay
                 their factor rows take, compression/base.py FACTOR_ROW_DECAY)
    md           alpha (0.3), budget (0: base-dim mode), round_pow2, dim (fixes this table's dim)
    md_blocks    alpha, blocks, round_pow2 (counts come from `id_counts`)
    tt           cores (3), rank (8) | ranks, vocab_factors, dim_factors (TT-Rec, compression/tt.py)
    fiited       keep (0.25), chunks (gcd(16, D)), utility ("gradient" | "magnitude"), decay (1.0), interval (0:
                 auto), ramp (0.3), ramp_shape ("geometric" | "linear"), compact_slack (1.0), grow_init ("zeros" |
                 "uniform"), position_discount (3), score ("row" | "chunk"), fallback (0: the share of the kept
                 values in a hashed table every id also reads), seed (0: its hash), capacity
                 (compression/fiited.py)
    row_prune    as fiited, with chunks 1 and utility "magnitude"
    uniform_dim  keep (0.25): every row round(keep D) wide, zero tail
Every method also takes `threshold` (default 0: compress every table).

Mixed dims ("md") depend on every table, so they are solved here over all tables whose method is "md":
base-dim mode (budget 0) is the reference's md_solver anchored at D over all md tables, including those kept
full by the threshold (as the reference, which applies md_solver to every table); budget mode picks the largest
lambda whose rounded dims keep the md tables' params (rows + projections, full tables included) <= budget.
The knobs alpha, budget and round_pow2 must agree across md tables; a table's own `dim` takes it out of the rule.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np
from ml_collections.config_dict import placeholder

from compression.base import TableSpec
from compression.mixed_dim import DEFAULT_ALPHA, md_budget_dims, md_budget_floor, md_dims, projection_params
from compression.registry import METHODS

MD_GROUP_KNOBS = {"alpha": DEFAULT_ALPHA, "budget": 0, "round_pow2": False}

# Every option any method takes, with its type. Configs declare them as unset ml_collections placeholders
# (`option_placeholders()`), because config_flags cannot add keys from the command line: this makes
# `--config.embedding.method=qr --config.embedding.options.collisions=4` work while a misspelt key still fails.
# Unset (None) options are dropped before they reach a method.
OPTION_TYPES: dict[str, type] = {
    "threshold": int, "buckets": int, "collisions": float, "hash": str, "seed": int, "sign": bool, "op": str,
    "radices": tuple, "partitions": int, "moduli": tuple, "hidden": int, "transform_by": str, "alpha": float,
    "budget": int, "round_pow2": bool, "dim": int, "blocks": tuple, "cores": int, "rank": int, "ranks": tuple,
    "vocab_factors": tuple, "dim_factors": tuple, "init": str, "chunks": int, "keep": float, "capacity": int,
    "utility": str, "decay": float, "interval": int, "ramp": float, "compact_slack": float, "grow_init": str,
    "position_discount": float, "row_decay": float, "score": str, "ramp_shape": str,
}


def option_placeholders() -> ml_collections.ConfigDict:
    """`config.embedding.options` with every method knob declared and unset."""
    return ml_collections.ConfigDict({k: placeholder(t) for k, t in OPTION_TYPES.items()})


def _set_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Drop unset (None) options; an integral float from the command line (collisions=4.0) becomes an int."""
    return {k: int(v) if isinstance(v, float) and v.is_integer() else v
            for k, v in options.items() if v is not None}


def _plain(x: Any) -> Any:
    """ConfigDicts (and nested mappings) -> plain dicts; everything else unchanged."""
    if hasattr(x, "to_dict"):
        x = x.to_dict()
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    return x


def resolve_methods(names: Sequence[str], embedding: Mapping) -> list[tuple[str, dict]]:
    """(method, options) per table: the defaults, then `embedding.tables[name]` overrides."""
    embedding = _plain(embedding)
    default_method = embedding.get("method", "full")
    default_options = _set_options(embedding.get("options") or {})
    overrides = embedding.get("tables") or {}
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(f"config.embedding.tables names unknown feature(s) {unknown}; features are {list(names)}")
    resolved = []
    for name in names:
        method, options = default_method, dict(default_options)
        override = overrides.get(name) or {}
        bad_keys = sorted(set(override) - {"method", "options"})
        if bad_keys:
            raise ValueError(f"config.embedding.tables.{name} has key(s) {bad_keys}; it takes 'method' and 'options'")
        if "method" in override and override["method"] != method:
            method, options = override["method"], {}
        options.update(_set_options(override.get("options") or {}))
        if method not in METHODS:
            raise ValueError(f"table '{name}': unknown embedding method '{method}'; known: {sorted(METHODS)}")
        resolved.append((method, options))
    return resolved


def plan_tables(names: Sequence[str], vocab_sizes: Sequence[int], base_dim: int, embedding: Mapping,
                id_counts: Mapping[str, np.ndarray] | None = None) -> list[TableSpec]:
    """One TableSpec per feature from `config.embedding` (see the module docstring for the layout).

    Args:
      names, vocab_sizes: the sparse features in model order.
      base_dim: D, every feature's output width.
      embedding: `config.embedding` (ConfigDict or dict): method, options, tables.
      id_counts: {feature: f64[vocab_size]} per-id counts, needed by md_blocks tables.
    """
    if len(names) != len(vocab_sizes):
        raise ValueError(f"{len(names)} feature names but {len(vocab_sizes)} vocab sizes")
    resolved = resolve_methods(names, embedding)
    specs: list[TableSpec | None] = [None] * len(names)
    md_rule, md_fixed, md_knobs = [], [], {}  # md tables solved by the rule / with fixed params; their knobs

    for i, (name, n, (method, options)) in enumerate(zip(names, vocab_sizes, resolved, strict=True)):
        threshold = options.pop("threshold", 0)
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"table '{name}': options.threshold must be an integer >= 0, got {threshold!r}")
        under_threshold = n <= threshold
        if method == "md":
            knobs = {k: options.pop(k, v) for k, v in MD_GROUP_KNOBS.items()}
            for k, v in knobs.items():
                if md_knobs.setdefault(k, (v, name))[0] != v:
                    first, where = md_knobs[k]
                    raise ValueError(f"md option '{k}' must be the same for every md table (dims are solved "
                                     f"jointly): table '{where}' has {first!r}, table '{name}' has {v!r}")
            leftover = sorted(set(options) - {"dim"})
            if leftover:
                raise ValueError(f"table '{name}': method 'md' has no option(s) {leftover}; it takes "
                                 f"{sorted([*MD_GROUP_KNOBS, 'dim', 'threshold'])}")
            if "dim" in options:
                md_fixed.append(i)
            else:
                md_rule.append(i)
        if under_threshold:
            specs[i] = TableSpec(name, n, base_dim, "full", {})
        elif method == "md_blocks":
            if "counts" not in options:
                if not id_counts or name not in id_counts:
                    raise ValueError(f"table '{name}': md_blocks needs per-id counts; set config.embedding.id_counts "
                                     "to 'dataset' (the dataset's expected counts) or to an .npz with one array per "
                                     "feature")
                options["counts"] = np.asarray(id_counts[name])
            specs[i] = TableSpec(name, n, base_dim, method, options)
        elif method != "md":
            specs[i] = TableSpec(name, n, base_dim, method, options)

    if md_rule or md_fixed:
        _plan_mixed_dims(names, vocab_sizes, base_dim, resolved, specs, md_rule, md_fixed, md_knobs)
    assert all(s is not None for s in specs)
    return specs


def _plan_mixed_dims(names, vocab_sizes, base_dim, resolved, specs, md_rule, md_fixed, md_knobs) -> None:
    """Fill in the md tables' specs (in place) with dims from the power rule or the budget."""
    alpha = float(md_knobs["alpha"][0])
    budget = int(md_knobs["budget"][0])
    round_pow2 = bool(md_knobs["round_pow2"][0])
    for i in md_fixed:
        if specs[i] is None:
            specs[i] = TableSpec(names[i], vocab_sizes[i], base_dim, "md", {"dim": resolved[i][1]["dim"]})
    if md_rule and budget > 0:
        # Budget over every md table: those kept full and those with a fixed dim are fixed costs.
        fixed = sum(vocab_sizes[i] * base_dim for i in md_rule if specs[i] is not None)
        for i in md_fixed:
            if specs[i].method == "full":
                fixed += vocab_sizes[i] * base_dim
            else:
                d = specs[i].options["dim"]
                fixed += vocab_sizes[i] * d + projection_params((d,), base_dim)
        solve = [i for i in md_rule if specs[i] is None]
        if solve:
            try:
                dims = md_budget_dims([vocab_sizes[i] for i in solve], alpha, base_dim, budget, round_pow2, fixed)
            except ValueError as error:  # below the floor: say how far md can go on these tables
                full = sum(vocab_sizes[i] for i in (*md_rule, *md_fixed)) * base_dim
                floor = md_budget_floor([vocab_sizes[i] for i in solve], base_dim, fixed)
                raise ValueError(f"{error}: the most md compresses these tables is {full / floor:.2f}x (full "
                                 f"{full:,} params), at embedding.dim {base_dim}") from None
            for i, d in zip(solve, dims, strict=True):
                specs[i] = TableSpec(names[i], vocab_sizes[i], base_dim, "md", {"dim": d})
        elif fixed > budget:
            raise ValueError(f"md budget {budget:,} is below the params of the md tables kept full ({fixed:,})")
    elif md_rule:
        # Base-dim mode: the reference's md_solver over every md table, thresholded ones included.
        dims = md_dims([vocab_sizes[i] for i in md_rule], alpha, base_dim, round_pow2)
        for i, d in zip(md_rule, dims, strict=True):
            if specs[i] is None:
                specs[i] = TableSpec(names[i], vocab_sizes[i], base_dim, "md", {"dim": d})


def load_id_counts(path: str) -> dict[str, np.ndarray]:
    """Per-id counts from an .npz holding one f64[vocab_size] array per feature name."""
    with np.load(path) as data:
        return {k: np.asarray(data[k], np.float64) for k in data.files}


def md_blocks_params(name: str, vocab_size: int, counts: np.ndarray, base_dim: int, options: Mapping) -> int:
    """Params of one md_blocks table (block rows + projections) at base dim `base_dim`, from the method itself."""
    from compression.registry import build_method

    method = build_method(TableSpec(name, vocab_size, base_dim, "md_blocks", {**options, "counts": counts}))
    return sum(t.params for t in method.physical_tables()) + method.glue_params()


def md_blocks_base_dim(counts: Mapping[str, np.ndarray], budget: float, max_dim: int,
                       options: Mapping | None = None) -> int:
    """The largest base dim d0 in [1, max_dim] at which the md_blocks tables of `counts` ({feature: f64[vocab_size]}
    per-id counts) take at most `budget` params: with md_blocks the hottest block is d0 wide and the others follow
    Ginart et al.'s power rule from it, so for a given temperature (`options.alpha`) the base dim is the knob that
    sets the size. A ValueError saying the largest ratio md_blocks reaches (every block at dim 1, d0 = 1) when
    even that exceeds the budget."""
    options = {k: v for k, v in (options or {}).items() if k != "counts"}

    def params(d0: int) -> int:
        return sum(md_blocks_params(name, len(c), np.asarray(c), d0, options) for name, c in counts.items())

    if params(1) > budget:
        full = sum(len(c) for c in counts.values()) * max_dim
        raise ValueError(f"md_blocks cannot fit {budget:,.0f} params: at base dim 1 (every block 1 wide) its tables "
                         f"take {params(1):,}, {full / params(1):.2f}x fewer than full tables at dim {max_dim}")
    # Params grow with d0 but for the projections a block drops when it reaches d0, so scan rather than bisect.
    return max(d0 for d0 in range(1, max_dim + 1) if params(d0) <= budget)
