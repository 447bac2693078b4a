"""The one-device layout: every table on one device (recjax/embedding_backend.py `Layout`; the mesh's is
recjax/sharding/layout.py)."""

import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from recjax.embedding import Routes
from recjax.embedding_backend import Layout


class OneDevice(Layout):
    """Every table on one device: the collection's route, gather and sparse update, each group's rows read and
    updated by its storage.

    Training routes deduplicate unless the collection's `dedup` is off (plain SGD, XLA, multi-hot bags: every
    occurrence scatter-added); forward-only steps never do (bags pool straight from the tables)."""

    def __init__(self):
        self.cached_groups: dict = {}

    # ------------------------------------------------------------------------------------------- device side
    def route(self, batch, aux: Mapping, *, train: bool) -> Routes:
        return self.collection.route(batch.ids, batch.lengths, aux=aux, dedup=None if train else False)

    def fetch(self, tables: Mapping[str, jax.Array], routes: Routes):
        tables, routes = self._brought(tables, routes)
        return self.collection.gather(tables, routes), None

    def _brought(self, tables: Mapping[str, jax.Array], routes: Routes):
        """The rows of groups whose storage is not `resident`, brought to the device (the distinct rows, or without
        dedup every bag slot's row), and the routes indexing them; the other groups as they are."""
        away = [g for g in tables if not self.storage_of[g].resident]
        if not away:
            return tables, routes
        tables, collection = dict(tables), self.collection
        features = dict(routes.features)
        if routes.deduplicated:
            unique = dict(routes.unique)
            for g in away:
                tables[g] = self.storage_of[g].bring(g, tables[g], unique[g])
                unique[g] = jnp.arange(unique[g].shape[0], dtype=jnp.int32)
            if routes.unique_slots is not None:  # the bags read the brought rows by their place in `unique`
                features = {name: route.replace(slots=tuple(
                    at if p.group in away else s for p, s, at in
                    zip(collection.placements[name], route.slots, routes.unique_slots[name], strict=True)))
                    for name, route in features.items()}
            return tables, routes.replace(unique=unique, features=features)
        flat: dict[str, list[jax.Array]] = {g: [] for g in away}  # every bag slot's row, in placement order
        for name, placed in collection.placements.items():
            for p, slots in zip(placed, routes.features[name].slots, strict=True):
                if p.group in flat:
                    flat[p.group].append(slots.reshape(-1))
        starts = dict.fromkeys(away, 0)
        for g in away:
            tables[g] = self.storage_of[g].bring(g, tables[g], jnp.concatenate(flat[g]))
        for name, placed in collection.placements.items():
            slots = []
            for p, s in zip(placed, features[name].slots, strict=True):
                if p.group in starts:
                    slots.append((starts[p.group] + jnp.arange(s.size, dtype=jnp.int32)).reshape(s.shape))
                    starts[p.group] += s.size
                else:
                    slots.append(s)
            features[name] = features[name].replace(slots=tuple(slots))
        return tables, routes.replace(features=features)

    def update(self, optimizer, tables, opt_state, routes, exchange, rows, row_grads, lr, step):
        storage_of = self.storage_of
        tables, opt_state = self.collection.sparse_update(
            optimizer, dict(tables), dict(opt_state), routes, rows, row_grads, lr, step,
            apply={g: functools.partial(s.apply, g) for g, s in storage_of.items()},
            scatter={g: functools.partial(s.scatter_add, g) for g, s in storage_of.items()})
        return tables, opt_state, self.collection.touched_rows(routes)

    # --------------------------------------------------------------------------------------------- host side
    def compile_train(self, train_step: Callable, state, batch, stacked: bool = False) -> Callable:
        return jax.jit(train_step, donate_argnums=(0,))

    def relayout(self) -> Callable:
        from recjax.sharding.relayout import relayout

        return relayout(self.collection, None)

    def compile_predict(self, predict_step: Callable, state, batch) -> Callable:
        return jax.jit(predict_step)

    def _sharding(self, group: str):
        kind = self.storage_of[group].memory_kind
        return None if kind is None else jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)

    def gather_dense(self, state):
        return state  # on the device already

    def place_tables(self, tables, opt_state, dirty_rows, groups):
        out_tables, out_opt, out_dirty = {}, {}, {}
        for g in groups:
            sharding = self._sharding(g)
            put = (lambda x: x) if sharding is None else (lambda x, s=sharding: jax.device_put(x, s))  # noqa: E731
            out_tables[g] = put(tables[g])
            out_opt[g] = {k: put(v) for k, v in opt_state[g].items()}
            if g in dirty_rows:
                out_dirty[g] = dirty_rows[g]
        return out_tables, out_opt, out_dirty

    def gather_tables(self, tables, opt_state, dirty_rows, groups):
        """The arrays as they are (a checkpoint copies them to the host itself)."""
        return ({g: tables[g] for g in groups}, {g: dict(opt_state[g]) for g in groups},
                {g: dirty_rows[g] for g in groups if g in dirty_rows})

    # ------------------------------------------------------------------------------------- a storage's cache
    def cache_layouts(self, cached, batch_size, cache_fraction, cache_rows):
        from recjax.tiering.slots import plan_group_layouts

        return plan_group_layouts(self.collection, cached, batch_size, cache_fraction, cache_rows)

    def cache_slots(self, layouts) -> dict:
        from recjax.tiering.slots import GroupSlots

        return {layout.name: GroupSlots(layout) for layout in layouts}
