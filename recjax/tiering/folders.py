"""Where a run's disk-tier table files go, and who owns them.

A run's table folder holds a `.owner` file, locked (flock) by the run for as long as it uses the folder and naming it
(pid, host, start, command). The kernel releases the lock when the process ends, however it ends -- a kill -9
included --, so a folder whose lock is free belongs to no live run. Two runs never share one (the second is refused
with the first's pid), and a temporary folder left by a killed run is removed by:
  * the next run or resume in the same workdir: `tiering.dir` "" puts the files in <workdir>/tables.tmp, and
    `remove_stale` runs before anything else (`recjax.train.train_and_evaluate`);
  * `python -m experiments.clean_tables [WORKDIR ...]`: the named workdirs' folders, or with none every
    recjax-tiering-* folder in the system's temporary directory (where the files of a library caller without a
    workdir go, `TableFolder.temporary_in`), each only if no live run holds it (a folder without an owner file, made
    before recjax recorded owners, counts as left).
A folder named by `tiering.dir` is kept after the run (its files hold the final tables); only its lock is taken.
"""

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import socket
import sys
import tempfile
import time

OWNER = ".owner"
WORKDIR_FOLDER = "tables.tmp"  # a run's temporary table folder, in its workdir
TEMP_PREFIX = "recjax-tiering-"  # a temporary table folder without a workdir, in the system's temporary directory


def folder_bytes(path: pathlib.Path) -> int:
    """Bytes the files under `path` take on the disk."""
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file():
                total += p.stat().st_blocks * 512
    return total


def owner(path: pathlib.Path) -> dict | None:
    """Who holds the folder `path` now ({"pid", "host", "started", "command"}), or None if no live run does."""
    try:
        fd = os.open(path / OWNER, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
            except ValueError:
                return {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def describe_owner(who: dict) -> str:
    return (f"pid {who.get('pid', '?')} on {who.get('host', '?')}, started {who.get('started', '?')}"
            + (f": {who['command']}" if who.get("command") else ""))


class FolderInUse(Exception):
    """A live run holds the table folder (`who`: its `owner`)."""

    def __init__(self, path: pathlib.Path, who: dict):
        super().__init__(f"{path} is in use by another run ({describe_owner(who)})")
        self.path, self.who = path, who


class TableFolder:
    """A run's table folder, held (its `.owner` locked) from `take` to `release`."""

    def __init__(self, path: pathlib.Path, temporary: bool):
        self.path, self.temporary = path, temporary
        self._fd = -1

    @classmethod
    def temporary_in(cls, workdir: pathlib.Path | None) -> "TableFolder":
        """A fresh temporary folder: <workdir>/tables.tmp (what a killed run left there removed first), or without a
        workdir a new recjax-tiering-* folder in the system's temporary directory."""
        if workdir is None:
            return cls(pathlib.Path(tempfile.mkdtemp(prefix=TEMP_PREFIX)), temporary=True)
        path = pathlib.Path(workdir) / WORKDIR_FOLDER
        remove_stale(path)
        return cls(path, temporary=True)

    def take(self) -> "TableFolder":
        """Create the folder and lock its owner file; FolderInUse if a live run holds it."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / OWNER, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
            os.close(fd)
            raise FolderInUse(self.path, who) from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the folder if it is temporary, and unlock it."""
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd >= 0:
            os.close(self._fd)  # unlocks
            self._fd = -1


def remove_stale(path: pathlib.Path) -> int:
    """Remove the temporary table folder `path` if no live run holds it; the bytes it took (0: none there). A folder
    a live run holds is left alone (that run, using the same workdir, is refused when it asks for it)."""
    if not path.is_dir() or owner(path) is not None:
        return 0
    size = folder_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return size


def stale_folders(workdirs: list[pathlib.Path]) -> list[pathlib.Path]:
    """The temporary table folders of `workdirs` that exist, held or not; with none, those in the system's temporary
    directory: every recjax-tiering-* folder, and the tables.tmp of the launcher's own temporary workdirs (recjax_*,
    a run without --workdir)."""
    if workdirs:
        return [pathlib.Path(w) / WORKDIR_FOLDER for w in workdirs if (pathlib.Path(w) / WORKDIR_FOLDER).is_dir()]
    temp = pathlib.Path(tempfile.gettempdir())
    return sorted(p for p in [*temp.glob(f"{TEMP_PREFIX}*"), *temp.glob(f"recjax_*/{WORKDIR_FOLDER}")] if p.is_dir())
