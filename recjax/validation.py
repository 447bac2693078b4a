"""Checking config values: the helpers every section's validator uses (a leaf module; it imports only errors).

Each helper returns the value, converted, or raises a `ConfigError` naming the dotted key (`train.steps: must be
>= 1, got 0`), which the launchers print as one line. Each config section is validated next to the code that owns
it (`check_train` beside the budget, `check_model` beside the model registry, ...); `recjax/config_check.py` runs
them all, in order, before any work.
"""

import contextlib
import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from recjax.errors import ConfigError

MISSING = object()  # what `find` returns for a key the config lacks (None is a value configs hold)


def find(config: Mapping, key: str, default: Any = None) -> Any:
    """`config[key]` for a dotted key, or `default` when some part of it is missing."""
    node: Any = config
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node:
            return default
        node = node[part]
    return node


def get(config: Mapping, key: str) -> Any:
    """`config[key]` for a dotted key, or a ConfigError saying it is missing."""
    value = find(config, key, MISSING)
    if value is MISSING:
        raise ConfigError(key, "is missing from the config; add it (see experiments/configs/common.py)")
    return value


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
    return check_integer(key, get(config, key), minimum)


def number(config: Mapping, key: str, *, above: float | None = None, at_least: float | None = None,
           below: float | None = None) -> float:
    return check_number(key, get(config, key), above=above, at_least=at_least, below=below)


def choice(config: Mapping, key: str, options: Sequence[str]) -> str:
    return check_choice(key, get(config, key), options)


def boolean(config: Mapping, key: str) -> bool:
    return check_boolean(key, get(config, key))


def widths(config: Mapping, key: str, *, allow_empty: bool = False) -> tuple[int, ...]:
    value = get(config, key)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = (value,)  # "--config.model.dlrm.top_mlp=1" parses as one int
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(
            isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= 1 for w in value):
        raise ConfigError(key, f"must be a tuple of layer widths >= 1, got {value!r}")
    if not value and not allow_empty:
        raise ConfigError(key, "must have at least one layer width")
    return tuple(int(w) for w in value)


def known_keys(config: Mapping, key: str, allowed: set[str]) -> None:
    section = get(config, key)
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
