"""Errors a user can act on. Launchers print their message alone (no traceback) and exit with status 2.

`ConfigError` names the config key at fault (`train.steps: must be >= 1, got 0`); `DataError` names the file,
line or split of the input data at fault. Both are ValueErrors, so library callers may catch them as such.
`StorageError` names a disk tier's table file that cannot hold or give back its rows (disk full, missing, truncated).
"""


class UserError(Exception):
    """A mistake in what the user asked for or supplied, with a message that says what to do."""


class ConfigError(UserError, ValueError):
    """A config field has a bad value, type or combination; `key` is its dotted name, e.g. "train.steps"."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


class DataError(UserError, ValueError):
    """The input data cannot be used as configured (a bad line in strict mode, an empty split, an empty file)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint cannot be used: missing, corrupt, or from a run with another config; names the step and path."""


class StorageError(UserError, OSError):
    """A disk tier's table file cannot be used: the disk is full, or the file is missing or truncated; names the file
    and what to do, never a wrong row."""


class Interrupted(KeyboardInterrupt):
    """The user stopped a run (Ctrl-C); the message says at which step and what a rerun resumes from. A
    KeyboardInterrupt, so callers that stop on one still do; the launchers print the message and exit with 130.
    `resumable`: the run's checkpoints hold a step a rerun resumes from."""

    def __init__(self, message: str, step: int = 0, resumable: bool = False):
        super().__init__(message)
        self.step = step
        self.resumable = resumable


def free_bytes(path) -> int:
    """Free bytes on the disk holding `path` (a pathlib.Path; its nearest existing parent), for the messages of a full
    disk; 0 if that cannot be read."""
    import shutil

    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return 0


def _chain(error: BaseException | None):
    """`error` and the errors it was raised from, innermost last."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from, is a write refused for want of space: ENOSPC / EDQUOT, also as
    tensorstore words it (`RESOURCE_EXHAUSTED: ... No space left on device`)."""
    import errno

    return any((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
               or "No space left on device" in str(e) or "Disk quota exceeded" in str(e) for e in _chain(error))


def reported(error: BaseException | None) -> bool:
    """Whether the entry points report `error` themselves, as one line: a UserError (or an error raised from one), a
    full disk (the checkpointer turns a save that ran out of space into one), Ctrl-C. A library's log of it from its
    own threads only repeats it, with a traceback."""
    return any(isinstance(e, UserError | KeyboardInterrupt) for e in _chain(error)) or disk_full(error)
