"""Tables larger than memory: physical tables on local disk (or host RAM) behind an in-RAM cache of hot rows.

    tiers.py    which tier each physical table lives in (`tiering.default`, `tiering.tables`, byte rules)
    store.py    a cached table's rows + optimizer-state rows: a file per table (mapped) or a host array
    cache.py    the host-side directory of a group's cache slots and its policies (lru, lfu, static hot set)
    backend.py  TieredEmbedding: the step's embedding interface over the cache, the prefetch / swap / write-back
                pipeline (SlottedBatch: the batch with its rows' cache slots)
    mesh.py     MeshTieredEmbedding: the same on a device mesh, each device block's cached rows behind its own cache

`setup(config, task, dataset)` returns the run's `TieredEmbedding`, or None when every table stays in memory.
"""

import math
import pathlib
import shutil
import tempfile
from collections.abc import Mapping

import jax
import ml_collections
import numpy as np

from recjax import sharding
from recjax.errors import ConfigError
from recjax.sharding.mesh import make_mesh
from recjax.sharding.plan import parse_overrides
from recjax.tiering.backend import GroupLayout, SlottedBatch, TieredBatch, TieredEmbedding, call_text
from recjax.tiering.cache import POLICIES, PartitionedRowCache, RowCache
from recjax.tiering.mesh import MeshTieredEmbedding, plan_mesh_layouts
from recjax.tiering.store import RowStore
from recjax.tiering.tiers import TIERS, TableBytes, resolve_tiers
from recjax.validation import boolean, check_text, choice, get, integer, known_keys, number

__all__ = ["GroupLayout", "MeshTieredEmbedding", "PartitionedRowCache", "RowCache", "RowStore", "SlottedBatch",
           "TieredBatch", "TieredEmbedding", "check_tiering", "plan_layouts", "plan_mesh_layouts", "setup",
           "table_bytes"]

TIERING_KEYS = {"default", "tables", "disk_over_bytes", "host_over_bytes", "dir", "cache_fraction", "cache_rows",
                "policy", "profile_batches", "prefetch", "io_threads"}


def check_tiering(config: Mapping) -> None:
    """`tiering` (optional: without it every table is in memory). The tables themselves, the cache against a step's
    rows and the disk's free space are checked when the task is built (`setup`)."""
    if "tiering" not in config:
        return
    known_keys(config, "tiering", TIERING_KEYS)
    tiering = get(config, "tiering")
    choice(config, "tiering.default", TIERS)
    check_text("tiering.tables", get(config, "tiering.tables"))
    for part in filter(None, (p.strip() for p in tiering.tables.split(","))):
        name, eq, tier = (x.strip() for x in part.partition("="))
        if not eq or not name or tier not in TIERS:
            raise ConfigError("tiering.tables", f"cannot read {part!r}: write table=tier with a tier in "
                                                f"{list(TIERS)}, e.g. C3=disk")
    integer(config, "tiering.disk_over_bytes", 0)
    integer(config, "tiering.host_over_bytes", 0)
    check_text("tiering.dir", get(config, "tiering.dir"))
    number(config, "tiering.cache_fraction", above=0.0, below=1.0)
    integer(config, "tiering.cache_rows", 0)
    choice(config, "tiering.policy", POLICIES)
    integer(config, "tiering.profile_batches", 1)
    boolean(config, "tiering.prefetch")
    integer(config, "tiering.io_threads", 1)


def table_bytes(collection, optimizer) -> list[TableBytes]:
    """Each physical table's rows + optimizer state, in bytes, for the tier rules."""
    return [TableBytes(p.table.name, p.feature, 4 * p.table.rows * p.table.dim
                       + (optimizer.state_bytes(p.table.rows, p.table.dim) if optimizer else 0))
            for p in collection.physical_tables()]


def plan_layouts(collection, tiers: Mapping[str, str], batch_size: int, cache_fraction: float = 0.1,
                 cache_rows: int = 0, steps_per_call: int = 1) -> list[GroupLayout]:
    """The device layout of every group holding a table whose tier is not memory: its memory tables, its cached
    tables, and a cache of `cache_rows` slots (0: `cache_fraction` of the cached rows, rounded up), which must hold
    one call's distinct cached rows (`steps_per_call` batches: a k-step call's rows are in the cache for all of it)
    and fewer than all of them."""
    examples = batch_size * steps_per_call
    layouts = []
    for group in sorted(collection.group_rows):
        placed = [p for p in collection.physical_tables() if p.group == group]
        if all(tiers[p.table.name] == "memory" for p in placed):
            continue
        resident = tuple((p.table.name, p.offset, p.table.rows) for p in placed if tiers[p.table.name] == "memory")
        cached = tuple((p.table.name, p.offset, p.table.rows, tiers[p.table.name]) for p in placed
                       if tiers[p.table.name] != "memory")
        total = sum(rows for _, _, rows, _ in cached)
        step_rows = min(total, sum(min(p.table.rows, examples * collection.slots_per_example(p))
                                   for p in placed if tiers[p.table.name] != "memory"))
        slots = cache_rows or math.ceil(cache_fraction * total)
        key = "tiering.cache_rows" if cache_rows else "tiering.cache_fraction"
        names = ", ".join(name for name, _, _, _ in cached)
        if slots < step_rows:
            raise ConfigError(key, f"group {group}'s cache of {slots:,} rows cannot hold the {step_rows:,} distinct "
                                   f"rows {call_text(batch_size, steps_per_call)} can read from its tables {names}; "
                                   f"raise it to at least {step_rows:,} rows ({step_rows / total:.3g} of {total:,}) "
                                   "or lower train.batch_size" + (" or train.steps_per_call" if steps_per_call > 1
                                                                  else ""))
        if slots >= total:
            raise ConfigError(key, f"group {group}'s cache of {slots:,} rows holds all {total:,} rows of its tables "
                                   f"{names}: keep them in memory (tiering.tables) or lower the cache")
        layouts.append(GroupLayout(group, collection.group_rows[group], collection.group_dims[group], resident,
                                   cached, slots, step_rows))
    return layouts


def profile_hot_rows(backend_unique, batches, layouts: list[GroupLayout], count: int) -> dict[str, np.ndarray]:
    """The static policy's hot set: per group, the cached rows read by the most of the first `count` batches (each
    row counted once per batch), as many as the cache holds beside one step's rows; ties by row id."""
    seen: dict[str, list[np.ndarray]] = {layout.name: [] for layout in layouts}
    for _, batch in zip(range(count), batches, strict=False):
        unique = backend_unique(batch)
        for layout in layouts:
            rows = unique[layout.name]
            starts = np.asarray([start for _, start, _, _ in layout.cached])
            stops = np.asarray([start + rows for _, start, rows, _ in layout.cached])
            t = np.searchsorted(starts, rows, side="right") - 1
            cached = (t >= 0) & (rows < stops[np.maximum(t, 0)])
            seen[layout.name].append(rows[cached])
    hot = {}
    for layout in layouts:
        rows, counts = np.unique(np.concatenate(seen[layout.name] or [np.zeros(0, np.int64)]), return_counts=True)
        keep = layout.slots - layout.step_rows
        order = np.lexsort((rows, -counts))[:keep]
        hot[layout.name] = np.sort(rows[order]).astype(np.int64)
    return hot


def setup(config: ml_collections.ConfigDict, task, dataset=None, steps_per_call: int = 1) -> TieredEmbedding | None:
    """The run's tiered backend from `config.tiering`, or None when every table stays in memory. `dataset` gives the
    static policy's profiling batches; `steps_per_call` (the run's, resolved) sizes the caches for a call's rows."""
    tiering = config.get("tiering")
    if not tiering:
        return None
    collection = task.collection
    tiers = resolve_tiers(table_bytes(collection, task.sparse_optimizer), tiering, jax.default_backend())
    off_memory = sorted(name for name, tier in tiers.items() if tier != "memory")
    if not off_memory:
        return None
    mesh = make_mesh(config.get("mesh", {}).get("shape", ""))
    if mesh is not None:
        _check_mesh_run(config, off_memory)
    dynamic = sorted(p.table.name for p in collection.physical_tables()
                     if p.feature in collection.aux_features and tiers[p.table.name] != "memory")
    if dynamic or (collection.aux_features and off_memory):
        raise ConfigError("tiering.tables", f"features {list(collection.aux_features)} use a dynamic method (their "
                                            "tables change shape during training), which the disk / host tier does "
                                            "not support; keep every table in memory for this run")
    batch_size = int(config.train.batch_size)
    fraction, cache_rows = float(tiering.get("cache_fraction", 0.1)), int(tiering.get("cache_rows", 0))
    if mesh is not None:  # each device block's cached rows behind a cache of its own (recjax/tiering/mesh.py)
        meshed = sharding.setup(_cached_tables_row_wise(config, task, off_memory), task)
        layouts = plan_mesh_layouts(collection, tiers, meshed.plan, batch_size, fraction, cache_rows, steps_per_call)
    else:
        layouts = plan_layouts(collection, tiers, batch_size, fraction, cache_rows, steps_per_call)
    directory, temporary = None, False
    if any(tier == "disk" for _, _, _, tier in (c for layout in layouts for c in layout.cached)):
        directory, temporary = _table_directory(str(tiering.get("dir", "")), layouts, task.sparse_optimizer)
    if mesh is not None:
        x = meshed.exchange
        return MeshTieredEmbedding(collection, task.sparse_optimizer, meshed.plan, meshed.mesh, layouts, directory,
                                   exchange_dtype=x.exchange_dtype, capacity_factor=x.capacity_factor,
                                   capacity_sigmas=x.capacity_sigmas, temporary=temporary,
                                   policy=tiering.get("policy", "lru"), prefetch=bool(tiering.get("prefetch", True)),
                                   io_threads=int(tiering.get("io_threads", 16)))
    backend = TieredEmbedding(collection, task.sparse_optimizer, layouts, directory, temporary=temporary,
                              policy=tiering.get("policy", "lru"), prefetch=bool(tiering.get("prefetch", True)),
                              io_threads=int(tiering.get("io_threads", 16)))
    if backend.policy == "static":
        if dataset is None:
            raise ConfigError("tiering.policy", "'static' needs the training data to profile its hot rows")
        backend.pinned = profile_hot_rows(lambda b: backend.put_batch(b).unique,
                                          dataset.train_batches(batch_size), layouts,
                                          int(tiering.get("profile_batches", 50)))
    return backend


def _check_mesh_run(config: ml_collections.ConfigDict, off_memory: list[str]) -> None:
    """What the disk / host tier does not do on a mesh yet, as ConfigErrors naming the key."""
    if jax.process_count() > 1:
        raise ConfigError("mesh.shape", f"tables {off_memory} are on the disk / host tier, which runs in one process "
                                        f"only (this run has {jax.process_count()}): the caches are planned from the "
                                        "whole global batch, and each process reads only its share; keep the tables "
                                        "in memory or run one process")
    if config.get("tiering", {}).get("policy", "lru") == "static":
        raise ConfigError("tiering.policy", "'static' is not supported on a mesh yet (its hot set would be profiled "
                                            "per device block); use lru or lfu")


def _cached_tables_row_wise(config: ml_collections.ConfigDict, task, off_memory: list[str]
                            ) -> ml_collections.ConfigDict:
    """The config the mesh's plan is made from: under `sharding.plan=auto`, the cached tables `sharding.tables` does
    not place are pinned row-wise -- a device's cache serves the rows it owns, and the planner would otherwise weigh
    column-wise and replicated placements, which the tier cannot serve on a mesh. Any other plan is the user's."""
    section = config.get("sharding") or ml_collections.ConfigDict()
    if section.get("plan", "auto") != "auto":
        return config
    text = section.get("tables", "")
    placed = parse_overrides(text, sharding.table_infos(task.collection, None))
    pins = [f"{name}=row" for name in off_memory if name not in placed]
    if not pins:
        return config
    config = config.copy_and_resolve_references()
    with config.unlocked():
        if "sharding" not in config:
            config.sharding = ml_collections.ConfigDict()
        config.sharding.tables = ",".join(filter(None, [text, *pins]))
    return config


def _table_directory(text: str, layouts: list[GroupLayout], optimizer) -> tuple[pathlib.Path, bool]:
    """The directory for the disk tables' files (created; "" = a new temporary one) after checking the disk has room
    for them."""
    temporary = not text
    directory = pathlib.Path(tempfile.mkdtemp(prefix="recjax-tiering-")) if temporary else pathlib.Path(text)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError("tiering.dir", f"cannot create {directory}: {error.strerror}") from error
    need = 0
    for layout in layouts:
        width = layout.dim + sum(math.prod(s[1:]) for s in optimizer.state_shapes(1, layout.dim).values())
        need += sum(rows for _, _, rows, tier in layout.cached if tier == "disk") * width * 4
    free = shutil.disk_usage(directory).free
    if need > free:
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)
        raise ConfigError("tiering.dir", f"the disk tables need {need:,} bytes in {directory} but {free:,} are free; "
                                         "free space or point tiering.dir at a larger disk")
    return directory, temporary
