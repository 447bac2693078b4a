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

# What a config tunes per model family: `model_defaults` records these (and any key another family's entry sets) for
# the config's own family, and a swap to a family without an entry names them.
FAMILY_KEYS = ("optimizer.dense.learning_rate", "optimizer.dense.weight_decay", "optimizer.sparse.learning_rate",
               "optimizer.sparse.weight_decay")


def flexible(value=None) -> config_dict.FieldReference:
    """A field that may hold None, a number or a string (e.g. train.eval_every = 500 or "epoch"), so the command
    line can set any of them (`--config.train.steps=None`); recjax/config_check.py checks the value."""
    return config_dict.FieldReference(value, field_type=object)


def embedding_config(dim: int, pooling: str = "sum") -> ml_collections.ConfigDict:
    embedding = ml_collections.ConfigDict()
    embedding.dim = dim  # D, the width every feature embeds to (lr uses 1, fm uses D as 1 + D - 1 factors)
    embedding.method = "full"  # compression method (compression/registry.py)
    embedding.options = option_placeholders()  # the method's knobs, unset = default (compression/plan.py)
    embedding.tables = ml_collections.ConfigDict()  # per-feature overrides: {feature: {method, options}}
    embedding.id_counts = ""  # per-id counts for md_blocks: "" (none), "dataset" or an .npz path
    embedding.pooling = pooling  # multi-hot bags: "sum" or "mean"
    # An id outside [0, vocab) inside a jitted step (the trainer validates batches on the host first): "zero"
    # (reads zeros, no update, counted), "error" (raises naming the feature) or "off" (recjax/embedding.py).
    embedding.bounds_check = "zero"
    # Gather-reduce and sparse-update implementation: "auto" (Pallas kernels on TPU / GPU, XLA on CPU), "xla",
    # "pallas" (the platform's kernels), "pallas_tpu" / "pallas_gpu" (on a CPU: those kernels in Pallas's
    # interpreter, slow; for tests).
    embedding.kernel = "auto"
    # What a deduplicated training step pools bags from: "distinct_rows" (gathered first), "table" (straight from
    # the tables inside the kernel; the update kernel reads the rows it writes), or "auto" ("table" wherever the
    # step runs Pallas kernels that take every lookup; recjax/embedding.py:resolve_pool_from).
    embedding.pool_from = "auto"
    # Deduplicate a batch's ids before the lookup and the update: "auto" skips it when the sparse optimizer sums
    # over duplicates (plain SGD without weight decay), the kernel is XLA and some bags are multi-hot -- the update
    # is then a scatter-add with duplicates, exact and cheaper; "always" keeps it (recjax/embedding.py).
    embedding.dedup = "auto"
    return embedding


def mesh_config() -> ml_collections.ConfigDict:
    mesh = ml_collections.ConfigDict()
    # Device mesh axes "data" and "model", e.g. "data=4,model=2"; "" = every device on "data". One device runs the
    # single-device engine; more split each batch over all devices (recjax/sharding/mesh.py).
    mesh.shape = ""
    return mesh


def sharding_config() -> ml_collections.ConfigDict:
    """Where the physical tables live on the mesh (recjax/sharding/plan.py); unused on one device."""
    sharding = ml_collections.ConfigDict()
    sharding.plan = "auto"  # "auto" (balance the cost model within memory), "table", "row", "column", "replicated"
    sharding.tables = ""  # per-table overrides, e.g. "C3=row,C4=table:2,C5/q=replicated" (logical or physical names)
    sharding.row_axes = "all"  # row-wise tables split over "all" devices or the "model" axis (copied along "data")
    sharding.row_split = "range"  # rows to parts by contiguous "range" or id "mod" the part count
    sharding.exchange_dtype = "float32"  # rows and row gradients between devices: float32, bfloat16 or float16
    sharding.device_memory_bytes = 0  # per-device budget for tables + optimizer state; 0 = the device's own
    # all_to_all buckets of row-/table-wise tables: factor x E + sigmas x sqrt(E) ids, E = the ids a device is
    # expected to send an owner (sqrt(E) ~ the spread of that count); a step with more takes worst-case buckets
    # (exact either way); capacity_factor 0 = always the worst case
    sharding.capacity_factor = 1.0
    sharding.capacity_sigmas = 7.0
    return sharding


def tiering_config() -> ml_collections.ConfigDict:
    """Where each physical table's rows live (recjax/tiering): memory (a device array), host (GPU / TPU: host RAM
    behind a device cache; on a CPU the same as memory) or disk (a file behind an in-RAM cache). One device only; its
    checkpoints are the in-memory run's, but a baseline reads the tables whole into RAM."""
    tiering = ml_collections.ConfigDict()
    tiering.default = "memory"  # the tier of every table not matched below: "memory", "host" or "disk"
    tiering.tables = ""  # per-table tiers, e.g. "C3=disk,C4/q=disk" (logical or physical names); these win
    tiering.disk_over_bytes = 0  # rule: a table whose rows + optimizer state exceed this many bytes goes to disk
    tiering.host_over_bytes = 0  # rule: ... to host (0 = neither rule)
    tiering.dir = ""  # where the disk tables' files go; "" = a temporary directory, removed at the end of the run
    tiering.cache_fraction = 0.1  # in-RAM cache per stacked group: this fraction of its disk / host rows ...
    tiering.cache_rows = 0  # ... or exactly this many rows (0 = use cache_fraction); at least one step's rows
    tiering.policy = "lru"  # which rows leave the cache: "lru", "lfu" or "static" (a profiled hot set pinned + lru)
    tiering.profile_batches = 50  # static: the hot set is the rows the first N training batches read most
    tiering.prefetch = True  # read step i+1's missing rows while step i runs (False: after it; for measuring)
    tiering.io_threads = 16  # threads reading / writing rows (the disk serves random reads best ~16 at a time)
    return tiering


def model_config(name: str, dim: int) -> ml_collections.ConfigDict:
    """`model.name` picks the family; each family's knobs live in its own sub-config, sized here for embedding
    dim `dim` (DLRM's dot interaction needs the bottom MLP to end in `dim`)."""
    model = ml_collections.ConfigDict()
    model.name = name  # "dlrm", "dcnv2", "wukong", "lr" (logistic regression) or "fm" (factorization machine)
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
    return model


def optimizer_config(dense: str, dense_lr: float, sparse: str, sparse_lr: float, *, decay: str = "none"
                     ) -> ml_collections.ConfigDict:
    optimizer = ml_collections.ConfigDict()
    optimizer.dense = ml_collections.ConfigDict()
    optimizer.dense.name = dense  # "adam", "sgd" or "adagrad"
    optimizer.dense.learning_rate = dense_lr
    optimizer.dense.weight_decay = 0.0  # decoupled decay of weight matrices (AdamW-style; biases and norms not)
    optimizer.sparse = ml_collections.ConfigDict()
    optimizer.sparse.name = sparse  # "sgd", "adagrad", "rowwise_adagrad" or "lazy_adam"
    optimizer.sparse.learning_rate = sparse_lr
    optimizer.sparse.weight_decay = 0.0  # L2 on the embedding rows a step touches (lazy, once per row per step)
    optimizer.warmup_steps = 0  # linear warmup of both learning rates
    optimizer.decay = decay  # "none" or "cosine" (to 0 at the last step)
    return optimizer


def train_config(*, batch_size: int, steps: int | None = None, epochs: float | None = None,
                 eval_every: int | str = "epoch", log_every: int = 100, patience: int = 0
                 ) -> ml_collections.ConfigDict:
    train = ml_collections.ConfigDict()
    train.batch_size = batch_size
    train.steps = flexible(steps)  # optimizer steps; or None and set train.epochs (exactly one of the two)
    train.epochs = flexible(epochs)  # passes over the train split (may be fractional); or None and set steps
    train.eval_every = flexible(eval_every)  # steps between evaluations on the validation split, or "epoch"
    train.log_every = log_every  # steps between train-loss log lines
    # Evaluations in a row without a better validation metric before training stops; 0 = run the whole budget.
    # Either way the reported test metrics are those of the step with the best validation metric.
    train.early_stopping_patience = patience
    train.select_on = "auc"  # validation metric that picks the best step: "auc" (higher) or "logloss" (lower)
    # The other metric's best step is tracked too (summary.json `selection`). Warn when the selected step's validation
    # logloss is more than this fraction above the lowest (selecting on auc; 1 % = 0.0044 at Criteo's 0.44, a few
    # times the 0.001 that Wang et al. 2017, DCN, call significant) ...
    train.selection_logloss_tolerance = 0.01
    # ... or its validation AUC more than this below the highest (selecting on logloss; 2x that 0.001).
    train.selection_auc_tolerance = 0.002
    train.progress_bar = True  # a tqdm bar on the console (examples, loss, best validation so far); False for logs
    # Stop a run whose train loss diverged: non-finite, or a log window's mean loss above this many times the lowest
    # so far and above step 1's (the untrained model's); 0 = stop on a non-finite loss only (recjax/train.py
    # `Divergence`). summary.json records it under "diverged"; the launcher exits with status 3.
    train.divergence_factor = 10.0
    # Refuse to start when the embedding tables + optimizer state (+ the host copy async checkpoints keep) do not fit
    # in the memory available (host MemAvailable on CPU, the device's on GPU / TPU); False: start anyway.
    train.check_memory = True
    # Steps one compiled call runs (a lax.scan over that many batches, sent to the device as one block): "auto" picks
    # by platform -- 1 on a CPU, 32 on a GPU / TPU, where one step is as quick as the host's dispatch of it
    # (benchmarks/RESULTS.md, the training loop). Results do not depend on it; log, eval and checkpoint steps end calls.
    train.steps_per_call = flexible("auto")
    train.input_workers = 2  # threads making, checking and transferring the next blocks of batches ahead of the loop
    return train


def checkpoint_config() -> ml_collections.ConfigDict:
    """Orbax checkpoints of the whole run (recjax/checkpoint/), on by default: re-running in the same workdir
    resumes from the latest complete checkpoint."""
    checkpoint = ml_collections.ConfigDict()
    checkpoint.enabled = True  # save checkpoints and resume from them (False: neither)
    checkpoint.dir = ""  # where they go; "" = <workdir>/checkpoints
    checkpoint.every_steps = 0  # save every this many steps (0 = by time only); the last step is always saved
    checkpoint.every_minutes = 5.0  # and/or after this many minutes since the last save (0 = by steps only)
    checkpoint.keep = 2  # restore points kept (with the baseline and deltas each one needs)
    # Also save at every step that improves the selected validation metric, and keep the selected step's restore
    # point: the export serves the model whose test metrics summary.json reports (False: interval saves only).
    checkpoint.keep_selected = True
    checkpoint.async_save = True  # write in a background thread; the loop only waits for the host copy
    # Tables: "full" (every checkpoint holds every row), or Check-N-Run incremental deltas of the rows touched since
    # a baseline: "one_shot" (one baseline, then each checkpoint a cumulative delta since it), "consecutive" (each
    # delta since the previous checkpoint) or "intermittent" (consecutive, with a new baseline once the chain's
    # deltas outgrow baseline_fraction of the baseline's bytes).
    checkpoint.policy = "full"
    checkpoint.baseline_fraction = 0.5  # intermittent: new baseline when the chain's delta bytes exceed this share
    # Row-wise asymmetric k-bit quantization of the delta rows (0 = f32; 2, 4 or 8): only the checkpoint is lossy,
    # training stays f32; a run restored from a quantized delta continues from the dequantized rows.
    checkpoint.quantize_bits = 0
    # The deltas' sparse-optimizer rows (lazy Adam's m and v, Adagrad's accumulator; not row-wise Adagrad's per-row
    # scalar) in 8-bit block-wise dynamic codes (Dettmers et al. 2022), one block per row (0 = f32, exact restores).
    checkpoint.quantize_optimizer_bits = 0
    checkpoint.restore = ""  # start from another run's checkpoint: its checkpoints dir or one step's dir in it
    return checkpoint


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
