"""Export: a trained run written with `jax.export` and loaded with jax + numpy only scores exactly as the trainer; raw
rows (MovieLens ratings lines, Criteo lines) encode exactly as the dataset builders encode them."""

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from test_train import tiny_config

from recjax.batch import pad_batch
from recjax.data.arrays import concatenate as concatenate_batches
from recjax.errors import CheckpointError, ConfigError
from recjax.metrics import binary_metrics
from recjax.serving import loader
from recjax.serving.export import export_run, load_run
from recjax.serving.tables import decode_table
from recjax.train import train_and_evaluate

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED = pathlib.Path(os.environ.get("RECJAX_SHARED_DATA", REPO.parent / "shared" / "data"))

# Runs in a fresh interpreter in which the training code cannot be imported: the export and its copied loader only.
ISOLATED = r"""
import json, sys
for name in ("recjax", "compression", "pallas_kernels", "experiments", "flax", "optax", "ml_collections", "orbax",
             "tensorflow_datasets", "grain"):
    sys.modules[name] = None  # `import name` (and its submodules) now fails
sys.path.insert(0, sys.argv[1])
import serving_loader

model = serving_loader.load(sys.argv[1])
rows = json.loads(open(sys.argv[2]).read())
scores, errors = model.score_rows(rows)
print(json.dumps({"scores": scores, "errors": errors, "float32_bits": [int(b) for b in __import__("numpy").asarray(
    [s if s is not None else 0.0 for s in scores], "float32").view("uint32")]}))
"""


def _rows_as_json(batch) -> list[dict]:
    """A batch's rows as the server's encoded rows: {"dense": [...], "ids": {feature: [ids in the bag]}}."""
    return [{"dense": [float(v) for v in batch.dense[r]],
             "ids": {f: [int(i) for i in ids[r, :batch.lengths[f][r]]] for f, ids in batch.ids.items()}}
            for r in range(batch.size)]


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    config = tiny_config(30)
    config.data.bag_sizes = (1, 3, 1, 1, 1, 2)
    config.data.eval_examples = 512
    config.train.eval_every = 30
    train_and_evaluate(config, workdir)
    return workdir


def test_f32_export_scores_equal_the_trainer_bit_for_bit(synthetic_run, tmp_path):
    run = load_run(synthetic_run)
    assert run.step == 30
    manifest = export_run(run, tmp_path / "export", "f32")
    batch_size = manifest["source"]["batch_size"]
    batch = pad_batch(next(run.dataset.eval_batches(batch_size, "test")), batch_size)
    trainer = np.asarray(run.predict_step()(run.state, jax.device_put(batch)))
    rows = _rows_as_json(batch)
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    result = subprocess.run([sys.executable, "-c", ISOLATED, str(tmp_path / "export"), str(tmp_path / "rows.json")],
                            capture_output=True, text=True, cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    served = json.loads(result.stdout.splitlines()[-1])
    assert served["errors"] == []
    np.testing.assert_array_equal(np.asarray(served["float32_bits"], np.uint32), trainer.view(np.uint32))
    # In this process too: the encoded rows are the batch itself.
    model = loader.load(tmp_path / "export")
    encoded, errors = model.encode(rows)
    assert errors == [] and encoded.index == list(range(batch_size))
    np.testing.assert_array_equal(encoded.dense, batch.dense)
    for f in batch.ids:
        np.testing.assert_array_equal(encoded.lengths[f], batch.lengths[f])
        valid = np.arange(batch.ids[f].shape[1])[None, :] < batch.lengths[f][:, None]
        np.testing.assert_array_equal(np.where(valid, encoded.ids[f], 0), np.where(valid, batch.ids[f], 0))


def test_quantized_export_bytes_and_bad_rows(synthetic_run, tmp_path):
    """int8 / int4 exports hold FBGEMM's fused rows (d + 8 / d / 2 + 4 bytes) and score as the trainer's predict step
    on the tables they decode to; bad rows are errors naming row and field while the good ones are scored."""
    run = load_run(synthetic_run)
    batch = next(run.dataset.eval_batches(16, "test"))
    for fmt, row_bytes in (("int8", lambda d: d + 8), ("int4", lambda d: d // 2 + 4)):
        manifest = export_run(run, tmp_path / fmt, fmt)
        rows, dims = zip(*[(g["rows"], g["dim"]) for g in manifest["groups"].values()], strict=True)
        assert manifest["bytes"]["tables"] == sum(r * row_bytes(d) for r, d in zip(rows, dims, strict=True))
        assert manifest["bytes"]["tables_f32"] == sum(4 * r * d for r, d in zip(rows, dims, strict=True))
        model = loader.load(tmp_path / fmt)
        decoded = {g: jax.numpy.asarray(decode_table(np.asarray(t), manifest["groups"][g]["format"],
                                                     run.task.collection.group_dims[g]))
                   for g, t in model.constants[0].items()}
        oracle = np.asarray(run.predict_step()(run.state.replace(tables=decoded), jax.device_put(batch)))
        np.testing.assert_allclose(model.score_arrays(batch.dense, batch.ids, batch.lengths), oracle, rtol=1e-5,
                                   atol=1e-6)
    model = loader.load(tmp_path / "int8")
    good = _rows_as_json(next(run.dataset.eval_batches(4, "test")))
    bad = [
        "a line of text",  # synthetic data has no raw format
        {"dense": good[0]["dense"][:3], "ids": good[0]["ids"]},
        {"dense": [float("nan")] * 13, "ids": good[0]["ids"]},
        {"dense": good[0]["dense"], "ids": {**good[0]["ids"], "C3": 1000}},  # vocab 1000
        {"dense": good[0]["dense"], "ids": {**good[0]["ids"], "C2": [1, 2, 3, 4]}},  # bag of 3
        {"dense": good[0]["dense"], "ids": {k: v for k, v in good[0]["ids"].items() if k != "C5"}},
        {"dense": good[0]["dense"], "ids": {**good[0]["ids"], "C9": 1}},
        {"dense": good[0]["dense"], "ids": {**good[0]["ids"], "C1": "7"}},
        {"dense": good[0]["dense"], "ids": good[0]["ids"], "label": 1},
        17,
        {"dense": [*good[0]["dense"][:5], 1e39, *good[0]["dense"][6:]], "ids": good[0]["ids"]},  # inf in float32
        {"dense": [*good[0]["dense"][:2], 10**400, *good[0]["dense"][3:]], "ids": good[0]["ids"]},  # past float64
    ]
    scores, errors = model.score_rows([good[0], *bad, good[1]])
    assert [(e["row"], e["field"]) for e in errors] == [
        (1, "row"), (2, "dense"), (3, "dense[0]"), (4, "C3"), (5, "C2"), (6, "C5"), (7, "C9"), (8, "C1"),
        (9, "label"), (10, "row"), (11, "dense[5]"), (12, "dense[2]")]
    assert "must be finite (in float32), got 1e+39" in errors[10]["error"]
    assert "outside [0, 1000)" in errors[3]["error"] and "at most 3" in errors[4]["error"]
    assert all(s is None for s in scores[1:-1])
    alone, _ = model.score_rows([good[0], good[1]])
    assert [scores[0], scores[-1]] == alone  # the good rows scored as they are alone (the same batch shape)
    with pytest.raises(ConfigError, match="quantize: unknown table format 'int3'"):
        export_run(run, tmp_path / "x", "int3")
    with pytest.raises(ConfigError, match="exists and is not an export"):
        export_run(run, tmp_path / "int8" / "arrays", "f32")


def test_tiered_tables_score_as_in_ram_and_count_cache_hits(synthetic_run, tmp_path):
    """Tables left in their files behind a RAM row cache (10 % of each group's rows, so batches evict and re-read
    rows) score exactly as the in-RAM model, per format; a cache holding every row misses each distinct row once."""
    from recjax.serving.tiered import TieredServingModel

    run = load_run(synthetic_run)
    batch_size = 64
    batches = list(run.dataset.eval_batches(batch_size, "test"))[:4]
    for fmt in ("f32", "int4"):
        export_run(run, tmp_path / fmt, fmt, log=lambda _: None)
        in_ram, tiered = loader.load(tmp_path / fmt), TieredServingModel(tmp_path / fmt, cache=0.1)
        for batch in batches + batches[:1]:
            np.testing.assert_array_equal(
                tiered.score_arrays(batch.dense, batch.ids, batch.lengths, pad_to=batch_size),
                in_ram.score_arrays(batch.dense, batch.ids, batch.lengths, pad_to=batch_size), err_msg=fmt)
        hits, lookups = tiered.cache_stats()
        assert 0 < hits < lookups
    # Every row fits: the hits are the lookups of rows seen in an earlier batch (counted here from the routes).
    whole = TieredServingModel(tmp_path / "int4", cache=1.0)
    seen = {g: set() for g in whole.caches}
    expected_hits = expected_lookups = 0
    for batch in batches + batches[:2]:
        whole.score_arrays(batch.dense, batch.ids, batch.lengths, pad_to=batch_size)
        padded = loader.pad_rows(batch.dense, batch.ids, batch.lengths, batch_size)
        for g, ids in jax.device_get(whole._slot_rows(whole.constants[2], *padded[1:])).items():
            rows = {int(i) for i in np.asarray(ids) if 0 <= i < whole.constants[0][g].shape[0]}
            expected_lookups += len(rows)
            expected_hits += len(rows & seen[g])
            seen[g] |= rows
    assert whole.cache_stats() == (expected_hits, expected_lookups)
    with pytest.raises(ValueError, match="cache must be a fraction"):
        TieredServingModel(tmp_path / "int4", cache=0.0)


def _scores(directory: pathlib.Path, rows: list[dict]) -> np.ndarray:
    scores, errors = loader.load(directory).score_rows(rows)
    assert errors == []
    return np.asarray(scores, np.float32).view(np.uint32)


def _dead_pid() -> int:
    """The id of a process that has ended (an export killed before it tidied up)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_an_export_is_replaced_only_with_overwrite_and_whole(synthetic_run, tmp_path, monkeypatch):
    """An export at --out is replaced only with overwrite; a write that fails (the disk full) leaves it as it was,
    with nothing beside it; the replacement is swapped in whole, through RENAME_EXCHANGE or by renaming the old one
    aside, and an export left aside by a swap cut between its renames is put back by the next export."""
    import recjax.serving.export as export_module

    run = load_run(synthetic_run)
    rows = _rows_as_json(next(run.dataset.eval_batches(16, "test")))
    out = tmp_path / "exports" / "model"
    export_run(run, out, "int8", log=lambda _: None)
    old = _scores(out, rows)
    with pytest.raises(ConfigError, match=rf"^out: {out} holds an export already \(step 30 of .*, int8 tables\); "
                                          "pass --overwrite to replace it"):
        export_run(run, out, "f32")

    def disk_full(tree, directory, prefix):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / prefix))

    monkeypatch.setattr(export_module, "_save_tree", disk_full)
    with pytest.raises(ConfigError, match=rf"^out: writing the export to {out} failed: No space left on device "
                                          r"\(.*\); the export needs [\d,]+ bytes, [\d,]+ are free there; "
                                          f"{out} is as it was before$"):
        export_run(run, out, "f32", overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]  # the half-written export is gone
    np.testing.assert_array_equal(_scores(out, rows), old)

    notes = []
    manifest = export_run(run, out, "f32", overwrite=True, log=notes.append)
    assert manifest["table_format"] == "f32" and sorted(p.name for p in out.parent.iterdir()) == ["model"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # a plain mkdir's permissions
    f32 = _scores(out, rows)
    assert not np.array_equal(f32, old) and notes[-1].startswith("exported step 30")

    # Without RENAME_EXCHANGE: the old export renamed aside, the new one renamed in; a swap cut between the two
    # (the old export aside, nothing at `out`) is undone by the next export before it starts.
    monkeypatch.setattr(export_module, "_exchange", lambda a, b: False)
    export_run(run, out, "int8", overwrite=True, log=lambda _: None)
    np.testing.assert_array_equal(_scores(out, rows), old)
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]
    out.rename(out.parent / f".model.replaced-{_dead_pid()}-x")
    (out.parent / f".model.partial-{_dead_pid()}-y").mkdir()  # a killed export's half-written folder
    notes = []
    with pytest.raises(ConfigError, match="holds an export already"):
        export_run(run, out, "f32", log=notes.append)
    assert notes == [f"note: restored the export {out} that an interrupted export had moved aside",
                     f"note: removed 1 folder(s) that interrupted exports left beside {out}"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]
    np.testing.assert_array_equal(_scores(out, rows), old)

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ConfigError, match="notes exists and is not an export; choose a new directory"):
        export_run(run, tmp_path / "notes", "f32", overwrite=True)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    export_run(run, tmp_path / "empty", "f32", log=lambda _: None)  # an empty folder is taken
    np.testing.assert_array_equal(_scores(tmp_path / "empty", rows), f32)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_unwritable_out_is_one_error_line(synthetic_run, tmp_path):
    """--out under a file, on a file system that makes no folders, or in a read-only folder: one `error:` line
    naming the path (from the command line: exit status 2, no traceback, before the run is restored); an export at
    --out without --overwrite: one line too."""
    run = load_run(synthetic_run)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=rf"^out: cannot write an export to {tmp_path}/a_file/export: "
                                          rf"{tmp_path}/a_file is a file, not a directory; choose a folder you can "
                                          "write$"):
        export_run(run, tmp_path / "a_file" / "export", "f32")
    if os.geteuid() != 0:  # a read-only folder (root writes anyway)
        read_only = tmp_path / "read_only"
        read_only.mkdir()
        read_only.chmod(0o555)
        with pytest.raises(ConfigError, match=rf"^out: cannot write an export to {read_only}/export: Permission "
                                              rf"denied \(making a folder in {read_only}\)"):
            export_run(run, read_only / "export", "f32")
    unwritable = pathlib.Path("/sys/recjax_export")  # sysfs makes no folders, whoever asks
    if not pathlib.Path("/sys/kernel").is_dir():
        unwritable = tmp_path / "a_file" / "export"
    command = [sys.executable, "-m", "experiments.export", f"--workdir={synthetic_run}"]
    result = subprocess.run([*command, f"--out={unwritable}"], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: out: cannot write an export to {unwritable}: ") and line.endswith(
        "; choose a folder you can write")
    export_run(run, tmp_path / "export", "int4", log=lambda _: None)
    result = subprocess.run([*command, f"--out={tmp_path / 'export'}"], cwd=REPO, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: out: {tmp_path / 'export'} holds an export already (step 30 of {synthetic_run.absolute()}, int4 "
        "tables); pass --overwrite to replace it (the new export is swapped in whole), or choose another --out"]


@pytest.mark.slow  # eight export processes
def test_an_export_killed_at_any_moment_leaves_the_old_or_the_new_export(synthetic_run, tmp_path):
    """`experiments.export --overwrite` over an int8 export, killed with SIGKILL at random moments and as its
    staging folder appears, as its export.json is written and right after the swap: `out` always loads as the old
    export or the new one, complete (its scores are one of the two, bit for bit); the next export removes what the
    killed ones left beside it."""
    run = load_run(synthetic_run)
    rows = _rows_as_json(next(run.dataset.eval_batches(16, "test")))
    references = tmp_path / "references"
    export_run(run, references / "old", "int8", log=lambda _: None)
    export_run(run, references / "new", "f32", log=lambda _: None)
    expected = {"old": _scores(references / "old", rows), "new": _scores(references / "new", rows)}
    assert not np.array_equal(expected["old"], expected["new"])
    work = tmp_path / "work"
    out = work / "export"
    command = [sys.executable, "-m", "experiments.export", f"--workdir={synthetic_run}", f"--out={out}",
               "--quantize=f32", "--overwrite"]

    def trial(kill) -> str:
        """Run the export over the old one; `kill(process)` returns once it has killed it (or let it finish)."""
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(references / "old", out)
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        kill(process)
        process.wait()
        found = _scores(out, rows)
        outcome = next((name for name, scores in expected.items() if np.array_equal(found, scores)), None)
        assert outcome is not None, f"{out} is neither export (exit {process.returncode})"
        assert json.loads((out / "export.json").read_text())["table_format"] == {"old": "int8", "new": "f32"}[outcome]
        return outcome

    def at(condition):
        def kill(process):
            while process.poll() is None and not condition():
                time.sleep(0.001)
            process.kill()
        return kill

    start = time.monotonic()
    assert trial(lambda process: process.wait()) == "new"
    whole = time.monotonic() - start
    outcomes = []
    rng = np.random.default_rng(0)
    for delay in rng.uniform(0.3, 1.0, 3) * whole:  # mostly while it restores the run and builds the export
        outcomes.append(trial(lambda process, delay=delay: (time.sleep(delay), process.kill())))
    staging = lambda: list(work.glob(".export.partial-*"))  # noqa: E731
    outcomes.append(trial(at(lambda: bool(staging()))))  # writing the new export's files
    assert outcomes[-1] == "old"
    outcomes.append(trial(at(lambda: any((s / "export.json").is_file() for s in staging()))))  # about to swap
    swapped = lambda: json.loads((out / "export.json").read_text())["table_format"] == "f32"  # noqa: E731
    outcomes.append(trial(at(swapped)))  # removing the old export
    assert outcomes[-1] == "new"
    assert set(outcomes) <= {"old", "new"}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in work.iterdir()) == ["export"]  # the killed exports' folders, removed
    np.testing.assert_array_equal(_scores(out, rows), expected["new"])


@pytest.fixture(scope="module")
def run_selecting_earlier(tmp_path_factory):
    """A run whose selected step (the best validation logloss: 10 on this data) is neither its last (40) nor among the
    `keep=1` restore points the interval keeps."""
    workdir = tmp_path_factory.mktemp("selecting")
    config = tiny_config(40)
    config.data.bag_sizes = (1, 3, 1, 1, 1, 2)
    config.data.eval_examples = 512
    config.train.eval_every = 5
    config.train.select_on = "logloss"
    config.optimizer.dense.learning_rate = 0.2  # noisy enough that the logloss is best before the end
    config.checkpoint.keep = 1
    summary = train_and_evaluate(config, workdir)
    assert summary["selected_step"] < 40, summary["selected_step"]  # what the test below is about
    return workdir, summary


def _test_metrics(model: loader.ServingModel, run, batch_size: int) -> dict:
    """The export's metrics over the test split, batched as the trainer's evaluation batches it."""
    labels, probs = [], []
    for batch in run.dataset.eval_batches(batch_size, "test"):
        probs.append(model.score_arrays(batch.dense, batch.ids, batch.lengths, pad_to=batch_size))
        labels.append(batch.labels)
    return binary_metrics(np.concatenate(labels), np.concatenate(probs))


def test_export_serves_the_selected_step(run_selecting_earlier, tmp_path):
    """By default the export is the model whose test metrics summary.json reports (its selected step, kept by
    checkpoint.keep_selected), not the last step's; --step still picks another; a run whose selected step has no
    checkpoint says so."""
    workdir, summary = run_selecting_earlier
    selected = summary["selected_step"]
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [selected, 40]
    run = load_run(workdir)
    assert run.step == selected
    manifest = export_run(run, tmp_path / "selected", "f32", log=lambda _: None)
    assert manifest["source"]["checkpoint_step"] == manifest["source"]["selected_step"] == selected
    batch_size = manifest["source"]["batch_size"]
    served = _test_metrics(loader.load(tmp_path / "selected"), run, batch_size)
    # The trainer's test metrics at its selected step, to the last bit (the export scores as the trainer does).
    assert (served["auc"], served["logloss"]) == (summary["auc"], summary["logloss"])
    notes = []
    last = load_run(workdir, step=40)
    export_run(last, tmp_path / "last", "f32", log=notes.append)
    assert f"not the run's selected step {selected}" in notes[-1]
    assert _test_metrics(loader.load(tmp_path / "last"), last, batch_size)["logloss"] != summary["logloss"]
    shutil.copytree(workdir, tmp_path / "copy")
    shutil.rmtree(tmp_path / "copy" / "checkpoints" / str(selected))
    with pytest.raises(CheckpointError, match=f"reports selected step {selected}, which has no checkpoint"):
        load_run(tmp_path / "copy")


def _clicks_csv(path: pathlib.Path, rows: int = 480) -> list[str]:
    """A seeded CSV click log with missing and NaN dense cells, a skewed category, a hashed one and a bag column;
    returns its data lines."""
    rng = np.random.default_rng(7)
    lines = []
    for i in range(rows):
        price = rng.choice(["", "NA", "nan", f"{rng.normal(3, 2):.3f}", f" {rng.integers(0, 50)} "], p=[.05, .05, .05,
                                                                                                     .75, .1])
        qty = str(int(rng.integers(-3, 400)))
        site = f"s{min(int(rng.zipf(1.6)), 60)}"
        app = f"a{int(rng.integers(0, 300))}"
        tags = "|".join(f"t{int(v)}" for v in rng.integers(0, 12, int(rng.integers(0, 4))))
        click = int(rng.random() < (0.7 if site in ("s1", "s2") else 0.2))
        lines.append(f"{i},{click},{price},{qty},{site},{app},\"{tags}\"")
    path.write_text("id,click,price,qty,site,app,tags\n" + "\n".join(lines) + "\n")
    return lines


def _clicks_config(directory: pathlib.Path, prepared: pathlib.Path):
    from experiments.configs import dlrm_csv_clicks

    config = dlrm_csv_clicks.get_config()
    data = config.data
    data.dir, data.files, data.prepared_dir = str(directory), "clicks.csv", str(prepared)
    data.label.column, data.dense.columns = "click", ("price", "qty")
    data.dense.transforms = {"qty": "clip+log1p+standardise"}
    data.dense.clip_min = 0.0
    data.sparse.columns, data.sparse.multi_valued = ("site", "app", "tags"), ("tags",)
    data.sparse.overrides = {"app": {"vocab": "hash", "hash_buckets": 50}}
    data.split.method, data.split.time_column = "random", ""
    config.train.epochs, config.train.steps, config.train.eval_every = None, 12, 12
    config.train.batch_size, config.train.progress_bar = 32, False
    return config


def test_tabular_csv_rows_encode_and_score_like_the_builder(tmp_path):
    """Raw CSV rows of a tabular run's test split encode to the builder's test batches (vocabularies, hashing,
    bags, missing / NaN cells, clip + log1p, standardisation) and score as the trainer, bit for bit; unseen values
    map as the builder maps them; bad fields are row errors naming the field."""
    from recjax.data.tabular import TabularOptions, prepare_tabular, split_uniform
    from recjax.data.vocabulary import string_key

    lines = _clicks_csv(tmp_path / "clicks.csv")
    config = _clicks_config(tmp_path, tmp_path / "prepared")
    train_and_evaluate(config, tmp_path / "run")
    run = load_run(tmp_path / "run")
    manifest = export_run(run, tmp_path / "export", "f32", log=lambda _: None)
    assert manifest["input"]["columns"] == ["id", "click", "price", "qty", "site", "app", "tags"]
    model = loader.load(tmp_path / "export")
    batch_size = int(config.train.batch_size)
    test_rows = np.flatnonzero(split_uniform(0, np.arange(len(lines))) >= 0.9)  # the random split's test rows
    encoded, errors = model.encode([lines[i] for i in test_rows])
    assert errors == []
    start = 0
    for batch in run.dataset.eval_batches(batch_size, "test"):
        rows = slice(start, start + batch.size)
        np.testing.assert_array_equal(encoded.dense[rows], batch.dense)
        for f in batch.ids:
            np.testing.assert_array_equal(encoded.lengths[f][rows], batch.lengths[f], err_msg=f)
            np.testing.assert_array_equal(encoded.ids[f][rows], batch.ids[f], err_msg=f)
        if start == 0:  # scores: the trainer's predict step on the builder's batch, bit for bit
            padded = pad_batch(batch, batch_size)
            trainer = np.asarray(run.predict_step()(run.state, jax.device_put(padded)))[:batch.size]
            np.testing.assert_array_equal(model.score_arrays(encoded.dense[rows], {k: v[rows] for k, v in
                                                                                  encoded.ids.items()},
                                                             {k: v[rows] for k, v in encoded.lengths.items()},
                                                             pad_to=batch_size), trainer)
        start += batch.size
    assert start == test_rows.size
    # Unseen values, a rare one and the label left out: ids as the builder's own vocabularies give them.
    with prepare_tabular(TabularOptions.from_config(config.data)) as prepared:
        vocab = prepared.vocabularies

        def builder_ids(feature: str, *values: str) -> list[int]:
            return vocab[feature].ids_of(np.array([string_key(v) for v in values], np.int64)).tolist()

        rare = next(k for k, c in zip(vocab["site"].raw_keys, vocab["site"].raw_counts, strict=True) if c == 1)
        rare_site = next(line.split(",")[4] for line in lines if string_key(line.split(",")[4]) == rare)
        unseen, _ = model.encode(["9,,1.5,7,never_seen,zz,t3|never|t1", f"9,1.5,7,{rare_site},a1,", "9,1,,,s1,a2,"])
        assert unseen.ids["site"][:, 0].tolist() == [0, 0, builder_ids("site", "s1")[0]] and rare not in vocab[
            "site"].keys
        assert unseen.ids["app"][:, 0].tolist() == builder_ids("app", "zz", "a1", "a2")
        assert unseen.ids["tags"][0, :3].tolist() == builder_ids("tags", "t3", "never", "t1")
        assert unseen.lengths["tags"].tolist() == [3, 0, 0]
        # Empty price and qty cells are data.dense.missing (0) before the chain and the standardisation.
        shift, scale = prepared.dense_shift, prepared.dense_scale
        np.testing.assert_array_equal(unseen.dense[2], ((np.array([0.0, 0.0]) - shift) / scale).astype(np.float32))
    bad = ["9,1,abc,3,s1,a1,t1", "9,1,2.5,inf,s1,a1,t1", "9,1,2.5,3,s1", "9,1,2.5,3,s1,a1,t1|t2|t3|t4|t5|t6|t7",
           "9,1,2.5,\"3,s1,a1,t1"]
    scores, errors = model.score_rows([lines[0], *bad, lines[1]])
    assert [(e["row"], e["field"]) for e in errors] == [(1, "price"), (2, "qty"), (3, "row"), (4, "tags"), (5, "row")]
    assert "not a number" in errors[0]["error"] and "at most" in errors[3]["error"]
    assert scores[0] is not None and scores[-1] is not None and scores[1:-1] == [None] * 5


def test_tabular_libfm_lines_encode_and_score_like_the_builder(tmp_path):
    """Raw libFM lines (positional fields, a dense index, the label optional) of the test split encode to the
    builder's test batches and score as the trainer; unseen indices map as the builder maps them; bad tokens are
    row errors naming the token."""
    from experiments.configs import dlrm_libfm
    from recjax.data.tabular import TabularOptions, prepare_tabular, split_uniform

    rng = np.random.default_rng(3)
    lines = []
    for _ in range(400):
        user, item, hour = int(rng.zipf(1.5)) % 40, 100 + int(rng.integers(0, 30)), 200 + int(rng.integers(0, 5))
        dense = f" 999:{rng.normal(2, 1):.3f}" if rng.random() < 0.9 else ""
        label = 1 if (user + item) % 3 == 0 else -1
        lines.append(f"{label} {user}:1 {item}:1{dense} {hour}:{int(rng.random() < 0.8)}")
    (tmp_path / "data.libfm").write_text("\n".join(lines) + "\n")
    config = dlrm_libfm.get_config()
    data = config.data
    data.dir, data.files, data.prepared_dir = str(tmp_path), "data.libfm", str(tmp_path / "prepared")
    data.split.method = "random"
    data.split.train_files = data.split.validation_files = data.split.test_files = ""
    data.libsvm.dense_indices = (999,)
    data.dense.transforms = {"i999": "clip+log1p+standardise"}
    data.dense.clip_min = 0.0
    config.train.epochs, config.train.steps, config.train.eval_every = None, 10, 10
    config.train.batch_size, config.train.progress_bar = 32, False
    train_and_evaluate(config, tmp_path / "run")
    run = load_run(tmp_path / "run")
    export_run(run, tmp_path / "export", "f32", log=lambda _: None)
    model = loader.load(tmp_path / "export")
    test_rows = np.flatnonzero(split_uniform(0, np.arange(len(lines))) >= 0.9)
    # Half of them without their label: the label is not scored.
    raw = [lines[i] if k % 2 else lines[i].split(" ", 1)[1] for k, i in enumerate(test_rows)]
    encoded, errors = model.encode(raw)
    assert errors == []
    batch = concatenate_batches(list(run.dataset.eval_batches(int(config.train.batch_size), "test")))
    np.testing.assert_array_equal(encoded.dense, batch.dense)
    for f in batch.ids:
        np.testing.assert_array_equal(encoded.ids[f], batch.ids[f], err_msg=f)
    first = pad_batch(next(run.dataset.eval_batches(32, "test")), 32)
    n = min(32, len(raw))
    trainer = np.asarray(run.predict_step()(run.state, jax.device_put(first)))[:n]
    np.testing.assert_array_equal(model.score_arrays(encoded.dense[:n], {k: v[:n] for k, v in encoded.ids.items()},
                                                     {k: v[:n] for k, v in encoded.lengths.items()}, pad_to=32),
                                  trainer)
    with prepare_tabular(TabularOptions.from_config(config.data)) as prepared:
        vocab = prepared.vocabularies
        unseen, errors = model.encode(["1 77777:1 101:1 203:0", "5:1 101:1 999:nan 202:1"])
        assert errors == []
        assert unseen.ids["f0"][:, 0].tolist() == vocab["f0"].ids_of(np.array([77777, 5])).tolist()
        assert unseen.ids["f2"][:, 0].tolist() == vocab["f2"].ids_of(np.array([2**63 - 1, 202])).tolist()
        # An absent and a NaN dense value are both data.dense.missing (0): clip, log1p(0) = 0, then standardised.
        expected = np.float32((0.0 - prepared.dense_shift[0]) / prepared.dense_scale[0])
        assert unseen.dense[:, 0].tolist() == [expected, expected]
    _, errors = model.score_rows(["1 5:1 101:1", "1 5:1 101:x 202:1", "1 5:1 101:2 202:1", "1 5:1 101:1 202:1 999:1 "
                                  "999:2", "1 5;1 101:1 202:1", "1 5:1 101:1 202:1 999:inf"])
    assert [(e["row"], e["field"]) for e in errors] == [(0, "row"), (1, "token 2"), (2, "token 2"), (3, "token 5"),
                                                        (4, "token 1"), (5, "token 4")]


def _need(path: pathlib.Path) -> pathlib.Path:
    if not path.exists():
        pytest.skip(f"{path} not found (set RECJAX_SHARED_DATA to the shared data directory)")
    return path


def test_movielens_raw_ratings_lines_score_like_the_trainer(tmp_path):
    """Raw u.data lines of the test split encode to the prepared test batch (ids, bags, dense) and score as the
    trainer scores that batch, bit for bit; unknown users and malformed lines are row errors."""
    from experiments.configs import dlrm_movielens
    from recjax.data.movielens import read_movielens, split_indices

    data = _need(SHARED / "movielens_100k")
    config = dlrm_movielens.get_config()
    config.data.dir = str(data)
    config.data.prepared_dir = str(tmp_path / "prepared")
    config.train.epochs, config.train.steps, config.train.eval_every = None, 20, 20
    config.train.progress_bar = False
    train_and_evaluate(config, tmp_path / "run")
    run = load_run(tmp_path / "run")
    manifest = export_run(run, tmp_path / "export", "f32")
    assert manifest["input"]["kind"] == "movielens" and manifest["dense_names"] == ["release_year", "age"]
    batch_size = int(config.train.batch_size)
    batch = next(run.dataset.eval_batches(batch_size, "test"))
    tables = read_movielens(data)
    split = config.data.split
    test = split_indices(tables.timestamps, split.method, split.validation_fraction, split.test_fraction,
                         split.seed)[2][:batch_size]
    lines = [line for line in (data / "u.data").read_text().splitlines() if line.strip()]
    model = loader.load(tmp_path / "export")
    encoded, errors = model.encode([lines[i] for i in test])
    assert errors == []
    np.testing.assert_array_equal(encoded.dense, batch.dense)
    for f in batch.ids:
        np.testing.assert_array_equal(encoded.ids[f], batch.ids[f], err_msg=f)
        np.testing.assert_array_equal(encoded.lengths[f], batch.lengths[f], err_msg=f)
    trainer = np.asarray(run.predict_step()(run.state, jax.device_put(batch)))
    np.testing.assert_array_equal(model.score_arrays(encoded.dense, encoded.ids, encoded.lengths), trainer)
    user, item = lines[test[0]].split("\t")[:2]
    _, errors = model.score_rows([f"{user}\t{item}", f"99999\t{item}", f"{user}\tx1", f"{user}\t{item}\t5", 3])
    assert [(e["row"], e["field"]) for e in errors] == [(1, "user"), (2, "item"), (3, "row"), (4, "row")]
    assert "not in the training data" in errors[0]["error"]


def test_criteo_raw_lines_encode_like_the_parser(tmp_path):
    """Criteo lines through the export's input spec (frequency vocabulary, and hashing) equal recjax.data.criteo's
    parse + vocabulary mapping of the same lines; bad fields are row errors naming the field."""
    from experiments.configs import dlrm_criteo_kaggle
    from recjax.data import criteo
    from recjax.serving.export import input_spec

    path = _need(SHARED / "criteo_kaggle_sample" / "train.txt")
    lines = path.read_text().splitlines()
    for vocab, max_index in (("frequency", 0), ("hash", 1000)):
        config = dlrm_criteo_kaggle.get_config()
        config.data.dir, config.data.vocab, config.data.max_index = str(path.parent), vocab, max_index
        options = criteo.CriteoOptions(vocab=vocab, max_index=max_index or None)
        with criteo.prepare_criteo(criteo.kaggle_splits(path), options) as prepared:
            vocabulary, spec = prepared.vocabulary, prepared.spec
        kind, arrays = input_spec(config, spec)
        encoder = loader.CriteoInput(kind, arrays, [{"name": n} for n in criteo.CRITEO_FEATURE_NAMES])
        chunk = next(iter(criteo.parse_file(path)))
        expected = criteo.apply(vocabulary, chunk)
        for r in range(0, chunk.size, 7):
            line = lines[chunk.line_numbers[r] - 1]
            for text in (line, line.split("\t", 1)[1]):  # with and without the label
                dense, ids = encoder.encode(text)
                np.testing.assert_array_equal(dense, expected.dense[r])
                assert ids == {f: [int(expected.ids[f][r, 0])] for f in criteo.CRITEO_FEATURE_NAMES}, (vocab, r)
    fields = lines[0].split("\t")
    for k, value, field in ((3, "1.5", "I3"), (20, "zz0000zz", "C7"), (20, "abc", "C7")):
        broken = "\t".join(fields[:k] + [value] + fields[k + 1:])
        with pytest.raises(loader.RowError) as error:
            encoder.encode(broken)
        assert error.value.field == field
    with pytest.raises(loader.RowError, match="40 tab-separated fields"):
        encoder.encode("\t".join(fields[:20]))
