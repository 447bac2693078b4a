"""Checkpoints of a whole run with Orbax: exact resume, and Check-N-Run incremental row deltas with quantization.

A checkpoint is one Orbax `CheckpointManager` step directory, `<checkpoint dir>/<step>/`, finalised atomically by
Orbax (written as `<step>.orbax-checkpoint-tmp*` and renamed when complete, so a save cut short is never loaded).
Its items, written by Orbax's handlers (arrays through tensorstore, JSON through json; nothing is pickled):

    state/  PyTreeSave {"step": i32[], "rng": u32[k] (the dropout key's data), "dense": {"00000": leaf, ...}
            (the leaves of (dense_params, dense_opt_state) in tree order), and in a *baseline* (kind "full") also
            "tables": {group: f32[rows, dim]} and "sparse_opt": {group: {name: f32[rows, ...]}}; with dynamic tables
            (FIITED) "aux": {feature: {name: array}} in every checkpoint, and a baseline after each compaction}
    rows/   PyTreeSave, only in a *delta*: {group: {"ids": i32[n] (stacked row ids, ascending), "rows": f32[n, dim]
            or, quantized, "codes": u8[n, dim * bits / 8], "offset": f32[n], "scale": f32[n], "opt": {name:
            f32[n, ...] or, quantized (`quantize_optimizer_bits`), {"codes": u8[n, dim], "absmax": f32[n]}}}} -- the
            rows touched since the previous checkpoint (consecutive) or since the baseline (one-shot), with their
            sparse-optimizer rows. Groups without touched rows are left out.
    meta/   JSON (Orbax's JSON handler, subclassed to await the checksums in its background commit): the
            format version, step, kind ("full" / "delta"), policy, `chain` (the steps whose tables this restore point
            reads, baseline first), quantize bits (rows; optimizer rows and `optimizer_codes`, {field: "signed" |
            "unsigned"}), byte counts, the sha256 of every array written, what the table arrays hold
            (`table_record`: compared with this run's before a restore reads any), the dense leaves' tree paths, the
            trainer's loop state (selection, early stopping, metrics history, train time), the resolved config and
            whether the run finished; and "sha256", the digest of all that (its canonical JSON): the metadata is
            covered by its own digest, every array by the sha256 it records.

Restore = the latest complete step: the baseline's tables, then each delta of its chain in order (rows replaced by
id), then that step's dense state, step and RNG. Every meta read (the chain's too) is checked against its own
sha256 and every array read against the sha256 in its meta; a missing or corrupt link of the chain is a
`CheckpointError` naming the step and path. Data needs no saved position: step i's batch is a pure function of
(seed, i) for synthetic and prepared data, so the trainer restarts the stream at the restored step.

Policies (recjax/checkpoint/policy.py, Eisenman et al. 2022, "Check-N-Run"): which rows a delta writes and when a
save is a new baseline; deltas may quantize their table rows (`quantize_bits`: Check-N-Run's row-wise asymmetric
codes) and their optimizer rows (`quantize_optimizer_bits`: block-wise 8-bit dynamic codes, Dettmers et al. 2022).

Mesh runs (one process, several devices): the state's tables are the plan's storages ("<group>/<kind>", written
"<group>~<kind>" in the items), global arrays whose blocks live on their devices; the dirty-row bitmaps are split like
their rows and set by each row's owner inside the sharded step. A save reads each device's block where it lives (host
copies and delta gathers per shard, never a gather of the whole table on one device). `meta["layout"]` records the
plan's layout (None on one device): a restore under another layout -- another mesh shape or plan, or one device --
converts the tables and optimizer rows through the single-device layout (`restore_state`'s `relayout`, given by
the trainer from recjax/sharding) and the next save starts a new baseline.

Disk-tier runs (recjax/tiering): a save writes what `backend.checkpoint_state` gives -- the cache's dirty rows written
back to the table files first, then the tables in the single-device layout read from the files (`CheckpointRows`) and
the dirty rows by table row -- so the checkpoint is the in-memory run's. A baseline never holds a disk table whole
(`streamed`): each of its arrays is written block by block from the files as a zarr array chunked by row blocks,
hashed by the same blocks (the sha256 of the whole array), and the save is complete before the next step (the files
change then). A restore reads those arrays back a chunk at a time (`StoredRows`, the deltas' rows over them) and the
backend writes them to fresh table files (`restores_single_device`, `restores_by_rows`, `place_state`). The arrays
are numpy arrays to any reader: an in-memory run restores a disk-tier checkpoint, and the reverse.

Multi-process runs: a baseline's tables are global arrays (device copies) that Orbax writes by blocks, each process
its own; a delta's ids / rows / optimizer rows are global arrays too, every row block's marked rows padded to the
largest count of any block (ids -1). meta marks them "blocks" and the `digests` item holds each block's sha256
(u8[R, 32 C], placed like the array), checked by whoever reads the block. Saves are synchronous there: Orbax
synchronises the processes with device collectives, which must come in the same order as the steps' (from its
background thread they crossed them and both processes waited forever).

The package, one concern per module (imports point down the list):

    config        the `checkpoint` config section, and which keys a resumed run may change
    streamed      arrays written and read by row blocks, never whole (a disk tier's tables): the Orbax handler
    blocks        arrays spread over processes: per-block digests, delta blocks
    integrity     the sha256 of every array and of meta itself
    records       what the arrays hold: the embedding tables' record, the dense leaves
    store         one checkpoint directory behind Orbax: format, items, checked reads, restore points
    policy        Check-N-Run's policies: dirty rows, the chain, what the next save writes
    restore       a restore point's state: chain, dequantization, relayout
    checkpointer  the trainer's Checkpointer: when to save, async saves, retention, resuming
"""

from recjax.checkpoint.checkpointer import Checkpointer
from recjax.checkpoint.config import (
    KEYS,
    POLICIES,
    QUANTIZE_BITS,
    QUANTIZE_OPTIMIZER_BITS,
    RESUMABLE_CHANGES,
    check_checkpoint_config,
    config_differences,
)
from recjax.checkpoint.records import table_differences, table_record
from recjax.checkpoint.restore import read_arrays, restore_state
from recjax.checkpoint.store import FORMAT_VERSION, ResumePoint, open_checkpoint

__all__ = ["FORMAT_VERSION", "KEYS", "POLICIES", "QUANTIZE_BITS", "QUANTIZE_OPTIMIZER_BITS", "RESUMABLE_CHANGES",
           "Checkpointer", "ResumePoint", "check_checkpoint_config", "config_differences", "open_checkpoint",
           "read_arrays", "restore_state", "table_differences", "table_record"]
