"""README.md works as written: every shell block's commands name modules, scripts, config files, config fields and
install extras that exist, always through the venv's Python, and the test command is what CI runs."""

import ast
import pathlib
import re
import shlex

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def shell_commands() -> list[str]:
    """Every command of every ```bash block, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
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
