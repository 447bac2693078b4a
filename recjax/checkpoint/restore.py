"""Restore = a restore point's baseline tables, then each delta of its chain in order (rows replaced by id, quantized
rows dequantized), then that step's dense state, step and RNG; checked against the run's table record first, and
re-laid out when the checkpoint was saved under another mesh layout. Multi-process checkpoints saved by blocks are
read by blocks, each process the blocks its devices hold."""

from collections.abc import Collection, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from recjax import quantize
from recjax.checkpoint import blocks
from recjax.checkpoint.records import dense_leaves, dense_values, table_differences
from recjax.checkpoint.store import ResumePoint, by_blocks, decode, encode
from recjax.checkpoint.streamed import RowBlocks
from recjax.errors import CheckpointError


def check_chain(point: ResumePoint) -> None:
    store, step = point.store, point.step
    present = set(store.steps())
    for s in point.meta["chain"]:
        if s not in present:
            raise CheckpointError(f"checkpoint step {step} in {store.directory} builds on step {s}, whose directory "
                                  f"{store.directory / str(s)} is missing or incomplete; delete "
                                  f"{store.directory / str(step)} to resume from an earlier checkpoint, or use a new "
                                  "workdir")


def chain_tables(point: ResumePoint, top: dict, placed: Mapping | None = None,
                 by_rows: Collection[str] = ()) -> tuple[dict, dict]:
    """Tables and sparse-optimizer state of `point`: its baseline's, then each delta of its chain in order (rows
    replaced by id; quantized rows dequantized; ids -1 pad a multi-process run's blocks). With `placed` (a
    multi-process restore: {"tables/<g>": sharding, ...} of this run's state) every process reads the blocks its
    devices hold and applies each delta there; the item paths `by_rows` (`top` read them so) are `StoredRows` with
    the deltas' rows over them (`Patched`: read by row blocks when asked); else everything is read whole, as numpy."""
    store, chain = point.store, point.meta["chain"]
    base = top if chain[0] == point.step else store.item(chain[0], "state", store.meta(chain[0]), placed, by_rows)
    if placed:
        tables = decode(base["tables"])
        sparse_opt = {g: dict(o) for g, o in decode(base.get("sparse_opt", {})).items()}
    else:
        tables = {g: _writable(t) for g, t in decode(base["tables"]).items()}
        sparse_opt = {g: {k: _writable(v) for k, v in o.items()} for g, o in decode(base.get("sparse_opt", {})).items()}
    for s in chain[1:]:
        delta_meta = store.meta(s)
        bits = delta_meta["quantize_bits"]
        where = delta_shardings(tables, sparse_opt) if placed else None
        rows = decode(store.item(s, "rows", delta_meta, where)) if delta_meta["groups"] else {}
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
            values = dequantize(part, bits, tables[g].shape[1]) if "codes" in part else np.asarray(part["rows"])
            tables[g] = _replace_rows(tables[g], ids[valid], values[valid])
            for k, v in part.get("opt", {}).items():
                values = dequantize_state(v, codes[k] == "signed") if k in codes else np.asarray(v)
                sparse_opt[g][k] = _replace_rows(sparse_opt[g][k], ids[valid], values[valid])
    return tables, sparse_opt


def _writable(array):
    """A numpy copy the deltas can write into; an array read by row blocks stays so."""
    return array if isinstance(array, RowBlocks) else np.array(array)


def _replace_rows(array, ids: np.ndarray, values: np.ndarray):
    """`array` with rows `ids` set to `values`: in place for numpy, over the blocks for RowBlocks."""
    if isinstance(array, RowBlocks):
        return array.patched(ids, values)
    array[ids] = values
    return array


def dequantize(part: Mapping, bits: int, dim: int) -> np.ndarray:
    """A delta's quantized rows f32[n, dim]; a column-split table's blocks were quantized each on its own (offset
    and scale f32[n, C] for C column blocks)."""
    offset, scale, codes = (np.asarray(part[k]) for k in ("offset", "scale", "codes"))
    if offset.ndim == 1:
        return quantize.dequantize_rows(part, bits, dim)
    c_blocks, width = offset.shape[1], codes.shape[1] // offset.shape[1]
    return np.concatenate([quantize.dequantize_rows({"codes": codes[:, c * width:(c + 1) * width],
                                                     "offset": offset[:, c], "scale": scale[:, c]}, bits,
                                                    dim // c_blocks) for c in range(c_blocks)], axis=1)


def dequantize_state(part: Mapping, signed: bool) -> np.ndarray:
    """A delta's optimizer rows f32[n, ...] from their dynamic codes; a column-split field's blocks were quantized each
    on its own (absmax f32[n, C] for C column blocks)."""
    codes, absmax = np.asarray(part["codes"]), np.asarray(part["absmax"])
    if absmax.ndim == 1:
        return quantize.dequantize_state_rows({"codes": codes, "absmax": absmax}, signed)
    width = codes.shape[1] // absmax.shape[1]
    return np.concatenate([quantize.dequantize_state_rows({"codes": codes[:, c * width:(c + 1) * width],
                                                           "absmax": absmax[:, c]}, signed)
                           for c in range(absmax.shape[1])], axis=1)


def delta_shardings(tables: Mapping, sparse_opt: Mapping) -> dict:
    """Where each array of a multi-process delta goes ({path in the rows item: sharding}): ids split like the table's
    rows, rows / codes like the table, offset / scale like its (row, column) blocks, optimizer rows like theirs."""
    out = {}
    for g, t in tables.items():
        spec = (*tuple(t.sharding.spec), None)
        key = encode(g)
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
    check_chain(point)
    top = point.store.item(point.step, "state", point.meta)
    tables, sparse_opt = chain_tables(point, top)
    dense = dense_values(top, point.meta)
    return {"step": np.asarray(top["step"]), "rng": np.asarray(top["rng"]),
            **{f"dense/{p}": np.asarray(a) for p, a in zip(point.meta["dense_paths"], dense, strict=True)},
            **{f"tables/{g}": t for g, t in tables.items()},  # mesh runs: by storage, "<group>/<kind>"
            **{f"sparse_opt/{g}/{k}": v for g, s in sparse_opt.items() for k, v in s.items()},
            **{f"aux/{f}/{k}": np.asarray(v) for f, a in top.get("aux", {}).items() for k, v in a.items()}}


def restore_state(point: ResumePoint, like, relayout=None, *, record: Mapping, by_rows: Collection[str] = ()):
    """The TrainState of `point` (without dirty-row bitmaps); `like` is a TrainState of this config (arrays or
    shapes) that gives the tree structure, the shape every array must have and, for arrays on a mesh, where they
    go; `record` is this run's `table_record`, which the checkpoint's must equal before any array is read.
    `relayout(by_key, saved_layout)` maps tables (or one optimizer field) {key: array} saved under
    `point.meta["layout"]` to this run's layout (None: the same layout). The table groups `by_rows` (a disk tier's:
    `backend.restores_by_rows`) of a checkpoint in the single-device layout come back as `RowBlocks` -- their arrays
    read from the checkpoint block by block when asked, with the deltas' rows over them -- for the backend's
    `place_state` to write where they go."""
    store, meta, step = point.store, point.meta, point.step
    differences = table_differences(meta["tables"], record)
    if differences:
        shown = "; ".join(differences[:6]) + (f"; and {len(differences) - 6} more" if len(differences) > 6 else "")
        raise CheckpointError(f"checkpoint step {step} in {store.directory} holds other embedding tables than this "
                              f"config builds (saved -> now: {shown}), so their rows would load into the wrong "
                              "features; restore it with the config that trained it, or train from scratch")
    other_model = (f"checkpoint step {step} in {store.directory} holds another model than this config builds "
                   "({}); restore it with its own config")
    paths, like_leaves, treedef = dense_leaves(like)
    if meta["dense_paths"] != paths:
        first = next((a, b) for a, b in zip(meta["dense_paths"] + [None], paths + [None], strict=False) if a != b)
        raise CheckpointError(other_model.format(f"dense parameters / optimizer state differ at {first[0]} vs "
                                                 f"{first[1]}"))
    check_chain(point)
    # Saved by blocks (a multi-process run) and restored by processes: each reads the blocks its devices hold.
    distributed = jax.process_count() > 1 and by_blocks(meta)
    placed = {}
    if distributed:
        placed = {f"tables/{encode(g)}": t.sharding for g, t in like.tables.items()}
        placed.update({f"sparse_opt/{encode(g)}/{k}": v.sharding for g, o in like.sparse_opt_state.items()
                       for k, v in o.items()})
    # By row blocks only from the single-device layout: a mesh run's storages are re-laid out whole, on the host.
    by_rows = by_rows if meta.get("layout") is None else ()
    row_paths = {f"tables/{encode(g)}" for g in by_rows} | {f"sparse_opt/{encode(g)}/{k}" for g in by_rows
                                                              for k in like.sparse_opt_state.get(g, {})}
    top = store.item(step, "state", meta, placed, row_paths)
    for i, (path, leaf) in enumerate(zip(paths, like_leaves, strict=True)):
        saved = dense_values(top, meta)[i]
        if tuple(np.shape(saved)) != tuple(leaf.shape):
            raise CheckpointError(other_model.format(f"{path} has shape {np.shape(saved)}, not {tuple(leaf.shape)}"))
    tables, sparse_opt = chain_tables(point, top, placed, row_paths)
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
        treedef, [put_like(v, leaf) for v, leaf in zip(dense_values(top, meta), like_leaves, strict=True)])
    return like.replace(
        step=put_like(np.asarray(top["step"], np.int32), like.step),
        dense_params=dense_params, dense_opt_state=dense_opt_state,
        tables={g: put_like(tables[g], t) for g, t in like.tables.items()},
        sparse_opt_state={g: {k: put_like(sparse_opt[g][k], v) for k, v in opt.items()}
                          for g, opt in like.sparse_opt_state.items()},
        dropout_rng=put_like(jax.random.wrap_key_data(jnp.asarray(top["rng"]), impl=meta["rng_impl"]),
                             like.dropout_rng),
        dirty_rows={}, aux={f: {k: jnp.asarray(aux[f][k], v.dtype) for k, v in a.items()} for f, a in like.aux.items()})


def put_like(value, like):
    """`value` as a device array placed like `like` (a mesh array: the same sharding, each device receiving its
    block of the host value every process holds; else the default device); an array read by row blocks as it is."""
    if isinstance(value, RowBlocks):
        return value
    sharding = getattr(like, "sharding", None)
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if isinstance(sharding, jax.sharding.NamedSharding):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(put_like(np.asarray(jax.random.key_data(value)), like),
                                            impl=jax.random.key_impl(value))
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jnp.asarray(value)
