"""README.md works as written: every shell block's commands name modules, scripts, config files, config fields and
install extras that exist, always through the venv's Python; every path a command reads was written by a command
before it (or is a /path/to/ placeholder); the serving example runs as written; and the test command is what CI
runs."""

import ast
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def shell_commands(text: str = README) -> list[str]:
    """Every command of every ```bash block, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split("  #")[0].strip()
            if command:
                commands.extend(part.strip() for part in command.split("&&"))
    return commands


COMMANDS = shell_commands()


def setup_extras() -> set[str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return {key.value for key in node.value.keys}
    raise AssertionError("setup.py has no extras_require")


def test_readme_has_commands():
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_names_things_that_exist(command):
    words = shlex.split(command)
    program = words[0]
    if program == "curl":  # a request to the server a README command starts
        ports = {a.split("=", 1)[1] for c in COMMANDS if " experiments.serve " in c for a in shlex.split(c)
                 if a.startswith("--port=")}
        assert re.search(r"localhost:(\d+)/", command).group(1) in ports, command
        return
    if program == "python3":
        assert words[1:3] == ["-m", "venv"], command
        return
    assert program.startswith(".venv/bin/"), f"use the venv's programs consistently: {command}"
    tool = program.removeprefix(".venv/bin/")
    if tool == "pip":
        for extra in re.findall(r"\.\[([\w,]+)\]", command):
            assert set(extra.split(",")) <= setup_extras(), command
        return
    if tool == "tensorboard":
        assert "tensorboard" in setup_extras()
        return
    assert tool == "python", command
    if words[1:3] == ["-m", "pytest"]:
        return
    if words[1] == "-m":
        module = words[2]
        path = REPO / (module.replace(".", "/") + ".py")
        assert path.is_file(), f"{module} does not exist ({command})"
        args = words[3:]
    else:
        assert (REPO / words[1]).is_file(), command
        args = words[2:]
    config_path = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
    if config_path is None and words[1:3] == ["-m", "experiments.train"]:
        config_path = "experiments/configs/dlrm_synthetic.py"
    if config_path:
        check_config(config_path, [a for a in args if a.startswith("--config.")], command)


def check_config(config_path: str, overrides: list[str], command: str) -> None:
    """The config file exists, loads with its argument, and has every overridden field."""
    import importlib

    path, _, arg = config_path.partition(":")
    assert (REPO / path).is_file(), f"{path} does not exist ({command})"
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    config = module.get_config(arg) if arg else module.get_config()
    for override in overrides:
        node = config
        for part in override.removeprefix("--config.").split("=")[0].split("."):
            assert part in node, f"{override}: no such config field ({command})"
            node = node[part]


# The flags through which a command reads a path, and those it writes one to: (module, flag); "*": any module.
READS = {("*", "--config.data.dir"), ("*", "--config.checkpoint.restore"), ("*", "--data_dir"),
         ("experiments.export", "--workdir"), ("experiments.serve", "--model")}
WRITES = {("experiments.make_movielens_like", "--out"), ("experiments.export", "--out"),
          ("experiments.train", "--workdir"), ("experiments.sweep_compression", "--workdir"),
          ("experiments.sweep_models", "--workdir"), ("experiments.sweep_scaling", "--workdir"),
          ("*", "--config.tiering.dir")}


def _paths(words: list[str], flags: set[tuple[str, str]]) -> list[str]:
    """The values of a command's flags in `flags`."""
    module = words[2] if words[1:2] == ["-m"] else ""
    values = []
    for arg in words:
        flag, eq, value = arg.partition("=")
        if eq and ((module, flag) in flags or ("*", flag) in flags):
            values.append(value)
    return values


def test_every_path_a_command_reads_was_written_before():
    """A command reading a run, an export or a data folder follows the command that writes it (so a chain of README
    commands runs as written), unless the path is a placeholder for the user's own files (/path/to/...)."""
    written: list[str] = []
    for command in COMMANDS:
        words = shlex.split(command)
        if not words[0].endswith("python"):
            continue
        for path in _paths(words, READS):
            assert path.startswith("/path/to/") or any(path == w or path.startswith(w.rstrip("/") + "/")
                                                       for w in written), f"{path} is written by no command " \
                                                                          f"before: {command}"
        written += _paths(words, WRITES)


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.slow  # generates data, trains, exports and serves (about a minute on 2 cores)
def test_the_serving_example_runs_as_written(tmp_path):
    """The Serving section's commands, in order, in a fresh folder (the repository's experiments/ linked into it):
    the data generated, a run trained, exported and served, and the curl request answered with a score per row. Only
    the pip install is left out (the test environment has the serve extra), /tmp/ is the test's folder, and the
    server takes a free port."""
    (tmp_path / "experiments").symlink_to(REPO / "experiments")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TFDS_DATA_DIR": str(tmp_path / "tfds")}
    commands = shell_commands(_section("Serving"))
    assert [c.split()[0] for c in commands][-2:] == [".venv/bin/python", "curl"], commands
    server, port = None, None
    try:
        for command in commands:
            words = [w.replace("/tmp/", f"{tmp_path}/") for w in shlex.split(command)]
            if words[0] == ".venv/bin/pip":
                continue
            if words[0] == "curl":
                target = next(w for w in words if w.startswith("localhost:"))
                url = re.sub(r"^localhost:\d+", f"localhost:{port}", target)
                request = urllib.request.Request(f"http://{url}", data=words[words.index("-d") + 1].encode())
                with urllib.request.urlopen(request) as answer:
                    body = json.loads(answer.read())
                rows = json.loads(words[words.index("-d") + 1])["rows"]
                assert body["errors"] == [] and len(body["scores"]) == len(rows), body
                assert all(0 < p < 1 for p in body["scores"]), body
                continue
            words[0] = sys.executable
            if words[1:3] == ["-m", "experiments.serve"]:
                words = [w if not w.startswith("--port=") else "--port=0" for w in words]
                server = subprocess.Popen(words, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)
                for line in server.stdout:
                    if line.startswith("serving on http://"):
                        port = int(line.split()[2].rsplit(":", 1)[1])
                        break
                else:
                    raise AssertionError(f"the server exited: {server.wait()}")
                continue
            result = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
            assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGTERM)
            server.communicate()
    assert server.returncode == 0


def readme_block(marker: str) -> str:
    """The fenced block after the README line starting `<!-- marker` (what .ci/run reads)."""
    assert f"<!-- {marker}" in README, marker
    return README.split(f"<!-- {marker}", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()


def test_the_test_commands_are_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    assert "ci:test-command" in ci and "ci:slow-command" in ci
    assert readme_block("ci:test-command") == ('python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && '
                                               '.venv/bin/python -m pytest')
    # The slow tests run in the venv the test command made: every slow-marked test is in CI.
    assert readme_block("ci:slow-command") == ".venv/bin/python -m pytest -m slow"
