"""One checkpoint directory behind its Orbax `CheckpointManager`: the format version, the items of a step, the meta
item's handler (which awaits the checksums), checked reads of items, and the restore points a run can start from."""

import dataclasses
import pathlib
import shutil
import threading
import time
from collections.abc import Collection, Mapping

import jax

from recjax.checkpoint import blocks, streamed
from recjax.checkpoint.integrity import (
    BLOCKS,
    DIGESTS,
    META_DIGEST,
    Checksums,
    describe_arrays,
    flat,
    meta_digest,
    unflat,
)
from recjax.errors import CheckpointError

# 2: meta holds its own sha256 and what each table array holds (`table_record`); format 1 had neither.
FORMAT_VERSION = 2

ITEMS = ("state", "rows", "meta", "digests")


def encode(key: str) -> str:
    """A table key as an item key: a mesh run's storages are named "<group>/<kind>", and "/" separates tree levels."""
    return key.replace("/", "~")


def decode(tree: Mapping) -> dict:
    return {k.replace("~", "/"): v for k, v in tree.items()}


def join_background(timeout_s: float = 3600.0) -> None:
    """Wait for Orbax's threads of a save: its commit threads and its finalize thread (classes of its own, each ending
    with its save). After a failed save some still run; a process that exits under them gets their errors printed at
    shutdown ("cannot schedule new futures after interpreter shutdown")."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and type(thread).__module__.startswith("orbax."):
            # threading.Thread's own join: Orbax's raises the thread's error, which the caller has already.
            threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))


def manager(directory: pathlib.Path, *, read_only: bool = False, async_save: bool = True):
    import orbax.checkpoint as ocp

    # Retention is ours (a delta chain must keep its baseline: Checkpointer._settle). Leftovers of saves cut short are
    # never complete: a writer removes them. Readers (another run's checkpoints) change nothing; Orbax's read_only
    # option would log warnings on every open, so they are plain managers that never save.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None, create=not read_only, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only, enable_background_delete=async_save)
    return ocp.CheckpointManager(directory, options=options, item_names=ITEMS)


def meta_handler_types():
    """The meta item's handler and args: Orbax's JSON handler, saving once the checksums are ready. Registered on
    first use (orbax is imported lazily)."""
    global _META_TYPES
    if _META_TYPES is None:
        import orbax.checkpoint as ocp

        class MetaHandler(ocp.handlers.JsonCheckpointHandler):
            async def _save_fn(self, x, directory):
                if isinstance(x.get("arrays"), Checksums):
                    x = {**x, "arrays": x["arrays"].result()}
                # Inside the item, so Orbax's atomic finalize covers the digest with the content it hashes.
                await super()._save_fn({**x, META_DIGEST: meta_digest(x)}, directory)

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


class Store:
    """One checkpoint directory behind its Orbax manager: step metadata (cached) and checked item reads."""

    def __init__(self, directory: pathlib.Path, *, read_only: bool = False, async_save: bool = True):
        self.directory = directory
        self.manager = manager(directory, read_only=read_only, async_save=async_save)
        self._metas: dict[int, dict] = {}

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def remember(self, step: int, meta: dict) -> None:
        self._metas[step] = meta

    def remove_partial(self, step: int) -> None:
        """Remove what a failed save of `step` left (Orbax's temporary directory), so its bytes are free again."""
        if jax.process_index() == 0:
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)

    def delete(self, step: int) -> None:
        self.manager.delete(step)
        self._metas.pop(step, None)

    def meta(self, step: int) -> dict:
        cached = self._metas.get(step)
        if cached is not None and isinstance(cached["arrays"], Checksums):  # saved by this process
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
            if meta.get(META_DIGEST) != meta_digest(meta):
                raise CheckpointError(f"checkpoint step {step}: {where} does not match the sha256 recorded in it (it "
                                      f"was changed after the save); the checkpoint is corrupt. {self._todo(step)}")
            self._metas[step] = meta
        return self._metas[step]

    def _todo(self, step: int) -> str:
        return (f"Delete {self.directory / str(step)} (and the later steps built on it) to resume from an earlier "
                "checkpoint, or use a new workdir")

    def item(self, step: int, item: str, meta: dict | None = None, placed: Mapping | None = None,
             by_rows: Collection[str] = ()):
        """One item of a step, its arrays checked against the sha256, dtype and shape recorded in `meta`. Arrays a
        multi-process run saved by blocks are read where `placed` ({path: sharding}) puts them -- each process its
        blocks --, and each block is checked against the step's `digests` item; the paths `by_rows` are opened as
        `StoredRows` (read block by block when asked: a disk tier's tables; their digests streamed); the rest is read
        whole, as numpy."""
        import orbax.checkpoint as ocp

        where = self.directory / str(step) / item
        todo = self._todo(step)
        if not where.exists():
            raise CheckpointError(f"checkpoint step {step}: {where} is missing; the checkpoint is incomplete or was "
                                  f"deleted. {todo}")
        expected = {k: v for k, v in (meta or {}).get("arrays", {}).items() if k.startswith(f"{item}/")}
        blocked = sorted(k[len(item) + 1:] for k, v in expected.items() if v[2] == BLOCKS)
        marked = {k: v[2] for k, v in expected.items() if v[2] in (BLOCKS, DIGESTS)}
        if item == "meta":
            restore = meta_handler_types()[1]()
        elif marked or by_rows:
            target = restore_target(expected, item, placed or {})
            restore = ocp.args.PyTreeRestore(target, restore_args=restore_args(target, by_rows))
        else:
            restore = ocp.args.PyTreeRestore()
        try:
            value = getattr(self.manager.restore(step, args=ocp.args.Composite(**{item: restore})), item)
        except Exception as error:
            raise CheckpointError(f"checkpoint step {step}: cannot read {where} ({type(error).__name__}: "
                                  f"{str(error)[:300]}); it is corrupt. {todo}") from error
        if meta is None:
            return value
        found = describe_arrays(item, value)
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
            arrays = flat(value)
            placed_digests = {f"{item}/{p}": blocks.digest_sharding(arrays[p].sharding)
                              for p in blocked if blocks.on_mesh(arrays[p])}
            digests = flat(self.item(step, "digests", meta, placed_digests))
            for p in blocked:
                try:
                    blocks.check_blocks(arrays[p], digests[f"{item}/{p}"],
                                  f"checkpoint step {step}: array {item}/{p} in {where}")
                except CheckpointError as error:
                    raise CheckpointError(f"{error}; the checkpoint is corrupt. {todo}") from None
        return value


def restore_target(expected: Mapping[str, list], item: str, placed: Mapping) -> dict:
    """The restore target of an item from its arrays in meta ({item/path: [dtype, shape, ...]}): an abstract array
    with the sharding `placed[path]` where given (each process reads its blocks), else without one (numpy)."""
    return unflat({key[len(item) + 1:]: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=placed.get(
        key[len(item) + 1:])) for key, (dtype, shape, _) in expected.items()})


def restore_args(target: Mapping, by_rows: Collection[str]) -> dict:
    """Orbax's restore args of a `restore_target`: the paths `by_rows` as `StoredRows` (read by row blocks when
    asked), arrays with a sharding placed by it, the rest numpy."""
    import orbax.checkpoint as ocp

    streamed.register_handler()
    args = flat(ocp.checkpoint_utils.construct_restore_args(target))
    for path in set(by_rows) & set(args):
        args[path] = ocp.type_handlers.RestoreArgs(restore_type=streamed.StoredRows)
    return unflat(args)


@dataclasses.dataclass
class ResumePoint:
    """A complete checkpoint to start from: its store (this run's or another run's), step and metadata."""

    store: Store
    step: int
    meta: dict
    own: bool  # in this run's checkpoint dir (False: config.checkpoint.restore)

    @property
    def finished(self) -> bool:
        return bool(self.meta.get("finished"))


def by_blocks(meta: Mapping) -> bool:
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
    store = Store(p, read_only=True)
    steps = store.steps()
    if not steps:
        raise CheckpointError(f"{p} holds no complete checkpoint")
    step = max(steps) if step is None else step
    if step not in steps:
        raise CheckpointError(f"{p} has no complete checkpoint of step {step}; it has {steps}")
    return ResumePoint(store, step, store.meta(step), own=False)
