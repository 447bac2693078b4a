"""The host-side directory of one stacked group's row cache: which row sits in which slot, and which rows leave.

`RowCache.plan(rows, dirty)` is called once per step, in the order the steps run, with the distinct cached rows the
step needs. It keeps those rows' slots, gives each miss a slot -- a free one, else a victim chosen by the policy among
the slots this step does not use -- and returns what must move: the misses to read into their slots, and the dirty
victims whose values must be written back before their slots are refilled. Everything is vectorised numpy over the
step's rows; nothing is O(cache) per step.

Policies (victims are never slots of the current step's rows, and never pinned slots):
    lru     exact least-recently-used. A log of each step's slots, oldest first: an entry is stale once its slot is
            used again (its last-use step moved on), and the first fresh entries are the victims. Amortised O(rows a
            step uses); the log is compacted when it outgrows a few times the cache.
    lfu     exact least-frequently-used: fewest uses since the row entered the cache, ties by least recent use. The
            same log, one per use count (a slot is appended to the log of its new count when used; fresh = that count
            and that step still), scanned from the lowest count up -- the O(1) LFU scheme of Shah, Mitra & Matani
            (2010) with a step's rows moved together.
    static  a hot set pinned for the whole run (the rows a profiling pass over the first batches read most, loaded
            at the start; RecNMP's hot-entry profiling, Ke et al. 2020), the other slots LRU for the rest.
"""

import collections
import dataclasses
from collections.abc import Callable

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
        # {use count (lfu; 0 for lru): deque of [tick, slots i32[n], next position]}, each deque oldest first.
        self._logs: dict[int, collections.deque] = {}
        self._log_size = 0
        self.lookups = self.hits = self.misses = self.evictions = self.writebacks = 0

    @property
    def pinned_rows(self) -> np.ndarray:
        return self.row_of_slot[self.pinned]

    @property
    def free(self) -> int:
        """Slots holding no row yet (once none, every miss evicts a row)."""
        return self._free_top

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
        self._append(slots[~self.pinned[slots]])
        if self._log_size > 4 * self.size + 4 * len(rows):
            self._compact_logs()
        self.lookups += len(rows)
        self.hits += int(hit.sum())
        self.misses += len(miss_rows)
        self.evictions += int(taken.sum())
        self.writebacks += len(evict_rows)
        return Plan(slots, miss_rows, victims, evict_rows, evict_slots)

    def slots_of(self, rows: np.ndarray) -> np.ndarray:
        """i32[N]: the slot holding each of `rows`, -1 where none does (nothing moves: for reads beside the step's)."""
        return self.slot_of_row[rows]

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
        for count in sorted(self._logs):
            if not need:
                break
            log = self._logs[count]
            while need and log:
                entry = log[0]
                tick, slots, start = entry
                rest = slots[start:]
                fresh = np.flatnonzero(self._fresh(rest, tick, count))
                if len(fresh) <= need:
                    out.append(rest[fresh])
                    need -= len(fresh)
                    log.popleft()
                    self._log_size -= len(slots)
                else:
                    out.append(rest[fresh[:need]])
                    entry[2] = start + int(fresh[need - 1]) + 1
                    need = 0
            if not log:
                del self._logs[count]
        if need:
            raise RuntimeError(self._too_small(need))
        return np.concatenate(out).astype(np.int32)

    def _fresh(self, slots: np.ndarray, tick: int, count: int) -> np.ndarray:
        """Which log entries still say where their slot stands: last used at `tick` (lfu: with `count` uses)."""
        fresh = self.last_use[slots] == tick
        return fresh & (self.uses[slots] == count) if self.policy == "lfu" else fresh

    def _append(self, slots: np.ndarray) -> None:
        """Log the slots this step used (in the order asked), by their new use count for lfu."""
        if self.policy != "lfu":
            self._logs.setdefault(0, collections.deque()).append([self.tick, slots, 0])
        else:
            counts = self.uses[slots]
            for count in np.unique(counts):
                self._logs.setdefault(int(count), collections.deque()).append([self.tick, slots[counts == count], 0])
        self._log_size += len(slots)

    def _compact_logs(self) -> None:
        """Drop the stale entries (slots used again since), keeping the order."""
        size = 0
        for count in list(self._logs):
            kept = collections.deque()
            for tick, slots, start in self._logs[count]:
                rest = slots[start:]
                rest = rest[self._fresh(rest, tick, count)]
                if len(rest):
                    kept.append([tick, rest, 0])
                    size += len(rest)
            if kept:
                self._logs[count] = kept
            else:
                del self._logs[count]
        self._log_size = size

    def _too_small(self, need: int) -> str:
        return (f"the row cache of {self.size:,} slots ({int(self.pinned.sum()):,} pinned) cannot take {need:,} more "
                "misses this step: it must hold every distinct row of a step beside the pinned ones")


def _summed(counter: str) -> property:
    """A `PartitionedRowCache` counter: its parts' `counter`, summed."""
    return property(lambda self: sum(getattr(cache, counter) for cache in self.parts))


class PartitionedRowCache:
    """The caches of a group's rows on a mesh: one `RowCache` of `slots` slots per device block (`parts` of them), each
    row cached only by the block that owns it (`owner`: stacked rows i64[N] -> i32[N] part). Slots are global, part
    k's slot j is k * slots + j (its row in the mesh's cache array), so `plan` answers as one `RowCache` would; each
    part chooses its victims by `policy` among its own slots."""

    def __init__(self, rows: int, slots: int, parts: int, owner: Callable[[np.ndarray], np.ndarray],
                 policy: str = "lru"):
        self.rows, self.slots, self.owner = rows, slots, owner
        self.size = slots * parts
        self.parts = [RowCache(rows, slots, policy) for _ in range(parts)]
        self.policy = policy
        self.pinned_rows = np.zeros(0, np.int64)

    @property
    def free(self) -> int:
        """Slots holding no row yet, over the parts."""
        return sum(cache.free for cache in self.parts)

    def plan(self, rows: np.ndarray, dirty: bool) -> Plan:
        rows = np.asarray(rows, np.int64)
        owner = self.owner(rows)
        slots = np.empty(len(rows), np.int32)
        moves: list[list[np.ndarray]] = [[], [], [], []]
        for k, cache in enumerate(self.parts):
            at = np.flatnonzero(owner == k)
            if not len(at):
                continue
            plan, base = cache.plan(rows[at], dirty), k * self.slots
            slots[at] = base + plan.slots
            for out, value in zip(moves, (plan.miss_rows, base + plan.miss_slots, plan.evict_rows,
                                          base + plan.evict_slots), strict=True):
                out.append(value)
        rows_of = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
        slots_of = lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)  # noqa
        return Plan(slots, rows_of(moves[0]), slots_of(moves[1]), rows_of(moves[2]), slots_of(moves[3]))

    def slots_of(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        owner = self.owner(rows)
        out = np.full(len(rows), -1, np.int32)
        for k, cache in enumerate(self.parts):
            at = np.flatnonzero(owner == k)
            slot = cache.slot_of_row[rows[at]]
            out[at] = np.where(slot >= 0, k * self.slots + slot, -1)
        return out

    def dirty_slots(self) -> tuple[np.ndarray, np.ndarray]:
        found = [(rows, k * self.slots + slots) for k, cache in enumerate(self.parts)
                 for rows, slots in [cache.dirty_slots()]]
        return (np.concatenate([r for r, _ in found]).astype(np.int64),
                np.concatenate([s for _, s in found]).astype(np.int32))

    def mark_clean(self) -> None:
        for cache in self.parts:
            cache.mark_clean()

    # The counters, summed over the parts.
    lookups = _summed("lookups")
    hits = _summed("hits")
    misses = _summed("misses")
    evictions = _summed("evictions")
    writebacks = _summed("writebacks")
