"""Serving with the tables in their files: each group's stored table stays in the export's .npy file (memory-mapped,
read on a miss) behind a RAM cache of its hot rows (`RowCache` of recjax/tiering/cache.py: LRU or exact LFU), the
serving counterpart of the training disk tier (EMS-i / the SCM serving paper's rows from a slower tier; RecNMP's
hot-entry locality is what makes a small cache hit).

    model = TieredServingModel("runs/ml100k/export_int8", cache=0.1)     # 10 % of each group's rows in RAM
    python -m experiments.serve --model=runs/ml100k/export_int8 --tier=disk --cache=0.1

A batch is scored by the export's two halves of the scoring function (recjax/serving/export.py
`gathered_functions`): the compiled route gives the stored row every bag slot reads; the host takes the batch's
distinct rows from the cache, reading the misses from the file into the slots the cache frees; the compiled lookup
decodes and pools exactly those stored bytes as the in-RAM model does, so the scores are the in-RAM model's, bit for
bit. `cache_stats()` (distinct rows found in the cache, distinct rows looked up; per batch, summed) feeds the
server's `recjax_serving_table_cache_hit_ratio`.
"""

import math
import pathlib

import jax
import numpy as np

from recjax.serving import loader
from recjax.tiering.cache import POLICIES, RowCache

TIERS = ("memory", "disk")


class TieredServingModel(loader.ServingModel):
    """An export (`loader.ServingModel`'s encode and seam) whose tables are read through a per-group RAM row cache
    holding `cache` of the group's rows (at least one), evicting by `policy`."""

    def __init__(self, directory: str | pathlib.Path, cache: float = 0.1, policy: str = "lru"):
        if not 0 < cache <= 1:
            raise ValueError(f"cache must be a fraction of each table's rows in (0, 1], got {cache}")
        if policy not in POLICIES or policy == "static":
            raise ValueError(f"cache policy must be lru or lfu, got {policy!r}")
        self.cache_fraction, self.policy = cache, policy
        super().__init__(directory)
        gathered = self.manifest.get("gathered")
        if gathered is None:
            raise ValueError(f"{self.directory} has no gathered scoring functions (exported before tiered serving); "
                             "export the run again")
        load = lambda name: jax.jit(jax.export.deserialize(  # noqa: E731
            bytearray((self.directory / gathered[name]).read_bytes())).call)
        self._slot_rows, self._score_gathered = load("slot_rows"), load("score")
        tables = self.constants[0]
        self.caches = {g: RowCache(t.shape[0], max(1, math.ceil(cache * t.shape[0])), policy)
                       for g, t in tables.items()}
        self.slots = {g: np.zeros((c.size, *tables[g].shape[1:]), tables[g].dtype) for g, c in self.caches.items()}

    def _constants(self, arguments: dict) -> tuple:
        """The tables stay memory-mapped on the host (read row by row on a miss); params and routing arrays go to
        the device."""
        tables = loader._skeleton(arguments["tables"], self.directory)
        params, aux = jax.device_put(tuple(loader._skeleton(arguments[k], self.directory) for k in ("params", "aux")))
        return tables, params, aux

    def gather(self, group: str, ids: np.ndarray) -> np.ndarray:
        """The stored rows of `ids` i32[M] (ids outside the table read zeros, which the lookup ignores), from the
        cache; misses are read from the file into the slots the cache gives them. A batch with more distinct rows
        than the cache has slots goes through it in pieces of at most its size."""
        table, cache, slots = self.constants[0][group], self.caches[group], self.slots[group]
        valid = (ids >= 0) & (ids < table.shape[0])
        distinct, inverse = np.unique(ids[valid], return_inverse=True)
        rows = np.empty((distinct.size, *table.shape[1:]), table.dtype)
        for start in range(0, distinct.size, cache.size):
            piece = distinct[start:start + cache.size]
            plan = cache.plan(piece, dirty=False)
            if plan.miss_rows.size:
                slots[plan.miss_slots] = table[plan.miss_rows]  # ascending rows: the file is read in order
            rows[start:start + piece.size] = slots[plan.slots]
        out = np.zeros((ids.size, *table.shape[1:]), table.dtype)
        out[valid] = rows[inverse.reshape(-1)]
        return out

    def score_arrays(self, dense: np.ndarray, ids: dict[str, np.ndarray], lengths: dict[str, np.ndarray],
                     pad_to: int | None = None) -> np.ndarray:
        n = dense.shape[0]
        dense, ids, lengths = loader.pad_rows(dense, ids, lengths, n if pad_to is None else pad_to)
        _, params, aux = self.constants
        slot_rows = jax.device_get(self._slot_rows(aux, ids, lengths))
        gathered = {g: self.gather(g, np.asarray(r)) for g, r in slot_rows.items()}
        return np.asarray(self._score_gathered(gathered, params, aux, dense, ids, lengths))[:n]

    def cache_stats(self) -> tuple[int, int]:
        """(distinct rows found in the cache, distinct rows looked up), over every batch and group so far."""
        return (sum(c.hits for c in self.caches.values()), sum(c.lookups for c in self.caches.values()))

    def describe(self) -> str:
        slots = sum(c.size for c in self.caches.values())
        ram = sum(s.nbytes for s in self.slots.values())
        return (f"{super().describe()}; tables on disk behind a {self.policy} row cache of {slots:,} rows "
                f"({self.cache_fraction:g} of each table, {ram / 2**20:.2f} MiB in RAM)")
