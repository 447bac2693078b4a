"""Checkpoints of a whole run with Orbax: exact resume, and Check-N-Run incremental row deltas with quantization.

A checkpoint is one Orbax `CheckpointManager` step directory, `<checkpoint dir>/<step>/`, finalised atomically by
Orbax (written as `<step>.orbax-checkpoint-tmp*` and renamed when complete, so a save cut short is never loaded).
Its items, written by Orbax's handlers (arrays through tensorstore, JSON through json; nothing is pickled):

    state/  StandardSave {"step": i32[], "rng": u32[k] (the dropout key's data), "dense": {"00000": leaf, ...}
            (the leaves of (dense_params, dense_opt_state) in tree order), and in a *baseline* (kind "full") also
            "tables": {group: f32[rows, dim]} and "sparse_opt": {group: {name: f32[rows, ...]}}; with dynamic tables
            (FIITED) "aux": {feature: {name: array}} in every checkpoint, and a baseline after each compaction}
    rows/   StandardSave, only in a *delta*: {group: {"ids": i32[n] (stacked row ids, ascending), "rows": f32[n, dim]
            or, quantized, "codes": u8[n, dim * bits / 8], "offset": f32[n], "scale": f32[n], "opt": {name:
            f32[n, ...] or, quantized (`quantize_optimizer_bits`), {"codes": u8[n, dim], "absmax": f32[n]}}}} -- the
            rows touched since the previous checkpoint (consecutive) or since the baseline (one-shot), with their
            sparse-optimizer rows. Groups without touched rows are left out.
    meta/   JSON (Orbax's JSON handler, subclassed to await the checksums in its background commit): the
            format version, step, kind ("full" / "delta"), policy, `chain` (the steps whose tables this restore point
            reads, baseline first), quantize bits (rows; optimizer rows and `optimizer_codes`, {field: "signed" |
            "unsigned"}), byte counts, the sha256 of every array written, what the table arrays hold
            (`table_record`: compared with this run's before a restore reads any), the dense leaves' tree paths, the
            trainer's loop state (selection, early stopping, metrics history, train time), the resolved config and
            whether the run finished; and "sha256", the digest of all that (its canonical JSON): the metadata is
            covered by its own digest, every array by the sha256 it records.

Restore = the latest complete step: the baseline's tables, then each delta of its chain in order (rows replaced by
id), then that step's dense state, step and RNG. Every meta read (the chain's too) is checked against its own
sha256 and every array read against the sha256 in its meta; a missing or corrupt link of the chain is a
`CheckpointError` naming the step and path. Data needs no saved position: step i's batch is a pure function of
(seed, i) for synthetic and prepared data, so the trainer restarts the stream at the restored step.

Policies (Eisenman et al. 2022, "Check-N-Run", Sec. 4): "full" (every checkpoint a baseline), "one_shot" (one
baseline, then cumulative deltas since it: each restore point reads 2 steps), "consecutive" (per-interval deltas;
restore reads the whole chain) and "intermittent" (consecutive, with a new baseline once the chain's delta bytes
exceed `baseline_fraction` of the baseline's). The dirty-row bitmap (bool[rows] per stacked group) lives in the
TrainState and is set inside the jitted train step (`mark_dirty_rows`); a save reads it and clears it (one-shot:
only at a baseline). Deltas may quantize their table rows (`quantize_bits`: Check-N-Run's row-wise asymmetric codes)
and their optimizer rows (`quantize_optimizer_bits`: block-wise 8-bit dynamic codes, Dettmers et al. 2022, one block
per row; unsigned for non-negative state): with lazy Adam the two moments are 2/3 of a delta's f32 bytes.

Async saves: the loop waits only for host copies of the tables (the next step donates the originals), made into
buffers kept from save to save (a table's size of host memory, held between saves); Orbax's save call runs on a
worker thread and writes in the background, the sha256s are computed on another worker and awaited by the meta
handler before Orbax finalises the step. The next save (or `close`) first waits for this one.

Mesh runs (one process, several devices): the state's tables are the plan's storages ("<group>/<kind>", written
"<group>~<kind>" in the items), global arrays whose blocks live on their devices; the dirty-row bitmaps are split like
their rows and set by each row's owner inside the sharded step. A save reads each device's block where it lives (host
copies and delta gathers per shard, never a gather of the whole table on one device). `meta["layout"]` records the
plan's layout (None on one device): a restore under another layout -- another mesh shape or plan, or one device --
converts the tables and optimizer rows through the single-device layout (`restore_state`'s `relayout`, given by
the trainer from recjax/sharding) and the next save starts a new baseline.

Multi-process runs: a baseline's tables are global arrays (device copies) that Orbax writes by blocks, each process
its own; a delta's ids / rows / optimizer rows are global arrays too, every row block's marked rows padded to the
largest count of any block (ids -1). meta marks them "blocks" and the `digests` item holds each block's sha256
(u8[R, 32 C], placed like the array), checked by whoever reads the block. Saves are synchronous there: Orbax
synchronises the processes with device collectives, which must come in the same order as the steps' (from its
background thread they crossed them and both processes waited forever).
"""

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from recjax import checkpoint_blocks as blocks
from recjax import quantize
from recjax.config_check import _get, boolean, check_number, choice, integer, known_keys
from recjax.errors import CheckpointError, ConfigError

# 2: meta holds its own sha256 and what each table array holds (`table_record`); format 1 had neither.
FORMAT_VERSION = 2
POLICIES = ("full", "one_shot", "consecutive", "intermittent")
QUANTIZE_BITS = (0, 2, 4, 8)
QUANTIZE_OPTIMIZER_BITS = (0, *quantize.STATE_BITS)
KEYS = {"enabled", "dir", "every_steps", "every_minutes", "keep", "async_save", "policy", "baseline_fraction",
        "quantize_bits", "quantize_optimizer_bits", "restore"}
# Config keys that may change between a run and its resumption (everything else must match).
# The mesh and plan may change too: the tables are re-laid out on restore.
RESUMABLE_CHANGES = ("checkpoint.", "train.progress_bar", "mesh.", "sharding.")
_ITEMS = ("state", "rows", "meta", "digests")
# Multi-process runs decide time-based saves together (process 0's clock) every this many steps.
AGREE_EVERY_STEPS = 20
BLOCKS = "blocks"  # meta["arrays"] marker: an array saved by blocks (each process its own), checked by digests
DIGESTS = "digests"  # meta["arrays"] marker: the sha256s of those blocks (the `digests` item)
META_DIGEST = "sha256"  # meta's own key: the sha256 of everything else in it (`_meta_digest`)


def check_checkpoint_config(config: Mapping) -> None:
    """ConfigError naming the first bad `checkpoint.*` key."""
    known_keys(config, "checkpoint", KEYS)
    boolean(config, "checkpoint.enabled")
    for key in ("dir", "restore"):
        value = _get(config, f"checkpoint.{key}")
        if not isinstance(value, str):
            raise ConfigError(f"checkpoint.{key}", f"must be a path (a string), got {value!r}")
    integer(config, "checkpoint.every_steps", 0)
    check_number("checkpoint.every_minutes", _get(config, "checkpoint.every_minutes"), at_least=0)
    integer(config, "checkpoint.keep", 1)
    boolean(config, "checkpoint.async_save")
    choice(config, "checkpoint.policy", POLICIES)
    check_number("checkpoint.baseline_fraction", _get(config, "checkpoint.baseline_fraction"), above=0)
    bits = _get(config, "checkpoint.quantize_bits")
    if bits not in QUANTIZE_BITS or isinstance(bits, bool):
        raise ConfigError("checkpoint.quantize_bits", f"must be one of {list(QUANTIZE_BITS)} (0 = f32), got {bits!r}")
    if bits and _get(config, "checkpoint.policy") == "full":
        raise ConfigError("checkpoint.quantize_bits", f"{bits} quantizes the rows of deltas, but checkpoint.policy "
                                                      "'full' writes none; set checkpoint.policy to 'one_shot', "
                                                      "'consecutive' or 'intermittent' (or quantize_bits to 0)")
    bits = _get(config, "checkpoint.quantize_optimizer_bits")
    if bits not in QUANTIZE_OPTIMIZER_BITS or isinstance(bits, bool):
        raise ConfigError("checkpoint.quantize_optimizer_bits",
                          f"must be one of {list(QUANTIZE_OPTIMIZER_BITS)} (0 = f32), got {bits!r}")
    if bits and _get(config, "checkpoint.policy") == "full":
        raise ConfigError("checkpoint.quantize_optimizer_bits",
                          f"{bits} quantizes the optimizer rows of deltas, but checkpoint.policy 'full' writes none; "
                          "set checkpoint.policy to 'one_shot', 'consecutive' or 'intermittent' (or "
                          "quantize_optimizer_bits to 0)")


# ------------------------------------------------------------------------------------------ dirty rows
def _table_shapes(state) -> dict[str, tuple[int, ...]]:
    return {g: tuple(t.shape) for g, t in state.tables.items()}


def _row_sharding(table: jax.Array):
    """Where a per-row array of `table` lives: split like its rows on a mesh (replicated when the rows are not split,
    e.g. a column-wise table), else the table's device."""
    sharding = table.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[:1]))
    return sharding


@functools.partial(jax.jit, static_argnums=(0, 1))
def _zeros(rows: int, sharding) -> jax.Array:
    """bool[rows] of zeros made where `sharding` puts them (each process its blocks)."""
    return jax.lax.with_sharding_constraint(jnp.zeros(rows, jnp.bool_), sharding)


def _encode(key: str) -> str:
    """A table key as an item key: a mesh run's storages are named "<group>/<kind>", and "/" separates tree levels."""
    return key.replace("/", "~")


def _decode(tree: Mapping) -> dict:
    return {k.replace("~", "/"): v for k, v in tree.items()}


def mark_dirty_rows(dirty: Mapping[str, jax.Array], touched: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Set the bitmap bool[rows] of each tracked group at the rows the step updated (`collection.touched_rows`;
    duplicates are harmless, the sentinel row id `rows`, padding, is dropped). Inside the jitted step, with the
    bitmap donated: O(ids in the batch)."""
    return {g: d.at[touched[g]].set(True, mode="drop") for g, d in dirty.items()}


def _gather_rows(array: jax.Array, ids: np.ndarray) -> np.ndarray:
    """array[ids] on the host, gathered on the device(s) holding the rows (a sharded array: each block gathers its
    own rows, on its device); ids padded to a power of two so few shapes compile."""
    if len(array.sharding.device_set) == 1:
        return blocks.gather_block(array, ids)
    out = np.zeros((len(ids), *array.shape[1:]), array.dtype)
    for shard in array.addressable_shards:
        if shard.replica_id:
            continue
        rows, *rest = shard.index
        start, stop, _ = rows.indices(array.shape[0])
        mine = np.flatnonzero((ids >= start) & (ids < stop))
        if len(mine):
            out[(mine, *rest)] = blocks.gather_block(shard.data, ids[mine] - start)
    return out


# --------------------------------------------------------------------------------------------- helpers
def _sha256(array: np.ndarray) -> str:
    return blocks.digest(array).hex()


def _flat(tree: Mapping, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _describe_arrays(item: str, tree: Mapping) -> dict[str, list]:
    """{item/path: [dtype, shape, sha256]} for every array of an item; an array spread over processes has
    "blocks" instead of a sha256: its blocks' sha256s are the `digests` item (`blocks.block_digests`)."""
    return {f"{item}/{p}": [str(a.dtype), list(a.shape), BLOCKS] if blocks.is_global(a) else
            [str(np.asarray(a).dtype), list(np.shape(a)), _sha256(np.asarray(a))] for p, a in _flat(tree).items()}


def _meta_digest(meta: Mapping) -> str:
    """The sha256 of `meta` without its own digest, as canonical JSON (sorted keys, no spaces) of what JSON reads back
    (tuples become lists, keys strings), so the dict saved and the dict read hash alike. The arrays' sha256s are in
    meta, so this one digest covers every byte a restore uses."""
    content = json.loads(json.dumps({k: v for k, v in meta.items() if k != META_DIGEST}))
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _local(array) -> np.ndarray:
    """The host value of an array every process holds whole (a replicated multi-process array: its local copy)."""
    if blocks.is_global(array):
        return np.array(array.addressable_data(0))
    return np.array(array)


class _Checksums:
    """meta["arrays"] ({item/path: [dtype, shape, sha256]}), hashed on a worker thread while the save goes on; the
    meta handler below waits for it in Orbax's background commit, so the train loop never does."""

    _pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="recjax-sha256")

    def __init__(self, items: Mapping[str, Mapping], extra: Mapping[str, list] | None = None):
        self._future = self._pool.submit(lambda: {**{k: v for item, tree in items.items()
                                                     for k, v in _describe_arrays(item, tree).items()},
                                                  **(extra or {})})

    def result(self) -> dict:
        return self._future.result()


def _meta_handler_types():
    """The meta item's handler and args: Orbax's JSON handler, saving once the checksums are ready. Registered on
    first use (orbax is imported lazily)."""
    global _META_TYPES
    if _META_TYPES is None:
        import orbax.checkpoint as ocp

        class MetaHandler(ocp.handlers.JsonCheckpointHandler):
            async def _save_fn(self, x, directory):
                if isinstance(x.get("arrays"), _Checksums):
                    x = {**x, "arrays": x["arrays"].result()}
                # Inside the item, so Orbax's atomic finalize covers the digest with the content it hashes.
                await super()._save_fn({**x, META_DIGEST: _meta_digest(x)}, directory)

        @ocp.args.register_with_handler(MetaHandler, for_save=True)
        @dataclasses.dataclass
        class MetaSave(ocp.args.CheckpointArgs):
            item: dict

        @ocp.args.register_with_handler(MetaHandler, for_restore=True)
        @dataclasses.dataclass
        class MetaRestore(ocp.args.CheckpointArgs):
            item: dict | None = None

        _META_TYPES = (MetaSave, MetaRestore)
    return _META_TYPES


_META_TYPES = None


# ---------------------------------------------------------------------------------------- table records
def table_record(collection, optimizer, state) -> dict:
    """What the table arrays of a checkpoint hold (meta["tables"]), compared with this run's before a restore reads
    any: tables of equal dim share one stacked array, so equal shapes do not mean equal tables.

        "features": {feature: {"method", "vocab_size", "dim",
                               "physical_tables": [{"name", "rows", "dim", "group", "offset"}, ...]}}
        "groups": {group: {"rows", "dim", "dtype", "sparse_opt": {field: [dtype, shape per row]}}}
        "sparse_optimizer": its name

    `offset` is the table's first row in its stacked group; a mesh run's storages are a function of these and of
    meta["layout"]'s placements (`sharding.relayout` rebuilds them). `state` (arrays or shapes; keyed by group, or
    by storage "<group>/<kind>" on a mesh) gives the dtypes."""
    dtypes = {key.split("/")[0]: str(t.dtype) for key, t in state.tables.items()}
    field_dtypes = {(key.split("/")[0], f): str(v.dtype) for key, fields in state.sparse_opt_state.items()
                    for f, v in fields.items()}
    features: dict[str, dict] = {}
    for p in collection.physical_tables():  # in stacking order
        spec = collection.table_specs[p.feature]
        entry = features.setdefault(p.feature, {"method": spec.method, "vocab_size": spec.vocab_size, "dim": spec.dim,
                                                "physical_tables": []})
        entry["physical_tables"].append({"name": p.table.name, "rows": p.table.rows, "dim": p.table.dim,
                                         "group": p.group, "offset": p.offset})
    groups = {}
    for g in sorted(collection.group_rows):
        shapes = optimizer.state_shapes(1, collection.group_dims[g])
        groups[g] = {"rows": collection.group_rows[g], "dim": collection.group_dims[g], "dtype": dtypes.get(g),
                     "sparse_opt": {f: [field_dtypes.get((g, f)), list(shape[1:])]
                                    for f, shape in sorted(shapes.items())}}
    return {"features": features, "groups": groups, "sparse_optimizer": optimizer.name}


def table_differences(saved: Mapping, now: Mapping) -> list[str]:
    """What differs between a checkpoint's table record and this run's, "saved -> now", one entry per logical table
    (or stacked group, or the optimizer); [] when the checkpoint's arrays hold exactly this run's tables."""
    out = []
    if saved["sparse_optimizer"] != now["sparse_optimizer"]:
        out.append(f"sparse optimizer {saved['sparse_optimizer']} -> {now['sparse_optimizer']}")
    features = [*saved["features"], *(f for f in now["features"] if f not in saved["features"])]
    for f in features:
        a, b = saved["features"].get(f), now["features"].get(f)
        if a is None or b is None:
            out.append(f"table {f}: {'not in the checkpoint' if a is None else 'not in this config'}")
            continue
        what = [f"{k} {a[k]} -> {b[k]}" for k in ("method", "vocab_size", "dim") if a[k] != b[k]]
        names = [[t["name"] for t in x["physical_tables"]] for x in (a, b)]
        if names[0] != names[1]:
            what.append(f"physical tables {names[0]} -> {names[1]}")
        else:
            for ta, tb in zip(a["physical_tables"], b["physical_tables"], strict=True):
                what += [f"{ta['name']} {k} {ta[k]} -> {tb[k]}" for k in ("rows", "dim", "group", "offset")
                         if ta[k] != tb[k]]
        if what:
            out.append(f"table {f}: {', '.join(what)}")
    for g in [*saved["groups"], *(g for g in now["groups"] if g not in saved["groups"])]:
        a, b = saved["groups"].get(g), now["groups"].get(g)
        if a is None or b is None:
            continue  # its tables differ (above)
        what = [f"dtype {a['dtype']} -> {b['dtype']}"] if a["dtype"] != b["dtype"] else []
        if a["sparse_opt"] != b["sparse_opt"] and saved["sparse_optimizer"] == now["sparse_optimizer"]:
            what.append(f"sparse optimizer state {a['sparse_opt']} -> {b['sparse_opt']}")
        if what:
            out.append(f"stacked group {g}: {', '.join(what)}")
    return out


def _config_dict(config: ml_collections.ConfigDict) -> dict:
    return json.loads(config.to_json_best_effort(sort_keys=True))


def _flatten_config(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: Mapping, current: Mapping) -> list[str]:
    """Dotted keys whose values differ, ignoring those a resumed run may change (RESUMABLE_CHANGES)."""
    a, b = _flatten_config(saved), _flatten_config(current)
    return sorted(k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>")
                  and not k.startswith(RESUMABLE_CHANGES))


def _manager(directory: pathlib.Path, *, read_only: bool = False, async_save: bool = True):
    import orbax.checkpoint as ocp

    # Retention is ours (a delta chain must keep its baseline: Checkpointer._settle). Leftovers of saves cut short are
    # never complete: a writer removes them. Readers (another run's checkpoints) change nothing; Orbax's read_only
    # option would log warnings on every open, so they are plain managers that never save.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None, create=not read_only, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only, enable_background_delete=async_save)
    return ocp.CheckpointManager(directory, options=options, item_names=_ITEMS)


class _Store:
    """One checkpoint directory behind its Orbax manager: step metadata (cached) and checked item reads."""

    def __init__(self, directory: pathlib.Path, *, read_only: bool = False, async_save: bool = True):
        self.directory = directory
        self.manager = _manager(directory, read_only=read_only, async_save=async_save)
        self._metas: dict[int, dict] = {}

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def remember(self, step: int, meta: dict) -> None:
        self._metas[step] = meta

    def delete(self, step: int) -> None:
        self.manager.delete(step)
        self._metas.pop(step, None)

    def meta(self, step: int) -> dict:
        cached = self._metas.get(step)
        if cached is not None and isinstance(cached["arrays"], _Checksums):  # saved by this process
            self._metas[step] = {**cached, "arrays": cached["arrays"].result()}
        if step not in self._metas:
            meta = self.item(step, "meta")
            where = self.directory / str(step) / "meta" / "metadata"  # Orbax's JSON handler's file
            if not isinstance(meta, dict) or "format" not in meta:
                raise CheckpointError(f"checkpoint step {step}: {where} is not a recjax checkpoint's metadata; use "
                                      "a new workdir")
            if meta["format"] != FORMAT_VERSION:
                raise CheckpointError(
                    f"checkpoint step {step}: {where} is of checkpoint format {meta['format']}, this recjax reads "
                    f"format {FORMAT_VERSION} only (it checks a digest of the metadata and what each table array "
                    "holds, which older checkpoints do not record); restore it with the recjax that wrote it, or "
                    "train from scratch in a new workdir")
            if meta.get(META_DIGEST) != _meta_digest(meta):
                raise CheckpointError(f"checkpoint step {step}: {where} does not match the sha256 recorded in it (it "
                                      f"was changed after the save); the checkpoint is corrupt. {self._todo(step)}")
            self._metas[step] = meta
        return self._metas[step]

    def _todo(self, step: int) -> str:
        return (f"Delete {self.directory / str(step)} (and the later steps built on it) to resume from an earlier "
                "checkpoint, or use a new workdir")

    def item(self, step: int, item: str, meta: dict | None = None, placed: Mapping | None = None):
        """One item of a step, its arrays checked against the sha256, dtype and shape recorded in `meta`. Arrays a
        multi-process run saved by blocks are read where `placed` ({path: sharding}) puts them -- each process its
        blocks --, else whole, as numpy, and each block is checked against the step's `digests` item."""
        import orbax.checkpoint as ocp

        where = self.directory / str(step) / item
        todo = self._todo(step)
        if not where.exists():
            raise CheckpointError(f"checkpoint step {step}: {where} is missing; the checkpoint is incomplete or was "
                                  f"deleted. {todo}")
        expected = {k: v for k, v in (meta or {}).get("arrays", {}).items() if k.startswith(f"{item}/")}
        blocked = sorted(k[len(item) + 1:] for k, v in expected.items() if v[2] == BLOCKS)
        marked = {k: v[2] for k, v in expected.items() if v[2] in (BLOCKS, DIGESTS)}
        restore = (_meta_handler_types()[1]() if item == "meta" else
                   ocp.args.StandardRestore(_target(expected, item, placed or {})) if marked else
                   ocp.args.StandardRestore())
        try:
            value = getattr(self.manager.restore(step, args=ocp.args.Composite(**{item: restore})), item)
        except Exception as error:
            raise CheckpointError(f"checkpoint step {step}: cannot read {where} ({type(error).__name__}: "
                                  f"{str(error)[:300]}); it is corrupt. {todo}") from error
        if meta is None:
            return value
        found = _describe_arrays(item, value)
        for path, marker in marked.items():  # blocks are checked against the digests below
            if path in found:
                found[path][2] = marker
        for path in sorted(set(expected) | set(found)):
            if expected.get(path) != found.get(path):
                what = "is missing" if path not in found else ("is unexpected" if path not in expected else
                                                               "does not match the sha256 / dtype / shape in its meta")
                raise CheckpointError(f"checkpoint step {step}: array {path} in {where} {what}; the checkpoint is "
                                      f"corrupt. {todo}")
        if blocked:
            arrays = _flat(value)
            placed_digests = {f"{item}/{p}": blocks.digest_sharding(arrays[p].sharding)
                              for p in blocked if blocks.on_mesh(arrays[p])}
            digests = _flat(self.item(step, "digests", meta, placed_digests))
            for p in blocked:
                try:
                    blocks.check_blocks(arrays[p], digests[f"{item}/{p}"],
                                  f"checkpoint step {step}: array {item}/{p} in {where}")
                except CheckpointError as error:
                    raise CheckpointError(f"{error}; the checkpoint is corrupt. {todo}") from None
        return value


def _target(expected: Mapping[str, list], item: str, placed: Mapping) -> dict:
    """The restore target of an item from its arrays in meta ({item/path: [dtype, shape, ...]}): an abstract array
    with the sharding `placed[path]` where given (each process reads its blocks), else numpy (the whole array)."""
    targets = {}
    for key, (dtype, shape, _) in expected.items():
        path = key[len(item) + 1:]
        targets[path] = (jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=placed[path]) if path in placed
                         else np.empty(shape, dtype))
    return _unflat(targets)


@dataclasses.dataclass
class ResumePoint:
    """A complete checkpoint to start from: its store (this run's or another run's), step and metadata."""

    store: _Store
    step: int
    meta: dict
    own: bool  # in this run's checkpoint dir (False: config.checkpoint.restore)

    @property
    def finished(self) -> bool:
        return bool(self.meta.get("finished"))


def _check_chain(point: ResumePoint) -> None:
    store, step = point.store, point.step
    present = set(store.steps())
    for s in point.meta["chain"]:
        if s not in present:
            raise CheckpointError(f"checkpoint step {step} in {store.directory} builds on step {s}, whose directory "
                                  f"{store.directory / str(s)} is missing or incomplete; delete "
                                  f"{store.directory / str(step)} to resume from an earlier checkpoint, or use a new "
                                  "workdir")


def _chain_tables(point: ResumePoint, top: dict, placed: Mapping | None = None) -> tuple[dict, dict]:
    """Tables and sparse-optimizer state of `point`: its baseline's, then each delta of its chain in order (rows
    replaced by id; quantized rows dequantized; ids -1 pad a multi-process run's blocks). With `placed` (a
    multi-process restore: {"tables/<g>": sharding, ...} of this run's state) every process reads the blocks its
    devices hold and applies each delta there; else everything is read whole, as numpy."""
    store, chain = point.store, point.meta["chain"]
    base = top if chain[0] == point.step else store.item(chain[0], "state", store.meta(chain[0]), placed)
    if placed:
        tables = _decode(base["tables"])
        sparse_opt = {g: dict(o) for g, o in _decode(base.get("sparse_opt", {})).items()}
    else:
        tables = {g: np.array(t) for g, t in _decode(base["tables"]).items()}
        sparse_opt = {g: {k: np.array(v) for k, v in o.items()} for g, o in _decode(base.get("sparse_opt", {})).items()}
    for s in chain[1:]:
        delta_meta = store.meta(s)
        bits = delta_meta["quantize_bits"]
        where = _delta_shardings(tables, sparse_opt) if placed else None
        rows = _decode(store.item(s, "rows", delta_meta, where)) if delta_meta["groups"] else {}
        codes = delta_meta["optimizer_codes"]  # {field: "signed" | "unsigned"}: stored in 8-bit dynamic codes
        for g, part in rows.items():
            if placed:
                tables[g] = blocks.apply_blocks(tables[g], part["ids"], blocks.block_values(part, bits, tables[g]))
                for k, v in part.get("opt", {}).items():
                    values = (blocks.state_block_values(v, codes[k] == "signed") if k in codes else
                              {b.device: np.asarray(b.data) for b in v.addressable_shards})
                    sparse_opt[g][k] = blocks.apply_blocks(sparse_opt[g][k], part["ids"], values)
                continue
            ids = np.asarray(part["ids"])
            valid = ids >= 0
            values = _dequantize(part, bits, tables[g].shape[1]) if "codes" in part else np.asarray(part["rows"])
            tables[g][ids[valid]] = values[valid]
            for k, v in part.get("opt", {}).items():
                values = _dequantize_state(v, codes[k] == "signed") if k in codes else np.asarray(v)
                sparse_opt[g][k][ids[valid]] = values[valid]
    return tables, sparse_opt


def _dequantize(part: Mapping, bits: int, dim: int) -> np.ndarray:
    """A delta's quantized rows f32[n, dim]; a column-split table's blocks were quantized each on its own (offset
    and scale f32[n, C] for C column blocks)."""
    offset, scale, codes = (np.asarray(part[k]) for k in ("offset", "scale", "codes"))
    if offset.ndim == 1:
        return quantize.dequantize_rows(part, bits, dim)
    c_blocks, width = offset.shape[1], codes.shape[1] // offset.shape[1]
    return np.concatenate([quantize.dequantize_rows({"codes": codes[:, c * width:(c + 1) * width],
                                                     "offset": offset[:, c], "scale": scale[:, c]}, bits,
                                                    dim // c_blocks) for c in range(c_blocks)], axis=1)


def _dequantize_state(part: Mapping, signed: bool) -> np.ndarray:
    """A delta's optimizer rows f32[n, ...] from their dynamic codes; a column-split field's blocks were quantized each
    on its own (absmax f32[n, C] for C column blocks)."""
    codes, absmax = np.asarray(part["codes"]), np.asarray(part["absmax"])
    if absmax.ndim == 1:
        return quantize.dequantize_state_rows({"codes": codes, "absmax": absmax}, signed)
    width = codes.shape[1] // absmax.shape[1]
    return np.concatenate([quantize.dequantize_state_rows({"codes": codes[:, c * width:(c + 1) * width],
                                                           "absmax": absmax[:, c]}, signed)
                           for c in range(absmax.shape[1])], axis=1)


# ------------------------------------------------------------------------- multi-process deltas, by blocks
def _delta_shardings(tables: Mapping, sparse_opt: Mapping) -> dict:
    """Where each array of a multi-process delta goes ({path in the rows item: sharding}): ids split like the table's
    rows, rows / codes like the table, offset / scale like its (row, column) blocks, optimizer rows like theirs."""
    out = {}
    for g, t in tables.items():
        spec = (*tuple(t.sharding.spec), None)
        key = _encode(g)
        out[f"{key}/ids"] = jax.sharding.NamedSharding(t.sharding.mesh, jax.sharding.PartitionSpec(spec[0]))
        out[f"{key}/rows"] = out[f"{key}/codes"] = t.sharding
        out[f"{key}/offset"] = out[f"{key}/scale"] = blocks.digest_sharding(t.sharding)
        out.update({f"{key}/opt/{k}": v.sharding for k, v in sparse_opt[g].items()})
        out.update({f"{key}/opt/{k}/codes": v.sharding for k, v in sparse_opt[g].items()})  # quantized: by blocks too
        out.update({f"{key}/opt/{k}/absmax": blocks.digest_sharding(v.sharding) for k, v in sparse_opt[g].items()})
    return out


def read_arrays(point: ResumePoint) -> dict[str, np.ndarray]:
    """Every array a restore of `point` yields, by name ("step", "rng", "dense/<tree path>", "tables/<group>",
    "sparse_opt/<group>/<name>"), without building a model: for tests, benchmarks and inspection."""
    _check_chain(point)
    top = point.store.item(point.step, "state", point.meta)
    tables, sparse_opt = _chain_tables(point, top)
    dense = _dense_values(top, point.meta)
    return {"step": np.asarray(top["step"]), "rng": np.asarray(top["rng"]),
            **{f"dense/{p}": np.asarray(a) for p, a in zip(point.meta["dense_paths"], dense, strict=True)},
            **{f"tables/{g}": t for g, t in tables.items()},  # mesh runs: by storage, "<group>/<kind>"
            **{f"sparse_opt/{g}/{k}": v for g, s in sparse_opt.items() for k, v in s.items()},
            **{f"aux/{f}/{k}": np.asarray(v) for f, a in top.get("aux", {}).items() for k, v in a.items()}}


def restore_state(point: ResumePoint, like, relayout=None, *, record: Mapping):
    """The TrainState of `point` (without dirty-row bitmaps); `like` is a TrainState of this config (arrays or
    shapes) that gives the tree structure, the shape every array must have and, for arrays on a mesh, where they
    go; `record` is this run's `table_record`, which the checkpoint's must equal before any array is read.
    `relayout(by_key, saved_layout)` maps tables (or one optimizer field) {key: array} saved under
    `point.meta["layout"]` to this run's layout (None: the same layout)."""
    store, meta, step = point.store, point.meta, point.step
    differences = table_differences(meta["tables"], record)
    if differences:
        shown = "; ".join(differences[:6]) + (f"; and {len(differences) - 6} more" if len(differences) > 6 else "")
        raise CheckpointError(f"checkpoint step {step} in {store.directory} holds other embedding tables than this "
                              f"config builds (saved -> now: {shown}), so their rows would load into the wrong "
                              "features; restore it with the config that trained it, or train from scratch")
    other_model = (f"checkpoint step {step} in {store.directory} holds another model than this config builds "
                   "({}); restore it with its own config")
    paths, like_leaves, treedef = _dense_leaves(like)
    if meta["dense_paths"] != paths:
        first = next((a, b) for a, b in zip(meta["dense_paths"] + [None], paths + [None], strict=False) if a != b)
        raise CheckpointError(other_model.format(f"dense parameters / optimizer state differ at {first[0]} vs "
                                                 f"{first[1]}"))
    _check_chain(point)
    # Saved by blocks (a multi-process run) and restored by processes: each reads the blocks its devices hold.
    distributed = jax.process_count() > 1 and _by_blocks(meta)
    placed = {}
    if distributed:
        placed = {f"tables/{_encode(g)}": t.sharding for g, t in like.tables.items()}
        placed.update({f"sparse_opt/{_encode(g)}/{k}": v.sharding for g, o in like.sparse_opt_state.items()
                       for k, v in o.items()})
    top = store.item(step, "state", meta, placed)
    for i, (path, leaf) in enumerate(zip(paths, like_leaves, strict=True)):
        saved = _dense_values(top, meta)[i]
        if tuple(np.shape(saved)) != tuple(leaf.shape):
            raise CheckpointError(other_model.format(f"{path} has shape {np.shape(saved)}, not {tuple(leaf.shape)}"))
    tables, sparse_opt = _chain_tables(point, top, placed)
    if relayout is not None and not distributed:
        tables = relayout(tables, meta.get("layout"))
        fields = sorted({k for opt in sparse_opt.values() for k in opt})
        by_field = {k: relayout({g: opt[k] for g, opt in sparse_opt.items()}, meta.get("layout")) for k in fields}
        sparse_opt = {g: {k: by_field[k][g] for k in fields} for g in tables}
    for g, t in like.tables.items():
        if g not in tables or tables[g].shape != tuple(t.shape):
            raise CheckpointError(other_model.format(f"table group {g}: {tables[g].shape if g in tables else None}, "
                                                     f"not {tuple(t.shape)}"))
    for g, opt in like.sparse_opt_state.items():
        for k, v in opt.items():
            if k not in sparse_opt.get(g, {}) or sparse_opt[g][k].shape != tuple(v.shape):
                raise CheckpointError(other_model.format(f"sparse optimizer state {g}/{k}"))
    aux = top.get("aux", {})
    for f, arrays in like.aux.items():
        for k, v in arrays.items():
            if k not in aux.get(f, {}) or tuple(np.shape(aux[f][k])) != tuple(v.shape):
                raise CheckpointError(other_model.format(f"routing array {f}/{k} of a dynamic table"))
    dense_params, dense_opt_state = jax.tree_util.tree_unflatten(
        treedef, [_put(v, leaf) for v, leaf in zip(_dense_values(top, meta), like_leaves, strict=True)])
    return like.replace(
        step=_put(np.asarray(top["step"], np.int32), like.step),
        dense_params=dense_params, dense_opt_state=dense_opt_state,
        tables={g: _put(tables[g], t) for g, t in like.tables.items()},
        sparse_opt_state={g: {k: _put(sparse_opt[g][k], v) for k, v in opt.items()}
                          for g, opt in like.sparse_opt_state.items()},
        dropout_rng=_put(jax.random.wrap_key_data(jnp.asarray(top["rng"]), impl=meta["rng_impl"]), like.dropout_rng),
        dirty_rows={}, aux={f: {k: jnp.asarray(aux[f][k], v.dtype) for k, v in a.items()} for f, a in like.aux.items()})


def _put(value, like):
    """`value` as a device array placed like `like` (a mesh array: the same sharding, each device receiving its
    block of the host value every process holds; else the default device)."""
    sharding = getattr(like, "sharding", None)
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if isinstance(sharding, jax.sharding.NamedSharding):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(_put(np.asarray(jax.random.key_data(value)), like),
                                            impl=jax.random.key_impl(value))
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jnp.asarray(value)


def _by_blocks(meta: Mapping) -> bool:
    """Whether a checkpoint's arrays were saved by blocks (a multi-process run)."""
    return any(v[2] == BLOCKS for v in meta["arrays"].values())


def open_checkpoint(path: str | pathlib.Path, step: int | None = None) -> ResumePoint:
    """A checkpoints dir's latest complete step, or `step`, or the step named by a step dir's path."""
    p = pathlib.Path(path).expanduser().absolute()
    if not p.is_dir():
        raise CheckpointError(f"{p} is not a directory; give a run's checkpoints dir (<workdir>/checkpoints) or one "
                              "step in it (<workdir>/checkpoints/<step>)")
    if step is None and p.name.isdigit() and (p / "meta").is_dir():
        p, step = p.parent, int(p.name)
    store = _Store(p, read_only=True)
    steps = store.steps()
    if not steps:
        raise CheckpointError(f"{p} holds no complete checkpoint")
    step = max(steps) if step is None else step
    if step not in steps:
        raise CheckpointError(f"{p} has no complete checkpoint of step {step}; it has {steps}")
    return ResumePoint(store, step, store.meta(step), own=False)


# ------------------------------------------------------------------------------------------ checkpointer
class Checkpointer:
    """Saves and restores the trainer's state per `config.checkpoint` in `<workdir>/checkpoints` (or `dir`)."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: pathlib.Path):
        ck = config.checkpoint
        self.config_dict = _config_dict(config)
        self.directory = pathlib.Path(ck.dir or pathlib.Path(workdir) / "checkpoints").expanduser().absolute()
        self.every_steps = int(ck.every_steps)
        self.every_seconds = 60.0 * float(ck.every_minutes)
        self.keep = int(ck.keep)
        self.policy = ck.policy
        self.baseline_fraction = float(ck.baseline_fraction)
        self.bits = int(ck.quantize_bits)
        self.optimizer_bits = int(ck.quantize_optimizer_bits)
        self.restore_from = ck.restore
        self.async_save = bool(ck.async_save)
        if jax.process_count() > 1:
            # Orbax synchronises processes with device collectives, from its background thread during an async save:
            # they can cross the train step's collectives in another order on another process, and both wait forever
            # (seen with 2 processes under load). Synchronous saves keep every collective on the loop's thread.
            self.async_save = False
        self.store = _Store(self.directory, async_save=self.async_save)
        self.last_save_time = time.monotonic()
        self.last_saved_step: int | None = None
        self.save_stall_s: list[float] = []  # per save: how long the train loop waited (the benchmark reads it)
        # The chain the next delta extends ([baseline, deltas...]), its baseline's and its deltas' table bytes.
        self._chain: list[int] | None = None
        self._baseline_bytes = 0
        self._chain_bytes = 0
        self._baseline_shapes: dict[str, tuple[int, ...]] = {}  # table shapes of the chain's baseline
        self._host: dict[str, np.ndarray] = {}  # host buffers of the baselines' tables (`_host_copy`)
        self._saver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-save")
        self._copy_workers = os.cpu_count() or 1
        self._copier = concurrent.futures.ThreadPoolExecutor(self._copy_workers, thread_name_prefix="checkpoint-copy")
        self._saving: concurrent.futures.Future | None = None  # the async save call in flight
        self._pending_retain = False
        self.layout: dict | None = None  # the tables' layout on a mesh (the trainer sets it; None on one device)
        self.task = None  # the run's Task: what its tables hold (`table_record`); the trainer sets it
        self.relayout = None  # (by_key, saved layout) -> by_key in this run's layout (the trainer sets it)

    # ---------------------------------------------------------------------------------------- resume
    def resume_point(self) -> ResumePoint | None:
        """The latest complete checkpoint of this run, else `checkpoint.restore`'s, else None. A checkpoint in this
        run's dir from a run with another config is an error naming the keys that differ."""
        steps = self.store.steps()
        if steps:
            meta = self.store.meta(steps[-1])
            diff = config_differences(meta["config"], self.config_dict)
            if diff:
                saved, now = _flatten_config(meta["config"]), _flatten_config(self.config_dict)
                shown = ", ".join(f"{k} {saved.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r}" for k in diff[:5])
                raise CheckpointError(f"{self.directory} holds checkpoints of a run with another config ({shown}); "
                                      f"use a new workdir (--config.checkpoint.restore={self.directory} there starts "
                                      "from this run's state), or delete the checkpoints to train from scratch")
            return ResumePoint(self.store, steps[-1], meta, own=True)
        if not self.restore_from:
            return None
        try:
            return open_checkpoint(self.restore_from)
        except CheckpointError as error:
            raise CheckpointError(f"checkpoint.restore: {error}") from None

    def restore(self, point: ResumePoint, like) -> tuple[Any, dict]:
        """(TrainState, the trainer's loop state) of `point`, with dirty-row bitmaps as the policy needs. The loop
        state (selection, early stopping, metrics history, times) is the checkpoint's when this run resumes itself,
        and {} for another run's checkpoint (`checkpoint.restore`): its history is not this run's."""
        if jax.process_count() > 1 and _by_blocks(point.meta) and point.meta.get("layout") != self.layout:
            raise CheckpointError(f"checkpoint step {point.step} in {point.store.directory} was saved by a "
                                  "multi-process run on another mesh or plan; restore it on the same mesh.shape and "
                                  "sharding.*, or in one process (which re-lays its tables out)")
        try:
            state = self.track(restore_state(point, like, self.relayout, record=self._record(like)))
        except CheckpointError as error:
            if point.own:
                raise
            raise CheckpointError(f"checkpoint.restore: {error}") from None
        self._baseline_shapes = _table_shapes(state)  # the chain restored reads tables of these shapes
        meta = point.meta
        # Another layout (or number of processes, which changes how deltas are written): a new baseline next.
        if point.own and meta.get("layout") == self.layout and meta.get("processes", 1) == jax.process_count():
            self.last_saved_step = point.step
            if meta["policy"] == self.policy and self.policy != "full":
                self._chain = list(meta["chain"])
                self._baseline_bytes, self._chain_bytes = int(meta["baseline_bytes"]), int(meta["chain_bytes"])
                if self.policy == "one_shot" and meta["groups"] and _by_blocks(meta):
                    self._chain = None  # multi-process: a new baseline rather than re-marking the delta's rows
                elif self.policy == "one_shot" and meta["groups"]:
                    # One-shot deltas are cumulative since the baseline: the restored delta's rows stay dirty.
                    rows = _decode(point.store.item(point.step, "rows", meta))
                    state = state.replace(dirty_rows={
                        g: d.at[jnp.asarray(rows[g]["ids"])].set(True) if g in rows else d
                        for g, d in state.dirty_rows.items()})
        return state, (meta["loop"] if point.own else {})

    def _record(self, state) -> dict:
        if self.task is None:
            raise ValueError("Checkpointer.task is not set: set it to the run's Task (what its tables hold) before a "
                             "save or a restore")
        return table_record(self.task.collection, self.task.sparse_optimizer, state)

    # ------------------------------------------------------------------------------------------ save
    def track(self, state):
        """`state` with a zero dirty-row bitmap per group when the policy writes deltas (none for "full")."""
        if self.policy == "full":
            return state.replace(dirty_rows={})
        return state.replace(dirty_rows={g: _zeros(t.shape[0], _row_sharding(t)) for g, t in state.tables.items()})

    def due(self, step: int) -> bool:
        """Whether the interval (steps or minutes) asks for a save after `step`."""
        if self.every_steps and step % self.every_steps == 0:
            return True
        if not self.every_seconds:
            return False
        late = time.monotonic() - self.last_save_time >= self.every_seconds
        if jax.process_count() == 1:
            return late
        # Every process must save at the same step: every AGREE_EVERY_STEPS steps, process 0's clock decides.
        if step % AGREE_EVERY_STEPS:
            return False
        from jax.experimental import multihost_utils

        return bool(multihost_utils.broadcast_one_to_all(np.asarray(late)))

    def save(self, step: int, state, loop: dict, finished: bool = False):
        """Checkpoint `state` after `step` (written in the background unless `async_save` is off); returns the state
        with its dirty-row bitmaps cleared as the policy says."""
        import orbax.checkpoint as ocp

        if step == self.last_saved_step:
            return state
        t0 = time.perf_counter()
        self._settle()
        paths, leaves, _ = _dense_leaves(state)
        distributed = jax.process_count() > 1
        item_state = {
            "step": np.asarray(step, np.int32),
            "rng": _local(jax.random.key_data(state.dropout_rng)),
            # Orbax cannot store empty arrays (e.g. a layer over zero dense features): their shapes are in meta.
            "dense": {f"{i:05d}": _local(leaf) for i, leaf in enumerate(leaves) if np.size(leaf)},
        }
        kind, rows_item, delta_bytes = self._plan(state)
        if state.aux:  # routing arrays of dynamic tables (FIITED's indirection, utility): small, saved whole
            item_state["aux"] = {f: {k: np.array(v) for k, v in a.items()} for f, a in state.aux.items()}
        if kind == "full":
            # Host copies into buffers kept from the previous baseline: the next step may donate (overwrite) the
            # tables while Orbax writes these in the background, and reusing the buffers halves the copy (a fresh
            # allocation page-faults: 1M x 16 rows with lazy Adam, 50 -> 28 ms).
            # A synchronous save is finished before the next step: it writes the arrays themselves.
            arrays = {("tables", g): t for g, t in state.tables.items()}
            arrays.update({("sparse_opt", g, k): v for g, o in state.sparse_opt_state.items() for k, v in o.items()})
            if not distributed:  # several processes: the global arrays themselves (saved synchronously, __init__)
                arrays = (self._host_copies(arrays) if self.async_save
                          else {key: np.asarray(a) for key, a in arrays.items()})
            item_state["tables"] = {_encode(key[1]): a for key, a in arrays.items() if key[0] == "tables"}
            item_state["sparse_opt"] = {_encode(g): {key[2]: a for key, a in arrays.items()
                                                     if key[:2] == ("sparse_opt", g)}
                                        for g, o in state.sparse_opt_state.items() if o}
            table_bytes = _nbytes({"t": item_state["tables"], "o": item_state["sparse_opt"]})
            self._chain, self._baseline_bytes, self._chain_bytes = [step], table_bytes, 0
            self._baseline_shapes = _table_shapes(state)
        else:
            table_bytes = delta_bytes
            if self.policy == "one_shot":
                self._chain, self._chain_bytes = [self._chain[0], step], delta_bytes
            else:
                self._chain, self._chain_bytes = [*self._chain, step], self._chain_bytes + delta_bytes
        # Arrays spread over processes (multi-process runs) are checked by blocks: their digests, by item and path.
        global_arrays = {p: a for p, a in _flat({"state": item_state, "rows": rows_item}).items()
                         if blocks.is_global(a)}
        arrays = _Checksums({"state": item_state, "rows": rows_item},
                            {f"digests/{p}": ["uint8", blocks.digest_shape(a), DIGESTS]
                             for p, a in global_arrays.items()})
        meta = {
            "format": FORMAT_VERSION, "step": step, "kind": kind, "policy": self.policy, "chain": self._chain,
            "quantize_bits": self.bits if kind == "delta" else 0, "groups": sorted(_decode(rows_item)),
            "quantize_optimizer_bits": self.optimizer_bits if kind == "delta" else 0,
            "optimizer_codes": self._optimizer_codes() if kind == "delta" else {},
            "table_bytes": table_bytes, "bytes": _nbytes(item_state) + _nbytes(rows_item),
            "baseline_bytes": self._baseline_bytes, "chain_bytes": self._chain_bytes,
            "dense_paths": paths, "dense_shapes": [[str(leaf.dtype), list(leaf.shape)] for leaf in leaves],
            "rng_impl": str(jax.random.key_impl(state.dropout_rng)), "layout": self.layout,
            "tables": self._record(state),
            "processes": jax.process_count(),
            "arrays": arrays, "loop": loop, "config": self.config_dict, "finished": finished,
        }
        args = {"state": ocp.args.StandardSave(item_state), "meta": _meta_handler_types()[0](meta)}
        if rows_item:
            args["rows"] = ocp.args.StandardSave(rows_item)

        def issue():
            if global_arrays:  # each process hashes the blocks it holds
                digests = {p: blocks.block_digests(a) for p, a in global_arrays.items()}
                args["digests"] = ocp.args.StandardSave(_unflat(digests))
            self.store.manager.save(step, args=ocp.args.Composite(**args), force=True)

        if self.async_save:  # Orbax's own save call (threads, an event loop) costs ~50 ms: off the loop too
            self._saving = self._saver.submit(issue)
        else:  # and always with several processes (above)
            issue()
            self.store.manager.wait_until_finished()
        self.store.remember(step, meta)
        self._pending_retain = True
        self.last_saved_step, self.last_save_time = step, time.monotonic()
        if state.dirty_rows and (kind == "full" or self.policy != "one_shot"):
            state = self.track(state)
        self.save_stall_s.append(time.perf_counter() - t0)
        return state

    def _plan(self, state) -> tuple[str, dict, int]:
        """("full", {}, 0) or ("delta", the rows item, its bytes) for the next save under the policy."""
        # A dynamic table's pool re-allocated since the baseline (new shapes) needs a new baseline.
        if self.policy == "full" or not self._chain or _table_shapes(state) != self._baseline_shapes:
            return "full", {}, 0
        rows_item = {}
        if jax.process_count() > 1:  # by blocks: each process gathers and writes its devices' rows
            from jax.experimental import multihost_utils

            groups = sorted(state.dirty_rows)
            counts = np.array([max(map(len, blocks.dirty_blocks(state.dirty_rows[g]).values()), default=0)
                               for g in groups], np.int64)
            caps = np.asarray(multihost_utils.process_allgather(counts)).reshape(-1, len(groups)).max(axis=0)
            for g, cap in zip(groups, caps, strict=True):
                if cap:  # Orbax cannot store empty arrays; a group without touched rows is left out
                    rows_item[_encode(g)] = blocks.delta_blocks(state.dirty_rows[g], state.tables[g],
                                                          state.sparse_opt_state[g], int(cap), self.bits,
                                                          self._optimizer_codes())
            groups = ()
        else:
            groups = sorted(state.dirty_rows)
        for g in groups:
            dirty = state.dirty_rows[g]
            ids = np.flatnonzero(np.asarray(dirty)).astype(np.int32)
            if not len(ids):
                continue  # Orbax cannot store empty arrays; a group without touched rows is left out
            part = {"ids": ids}
            rows = _gather_rows(state.tables[g], ids)
            part.update(quantize.quantize_rows(rows, self.bits) if self.bits else {"rows": rows})
            codes = self._optimizer_codes()
            opt = {k: _gather_rows(v, ids) for k, v in state.sparse_opt_state[g].items()}
            opt = {k: quantize.quantize_state_rows(v, codes[k] == "signed") if k in codes else v
                   for k, v in opt.items()}
            if opt:
                part["opt"] = opt
            rows_item[_encode(g)] = part
        delta_bytes = _nbytes(rows_item)
        if self.policy == "intermittent" and (self._chain_bytes + delta_bytes
                                              > self.baseline_fraction * self._baseline_bytes):
            return "full", {}, 0
        return "delta", rows_item, delta_bytes

    def _optimizer_codes(self) -> dict[str, str]:
        """{field: "signed" | "unsigned"}: the sparse-optimizer fields a delta stores in 8-bit dynamic codes
        (`quantize_optimizer_bits`): those with a vector per row (lazy Adam's m and v, Adagrad's accumulator); a
        per-row scalar (row-wise Adagrad's accumulator, 1 / D of the row's bytes) stays f32, as its block would be
        the one value. Unsigned for the fields the optimizer keeps non-negative."""
        if not self.optimizer_bits:
            return {}
        optimizer = self.task.sparse_optimizer
        return {k: "unsigned" if k in optimizer.nonnegative_state else "signed"
                for k, shape in sorted(optimizer.state_shapes(1, 1).items()) if len(shape) > 1}

    def _host_copies(self, arrays: dict) -> dict:
        """Each array copied into this checkpointer's host buffer for its key (re-allocated when its shape changes),
        in row blocks over a thread per core (numpy releases the GIL: 28 -> 15 ms for 192 MB on 2 cores)."""
        jobs = []
        for key, array in arrays.items():
            buffer = self._host.get(key)
            if buffer is None or buffer.shape != array.shape or buffer.dtype != array.dtype:
                buffer = self._host[key] = np.empty(array.shape, array.dtype)
            # A mesh array: each device's block is copied into its place (a replicated block once).
            parts = ([(shard.index, np.asarray(shard.data)) for shard in array.addressable_shards
                       if not shard.replica_id] if isinstance(array, jax.Array) else [((), np.asarray(array))])
            for index, source in parts:
                target = buffer[index]
                if source.ndim == 0 or len(source) < 2:
                    np.copyto(target, source)
                    continue
                bounds = np.linspace(0, len(source), self._copy_workers + 1).astype(int)
                jobs += [self._copier.submit(np.copyto, target[a:b], source[a:b])
                         for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
        for job in jobs:
            job.result()
        return {key: self._host[key] for key in arrays}

    def wait(self) -> None:
        """Block until the save in flight is complete (and old checkpoints are pruned)."""
        self._settle()

    def _settle(self) -> None:
        """Wait for the save in flight, then delete what no kept restore point needs -- only once the newer
        checkpoint is complete, so a crash always leaves a restorable chain."""
        if self._saving is not None:
            saving, self._saving = self._saving, None
            saving.result()  # re-raises an error of the save call
        self.store.manager.wait_until_finished()
        if not self._pending_retain:
            return
        self._pending_retain = False
        steps = self.store.steps()
        needed = set()
        for s in steps[-self.keep:]:
            needed.update(self.store.meta(s)["chain"])
        for s in steps:
            if s not in needed:
                self.store.delete(s)

    def close(self) -> None:
        try:
            self._settle()
        finally:
            self._saver.shutdown(wait=True)
            self._copier.shutdown(wait=True)
            self.store.manager.close()


def _unflat(flat: Mapping[str, Any]) -> dict:
    """The inverse of `_flat`."""
    tree: dict = {}
    for path, value in flat.items():
        *parents, name = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    return tree


def _nbytes(tree: Mapping) -> int:
    return int(sum(a.nbytes if isinstance(a, jax.Array) else np.asarray(a).nbytes for a in _flat(tree).values()))


def _dense_values(top: Mapping, meta: Mapping) -> list[np.ndarray]:
    """The dense leaves of a state item in tree order, the empty ones (not stored) rebuilt from meta's shapes."""
    return [top["dense"][f"{i:05d}"] if f"{i:05d}" in top.get("dense", {}) else np.zeros(shape, dtype)
            for i, (dtype, shape) in enumerate(meta["dense_shapes"])]


def _dense_leaves(state) -> tuple[list[str], list, Any]:
    """Tree paths, leaves and treedef of (dense_params, dense_opt_state)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path((state.dense_params, state.dense_opt_state))
    return [jax.tree_util.keystr(p) for p, _ in with_paths], [leaf for _, leaf in with_paths], treedef
