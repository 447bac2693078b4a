"""Checkpoints: a run interrupted and resumed ends bit-identical to an uninterrupted one (synthetic and prepared
data, every incremental policy), deltas hold exactly the rows the batches touched, integrity errors name the step
and path, partial saves are never loaded, nothing is unpickled, and the quantizer against plain numpy."""

import csv
import json
import os
import pathlib
import pickle
import shutil
import signal
import time

import numpy as np
import pytest
from conftest import HANG_GUARD_S

from recjax import checkpoint, quantize
from recjax.checkpoint.integrity import flat
from recjax.errors import CheckpointError, ConfigError, Interrupted
from recjax.train import train_and_evaluate

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMING = {"examples_per_sec", "compile_time_s", "train_time_s", "wall_time_s", "peak_rss_bytes",
          "peak_rss_anon_bytes", "peak_rss_file_bytes", "loop"}
VOCABS = (200, 50, 1000, 8, 3000, 20)


def tiny(steps: int = 40, **ckpt):
    from experiments.configs.dlrm_synthetic import get_config

    config = get_config()
    config.data.vocab_sizes = VOCABS
    config.data.eval_examples = 1024
    config.embedding.dim = 8
    config.model.dlrm.bottom_mlp = (16, 8)
    config.model.dlrm.top_mlp = (16, 1)
    config.model.dlrm.dropout = 0.1  # the dropout RNG must resume too
    config.train.batch_size = 128
    config.train.steps = steps
    config.train.eval_every = 10
    config.train.log_every = 5
    config.train.progress_bar = False
    config.checkpoint.every_steps = 10
    for key, value in ckpt.items():
        config.checkpoint[key] = value
    return config


def final_arrays(workdir: pathlib.Path) -> dict[str, np.ndarray]:
    return checkpoint.read_arrays(checkpoint.open_checkpoint(workdir / "checkpoints"))


def assert_same_arrays(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k, strict=True)


def assert_same_run(a: pathlib.Path, b: pathlib.Path) -> None:
    """Bit-identical final state, summary (but its timings) and metrics.csv (but its timing columns)."""
    assert_same_arrays(final_arrays(a), final_arrays(b))
    def untimed(d):  # the dynamic tables' section has timings of its own (adjust_s, recompile_s, ...)
        summary = {k: v for k, v in json.loads((d / "summary.json").read_text()).items() if k not in TIMING}
        if summary.get("dynamic_tables"):
            summary["dynamic_tables"] = {k: v for k, v in summary["dynamic_tables"].items() if not k.endswith("_s")}
        return summary

    assert untimed(a) == untimed(b)

    def rows(d):
        lines = [line.split(",") for line in (d / "metrics.csv").read_text().splitlines()]
        return [line[:-2] for line in lines]  # drop examples_per_sec and elapsed_s

    assert rows(a) == rows(b)


def crash_after_save(monkeypatch, at_step: int) -> None:
    """Make the run die right after it issued the save of `at_step` (the save itself completes)."""
    save = checkpoint.Checkpointer.save

    def dying(self, step, state, loop, finished=False):
        out = save(self, step, state, loop, finished)
        if step == at_step:
            raise KeyboardInterrupt(f"killed after the save of step {step}")
        return out

    monkeypatch.setattr(checkpoint.Checkpointer, "save", dying)


def interrupted_run(config, workdir, monkeypatch, at_step: int, capsys=None) -> dict:
    with monkeypatch.context() as patch:
        crash_after_save(patch, at_step)
        with pytest.raises(KeyboardInterrupt):
            train_and_evaluate(config, workdir)
    assert checkpoint.open_checkpoint(workdir / "checkpoints").step == at_step
    return train_and_evaluate(config, workdir)


def resumed_from(finished: pathlib.Path, config, workdir: pathlib.Path, at_step: int, capsys) -> dict:
    """Resume in `workdir` from copies of the finished run's config.json and checkpoints up to `at_step`: what a run
    of the same config killed right after the save of `at_step` leaves (`interrupted_run`: the save completes before
    the kill), without training those steps a third time. The finished run must keep those checkpoints
    (checkpoint.keep); the kills themselves are proven by the tests that call `interrupted_run` and the Ctrl-C ones."""
    (workdir / "checkpoints").mkdir(parents=True)
    shutil.copy(finished / "config.json", workdir)
    steps = [int(p.name) for p in (finished / "checkpoints").iterdir() if p.name.isdigit()]
    assert at_step in steps, (at_step, sorted(steps))
    for step in steps:
        if step <= at_step:
            shutil.copytree(finished / "checkpoints" / str(step), workdir / "checkpoints" / str(step))
    capsys.readouterr()
    summary = train_and_evaluate(config, workdir)
    out = capsys.readouterr().out
    where = workdir / "checkpoints" / str(at_step)
    assert f"resuming from checkpoint step {at_step} of {config.train.steps} ({where})" in out, out
    return summary


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> pathlib.Path:
    """An uninterrupted run, the oracle of every resume: consecutive deltas every 10 steps, all kept (the policy
    changes what is written, never the training)."""
    workdir = tmp_path_factory.mktemp("ckpt") / "reference"
    train_and_evaluate(reference_config(), workdir)
    return workdir


def reference_config():
    return tiny(policy="consecutive", keep=10)


# --------------------------------------------------------------------------------------- exact resume
def test_resumed_run_is_bit_identical_and_says_so(reference, tmp_path, monkeypatch, capsys):
    interrupted_run(tiny(policy="full"), tmp_path, monkeypatch, at_step=20)
    assert f"resuming from checkpoint step 20 of 40 ({tmp_path / 'checkpoints' / '20'})" in capsys.readouterr().out
    assert_same_run(reference, tmp_path)
    assert checkpoint.open_checkpoint(tmp_path / "checkpoints").meta["finished"]


def ctrl_c_at(monkeypatch, step: int, presses: int = 1) -> None:
    """SIGINT this process `presses` times while step `step` runs (from the checkpointer's per-step `due` check)."""
    due = checkpoint.Checkpointer.due

    def pressing(self, at):
        for _ in range(presses if at == step else 0):
            os.kill(os.getpid(), signal.SIGINT)
        return due(self, at)

    monkeypatch.setattr(checkpoint.Checkpointer, "due", pressing)


def test_ctrl_c_checkpoints_the_step_and_a_rerun_resumes_bit_identical(reference, tmp_path, monkeypatch, capsys):
    """Ctrl-C at step 13 (between the saves of 10 and 20): the run stops after that step, checkpoints it, says so
    (Interrupted, which the launcher prints with exit status 130), restores the SIGINT handler; the same call again
    resumes at 13 and ends bit-identical to the uninterrupted run."""
    before = signal.getsignal(signal.SIGINT)  # the default, or SIG_IGN in a process some earlier test left so
    with monkeypatch.context() as patch:
        ctrl_c_at(patch, 13)
        with pytest.raises(Interrupted, match=rf"^interrupted at step 13; rerun the same command to resume from its "
                                              rf"checkpoint of step 13 \({tmp_path / 'checkpoints' / '13'}\)$"):
            train_and_evaluate(reference_config(), tmp_path)
    assert signal.getsignal(signal.SIGINT) is before
    assert "interrupt: stopping after this step" in capsys.readouterr().out
    assert checkpoint.open_checkpoint(tmp_path / "checkpoints").step == 13
    train_and_evaluate(reference_config(), tmp_path)
    assert "resuming from checkpoint step 13 of 40" in capsys.readouterr().out
    assert_same_run(reference, tmp_path)


def test_ctrl_c_twice_stops_at_once_and_resumes_from_the_last_checkpoint(tmp_path, monkeypatch):
    before = signal.getsignal(signal.SIGINT)
    with monkeypatch.context() as patch:
        ctrl_c_at(patch, 13, presses=2)
        with pytest.raises(Interrupted, match=r"^interrupted at step 13; rerun the same command to resume from its "
                                              r"checkpoint of step 10 "):
            train_and_evaluate(tiny(steps=20), tmp_path)
    assert checkpoint.open_checkpoint(tmp_path / "checkpoints").step == 10
    assert signal.getsignal(signal.SIGINT) is before


def test_finished_run_is_not_trained_again(reference, monkeypatch, capsys):
    import recjax.train

    monkeypatch.setattr(recjax.train, "make_dataset", lambda *a, **k: pytest.fail("a finished run was retrained"))
    summary = train_and_evaluate(reference_config(), reference)
    assert summary == json.loads((reference / "summary.json").read_text())
    assert "run complete" in capsys.readouterr().out


def test_resuming_with_another_config_is_an_error(reference):
    config = reference_config()
    config.optimizer.dense.learning_rate = 0.5
    with pytest.raises(CheckpointError, match=r"another config \(optimizer.dense.learning_rate 0.001 -> 0.5\)"):
        train_and_evaluate(config, reference)


def metrics_rows(workdir: pathlib.Path) -> list[dict]:
    """metrics.csv's rows but their timing columns."""
    with (workdir / "metrics.csv").open() as f:
        return [{k: v for k, v in row.items() if k not in ("examples_per_sec", "elapsed_s")}
                for row in csv.DictReader(f)]


def test_restore_starts_from_another_runs_checkpoint_with_a_history_of_its_own(reference, tmp_path, capsys):
    """The model goes on exactly as the donor's did; selection, early stopping and metrics.csv hold only this run's
    evaluations (after step 30), never the donor's best step and test AUC."""
    config = tiny(restore=str(reference / "checkpoints" / "30"))
    summary = train_and_evaluate(config, tmp_path)
    out = capsys.readouterr().out
    assert "resuming from checkpoint step 30" in out and "selection and metrics history start anew" in out
    assert_same_arrays(final_arrays(reference), final_arrays(tmp_path))
    after = [row for row in metrics_rows(reference) if int(row["step"]) > 30]  # the oracle: the donor's own log
    assert metrics_rows(tmp_path) == after
    validation = [row for row in after if row["split"] == "validation"]
    best = max(validation, key=lambda row: float(row["auc"]))
    assert summary["selected_step"] == int(best["step"])
    assert summary["validation"]["auc"] == pytest.approx(float(best["auc"]), rel=1e-12)
    assert summary["restored_from"] == {"checkpoint": str(reference / "checkpoints" / "30"), "step": 30}
    # Its speed counts the 10 steps it trained, in its own train time.
    assert summary["examples_per_sec"] * summary["train_time_s"] == pytest.approx(10 * 128, rel=1e-9)
    assert json.loads((reference / "summary.json").read_text())["restored_from"] is None


@pytest.mark.parametrize("change, differences", [
    # Two tables' sizes swapped: the stacked group dim8 keeps its shape, so shapes alone would load C1's rows into C2.
    (lambda c: setattr(c.data, "vocab_sizes", (50, 200, *VOCABS[2:])),
     "table C1: vocab_size 200 -> 50, C1 rows 200 -> 50; table C2: vocab_size 50 -> 200, C2 rows 50 -> 200, C2 "
     "offset 200 -> 50"),
    # Same rows, another method: hashing 1000 ids into 1000 buckets has C3's shape and another meaning.
    (lambda c: c.embedding.tables.update({"C3": {"method": "hashing", "options": {"buckets": 1000}}}),
     "table C3: method full -> hashing"),
    (lambda c: setattr(c.optimizer.sparse, "name", "adagrad"), "sparse optimizer lazy_adam -> adagrad"),
])
def test_restore_of_other_tables_is_an_error_naming_them(reference, tmp_path, change, differences):
    config = tiny(restore=str(reference / "checkpoints" / "30"))
    change(config)
    with pytest.raises(CheckpointError) as error:
        train_and_evaluate(config, tmp_path)
    assert str(error.value) == (
        f"checkpoint.restore: checkpoint step 30 in {reference / 'checkpoints'} holds other embedding tables than this "
        f"config builds (saved -> now: {differences}), so their rows would load into the wrong features; restore it "
        "with the config that trained it, or train from scratch")


def test_restore_at_the_end_of_its_budget_is_an_error(reference, tmp_path):
    """Nothing would be trained or evaluated: there is no selection of this run's own to report."""
    with pytest.raises(ConfigError, match=r"train.steps: the budget of 30 steps ends at or before step 30 of the "
                                          r"checkpoint.restore .*checkpoints/30; raise train.steps"):
        train_and_evaluate(tiny(steps=30, restore=str(reference / "checkpoints" / "30")), tmp_path)


def test_checkpoint_of_an_older_format_is_refused(reference, tmp_path):
    """Format 1 recorded neither a metadata digest nor what its tables hold: nothing to check it against."""
    run = copy_run(reference, tmp_path)
    path = run / "checkpoints" / "40" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    for key in ("tables", "sha256"):
        del meta[key]
    path.write_text(json.dumps({**meta, "format": 1}))
    with pytest.raises(CheckpointError, match=r"checkpoint step 40: .*checkpoints/40/meta/metadata is of checkpoint "
                                              r"format 1, this recjax reads format 2 only"):
        checkpoint.open_checkpoint(run / "checkpoints")


def test_prepared_data_resumes_exactly(tmp_path, capsys):
    """MovieLens (prepared blocks read by Grain): a resume mid-block and mid-epoch continues the same stream."""
    data = pathlib.Path(os.environ.get("RECJAX_SHARED_DATA", REPO.parent / "shared" / "data")) / "movielens_100k"
    if not (data / "u.data").is_file():
        pytest.skip(f"ML-100K not found at {data} (set RECJAX_SHARED_DATA)")
    from experiments.configs import dlrm_movielens

    config = dlrm_movielens.get_config()
    config.data.dir = str(data)
    config.data.prepared_dir = str(tmp_path / "prepared")
    config.train.epochs, config.train.steps, config.train.eval_every = None, 30, 10
    config.train.batch_size = 1024
    config.train.progress_bar = False
    config.checkpoint.every_steps = 7  # 7 * 1024 rows: mid-block (8192-row blocks)
    config.checkpoint.keep = 5  # every restore point, so the resume below can start from step 21's
    train_and_evaluate(config, tmp_path / "a")
    resumed_from(tmp_path / "a", config, tmp_path / "b", at_step=21, capsys=capsys)
    assert_same_run(tmp_path / "a", tmp_path / "b")


def test_both_metrics_selections_resume_exactly_and_their_disagreement_warns(tmp_path, capsys):
    """Learning rates of 0.1 make validation AUC and logloss peak at different steps (10 and 20 on this data); a run
    resumed from the save of the earlier one (run a's) must know that step was its metric's best (only the
    checkpoint's loop state says so). The summary reports the test metrics at both steps; metrics.csv is the oracle:
    test scored exactly at the evaluations that improved AUC or logloss, the bests its arg-extremes."""
    import csv

    config = tiny(steps=20, every_steps=5, policy="full", keep=4)  # keep every restore point for the resume below
    config.train.eval_every = 5
    config.optimizer.dense.learning_rate = config.optimizer.sparse.learning_rate = 0.1
    config.train.selection_logloss_tolerance = 0.001  # the curves' gap is 0.24 %: warn above 0.1 %
    a = train_and_evaluate(config, tmp_path / "a")
    out = capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "a" / "metrics.csv").open()))
    validation = [(int(r["step"]), float(r["auc"]), float(r["logloss"])) for r in rows if r["split"] == "validation"]
    test = {int(r["step"]): (float(r["auc"]), float(r["logloss"])) for r in rows if r["split"] == "test"}
    improving = [v[0] for i, v in enumerate(validation) if i == 0 or v[1] > max(u[1] for u in validation[:i])
                 or v[2] < min(u[2] for u in validation[:i])]
    assert sorted(test) == improving
    best_auc = max(validation, key=lambda v: (v[1], -v[0]))[0]
    best_loss = min(validation, key=lambda v: (v[2], v[0]))[0]
    assert best_loss != best_auc, (best_loss, best_auc)  # the precondition of the resume below
    assert a["selected_step"] == a["selection"]["auc"]["step"] == best_auc
    assert a["selection"]["logloss"]["step"] == best_loss
    for metric, step in (("auc", best_auc), ("logloss", best_loss)):
        assert (a["selection"][metric]["test"]["auc"], a["selection"][metric]["test"]["logloss"]) == test[step]
    assert (a["auc"], a["logloss"]) == test[best_auc]  # the headline stays select_on's
    assert f"WARNING: selecting on validation auc picked step {best_auc}" in out
    assert a["warnings"][-1].startswith(f"selecting on validation auc picked step {best_auc}")

    resumed_from(tmp_path / "a", config, tmp_path / "b", at_step=min(best_auc, best_loss), capsys=capsys)
    assert_same_run(tmp_path / "a", tmp_path / "b")


# ------------------------------------------------------------------------------------------ policies
def test_consecutive_deltas_chain_from_one_baseline(reference):
    """The reference: one baseline, then a chain of deltas that every restore point reads in order (resumes from
    mid-chain are the crash test's)."""
    store = checkpoint.open_checkpoint(reference / "checkpoints").store
    assert [store.meta(s)["chain"] for s in (10, 20, 30, 40)] == [[10], [10, 20], [10, 20, 30], [10, 20, 30, 40]]
    assert [store.meta(s)["kind"] for s in (10, 20, 30, 40)] == ["full", "delta", "delta", "delta"]


def test_one_shot_deltas_are_cumulative_and_resume_exactly(reference, tmp_path, monkeypatch):
    """Killed after the delta of step 20, the run must keep 11..20's rows dirty: step 30's delta covers 11..30."""
    interrupted_run(tiny(policy="one_shot", keep=10), tmp_path, monkeypatch, at_step=20)
    assert_same_run(reference, tmp_path)
    store = checkpoint.open_checkpoint(tmp_path / "checkpoints").store
    assert [store.meta(s)["chain"] for s in (10, 20, 30, 40)] == [[10], [10, 20], [10, 30], [10, 40]]
    ids = {s: set(store.item(s, "rows", store.meta(s))["dim8"]["ids"].tolist()) for s in (20, 30, 40)}
    ref = checkpoint.open_checkpoint(reference / "checkpoints").store
    consecutive = {s: set(ref.item(s, "rows", ref.meta(s))["dim8"]["ids"].tolist()) for s in (20, 30, 40)}
    assert ids[30] == consecutive[20] | consecutive[30]
    assert ids[40] == consecutive[20] | consecutive[30] | consecutive[40]


def test_intermittent_rebaselines_when_the_chain_outgrows_its_fraction(reference, tmp_path, monkeypatch):
    config = tiny(policy="intermittent", baseline_fraction=0.3, keep=10, every_steps=5)
    interrupted_run(config, tmp_path, monkeypatch, at_step=25)
    assert_same_run(reference, tmp_path)
    store = checkpoint.open_checkpoint(tmp_path / "checkpoints").store
    metas = [store.meta(s) for s in store.steps()]
    for meta in metas:
        if meta["kind"] == "delta":
            assert meta["chain_bytes"] <= 0.3 * meta["baseline_bytes"] and len(meta["chain"]) >= 2
        else:
            assert meta["chain"] == [meta["step"]]
    kinds = [m["kind"] for m in metas]
    assert kinds.count("full") >= 2 and kinds.count("delta") >= 2, kinds


def test_deltas_hold_exactly_the_rows_the_batches_touched(reference):
    """Oracle: the stacked row ids of every train batch between two checkpoints, from the data in numpy."""
    from recjax.data import make_dataset

    config = reference_config()
    dataset = make_dataset(config.data, seed=config.seed)
    offsets = np.cumsum((0,) + VOCABS)[:-1]  # one-hot features of one dim, stacked in feature order
    stream = dataset.train_batches(config.train.batch_size)
    batches = [next(stream) for _ in range(40)]
    store = checkpoint.open_checkpoint(reference / "checkpoints").store
    full_bytes = store.meta(10)["table_bytes"]
    for step in (20, 30, 40):
        expected = set()
        for batch in batches[step - 10:step]:  # steps step-9 .. step read batches step-10 .. step-1
            for f, offset in zip(dataset.spec.feature_names, offsets, strict=True):
                expected.update((batch.ids[f][:, 0] + offset).tolist())
        meta = store.meta(step)
        rows = store.item(step, "rows", meta)
        assert rows["dim8"]["ids"].tolist() == sorted(expected)
        n = len(expected)
        assert meta["table_bytes"] == n * 4 + n * 8 * 4 * 3  # ids, rows, lazy Adam's m and v
        assert meta["table_bytes"] < full_bytes


# ----------------------------------------------------------------------------------------- integrity
def copy_run(reference: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    shutil.copytree(reference, tmp_path / "run")
    return tmp_path / "run"


def test_corrupt_array_is_an_error_naming_step_and_file(reference, tmp_path):
    run = copy_run(reference, tmp_path)
    data_files = [p for p in (run / "checkpoints" / "40" / "state").rglob("d/*") if p.is_file()]
    assert data_files
    for path in data_files:  # every data file (tensorstore's chunks and index), so whichever is read is bad
        blob = bytearray(path.read_bytes())
        for i in range(len(blob) // 4, min(len(blob), len(blob) // 4 + 256)):
            blob[i] ^= 0xFF
        path.write_bytes(bytes(blob))
    (run / "summary.json").unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint step 40: .*checkpoints/40/state.* corrupt\. Delete "):
        train_and_evaluate(reference_config(), run)


def unchecked_item(checkpoints: pathlib.Path, step: int, item: str) -> dict:
    """An item as Orbax and tensorstore decode it, without the sha256 comparison."""
    point = checkpoint.open_checkpoint(checkpoints, step)
    return flat(point.store.item(step, item))


def test_flipped_byte_that_decodes_is_an_error(reference, tmp_path):
    """One byte of one stored table value changed, re-encoded through tensorstore itself (the chunks are zstd
    compressed, so a byte flipped in the file would most likely fail to decode): the array decodes cleanly to the
    wrong value, and only the sha256 comparison can tell."""
    import tensorstore as ts

    run = copy_run(reference, tmp_path)
    item = run / "checkpoints" / "10" / "state"  # the chain's baseline: every later step reads its tables
    spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{item}/", "path": "tables.dim8/"}}
    stored = ts.open(spec).result()
    values = stored.read().result()
    flipped = values.copy()
    flipped.view(np.uint8).reshape(-1)[4 * 1234] ^= 0x01  # the lowest mantissa bit of one float: a 1e-7 change
    stored.write(flipped).result()
    decoded = unchecked_item(run / "checkpoints", 10, "state")["tables/dim8"]
    assert np.count_nonzero(decoded.view(np.uint8) != values.view(np.uint8)) == 1
    with pytest.raises(CheckpointError, match=r"checkpoint step 10: array state/tables/dim8 in .*checkpoints/10/state "
                                              r"does not match the sha256"):
        final_arrays(run)


def test_item_copied_from_another_step_is_an_error(reference, tmp_path):
    """Step 30's state item copied over step 40's: every file is valid and decodes, to step 30's values."""
    run = copy_run(reference, tmp_path)
    checkpoints = run / "checkpoints"
    shutil.rmtree(checkpoints / "40" / "state")
    shutil.copytree(checkpoints / "30" / "state", checkpoints / "40" / "state")
    decoded, donor = (unchecked_item(checkpoints, s, "state") for s in (40, 30))
    assert_same_arrays(decoded, donor)
    with pytest.raises(CheckpointError, match=r"checkpoint step 40: array state/\S+ in .*checkpoints/40/state does "
                                              r"not match the sha256"):
        final_arrays(run)


@pytest.mark.parametrize("step, edit", [
    (40, lambda meta: meta["loop"]["selection"]["best_validation"].update(auc=0.99)),  # the restore point's
    (20, lambda meta: meta["loop"]["history"].pop()),  # a delta the chain of step 40 reads
])
def test_edited_metadata_is_an_error_naming_step_and_file(reference, tmp_path, step, edit):
    """Metadata still valid JSON, but changed after the save: a resume must refuse it, not report a wrong selection."""
    run = copy_run(reference, tmp_path)
    path = run / "checkpoints" / str(step) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    (run / "summary.json").unlink()
    with pytest.raises(CheckpointError, match=rf"checkpoint step {step}: .*checkpoints/{step}/meta/metadata does not "
                                              r"match the sha256 recorded in it .* corrupt\. Delete "):
        train_and_evaluate(reference_config(), run)


def test_missing_delta_is_an_error(reference, tmp_path):
    run = copy_run(reference, tmp_path)
    shutil.rmtree(run / "checkpoints" / "20")
    (run / "summary.json").unlink()
    with pytest.raises(CheckpointError, match=r"step 40 in .* builds on step 20, whose directory .*/20 is missing"):
        train_and_evaluate(reference_config(), run)


def test_partial_save_is_never_loaded(reference, tmp_path):
    """A save cut short leaves Orbax's `<step>.orbax-checkpoint-tmp` dir (renamed only when complete)."""
    run = copy_run(reference, tmp_path)
    shutil.rmtree(run / "checkpoints" / "40")
    partial = run / "checkpoints" / "50.orbax-checkpoint-tmp"
    shutil.copytree(run / "checkpoints" / "30", partial)
    shutil.rmtree(partial / "meta")
    (run / "summary.json").unlink()
    checkpointer = checkpoint.Checkpointer(reference_config(), run)
    assert checkpointer.resume_point().step == 30
    checkpointer.close()
    # Orbax removes leftovers on a background thread when a manager opens (milliseconds idle; HANG_GUARD_S ends a hang)
    deadline = time.monotonic() + HANG_GUARD_S
    while partial.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not partial.exists()


def test_loading_unpickles_nothing(reference, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load used pickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    arrays = final_arrays(reference)
    assert int(arrays["step"]) == 40 and arrays["tables/dim8"].shape == (sum(VOCABS), 8)


@pytest.mark.parametrize("key, value, message", [
    ("policy", "sometimes", r"checkpoint.policy: unknown value 'sometimes'"),
    ("quantize_bits", 3, r"checkpoint.quantize_bits: must be one of \[0, 2, 4, 8\]"),
    ("quantize_bits", 4, r"checkpoint.quantize_bits: 4 quantizes the rows of deltas, but checkpoint.policy 'full'"),
    ("quantize_optimizer_bits", 4, r"checkpoint.quantize_optimizer_bits: must be one of \[0, 8\]"),
    ("quantize_optimizer_bits", 8, r"checkpoint.quantize_optimizer_bits: 8 quantizes the optimizer rows of deltas, "
                                   r"but checkpoint.policy 'full'"),
    ("keep", 0, r"checkpoint.keep: must be >= 1"),
    ("every_minutes", -1.0, r"checkpoint.every_minutes: must be >= 0"),
])
def test_bad_checkpoint_config_names_the_key(tmp_path, key, value, message):
    with pytest.raises(ConfigError, match=message):
        train_and_evaluate(tiny(**{key: value}), tmp_path)


# -------------------------------------------------------------------------------------- quantization
def minmax_quantize(x: np.ndarray, bits: int) -> np.ndarray:
    """Plain per-row min/max asymmetric quantization, dequantized (the independent oracle)."""
    lo, hi = x.min(1, keepdims=True), x.max(1, keepdims=True)
    scale = (hi - lo) / (2**bits - 1)
    q = np.clip(np.rint((x - lo) / np.where(scale > 0, scale, 1)), 0, 2**bits - 1)
    return lo + scale * q


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantizer_is_never_worse_than_min_max_and_packs_exactly(bits):
    rng = np.random.default_rng(bits)
    x = rng.standard_t(3, size=(300, 13)).astype(np.float32)  # heavy tails: clipping pays off
    x[0] = 0.5  # a constant row
    q = quantize.quantize_rows(x, bits)
    assert q["codes"].shape == (300, -(-13 * bits // 8)) and q["codes"].dtype == np.uint8
    back = quantize.dequantize_rows(q, bits, 13)
    err = ((back - x) ** 2).sum(1)
    oracle = ((minmax_quantize(x, bits) - x) ** 2).sum(1)
    assert np.all(err <= oracle * (1 + 1e-5) + 1e-12)
    np.testing.assert_array_equal(back[0], x[0])
    if bits <= 4:
        assert err.sum() < oracle.sum()  # the range search finds better ranges at low bits
    codes = rng.integers(0, 2**bits, size=(7, 13)).astype(np.uint8)
    np.testing.assert_array_equal(quantize.unpack_codes(quantize.pack_codes(codes, bits), bits, 13), codes)


def test_quantized_deltas_restore_within_their_step(reference, tmp_path):
    """A run with 8-bit deltas trains exactly like the reference (only the checkpoint is lossy); its restored
    tables differ from the f32 ones by at most half a quantization step per row."""
    config = reference_config()
    config.checkpoint.quantize_bits = 8
    train_and_evaluate(config, tmp_path)
    exact, lossy = final_arrays(reference), final_arrays(tmp_path)
    store = checkpoint.open_checkpoint(tmp_path / "checkpoints").store
    rows = store.item(40, "rows", store.meta(40))["dim8"]
    ids = rows["ids"]
    bound = rows["scale"][:, None] / 2 + 1e-6
    assert np.all(np.abs(lossy["tables/dim8"][ids] - exact["tables/dim8"][ids]) <= bound)
    assert not np.array_equal(lossy["tables/dim8"][ids], exact["tables/dim8"][ids])  # it is lossy
    for k in exact:
        if k != "tables/dim8":
            np.testing.assert_array_equal(exact[k], lossy[k], err_msg=k)
    assert store.meta(40)["table_bytes"] < store.meta(20)["table_bytes"] * 10


def nearest_codes(x: np.ndarray, signed: bool) -> np.ndarray:
    """The oracle of `quantize_state_rows`: per row, each value / the row's absolute maximum rounded to the nearest
    code by brute force (an unsigned positive value to the nearest positive code), times that maximum."""
    code = quantize.dynamic_code(signed)
    absmax = np.abs(x).max(axis=1, keepdims=True)
    scaled = x / np.where(absmax > 0, absmax, 1)
    candidates = np.where(signed | (scaled[..., None] <= 0) | (code > 0), code, np.inf)  # positive: positive codes
    return (code[np.argmin(np.abs(candidates - scaled[..., None]), axis=-1)] * absmax).astype(np.float32)


def test_dynamic_code_and_state_quantizer():
    """The 8-bit dynamic tree code by hand, and block-wise (per-row) quantization against the brute-force nearest code
    (Dettmers et al. 2022)."""
    unsigned, signed = quantize.dynamic_code(False), quantize.dynamic_code(True)
    assert len(np.unique(unsigned)) == 256 and len(np.unique(signed)) == 255
    # Decade e has 2^(f) values 10^-e (0.1 + 0.9 k / 2^f), f = 7 - e (unsigned) or 6 - e (signed) fraction bits.
    np.testing.assert_allclose(unsigned[[0, 1, 2, -2, -1]], [0, 1e-7, 1e-6 * 0.55, 0.1 + 0.9 * 127 / 128, 1])
    np.testing.assert_allclose(signed[[0, 1, 126, 127, 128, -1]], [-1, -(0.1 + 0.9 * 63 / 64), -1e-6, 0, 1e-6, 1])
    assert np.count_nonzero((unsigned > 0.1) & (unsigned <= 1)) == 128  # the top decade: 7 fraction bits
    rng = np.random.default_rng(0)
    m = (rng.standard_t(3, size=(200, 16)) * 10.0 ** rng.uniform(-6, 0, (200, 1))).astype(np.float32)
    v = (m**2 * 10.0 ** rng.uniform(-4, 0, m.shape)).astype(np.float32)  # non-negative, spanning decades in a row
    m[0], v[1], v[2, 3] = 0.0, 0.0, 1e-30  # a zero row; a tiny positive value far below the row's maximum
    for x, is_signed in ((m, True), (v, False)):
        q = quantize.quantize_state_rows(x, is_signed)
        assert q["codes"].dtype == np.uint8 and q["codes"].shape == x.shape and q["absmax"].shape == (len(x),)
        back = quantize.dequantize_state_rows(q, is_signed)
        np.testing.assert_allclose(back, nearest_codes(x, is_signed), rtol=1e-6)
        np.testing.assert_array_equal(np.abs(back).max(axis=1), np.abs(x).max(axis=1))  # each block's max is exact
        np.testing.assert_array_equal(back == 0, x == 0)  # zeros stay zero; positive state never becomes 0
        assert np.all(np.sign(back) == np.sign(x))
    assert quantize.dequantize_state_rows(quantize.quantize_state_rows(v, False), False)[2, 3] == np.float32(
        1e-7 * np.abs(v[2]).max())
    with pytest.raises(ValueError, match="non-negative state only"):
        quantize.quantize_state_rows(m, False)


def test_quantized_optimizer_rows_restore_to_their_nearest_codes(reference, tmp_path):
    """8-bit optimizer rows (lazy Adam: m signed, v unsigned) in every delta: training is the reference's exactly;
    the restored tables are exact and every optimizer row a delta holds is its exact value's nearest code (its last
    delta holds its final value: the rows no later step touched did not change); bytes by hand."""
    config = reference_config()
    config.checkpoint.quantize_optimizer_bits = 8
    train_and_evaluate(config, tmp_path)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (reference, tmp_path))
    assert {k: v for k, v in sa.items() if k not in TIMING} == {k: v for k, v in sb.items() if k not in TIMING}
    exact, lossy = final_arrays(reference), final_arrays(tmp_path)
    store = checkpoint.open_checkpoint(tmp_path / "checkpoints").store
    in_deltas = np.unique(np.concatenate([store.item(s, "rows", store.meta(s))["dim8"]["ids"] for s in (20, 30, 40)]))
    for k in exact:
        if not k.startswith("sparse_opt/"):
            np.testing.assert_array_equal(lossy[k], exact[k], err_msg=k)
    for field, is_signed in (("m", True), ("v", False)):
        expected = exact[f"sparse_opt/dim8/{field}"].copy()
        expected[in_deltas] = nearest_codes(expected[in_deltas], is_signed)
        np.testing.assert_allclose(lossy[f"sparse_opt/dim8/{field}"], expected, rtol=1e-6, atol=0, err_msg=field)
        assert not np.array_equal(lossy[f"sparse_opt/dim8/{field}"], exact[f"sparse_opt/dim8/{field}"])
    meta = store.meta(40)
    n = len(store.item(40, "rows", meta)["dim8"]["ids"])
    assert meta["optimizer_codes"] == {"m": "signed", "v": "unsigned"} and meta["quantize_optimizer_bits"] == 8
    assert meta["table_bytes"] == n * 4 + n * 8 * 4 + 2 * (n * 8 + n * 4)  # ids, f32 rows, m and v: codes + absmax

