r"""Train and evaluate one configuration.

    python -m experiments.train                                   # synthetic DLRM default, temp workdir
    python -m experiments.train --config=experiments/configs/dlrm_synthetic.py:kaggle \
        --config.train.steps=1000 --workdir=runs/kaggle
    python -m experiments.train --cpu_devices=8 --config.mesh.shape=data=4,model=2   # 8 CPU devices, sharded
    python -m experiments.train --coordinator_address=HOST:PORT --num_processes=2 --process_id=0   # multi-host

Writes to --workdir: TensorBoard events, metrics.csv, config.json, summary.json and checkpoints/; the same command
with the same --workdir resumes from the latest complete checkpoint (or says the run is complete). A config mistake
is one `error: ...` line and exit status 2 (`--debug` shows the traceback). `--config.model.name` swaps the model
with the learning rates and regularisation the config tuned for it (experiments/configs/common.py:swap_model); the
other `--config.*` values given win. A run whose loss diverged stops with an `error: ...` line and exit status 3
(summary.json "diverged"); Ctrl-C stops after the current step, checkpoints it and exits with status 130 (a second
Ctrl-C stops at once).
"""

import json
import pathlib
import shutil
import sys
import tempfile

from absl import flags
from ml_collections import config_flags

from experiments.configs import common
from recjax import cli
from recjax.errors import Interrupted

_DEFAULT_CONFIG = pathlib.Path(__file__).parent / "configs" / "dlrm_synthetic.py"

_CONFIG = cli.define_config_flag(_DEFAULT_CONFIG)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory; a fresh temp directory if unset.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None, "Give JAX this many CPU devices (like JAX_NUM_CPU_DEVICES), "
                                                         "e.g. 8 to try a mesh on a laptop.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "Multi-host: HOST:PORT of process 0 "
                                                                "(jax.distributed; or JAX_COORDINATOR_ADDRESS).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: how many processes (or JAX_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index (or JAX_PROCESS_ID).")

HEADLINE = ("auc", "logloss", "ne", "accuracy", "bayes_auc", "selected_step", "params", "embedding_bytes",
            "flops_per_example", "examples_per_sec")


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {argv[1:]}")
    import jax

    from recjax.sharding import multihost

    if _CPU_DEVICES.value is not None:
        if _CPU_DEVICES.value < 1:
            cli.fail(f"--cpu_devices: must be >= 1, got {_CPU_DEVICES.value}")
        jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
    multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)  # before JAX's first use
    from recjax.train import train_and_evaluate

    config = _CONFIG.value
    explicit = config_flags.get_override_values(flags.FLAGS["config"])  # {dotted key: value} set on the command line
    if "model.name" in explicit:
        for line in common.swap_model(config, config.model.name, explicit):
            print(line, flush=True)
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="recjax_")
    try:
        summary = train_and_evaluate(config, workdir)
    except Interrupted as error:
        if _WORKDIR.value or not error.resumable:
            raise
        # The checkpoint is in the temp workdir, which the same command would not find again: keep it, say where.
        raise Interrupted(f"interrupted at step {error.step:,}; to resume, rerun the command with "
                          f"--workdir={workdir} (its checkpoints are there)", error.step, True) from None
    except BaseException:
        if not _WORKDIR.value:  # a temp workdir of a failed run holds nothing worth keeping
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    if jax.process_index() == 0:
        print(json.dumps({k: summary[k] for k in HEADLINE if k in summary}, indent=2))
        print(f"summary: {pathlib.Path(workdir) / 'summary.json'}")
    if summary.get("diverged"):  # the full message is on the console above and in summary.json
        first = summary["diverged"].split(":", 1)[0]
        print(f"error: {first} (why, and which learning rates to lower: above and in "
              f"{pathlib.Path(workdir) / 'summary.json'} \"diverged\")", file=sys.stderr, flush=True)
        sys.exit(cli.EXIT_DIVERGED)


if __name__ == "__main__":
    cli.run(main)
