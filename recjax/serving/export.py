r"""Export a trained run as a self-contained serving model (read by recjax/serving/loader.py with jax + numpy only).

    python -m experiments.export --workdir=runs/ml100k --quantize=int8 --out=runs/ml100k/export_int8

What it takes from the run: its checkpoint at the step model selection chose (summary.json's "selected_step", whose
test metrics the summary reports; the trainer keeps its restore point, `checkpoint.keep_selected`), or at `step`, or
the latest one while the run has no selection, and the config saved in it -- the
task is rebuilt from that config exactly as the trainer built it (dataset spec, planned tables, dynamic tables at the
checkpoint's capacities), and the state restored into it (a mesh run's tables through the single-device layout).

What it writes (the layout is in loader.py's docstring): the scoring function -- the trainer's own predict step
(recjax/step.py) over `ServingStorage` tables of the chosen format -- serialized with `jax.export` for CPU (and
cuda / tpu on request) with a symbolic batch dimension; the tables in their stored format and the dense params, one
.npy each; and the input spec the dataset builders used to turn raw rows into ids, fitted again from the run's data
files and checked against the spec the run trained on:
    synthetic            encoded rows only (the data has no raw format)
    movielens            the raw user and movie ids of the ratings file, each user's demographics and each movie's
                         genres and year, as prepared for training (recjax/data/movielens.py)
    criteo_kaggle / _tb  the frequency vocabulary fitted on the train days (or the hashing modulus) and DLRM's dense
                         transform (recjax/data/criteo.py)
    tabular              CSV and libSVM: each feature's frequency vocabulary (or hash buckets) and each dense
                         column's clip / log1p chain and train standardisation, as the builder fitted them
                         (recjax/data/tabular.py), and a CSV file's columns; Parquet data: encoded rows only

Where it writes, atomically: the export is built in a folder beside `out` (`.NAME.partial-PID-*`, same file system)
and swapped in with one rename -- on Linux `renameat2(RENAME_EXCHANGE)` trades it with an export already there, so
a server loading `out`, or a kill -9 at any moment, finds the old export or the new one complete, never neither and
never a mix; the old one is then removed. Elsewhere (no exchange call, or a file system without it) the old export
is first renamed aside (`.NAME.replaced-PID-*`): a kill between the two renames leaves both complete, and the next
export to `out` puts the old one back before it starts. An export in `out` is replaced only with `overwrite`
(`--overwrite`); a folder there that is not an export, never. Folders left by killed exports are removed by the next
export to the same `out`.
"""

import ctypes
import dataclasses
import errno
import json
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from recjax import placement, sharding
from recjax.batch import Batch
from recjax.checkpoint import ResumePoint, open_checkpoint, restore_state, table_record
from recjax.data import make_dataset
from recjax.dynamic import DynamicTables
from recjax.embedding import EmbeddingCollection, EmbeddingGlue
from recjax.embedding_backend import EmbeddingBackend
from recjax.errors import CheckpointError, ConfigError, DataError
from recjax.evaluation import resolve_budget
from recjax.sections import CheckpointSection, read_section
from recjax.serving import loader
from recjax.serving.tables import FORMATS, encode_tables, group_formats, slot_rows, stored_bytes
from recjax.specs import DatasetSpec
from recjax.step import TrainState, init_state, make_predict_step
from recjax.task import Task, build_task

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# MovieLens fields that belong to the movie (the rest of the non-id fields belong to the user; movielens.py).
MOVIELENS_ITEM_FIELDS = ("genres", "release_year")
MOVIELENS_SEPARATORS = {"100k": "\t", "1m": "::", "latest-small": ","}


@dataclasses.dataclass
class TrainedRun:
    """A run's checkpoint restored into the task its config builds."""

    workdir: pathlib.Path
    config: ml_collections.ConfigDict
    dataset: object
    task: Task
    state: TrainState
    point: ResumePoint

    @property
    def step(self) -> int:
        return self.point.step

    def predict_step(self):
        """The trainer's compiled-on-call predict step (one device, f32 tables)."""
        return make_predict_step(self.task)


def _checkpoints_of(workdir: pathlib.Path) -> pathlib.Path:
    config_path = workdir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{workdir} is not a run's workdir: it has no config.json (give the --workdir a "
                              "python -m experiments.train run wrote)")
    directory = read_section(json.loads(config_path.read_text()), "checkpoint", CheckpointSection).dir
    return pathlib.Path(directory).expanduser() if directory else workdir / "checkpoints"


def _example_batch(spec: DatasetSpec, size: int = 8) -> Batch:
    """A batch of the spec's shapes (its values are never used: only shapes reach `init_state`)."""
    return Batch(dense=np.zeros((size, spec.num_dense), np.float32),
                 ids={f.name: np.zeros((size, f.bag_size), np.int32) for f in spec.features},
                 lengths={f.name: np.ones(size, np.int32) for f in spec.features},
                 labels=np.zeros(size, np.float32))


def selected_step(workdir: pathlib.Path) -> int | None:
    """The step model selection chose (summary.json's "selected_step": its test metrics are the ones reported), or
    None for a run without a summary (still training) or without a selection (no evaluation)."""
    summary = workdir / "summary.json"
    if not summary.is_file():
        return None
    step = json.loads(summary.read_text()).get("selected_step")
    return int(step) if step else None


def load_run(workdir: str | pathlib.Path, step: int | None = None, log=print) -> TrainedRun:
    """The run in `workdir` at `step`, or by default at its selected step (the model whose test metrics summary.json
    reports; kept by `checkpoint.keep_selected`), or at its latest complete checkpoint if it has no selection yet --
    restored on one device."""
    workdir = pathlib.Path(workdir).expanduser()
    checkpoints = _checkpoints_of(workdir)
    if step is None:
        step = selected_step(workdir)
        if step is None:
            log(f"note: {workdir} has no selected step (no summary.json with one: the run is unfinished or never "
                "evaluated); exporting its latest checkpoint")
        else:
            try:
                open_checkpoint(checkpoints, step)
            except CheckpointError as error:
                raise CheckpointError(f"{workdir}'s summary.json reports selected step {step:,}, which has no "
                                      f"checkpoint ({error}; the run kept no restore point of its selected step: "
                                      "checkpoint.keep_selected was off, or it predates it); pass --step=<one of "
                                      "its steps> to export another step, or train again") from None
    point = open_checkpoint(checkpoints, step)
    config = ml_collections.ConfigDict(point.meta["config"])
    dataset = make_dataset(config.data, seed=int(config.seed))
    budget = resolve_budget(config.train, dataset)
    task = build_task(config, dataset.spec, dataset, budget.steps)
    dynamic = DynamicTables.create(task.collection, budget.steps, int(config.seed))
    if dynamic is not None and point.meta["loop"].get("dynamic"):  # FIITED pools as the compactions left them
        task = dynamic.resume(task, point.meta["loop"]["dynamic"])
    like = jax.eval_shape(lambda b: init_state(task, jax.random.key(int(config.seed)), b),
                          _example_batch(dataset.spec))
    state = restore_state(point, like, sharding.relayout(task.collection, None),
                          record=table_record(task.collection, task.sparse_optimizer, like))
    return TrainedRun(workdir, config, dataset, task, state, point)


# ---------------------------------------------------------------------------------------------- input spec
def _check_spec(rebuilt: DatasetSpec, trained: DatasetSpec, source: str) -> None:
    if rebuilt != trained:
        raise DataError(f"the input spec fitted again from {source} ({_describe(rebuilt)}) is not the one the run "
                        f"trained on ({_describe(trained)}): the data changed since training; export from the data "
                        "the run was trained on")


def _describe(spec: DatasetSpec) -> str:
    return f"{spec.num_dense} dense, " + ", ".join(f"{f.name}:{f.vocab_size}x{f.bag_size}" for f in spec.features)


def _movielens_input(config: ml_collections.ConfigDict, spec: DatasetSpec) -> tuple[dict, dict[str, np.ndarray]]:
    from recjax.data.movielens import prepare_examples, read_movielens

    data = config.data
    tables = read_movielens(data.dir, data.variant)
    rebuilt, batch, vocabularies = prepare_examples(tables, rating_threshold=float(data.rating_threshold),
                                                    zip_prefix_length=int(data.zip_prefix_length))
    _check_spec(rebuilt, spec, str(data.dir))
    user_index, item_index = batch.ids["user"][:, 0], batch.ids["item"][:, 0]
    arrays = {"users/raw_ids": np.asarray(vocabularies["user"], np.int64),
              "items/raw_ids": np.asarray(vocabularies["item"], np.int64)}
    entity_of = {}

    def per_entity(name: str, column: np.ndarray) -> np.ndarray:
        """Each user's (item's) value of a per-rating column, checked to be the same in all of its ratings."""
        entity = "item" if name in MOVIELENS_ITEM_FIELDS else "user"
        index = item_index if entity == "item" else user_index
        count = arrays[f"{entity}s/raw_ids"].size
        first = np.full(count, -1, np.int64)
        first[index[::-1]] = np.arange(index.size)[::-1]  # each entity's first rating
        table = column[first]
        if not np.array_equal(table[index], column):
            raise DataError(f"MovieLens field {name!r} differs between ratings of one {entity}; it cannot be looked "
                            f"up per {entity}")
        entity_of[name] = entity
        return table

    for f in spec.features:
        if f.name in ("user", "item"):
            continue
        ids = per_entity(f.name, batch.ids[f.name])
        entity = entity_of[f.name]
        if f.bag_size == 1:
            arrays[f"{entity}s/{f.name}"] = ids[:, 0].astype(np.int32)
        else:
            arrays[f"{entity}s/{f.name}"] = ids.astype(np.int32)
            arrays[f"{entity}s/{f.name}_lengths"] = per_entity(f.name, batch.lengths[f.name]).astype(np.int32)
    for k, name in enumerate(vocabularies["dense"]):
        arrays[f"{'item' if name in MOVIELENS_ITEM_FIELDS else 'user'}s/{name}"] = per_entity(
            name, batch.dense[:, k]).astype(np.float32)
    return {"kind": "movielens", "variant": tables.variant, "separator": MOVIELENS_SEPARATORS[tables.variant],
            "entity_of": entity_of}, arrays


def _criteo_input(config: ml_collections.ConfigDict, spec: DatasetSpec) -> tuple[dict, dict[str, np.ndarray]]:
    from recjax.data import criteo
    from recjax.data.builders import CRITEO_OPTION_KEYS, criteo_options

    data = config.data
    _, options = criteo_options(data)
    directory = pathlib.Path(data.dir).expanduser()
    if data.name == "criteo_kaggle":
        splits = criteo.kaggle_splits(directory / "train.txt")
    else:
        splits = criteo.terabyte_splits(directory, train_days=tuple(options["train_days"]))
    with criteo.prepare_criteo(splits, criteo.CriteoOptions(**{k: options[k] for k in CRITEO_OPTION_KEYS})
                               ) as prepared:
        vocabulary = prepared.vocabulary
    _check_spec(vocabulary.spec(), spec, str(directory))
    arrays = {}
    if vocabulary.mode == "frequency":
        for name, keys, indices in zip(criteo.CRITEO_FEATURE_NAMES, vocabulary.keys, vocabulary.indices, strict=True):
            arrays[f"{name}/keys"], arrays[f"{name}/indices"] = keys.astype(np.int64), indices.astype(np.int32)
    return {"kind": "criteo", "vocab": vocabulary.mode, "max_index": vocabulary.max_index}, arrays


def _tabular_input(config: ml_collections.ConfigDict, spec: DatasetSpec) -> tuple[dict, dict[str, np.ndarray]]:
    """CSV and libSVM data: what the tabular builder fitted on the train split (each feature's vocabulary or
    hashing, each dense column's chain and standardisation), prepared again from the run's files; for CSV the first
    file's columns (the order of a raw row's fields). Parquet data takes encoded rows."""
    from recjax.data.tabular import TabularOptions, prepare_tabular, source_paths
    from recjax.data.tabular_formats import MISSING_MARKERS, NAN_MARKERS, csv_units

    options = TabularOptions.from_config(config.data)
    if options.format not in ("csv", "libsvm"):
        return {"kind": "tabular", "format": options.format}, {}
    plan = options.read_plan()
    with prepare_tabular(options) as prepared:
        _check_spec(prepared.spec, spec, str(options.dir))
        vocabularies, shift, scale = prepared.vocabularies, prepared.dense_shift, prepared.dense_scale
    if options.format == "csv":
        layout = {"delimiter": options.csv_delimiter,
                  "columns": list(next(csv_units(source_paths(options, options.dir), plan)).names)}
    else:
        layout = {"fields": options.libsvm_fields}
    arrays = {"dense/shift": np.asarray(shift, np.float64), "dense/scale": np.asarray(scale, np.float64)}
    sparse = []
    for name, vocabulary in vocabularies.items():
        settings = vocabulary.settings
        sparse.append({"name": name, "vocab": settings.vocab, "hash_buckets": settings.hash_buckets,
                       "multi_valued": vocabulary.multi_valued, "bag_size": vocabulary.bag_size})
        if settings.vocab == "frequency":
            arrays[f"{name}/keys"], arrays[f"{name}/ids"] = vocabulary.keys.astype(np.int64), vocabulary.ids
    return {"kind": "tabular", "format": options.format, **layout, "label": options.label_column,
            "dense": [{"name": d.name, "steps": list(d.steps), "index": d.index} for d in plan.dense],
            "clip_min": options.dense_clip_min, "clip_max": options.dense_clip_max, "missing": options.dense_missing,
            "nan": options.dense_nan, "missing_markers": list(MISSING_MARKERS), "nan_markers": list(NAN_MARKERS),
            "sparse": sparse, "separator": options.sparse_separator, "max_bag_size": options.sparse_max_bag_size
            }, arrays


def input_spec(config: ml_collections.ConfigDict, spec: DatasetSpec) -> tuple[dict, dict[str, np.ndarray]]:
    """(export.json's "input", its arrays by name): how the dataset's raw rows become this model's ids."""
    name = config.data.name
    if name == "movielens":
        return _movielens_input(config, spec)
    if name in ("criteo_kaggle", "criteo_terabyte"):
        return _criteo_input(config, spec)
    if name == "tabular":
        return _tabular_input(config, spec)
    return {"kind": name}, {}  # synthetic data: encoded rows


# ---------------------------------------------------------------------------------------------------- export
def scoring_function(task: Task, table_format: str):
    """(tables, dense params, routing arrays, dense, ids, lengths) -> probabilities f32[B]: the trainer's predict
    step over serving tables of `table_format`. Its lookups are XLA's (`embedding.kernel="xla"`): the Pallas kernels
    size their grids from the batch, which the export leaves symbolic."""
    task = _xla_task(task)
    return _score_with(task, placement.serving(task.collection, table_format))


def _xla_task(task: Task) -> Task:
    c = task.collection
    xla = EmbeddingCollection(c.spec, list(c.table_specs.values()), c.pooling, c.bounds_check, "xla", c.dedup,
                              "distinct_rows")
    return dataclasses.replace(task, collection=xla, glue=EmbeddingGlue(xla))


def _score_with(task: Task, backend: EmbeddingBackend):
    predict = make_predict_step(task, backend)

    def score(tables, params, aux, dense, ids, lengths):
        state = TrainState(step=jnp.zeros((), jnp.int32), dense_params=params, dense_opt_state=(), tables=tables,
                           sparse_opt_state={}, dropout_rng=jnp.zeros((2,), jnp.uint32), aux=aux)
        return predict(state, Batch(dense=dense, ids=ids, lengths=lengths,
                                    labels=jnp.zeros(dense.shape[:1], jnp.float32)))

    return score


def gathered_functions(task: Task, table_format: str, rows: dict[str, int]):
    """The scoring function in two halves, for tables kept outside the step (on disk behind a RAM row cache,
    recjax/serving/tiered.py): (routing arrays, ids, lengths) -> {group: i32[M_g]} the stored row every bag slot
    reads; and (those rows {group: [M_g, width]} in the stored format, dense params, routing arrays, dense, ids,
    lengths) -> probabilities f32[B], the lookup decoding and pooling them as `scoring_function`'s does."""
    task = _xla_task(task)

    def slot_rows_of(aux, ids, lengths):
        return slot_rows(task.collection, task.collection.route(ids, lengths, aux=aux, dedup=False))

    return slot_rows_of, _score_with(task, placement.serving(task.collection, table_format, gathered=rows))


def _save_tree(tree, directory: pathlib.Path, prefix: str) -> dict:
    """Nested dicts of arrays -> .npy files under directory/prefix; returns the skeleton (leaves: relative paths)."""
    if isinstance(tree, dict):
        return {str(k): _save_tree(v, directory, f"{prefix}/{k}") for k, v in tree.items()}
    path = directory / f"{prefix}.npy"
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, np.asarray(tree))
    return f"{prefix}.npy"


def _plain(tree):
    """Flax param trees (dicts, FrozenDicts) -> nested plain dicts of numpy arrays."""
    if hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    return np.asarray(tree)


# ---------------------------------------------------------------------------------------------- where it goes
PARTIAL, REPLACED = "partial", "replaced"  # `.NAME.partial-PID-*`: an export being built; `.NAME.replaced-PID-*`: an
# old export renamed aside (where no exchange call exists)
AT_FDCWD, RENAME_EXCHANGE = -100, 2  # linux/fcntl.h, linux/fs.h


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Swap the two paths in one step (Linux `renameat2(..., RENAME_EXCHANGE)`, glibc >= 2.28); False where the
    system or the file system has no such call."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(out: pathlib.Path, kind: str) -> list[pathlib.Path]:
    """`out`'s sibling folders of `kind` left by exports that are no longer running (killed, or failed hard)."""
    found = []
    for path in out.parent.glob(f".{out.name}.{kind}-*"):
        pid = path.name.removeprefix(f".{out.name}.{kind}-").split("-", 1)[0]
        if path.is_dir() and pid.isdigit() and not _alive(int(pid)):
            found.append(path)
    return sorted(found)


def _describe_export(out: pathlib.Path) -> str:
    try:
        manifest = json.loads((out / "export.json").read_text())
        return (f"step {manifest['source']['checkpoint_step']:,} of {manifest['source']['workdir']}, "
                f"{manifest['table_format']} tables")
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable export.json"


def check_out(out: str | pathlib.Path, overwrite: bool = False, log=print) -> pathlib.Path:
    """Check that an export can be written to `out` before anything is built (`experiments.export` calls it before
    restoring the run): a ConfigError when `out` is something other than an export or an empty folder, when it holds
    an export and `overwrite` is off, or when no folder can be made beside it. Also tidies what killed exports left
    beside it (the module doc). Returns `out` as a path."""
    out = pathlib.Path(out).expanduser()
    try:
        for old in _leftovers(out, REPLACED):  # a rename-aside swap cut between its renames: the old export is back
            if not out.exists() and (old / "export.json").is_file():
                old.rename(out)
                log(f"note: restored the export {out} that an interrupted export had moved aside")
        leftovers = _leftovers(out, PARTIAL) + _leftovers(out, REPLACED)
        for path in leftovers:
            shutil.rmtree(path)
        if leftovers:
            log(f"note: removed {len(leftovers)} folder(s) that interrupted exports left beside {out}")
    except OSError:  # the folder cannot be read or written: said below
        pass
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise ConfigError("out", f"{out} exists and is not an export (a file); choose a new directory")
        if (out / "export.json").is_file():
            if not overwrite:
                raise ConfigError("out", f"{out} holds an export already ({_describe_export(out)}); pass --overwrite "
                                         "to replace it (the new export is swapped in whole), or choose another --out")
        elif any(out.iterdir()):
            raise ConfigError("out", f"{out} exists and is not an export; choose a new directory")
    probe = _staging(out)
    probe.rmdir()
    return out


def _staging(out: pathlib.Path) -> pathlib.Path:
    """A new empty folder beside `out` (same file system, so the swap is a rename) named after this process, with
    the permissions a plain mkdir gives (mkdtemp's are owner-only)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.{PARTIAL}-{os.getpid()}-", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)
        return staging
    except OSError as error:
        blocking = next((p for p in (out.parent, *out.parent.parents) if p.exists()), None)
        why = (f"{blocking} is a file, not a directory" if blocking is not None and not blocking.is_dir()
               else f"{error.strerror or error} (making a folder in {out.parent})")
        raise ConfigError("out", f"cannot write an export to {out}: {why}; choose a folder you can write") from None


def _swap_in(staging: pathlib.Path, out: pathlib.Path) -> None:
    """Put the complete export in `staging` at `out` (the module doc), and remove what `out` held."""
    if not out.exists():
        staging.rename(out)
    elif not any(out.iterdir()):  # an empty folder: rename replaces it
        os.rename(staging, out)
    elif _exchange(staging, out):
        shutil.rmtree(staging, ignore_errors=True)  # the old export, now under the staging name (if it stays, the
        # next export to `out` removes it)
    else:
        aside = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.{REPLACED}-{os.getpid()}-", dir=out.parent))
        aside.rmdir()
        out.rename(aside)
        staging.rename(out)
        shutil.rmtree(aside, ignore_errors=True)


def export_run(run: TrainedRun, out: str | pathlib.Path, table_format: str = "f32",
               platforms: Sequence[str] = ("cpu",), log=print, overwrite: bool = False) -> dict:
    """Write `run` as an export in `out`, atomically (the module doc); an export already there is replaced only with
    `overwrite`. Returns export.json's content."""
    if table_format not in FORMATS:
        raise ConfigError("quantize", f"unknown table format {table_format!r}; use one of {list(FORMATS)}")
    unknown = [p for p in platforms if p not in PLATFORMS]
    if unknown or not platforms:
        raise ConfigError("platforms", f"{list(platforms)}: use some of {list(PLATFORMS)}")
    out = check_out(out, overwrite, log)
    built = _build_export(run, table_format, platforms)
    staging = _staging(out)
    try:
        manifest = _write_export(built, staging)
        _swap_in(staging, out)
    except OSError as error:  # the disk filled up, the folder went read-only, ...
        space = ""
        if error.errno == errno.ENOSPC:
            space = (f"; the export needs {built.bytes():,} bytes, {shutil.disk_usage(out.parent).free:,} are free "
                     "there")
        raise ConfigError("out", f"writing the export to {out} failed: {error.strerror or error} "
                                 f"({error.filename or staging}){space}; {out} is as it was before") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    selected = manifest["source"]["selected_step"]
    log(f"exported step {run.step:,} of {run.workdir} ({table_format} tables: "
        f"{manifest['bytes']['tables']:,} bytes, {manifest['bytes']['tables_f32'] / manifest['bytes']['tables']:.2f}x "
        f"fewer than f32; platforms {', '.join(platforms)}) to {out}")
    if selected is not None and selected != run.step:
        log(f"note: this export serves step {run.step:,} (--step), not the run's selected step {selected:,} whose "
            "test metrics summary.json reports")
    return manifest


@dataclasses.dataclass
class _Export:
    """An export before it is written: what `_write_export` puts in files."""

    functions: dict[str, bytes]  # file name -> a serialized jax.export
    trees: dict[str, object]  # "tables" / "params" / "aux" -> nested dicts of arrays
    vocab: dict[str, np.ndarray]
    manifest: dict  # export.json, but for the files' names ("arguments", "input"'s "arrays")

    def bytes(self) -> int:
        arrays = jax.tree.leaves(self.trees) + list(self.vocab.values())
        return sum(map(len, self.functions.values())) + int(sum(np.asarray(a).nbytes for a in arrays))


def _build_export(run: TrainedRun, table_format: str, platforms: Sequence[str]) -> _Export:
    """The export's content: the scoring functions serialized, the tables encoded, the input spec fitted again."""
    task, state, spec = run.task, run.state, run.task.spec
    tables_f32 = {g: np.asarray(t) for g, t in state.tables.items()}
    stored = encode_tables(tables_f32, table_format)
    formats = group_formats(table_format, {g: t.shape[1] for g, t in tables_f32.items()})
    params, aux = _plain(state.dense_params), _plain(state.aux)
    kind, vocab = input_spec(run.config, spec)

    # The scoring function, with a symbolic batch dimension (one export serves every batch size).
    (b,) = jax.export.symbolic_shape("b")
    shape = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)  # noqa: E731
    arguments = (jax.tree.map(shape, stored), jax.tree.map(shape, params), jax.tree.map(shape, aux),
                 jax.ShapeDtypeStruct((b, spec.num_dense), jnp.float32),
                 {f.name: jax.ShapeDtypeStruct((b, f.bag_size), jnp.int32) for f in spec.features},
                 {f.name: jax.ShapeDtypeStruct((b,), jnp.int32) for f in spec.features})
    exported = jax.export.export(jax.jit(scoring_function(task, table_format)), platforms=tuple(platforms))(
        *arguments)
    # Its two halves, for serving the tables from files behind a RAM cache (`experiments.serve --tier=disk`): every
    # bag slot reads one stored row per placement, so group g's rows per batch are a fixed multiple of the batch.
    rows = {g: int(t.shape[0]) for g, t in tables_f32.items()}
    slot_rows, score_gathered = gathered_functions(task, table_format, rows)
    per_example = {g: int(r.shape[0]) for g, r in jax.eval_shape(
        slot_rows, arguments[2], *jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype),
                                               arguments[4:])).items()}
    exported_rows = jax.export.export(jax.jit(slot_rows), platforms=tuple(platforms))(*arguments[2:3],
                                                                                     *arguments[4:])
    exported_gathered = jax.export.export(jax.jit(score_gathered), platforms=tuple(platforms))(
        {g: jax.ShapeDtypeStruct((b * k, stored[g].shape[1]), stored[g].dtype) for g, k in per_example.items()},
        *arguments[1:])

    any_id = task.collection.any_id_features
    dense_names = list(run.dataset.info().get("dense_features", [f"dense{i}" for i in range(spec.num_dense)]))
    if kind["kind"] == "criteo":
        from recjax.data.criteo import CRITEO_DENSE_NAMES

        dense_names = list(CRITEO_DENSE_NAMES)
    summary_path = run.workdir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    manifest = {
        "format_version": loader.FORMAT_VERSION,
        "source": {"workdir": str(run.workdir.absolute()), "checkpoint_step": run.step,
                   "selected_step": summary.get("selected_step"), "model": run.config.model.name,
                   "dataset": run.config.data.name, "batch_size": int(run.config.train.batch_size)},
        "table_format": table_format,
        "platforms": list(platforms),
        "num_dense": spec.num_dense,
        "dense_names": dense_names,
        "features": [{"name": f.name, "vocab_size": f.vocab_size, "bag_size": f.bag_size, "any_id": f.name in any_id,
                      "method": task.collection.table_specs[f.name].method} for f in spec.features],
        "groups": {g: {"rows": int(t.shape[0]), "dim": int(t.shape[1]), "format": formats[g],
                       "stored_shape": list(stored[g].shape), "stored_dtype": str(stored[g].dtype)}
                   for g, t in tables_f32.items()},
        "bytes": {"tables": stored_bytes(stored), "tables_f32": stored_bytes(tables_f32),
                  "dense_params": int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))),
                  "routing_arrays": int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(aux)))},
        "arguments": None,  # the arrays' files, once written
        "gathered": {"slot_rows": "slot_rows.jax_export", "score": "score_gathered.jax_export",
                     "rows_per_example": per_example},
        "input": kind,
    }
    functions = {"score.jax_export": exported.serialize(), "slot_rows.jax_export": exported_rows.serialize(),
                 "score_gathered.jax_export": exported_gathered.serialize()}
    return _Export(functions, {"tables": stored, "params": params, "aux": aux}, vocab, manifest)


def _write_export(export: _Export, out: pathlib.Path) -> dict:
    """Every file of the export into the (empty) folder `out`, export.json last; returns export.json's content."""
    for name, data in export.functions.items():
        (out / name).write_bytes(data)
    manifest = dict(export.manifest)
    manifest["arguments"] = {name: _save_tree(tree, out, f"arrays/{name}") for name, tree in export.trees.items()}
    vocab_files = {}
    for name, array in export.vocab.items():
        vocab_files[name] = f"vocab/{name}.npy"
        (out / vocab_files[name]).parent.mkdir(parents=True, exist_ok=True)
        np.save(out / vocab_files[name], array)
    manifest["input"] = {**manifest["input"], "arrays": vocab_files}
    shutil.copyfile(pathlib.Path(loader.__file__), out / "serving_loader.py")
    (out / "export.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
