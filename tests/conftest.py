"""Shared fixtures: small specs and deterministic batches."""

import os

# LLVM -O0 for XLA:CPU's generated code: the tests' programs are small and short-lived, so compiling them dominates
# and -O0 makes the suite ~30 % faster (measured on tests/test_scaling.py + test_train.py + test_dedup_modes.py:
# 175 s -> 126 s). Same HLO, same tolerances; subprocesses the tests start inherit it. Set before jax's backend
# starts; benchmarks never import this file.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# XLA:CPU aborts a multi-device program when one device's thread reaches a collective 40 s after another (its
# rendezvous timeout, meant for deadlocks): two cores shared by 8 device threads and other work can starve one
# that long. 3 h (HANG_GUARD_S below) instead; the mesh tests' subprocesses inherit it.
os.environ["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=10800"
# One XLA compilation cache for the whole test session, shared by the xdist workers and the subprocesses the tests
# start: many tests compile the very same small programs (a tiny config's train, eval and init steps), and a program
# compiled once is then loaded, not compiled again (measured: tests/test_train.py 53-59 s -> 46.5 s from an empty
# cache). JAX's thresholds off, since at -O0 every compile is under its 1 s default. A fresh directory per session,
# made by the first process to import this file (pytest-xdist's controller, before it starts the workers, which
# inherit it) and removed when that process ends, so no executable outlives the code that compiled it.
if "RECJAX_TEST_JAX_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["RECJAX_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="recjax_test_jax_cache_")
    atexit.register(shutil.rmtree, os.environ["RECJAX_TEST_JAX_CACHE"], ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["RECJAX_TEST_JAX_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402
import numpy as np
import pytest

from recjax.batch import Batch
from recjax.specs import DatasetSpec, FeatureSpec

# No test has a time budget: on a loaded machine (the suite shares 2 cores with other work) everything takes many
# times its idle time, and a test must still pass. What waits on something that could hang (another process, a
# background thread, a kernel) has a guard this long, hours beyond any slow run, to end a real hang.
HANG_GUARD_S = 3 * 3600


def random_batch(spec: DatasetSpec, batch_size: int, seed: int = 0, full_bags: bool = False) -> Batch:
    """Valid random batch for `spec`: uniform ids, random bag lengths (>= 1 unless one-hot)."""
    rng = np.random.default_rng(seed)
    ids, lengths = {}, {}
    for f in spec.features:
        ids[f.name] = rng.integers(0, f.vocab_size, (batch_size, f.bag_size)).astype(np.int32)
        if full_bags or f.bag_size == 1:
            lengths[f.name] = np.full(batch_size, f.bag_size, np.int32)
        else:
            lengths[f.name] = rng.integers(0, f.bag_size + 1, batch_size).astype(np.int32)
    return Batch(dense=rng.normal(size=(batch_size, spec.num_dense)).astype(np.float32), ids=ids, lengths=lengths,
                 labels=(rng.random(batch_size) < 0.3).astype(np.float32))


def train_steps(config, spec: DatasetSpec, batches):
    """(task, state, losses) after one train step per batch from `init_state(key 0)`, for whole-step comparisons."""
    from recjax.step import init_state, make_train_step
    from recjax.task import build_task

    task = build_task(config, spec)
    state = init_state(task, jax.random.key(0), batches[0])
    step = make_train_step(task)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return task, state, losses


def run_notebook(path, workdir, monkeypatch):
    """Execute the notebook at `path` top to bottom from its folder, in its tiny setting (RECJAX_NOTEBOOK_TINY=1),
    writing into `workdir` (RECJAX_NOTEBOOK_WORKDIR), and return it with its outputs; skipped without nbformat /
    nbclient. Cells have no time limit (the tests share 2 cores with other work and must not fail because the
    machine is busy); waits for the kernel and its messages have HANG_GUARD_S."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("RECJAX_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("RECJAX_NOTEBOOK_WORKDIR", str(workdir))
    notebook = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=None, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
        startup_timeout=HANG_GUARD_S,  # kernel start: ~0.6 s idle (nbclient's default, 60 s, is a time budget)
        # A cell's outputs arrive ~2 ms after its reply (idle); nbclient waits 4 s by default and then *drops* the
        # rest silently (a missing plot, not an error): wait as long as they take, and a lost one is an error.
        iopub_timeout=HANG_GUARD_S, raise_on_iopub_timeout=True,
    ).execute()
    return notebook


@pytest.fixture
def small_spec() -> DatasetSpec:
    return DatasetSpec(num_dense=3, features=(FeatureSpec("a", 7), FeatureSpec("b", 11, bag_size=4),
                                              FeatureSpec("c", 5, bag_size=2)))


def embed(collection, tables, ids, lengths):
    """Embeddings f32[B, F, D] (numpy) and the glue's initialised variables, through route -> gather -> glue."""
    from recjax.embedding import EmbeddingGlue

    glue = EmbeddingGlue(collection)

    @jax.jit
    def run(tables, ids, lengths):
        routes = collection.route(ids, lengths)
        rows = collection.gather(tables, routes)
        variables = glue.init(jax.random.key(1), rows, routes.features)
        return glue.apply(variables, rows, routes.features), variables

    emb, variables = run(tables, ids, lengths)
    return np.asarray(emb), variables


def pallas_calls(fn, *args) -> list[tuple[str, str]]:
    """(name, kernel family) of every pallas_call in `fn`'s jaxpr at `args`, nested jaxprs included (jit, cond
    branches, scans, custom VJPs). The family comes from the compiler params: "mosaic" (Mosaic TPU) or "triton" --
    so a test can assert which kernel a path traced, not only that its numbers match."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas import triton as plgpu
    from jax.extend.core import ClosedJaxpr, Jaxpr

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                params = eqn.params["compiler_params"]
                family = ("mosaic" if isinstance(params, pltpu.CompilerParams)
                          else "triton" if isinstance(params, plgpu.CompilerParams) else type(params).__name__)
                found.append((eqn.params["name"], family))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(sub, ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
