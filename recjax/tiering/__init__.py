"""Tables larger than memory: physical tables on local disk (or host RAM) behind a device-side cache of hot rows.

    store.py    a cached table's rows + optimizer-state rows: a file per table (pread / pwrite) or a host array
    cache.py    the host-side directory of a group's cache slots and its policies (lru, lfu, static hot set)
    folders.py  the run's table folder: owned (locked) while used, a temporary one removed at the end, by the next
                run in the workdir, or by `python -m experiments.clean_tables`
    slots.py    where the cache's slots sit in the layout's arrays (one device: after the group's memory tables'
                rows; a mesh: one more array split like the cached tables), and the caches' sizes
    storage.py  DiskStorage: the storage (recjax/placement) of groups holding such tables -- the prefetch / swap /
                write-back pipeline, its checkpoints

`recjax.placement.build` gives the groups holding a disk-tier table to `DiskStorage`.
"""

from recjax.tiering.cache import POLICIES, PartitionedRowCache, RowCache
from recjax.tiering.folders import WORKDIR_FOLDER, TableFolder, remove_stale
from recjax.tiering.slots import GroupLayout, plan_block_layouts, plan_group_layouts
from recjax.tiering.storage import CheckpointRows, DiskBatch, DiskStorage, profile_hot_rows
from recjax.tiering.store import RowStore

__all__ = ["POLICIES", "WORKDIR_FOLDER", "CheckpointRows", "DiskBatch", "DiskStorage", "GroupLayout",
           "PartitionedRowCache", "RowCache", "RowStore", "TableFolder", "plan_block_layouts", "plan_group_layouts",
           "profile_hot_rows", "remove_stale"]
