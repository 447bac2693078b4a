"""What every entry point shares (the launcher, the sweeps, the benchmarks): a user's mistake is one line on
stderr and exit status 2, never a traceback.

    error: train.steps: must be >= 1, got 0

Mistakes are `recjax.errors.UserError`s (a bad config value, a data dir without its files, a bad line in strict
mode) and the command-line errors absl and ml_collections raise while parsing flags (a misspelt config field, a
value of the wrong type, a missing config file). Bugs still show their traceback. `--debug` (or RECJAX_DEBUG=1)
shows the traceback of user errors too.
"""

import ast
import contextlib
import ctypes
import glob
import importlib.metadata
import importlib.util
import logging
import os
import pathlib
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

from absl import flags as absl_flags

from recjax.errors import Interrupted, UserError, reported
from recjax.validation import find

DEBUG_ENV = "RECJAX_DEBUG"
MALLOC_ENV = "RECJAX_MALLOC"  # "default" leaves glibc's malloc settings alone
EXIT_USAGE = 2
EXIT_DIVERGED = 3  # the run stopped because its loss diverged (summary.json "diverged")
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, what a shell reports for a process SIGINT killed


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


def parse_list(text: str) -> tuple:
    """A tuple config field's command-line value: comma-separated items, each a Python literal (a number, True,
    None, a quoted string) or else the item's text, so `64,1` is (64, 1) and `user,item` is ("user", "item"); a whole
    Python tuple or list is taken as written (`"('a', 'b,c')"` keeps a comma inside an item); "" is ()."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return tuple(_list_item(item) for item in text.split(",")) if text.strip() else ()
    if isinstance(value, tuple | list):
        return tuple(value)
    return (value,)


def _list_item(text: str):
    text = text.strip()
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, int | float | bool | str) or value is None else text


class ListFlagParser(absl_flags.ArgumentParser):
    """absl parser of tuple config fields (`parse_list`). Registered for ml_collections' tuple fields by
    `define_config_flag`: a field with this parser is a plain flag (one value, not ml_collections' multi-flag that
    joins repeats), and `check_repeated_list_flags` makes giving it twice an error."""

    syntactic_help = "a comma-separated list, e.g. 64,1 or user,item"

    def parse(self, argument) -> tuple:
        if isinstance(argument, tuple | list):  # the config's default
            return tuple(argument)
        return () if argument is None else parse_list(str(argument))

    def flag_type(self) -> str:
        return "list"


def check_repeated_list_flags(argv: Sequence[str], flag_values) -> None:
    """A tuple field given twice is an error (which one was meant? ml_collections joined them, absl's other flags
    keep the last): `error: --config.model.dlrm.top_mlp is given twice (64,1 and 32,1); give the whole list once`."""
    values: dict[str, list[str]] = {}
    args = list(argv[1:])
    if "--" in args:
        args = args[:args.index("--")]
    for i, arg in enumerate(args):
        if not arg.startswith("--config."):
            continue
        name, eq, value = arg.partition("=")
        values.setdefault(name, []).append(value if eq else (args[i + 1] if i + 1 < len(args) else ""))
    for name, given in values.items():
        if len(given) > 1 and name[2:] in flag_values and isinstance(flag_values[name[2:]].parser, ListFlagParser):
            times = "twice" if len(given) == 2 else f"{len(given)} times"
            fail(f"{name} is given {times} ({' and '.join(given)}); give the whole list once, comma-separated: "
                 f"{name}={given[-1]}")


_UNKNOWN_FIELD = re.compile(r"^'([^']+)'(?:\s+(Did you mean .*))?$", re.S)  # ml_collections' KeyError text


def _innermost(error: BaseException) -> str:
    """The message at the bottom of exceptions wrapping exceptions (absl wraps ml_collections' KeyError)."""
    message: object = error
    while isinstance(message, BaseException) and message.args:
        message = message.args[0]
    return str(message)


def flag_error_message(error: BaseException, argv: Sequence[str], default_config: str | pathlib.Path | None = None
                       ) -> str:
    """One readable line for an exception raised while parsing command-line flags. `default_config`: the config
    file a run without --config uses (to name the config files that have a field it lacks)."""
    text = _innermost(error)
    unknown = _UNKNOWN_FIELD.match(text.strip())
    if unknown:
        field, hint = unknown.group(1), unknown.group(2)
        offending = next((a.split("=")[0] for a in argv if a.startswith("--config.")
                          and re.search(rf"[.]{re.escape(field)}(=|$|[.])", a.split("=")[0] + "=")), None)
        where = f"{offending}: " if offending else ""
        message = f"{where}the config has no field '{field}'" + (f"; {hint[0].lower()}{hint[1:]}" if hint else "")
        chosen = next((a.split("=", 1)[1].split(":", 1)[0] for a in argv if a.startswith("--config=")), None)
        if offending and (chosen or default_config):
            message += configs_with_field(offending.removeprefix("--config."), pathlib.Path(chosen or default_config),
                                          is_default=chosen is None)
        return message
    if "Error whilst parsing config file" in text:
        flag = text.split(": Error whilst", 1)[0].removeprefix("flag ")
        last = [line for line in text.strip().splitlines() if line.strip()][-1]
        return f"{flag}: the config file failed: {last.strip()}"
    return text.removeprefix("flag ").strip()


def _shown(path: pathlib.Path) -> str:
    """`path` relative to the working directory when it is under it, as a user would type it."""
    try:
        return str(path.resolve().relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)


def _load_config(path: pathlib.Path):
    """`get_config()` of a config file, or None if it fails to load (or needs an argument)."""
    try:
        spec = importlib.util.spec_from_file_location(f"_recjax_config_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config()
    except Exception:
        return None


def configs_with_field(key: str, config_file: pathlib.Path, is_default: bool) -> str:
    """For a field `key` (e.g. "data.dir") that `config_file` lacks: what that config is, and the config files beside
    it that have the field, as text to append to the error; "" if none has it."""
    others = [path for path in sorted(config_file.parent.glob("*.py"))
              if path.name not in ("__init__.py", "common.py") and path.resolve() != config_file.resolve()]
    others = [_shown(path) for path in others if find(_load_config(path), key) is not None]
    if not others:
        return ""
    which = f"the default config ({_shown(config_file)}, used without --config)" if is_default else _shown(config_file)
    section, data_name = key.split(".", 1)[0], find(_load_config(config_file), "data.name")
    what = f" (data.name={data_name!r}: generated, no files to read)" if section == "data" and data_name == (
        "synthetic") else ""
    return f"; {which} has no {key}{what}; the configs with {key}: {', '.join(others)} (e.g. --config={others[0]})"


def check_config_path(argv: Sequence[str]) -> None:
    """`--config=PATH[:ARG]` must name an existing file (ml_collections would fail much later, opaquely)."""
    for arg in argv:
        if arg.startswith("--config="):
            path = pathlib.Path(arg.split("=", 1)[1].split(":", 1)[0])
            if not path.is_file():
                fail(f"--config: config file {path} not found (run from the repository root, e.g. "
                     "--config=experiments/configs/dlrm_movielens.py)")


def define_config_flag(default: str | pathlib.Path, help_text: str = "Path to a config file (with :preset).",
                       name: str = "config", flag_values=None, argv: Sequence[str] | None = None):
    """`config_flags.DEFINE_config_file`, with overrides of the default config that fail at definition time (when
    no --config is given, ml_collections applies them then) reported as one line, and tuple fields read by
    `ListFlagParser`. `flag_values` (absl's FLAGS) and `argv` (sys.argv) are for tests."""
    from absl import flags
    from ml_collections import config_flags

    argv = sys.argv if argv is None else argv
    check_config_path(argv)
    # Tuple fields read as comma lists and replace their value; ml_collections' own parser joins the values of a
    # repeated flag (`top_mlp=64,1 top_mlp=32,1` ran with (64, 1, 32, 1)) and reads `user,item` as one string.
    config_flags.register_flag_parser_for_type(tuple, ListFlagParser())
    flag_values = flags.FLAGS if flag_values is None else flag_values
    try:
        holder = config_flags.DEFINE_config_file(name, str(default), help_text, lock_config=True,
                                                 flag_values=flag_values, sys_argv=argv)
        # For `flag_error_message` when the command line is parsed (`run`): which file a run without --config uses.
        flag_values[name].default_config_file = str(default)
        return holder
    except Exception as error:
        if debugging(argv):
            raise
        fail(flag_error_message(error, argv, default))


def run(main: Callable[[list[str]], None]) -> None:
    """`absl.app.run(main)` with flag errors and UserErrors printed as one line (exit status 2)."""
    from absl import app, flags

    if "debug" not in flags.FLAGS:
        flags.DEFINE_bool("debug", False, f"Show the traceback of user errors too (or set {DEBUG_ENV}=1).")

    def parse(argv: list[str]) -> list[str]:
        check_config_path(argv)
        try:
            rest = flags.FLAGS(argv)
        except Exception as error:
            if debugging(argv):
                raise
            default = getattr(flags.FLAGS["config"], "default_config_file", None) if "config" in flags.FLAGS else None
            fail(flag_error_message(error, argv, default))
        check_repeated_list_flags(argv, flags.FLAGS)
        return rest

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


class _ReportedErrors(logging.Filter):
    """Drops a library's log record of an exception the entry point reports itself, as one line (`errors.reported`:
    a UserError, a full disk). Orbax logs every exception of its background threads with its traceback and then hands
    it to the caller that waits for the save, which reports it: a table file truncated during a save printed 5-7
    tracebacks before its one `error:` line. And Orbax's warning that a save waited for the previous one: the
    checkpointer waits for it on purpose before each save (a stall it counts itself), which Orbax adds up as its own
    wait."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and reported(record.exc_info[1]):
            return False
        return not str(record.msg).startswith("Waiting for previous save to complete took")


_REPORTED_ERRORS = _ReportedErrors()


def quiet_reported_errors() -> None:
    """Install `_ReportedErrors` on absl's logger (Orbax's), unless debugging (then every log shows)."""
    absl = logging.getLogger("absl")
    if not debugging() and _REPORTED_ERRORS not in absl.filters:
        absl.addFilter(_REPORTED_ERRORS)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn a UserError into `error: <message>` and exit status 2, and Ctrl-C into one line and exit status 130
    (argparse scripts wrap their main in this); library logs of the errors reported so are dropped
    (`quiet_reported_errors`)."""
    quiet_reported_errors()
    try:
        yield
    except UserError as error:
        if debugging():
            raise
        fail(str(error))
    except KeyboardInterrupt as error:  # Ctrl-C: the trainer's Interrupted says at which step, and how to resume
        if debugging():
            raise
        message = str(error) if isinstance(error, Interrupted) else (
            "interrupted; rerunning the same command resumes from the last checkpoint, if there is one")
        print(message, file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as error:
        # A config file that failed to load raises only when the config is first read (ml_collections'
        # _ErrorConfig), i.e. inside main.
        if "Error whilst parsing config file" in _innermost(error) and not debugging():
            fail(flag_error_message(error, sys.argv))
        raise
