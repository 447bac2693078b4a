"""What a run writes as it goes: `metrics.csv`, TensorBoard scalars, and the rows kept for checkpoints.

One row per train log point and per evaluation (`split` = train / validation / test). The rows are also kept in
memory (`history`): a checkpoint saves them, and a resumed run rewrites `metrics.csv` from them, so rows a crashed
run logged after its last checkpoint are dropped, never duplicated. TensorBoard events of a resumed run go to a new
events file, so there the steps between the checkpoint and a crash appear twice.

Not `clu.metric_writers`: its TensorBoard writers need TensorFlow (or torch) and it has no CSV writer, so it would
add a dependency without replacing either writer here; tensorboardX writes the event files without TensorFlow.
"""

import csv
import pathlib

import numpy as np
from tensorboardX import SummaryWriter

from recjax.metrics import METRICS


def fields(metrics: tuple[str, ...] = METRICS) -> tuple[str, ...]:
    """metrics.csv's columns for a run whose evaluations report `metrics` (its objective's)."""
    return ("step", "split", "examples", "epoch", "loss", *metrics, "examples_per_sec", "elapsed_s")


FIELDS = fields()  # a binary run's columns
_NOT_SCALARS = ("step", "split", "examples", "epoch")


class MetricLog:
    """metrics.csv + TensorBoard events in `workdir`, starting from `history` (a restored run's rows); `metrics` are
    the evaluations' columns (the run's objective's)."""

    def __init__(self, workdir: pathlib.Path, batch_size: int, examples_per_epoch: int | None,
                 history: list[dict] | None = None, metrics: tuple[str, ...] = METRICS):
        self.batch_size, self.examples_per_epoch = batch_size, examples_per_epoch
        self.history = list(history or [])
        self.fields = fields(metrics)
        self.csv_path = workdir / "metrics.csv"
        with self.csv_path.open("w", newline="") as f:
            csv.writer(f).writerow(self.fields)
            csv.DictWriter(f, self.fields).writerows(self.history)
        self.writer = SummaryWriter(str(workdir))  # a resumed run's events go to a new file

    def write(self, row: dict) -> None:
        """Append one row ({"step", "split", ...}); examples and epoch are filled in from the step."""
        row["examples"] = row["step"] * self.batch_size
        if self.examples_per_epoch:
            row["epoch"] = row["examples"] / self.examples_per_epoch
        self.history.append(row)
        with self.csv_path.open("a", newline="") as f:
            csv.DictWriter(f, self.fields).writerow(row)
        for k, v in row.items():
            if k not in _NOT_SCALARS and v is not None and np.isfinite(v):
                self.writer.add_scalar(f"{row['split']}/{k}", v, row["step"])

    def close(self) -> None:
        self.writer.close()
