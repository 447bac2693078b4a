"""The dependency ranges setup.py declares are true at their lower ends: a throwaway venv gets exactly every declared
minimum (jaxlib == jax), and recjax imports, trains with k steps per call, checkpoints and restores there.

Slow and online: it installs from the package index (~400 MB the first time; pip's cache serves later runs). Without
an index it skips, saying so.
"""

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from conftest import HANG_GUARD_S
from packaging.version import Version

REPO = pathlib.Path(__file__).resolve().parents[1]


def declared_minimums() -> dict[str, str]:
    """{distribution: lower bound} of setup.py's install_requires (every one must have a ">=" bound)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "setup")
    requires = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "install_requires"))
    out = {}
    for requirement in requires:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9.]*)\s*(,.*)?", requirement)
        assert match, f"setup.py: {requirement!r} has no '>=' lower bound"
        out[match.group(1)] = match.group(2)
    return out


def copy_source(target: pathlib.Path) -> None:
    """The checkout's tracked files; where it is no git checkout (CI's copy of the tracked files), all of it but
    environments, caches and build output."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if listed.returncode:
        shutil.copytree(REPO, target, ignore=shutil.ignore_patterns(
            ".venv", "venv", ".git", "__pycache__", "*.egg-info", "build", ".pytest_cache", ".ruff_cache"))
        return
    for name in filter(None, listed.stdout.decode().split("\0")):
        path = target / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes((REPO / name).read_bytes())


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_requirement_declares_its_minimum():
    minimums = declared_minimums()
    assert {"jax", "numpy", "orbax-checkpoint", "grain", "tensorflow-datasets"} <= set(minimums)


@pytest.mark.slow
def test_the_declared_minimums_install_import_train_and_checkpoint(tmp_path):
    minimums = declared_minimums()
    constraints = {**minimums, "jaxlib": minimums["jax"]}
    (tmp_path / "constraints.txt").write_text("".join(f"{n}=={v}\n" for n, v in constraints.items()))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip, python = str(venv / "bin" / "pip"), str(venv / "bin" / "python")
    online = subprocess.run([pip, "download", "--no-deps", "-q", "-d", str(tmp_path / "probe"),
                             f"jax=={minimums['jax']}"], capture_output=True, text=True, timeout=600)
    if online.returncode:
        pytest.skip(f"no package index to install the declared minimums from: {online.stderr.strip()[-300:]}")
    # A copy of the source (as .ci/run installs it), so the build writes nothing beside the checkout.
    source = tmp_path / "src"
    copy_source(source)
    install = subprocess.run([pip, "install", "-q", "-c", str(tmp_path / "constraints.txt"), str(source)],
                             capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert install.returncode == 0, install.stderr[-4000:]
    listed = subprocess.run([pip, "list", "--format=freeze"], capture_output=True, text=True, check=True).stdout
    installed = {normalized(n): v for n, v in (line.split("==") for line in listed.splitlines() if "==" in line)}
    for name, version in constraints.items():  # exactly the minimums (0.10 is 0.10.0)
        assert Version(installed.get(normalized(name), "0")) == Version(version), (name, version, installed)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "PYTHONPATH"))} | {"JAX_PLATFORMS": "cpu"}
    flags = ["--config.train.steps=12", "--config.train.eval_every=6", "--config.train.log_every=6",
             "--config.data.eval_examples=1024", "--config.data.vocab_sizes=200,50,1000,8,3000,20",
             "--config.train.batch_size=128", "--config.train.progress_bar=False", "--config.train.steps_per_call=4",
             "--config.checkpoint.every_steps=6"]
    first = subprocess.run([python, "-m", "experiments.train", f"--workdir={tmp_path / 'a'}", *flags], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (tmp_path / "a" / "summary.json").is_file() and (tmp_path / "a" / "checkpoints" / "12").is_dir()
    # Another run restored from its checkpoint of step 6 (Orbax's read of what it wrote) trains on to 18.
    second = subprocess.run([python, "-m", "experiments.train", f"--workdir={tmp_path / 'b'}", *flags,
                             "--config.train.steps=18", f"--config.checkpoint.restore={tmp_path / 'a/checkpoints/6'}"],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from checkpoint step 6 of 18" in second.stdout
