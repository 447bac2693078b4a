"""The config sections every dataset config shares: embeddings, every model family, optimizers and the budget.

Each dataset config (`dlrm_movielens.py`, `dlrm_criteo_kaggle.py`, ...) builds its sections with these functions
and overrides what its data needs, so `--config.model.name=lr` (or fm, dcnv2, wukong) works on every config and
every knob has one name everywhere. `recjax/config_check.py` validates the result before a run starts.
"""

import ml_collections
from ml_collections import config_dict

from compression.plan import option_placeholders

MODEL_NAMES = ("dlrm", "dcnv2", "wukong", "lr", "fm")


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
    # Gather-reduce and sparse-update implementation: "auto" (Pallas kernels on TPU / GPU, XLA on CPU), "xla", or
    # "pallas" (on a CPU: the kernels in Pallas's interpreter, slow; for tests).
    embedding.kernel = "auto"
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
    behind a device cache; on a CPU the same as memory) or disk (a file behind an in-RAM cache). One device only, and
    a run with a table off memory cannot checkpoint yet (checkpoint.enabled=False)."""
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
    train.progress_bar = True
    return train


def checkpoint_config() -> ml_collections.ConfigDict:
    """Orbax checkpoints of the whole run (recjax/checkpoint.py), on by default: re-running in the same workdir
    resumes from the latest complete checkpoint."""
    checkpoint = ml_collections.ConfigDict()
    checkpoint.enabled = True  # save checkpoints and resume from them (False: neither)
    checkpoint.dir = ""  # where they go; "" = <workdir>/checkpoints
    checkpoint.every_steps = 0  # save every this many steps (0 = by time only); the last step is always saved
    checkpoint.every_minutes = 5.0  # and/or after this many minutes since the last save (0 = by steps only)
    checkpoint.keep = 2  # restore points kept (with the baseline and deltas each one needs)
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
    checkpoint.restore = ""  # start from another run's checkpoint: its checkpoints dir or one step's dir in it
    return checkpoint
