"""Ranking models. Each takes (dense f32[B, num_dense], embeddings f32[B, F, D]) and returns logits f32[B]."""

import ml_collections

from recjax.models.dcnv2 import DCNv2
from recjax.models.dlrm import DLRM
from recjax.models.linear import FactorizationMachine, LogisticRegression
from recjax.models.wukong import Wukong


def make_model(config: ml_collections.ConfigDict):
    """The Flax module named by `config.name`, built from the remaining fields."""
    kwargs = dict(config)
    name = kwargs.pop("name")
    models = {"dlrm": DLRM, "logistic_regression": LogisticRegression, "fm": FactorizationMachine, "wukong": Wukong,
              "dcnv2": DCNv2}
    if name not in models:
        raise ValueError(f"unknown model '{name}'; known: {sorted(models)}")
    return models[name](**{k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()})


__all__ = ["DCNv2", "DLRM", "FactorizationMachine", "LogisticRegression", "Wukong", "make_model"]
