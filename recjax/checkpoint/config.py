"""The `checkpoint` config section: its keys and checks, and which keys a resumed run may change."""

import json
from collections.abc import Mapping
from typing import Any

import ml_collections

from recjax import quantize
from recjax.checkpoint.integrity import flat
from recjax.errors import ConfigError
from recjax.validation import boolean, check_number, choice, get, integer, known_keys

POLICIES = ("full", "one_shot", "consecutive", "intermittent")

QUANTIZE_BITS = (0, 2, 4, 8)

QUANTIZE_OPTIMIZER_BITS = (0, *quantize.STATE_BITS)

KEYS = {"enabled", "dir", "every_steps", "every_minutes", "keep", "keep_selected", "async_save", "policy",
        "baseline_fraction", "quantize_bits", "quantize_optimizer_bits", "restore"}

# Config keys that may change between a run and its resumption (everything else must match).
# The mesh and plan may change too: the tables are re-laid out on restore; and the storage tiers: a checkpoint records
# the tables in the single-device layout whatever their tier, and a disk tier's files are written from it. How
# embedding.kernel="auto" measures and caches its choice changes no state; steps per call and the input threads
# change how the loop runs, not what it computes.
RESUMABLE_CHANGES = ("checkpoint.", "train.progress_bar", "train.steps_per_call", "train.input_workers", "mesh.",
                     "sharding.", "tiering.", "embedding.kernel_measure", "embedding.kernel_cache")


def check_checkpoint_config(config: Mapping) -> None:
    """ConfigError naming the first bad `checkpoint.*` key."""
    known_keys(config, "checkpoint", KEYS)
    boolean(config, "checkpoint.enabled")
    for key in ("dir", "restore"):
        value = get(config, f"checkpoint.{key}")
        if not isinstance(value, str):
            raise ConfigError(f"checkpoint.{key}", f"must be a path (a string), got {value!r}")
    integer(config, "checkpoint.every_steps", 0)
    check_number("checkpoint.every_minutes", get(config, "checkpoint.every_minutes"), at_least=0)
    integer(config, "checkpoint.keep", 1)
    boolean(config, "checkpoint.keep_selected")
    boolean(config, "checkpoint.async_save")
    choice(config, "checkpoint.policy", POLICIES)
    check_number("checkpoint.baseline_fraction", get(config, "checkpoint.baseline_fraction"), above=0)
    bits = get(config, "checkpoint.quantize_bits")
    if bits not in QUANTIZE_BITS or isinstance(bits, bool):
        raise ConfigError("checkpoint.quantize_bits", f"must be one of {list(QUANTIZE_BITS)} (0 = f32), got {bits!r}")
    if bits and get(config, "checkpoint.policy") == "full":
        raise ConfigError("checkpoint.quantize_bits", f"{bits} quantizes the rows of deltas, but checkpoint.policy "
                                                      "'full' writes none; set checkpoint.policy to 'one_shot', "
                                                      "'consecutive' or 'intermittent' (or quantize_bits to 0)")
    bits = get(config, "checkpoint.quantize_optimizer_bits")
    if bits not in QUANTIZE_OPTIMIZER_BITS or isinstance(bits, bool):
        raise ConfigError("checkpoint.quantize_optimizer_bits",
                          f"must be one of {list(QUANTIZE_OPTIMIZER_BITS)} (0 = f32), got {bits!r}")
    if bits and get(config, "checkpoint.policy") == "full":
        raise ConfigError("checkpoint.quantize_optimizer_bits",
                          f"{bits} quantizes the optimizer rows of deltas, but checkpoint.policy 'full' writes none; "
                          "set checkpoint.policy to 'one_shot', 'consecutive' or 'intermittent' (or "
                          "quantize_optimizer_bits to 0)")


def config_dict(config: ml_collections.ConfigDict) -> dict:
    return json.loads(config.to_json_best_effort(sort_keys=True))


def flatten_config(d: Mapping) -> dict[str, Any]:
    """{"a.b": value} of a nested config dict."""
    return flat(d, sep=".")


def config_differences(saved: Mapping, current: Mapping) -> list[str]:
    """Dotted keys whose values differ, ignoring those a resumed run may change (RESUMABLE_CHANGES)."""
    a, b = flatten_config(saved), flatten_config(current)
    return sorted(k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>")
                  and not k.startswith(RESUMABLE_CHANGES))
