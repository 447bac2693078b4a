"""The embedding engine against a dense oracle: stacking, pooled gather, and the sparse update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_batch

from compression import TableSpec
from recjax.embedding import EmbeddingCollection, EmbeddingGlue
from recjax.sparse_optim import SGD, RowwiseAdagrad
from recjax.specs import DatasetSpec, FeatureSpec


def make_collection(spec, dim=4, pooling="sum"):
    return EmbeddingCollection(spec, [TableSpec(f.name, f.vocab_size, dim) for f in spec.features], pooling)


def numpy_embeddings(collection, tables, batch):
    """[B, F, D] by explicit loops over examples and bag slots."""
    out = np.zeros((batch.size, len(collection.spec.features), collection.dim), np.float32)
    for fi, f in enumerate(collection.spec.features):
        (p,) = collection.placements[f.name]
        table = np.asarray(tables[p.group])[p.offset: p.offset + p.table.rows]
        for b in range(batch.size):
            n = batch.lengths[f.name][b]
            for slot in range(n):
                out[b, fi] += table[batch.ids[f.name][b, slot]]
            if collection.pooling == "mean" and n > 0:
                out[b, fi] /= n
    return out


def test_stacking_offsets_and_accounting(small_spec):
    collection = make_collection(small_spec, dim=4)
    assert collection.group_rows == {"dim4": 7 + 11 + 5}
    assert [collection.placements[f][0].offset for f in ("a", "b", "c")] == [0, 7, 18]
    acc = collection.accounting(RowwiseAdagrad(0.1))
    assert acc["params"] == 23 * 4
    assert acc["bytes"] == 23 * 4 * 4
    assert acc["optimizer_bytes"] == 23 * 4
    assert acc["tables"]["b"]["physical_tables"] == {"b": [11, 4]}


def test_tables_of_different_dims_go_to_separate_groups():
    spec = DatasetSpec(1, (FeatureSpec("a", 3), FeatureSpec("b", 4), FeatureSpec("c", 5)))
    tables = [TableSpec("a", 3, 8), TableSpec("b", 4, 16), TableSpec("c", 5, 8)]
    collection = EmbeddingCollection(spec, tables)
    assert collection.group_rows == {"dim8": 8, "dim16": 4}
    assert collection.dim is None


def test_init_follows_dlrm_bounds(small_spec):
    collection = make_collection(small_spec, dim=64)
    table = np.asarray(collection.init_tables(jax.random.key(0))["dim64"])
    for f in small_spec.features:
        (p,) = collection.placements[f.name]
        block = table[p.offset: p.offset + p.table.rows]
        bound = np.sqrt(1 / f.vocab_size)
        assert np.abs(block).max() <= bound
        assert np.abs(block).max() > 0.8 * bound  # uses the range, not a constant


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_gather_and_glue_match_numpy(small_spec, pooling):
    collection = make_collection(small_spec, pooling=pooling)
    tables = collection.init_tables(jax.random.key(0))
    batch = random_batch(small_spec, 16, seed=1)
    # Garbage in padded slots must not matter.
    for f in small_spec.features:
        slot = np.arange(f.bag_size)[None, :]
        batch.ids[f.name][slot >= batch.lengths[f.name][:, None]] = 10**6
    routes = collection.route(batch.ids, batch.lengths)
    rows = collection.gather(tables, routes)
    glue = EmbeddingGlue(collection)
    emb = glue.apply(glue.init(jax.random.key(0), rows, routes.features), rows, routes.features)
    np.testing.assert_allclose(np.asarray(emb), numpy_embeddings(collection, tables, batch), rtol=1e-5, atol=1e-6)


def dense_oracle_update(name, collection, tables, batch, target, lr):
    """The whole-table reference: autodiff w.r.t. every table row, then the rule on the rows the batch used."""
    glue = EmbeddingGlue(collection)

    def loss_from_tables(tables, batch):
        routes = collection.route(batch.ids, batch.lengths)
        return jnp.sum(jnp.sin(glue.apply({}, collection.gather(tables, routes), routes.features)) * target)

    # Jitted: one compile instead of routing, gathering and differentiating eagerly, primitive by primitive.
    grad = np.asarray(jax.jit(jax.grad(loss_from_tables))(tables, batch)["dim4"])
    table = np.asarray(tables["dim4"]).copy()
    touched = np.zeros(table.shape[0], bool)
    for f in collection.spec.features:
        (p,) = collection.placements[f.name]
        for b in range(batch.size):
            touched[p.offset + batch.ids[f.name][b, : batch.lengths[f.name][b]]] = True
    if name == "sgd":
        table[touched] -= lr * grad[touched]
    else:  # row-wise Adagrad from a zero accumulator, eps 1e-8
        acc = np.mean(grad * grad, axis=1)
        table[touched] -= lr * grad[touched] / (np.sqrt(acc[touched])[:, None] + 1e-8)
    return table, touched


@pytest.mark.parametrize("optimizer", [SGD(0.5), RowwiseAdagrad(0.5)])
def test_sparse_update_equals_dense_gradient_oracle(optimizer):
    """route -> gather distinct rows -> grad w.r.t. them -> sparse_update equals the whole-table oracle, with
    duplicate ids within bags, across examples and across features sharing the stacked group."""
    spec = DatasetSpec(num_dense=3, features=(FeatureSpec("a", 40), FeatureSpec("b", 90, bag_size=4),
                                              FeatureSpec("c", 25, bag_size=2)))
    collection = make_collection(spec, pooling="mean")
    tables = collection.init_tables(jax.random.key(0))
    batch = random_batch(spec, 32, seed=2)
    batch.ids["b"][:4] = 3  # the same id many times, within and across bags
    target = jax.random.normal(jax.random.key(3), (32, 3, 4))
    glue = EmbeddingGlue(collection)

    @jax.jit
    def step(tables, state, batch):
        routes = collection.route(batch.ids, batch.lengths)
        rows = collection.gather(tables, routes)
        loss = lambda rows: jnp.sum(jnp.sin(glue.apply({}, rows, routes.features)) * target)  # noqa: E731
        return collection.sparse_update(optimizer, tables, state, routes, rows, jax.grad(loss)(rows),
                                        jnp.float32(optimizer.learning_rate), jnp.int32(1))

    expected, touched = dense_oracle_update(optimizer.name, collection, tables, batch, target, optimizer.learning_rate)
    updated, state = step(tables, collection.init_optimizer(optimizer), batch)
    np.testing.assert_allclose(np.asarray(updated["dim4"]), expected, rtol=1e-5, atol=1e-6)
    assert 0 < touched.sum() < touched.size
    if optimizer.name == "rowwise_adagrad":
        assert np.all(np.asarray(state["dim4"]["accumulator"])[~touched] == 0)


@pytest.mark.parametrize("row_decay", [None, 0.5])
def test_factor_tables_stack_apart_and_take_their_row_decay(row_decay):
    """QR's factor rows take `row_decay` x the optimizer's weight decay (default 0); a full table's rows all of it.
    With a zero loss gradient SGD's update is pure decay: w <- w (1 - lr wd scale) on every touched row."""
    spec = DatasetSpec(num_dense=1, features=(FeatureSpec("a", 30), FeatureSpec("b", 40)))
    options = {"collisions": 4} if row_decay is None else {"collisions": 4, "row_decay": row_decay}
    collection = EmbeddingCollection(spec, [TableSpec("a", 30, 4), TableSpec("b", 40, 4, "qr", options)])
    factor_group = "dim4_decay0" if row_decay is None else "dim4_decay0.5"
    assert collection.group_rows == {"dim4": 30, factor_group: 10 + 4}
    tables = collection.init_tables(jax.random.key(0))
    optimizer = SGD(0.1, weight_decay=0.2)
    batch = random_batch(spec, 16, seed=1)
    routes = collection.route(batch.ids, batch.lengths)
    rows = collection.gather(tables, routes)
    zero = jax.tree.map(jnp.zeros_like, rows)
    updated, _ = collection.sparse_update(optimizer, tables, collection.init_optimizer(optimizer), routes, rows, zero,
                                          jnp.float32(0.1), jnp.int32(1))
    for group, scale in (("dim4", 1.0), (factor_group, row_decay or 0.0)):
        touched = np.unique(np.asarray(routes.unique[group]))
        touched = touched[touched < collection.group_rows[group]]
        before, after = np.asarray(tables[group]), np.asarray(updated[group])
        np.testing.assert_allclose(after[touched], before[touched] * (1 - 0.1 * 0.2 * scale), rtol=1e-6)
        untouched = np.setdiff1d(np.arange(len(before)), touched)
        np.testing.assert_array_equal(after[untouched], before[untouched])
    with pytest.raises(ValueError, match="option row_decay must be a number >= 0"):
        EmbeddingCollection(spec, [TableSpec("a", 30, 4), TableSpec("b", 40, 4, "tt", {"row_decay": -1})])


def test_unknown_method_and_missing_table(small_spec):
    with pytest.raises(ValueError, match="unknown embedding method 'qrr'"):
        EmbeddingCollection(small_spec, [TableSpec(f.name, f.vocab_size, 4, "qrr") for f in small_spec.features])
    with pytest.raises(ValueError, match=r"no embedding table configured for features \['c'\]"):
        EmbeddingCollection(small_spec, [TableSpec("a", 7, 4), TableSpec("b", 11, 4)])


def _one_step(collection, tables, ids, lengths):
    """route -> gather -> glue -> SGD update with d loss / d embeddings = 1: (embeddings, new tables, routes)."""
    glue = EmbeddingGlue(collection)

    @jax.jit
    def step(tables, ids, lengths):
        routes = collection.route(ids, lengths)
        rows = collection.gather(tables, routes)
        variables = glue.init(jax.random.key(0), rows, routes.features)
        emb, vjp = jax.vjp(lambda r: glue.apply(variables, r, routes.features), rows)
        (grads,) = vjp(jnp.ones_like(emb))
        new, _ = collection.sparse_update(SGD(1.0), tables, {g: {} for g in tables}, routes, rows, grads,
                                          jnp.float32(1.0), jnp.int32(1))
        return emb, new, routes.invalid_ids

    return step(tables, ids, lengths)


def test_bounds_check_zero_reads_zeros_skips_the_update_and_counts(small_spec):
    """Feature 'a' (7 ids) gets id 9, which without a check would be row 2 of the next feature 'b'."""
    collection = EmbeddingCollection(small_spec, [TableSpec(f.name, f.vocab_size, 4) for f in small_spec.features])
    tables = collection.init_tables(jax.random.key(0))
    ids = {"a": jnp.array([[9], [3]], jnp.int32), "b": jnp.zeros((2, 4), jnp.int32), "c": jnp.zeros((2, 2), jnp.int32)}
    lengths = {"a": jnp.array([1, 1]), "b": jnp.array([0, 0]), "c": jnp.array([0, 0])}
    emb, new, invalid = _one_step(collection, tables, ids, lengths)
    assert int(invalid["a"]) == 1 and int(invalid["b"]) == 0
    np.testing.assert_array_equal(np.asarray(emb)[0, 0], 0.0)  # the bad id read zeros
    old, changed = np.asarray(tables["dim4"]), np.asarray(new["dim4"])
    assert np.array_equal(changed[9], old[9])  # 'b' row 2 (stacked row 9) untouched
    assert not np.array_equal(changed[3], old[3])  # the valid id was updated
    # "off" trusts the caller: the same id reads the next feature's row -- why the check exists.
    trusting = EmbeddingCollection(small_spec, [TableSpec(f.name, f.vocab_size, 4) for f in small_spec.features],
                                   bounds_check="off")
    emb, _, invalid = _one_step(trusting, tables, ids, lengths)
    np.testing.assert_allclose(np.asarray(emb)[0, 0], old[9])
    assert invalid == {}


def test_bounds_check_error_names_the_feature(small_spec):
    collection = EmbeddingCollection(small_spec, [TableSpec(f.name, f.vocab_size, 4) for f in small_spec.features],
                                     bounds_check="error")
    tables = collection.init_tables(jax.random.key(0))
    ids = {"a": jnp.array([[-1], [3]], jnp.int32), "b": jnp.zeros((2, 4), jnp.int32), "c": jnp.zeros((2, 2), jnp.int32)}
    lengths = {"a": jnp.array([1, 1]), "b": jnp.array([1, 1]), "c": jnp.array([2, 2])}
    with pytest.raises(Exception, match=r"feature 'a': 1 ids outside \[0, 7\)"):
        jax.block_until_ready(_one_step(collection, tables, ids, lengths))
    with pytest.raises(ValueError, match="unknown bounds_check 'clamp'"):
        EmbeddingCollection(small_spec, [TableSpec(f.name, f.vocab_size, 4) for f in small_spec.features],
                            bounds_check="clamp")
