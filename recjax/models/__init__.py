"""Ranking models. Each takes (dense f32[B, num_dense], embeddings f32[B, F, D], train) and returns logits f32[B]
(or, on a rating dataset, the predicted ratings: the objective decides, recjax/task.py).

`config.model.name` picks the family and `config.model.<name>` holds its knobs (experiments/configs/common.py),
so every dataset config can swap models from the command line (`--config.model.name=lr`).
"""

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import ml_collections

from recjax.errors import ConfigError
from recjax.models.dcnv2 import DCNv2
from recjax.models.dlrm import DLRM
from recjax.models.linear import FactorizationMachine, LogisticRegression
from recjax.models.mf import MatrixFactorization
from recjax.models.wukong import Wukong
from recjax.validation import boolean, choice, get, integer, known_keys, number, widths

MODELS: dict[str, type[nn.Module]] = {
    "dlrm": DLRM,
    "dcnv2": DCNv2,
    "wukong": Wukong,
    "lr": LogisticRegression,
    "fm": FactorizationMachine,
    "mf": MatrixFactorization,
}
# Fields set from the embedding dim rather than the config: an FM's factors are the embedding minus its weight.
DERIVED_FIELDS = {"fm": {"factor_dim"}}


def model_fields(name: str) -> tuple[set[str], set[str]]:
    """(every config field of model `name`, the ones without a default)."""
    fields = [f for f in dataclasses.fields(MODELS[name]) if f.init and f.name not in ("parent", "name")
              and f.name not in DERIVED_FIELDS.get(name, ())]
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return {f.name for f in fields}, required


def check_model(config: Mapping) -> None:
    name = choice(config, "model.name", list(MODELS))
    key = f"model.{name}"
    section = get(config, key)
    fields, required = model_fields(name)
    known_keys(config, key, fields)
    missing = sorted(required - set(section.keys()))
    if missing:
        raise ConfigError(f"{key}.{missing[0]}", "is missing; see experiments/configs/common.py for the defaults")
    dim = integer(config, "embedding.dim", 1)
    if "dropout" in section:
        number(config, f"{key}.dropout", at_least=0, below=1)
    for field in ("bottom_mlp", "top_mlp", "deep_mlp", "dense_mlp"):
        if field in section:
            widths(config, f"{key}.{field}", allow_empty=field in ("deep_mlp", "dense_mlp"))
    if name == "dlrm":
        interaction = choice(config, "model.dlrm.interaction", ("dot", "cat"))
        bottom = widths(config, "model.dlrm.bottom_mlp")
        if interaction == "dot" and bottom[-1] != dim:
            raise ConfigError("model.dlrm.bottom_mlp", f"dot interaction needs the last width to equal embedding.dim "
                                                       f"({dim}), got {bottom}; e.g. --config.model.dlrm.bottom_mlp="
                                                       f"{','.join(map(str, bottom[:-1] + (dim,)))}")
        boolean(config, "model.dlrm.self_interaction")
    if name in ("dlrm", "wukong"):
        top = widths(config, f"{key}.top_mlp")
        if top[-1] != 1:
            raise ConfigError(f"{key}.top_mlp", f"must end in 1 (the logit), got {top}")
    if name == "dcnv2":
        integer(config, "model.dcnv2.num_cross_layers", 0)
        integer(config, "model.dcnv2.low_rank", 0)
        choice(config, "model.dcnv2.structure", ("stacked", "parallel"))
    if name == "wukong":
        for field in ("num_layers", "fmb_embeddings", "lcb_embeddings", "fm_rank", "fmb_mlp_depth", "fmb_mlp_width",
                      "num_dense_embeddings"):
            integer(config, f"model.wukong.{field}", 1)
    if name == "fm" and dim < 2:
        raise ConfigError("embedding.dim", f"fm needs embedding.dim >= 2 (an id's weight plus >= 1 factor), got {dim}")
    if "tuned_for" in get(config, "model"):
        choice(config, "model.tuned_for", list(MODELS))


def _leaves(section: Mapping, prefix: str = "") -> Iterator[str]:
    for key, value in section.items():
        if hasattr(value, "items"):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def check_model_defaults(config: Mapping) -> None:
    """`model_defaults` (optional; experiments/configs/common.py:model_defaults): model families, each with values
    for keys the config has."""
    if "model_defaults" not in config:
        return
    for family, entry in get(config, "model_defaults").items():
        if family not in MODELS:
            raise ConfigError(f"model_defaults.{family}", f"is not a model family; use some of {list(MODELS)}")
        for key in _leaves(entry):
            node: Any = config
            for part in key.split("."):
                if key.startswith("model_defaults.") or not hasattr(node, "keys") or part not in node:
                    raise ConfigError(f"model_defaults.{family}.{key}", f"sets {key}, which the config does not have")
                node = node[part]


def embedding_dim(config: ml_collections.ConfigDict) -> int:
    """The width the tables embed to: logistic regression's per-id weight is 1-d, others use embedding.dim."""
    return 1 if config.model.name == "lr" else int(config.embedding.dim)


def make_model(config: ml_collections.ConfigDict, embedding_dim: int) -> nn.Module:
    """The Flax module named by `config.name`, built from `config[config.name]`."""
    name = config.name
    if name not in MODELS:
        raise ValueError(f"unknown model '{name}'; known: {sorted(MODELS)}")
    kwargs = {k: tuple(v) if isinstance(v, list | tuple) else v for k, v in dict(config[name]).items()}
    if name == "fm":
        kwargs["factor_dim"] = embedding_dim - 1
    return MODELS[name](**kwargs)


__all__ = ["DCNv2", "DLRM", "FactorizationMachine", "LogisticRegression", "MODELS", "MatrixFactorization", "Wukong",
           "check_model",
           "check_model_defaults", "embedding_dim", "make_model", "model_fields"]
