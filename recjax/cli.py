"""What every entry point shares (the launcher, the sweeps, the benchmarks): a user's mistake is one line on
stderr and exit status 2, never a traceback.

    error: train.steps: must be >= 1, got 0

Mistakes are `recjax.errors.UserError`s (a bad config value, a data dir without its files, a bad line in strict
mode) and the command-line errors absl and ml_collections raise while parsing flags (a misspelt config field, a
value of the wrong type, a missing config file). Bugs still show their traceback. `--debug` (or RECJAX_DEBUG=1)
shows the traceback of user errors too.
"""

import contextlib
import ctypes
import glob
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

from recjax.errors import UserError

DEBUG_ENV = "RECJAX_DEBUG"
MALLOC_ENV = "RECJAX_MALLOC"  # "default" leaves glibc's malloc settings alone
EXIT_USAGE = 2


ACCELERATOR_DEVICES = ("/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/dxg", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*",
                       "/dev/kfd")  # NVIDIA, WSL GPU, TPU (accel / vfio), AMD


def accelerator_present() -> bool:
    """Whether a GPU/TPU runtime or device could be here, without initialising JAX's backends (a few ms): a
    TPU or PJRT plugin installed, or an accelerator device node."""
    plugins = (importlib.util.find_spec("libtpu") is not None or importlib.util.find_spec("jax_plugins") is not None
               or any(True for _ in importlib.metadata.entry_points(group="jax_plugins")))
    return plugins or any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


def use_cpu_if_no_accelerator() -> None:
    """On a CPU-only machine pin JAX to the CPU before its first use, so it does not probe for a TPU and log
    "Unable to initialize backend 'tpu' ... libtpu.so" on every run. JAX_PLATFORMS set by the user wins."""
    if "JAX_PLATFORMS" in os.environ or accelerator_present():
        return
    import jax

    jax.config.update("jax_platforms", "cpu")


# glibc mallopt parameters (malloc.h) and the values `tune_malloc` sets.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20


def tune_malloc() -> bool:
    """Serve allocations up to 64 MiB from glibc's heap and keep up to 256 MiB of freed heap, so XLA:CPU's per-step
    temporaries (a few MiB each at batch 2048) are reused instead of mmap'ed, page-faulted and unmapped every step.

    glibc's default mmap threshold starts at 128 KiB and its trim threshold returns freed heap tops to the kernel;
    on the Kaggle one-hot step at batch 2048 the step spent its time re-faulting fresh pages. Tuned, that step takes
    about the time torch's does and the other shapes are unchanged; disabling mmap altogether was measured too and
    costs peak memory (figures and commands: benchmarks/RESULTS.md#glibc-malloc-at-the-entry-points).

    Applied by the entry points (the launcher, sweeps, benchmarks) at start; returns whether it applied: not on a
    non-glibc system, not when the user tuned malloc already (GLIBC_TUNABLES glibc.malloc.*, MALLOC_*_
    variables), not with RECJAX_MALLOC=default."""
    if os.environ.get(MALLOC_ENV, "") == "default" or not sys.platform.startswith("linux"):
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(
            k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) & bool(mallopt(M_TRIM_THRESHOLD,
                                                                                TRIM_THRESHOLD_BYTES))


def debugging(argv: Sequence[str] | None = None) -> bool:
    argv = sys.argv if argv is None else argv
    return os.environ.get(DEBUG_ENV, "") not in ("", "0") or any(a in ("--debug", "--debug=true", "--debug=True")
                                                                    for a in argv)


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


_UNKNOWN_FIELD = re.compile(r"^'([^']+)'(?:\s+(Did you mean .*))?$", re.S)  # ml_collections' KeyError text


def _innermost(error: BaseException) -> str:
    """The message at the bottom of exceptions wrapping exceptions (absl wraps ml_collections' KeyError)."""
    message: object = error
    while isinstance(message, BaseException) and message.args:
        message = message.args[0]
    return str(message)


def flag_error_message(error: BaseException, argv: Sequence[str]) -> str:
    """One readable line for an exception raised while parsing command-line flags."""
    text = _innermost(error)
    unknown = _UNKNOWN_FIELD.match(text.strip())
    if unknown:
        field, hint = unknown.group(1), unknown.group(2)
        offending = next((a.split("=")[0] for a in argv if a.startswith("--config.")
                          and re.search(rf"[.]{re.escape(field)}(=|$|[.])", a.split("=")[0] + "=")), None)
        where = f"{offending}: " if offending else ""
        return f"{where}the config has no field '{field}'" + (f"; {hint[0].lower()}{hint[1:]}" if hint else "")
    if "Error whilst parsing config file" in text:
        flag = text.split(": Error whilst", 1)[0].removeprefix("flag ")
        last = [line for line in text.strip().splitlines() if line.strip()][-1]
        return f"{flag}: the config file failed: {last.strip()}"
    return text.removeprefix("flag ").strip()


def check_config_path(argv: Sequence[str]) -> None:
    """`--config=PATH[:ARG]` must name an existing file (ml_collections would fail much later, opaquely)."""
    for arg in argv:
        if arg.startswith("--config="):
            path = pathlib.Path(arg.split("=", 1)[1].split(":", 1)[0])
            if not path.is_file():
                fail(f"--config: config file {path} not found (run from the repository root, e.g. "
                     "--config=experiments/configs/dlrm_movielens.py)")


def define_config_flag(default: str | pathlib.Path, help_text: str = "Path to a config file (with :preset).",
                       name: str = "config"):
    """`config_flags.DEFINE_config_file`, with overrides of the default config that fail at definition time (when
    no --config is given, ml_collections applies them then) reported as one line."""
    from ml_collections import config_flags

    check_config_path(sys.argv)
    try:
        return config_flags.DEFINE_config_file(name, str(default), help_text, lock_config=True)
    except Exception as error:
        if debugging():
            raise
        fail(flag_error_message(error, sys.argv))


def run(main: Callable[[list[str]], None]) -> None:
    """`absl.app.run(main)` with flag errors and UserErrors printed as one line (exit status 2)."""
    from absl import app, flags

    if "debug" not in flags.FLAGS:
        flags.DEFINE_bool("debug", False, f"Show the traceback of user errors too (or set {DEBUG_ENV}=1).")

    def parse(argv: list[str]) -> list[str]:
        check_config_path(argv)
        try:
            return flags.FLAGS(argv)
        except Exception as error:
            if debugging(argv):
                raise
            fail(flag_error_message(error, argv))

    def guarded(argv: list[str]) -> None:
        tune_malloc()
        use_cpu_if_no_accelerator()
        quiet_libraries()
        with user_errors():
            main(argv)

    app.run(guarded, flags_parser=parse)


def quiet_libraries() -> None:
    """Warnings and errors only from the libraries' absl logging unless `--verbosity` is given: absl.app shows INFO,
    and Orbax logs ~25 INFO lines per checkpoint save (jax.distributed a few per start), which drowned the run's own
    console lines."""
    from absl import flags
    from absl import logging as absl_logging

    if "verbosity" in flags.FLAGS and not flags.FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn a UserError into `error: <message>` and exit status 2 (argparse scripts wrap their main in this)."""
    try:
        yield
    except UserError as error:
        if debugging():
            raise
        fail(str(error))
    except Exception as error:
        # A config file that failed to load raises only when the config is first read (ml_collections'
        # _ErrorConfig), i.e. inside main.
        if "Error whilst parsing config file" in _innermost(error) and not debugging():
            fail(flag_error_message(error, sys.argv))
        raise
