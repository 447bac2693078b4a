"""FIITED through the engine and the trainer (compression/fiited.py, recjax/dynamic.py): each row reads its live
chunk prefix with a zero tail, pruned chunks get no update, chunk utility equals the summed per-row chunk gradient
norms, an adjustment keeps the best chunks and preserves the kept values, compaction preserves the model exactly,
and the accounting equals the arrays really allocated. The pool's own invariants: tests/test_chunk_pool.py."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_batch
from test_train import tiny_config

from compression import chunk_pool
from compression.base import TableSpec
from compression.fiited import FiitedEmbedding, UniformDimEmbedding
from recjax.dynamic import DynamicTables
from recjax.specs import DatasetSpec, FeatureSpec
from recjax.step import init_state, make_predict_step, make_train_step
from recjax.task import build_task

SPEC = DatasetSpec(num_dense=3, features=(FeatureSpec("a", 13), FeatureSpec("b", 9, bag_size=3),
                                          FeatureSpec("c", 6)))


def fiited_task(optimizer: str = "adagrad", total_steps: int = 8, **options):
    """The tiny model with FIITED on "a" and "b"; without the hashed fallback unless `fallback` is given (these tests
    check the pool: the paper's method)."""
    config = tiny_config(steps=total_steps)
    config.embedding.method = "fiited"
    config.embedding.options.chunks = 4
    config.embedding.options.fallback = 0.0
    for key, value in options.items():
        config.embedding.options[key] = value
    config.embedding.tables.c = {"method": "full"}  # a static table sharing nothing with the pools
    config.optimizer.sparse.name = optimizer
    config.optimizer.sparse.learning_rate = 0.3
    return build_task(config, SPEC, total_steps=total_steps)


def logical_rows(task, state, feature: str) -> np.ndarray:
    """f32[V, D] of a fiited feature, read from the pool through the indirection (numpy oracle of `route`)."""
    (p,) = [q for q in task.collection.physical_tables() if q.feature == feature and q.table_index == 0]
    pool = np.asarray(state.tables[p.group])[p.offset:p.offset + p.table.rows]
    method = task.collection.methods[feature]
    offsets, k = np.asarray(method.offsets(state.aux[feature])), method.chunks
    counts = np.diff(offsets)
    slots = np.where(np.arange(k)[None, :] < counts[:, None], offsets[:-1, None] + np.arange(k), -1)
    rows = np.where(slots[..., None] >= 0, pool[np.maximum(slots, 0)], 0.0)
    return rows.reshape(slots.shape[0], -1)


def with_counts(task, state, feature: str, counts: np.ndarray):
    """`state` with the pool of `feature` laid out for per-row chunk `counts` (chunk_pool.resize, state moved)."""
    (p,) = [q for q in task.collection.physical_tables() if q.feature == feature and q.table_index == 0]
    rows = slice(p.offset, p.offset + p.table.rows)
    method = task.collection.methods[feature]
    pool = chunk_pool.ChunkPool(pool=state.tables[p.group][rows], offsets=method.offsets(state.aux[feature]),
                                state={k: s[rows] for k, s in state.sparse_opt_state[p.group].items()},
                                chunks=method.chunks)
    pool, _ = jax.jit(chunk_pool.resize)(pool, jnp.asarray(counts, jnp.int32))  # one compile, not op by op
    tables = {**state.tables, p.group: state.tables[p.group].at[rows].set(pool.pool)}
    opt = {**state.sparse_opt_state, p.group: {k: s.at[rows].set(pool.state[k])
                                               for k, s in state.sparse_opt_state[p.group].items()}}
    aux = {**state.aux, feature: method.with_offsets(state.aux[feature], pool.offsets)}
    return state.replace(tables=tables, sparse_opt_state=opt, aux=aux)


def test_rows_read_their_live_prefix_and_pruned_chunks_get_no_update():
    task = fiited_task(optimizer="sgd")
    batch = jax.device_put(random_batch(SPEC, 16, seed=0, full_bags=True))
    state = init_state(task, jax.random.key(0), batch)
    # Prune row 2 of "a" to one chunk and every row of "b" to two.
    method = task.collection.methods["a"]
    state = with_counts(task, state, "a", np.where(np.arange(13) == 2, 1, 4))
    state = with_counts(task, state, "b", np.full(9, 2))
    before_a, before_b = logical_rows(task, state, "a"), logical_rows(task, state, "b")
    c = method.chunk_dim
    assert np.all(before_a[2, c:] == 0) and np.all(before_b[:, 2 * c:] == 0)

    (p,) = [q for q in task.collection.physical_tables() if q.feature == "b"]
    old_group = np.asarray(state.tables[p.group])
    new, _ = make_train_step(task)(state, batch)  # donates `state`
    after_a, after_b = logical_rows(task, new, "a"), logical_rows(task, new, "b")
    assert np.all(after_a[2, c:] == 0) and np.all(after_b[:, 2 * c:] == 0)  # still zero: no update
    touched = np.unique(np.asarray(batch.ids["a"]))
    assert not np.allclose(after_a[touched, :c], before_a[touched, :c])  # live chunks did train
    # Free pool slots (past the live 9 x 2) were not written either: they stay zero.
    dead = p.offset + np.arange(18, p.table.rows)
    assert len(dead) == 9 * 2
    np.testing.assert_array_equal(np.asarray(new.tables[p.group])[dead], old_group[dead])
    assert np.all(old_group[dead] == 0)


def test_utility_is_the_decayed_sum_of_per_row_chunk_gradient_norms():
    task = fiited_task(optimizer="sgd", decay=0.5)
    batches = [jax.device_put(random_batch(SPEC, 16, seed=i)) for i in range(2)]
    state = init_state(task, jax.random.key(0), batches[0])
    step = make_train_step(task)
    collection, glue, model = task.collection, task.glue, task.model
    names = SPEC.feature_names

    # Oracle: d loss / d embeddings from the same forward (autodiff of a plain logistic loss, not the step's
    # embedding probe), summed per row and chunk in numpy below. Jitted: one compile, not an eager op-by-op trace
    # of routing, gather and the model's gradient for each batch.
    @jax.jit
    def embedding_grads(state, batch, t):
        def loss_of_emb(emb):
            logits = model.apply({"params": state.dense_params["model"]}, batch.dense, emb, train=True,
                                 rngs={"dropout": jax.random.fold_in(state.dropout_rng, t - 1)})
            return jnp.mean(jnp.maximum(logits, 0) - logits * batch.labels + jnp.log1p(jnp.exp(-jnp.abs(logits))))

        routes = collection.route(batch.ids, batch.lengths, aux=state.aux)
        emb = glue.apply({"params": state.dense_params["glue"]}, collection.gather(state.tables, routes),
                         routes.features)
        return jax.grad(loss_of_emb)(emb)

    want = np.zeros((13, 4))
    last = np.zeros(13, int)
    for t, batch in enumerate(batches, start=1):
        g = np.asarray(embedding_grads(state, batch, t))[:, names.index("a")]  # [B, D], "a" is one-hot
        ids = np.asarray(batch.ids["a"])[:, 0]
        summed = np.zeros((13, g.shape[1]))
        np.add.at(summed, ids, g)
        seen = np.unique(ids)
        want[seen] = want[seen] * 0.5 ** (t - last[seen])[:, None] + np.linalg.norm(
            summed[seen].reshape(len(seen), 4, -1), axis=-1)
        last[seen] = t
        state, _ = step(state, batch)
    np.testing.assert_allclose(np.asarray(state.aux["a"]["utility"]), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(state.aux["a"]["last"]), last)


def test_adjust_keeps_the_best_chunks_and_compaction_preserves_the_model():
    task = fiited_task(optimizer="rowwise_adagrad", keep=0.3, interval=2, ramp=0.5, compact_slack=0.25, total_steps=8,
                       ramp_shape="linear")
    batches = [jax.device_put(random_batch(SPEC, 16, seed=i)) for i in range(4)]
    state = init_state(task, jax.random.key(0), batches[0])
    step = make_train_step(task)
    for batch in batches[:2]:
        state, _ = step(state, batch)
    dynamic = DynamicTables.create(task.collection, 8, seed=0)
    assert dynamic.features == ("a", "b") and dynamic.ramp_end(task.collection) == 4
    assert dynamic.due(task.collection, 2) and not dynamic.due(task.collection, 3)

    method = task.collection.methods["a"]
    before = logical_rows(task, state, "a")
    scores = np.asarray(method.scores(None, state.aux["a"], jnp.int32(2)))
    keep = method.budget_chunks(method.budget_at(2, 8))  # 1 -> 0.3 over 4 steps: 0.65 at step 2
    assert keep == int(np.ceil(0.65 * 13 * 4))
    task2, state2, recompiled = dynamic.adjust(task, state, 2)
    counts = np.diff(np.asarray(method.offsets(state2.aux["a"])))
    assert counts.sum() == keep
    # The kept chunks are the best by prefix score: every kept chunk scores >= every dropped one.
    kept = np.arange(4)[None, :] < counts[:, None]
    assert scores[kept].min() >= scores[~kept].max()
    after = logical_rows(task2, state2, "a")
    mask = np.repeat(kept, method.chunk_dim, axis=1)
    np.testing.assert_array_equal(after, np.where(mask, before, 0.0))  # kept values survive, the rest reads 0
    # 0.65 of the chunks: the pool (capacity V K) is more than 1.25x that, so it was compacted to the budget.
    assert recompiled and task2.collection.methods["a"].capacity == keep
    assert dynamic.timings["compactions"] == 1

    # Compaction preserved the model: the compacted layout predicts what the logical rows (read back through the
    # indirection, as V x D tables) predict.
    probs = np.asarray(make_predict_step(task2)(state2, batches[2]))
    want = reference_probs(task2, state2, {"a": after, "b": logical_rows(task2, state2, "b")}, batches[2])
    np.testing.assert_allclose(probs, want, rtol=1e-6)

    # Training goes on with the compacted layout; accounting equals the arrays allocated.
    state2, metrics = make_train_step(task2)(state2, batches[3])
    assert np.isfinite(float(metrics["loss"]))
    accounting = task2.collection.accounting(task2.sparse_optimizer)["tables"]["a"]
    (p,) = [q for q in task2.collection.physical_tables() if q.feature == "a"]
    aux = state2.aux["a"]
    model_bytes = p.table.rows * p.table.dim * 4 + aux["offsets_base"].nbytes + aux["counts"].nbytes
    opt_bytes = task2.sparse_optimizer.state_bytes(p.table.rows, p.table.dim) + aux["utility"].nbytes \
        + aux["last"].nbytes
    assert accounting["bytes"] == model_bytes and accounting["optimizer_bytes"] == opt_bytes
    assert state2.tables[p.group].shape[0] == task2.collection.group_rows[p.group]


def reference_probs(task, state, rows: dict, batch) -> np.ndarray:
    """Probabilities of the model with `rows` ({feature: f32[V, D]}) as plain tables, other features unchanged."""
    collection = task.collection

    @jax.jit  # one compile, not an eager trace op by op
    def embeddings(state, batch):
        routes = collection.route(batch.ids, batch.lengths, aux=state.aux, dedup=False)
        looked = collection.gather(state.tables, routes)
        return task.glue.apply({"params": state.dense_params["glue"]}, looked, routes.features)

    emb = np.array(embeddings(state, batch))
    for name, table in rows.items():
        f = SPEC.feature_names.index(name)
        ids, lengths = np.asarray(batch.ids[name]), np.asarray(batch.lengths[name])
        valid = np.arange(ids.shape[1])[None, :] < lengths[:, None]
        emb[:, f] = np.einsum("bl,bld->bd", valid.astype(np.float32), table[ids])
    logits = jax.jit(task.model.apply)({"params": state.dense_params["model"]}, batch.dense, jnp.asarray(emb))
    return np.asarray(jax.nn.sigmoid(logits))


def test_bad_options_name_the_table():
    with pytest.raises(ValueError, match="table 'x'.*chunks=3 must divide dim 16"):
        FiitedEmbedding(TableSpec("x", 10, 16, "fiited", {"chunks": 3}))
    with pytest.raises(ValueError, match="table 'x'.*keep must be in"):
        FiitedEmbedding(TableSpec("x", 10, 16, "fiited", {"keep": 0.0}))
    with pytest.raises(ValueError, match="table 'x'.*utility"):
        FiitedEmbedding(TableSpec("x", 10, 16, "fiited", {"utility": "random"}))
    assert UniformDimEmbedding(TableSpec("x", 10, 16, "uniform_dim", {"keep": 0.1})).reduced_dim == 2


def test_position_discount_spreads_chunks_over_rows():
    """Equal utility on every chunk: plain scores keep whole rows, a position discount keeps first chunks first."""
    aux = {"utility": jnp.ones((6, 4)), "last": jnp.zeros(6, jnp.int32)}
    for p, want in ((0.0, [4, 2, 0, 0, 0, 0]), (1.0, [1, 1, 1, 1, 1, 1])):
        m = FiitedEmbedding(TableSpec("x", 6, 8, "fiited", {"position_discount": p, "chunks": 4}))
        order = np.argsort(-np.asarray(m.scores(None, aux, jnp.int32(0))).reshape(-1), kind="stable")[:6]
        assert np.bincount(order // 4, minlength=6).tolist() == want


def test_a_fiited_run_reaches_its_budget_and_resumes_bit_identical_across_compactions(tmp_path, capsys):
    """The run's memory follows the budget down (summary.json `dynamic_tables`). Resumed from its checkpoint after the
    compactions (step 6: the resume must re-size the pools first), it ends with the same pools, indirection,
    utility, optimizer state and metrics as the uninterrupted run, with incremental (consecutive) checkpoints where
    each compaction starts a new baseline."""
    from test_checkpoint import assert_same_arrays, final_arrays, resumed_from, tiny

    from recjax import checkpoint
    from recjax.train import train_and_evaluate

    def config():
        c = tiny(steps=20, policy="consecutive", keep=10, every_steps=3)
        c.embedding.method = "fiited"
        c.embedding.options.keep = 0.25
        c.embedding.options.chunks = 4
        c.embedding.options.threshold = 100
        c.embedding.options.compact_slack = 10.0  # compact only at the ramp's end (each compaction re-compiles)
        return c

    reference = train_and_evaluate(config(), tmp_path / "reference")
    dynamic = reference["dynamic_tables"]
    assert dynamic["features"] == ["C1", "C3", "C5"]  # vocab (200, 50, 1000, 8, 3000, 20) above 100
    memory = dynamic["memory"]
    # Ramp 0.3 x 20 = 6 steps, adjusted every step (a tenth of it, at least 1): memory falls (the pools are
    # compacted at the ramp's end), then holds.
    assert [m["step"] for m in memory] == list(range(7))
    allocated = [m["allocated_bytes"] for m in memory]
    assert allocated == sorted(allocated, reverse=True) and allocated[-1] < allocated[0] / 2
    assert dynamic["peak_allocated_bytes"] == allocated[0] and dynamic["compactions"] == 1
    for f, v in zip(("C1", "C3", "C5"), (200, 1000, 3000), strict=True):
        assert memory[-1]["live_chunks"][f] == memory[-1]["capacity"][f] == math.ceil(0.25 * v * 4)
        assert sum(memory[-1]["rows_by_chunks"][f]) == v
    assert reference["embedding_bytes"] == memory[-1]["embedding_bytes"]
    assert reference["selected_step"] >= 6  # validation selects only once the budget holds

    # Resumed from the reference's checkpoint of step 6 (what a run killed after that save leaves), not from a third
    # run training and compacting the same 6 steps again.
    resumed = resumed_from(tmp_path / "reference", config(), tmp_path / "resumed", at_step=6, capsys=capsys)
    assert_same_arrays(final_arrays(tmp_path / "reference"), final_arrays(tmp_path / "resumed"))
    assert any(k.startswith("aux/C1/") for k in final_arrays(tmp_path / "resumed"))
    timing = ("adjust_s", "adjust_compile_s", "compact_s", "recompile_s")
    strip = lambda s: {k: v for k, v in s.items() if not k.endswith("_s") and not k.startswith("peak_rss")
                       and k not in ("examples_per_sec", "loop")}
    a, b = dict(reference["dynamic_tables"]), dict(resumed["dynamic_tables"])
    assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    assert {k: v for k, v in strip(reference).items() if k != "dynamic_tables"} == \
        {k: v for k, v in strip(resumed).items() if k != "dynamic_tables"}
    kinds = {s: checkpoint.open_checkpoint(tmp_path / "reference" / "checkpoints", s).meta["kind"]
             for s in (3, 6, 9)}
    assert kinds[3] == "full" and kinds[6] == "full"  # the pools were compacted at step 6: a new baseline
    assert kinds[9] == "delta"


@pytest.mark.slow  # two 8-device runs in a subprocess, with a compaction's re-compile each
def test_fiited_on_a_mesh_follows_the_single_device_run_and_resumes_bit_identical(tmp_path):
    """On a data=4,model=2 mesh (pools row-wise, table-wise and replicated): the routing arrays are updated from the
    global batch on every device, so the adjustments choose what one device chooses -- the same memory history, live
    chunks and indirection -- and the tables match the single-device run's up to f32 summation order. A mesh run
    killed after the compaction's save and resumed ends bit-identical to the uninterrupted one."""
    from test_checkpoint import assert_same_arrays, final_arrays
    from test_sharding import run_devices

    from recjax import checkpoint, sharding
    from recjax.data import make_dataset
    from recjax.train import train_and_evaluate
    from tests.fiited_mesh_runs import fiited_config

    single = train_and_evaluate(fiited_config(), tmp_path / "single")
    run_devices(tmp_path, [], script="fiited_mesh_runs.py")
    mesh = json.loads((tmp_path / "reference" / "summary.json").read_text())
    timing = ("adjust_s", "adjust_compile_s", "compact_s", "recompile_s")
    a, b = dict(single["dynamic_tables"]), dict(mesh["dynamic_tables"])
    assert a["compactions"] == b["compactions"] == 1
    assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    ours, theirs = final_arrays(tmp_path / "single"), final_arrays(tmp_path / "reference")
    offsets = [k for k in ours if k.startswith("aux/") and "offsets" in k]
    assert offsets and all(np.array_equal(ours[k], theirs[k]) for k in offsets)
    # The mesh checkpoint's tables, laid out as one device's (the compacted capacities): the same values.
    point = checkpoint.open_checkpoint(tmp_path / "reference" / "checkpoints")
    config = fiited_config()
    task = DynamicTables.with_capacities(build_task(config, make_dataset(config.data, seed=config.seed).spec),
                                         point.meta["loop"]["dynamic"]["capacities"])
    tables = sharding.relayout(task.collection, None)(
        {k[len("tables/"):]: v for k, v in theirs.items() if k.startswith("tables/")}, point.meta["layout"])
    assert sorted(tables) == sorted(k[len("tables/"):] for k in ours if k.startswith("tables/"))
    for group, rows in tables.items():
        np.testing.assert_allclose(rows, ours[f"tables/{group}"], rtol=1e-4, atol=1e-5, err_msg=group)
    np.testing.assert_allclose(theirs["aux/C5/utility"], ours["aux/C5/utility"], rtol=1e-4, atol=1e-6)
    assert abs(single["auc"] - mesh["auc"]) < 1e-5 and abs(single["logloss"] - mesh["logloss"]) < 1e-5
    kinds = {s: checkpoint.open_checkpoint(tmp_path / "resumed" / "checkpoints", s).meta["kind"] for s in (6, 9)}
    assert kinds == {6: "full", 9: "delta"}  # the compaction (step 6) started a new baseline on the mesh too
    assert_same_arrays(theirs, final_arrays(tmp_path / "resumed"))


def test_adjustments_mark_the_slots_they_change_as_dirty_rows():
    """Incremental checkpoints must carry what an adjustment changed: every pool slot whose values or optimizer
    state the re-layout changed (moved, freed and zeroed, or grown), and nothing else."""
    task = fiited_task(keep=0.5, interval=1, ramp=1.0)
    state = init_state(task, jax.random.key(0), jax.device_put(random_batch(SPEC, 16, seed=0)))
    state = make_train_step(task)(state, jax.device_put(random_batch(SPEC, 16, seed=1)))[0]  # state != 0
    state = state.replace(dirty_rows={g: jnp.zeros(t.shape[0], jnp.bool_) for g, t in state.tables.items()})
    before = ({g: np.asarray(t) for g, t in state.tables.items()},
              {g: {k: np.asarray(s) for k, s in o.items()} for g, o in state.sparse_opt_state.items()})
    dynamic = DynamicTables.create(task.collection, 8, seed=0)
    task2, state2, recompiled = dynamic.adjust(task, state, 1)
    assert not recompiled  # 15/16 of the chunks: no compaction, the bitmaps carry on
    for g in state2.tables:
        changed = np.any((np.asarray(state2.tables[g]) != before[0][g]).reshape(before[0][g].shape[0], -1), axis=1)
        for k, s in state2.sparse_opt_state[g].items():
            changed |= np.any((np.asarray(s) != before[1][g][k]).reshape(s.shape[0], -1), axis=1)
        np.testing.assert_array_equal(np.asarray(state2.dirty_rows[g]), changed)
    assert sum(int(np.asarray(d).sum()) for d in state2.dirty_rows.values()) > 0


@pytest.mark.slow  # trains full and FIITED on ML-100K
def test_fiited_at_a_tenth_of_the_bytes_trains_within_0_01_auc_of_full_on_ml100k(tmp_path):
    """The issue's bar, on real data: FIITED with its defaults at compression ratio 10 -- every byte counted: the
    pools, the packed offsets and the tables <= 200 ids kept full, keep solved by the sweep's plan -- ends within
    0.01 test AUC of the full model, same seed, same config otherwise."""
    import os
    import pathlib

    from experiments.configs import dlrm_movielens
    from experiments.sweep_compression import embedding_section
    from recjax.train import train_and_evaluate

    shared = pathlib.Path(os.environ.get("RECJAX_SHARED_DATA", pathlib.Path(__file__).resolve().parents[2] /
                                         "shared" / "data"))
    if not (shared / "movielens_100k" / "u.data").is_file():
        pytest.skip(f"ML-100K not found under {shared} (set RECJAX_SHARED_DATA)")
    summaries = {}
    for method in ("full", "fiited"):
        config = dlrm_movielens.get_config()
        config.data.dir = str(shared / "movielens_100k")
        config.data.prepared_dir = str(tmp_path / "prepared")
        config.train.progress_bar = False
        config.checkpoint.enabled = False
        if method == "fiited":
            full = summaries["full"]
            spec = DatasetSpec(0, tuple(FeatureSpec(n, v) for n, v in full["vocab_sizes"].items()))
            section = embedding_section("fiited", spec, config.embedding.dim, 10.0)
            config.embedding.method = "fiited"
            config.embedding.options.threshold = section.options.threshold
            config.embedding.options.keep = section.options.keep
            config.embedding.options.compact_slack = 10.0  # compact once, at the ramp's end (each one re-compiles)
        summaries[method] = train_and_evaluate(config, tmp_path / method)
    full, fiited = summaries["full"], summaries["fiited"]
    assert fiited["compression_ratio"] >= 9.95, fiited["compression_ratio"]
    assert fiited["embedding_bytes"] == fiited["dynamic_tables"]["final_allocated_bytes"] - \
        fiited["embedding_optimizer_bytes"]
    assert fiited["auc"] > full["auc"] - 0.01, (fiited["auc"], full["auc"])


def greedy_counts(row_utility: np.ndarray, chunks: int, p: float, budget: int) -> np.ndarray:
    """Oracle: hand out `budget` chunks one at a time, each to the row whose next chunk scores highest, chunk k of
    row r scoring row_utility[r] / (k + 1)^p (ties: lower row first)."""
    counts = np.zeros(row_utility.shape[0], int)
    for _ in range(budget):
        marginal = np.where(counts < chunks, row_utility / (counts + 1.0) ** p, -np.inf)
        counts[int(np.argmax(marginal))] += 1
    return counts


def test_a_rows_chunk_count_follows_its_total_utility_not_its_weakest_column():
    """Default scoring: a row's chunks rank by the row's summed utility with the position discount, so a row whose
    gradients happen to be small in one column (1-column chunks: the columns are an arbitrary basis) keeps as many
    chunks as its total says; the per-chunk prefix minimum cut such a row at that column."""
    utility = np.array([[4.0, 0.01, 4.0, 4.0], [1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0],
                        [0.5, 0.5, 0.5, 0.5]], np.float32)
    aux = {"utility": jnp.asarray(utility), "last": jnp.zeros(5, jnp.int32)}
    m = FiitedEmbedding(TableSpec("x", 5, 8, "fiited", {"chunks": 4}))
    scores = np.asarray(m.scores(None, aux, jnp.int32(0)))
    for budget in (3, 6, 9, 12):
        order = np.argsort(-scores.reshape(-1), kind="stable")[:budget]
        got = np.bincount(order // 4, minlength=5)
        np.testing.assert_array_equal(got, greedy_counts(utility.sum(1), 4, m.position_discount, budget))
    assert got[0] >= got[2] > 1  # row 0 (total 12.01) is not cut at its weak column 1


def test_the_budget_falls_geometrically_so_each_adjustment_prunes_the_same_share():
    """Default ramp: keep^(t / ramp steps). Linear, the last of ten adjustments to 5 % pruned 2/3 of the live chunks
    at once (14.5 % -> 5 %); geometric, every adjustment keeps keep^(1/10) = 74 % of them."""
    m = FiitedEmbedding(TableSpec("x", 100, 16, "fiited", {"keep": 0.05, "ramp": 0.5}))
    total = 200  # ramp 100 steps, an adjustment every 10
    assert m.ramp_end(total) == 100 and m.adjust_every(total) == 10
    shares = [m.budget_at(t, total) for t in range(0, 101, 10)]
    np.testing.assert_allclose(shares, [0.05 ** (t / 100) for t in range(0, 101, 10)], rtol=1e-12)
    np.testing.assert_allclose(np.array(shares[1:]) / np.array(shares[:-1]), 0.05 ** 0.1, rtol=1e-12)
    assert m.budget_at(150, total) == 0.05


def test_by_default_a_rows_utility_does_not_depend_on_when_it_was_last_seen():
    """Two rows given the same gradients, one at step 1 and one at step 300, score the same at step 300: the default
    utility is what a row's gradients said since training began (a decay of 0.99 per step made the first row's
    utility 0.99^299 = 5 % of the second's -- on a dataset whose rows recur every few hundred steps, a lottery of
    recency)."""
    m = FiitedEmbedding(TableSpec("x", 4, 8, "fiited", {"chunks": 4}))
    aux = m.init_aux()
    g = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8)), jnp.float32)
    one = jnp.ones((1, 1), jnp.float32)
    aux = m.update_aux(aux, jnp.array([[1]]), one, g, jnp.int32(1))
    aux = m.update_aux(aux, jnp.array([[2]]), one, g, jnp.int32(300))
    scores = np.asarray(m.scores(None, aux, jnp.int32(300)))
    np.testing.assert_allclose(scores[1], scores[2], rtol=1e-6)
    row_utility = np.linalg.norm(np.asarray(g).reshape(4, 2), axis=1).sum()  # chunks of 2 columns: L2 norms, summed
    np.testing.assert_allclose(scores[1], row_utility / np.arange(1, 5) ** m.position_discount, rtol=1e-5)
    assert np.all(scores[[0, 3]] == 0)


def universal_hash_oracle(ids: np.ndarray, a: int, b: int, buckets: int) -> np.ndarray:
    """((a x + b) mod p) mod m in Python integers (compression/hashing.py's family, p = 2^31 - 1)."""
    p = (1 << 31) - 1
    return np.array([((a * (int(x) % p) + b) % p) % buckets for x in ids.reshape(-1)]).reshape(ids.shape)


def test_with_a_fallback_every_row_reads_its_hashed_row_plus_its_own_live_chunks():
    """`fallback`: a row's embedding is the shared hashed row plus its live chunk prefix, so a row pruned to zero
    dims reads the hashed row instead of zeros; the predictions equal the model's with those rows as plain tables
    (numpy oracle: the hash in Python integers, the pool read through the unpacked offsets)."""
    task = fiited_task(optimizer="sgd", fallback=0.5, keep=0.5)
    batch = jax.device_put(random_batch(SPEC, 16, seed=0, full_bags=True))
    state = init_state(task, jax.random.key(0), batch)
    state = with_counts(task, state, "a", np.arange(13) % 5)  # counts 0..4: three rows at zero dims
    state = with_counts(task, state, "b", np.zeros(9, int))  # every row of "b" at zero dims
    rows = {}
    for f, v in (("a", 13), ("b", 9)):
        method = task.collection.methods[f]
        assert method.fallback_rows == round(0.5 * 0.5 * v)
        (fb,) = [q for q in task.collection.physical_tables() if q.feature == f and q.table_index == 1]
        table = np.asarray(state.tables[fb.group])[fb.offset:fb.offset + fb.table.rows]
        assert fb.table.rows == method.fallback_rows and np.any(table != 0)
        rows[f] = logical_rows(task, state, f) + table[universal_hash_oracle(np.arange(v), *method.hash_params,
                                                                             method.fallback_rows)]
    assert np.all(logical_rows(task, state, "b") == 0) and np.all(np.any(rows["b"] != 0, axis=1))
    probs = np.asarray(make_predict_step(task)(state, batch))
    np.testing.assert_allclose(probs, reference_probs(task, state, rows, batch), rtol=1e-5, atol=1e-7)


def test_the_fallback_takes_its_share_of_the_budget_and_survives_compaction(tmp_path):
    """The pool's final budget is the table's kept chunks less the fallback's (so the bytes the sweep plans hold),
    the accounting is the arrays' real bytes (pool, fallback, packed offsets), and compacting the pool leaves the
    fallback's rows and optimizer state where they were."""
    task = fiited_task(optimizer="rowwise_adagrad", keep=0.5, fallback=0.5, interval=2, ramp=0.5, compact_slack=0.25,
                       total_steps=8)
    m = task.collection.methods["a"]
    assert m.fallback_rows == 3 and m.pool_chunks == 26 - 3 * 4  # ceil(0.5 x 13 x 4) = 26 chunks in all
    assert m.budget_chunks(m.budget_at(4, 8)) == m.pool_chunks
    batches = [jax.device_put(random_batch(SPEC, 16, seed=i)) for i in range(3)]
    state = init_state(task, jax.random.key(0), batches[0])
    for batch in batches[:2]:
        state, _ = make_train_step(task)(state, batch)
    (fb,) = [q for q in task.collection.physical_tables() if q.feature == "a" and q.table_index == 1]
    fallback = np.asarray(state.tables[fb.group])[fb.offset:fb.offset + fb.table.rows]
    fallback_opt = {k: np.asarray(s)[fb.offset:fb.offset + fb.table.rows]
                    for k, s in state.sparse_opt_state[fb.group].items()}
    dynamic = DynamicTables.create(task.collection, 8, seed=0)
    task, state, _ = dynamic.adjust(task, state, 2)
    task, state, compacted = dynamic.adjust(task, state, 4)  # the ramp's end: compacted to the final budget
    assert compacted and task.collection.methods["a"].capacity == 14
    (fb,) = [q for q in task.collection.physical_tables() if q.feature == "a" and q.table_index == 1]
    np.testing.assert_array_equal(np.asarray(state.tables[fb.group])[fb.offset:fb.offset + fb.table.rows], fallback)
    for k, s in state.sparse_opt_state[fb.group].items():
        np.testing.assert_array_equal(np.asarray(s)[fb.offset:fb.offset + fb.table.rows], fallback_opt[k])
    accounting = task.collection.accounting(task.sparse_optimizer)["tables"]["a"]
    aux = state.aux["a"]
    assert accounting["bytes"] == (14 * 2 + 3 * 8) * 4 + aux["offsets_base"].nbytes + aux["counts"].nbytes
