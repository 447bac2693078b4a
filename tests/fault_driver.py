r"""The launcher (experiments/train.py) with one fault injected at a set moment of a disk-tier run: what a user sees
when a table file is truncated or removed, or the disk fills up, while the run trains or saves a checkpoint. Used by
tests/test_tiering_faults.py.

    RECJAX_FAULT=save_truncate python tests/fault_driver.py --workdir=/tmp/f --config.tiering.tables=C3=disk ...

Every fault fires once, after the checkpoint of step `RECJAX_FAULT_AFTER` (default 3) is complete, at the first
moment of its kind:
    read_truncate, read_delete          the table file, as the train loop reads a step's missing rows
    writeback_truncate                  the table file, as the write-back thread writes evicted rows
    save_truncate, save_delete          the table file, as a checkpoint save reads its first block of the tables
                                        (inside Orbax's save threads)
    writeback_enospc                    the disk full (ENOSPC) for the write-back thread's pwrite
    save_enospc                         the disk full (ENOSPC) as a checkpoint save writes its first block of the
                                        tables (inside Orbax's save threads)
    fill_disk                           a file written at RECJAX_FAULT_FILL (on the disk of the checkpoints, a small
                                        file system) that leaves 4 KiB free: the next save finds the disk full
With no fault it is the launcher itself.
"""

import errno
import os
import pathlib
import shutil
import sys
import threading

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FAULTS = ("read_truncate", "read_delete", "writeback_truncate", "save_truncate", "save_delete", "writeback_enospc",
          "save_enospc", "fill_disk")


class Fault:
    """One fault, armed once the checkpoint of step `after` is complete, fired once."""

    def __init__(self, name: str, after: int):
        self.name, self.after = name, after
        self.armed = self.fired = False
        self.saving = 0  # the step of the save in progress

    def fire(self, kind: str, files) -> bool:
        """Whether the fault of `kind` fires now; if so, break the table files `files` as it says."""
        if self.fired or not self.armed or not self.name.startswith(kind):
            return False
        if kind == "save" and self.saving <= self.after:
            return False
        self.fired = True
        for f in files:
            if self.name.endswith("truncate"):
                os.truncate(f.path, f.size // 3)
            elif self.name.endswith("delete"):
                os.unlink(f.path)
        return True


def install(fault: Fault) -> None:
    from recjax import checkpoint
    from recjax.tiering import storage, store

    save = checkpoint.Checkpointer.save

    def saving(self, step, state, loop, finished=False):
        fault.saving = step
        out = save(self, step, state, loop, finished)
        if step >= fault.after:
            self.wait()
            fault.armed = True
            if fault.name == "fill_disk" and not fault.fired:
                fault.fired = True
                filler = pathlib.Path(os.environ["RECJAX_FAULT_FILL"])
                left = shutil.disk_usage(filler.parent).free - (4 << 10)
                with filler.open("wb") as f:
                    while left > 0:
                        left -= f.write(bytes(min(left, 1 << 20)))
        return out

    checkpoint.Checkpointer.save = saving

    read_misses = storage.DiskStorage._read_misses

    def reading(self, group, rows):
        fault.fire("read", self.stores[group].files)
        return read_misses(self, group, rows)

    storage.DiskStorage._read_misses = reading

    write = store.RowStore.write

    def writing(self, rows, records):
        # (fire first: it breaks the files for the faults that do)
        if (threading.current_thread().name == "recjax-writeback" and fault.fire("writeback", self.files)
                and fault.name.endswith("enospc")):
            real = os.pwrite

            def full(*args):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            os.pwrite = full
            try:
                return write(self, rows, records)
            finally:
                os.pwrite = real
        return write(self, rows, records)

    store.RowStore.write = writing

    block = storage.CheckpointRows.block

    def reading_block(self, start, stop):
        if (fault.fire("save", [f for s in self.storage.stores.values() for f in s.files])
                and fault.name.endswith("enospc")):  # as tensorstore words a write the disk refused
            raise ValueError("RESOURCE_EXHAUSTED: Error writing the checkpoint's table block: Failed to write "
                             f"{(stop - start) * 4:,} bytes: No space left on device [os_error_code=28]")
        return block(self, start, stop)

    storage.CheckpointRows.block = reading_block


def main() -> None:
    name = os.environ.get("RECJAX_FAULT", "")
    if name:
        if name not in FAULTS:
            raise SystemExit(f"unknown RECJAX_FAULT {name!r}; one of {FAULTS}")
        install(Fault(name, int(os.environ.get("RECJAX_FAULT_AFTER", "3"))))
    from experiments import train as launcher
    from recjax import cli

    cli.run(launcher.main)


if __name__ == "__main__":
    main()
