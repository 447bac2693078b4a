"""Typed config sections: each runtime component receives its own section of the config as a frozen dataclass, and
the defaults are defined here, once.

    sections = read_sections(config)      # the one place a ConfigDict becomes typed sections
    placement.build(sections, task)       # reads sections.mesh, .sharding, .tiering, .train.batch_size
    build_task(sections, spec)            # .embedding, .optimizer, .train

`experiments/configs/common.py` builds its ConfigDict sections from these dataclasses (`config_section`), so a
default written here is the one every config starts from; a config without an optional section (mesh, sharding,
tiering) or a section without one of its keys gets the default here, and nothing downstream repeats it with
`.get(key, default)`. `read_section` checks each value's type by its field's annotation and a key the section does
not have, each a one-line `ConfigError` naming the dotted key; the values' ranges and choices are checked by each
section's validator beside its owner (recjax/config_check.py runs them).
"""

import dataclasses
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from recjax.errors import ConfigError


# ------------------------------------------------------------------------------------------------------ sections
@dataclasses.dataclass(frozen=True)
class MeshSection:
    # Device mesh axes "data" and "model", e.g. "data=4,model=2"; "" = every device on "data". One device runs the
    # single-device layout; more split each batch over all devices (recjax/sharding/mesh.py).
    shape: str = ""


@dataclasses.dataclass(frozen=True)
class ShardingSection:
    """Where the physical tables live on the mesh (recjax/sharding/plan.py); unused on one device."""

    plan: str = "auto"  # "auto" (balance the cost model within memory), "table", "row", "column", "replicated"
    tables: str = ""  # per-table overrides, e.g. "C3=row,C4=table:2,C5/q=replicated" (logical or physical names)
    row_axes: str = "all"  # row-wise tables split over "all" devices or the "model" axis (copied along "data")
    row_split: str = "range"  # rows to parts by contiguous "range" or id "mod" the part count
    # what crosses devices: "auto" (bags pooled on their tables' owners where that moves fewer bytes than the rows),
    # "pooled" (wherever the method allows), "rows" (every distinct row, as before issue 39); recjax/sharding/plan.py
    exchange: str = "auto"
    exchange_dtype: str = "float32"  # pooled bags, rows and gradients between devices: float32, bfloat16 or float16
    device_memory_bytes: int = 0  # per-device budget for tables + optimizer state; 0 = the device's own
    # all_to_all buckets of row-/table-wise tables: factor x E + sigmas x sqrt(E) ids, E = the ids a device is
    # expected to send an owner (sqrt(E) ~ the spread of that count); a step with more takes worst-case buckets
    # (exact either way); capacity_factor 0 = always the worst case
    capacity_factor: float = 1.0
    capacity_sigmas: float = 7.0


@dataclasses.dataclass(frozen=True)
class TieringSection:
    """Where each physical table's rows live (recjax/placement: a storage per stacked group): memory (a device
    array), host (host memory through JAX memory kinds, the step's rows brought to the device; on a CPU host memory
    is the device's, so the same numbers as memory) or disk (a file behind an in-RAM cache of rows)."""

    default: str = "memory"  # the tier of every table not matched below: "memory", "host" or "disk"
    tables: str = ""  # per-table tiers, e.g. "C3=disk,C4/q=disk" (logical or physical names); these win
    disk_over_bytes: int = 0  # rule: a table whose rows + optimizer state exceed this many bytes goes to disk
    host_over_bytes: int = 0  # rule: ... to host (0 = neither rule)
    dir: str = ""  # where the disk tables' files go; "" = <workdir>/tables.tmp, removed at the end of the run
    cache_fraction: float = 0.1  # in-RAM cache per stacked group: this fraction of its disk rows ...
    cache_rows: int = 0  # ... or exactly this many rows (0 = use cache_fraction); at least one step's rows
    policy: str = "lru"  # which rows leave the cache: "lru", "lfu" or "static" (a profiled hot set pinned + lru)
    profile_batches: int = 50  # static: the hot set is the rows the first N training batches read most
    prefetch: bool = True  # read step i+1's missing rows while step i runs (False: after it; for measuring)
    io_threads: int = 16  # threads reading / writing rows (the disk serves random reads best ~16 at a time)


@dataclasses.dataclass(frozen=True)
class EmbeddingSection:
    dim: int  # D, the width every feature embeds to (lr uses 1, fm uses D as 1 + D - 1 factors)
    method: str = "full"  # compression method (compression/registry.py)
    # The method's knobs, unset = default (compression/plan.py); experiments/configs/common.py lists every option
    # as an unset placeholder so the command line can set any of them.
    options: Mapping = dataclasses.field(default_factory=dict)
    tables: Mapping = dataclasses.field(default_factory=dict)  # per-feature overrides: {feature: {method, options}}
    id_counts: str = ""  # per-id counts for md_blocks: "" (none), "dataset" or an .npz path
    pooling: str = "sum"  # multi-hot bags: "sum" or "mean"
    # An id outside [0, vocab) inside a jitted step (the trainer validates batches on the host first): "zero"
    # (reads zeros, no update, counted), "error" (raises naming the feature) or "off" (recjax/embedding.py).
    bounds_check: str = "zero"
    # Gather-reduce and sparse-update implementation: "auto" (XLA on CPU; on a GPU / TPU the kernels only where
    # measured faster than XLA for this device kind and step shape: recjax/kernel_choice.py), "xla", "pallas" (the
    # platform's kernels), "pallas_tpu" / "pallas_gpu" (on a CPU: those kernels in Pallas's interpreter, slow; tests).
    kernel: str = "auto"
    # "auto"'s measurements: "auto" (measure when neither the cache nor the shipped table has a choice), "always"
    # (measure again and rewrite the cache entry) or "never"; and the JSON cache of measured choices ("" =
    # $RECJAX_CACHE_DIR or ~/.cache/recjax/kernel_choices.json, "none" = no cache).
    kernel_measure: str = "auto"
    kernel_cache: str = ""
    # What a deduplicated training step pools bags from: "distinct_rows" (gathered first), "table" (straight from
    # the tables inside the kernel; the update kernel reads the rows it writes), or "auto" ("table" wherever the
    # step runs Pallas kernels that take every lookup; recjax/embedding.py:resolve_pool_from).
    pool_from: str = "auto"
    # Deduplicate a batch's ids before the lookup and the update: "auto" skips it when the sparse optimizer sums
    # over duplicates (plain SGD without weight decay), the kernel is XLA and some bags are multi-hot -- the update
    # is then a scatter-add with duplicates, exact and cheaper; "always" keeps it (recjax/embedding.py).
    dedup: str = "auto"


@dataclasses.dataclass(frozen=True)
class DenseOptimizerSection:
    name: str  # "adam", "sgd" or "adagrad"
    learning_rate: float
    weight_decay: float = 0.0  # decoupled decay of weight matrices (AdamW-style; biases and norms not)


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    dense: DenseOptimizerSection
    # {name, learning_rate, weight_decay, ...}: the sparse optimizer's own dataclass holds its fields and defaults
    # (recjax/sparse_optim.py; e.g. lazy_adam's b1 / b2 / eps), built from this mapping by `make_sparse_optimizer`.
    sparse: Mapping
    warmup_steps: int = 0  # linear warmup of both learning rates
    decay: str = "none"  # "none" or "cosine" (to 0 at the last step)


@dataclasses.dataclass(frozen=True)
class TrainSection:
    batch_size: int  # examples per optimizer step (over every device)
    steps: object = None  # optimizer steps; or None and set train.epochs (exactly one of the two)
    epochs: object = None  # passes over the train split (may be fractional); or None and set steps
    eval_every: object = "epoch"  # steps between evaluations on the validation split, or "epoch"
    log_every: int = 100  # steps between train-loss log lines
    # Evaluations in a row without a better validation metric before training stops; 0 = run the whole budget.
    # Either way the reported test metrics are those of the step with the best validation metric.
    early_stopping_patience: int = 0
    # Validation metric that picks the best step: "auc" (higher) or "logloss" (lower); on ratings "mse" (lower)
    select_on: str = "auc"
    # The other metric's best step is tracked too (summary.json `selection`). Warn when the selected step's validation
    # logloss is more than this fraction above the lowest (selecting on auc; 1 % = 0.0044 at Criteo's 0.44, a few
    # times the 0.001 that Wang et al. 2017, DCN, call significant) ...
    selection_logloss_tolerance: float = 0.01
    # ... or its validation AUC more than this below the highest (selecting on logloss; 2x that 0.001).
    selection_auc_tolerance: float = 0.002
    progress_bar: bool = True  # a tqdm bar on the console (examples, loss, best validation so far); False for logs
    # Stop a run whose train loss diverged: non-finite, or a log window's mean loss above this many times the lowest
    # so far and above step 1's (the untrained model's); 0 = stop on a non-finite loss only (recjax/guards.py
    # `Divergence`). summary.json records it under "diverged"; the launcher exits with status 3.
    divergence_factor: float = 10.0
    # Refuse to start when the embedding tables + optimizer state (+ the host copy async checkpoints keep) do not fit
    # in the memory available (host MemAvailable on CPU; on GPU / TPU the device's, and the host's for tables in host
    # memory); False: start anyway.
    check_memory: bool = True
    # Steps one compiled call runs (a lax.scan over that many batches, sent to the device as one block): "auto" picks
    # by platform (recjax/evaluation.py AUTO_STEPS_PER_CALL: 1 on a CPU, where the step keeps the cores busy; 32 on a
    # GPU / TPU, where one step is as quick as the host's dispatch of it; benchmarks/RESULTS.md, the training loop).
    # Results do not depend on it: log, eval, checkpoint and adjustment steps end calls.
    steps_per_call: object = "auto"
    input_workers: int = 2  # threads reading, checking, stacking and transferring the next blocks of batches


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Orbax checkpoints of the whole run (recjax/checkpoint/), on by default: re-running in the same workdir resumes
    from the latest complete checkpoint."""

    enabled: bool = True  # save checkpoints and resume from them (False: neither)
    dir: str = ""  # where they go; "" = <workdir>/checkpoints
    every_steps: int = 0  # save every this many steps (0 = by time only); the last step is always saved
    every_minutes: float = 5.0  # and/or after this many minutes since the last save (0 = by steps only)
    keep: int = 2  # restore points kept (with the baseline and deltas each one needs)
    # Also save at every step that improves the selected validation metric, and keep the selected step's restore
    # point: the export serves the model whose test metrics summary.json reports (False: interval saves only).
    keep_selected: bool = True
    async_save: bool = True  # write in a background thread; the loop only waits for the host copy
    # Tables: "full" (every checkpoint holds every row), or Check-N-Run incremental deltas of the rows touched since
    # a baseline: "one_shot" (one baseline, then each checkpoint a cumulative delta since it), "consecutive" (each
    # delta since the previous checkpoint) or "intermittent" (consecutive, with a new baseline once the chain's
    # deltas outgrow baseline_fraction of the baseline's bytes).
    policy: str = "full"
    baseline_fraction: float = 0.5  # intermittent: new baseline when the chain's delta bytes exceed this share
    # Row-wise asymmetric k-bit quantization of the delta rows (0 = f32; 2, 4 or 8): only the checkpoint is lossy,
    # training stays f32; a run restored from a quantized delta continues from the dequantized rows.
    quantize_bits: int = 0
    # The deltas' sparse-optimizer rows (lazy Adam's m and v, Adagrad's accumulator; not row-wise Adagrad's per-row
    # scalar) in 8-bit block-wise dynamic codes (Dettmers et al. 2022), one block per row (0 = f32, exact restores).
    quantize_optimizer_bits: int = 0
    restore: str = ""  # start from another run's checkpoint: its checkpoints dir or one step's dir in it


@dataclasses.dataclass(frozen=True)
class Sections:
    """Every typed section of a run's config (`read_sections`)."""

    seed: int
    train: TrainSection
    checkpoint: CheckpointSection
    optimizer: OptimizerSection
    embedding: EmbeddingSection
    mesh: MeshSection
    sharding: ShardingSection
    tiering: TieringSection


SECTIONS = {"train": TrainSection, "checkpoint": CheckpointSection, "optimizer": OptimizerSection,
            "embedding": EmbeddingSection, "mesh": MeshSection, "sharding": ShardingSection,
            "tiering": TieringSection}


# -------------------------------------------------------------------------------------------------- building them
def read_sections(config: Mapping) -> Sections:
    """The typed sections of `config` (a ConfigDict or a nested mapping); a ConfigError names a bad key."""
    if isinstance(config, Sections):
        return config
    return Sections(seed=int(config["seed"]), **{key: read_section(config, key, cls) for key, cls in SECTIONS.items()})


def read_section(config: Mapping, key: str, cls: type):
    """`config[key]` as the dataclass `cls`: fields it lacks take their defaults (so does a missing section), a key
    `cls` has no field for, or a value of the wrong type, is a ConfigError naming the dotted key."""
    section = config.get(key) or {}  # a missing (or None) section: every field at its default
    if dataclasses.is_dataclass(section):
        return section
    if not hasattr(section, "keys"):
        raise ConfigError(key, f"must be a section of fields, got {section!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(section.keys()) - set(fields))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", f"is not a known field; {key} has {sorted(fields)}")
    values = {}
    for name, field in fields.items():
        if name in section:
            values[name] = _typed(f"{key}.{name}", section[name], hints[name])
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key}.{name}", "is missing from the config; add it (see experiments/configs/common.py)")
    return cls(**values)


def _typed(key: str, value: Any, hint: Any) -> Any:
    """`value` checked (and converted: an int where a float is wanted, a ConfigDict to a dict, a nested section to
    its dataclass) against the field annotation `hint`."""
    if dataclasses.is_dataclass(hint):
        return read_section({key: value}, key, hint)
    if hint is object or hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be True or False, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(key, f"must be a whole number, got {value!r}")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(key, f"must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {value!r}")
        return value
    if hint is Mapping or typing.get_origin(hint) is Mapping:
        if value is None:
            return {}
        if not hasattr(value, "items"):
            raise ConfigError(key, f"must be a section of fields, got {value!r}")
        return _plain(value)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return value
    raise TypeError(f"{key}: no check for the annotation {hint!r}")  # a field type this module does not handle


def _plain(value: Any) -> Any:
    """ConfigDicts (and nested mappings) -> plain dicts."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    return value


def config_section(cls: type, **values: Any) -> ml_collections.ConfigDict:
    """A ConfigDict of `cls`'s fields at their defaults, and `values` (which the fields without a default need), for
    experiments/configs/common.py. A field annotated `object` (None, a number or a string) becomes a FieldReference
    of any type, so the command line can set any of them (`--config.train.steps=None`)."""
    section = ml_collections.ConfigDict()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in values:
            value = values[field.name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{field.name} has no default: pass it")
        if dataclasses.is_dataclass(value):
            value = config_section(type(value), **{f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
        elif isinstance(value, Mapping):
            value = ml_collections.ConfigDict(dict(value))
        elif hints[field.name] is object:
            value = config_dict.FieldReference(value, field_type=object)
        section[field.name] = value
    return section
