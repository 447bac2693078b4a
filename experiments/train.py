r"""Train and evaluate one configuration.

    python -m experiments.train                                   # synthetic DLRM default, temp workdir
    python -m experiments.train --config=experiments/configs/dlrm_synthetic.py:kaggle \
        --config.train.steps=1000 --workdir=runs/kaggle

Writes to --workdir: TensorBoard events, metrics.csv, config.json, summary.json and checkpoints/; the same command
with the same --workdir resumes from the latest complete checkpoint (or says the run is complete). A config mistake
is one `error: ...` line and exit status 2 (`--debug` shows the traceback).
"""

import json
import pathlib
import shutil
import tempfile

from absl import flags

from recjax import cli

_DEFAULT_CONFIG = pathlib.Path(__file__).parent / "configs" / "dlrm_synthetic.py"

_CONFIG = cli.define_config_flag(_DEFAULT_CONFIG)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory; a fresh temp directory if unset.")

HEADLINE = ("auc", "logloss", "ne", "accuracy", "bayes_auc", "selected_step", "params", "embedding_bytes",
            "flops_per_example", "examples_per_sec")


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {argv[1:]}")
    from recjax.train import train_and_evaluate

    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="recjax_")
    try:
        summary = train_and_evaluate(_CONFIG.value, workdir)
    except BaseException:
        if not _WORKDIR.value:  # a temp workdir of a failed run holds nothing worth keeping
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    print(json.dumps({k: summary[k] for k in HEADLINE if k in summary}, indent=2))
    print(f"summary: {pathlib.Path(workdir) / 'summary.json'}")


if __name__ == "__main__":
    cli.run(main)
