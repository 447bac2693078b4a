"""Export: a trained run written with `jax.export` and loaded with jax + numpy only scores exactly as the trainer; raw
rows (MovieLens ratings lines, Criteo lines) encode exactly as the dataset builders encode them."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_train import tiny_config

from recjax.batch import pad_batch
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
    ]
    scores, errors = model.score_rows([good[0], *bad, good[1]])
    assert [(e["row"], e["field"]) for e in errors] == [
        (1, "row"), (2, "dense"), (3, "dense[0]"), (4, "C3"), (5, "C2"), (6, "C5"), (7, "C9"), (8, "C1"),
        (9, "label"), (10, "row")]
    assert "outside [0, 1000)" in errors[3]["error"] and "at most 3" in errors[4]["error"]
    assert all(s is None for s in scores[1:-1])
    alone, _ = model.score_rows([good[0], good[1]])
    assert [scores[0], scores[-1]] == alone  # the good rows scored as they are alone (the same batch shape)
    with pytest.raises(ConfigError, match="quantize: unknown table format 'int3'"):
        export_run(run, tmp_path / "x", "int3")
    with pytest.raises(ConfigError, match="exists and is not an export"):
        export_run(run, tmp_path / "int8" / "arrays", "f32")


@pytest.fixture(scope="module")
def run_selecting_earlier(tmp_path_factory):
    """A run whose selected step (35: the best validation logloss) is neither its last (40) nor among the `keep=1`
    restore points the interval keeps."""
    workdir = tmp_path_factory.mktemp("selecting")
    config = tiny_config(40)
    config.data.bag_sizes = (1, 3, 1, 1, 1, 2)
    config.data.eval_examples = 512
    config.train.eval_every = 5
    config.train.select_on = "logloss"
    config.optimizer.dense.learning_rate = 0.1  # noisy enough that the logloss is best before the end
    config.checkpoint.keep = 1
    summary = train_and_evaluate(config, workdir)
    assert summary["selected_step"] == 35, summary["selected_step"]  # what the test below is about
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
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [35, 40]
    run = load_run(workdir)
    assert run.step == 35
    manifest = export_run(run, tmp_path / "selected", "f32", log=lambda _: None)
    assert manifest["source"]["checkpoint_step"] == manifest["source"]["selected_step"] == 35
    batch_size = manifest["source"]["batch_size"]
    served = _test_metrics(loader.load(tmp_path / "selected"), run, batch_size)
    # The trainer's test metrics at its selected step, to the last bit (the export scores as the trainer does).
    assert (served["auc"], served["logloss"]) == (summary["auc"], summary["logloss"])
    notes = []
    last = load_run(workdir, step=40)
    export_run(last, tmp_path / "last", "f32", log=notes.append)
    assert "not the run's selected step 35" in notes[-1]
    assert _test_metrics(loader.load(tmp_path / "last"), last, batch_size)["logloss"] != summary["logloss"]
    shutil.copytree(workdir, tmp_path / "copy")
    shutil.rmtree(tmp_path / "copy" / "checkpoints" / "35")
    with pytest.raises(CheckpointError, match="reports selected step 35, which has no checkpoint"):
        load_run(tmp_path / "copy")


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
