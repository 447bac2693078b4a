r"""Train and evaluate one configuration.

    python -m experiments.train                                   # synthetic DLRM default, temp workdir
    python -m experiments.train --config=experiments/configs/dlrm_synthetic.py:kaggle \
        --config.train.steps=1000 --workdir=runs/kaggle

Writes to --workdir: TensorBoard events, metrics.csv, config.json and summary.json.
"""

import json
import pathlib
import tempfile

from absl import app, flags
from ml_collections import config_flags

from recjax.train import train_and_evaluate

_DEFAULT_CONFIG = pathlib.Path(__file__).parent / "configs" / "dlrm_synthetic.py"

_CONFIG = config_flags.DEFINE_config_file("config", str(_DEFAULT_CONFIG), "Path to a config file (with :preset).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory; a fresh temp directory if unset.")

HEADLINE = ("auc", "logloss", "ne", "accuracy", "bayes_auc", "params", "embedding_bytes", "flops_per_example",
            "examples_per_sec")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="recjax_")
    summary = train_and_evaluate(_CONFIG.value, workdir)
    print(json.dumps({k: summary[k] for k in HEADLINE if k in summary}, indent=2))
    print(f"summary: {pathlib.Path(workdir) / 'summary.json'}")


if __name__ == "__main__":
    app.run(main)
