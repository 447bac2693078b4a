"""One validation pass over a resolved config before any work: types, ranges, mutually exclusive keys, model and
embedding shapes that must agree, and the data directory's contents.

Every problem is a `ConfigError` naming the dotted key (`train.steps: must be a whole number >= 1, got 0`), which
the launchers print as one line. `train_and_evaluate` calls `validate_config` first, so programmatic callers
(sweeps, notebooks) get the same messages. Checks that need the data's spec (a table plan, a cross layer's rank
against its width) run when the task is built and are turned into ConfigErrors by `config_errors`.
"""

import contextlib
import dataclasses
import math
import numbers
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_collections

from recjax.errors import ConfigError

MODEL_NAMES = ("dlrm", "dcnv2", "wukong", "lr", "fm")
DENSE_OPTIMIZERS = ("sgd", "adam", "adagrad")
DECAYS = ("none", "cosine")
SELECT_ON = ("auc", "logloss")
POOLINGS = ("sum", "mean")
TRAIN_KEYS = {"batch_size", "steps", "epochs", "eval_every", "log_every", "early_stopping_patience", "select_on",
              "progress_bar"}
EPOCH_EVERY = re.compile(r"^\s*(\d*\.?\d*)\s*epochs?\s*$")  # "epoch", "0.25epoch", "2 epochs"


# ------------------------------------------------------------------------------------------- value checks
def _get(config: Mapping, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node:
            raise ConfigError(key, "is missing from the config; add it (see experiments/configs/common.py)")
        node = node[part]
    return node


def check_integer(key: str, value: Any, minimum: int | None = None, below: int | None = None) -> int:
    """`value` as an int, or a ConfigError naming `key` (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        bounds = _range(minimum) + ("" if below is None else f" and < {below}")
        raise ConfigError(key, f"must be a whole number{bounds}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}")
    if below is not None and value >= below:
        raise ConfigError(key, f"must be < {below}, got {value}")
    return int(value)


def _range(minimum) -> str:
    return "" if minimum is None else f" >= {minimum}"


def check_number(key: str, value: Any, *, above: float | None = None, at_least: float | None = None,
                 below: float | None = None, optional: bool = False) -> float | None:
    """`value` as a finite float within the bounds (None allowed if `optional`), or a ConfigError naming `key`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    if above is not None and not value > above:
        raise ConfigError(key, f"must be > {above}, got {value}")
    if at_least is not None and not value >= at_least:
        raise ConfigError(key, f"must be >= {at_least}, got {value}")
    if below is not None and not value < below:
        raise ConfigError(key, f"must be < {below}, got {value}")
    return float(value)


def check_choice(key: str, value: Any, options: Sequence[str]) -> str:
    if value not in options:
        raise ConfigError(key, f"unknown value {value!r}; use one of {list(options)}")
    return value


def check_boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be True or False, got {value!r}")
    return value


def check_text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(key, f"must be a string, got {value!r}")
    return value


def integer(config: Mapping, key: str, minimum: int | None = None) -> int:
    return check_integer(key, _get(config, key), minimum)


def number(config: Mapping, key: str, *, above: float | None = None, at_least: float | None = None,
           below: float | None = None) -> float:
    return check_number(key, _get(config, key), above=above, at_least=at_least, below=below)


def choice(config: Mapping, key: str, options: Sequence[str]) -> str:
    return check_choice(key, _get(config, key), options)


def boolean(config: Mapping, key: str) -> bool:
    return check_boolean(key, _get(config, key))


def widths(config: Mapping, key: str, *, allow_empty: bool = False) -> tuple[int, ...]:
    value = _get(config, key)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = (value,)  # "--config.model.dlrm.top_mlp=1" parses as one int
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(
            isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= 1 for w in value):
        raise ConfigError(key, f"must be a tuple of layer widths >= 1, got {value!r}")
    if not value and not allow_empty:
        raise ConfigError(key, "must have at least one layer width")
    return tuple(int(w) for w in value)


def known_keys(config: Mapping, key: str, allowed: set[str]) -> None:
    section = _get(config, key)
    unknown = sorted(set(section.keys()) - allowed)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", f"is not a known field; {key} has {sorted(allowed)}")


@contextlib.contextmanager
def config_errors(key: str) -> Iterator[None]:
    """Re-raise a ValueError from building the task (planning tables, a model's own checks) as a ConfigError
    under `key`, so the launcher reports it in one line instead of a traceback."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(key, str(error)) from error


# ------------------------------------------------------------------------------------------------ sections
def eval_interval(value: Any) -> tuple[str, float]:
    """train.eval_every -> ("steps", n) or ("epochs", fraction of an epoch)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError("train.eval_every", f"must be >= 1 steps or 'epoch', got {value}")
        return "steps", int(value)
    if isinstance(value, str):
        if value.strip().isdigit():
            return eval_interval(int(value))
        match = EPOCH_EVERY.match(value)
        if match:
            fraction = float(match.group(1)) if match.group(1) not in ("", ".") else 1.0
            if fraction > 0:
                return "epochs", fraction
    raise ConfigError("train.eval_every", f"must be a number of steps >= 1, 'epoch' or e.g. '0.25epoch', got "
                                          f"{value!r}")


def check_train(config: Mapping) -> None:
    known_keys(config, "train", TRAIN_KEYS)
    integer(config, "train.batch_size", 1)
    steps, epochs = _get(config, "train.steps"), _get(config, "train.epochs")
    if (steps is None) == (epochs is None):
        both = "both are set" if steps is not None else "neither is set"
        raise ConfigError("train.steps", f"set exactly one of train.steps and train.epochs ({both}: steps={steps!r}, "
                                         f"epochs={epochs!r}); e.g. --config.train.epochs=None "
                                         "--config.train.steps=1000")
    if steps is not None:
        integer(config, "train.steps", 1)
    else:
        number(config, "train.epochs", above=0)
    unit, _ = eval_interval(_get(config, "train.eval_every"))
    integer(config, "train.log_every", 1)
    integer(config, "train.early_stopping_patience", 0)
    choice(config, "train.select_on", SELECT_ON)
    boolean(config, "train.progress_bar")
    if _get(config, "data.name") == "synthetic" and (epochs is not None or unit == "epochs"):
        raise ConfigError("train.epochs" if epochs is not None else "train.eval_every",
                          "synthetic data is an endless stream without epochs; set train.steps and an eval_every "
                          "in steps")


def check_optimizer(config: Mapping) -> None:
    from recjax.sparse_optim import SPARSE_OPTIMIZERS

    known_keys(config, "optimizer", {"dense", "sparse", "warmup_steps", "decay"})
    known_keys(config, "optimizer.dense", {"name", "learning_rate", "weight_decay"})
    choice(config, "optimizer.dense.name", DENSE_OPTIMIZERS)
    number(config, "optimizer.dense.learning_rate", above=0)
    number(config, "optimizer.dense.weight_decay", at_least=0)
    name = choice(config, "optimizer.sparse.name", sorted(SPARSE_OPTIMIZERS))
    number(config, "optimizer.sparse.learning_rate", above=0)
    number(config, "optimizer.sparse.weight_decay", at_least=0)
    known_keys(config, "optimizer.sparse", {"name"} | {f.name for f in dataclasses.fields(SPARSE_OPTIMIZERS[name])})
    integer(config, "optimizer.warmup_steps", 0)
    choice(config, "optimizer.decay", DECAYS)


def check_embedding(config: Mapping) -> None:
    from compression.registry import METHODS

    integer(config, "embedding.dim", 1)
    choice(config, "embedding.method", sorted(METHODS))
    choice(config, "embedding.pooling", POOLINGS)
    if "bounds_check" in _get(config, "embedding"):
        choice(config, "embedding.bounds_check", ("zero", "error", "off"))
    if "kernel" in _get(config, "embedding"):
        choice(config, "embedding.kernel", ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu"))
    if "pool_from" in _get(config, "embedding"):
        choice(config, "embedding.pool_from", ("auto", "distinct_rows", "table"))
    if "dedup" in _get(config, "embedding"):
        choice(config, "embedding.dedup", ("auto", "always"))


def check_model(config: Mapping) -> None:
    from recjax.models import model_fields

    name = choice(config, "model.name", MODEL_NAMES)
    key = f"model.{name}"
    section = _get(config, key)
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


def check_sharding(config: Mapping) -> None:
    """`mesh` and `sharding` (both optional: a config without them runs on every device with the defaults). The
    mesh against the device count, the table names and the memory fit are checked when the plan is made, before
    any compile (recjax/sharding)."""
    from recjax.sharding.mesh import parse_mesh_shape
    from recjax.sharding.plan import EXCHANGE_DTYPES, PLANS, ROW_AXES, ROW_SPLITS

    if "mesh" in config:
        known_keys(config, "mesh", {"shape"})
        parse_mesh_shape(_get(config, "mesh.shape"))
    if "sharding" in config:
        known_keys(config, "sharding", {"plan", "tables", "row_axes", "row_split", "exchange_dtype",
                                        "device_memory_bytes", "capacity_factor", "capacity_sigmas"})
        choice(config, "sharding.plan", PLANS)
        check_text("sharding.tables", _get(config, "sharding.tables"))
        choice(config, "sharding.row_axes", ROW_AXES)
        choice(config, "sharding.row_split", ROW_SPLITS)
        choice(config, "sharding.exchange_dtype", EXCHANGE_DTYPES)
        integer(config, "sharding.device_memory_bytes", 0)
        if "capacity_factor" in _get(config, "sharding"):
            factor = number(config, "sharding.capacity_factor", at_least=0.0)
            if 0 < factor < 1:
                raise ConfigError("sharding.capacity_factor", f"must be 0 (always the worst case) or >= 1, got "
                                                              f"{factor}")
        if "capacity_sigmas" in _get(config, "sharding"):
            number(config, "sharding.capacity_sigmas", at_least=0.0)


def check_data(config: Mapping) -> None:
    from recjax.data import check_data_config

    check_data_config(_get(config, "data"))


def check_checkpoint(config: Mapping) -> None:
    from recjax.checkpoint import check_checkpoint_config

    check_checkpoint_config(config)


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Raise a ConfigError naming the first bad key of `config`; return None if it can run."""
    integer(config, "seed", 0)
    check_train(config)
    check_checkpoint(config)
    check_optimizer(config)
    check_embedding(config)
    check_model(config)
    check_sharding(config)
    check_data(config)
