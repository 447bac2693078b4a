"""The config sections every dataset config shares: embeddings, every model family, optimizers and the budget.

Each dataset config (`dlrm_movielens.py`, `dlrm_criteo_kaggle.py`, ...) builds its sections with these functions
and overrides what its data needs, so `--config.model.name=lr` (or fm, dcnv2, wukong) runs on every config and
every knob has one name everywhere. `recjax/config_check.py` validates the result before a run starts.

Learning rates and regularisation are tuned for one model family (`model.tuned_for`): a row L2 that DLRM needs on
MovieLens costs logistic regression test AUC (benchmarks/RESULTS.md, model swaps). So a model swap goes through
`swap_model`, which brings the values the config tuned for the new family (`config.model_defaults`, built by
`model_defaults`), or says which values were tuned for another family when the config has none for it.
"""

from collections.abc import Collection, Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from compression.plan import option_placeholders
from recjax.sections import (
    CheckpointSection,
    DenseOptimizerSection,
    EmbeddingSection,
    MeshSection,
    OptimizerSection,
    ShardingSection,
    TieringSection,
    TrainSection,
    config_section,
)

# What a config tunes per model family: `model_defaults` records these (and any key another family's entry sets) for
# the config's own family, and a swap to a family without an entry names them.
FAMILY_KEYS = ("optimizer.dense.learning_rate", "optimizer.dense.weight_decay", "optimizer.sparse.learning_rate",
               "optimizer.sparse.weight_decay")


def flexible(value=None) -> config_dict.FieldReference:
    """A field that may hold None, a number or a string (e.g. train.eval_every = 500 or "epoch"), so the command
    line can set any of them (`--config.train.steps=None`); recjax/config_check.py checks the value."""
    return config_dict.FieldReference(value, field_type=object)


# The runtime sections' fields, defaults and one comment per field are in recjax/sections.py (defined once: the runtime
# reads these sections as those dataclasses); the functions below build a config's sections from them.
def embedding_config(dim: int, pooling: str = "sum") -> ml_collections.ConfigDict:
    """`config.embedding` (recjax/sections.py `EmbeddingSection`); every compression option is listed, unset."""
    return config_section(EmbeddingSection, dim=dim, pooling=pooling, options=option_placeholders())


def mesh_config() -> ml_collections.ConfigDict:
    """`config.mesh` (recjax/sections.py `MeshSection`): one device unless `shape` says otherwise."""
    return config_section(MeshSection)


def sharding_config() -> ml_collections.ConfigDict:
    """`config.sharding` (recjax/sections.py `ShardingSection`): where the tables live on a mesh."""
    return config_section(ShardingSection)


def tiering_config() -> ml_collections.ConfigDict:
    """`config.tiering` (recjax/sections.py `TieringSection`): the storage of each table's rows (memory, host or disk
    behind a RAM cache); its checkpoints are the in-memory run's, and a baseline is read and written a block of rows
    at a time."""
    return config_section(TieringSection)


def model_config(name: str, dim: int) -> ml_collections.ConfigDict:
    """`model.name` picks the family; each family's knobs live in its own sub-config, sized here for embedding
    dim `dim` (DLRM's dot interaction needs the bottom MLP to end in `dim`)."""
    model = ml_collections.ConfigDict()
    model.name = name  # "dlrm", "dcnv2", "wukong", "lr" (logistic regression), "fm" (factorization machine) or
    # "mf" (matrix factorisation: two sparse features, e.g. MovieLens with data.features="user_item")
    # The family the config's learning rates and regularisation were tuned for; a --config.model.name swap to another
    # brings config.model_defaults' values for it (`swap_model`).
    model.tuned_for = name

    model.dlrm = ml_collections.ConfigDict()
    model.dlrm.bottom_mlp = (64, dim)  # widths on the dense features; the last must equal embedding.dim (dot)
    model.dlrm.top_mlp = (64, 1)  # widths after the interaction; ends in 1 (the logit)
    model.dlrm.interaction = "dot"  # "dot" or "cat"
    model.dlrm.self_interaction = False  # dot: also keep <x_i, x_i>
    model.dlrm.dropout = 0.0  # rate after each hidden ReLU of both MLPs while training

    model.dcnv2 = ml_collections.ConfigDict()
    model.dcnv2.bottom_mlp = (64, dim)  # widths (ReLU) of the dense-feature MLP; x_0 = [bottom out, F * dim]
    model.dcnv2.num_cross_layers = 3  # L, cross layers x_{l+1} = x_0 * (W x_l + b) + x_l
    model.dcnv2.low_rank = 64  # r of W = U V^T; 0 = full rank W [M, M]
    model.dcnv2.structure = "stacked"  # "stacked" (cross then deep) or "parallel" (cross || deep)
    model.dcnv2.deep_mlp = (256, 64)  # widths (ReLU) of the deep network; a final linear layer gives the logit
    model.dcnv2.dropout = 0.0  # rate after each hidden ReLU of the MLPs while training

    model.wukong = ml_collections.ConfigDict()
    model.wukong.num_layers = 2  # l, stacked Wukong layers
    model.wukong.fmb_embeddings = 16  # n_F, embeddings out of each Factorization Machine Block
    model.wukong.lcb_embeddings = 16  # n_L, embeddings out of each Linear Compression Block
    model.wukong.fm_rank = 8  # k, rank of the optimized FM X (X^T Y), Y [n, k]
    model.wukong.fmb_mlp_depth = 2  # Dense layers in each FMB MLP (the last outputs n_F * dim)
    model.wukong.fmb_mlp_width = 128  # hidden width of each FMB MLP
    model.wukong.top_mlp = (256, 64, 1)  # widths on the flattened last layer [n_F + n_L, dim]; ends in 1
    model.wukong.num_dense_embeddings = 2  # dim-wide embeddings made from the dense features
    model.wukong.dense_mlp = (64,)  # hidden widths before the linear map to num_dense_embeddings * dim
    model.wukong.dropout = 0.0  # rate after each hidden ReLU of the MLPs while training

    model.lr = ml_collections.ConfigDict()  # logistic regression: no knobs; each id's weight is a 1-d embedding
    model.fm = ml_collections.ConfigDict()  # factorization machine: embedding.dim - 1 factors per id (+ its weight)
    model.mf = ml_collections.ConfigDict()  # matrix factorisation: mu + <user, item> (two sparse features, no dense)
    return model


def optimizer_config(dense: str, dense_lr: float, sparse: str, sparse_lr: float, *, decay: str = "none"
                     ) -> ml_collections.ConfigDict:
    """`config.optimizer` (recjax/sections.py `OptimizerSection`). The sparse optimizer's fields are its dataclass's
    in recjax/sparse_optim.py (name, learning_rate, weight_decay: L2 on the embedding rows a step touches, lazy, once
    per row per step; and its own, e.g. lazy_adam's b1, b2, eps)."""
    optimizer = config_section(OptimizerSection, dense=DenseOptimizerSection(dense, dense_lr),
                               sparse={"name": sparse, "learning_rate": sparse_lr, "weight_decay": 0.0}, decay=decay)
    return optimizer


def train_config(*, batch_size: int, steps: int | None = None, epochs: float | None = None,
                 eval_every: int | str = "epoch", log_every: int = 100, patience: int = 0
                 ) -> ml_collections.ConfigDict:
    """`config.train` (recjax/sections.py `TrainSection`): the budget, evaluation, selection and the run's guards."""
    return config_section(TrainSection, batch_size=batch_size, steps=steps, epochs=epochs, eval_every=eval_every,
                          log_every=log_every, early_stopping_patience=patience)


def checkpoint_config() -> ml_collections.ConfigDict:
    """`config.checkpoint` (recjax/sections.py `CheckpointSection`): Orbax checkpoints of the whole run, on by
    default: re-running in the same workdir resumes from the latest complete checkpoint."""
    return config_section(CheckpointSection)


# ------------------------------------------------------------------------------------------------ model swaps
def _flat(section: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optimizer": {"sparse": {"weight_decay": 0.0}}} -> {"optimizer.sparse.weight_decay": 0.0}."""
    out = {}
    for key, value in section.items():
        if hasattr(value, "items"):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _get(config: ml_collections.ConfigDict, key: str) -> Any:
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def _set(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[leaf] = value


def model_defaults(config: ml_collections.ConfigDict, **families: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """`config.model_defaults`: {family: {dotted key: value}} as nested sections, the values this config tuned for
    each family, e.g. `model_defaults(config, lr={"optimizer.sparse.weight_decay": 0.0})`. Every entry covers the
    same keys, FAMILY_KEYS and every key some family sets: what a family does not set is the config's current value,
    and the config's own family (`model.tuned_for`) gets all its current values, so a config derived from this one
    for another family swaps back to exactly this one."""
    keys = dict.fromkeys([*FAMILY_KEYS, *(key for entry in families.values() for key in entry)])
    own = {key: _get(config, key) for key in keys}
    defaults = ml_collections.ConfigDict()
    for family, entry in {config.model.tuned_for: {}, **families}.items():
        defaults[family] = ml_collections.ConfigDict()
        for key, value in {**own, **entry}.items():
            node = defaults[family]
            *parents, leaf = key.split(".")
            for part in parents:
                if part not in node:
                    node[part] = ml_collections.ConfigDict()
                node = node[part]
            node[leaf] = value
    return defaults


def _explicit(key: str, explicit: Collection[str]) -> bool:
    return any(key == e or key.startswith(f"{e}.") for e in explicit)


def swap_model(config: ml_collections.ConfigDict, name: str, explicit: Collection[str] = ()) -> list[str]:
    """Make `name` the model of `config`, with the learning rates and regularisation the config tuned for it.

    If `name` is not the family the config was tuned for (`model.tuned_for`) and `config.model_defaults` has an entry
    for it, the entry's values replace the config's, but for keys in `explicit` (what the user set: command-line
    overrides, a sweep's grid), and `model.tuned_for` becomes `name`. Without an entry the values stay. Returns the
    lines to print: what the swap changed and kept, or a WARNING naming the values tuned for another family (none
    when `name` is the family the config was tuned for).
    """
    config.model.name = name
    tuned_for = config.model.get("tuned_for", name)
    if name == tuned_for:
        return []
    defaults = config.get("model_defaults") or {}
    if name not in defaults:
        keys = dict.fromkeys([*FAMILY_KEYS, *(k for entry in defaults.values() for k in _flat(entry))])
        values = ", ".join(f"{k}={_get(config, k)!r}" for k in keys if not _explicit(k, explicit))
        if not values:
            return []
        return [f"WARNING: model.name={name}: this config's learning rates and regularisation were tuned for "
                f"{tuned_for} and it has no {name} defaults (config.model_defaults), so {name} trains with "
                f"{tuned_for}'s {values}; set them on the command line or tune them (experiments.sweep_models --grid)"]
    changed, kept = [], []
    for key, value in _flat(defaults[name]).items():
        if _explicit(key, explicit):
            kept.append(f"{key}={_get(config, key)!r}")
        elif _get(config, key) != value:
            changed.append(f"{key} {_get(config, key)!r} -> {value!r}")
            _set(config, key, value)
    config.model.tuned_for = name
    return [f"model.name={name}: this config's {name} defaults replace those it tuned for {tuned_for} "
            f"(config.model_defaults.{name}): {', '.join(changed) or 'no value differs'}"
            + (f"; kept as set explicitly: {', '.join(kept)}" if kept else "")]
