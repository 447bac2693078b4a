"""The host-side directory of one stacked group's row cache: which row sits in which slot, and which rows leave.

`RowCache.plan(rows, dirty)` is called once per step, in the order the steps run, with the distinct cached rows the
step needs. It keeps those rows' slots, gives each miss a slot -- a free one, else a victim chosen by the policy among
the slots this step does not use -- and returns what must move: the misses to read into their slots, and the dirty
victims whose values must be written back before their slots are refilled. Everything is vectorised numpy over the
step's rows; nothing is O(cache) per step except the LFU pool's occasional refresh.

Policies (victims are never slots of the current step's rows, and never pinned slots):
    lru     exact least-recently-used: a log of each step's slots, oldest first; an entry is stale once its slot was
            used again (its last-use step moved on), and the first fresh entries are the victims. Amortised O(rows
            a step uses); the log is compacted when it outgrows a few times the cache.
    lfu     least-frequently-used (uses since the row entered the cache, ties by least recent): victims come from a
            pool of the least-used slots taken from the whole cache when the pool runs dry; a pooled slot used since
            is skipped. So it is exact at each refresh and approximate in between (a slot filled after the refresh
            is not a candidate until the next one).
    static  a hot set pinned for the whole run (the rows a profiling pass over the first batches used most, loaded
            at the start; RecNMP's hot-entry profiling), the other slots LRU for the rest.
"""

import collections
import dataclasses

import numpy as np

POLICIES = ("lru", "lfu", "static")


@dataclasses.dataclass
class Plan:
    """What one step moves in one group's cache.

    slots: i32[N] the slot of each row asked for, in the order asked.
    miss_rows / miss_slots: i64[M] / i32[M] rows to read into their (new) slots.
    evict_rows / evict_slots: i64[E] / i32[E] dirty rows leaving: their values are read out of these slots before the
        misses are written in.
    """

    slots: np.ndarray
    miss_rows: np.ndarray
    miss_slots: np.ndarray
    evict_rows: np.ndarray
    evict_slots: np.ndarray


class RowCache:
    """The directory of `slots` cache slots over the rows [0, rows) of a group (only the cached tables' rows are ever
    asked for). `pinned` rows (the static policy's hot set) take the first slots for the whole run."""

    def __init__(self, rows: int, slots: int, policy: str = "lru", pinned: np.ndarray | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; use one of {list(POLICIES)}")
        self.rows, self.size, self.policy = rows, slots, policy
        self.slot_of_row = np.full(rows, -1, np.int32)
        self.row_of_slot = np.full(slots, -1, np.int64)
        self.dirty = np.zeros(slots, bool)
        self.last_use = np.full(slots, -1, np.int64)  # the tick a slot was last asked for
        self.uses = np.zeros(slots, np.int64)  # lfu: uses since the row entered its slot
        self.pinned = np.zeros(slots, bool)
        self.tick = 0
        pinned = np.zeros(0, np.int64) if pinned is None else np.asarray(pinned, np.int64)
        if len(pinned) > slots:
            raise ValueError(f"{len(pinned)} pinned rows do not fit {slots} slots")
        self.pinned[: len(pinned)] = True
        self.row_of_slot[: len(pinned)] = pinned
        self.slot_of_row[pinned] = np.arange(len(pinned), dtype=np.int32)
        self._free = np.arange(slots - 1, len(pinned) - 1, -1, dtype=np.int32)  # a stack: pop from the end
        self._free_top = len(self._free)
        self._log: collections.deque = collections.deque()  # lru: [tick, slots i32[n], next position]
        self._log_size = 0
        self._pool = np.zeros(0, np.int32)  # lfu candidates, best first, with their uses / last use when pooled
        self._pool_uses = self._pool_last = np.zeros(0, np.int64)
        self._pool_pos = 0
        self.lookups = self.hits = self.misses = self.evictions = self.writebacks = 0

    @property
    def pinned_rows(self) -> np.ndarray:
        return self.row_of_slot[self.pinned]

    @property
    def evictable(self) -> int:
        return self.size - int(self.pinned.sum())

    def plan(self, rows: np.ndarray, dirty: bool) -> Plan:
        """Slots for the distinct rows i64[N] a step asks for (a training step updates them: `dirty`)."""
        rows = np.asarray(rows, np.int64)
        self.tick += 1
        slots = self.slot_of_row[rows].astype(np.int32)
        hit = slots >= 0
        hit_slots = slots[hit]
        # Marking the hits used now makes their older log entries stale and keeps them out of this step's victims.
        self.last_use[hit_slots] = self.tick
        self.uses[hit_slots] += 1
        miss_rows = rows[~hit]
        victims = self._victims(len(miss_rows))
        leaving = self.row_of_slot[victims]
        taken = leaving >= 0
        evict = taken & self.dirty[victims]
        evict_slots, evict_rows = victims[evict], leaving[evict]
        self.slot_of_row[leaving[taken]] = -1
        self.row_of_slot[victims] = miss_rows
        self.slot_of_row[miss_rows] = victims
        self.dirty[victims] = False
        self.last_use[victims] = self.tick
        self.uses[victims] = 1
        slots[~hit] = victims
        if dirty:
            self.dirty[slots] = True
        if self.policy != "lfu":
            unpinned = slots[~self.pinned[slots]]
            self._log.append([self.tick, unpinned, 0])
            self._log_size += len(unpinned)
            if self._log_size > 4 * self.size + 4 * len(rows):
                self._compact_log()
        self.lookups += len(rows)
        self.hits += int(hit.sum())
        self.misses += len(miss_rows)
        self.evictions += int(taken.sum())
        self.writebacks += len(evict_rows)
        return Plan(slots, miss_rows, victims, evict_rows, evict_slots)

    def dirty_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows i64[K], slots i32[K]) of every dirty slot, to write back when the cache is flushed."""
        slots = np.flatnonzero(self.dirty).astype(np.int32)
        return self.row_of_slot[slots], slots

    def mark_clean(self) -> None:
        self.dirty[:] = False

    # ------------------------------------------------------------------------------------------------ victims
    def _victims(self, need: int) -> np.ndarray:
        """`need` distinct slots for this step's misses: free slots first, then the policy's victims."""
        take = min(need, self._free_top)
        out = [self._free[self._free_top - take: self._free_top][::-1]]
        self._free_top -= take
        need -= take
        if need:
            out.append(self._lfu_victims(need) if self.policy == "lfu" else self._lru_victims(need))
        return np.concatenate(out).astype(np.int32)

    def _lru_victims(self, need: int) -> np.ndarray:
        out = []
        while need:
            if not self._log:
                raise RuntimeError(self._too_small(need))
            entry = self._log[0]
            tick, slots, start = entry
            rest = slots[start:]
            fresh = np.flatnonzero(self.last_use[rest] == tick)
            if len(fresh) <= need:
                out.append(rest[fresh])
                need -= len(fresh)
                self._log.popleft()
                self._log_size -= len(slots)
            else:
                out.append(rest[fresh[:need]])
                entry[2] = start + int(fresh[need - 1]) + 1
                need = 0
        return np.concatenate(out)

    def _compact_log(self) -> None:
        """Drop the stale entries (slots used again since), keeping the order."""
        kept = collections.deque()
        size = 0
        for tick, slots, start in self._log:
            rest = slots[start:]
            rest = rest[self.last_use[rest] == tick]
            if len(rest):
                kept.append([tick, rest, 0])
                size += len(rest)
        self._log, self._log_size = kept, size

    def _lfu_victims(self, need: int) -> np.ndarray:
        out = []
        while need:
            if self._pool_pos >= len(self._pool):
                self._refresh_pool(need)
            pool = self._pool[self._pool_pos:]
            unchanged = ((self.uses[pool] == self._pool_uses[self._pool_pos:])
                         & (self.last_use[pool] == self._pool_last[self._pool_pos:]))
            fresh = np.flatnonzero(unchanged)
            if len(fresh) <= need:
                out.append(pool[fresh])
                need -= len(fresh)
                self._pool_pos = len(self._pool)
            else:
                out.append(pool[fresh[:need]])
                self._pool_pos += int(fresh[need - 1]) + 1
                need = 0
        return np.concatenate(out)

    def _refresh_pool(self, need: int) -> None:
        """The least-used occupied slots not used this step (ties: least recent), best first."""
        candidates = np.flatnonzero((self.row_of_slot >= 0) & ~self.pinned & (self.last_use < self.tick))
        if len(candidates) < need:
            raise RuntimeError(self._too_small(need))
        # One sort key: uses in the high bits, last use in the low 32 (ticks stay far below 2^32).
        key = (self.uses[candidates] << 32) | self.last_use[candidates]
        k = min(len(candidates), max(4 * need, self.size // 16))
        best = np.argpartition(key, k - 1)[:k] if k < len(candidates) else np.arange(len(candidates))
        best = best[np.argsort(key[best], kind="stable")]
        self._pool = candidates[best].astype(np.int32)
        self._pool_uses, self._pool_last = self.uses[self._pool].copy(), self.last_use[self._pool].copy()
        self._pool_pos = 0

    def _too_small(self, need: int) -> str:
        return (f"the row cache of {self.size:,} slots ({int(self.pinned.sum()):,} pinned) cannot take {need:,} more "
                "misses this step: it must hold every distinct row of a step beside the pinned ones")
