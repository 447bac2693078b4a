"""Placement as a layout x a storage per table group (recjax/placement): host memory equals device memory bit for bit
(on a CPU, jax's `pinned_host` memory is the device's own RAM, so the host storage's code path runs here as it runs
on a GPU / TPU), a storage added in one new file and one registry line trains, every mesh run writes its sharding
plan whatever its storages, and nothing outside `placement.build` branches on a placement type."""

import ast
import json
import pathlib

import jax
import numpy as np
import pytest
from test_sharding import run_devices
from test_tiering import SPEC, assert_same_state, batches_with_returning_rows, memory_run, tiny_config

from recjax import placement
from recjax.embedding_backend import Layout, Storage
from recjax.step import init_state, make_predict_step, make_train_step
from recjax.task import build_task
from recjax.train import train_and_evaluate

REPO = pathlib.Path(__file__).resolve().parents[1]


def placed_run(config, task, batches):
    """`batches` through the placement `placement.build` makes of `config`, as the trainer runs them."""
    backend = placement.build(config, task)
    state = backend.place_state(init_state(task, jax.random.key(0), batches[0], backend))
    first = backend.put_batch(batches[0])
    step = make_train_step(task, backend, state).lower(state, first).compile()
    predict = make_predict_step(task, backend, state).lower(state, first).compile()
    losses = []
    for batch in batches:
        state, metrics = step(state, backend.put_batch(batch))
        losses.append(float(metrics["loss"]))
    return backend, state, losses, np.asarray(predict(state, backend.put_batch(batches[1])))


# ---------------------------------------------------------------------------------------------- host memory
@pytest.mark.parametrize("optimizer,method,tables,pool_from", [
    # Multi-hot C2 with plain SGD: no dedup, every bag slot's row brought to the device, scatter-added on the host.
    ("sgd", "full", "C2=host", "auto"),
    # A per-row state field (row-wise Adagrad's accumulator, 1-d) brought and written back with its rows.
    ("rowwise_adagrad", "full", "C1=host", "auto"),
    # The accelerators' layout: bags pooled from the brought distinct rows; lazy Adam's moments and weight decay.
    ("lazy_adam", "full", "C4=host", "table"),
    # Mixed dims: C1's blocks in host memory, the other groups in device memory, in one step.
    pytest.param("adagrad", "md", "C1=host", "auto", marks=pytest.mark.slow),
])
def test_host_memory_equals_device_memory_bit_for_bit(optimizer, method, tables, pool_from):
    config = tiny_config(optimizer, "full" if method == "md" else method)
    if method == "md":
        config.embedding.method, config.embedding.options.alpha = "md", 0.5
    config.embedding.pool_from = pool_from
    config.tiering.tables = tables
    task = build_task(config, SPEC)
    batches = batches_with_returning_rows()
    expected, expected_losses, expected_probs = memory_run(task, batches)
    backend, state, losses, probs = placed_run(config, task, batches)
    on_host = {g for s in backend.storages if s.name == "host" for g in s.groups}
    c1 = {p.group for p in task.collection.physical_tables() if p.feature == tables.split("=")[0]}
    assert on_host == c1 and (method != "md" or len(backend.storages) == 2), [s.groups for s in backend.storages]
    for g in task.collection.group_rows:  # the arrays stay in host memory through the donated steps
        kinds = {a.sharding.memory_kind for a in (state.tables[g], *state.sparse_opt_state[g].values())}
        assert kinds == ({"pinned_host"} if g in on_host else {"device"}), (g, kinds)
    assert losses == expected_losses
    np.testing.assert_array_equal(probs, expected_probs)
    assert_same_state(expected, backend.local_state(state))
    memory = backend.memory_bytes(task.sparse_optimizer)
    host_bytes = sum(4 * p.table.rows * p.table.dim + task.sparse_optimizer.state_bytes(p.table.rows, p.table.dim)
                     for p in task.collection.physical_tables() if p.group in on_host)
    accounting = task.collection.accounting(task.sparse_optimizer)
    assert memory.host == host_bytes
    assert memory.device + memory.host == accounting["bytes"] + accounting["optimizer_bytes"]


def host_run_config(tables: str = ""):
    config = tiny_config("lazy_adam")
    config.data.vocab_sizes = (3000, 500, 40, 2000)
    config.data.eval_examples = 256
    config.train.batch_size = 32
    config.train.steps = 8
    config.train.eval_every = 4
    config.train.log_every = 4
    config.train.progress_bar = False
    config.checkpoint.every_steps = 4
    config.tiering.tables = tables
    return config


def test_a_host_memory_run_equals_the_memory_run_and_says_where_its_bytes_are(tmp_path):
    """The trainer's run with C1's group in host memory (checkpoints included: the saves copy host arrays) ends
    with the in-memory run's metrics, and summary.json counts its tables in host memory, not the device's."""
    memory = train_and_evaluate(host_run_config(), tmp_path / "memory")
    host = train_and_evaluate(host_run_config("C1=host"), tmp_path / "host")
    for key in ("auc", "logloss", "final_train_loss", "selected_step", "test"):
        assert host[key] == memory[key], key
    assert host["host_memory"]["tables"] == ["C1", "C2", "C3", "C4"]  # one dim: one group, all in host memory
    assert memory["embedding_host_bytes"] == 0 and host["embedding_device_bytes"] == 0
    assert host["embedding_host_bytes"] == memory["embedding_device_bytes"] == 5540 * 8 * 4 * 3  # rows, m, v


@pytest.mark.slow  # three runs, ~60 s on a loaded machine
def test_a_run_moves_its_tables_to_host_memory_when_it_resumes(tmp_path, monkeypatch):
    """Killed after its save of step 4 and resumed with C1's group in host memory (`tiering.*` may change on a
    resume), a run writes the in-memory run's checkpoints and ends with its summary."""
    from test_tiering_checkpoint import TIMING, assert_same_checkpoints, interrupted

    memory = train_and_evaluate(host_run_config(), tmp_path / "memory")
    interrupted(host_run_config(), tmp_path / "moved", monkeypatch, at_step=4)
    moved = train_and_evaluate(host_run_config("C1=host"), tmp_path / "moved")
    assert_same_checkpoints(tmp_path / "memory", tmp_path / "moved", steps=(4, 8))
    # The storage's own: where the bytes are, its summary section, and XLA's FLOPs of its step (the host gathers).
    own = TIMING | {"host_memory", "embedding_host_bytes", "embedding_device_bytes", "flops_per_example",
                    "train_flops_per_example"}
    assert {k: v for k, v in moved.items() if k not in own} == {k: v for k, v in memory.items() if k not in own}
    assert moved["embedding_host_bytes"] == memory["embedding_device_bytes"] > 0


def test_host_memory_lowers_for_gpu_and_tpu():
    """The host storage's train step lowers for cuda and tpu from this CPU host: its arrays in `pinned_host`, the
    row gathers and scatters marked to run on the host, the rest on the device."""
    config = tiny_config("rowwise_adagrad")
    config.embedding.kernel = "xla"  # the lowering under test is the host storage's, not the Pallas kernels'
    config.tiering.tables = "C1=host"
    task = build_task(config, SPEC)
    batch = batches_with_returning_rows(1)[0]
    backend = placement.build(config, task)
    state = backend.place_state(init_state(task, jax.random.key(0), batch, backend))
    traced = make_train_step(task, backend, state).trace(state, backend.put_batch(batch))
    for platform in ("cuda", "tpu"):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert 'mhlo.memory_kind = "pinned_host"' in text, platform
        assert '_xla_compute_type = "host"' in text, platform


# --------------------------------------------------------------------------------- a storage: one file, one line
NEW_STORAGE = '''"""A storage written as WORKSPACE.md's recipe says: device memory, its rows read through `bring`."""

import jax.numpy as jnp

from recjax.embedding_backend import Storage


class CopiedStorage(Storage):
    """Rows kept in device memory and brought to the step as a copy of the rows it reads."""

    name = "copied"
    resident = False

    def bring(self, group, array, ids):
        return jnp.take(array, ids, axis=0, mode="fill", fill_value=0)
'''


def test_a_storage_is_one_new_file_and_one_registry_line(tmp_path, monkeypatch):
    """WORKSPACE.md's recipe: a storage in a file of its own and one line in `placement.STORAGES` -- no other file
    changes -- trains (its tier in `tiering.tables`, validated against the registry) and equals the in-memory run."""
    (tmp_path / "copied_storage.py").write_text(NEW_STORAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import copied_storage

    monkeypatch.setitem(placement.STORAGES, "copied", copied_storage.CopiedStorage)  # the registry line
    memory = train_and_evaluate(host_run_config(), tmp_path / "memory")
    copied = train_and_evaluate(host_run_config("C2=copied"), tmp_path / "copied")
    for key in ("auc", "logloss", "final_train_loss", "selected_step"):
        assert copied[key] == memory[key], key
    config = host_run_config("C2=tape")
    with pytest.raises(Exception, match="tiering.tables: cannot read 'C2=tape'"):
        train_and_evaluate(config, tmp_path / "tape")


def _recjax_modules():
    for path in sorted((REPO / "recjax").rglob("*.py")):
        yield path.relative_to(REPO).as_posix(), path.read_text()


def test_the_host_storage_is_its_file_and_one_registry_line():
    """The host storage's code touches no production module but its own and the registry (the recipe's proof):
    `HostStorage` is named in code only by recjax/placement/host.py, and by the registry's import and line."""
    naming = {}
    for name, text in _recjax_modules():
        uses = [n for n in ast.walk(ast.parse(text)) if (isinstance(n, ast.Name) and n.id == "HostStorage")
                or (isinstance(n, ast.alias) and n.name == "HostStorage")
                or (isinstance(n, ast.ClassDef) and n.name == "HostStorage")]
        if uses:
            naming[name] = len(uses)
    assert sorted(naming) == ["recjax/placement/__init__.py", "recjax/placement/host.py"], naming
    assert naming["recjax/placement/__init__.py"] == 2  # its import and its line in STORAGES
    assert '    "host": HostStorage,\n' in (REPO / "recjax/placement/__init__.py").read_text()


def test_nothing_branches_on_a_placement_type():
    """No isinstance / type test on a layout, storage or placement class anywhere in the runtime (capabilities are
    attributes: `resident`, `places`, `prepares`, ...), and the tier names are compared only where the placement is
    chosen (recjax/placement/) -- the planner's "host" (devices of one host) and the server's `--tier` are other
    concepts."""
    kinds = {"Layout", "OneDevice", "MeshLayout", "Storage", "DeviceStorage", "HostStorage", "DiskStorage",
             "ServingStorage", "PlacedEmbedding", "EmbeddingBackend", "GroupSlots", "BlockSlots"}
    tiers = set(placement.STORAGES)
    other_concepts = {"recjax/sharding/planner.py", "recjax/serving/tiered.py"}
    found, compared = [], []
    for name, text in _recjax_modules():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} | {
                    n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if names & kinds:
                    found.append((name, node.lineno))
            if isinstance(node, ast.Compare) and not name.startswith("recjax/placement/") \
                    and name not in other_concepts:
                constants = {c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)}
                if constants & tiers:
                    compared.append((name, node.lineno))
    assert not found, found
    assert not compared, compared
    assert issubclass(placement.OneDevice, Layout) and all(issubclass(s, Storage) for s in placement.STORAGES.values())


# ------------------------------------------------------------------------------------------------------ a mesh
@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("placement_mesh")
    run_devices(out, ["runs"], script="placement_mesh_cases.py")
    return json.loads((out / "runs.json").read_text())


def test_every_mesh_run_writes_its_sharding_plan_whatever_its_storages(mesh_runs):
    """A mesh run writes sharding_plan.txt / .json with its tables in device memory, in host memory or on disk (a
    disk run used to write none), and the plans are the same: the storages do not move a table the user placed."""
    plans = {name: mesh_runs[name]["plan"] for name in ("memory", "host", "disk")}
    assert all(mesh_runs[name]["plan_txt"] and plans[name] for name in plans), plans
    placed = {name: {t["table"]: (t["sharding"], t["devices"]) for t in plan} for name, plan in plans.items()}
    assert placed["host"] == placed["memory"]
    assert placed["disk"]["C1"] == placed["memory"]["C1"] and placed["disk"]["C2"] == placed["memory"]["C2"]
    assert placed["disk"]["C4"][0] == "row"  # the planner's choice pinned row-wise: each device's cache serves it


def test_host_and_disk_storages_on_a_mesh_equal_device_memory(mesh_runs):
    """On a data=4 x model=2 mesh, each device's block of the group in its host memory (`pinned_host`), and the
    runs end with the in-memory mesh run's metrics, bit for bit."""
    memory = mesh_runs["memory"]["summary"]
    for name in ("host", "disk"):
        summary = mesh_runs[name]["summary"]
        for key in ("auc", "logloss", "final_train_loss", "selected_step"):
            assert summary[key] == memory[key], (name, key)
    assert mesh_runs["host_storages"] == {"host": ["dim8"]}
    assert set(mesh_runs["host_memory_kinds"].values()) == {"pinned_host"}, mesh_runs["host_memory_kinds"]
    assert mesh_runs["host"]["summary"]["embedding_device_bytes"] == 0
