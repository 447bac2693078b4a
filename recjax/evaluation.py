"""Budget, evaluation and selection: how long a run trains, how it is scored, which step it reports.

`Budget` (from `train.steps` or `train.epochs`, and `train.eval_every`) says when to evaluate; `evaluate` scores a
split exactly (every example once, the short last batch padded) with the task's objective's metrics; `Selection`
keeps the best validation step and the test metrics scored at it (and the best step of the other tracked metric --
AUC or logloss for clicks; ratings track mse only -- with its test metrics) --
test is scored only at steps that improve a validation metric, so it never steers anything -- and stops a run after
`train.early_stopping_patience` evaluations without improvement of `train.select_on`. `check_train` validates the
`train` section.
"""

import dataclasses
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

from recjax import metrics
from recjax.batch import pad_batch, validate_batch
from recjax.embedding_backend import EmbeddingBackend
from recjax.errors import ConfigError
from recjax.placement.embedding import one_device
from recjax.step import TrainState
from recjax.task import Task
from recjax.validation import boolean, check_integer, choice, find, get, integer, known_keys, number

SELECT_ON = ("auc", "logloss", "mse")  # auc / logloss: binary labels; mse: regression (recjax/task.py OBJECTIVES)
TRAIN_KEYS = {"batch_size", "steps", "epochs", "eval_every", "log_every", "early_stopping_patience", "select_on",
              "selection_logloss_tolerance", "selection_auc_tolerance", "progress_bar", "divergence_factor",
              "check_memory", "steps_per_call", "input_workers"}
# train.steps_per_call = "auto": the steps one compiled call runs, by platform. On a CPU the step itself keeps the
# cores busy and a scan only saves a dispatch a step; on a GPU / TPU one step takes about as long as the host needs to
# dispatch it, so a call runs many (benchmarks/RESULTS.md#the-training-loop-steps-per-call).
AUTO_STEPS_PER_CALL = {"cpu": 1, "gpu": 32, "tpu": 32}
EPOCH_EVERY = re.compile(r"^\s*(\d*\.?\d*)\s*epochs?\s*$")  # "epoch", "0.25epoch", "2 epochs"


# ------------------------------------------------------------------------------------------- config
def eval_interval(value: Any) -> tuple[str, float]:
    """train.eval_every -> ("steps", n) or ("epochs", fraction of an epoch)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError("train.eval_every", f"must be >= 1 steps or 'epoch', got {value}")
        return "steps", int(value)
    if isinstance(value, str):
        if value.strip().isdigit():
            return eval_interval(int(value))
        match = EPOCH_EVERY.match(value)
        if match:
            fraction = float(match.group(1)) if match.group(1) not in ("", ".") else 1.0
            if fraction > 0:
                return "epochs", fraction
    raise ConfigError("train.eval_every", f"must be a number of steps >= 1, 'epoch' or e.g. '0.25epoch', got "
                                          f"{value!r}")


def check_train(config: Mapping) -> None:
    known_keys(config, "train", TRAIN_KEYS)
    integer(config, "train.batch_size", 1)
    steps, epochs = get(config, "train.steps"), get(config, "train.epochs")
    if (steps is None) == (epochs is None):
        both = "both are set" if steps is not None else "neither is set"
        raise ConfigError("train.steps", f"set exactly one of train.steps and train.epochs ({both}: steps={steps!r}, "
                                         f"epochs={epochs!r}); e.g. --config.train.epochs=None "
                                         "--config.train.steps=1000")
    if steps is not None:
        integer(config, "train.steps", 1)
    else:
        number(config, "train.epochs", above=0)
    unit, _ = eval_interval(get(config, "train.eval_every"))
    integer(config, "train.log_every", 1)
    integer(config, "train.early_stopping_patience", 0)
    choice(config, "train.select_on", SELECT_ON)
    number(config, "train.selection_logloss_tolerance", at_least=0)
    number(config, "train.selection_auc_tolerance", at_least=0)
    boolean(config, "train.progress_bar")
    factor = number(config, "train.divergence_factor", at_least=0)
    if 0 < factor <= 1:
        raise ConfigError("train.divergence_factor", f"must be 0 (off) or > 1 (a loss this many times its lowest), "
                                                     f"got {factor}")
    boolean(config, "train.check_memory")
    steps_per_call = find(config, "train.steps_per_call", "auto")
    if steps_per_call != "auto":
        check_integer("train.steps_per_call", steps_per_call, 1)
    check_integer("train.input_workers", find(config, "train.input_workers", 2), 1)
    if get(config, "data.name") == "synthetic" and (epochs is not None or unit == "epochs"):
        raise ConfigError("train.epochs" if epochs is not None else "train.eval_every",
                          "synthetic data is an endless stream without epochs; set train.steps and an eval_every "
                          "in steps")


# ------------------------------------------------------------------------------------------- budget
@dataclasses.dataclass(frozen=True)
class Budget:
    """How long to train and when to evaluate, in steps of `batch_size` examples.

    With `train.epochs`, steps = ceil(epochs * examples_per_epoch / batch_size); epochs follow each other without a
    gap in the train stream, so the budget is exact. An interval of `every_epochs` evaluates after each step that
    crosses a multiple of that many epochs' examples. The last step is always evaluated.
    """

    steps: int
    batch_size: int
    examples_per_epoch: int | None  # None: an endless stream (synthetic data)
    every_steps: int | None = None
    every_epochs: float | None = None

    def is_eval_step(self, step: int) -> bool:
        if step == self.steps:
            return True
        if self.every_steps is not None:
            return step % self.every_steps == 0
        period = self.every_epochs * self.examples_per_epoch
        return math.floor(step * self.batch_size / period) > math.floor((step - 1) * self.batch_size / period)

    def describe(self) -> str:
        examples = self.steps * self.batch_size
        if self.examples_per_epoch:
            text = (f"{self.examples_per_epoch:,} train examples/epoch; {self.steps:,} steps of {self.batch_size} = "
                    f"{examples / self.examples_per_epoch:.3g} epochs")
        else:
            text = f"{self.steps:,} steps of {self.batch_size} = {examples:,} examples"
        if self.every_steps is not None:
            every = f"every {self.every_steps:,} steps"
        else:
            every = "every epoch" if self.every_epochs == 1 else f"every {self.every_epochs:g} epochs"
        return f"{text}; validation {every} and at the end"


def resolve_steps_per_call(train: ml_collections.ConfigDict, platform: str, one_step_only: str | None = None) -> int:
    """train.steps_per_call as a number: "auto" -> the platform's (`AUTO_STEPS_PER_CALL`; 1 on an unknown one), or 1
    where the placement runs one step per call (`one_step_only`: why; then a k > 1 asked for is a ConfigError)."""
    value = train.get("steps_per_call", "auto")
    if value == "auto":
        return 1 if one_step_only else AUTO_STEPS_PER_CALL.get(platform, 1)
    if int(value) > 1 and one_step_only:
        raise ConfigError("train.steps_per_call", one_step_only.removeprefix("train.steps_per_call "))
    return int(value)


def resolve_budget(train: ml_collections.ConfigDict, dataset) -> Budget:
    """The run's Budget from `config.train` and the dataset's train size."""
    batch_size = int(train.batch_size)
    n = dataset.num_examples("train")
    if n == 0:
        raise ConfigError("data", "the train split is empty")
    unit, every = eval_interval(train.eval_every)
    if n is None and (train.epochs is not None or unit == "epochs"):
        raise ConfigError("train.epochs", "this dataset is an endless stream without epochs; set train.steps and an "
                                          "eval_every in steps")
    steps = int(train.steps) if train.steps is not None else math.ceil(float(train.epochs) * n / batch_size)
    if unit == "steps":
        return Budget(steps, batch_size, n, every_steps=int(every))
    return Budget(steps, batch_size, n, every_epochs=every)


# ----------------------------------------------------------------------------------------- evaluation
def evaluate(task: Task, predict_step, state: TrainState, dataset, batch_size: int, split: str,
             backend: EmbeddingBackend | None = None) -> dict[str, float]:
    """Exact metrics over the whole `split` (short last batch padded, padding dropped); `backend` places each batch
    (a mesh run splits it over the devices). Multi-host, each process reads only its share of every batch
    (`backend.process_rows`), and every process computes the metrics over all processes' rows, each row once."""
    backend = backend or one_device(task.collection)
    put, rows = backend.put_batch, backend.process_rows(batch_size)
    labels, probs = [], []
    share = {} if rows is None else {"rows": rows}
    local_size = batch_size if rows is None else rows.stop - rows.start
    for i, batch in enumerate(dataset.eval_batches(batch_size, split, **share)):
        validate_batch(batch, task.spec, any_id=task.collection.any_id_features, where=f"{split} batch {i}")
        n = batch.size
        padded = pad_batch(batch, local_size)
        p = backend.to_host(predict_step(state, put(padded)))
        if rows is None:
            probs.append(p[:n])
            labels.append(batch.labels)
        else:  # every process's labels and which rows are real (a share of the short last batch may be empty)
            label, real = (backend.to_host(x) for x in put((padded.labels, np.arange(local_size) < n)))
            probs.append(p[real])
            labels.append(label[real])
    labels, probs = np.concatenate(labels), np.concatenate(probs)
    if not np.all(np.isfinite(probs)):
        raise FloatingPointError("model produced non-finite predictions; lower the learning rates")
    return task.objective.evaluate(labels, probs)


# ------------------------------------------------------------------------------------------ selection
# Validation metrics whose best step is tracked (and test scored at it), whichever one `train.select_on` names: the
# binary objective's; a regression run tracks its objective's (`Selection.tracked`).
TRACKED = ("auc", "logloss")
_better = metrics.better


@dataclasses.dataclass
class Selection:
    """Best-step selection on the validation split, with early stopping after `patience` evaluations without
    improvement (0 = never stop early).

    The step `select_on` picks is the run's (its test metrics are the headline); besides it, `by_metric` keeps the
    best validation step of every TRACKED metric with its test metrics, {metric: {"step", "validation", "test"}}:
    AUC can keep rising while the probabilities are already overconfident and the logloss rises past its minimum,
    and a user reading only the AUC-selected logloss would not know what selecting on logloss gives. Test is scored
    only at steps that improve some tracked metric, so it still steers nothing.
    """

    select_on: str
    patience: int
    selectable_from: int = 0  # earlier evaluations are logged only (dynamic tables have not reached their budget)
    best_step: int = 0
    best_validation: dict = dataclasses.field(default_factory=dict)
    test: dict = dataclasses.field(default_factory=dict)
    last_validation: dict = dataclasses.field(default_factory=dict)
    evals_without_improvement: int = 0
    warnings: list[str] = dataclasses.field(default_factory=list)
    by_metric: dict = dataclasses.field(default_factory=dict)
    tracked: tuple[str, ...] = TRACKED  # the objective's (recjax/task.py Objective.tracked)

    def improves(self, validation: dict) -> bool:
        if not self.best_validation:
            return True
        return _better(self.select_on, validation[self.select_on], self.best_validation[self.select_on])

    def record(self, step: int, validation: dict) -> bool:
        """Note an evaluation; True if it is the best step so far of `select_on` or of another tracked metric (then
        score test and pass it to `record_test`)."""
        if self.select_on == "auc" and not np.isfinite(validation["auc"]) and "logloss" in self.tracked:
            # One class only (e.g. a tiny validation split without clicks): AUC is undefined, logloss is not.
            self.select_on = "logloss"
            self.warnings.append(f"the validation split has one class only (click rate {validation['eval_ctr']:g} "
                                 f"over {validation['eval_examples']} examples), so its AUC is undefined: selecting "
                                 "on validation logloss instead; provide a larger validation split")
            print(f"WARNING: {self.warnings[-1]}", flush=True)
        self.last_validation = validation
        if step < self.selectable_from:
            return False
        improved = False
        for metric in self.tracked:  # a NaN (one-class) metric never becomes a best
            value, best = validation[metric], self.by_metric.get(metric)
            if np.isfinite(value) and (best is None or _better(metric, value, best["validation"][metric])):
                self.by_metric[metric] = {"step": step, "validation": validation, "test": {}}
                improved = True
        if self.improves(validation):
            self.best_step, self.best_validation, self.evals_without_improvement = step, validation, 0
            return True
        self.evals_without_improvement += 1
        return improved

    def record_test(self, step: int, test: dict) -> None:
        """The test metrics of `step`, an evaluation `record` said to score: kept for every metric it is best on."""
        if step == self.best_step:
            self.test = test
        for best in self.by_metric.values():
            if best["step"] == step:
                best["test"] = test

    def disagreement(self, logloss_tolerance: float, auc_tolerance: float) -> str | None:
        """A warning when the selected step is far from another tracked metric's best validation step: its
        validation logloss more than `logloss_tolerance` (relative) above the lowest, or its validation AUC more
        than `auc_tolerance` (absolute) below the highest; None when they agree within those."""
        other = "auc" if self.select_on == "logloss" else "logloss"
        if other not in self.by_metric or self.select_on not in ("auc", "logloss"):
            return None
        chosen, best = self.best_validation[other], self.by_metric[other]["validation"][other]
        if other == "logloss" and chosen > best * (1.0 + logloss_tolerance):
            text = f"validation logloss {chosen:.4f} is {100 * (chosen / best - 1):.1f} % above its lowest, {best:.4f}"
        elif other == "auc" and chosen < best - auc_tolerance:
            text = f"validation auc {chosen:.4f} is {best - chosen:.4f} below its highest, {best:.4f}"
        else:
            return None
        step = self.by_metric[other]["step"]
        test = lambda t: f"auc {t['auc']:.4f}, logloss {t['logloss']:.4f}"  # noqa: E731
        return (f"selecting on validation {self.select_on} picked step {self.best_step:,}, whose {text} (step "
                f"{step:,}); test at step {self.best_step:,}: {test(self.test)}, at step {step:,}: "
                f"{test(self.by_metric[other]['test'])} (summary.json: selection)")

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.evals_without_improvement >= self.patience
