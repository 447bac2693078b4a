"""The trainer: `train_and_evaluate(config, workdir)` wires the data, the task, the embedding backend, the
checkpoints and the outputs, then runs the loop.

What is trained is a `Task` (recjax/task.py); the one train / predict step is recjax/step.py, written against the
embedding interface, which `recjax.placement.build` composes from a layout (one device, a mesh) and a storage per
table group (device memory, host memory, disk behind a RAM cache); budget, evaluation and selection are
recjax/evaluation.py; what the run writes as it goes is recjax/metric_log.py. The loop:

    for each call of k steps (`train.steps_per_call`; a call ends at every log / eval / checkpoint / adjustment step):
    train steps -> (dynamic tables: adjust) -> at log points: loss and the divergence check, at eval
    points: validation, and test when validation improved -> early stop? -> checkpoint when due or newly selected (or
    on Ctrl-C, then stop)

What guards a run (a workdir it can write, a model that fits in memory, a loss that diverges, Ctrl-C) is
recjax/guards.py.

Model selection is honest: the test split is scored only at steps that improve a validation metric (AUC or
logloss), so test numbers never steer anything; the summary reports the test metrics of the best validation step of
`train.select_on`, those at the other metric's best step, and a warning when the two disagree by more than
`train.selection_*_tolerance`.
"""

import collections
import dataclasses
import functools
import json
import math
import pathlib
import resource
import time
from collections.abc import Iterator

import jax
import ml_collections
import numpy as np
import tqdm

from recjax import placement, sharding
from recjax.batch import pad_batch, validate_batch
from recjax.checkpoint import Checkpointer, ResumePoint
from recjax.config_check import validate_config
from recjax.data import make_dataset
from recjax.data.pipeline import BlockPrefetcher, MadeBlocks, stack, stream_blocks
from recjax.dynamic import DynamicTables
from recjax.embedding_backend import EmbeddingBackend
from recjax.errors import ConfigError, Interrupted
from recjax.evaluation import Budget, Selection, evaluate, resolve_budget, resolve_steps_per_call
from recjax.guards import (
    Divergence,
    StopRequest,
    check_memory,
    divergence_advice,
    interrupted,
    writable_directory,
)
from recjax.metric_log import MetricLog
from recjax.rss import RssSampler
from recjax.sharding import multihost
from recjax.step import init_state, make_predict_step, make_train_step
from recjax.task import Task, build_task
from recjax.tiering.folders import WORKDIR_FOLDER, remove_stale


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
    """Train per `config`, select the best step on validation, write the workdir outputs, return the summary."""
    sections = validate_config(config)  # every config mistake is a ConfigError naming its key, before any work

    # --- workdir and checkpoints ----------------------------------------------------------------------
    root = pathlib.Path(workdir)  # process 0's workdir: the summary and the checkpoints every process shares
    workdir = sharding.process_workdir(root)  # under multi-host, process i > 0 logs to process_i/
    writable_directory(workdir, "--workdir")
    if config.checkpoint.enabled and config.checkpoint.dir:
        writable_directory(pathlib.Path(config.checkpoint.dir).expanduser(), "checkpoint.dir")
    left = remove_stale(workdir / WORKDIR_FOLDER)  # the disk-tier table files a killed run left here
    if left:
        print(f"removed the disk-tier table files ({left / 2**20:,.1f} MiB) a killed run left in {workdir}", flush=True)
    checkpointer = Checkpointer(config, root) if config.checkpoint.enabled else None
    resume = checkpointer.resume_point() if checkpointer else None
    if resume and resume.own and resume.finished and (root / "summary.json").exists():
        print(f"run complete: {resume.store.directory / str(resume.step)} is its final checkpoint; nothing to train "
              f"(summary: {root / 'summary.json'})", flush=True)
        checkpointer.close()
        return json.loads((root / "summary.json").read_text())
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")

    # --- data and task ----------------------------------------------------------------------------------
    dataset = make_dataset(config.data, seed=config.seed)
    budget = resolve_budget(config.train, dataset)
    if resume and not resume.own and resume.step >= budget.steps:  # nothing left to train, nothing of its own to select
        key = "train.steps" if config.train.steps is not None else "train.epochs"
        raise ConfigError(key, f"the budget of {budget.steps:,} steps ends at or before step {resume.step:,} of the "
                               f"checkpoint.restore {resume.store.directory / str(resume.step)}; raise {key} to train "
                               "on from there")
    print(f"train: {budget.describe()}", flush=True)
    task = build_task(config, dataset.spec, dataset, budget.steps)
    dynamic = DynamicTables.create(task.collection, budget.steps, int(config.seed))
    saved_dynamic = resume.meta["loop"].get("dynamic") if resume else None
    if saved_dynamic and dynamic is not None:  # the pools were compacted: restore into the checkpoint's capacities
        # (with its memory history only when the run resumes itself; another run's history is its own)
        task = (dynamic.resume(task, saved_dynamic) if resume.own
                else dynamic.with_capacities(task, saved_dynamic["capacities"]))

    # --- where the embedding rows live ------------------------------------------------------------------
    # A layout (one device, or the mesh's plan) x a storage per table group (device memory, host memory, disk
    # behind a RAM cache): recjax/placement.
    backend = placement.build(sections, task, dataset, workdir)
    check_memory(config, task, backend)  # before the tables are made (device and host memory, apart)
    if checkpointer is not None:  # where the tables' rows are, and how to restore a checkpoint saved elsewhere
        checkpointer.layout = backend.checkpoint_layout()
        checkpointer.relayout = backend.relayout()
        checkpointer.task = task  # what the tables hold: checked on restore
        checkpointer.backend = backend  # what a save writes of the tables (a disk tier reads them from its files)

    stop = StopRequest()
    try:
        # Steps one compiled call runs: by platform, or 1 where the placement plans each step's rows on the host.
        steps_per_call = resolve_steps_per_call(config.train, jax.default_backend(), backend.one_step_only)
        with stop, RssSampler() as rss:
            run = Run(config, workdir, dataset, task, budget, backend, checkpointer, dynamic, stop, rss, steps_per_call)
            # The input pipeline starts first: its first blocks are made while the steps compile.
            with run.input_pipeline(resume.step if resume else 0) as calls:
                run.start(resume)
                return run.train(calls)
    except KeyboardInterrupt as error:  # Ctrl-C twice, or before the loop started
        if isinstance(error, Interrupted):
            raise
        raise interrupted(stop.step, checkpointer) from None
    finally:
        try:
            if checkpointer:
                checkpointer.close()  # waits for a save in flight
        finally:
            backend.close()  # a disk tier's writer thread and files


@dataclasses.dataclass
class LoopState:
    """The loop's own state, saved with every checkpoint beside the TrainState (`to_saved` / `from_saved` keep the
    checkpoint's `loop` format)."""

    selection: Selection
    history: list[dict]  # metrics.csv's rows so far
    train_time: float = 0.0  # seconds spent in train steps (compiles, evaluations and save stalls excluded)
    wall_time_before: float = 0.0  # wall time of the run before it was resumed
    loss: float = math.nan  # the last logged train loss
    test_warned: bool = False
    restored_from: dict | None = None  # {"checkpoint", "step"}: this run began from another run's checkpoint
    divergence: Divergence = dataclasses.field(default_factory=lambda: Divergence(0.0))

    @classmethod
    def fresh(cls, config: ml_collections.ConfigDict, tracked: tuple[str, ...] = ("auc", "logloss")) -> "LoopState":
        return cls(Selection(config.train.select_on, int(config.train.early_stopping_patience), tracked=tracked), [],
                   divergence=Divergence(float(config.train.divergence_factor)))

    @classmethod
    def from_saved(cls, saved: dict, config: ml_collections.ConfigDict) -> "LoopState":
        return cls(Selection(**saved["selection"]), list(saved.get("history", [])), saved.get("train_time", 0.0),
                   saved.get("wall_time", 0.0), saved.get("loss", math.nan), saved.get("test_warned", False),
                   saved.get("restored_from"),
                   Divergence(float(config.train.divergence_factor), **saved.get("divergence", {})))

    def to_saved(self, history: list[dict], wall_time: float) -> dict:
        return {"selection": dataclasses.asdict(self.selection), "test_warned": self.test_warned,
                "train_time": self.train_time, "wall_time": wall_time, "loss": self.loss,
                "restored_from": self.restored_from,
                "divergence": {"initial": self.divergence.initial, "lowest": self.divergence.lowest},
                "history": list(history)}  # a copy: an async save serialises it while the loop appends


class Run:
    """One training run: the state, the compiled steps, the loop state and what it writes."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: pathlib.Path, dataset, task: Task,
                 budget: Budget, backend: EmbeddingBackend, checkpointer: Checkpointer | None,
                 dynamic: DynamicTables | None, stop: StopRequest | None = None, rss: RssSampler | None = None,
                 steps_per_call: int = 1):
        self.config, self.workdir, self.dataset, self.task, self.budget = config, workdir, dataset, task, budget
        self.backend, self.checkpointer, self.dynamic = backend, checkpointer, dynamic
        self.stop = stop or StopRequest()  # Ctrl-C: stop after the current call
        self.steps_per_call = steps_per_call
        self.rss = rss or RssSampler()  # the peaks of the process's own memory and of its mapped files
        self.loop = LoopState.fresh(config, task.objective.tracked)
        # The calls' losses since the last divergence check, left on the device until a log point (or a save)
        # fetches them at once; step 1's loss (a fresh run's: the untrained model's).
        self.window_losses: list[jax.Array] = []
        self.first_loss: jax.Array | None = None
        # Where the loop's train time goes (summary.json "loop"): waiting for the next block of batches, dispatching
        # the compiled calls, and reading values back at log points (which waits for the device); and the process's
        # CPU time over the same windows (every thread's: the device's on a CPU, the input pipeline's).
        self.clock = {"calls": 0, "input_wait_s": 0.0, "dispatch_s": 0.0, "sync_s": 0.0, "cpu_s": 0.0}
        self.train_calls: dict[int, object] = {}  # steps per call -> its executable (1: `train_step`)
        self._initial_collection = task.collection  # a compaction keeps the adjustment steps

    # ------------------------------------------------------------------------------------------------ input
    def is_call_end(self, step: int) -> bool:
        """A step after which the loop must look at the state: a log or evaluation point, a checkpoint the steps
        interval asks for, a dynamic table's adjustment, or the last step. A call of k steps never runs past one
        (time-based checkpoints and Ctrl-C are looked at after every call)."""
        due = self.dynamic.due if self.dynamic is not None else None
        return (step % self.config.train.log_every == 0 or self.budget.is_eval_step(step)
                or (self.checkpointer is not None and self.checkpointer.due_at(step))
                or (due is not None and due(self._initial_collection, step)))

    def call_lengths(self, start: int, last: int) -> Iterator[int]:
        """Steps of each call from `start` to `last`: k (`steps_per_call`) where no call end falls inside the next k
        steps, else 1 up to it -- two compiled executables, whatever the intervals (a call of every other length would
        compile one more)."""
        k, step = self.steps_per_call, start
        while step < last:
            n = k if step + k <= last and not any(self.is_call_end(s) for s in range(step + 1, step + k)) else 1
            yield n
            step += n

    def call_sizes(self) -> list[int]:
        """Every length a call can have: 1 and k."""
        return sorted({1, self.steps_per_call})

    def input_pipeline(self, start: int) -> BlockPrefetcher | MadeBlocks:
        """The calls' inputs from step `start` to the budget (recjax/data/pipeline.py). Step i's batch is a pure
        function of (seed, i), so a resumed run restarts the stream at its step. Synthetic data is made on the
        device, keyed by step, one call ahead; other data is read on the host and validated, stacked and put on the
        device a block at a time by worker threads, ahead of the loop. Multi-host: each process reads only its
        devices' rows of every batch (the batch is the same for any number of processes); the processes' shares
        make the global arrays (`backend.put_batch`)."""
        backend, batch_size = self.backend, self.budget.batch_size
        lengths = self.call_lengths(start, self.budget.steps)
        rows = backend.process_rows(batch_size)  # multi-host: this process's share of every batch
        if rows is None and hasattr(self.dataset, "device_batches"):
            make = functools.partial(self.dataset.device_batches, batch_size)
            # Compiled for every call length while the steps compile.
            return MadeBlocks(make, lengths, backend.put_batch, start,
                              warmup=[functools.partial(make, start, n) for n in self.call_sizes()])
        if rows is not None:
            print(f"data: process {jax.process_index()} of {jax.process_count()} reads rows [{rows.start}, "
                  f"{rows.stop}) of every batch of {batch_size}", flush=True)
        validate = lambda b, where: validate_batch(b, self.task.spec,  # noqa: E731
                                                   any_id=self.task.collection.any_id_features, where=where)
        share = {} if rows is None else {"rows": rows}
        jobs = stream_blocks(self.dataset.train_batches(batch_size, start, **share), lengths, validate,
                             backend.put_batch, start)
        workers = int(self.config.train.get("input_workers", 2))
        return BlockPrefetcher(jobs, workers=workers, depth=2 * workers)

    # ------------------------------------------------------------------------------------------------ start
    def start(self, resume: ResumePoint | None) -> None:
        """The initial (or restored) state and the compiled steps."""
        task, backend, batch_size = self.task, self.backend, self.budget.batch_size
        rows = backend.process_rows(batch_size)  # multi-host: this process's share
        eval_host = pad_batch(next(self.dataset.eval_batches(batch_size, "validation",
                                                             **({} if rows is None else {"rows": rows}))),
                              batch_size if rows is None else rows.stop - rows.start)
        if backend.describe():
            print(backend.describe(), flush=True)
        backend.save_plan(self.workdir)  # a mesh's sharding_plan.txt / .json, whatever its storages
        init = lambda batch: init_state(task, jax.random.key(self.config.seed), batch, backend)  # noqa: E731
        if resume and backend.restores_single_device:  # restored into: no need to initialise the tables
            like = jax.eval_shape(lambda b: init_state(task, jax.random.key(self.config.seed), b), eval_host)
            self.state = backend.place_state(self._restore_or_track(like, resume))
        else:  # the single-device initial state, laid out by the backend (a mesh: by the plan)
            self.state = self._restore_or_track(backend.place_state(init(eval_host)), resume)
        self.start_step = resume.step if resume else 0

        # Compile once, up front: the loop calls the executables (one step, and k steps a call), so no step pays for
        # compilation and the compile time and XLA's cost analysis come from exactly what runs. The train steps
        # compile for a validation batch's shapes: the same as a train batch's.
        t0 = time.perf_counter()
        self.example = backend.put_batch(eval_host)
        if self.steps_per_call > 1:  # k copies of it for the k-step call
            self.examples_k = backend.put_batch(stack([eval_host] * self.steps_per_call), stacked=True)
        self._compile()
        self.compile_time = time.perf_counter() - t0
        # XLA's cost analysis of a mesh step is per device, which sees batch_size / devices examples.
        per_device = batch_size // backend.shards
        self.forward_flops = flops_per_example(self.predict_step, per_device)
        self.train_flops = flops_per_example(self.train_step, per_device)
        accounting = task.collection.accounting(task.sparse_optimizer)
        self.dense_params = dense_param_count(self.state.dense_params)
        print(f"workdir: {self.workdir}\nembedding tables: {accounting['params']:,} params "
              f"({accounting['bytes'] / 2**20:.1f} MiB) + optimizer {accounting['optimizer_bytes'] / 2**20:.1f} MiB; "
              f"dense params: {self.dense_params:,}; {self.forward_flops:,.0f} FLOPs/example; "
              f"{self.steps_per_call} step{'s' if self.steps_per_call > 1 else ''} per call on "
              f"{jax.device_count()} x {jax.devices()[0].device_kind} ({jax.default_backend()})", flush=True)

        self.log = MetricLog(self.workdir, batch_size, self.budget.examples_per_epoch, self.loop.history,
                             task.objective.metrics)
        if self.dynamic is not None:
            self.loop.selection.selectable_from = self.dynamic.ramp_end(task.collection)
            if not self.dynamic.history:  # a resumed run restored its history
                self.dynamic.record(task.collection, task.sparse_optimizer, self.state, self.start_step)
            print(f"dynamic tables {', '.join(self.dynamic.features)}: budgets reached at step "
                  f"{self.loop.selection.selectable_from:,}; validation selects from there", flush=True)
        self.run_start = time.perf_counter() - self.loop.wall_time_before

    def _restore_or_track(self, like, resume: ResumePoint | None):
        """The checkpoint's state placed like `like` (and the loop state), else `like` with dirty-row bitmaps when
        the checkpoint policy writes deltas."""
        if not resume:
            return self.checkpointer.track(like) if self.checkpointer else like
        state, saved = self.checkpointer.restore(resume, like)
        where = resume.store.directory / str(resume.step)
        if resume.own:
            self.loop = LoopState.from_saved(saved, self.config)
        else:  # another run's checkpoint: selection, early stopping and history start here
            self.loop.restored_from = {"checkpoint": str(where), "step": resume.step}
        layout = resume.meta.get("layout")
        moved = "" if layout == self.checkpointer.layout else (
            f"; its tables re-laid out from {_describe_layout(layout)} to "
            f"{_describe_layout(self.checkpointer.layout)}")
        fresh = "" if resume.own else "; another run's checkpoint: selection and metrics history start anew"
        print(f"resuming from checkpoint step {resume.step:,} of {self.budget.steps:,} ({where}){moved}{fresh}",
              flush=True)
        return state

    def _compile(self) -> None:
        self.predict_step = make_predict_step(self.task, self.backend, self.state).lower(
            self.state, self.example).compile()
        self.train_step = make_train_step(self.task, self.backend, self.state).lower(self.state, self.example).compile()
        self.train_calls = {1: self.train_step}
        if self.steps_per_call > 1:
            self._executable(self.steps_per_call, self.examples_k, in_loop=False)
        multihost.barrier("recjax_steps_compiled")  # every process compiled: their first collectives run together

    def _executable(self, n: int, block, in_loop: bool = True):
        """The compiled call of `n` steps, compiled for `block` at its first use (in the loop: not training time)."""
        if n not in self.train_calls:
            t0, cpu = time.perf_counter(), time.process_time()
            self.train_calls[n] = make_train_step(self.task, self.backend, self.state, steps_per_call=n).lower(
                self.state, block).compile()
            compiling = time.perf_counter() - t0
            if in_loop:
                self.compile_time += compiling
                self.window_start += compiling
                self.window_cpu += time.process_time() - cpu
        return self.train_calls[n]

    # ------------------------------------------------------------------------------------------------- loop
    def train(self, calls) -> dict:
        """Train from the start step to the budget (or the early stop); return the summary. `calls` yields each call's
        (steps, block of batches on the device) (`input_pipeline`)."""
        budget, selection, batch_size = self.budget, self.loop.selection, self.budget.batch_size
        step = self.start_step
        last = step if selection.should_stop else budget.steps  # a run restored after its early stop trains no more
        bar = tqdm.tqdm(initial=step * batch_size, total=budget.steps * batch_size, unit="ex", unit_scale=True,
                        disable=not self.config.train.progress_bar, mininterval=1.0, dynamic_ncols=True)
        ready = next(calls) if step < last else None  # the first block, made while the steps compiled
        self.window_start, self.window_cpu, self.window_examples = time.perf_counter(), time.process_time(), 0
        in_flight = collections.deque()  # dispatched calls not known to be done (when the backend bounds them)
        diverged = None  # why the run stopped as diverged (summary.json "diverged")
        clock = self.clock
        while step < last:
            t0 = time.perf_counter()
            (n, block), ready = ready or next(calls), None
            t1 = time.perf_counter()
            compiling = self.compile_time
            step = self._call(step, n, block)
            clock["input_wait_s"] += t1 - t0
            clock["dispatch_s"] += time.perf_counter() - t1 - (self.compile_time - compiling)
            clock["calls"] += 1
            self.stop.step = step
            if self.backend.steps_in_flight is not None:
                # A mesh on XLA:CPU: hundreds of queued steps with collectives can deadlock (one device thread never
                # reaches an all-reduce; XLA aborts after 40 s), so at most `steps_in_flight` calls are queued.
                in_flight.append(self.window_losses[-1])
                if len(in_flight) > self.backend.steps_in_flight:
                    in_flight.popleft().block_until_ready()
            self.window_examples += n * batch_size
            if self.dynamic is not None and self.dynamic.due(self.task.collection, step):
                self._adjust(step)
            evaluate_now = budget.is_eval_step(step)
            if step % self.config.train.log_every == 0 or evaluate_now:
                diverged = self._log_train(step)
                if diverged is None and evaluate_now:
                    diverged = self._evaluate(step)
                if diverged is not None:
                    break
                postfix = {"loss": f"{self.loop.loss:.4f}"}
                if selection.best_validation:  # keep showing the best so far between evaluations
                    best = selection.best_validation[selection.select_on]
                    postfix["best_val"] = f"{best:.4f}@{selection.best_step}"
                bar.set_postfix(postfix)
                self.window_start, self.window_cpu, self.window_examples = time.perf_counter(), time.process_time(), 0
            bar.update(n * batch_size)
            if selection.should_stop:
                break
            # Due by the interval, or (`keep_selected`) because this step is the newly selected one: the export
            # then serves the model whose test metrics the summary reports, not the last step's.
            due = self.checkpointer is not None and step < budget.steps and (
                self.checkpointer.due(step) or (self.checkpointer.keep_selected and evaluate_now
                                                and selection.best_step == step))
            stopping = self.stop.requested and step < budget.steps  # read once: a later Ctrl-C stops after the next
            if due or (stopping and self.checkpointer):
                jax.block_until_ready(self.state)
                diverged = self._check_divergence(step)  # never checkpoint a diverged state
                if diverged is not None:
                    self.loop.train_time += time.perf_counter() - self.window_start
                    self.clock["cpu_s"] += time.process_time() - self.window_cpu
                    break
                self._save(step)
            if stopping:
                bar.close()
                self.log.close()
                raise interrupted(step, self.checkpointer)  # the save above finishes as the checkpointer closes
        bar.close()
        self.log.close()
        if diverged is not None:
            # Stop, and checkpoint nothing: a rerun resumes from the last checkpoint before it (and diverges again),
            # and --config.checkpoint.restore of that checkpoint with lower learning rates continues from a sane state.
            diverged += f"; {divergence_advice(self.config, self.state)}"
            print(f"ERROR: {diverged}", flush=True)
        elif self.checkpointer:
            self.state = self.checkpointer.save(step, self.state, self._loop_saved(), finished=True)
        self.backend.finish(self.state)  # e.g. a disk tier's final write-back: before the summary reads the memory
        stopped_early = step < budget.steps and diverged is None
        if selection.best_validation:
            print(f"selected step {selection.best_step:,} (best validation {selection.select_on} "
                  f"{selection.best_validation[selection.select_on]:.4f})"
                  + (f"; stopped early at step {step:,} after {selection.patience} evaluations without improvement"
                     if stopped_early else ""), flush=True)
        # Not kept in `selection`: a run resumed from its final checkpoint (saved above) computes it again.
        disagreement = selection.disagreement(float(self.config.train.selection_logloss_tolerance),
                                              float(self.config.train.selection_auc_tolerance))
        if disagreement:
            print(f"WARNING: {disagreement}", flush=True)
        late = self._selected_at_budget_end(diverged)
        if late:
            print(f"WARNING: {late}", flush=True)
        summary = self.summary(step, disagreement, diverged, late)
        if jax.process_index() == 0:  # multi-host: one summary
            (self.workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _selected_at_budget_end(self, diverged: str | None) -> str | None:
        """A warning when the selected step is the budget's last (after more than one evaluation): validation was
        still improving when the budget ended, so the run's figures understate what its config reaches."""
        selection, steps = self.loop.selection, self.budget.steps
        evaluations = sum(1 for row in self.log.history if row["split"] == "validation")
        if diverged is not None or selection.best_step != steps or evaluations < 2:
            return None
        key = "train.steps" if self.config.train.steps is not None else "train.epochs"
        return (f"the selected step {steps:,} is the last of the budget: validation {selection.select_on} was still "
                f"improving when the budget ended, so these test figures understate what this config reaches; raise "
                f"{key} (summary.json: selected_step = budget_steps)")

    def _call(self, step: int, n: int, block) -> int:
        """Dispatch the `n` steps after `step` as one compiled call; the step after them. Nothing is read from the
        device here: the losses stay there, in `window_losses`, until a log point."""
        self.state, metrics = self._executable(n, block)(self.state, block)
        self.window_losses.append(metrics["loss"])
        if step == 0:
            self.first_loss = metrics["loss"]
        return step + n

    def _adjust(self, step: int) -> None:
        """A dynamic table's adjustment (and compaction: new shapes, re-compiled steps); not training time."""
        dynamic = self.dynamic
        compiling = dynamic.timings["adjust_compile_s"] + dynamic.timings["recompile_s"]
        self.task, self.backend, self.state, recompile = dynamic.adjust_placed(self.task, self.backend, self.state,
                                                                               step)
        if self.checkpointer is not None:
            self.checkpointer.task = self.task  # a compaction re-sized the pools
        if recompile:  # a pool was compacted: new shapes (a mesh made a new plan for them)
            if self.checkpointer is not None:
                self.checkpointer.layout = self.backend.checkpoint_layout()
                self.checkpointer.relayout = self.backend.relayout()
            t0 = time.perf_counter()
            self._compile()  # and the k-step call again (`examples_k` keeps the batch's shapes)
            dynamic.timings["recompile_s"] += time.perf_counter() - t0
        # Compiling is not training time (as the first compile is not); nor its CPU time (a compile runs on one
        # thread: about its wall time).
        compiled = dynamic.timings["adjust_compile_s"] + dynamic.timings["recompile_s"] - compiling
        self.window_start += compiled
        self.window_cpu += compiled

    def _log_train(self, step: int) -> str | None:
        """The log point after `step`: the window's losses read at once (this waits for the device, so the window's
        time is real work), the last one logged, their mean checked for divergence (`_check_divergence`)."""
        diverged = self._check_divergence(step)
        elapsed = time.perf_counter() - self.window_start
        self.loop.train_time += elapsed
        self.clock["cpu_s"] += time.process_time() - self.window_cpu
        self.log.write({"step": step, "split": "train", "loss": self.loop.loss,
                        "examples_per_sec": self.window_examples / elapsed,
                        "elapsed_s": time.perf_counter() - self.run_start})
        return diverged

    def _score(self, split: str, step: int) -> dict:
        result = evaluate(self.task, self.predict_step, self.state, self.dataset, self.budget.batch_size, split,
                          self.backend)
        self.log.write({"step": step, "split": split, **{k: result[k] for k in self.task.objective.metrics},
                        "elapsed_s": time.perf_counter() - self.run_start})
        return result

    def _check_divergence(self, step: int) -> str | None:
        """Why training diverged, from the mean loss of the steps since the last check (`Divergence`), or None. Reads
        the window's losses (and step 1's) from the device in one transfer; the last is the logged train loss."""
        if not self.window_losses:  # checked at this step already
            return None
        t0 = time.perf_counter()
        window, first = jax.device_get((self.window_losses, self.first_loss))
        self.clock["sync_s"] += time.perf_counter() - t0
        self.window_losses.clear()
        losses = np.concatenate([np.ravel(x) for x in window])
        self.loop.loss = float(losses[-1])
        if first is not None:
            self.loop.divergence.start(float(np.ravel(first)[0]))
            self.first_loss = None  # started: step 1's loss is read once
        span = f"steps {step - len(losses) + 1:,}-{step:,}"
        reason = self.loop.divergence.check(float(np.mean(losses)), span)
        return None if reason is None else f"training diverged at step {step:,}: {reason}"

    def _evaluate(self, step: int) -> str | None:
        """Validation; the test split too when validation improved (test never steers selection). Why training
        diverged if the validation predictions are not finite, else None."""
        selection = self.loop.selection
        try:
            validation = self._score("validation", step)
        except FloatingPointError:  # non-finite predictions (evaluate)
            return f"training diverged at step {step:,}: its validation predictions are not finite"
        if not selection.record(step, validation):
            return None
        test = self._score("test", step)
        selection.record_test(step, test)
        if not np.isfinite(test.get("auc", 0.0)) and not self.loop.test_warned:
            self.loop.test_warned = True
            selection.warnings.append(
                f"the test split has one class only (click rate {test['eval_ctr']:g} over "
                f"{test['eval_examples']} examples): its AUC is undefined (NaN in the summary)")
            print(f"WARNING: {selection.warnings[-1]}", flush=True)
        return None

    def _loop_saved(self) -> dict:
        saved = self.loop.to_saved(self.log.history, time.perf_counter() - self.run_start)
        if self.dynamic is not None:
            saved["dynamic"] = self.dynamic.loop_state(self.task.collection)
        return saved

    def _save(self, step: int) -> None:
        jax.block_until_ready(self.state)
        saving, cpu = time.perf_counter(), time.process_time()
        self.state = self.checkpointer.save(step, self.state, self._loop_saved())
        self.window_start += time.perf_counter() - saving  # the save's stall is not training time
        self.window_cpu += time.process_time() - cpu

    # ---------------------------------------------------------------------------------------------- summary
    def summary(self, step: int, disagreement: str | None = None, diverged: str | None = None,
                late: str | None = None) -> dict:
        """What summary.json holds: the test split at the selected step (and at the other tracked metric's best
        step), the run's costs and sizes."""
        selection, budget, batch_size = self.loop.selection, self.budget, self.budget.batch_size
        objective = self.task.objective
        metrics, reported = objective.metrics, (*objective.metrics, *objective.extras)
        no_metrics = {k: math.nan for k in reported}  # diverged before an evaluation
        test = selection.test or no_metrics
        # The tables as they end (dynamic pools compacted to their budget).
        accounting = self.task.collection.accounting(self.task.sparse_optimizer)
        memory = self.backend.memory_bytes(self.task.sparse_optimizer)  # where this process holds them
        restored = self.loop.restored_from["step"] if self.loop.restored_from else 0
        return {
            # Headline metrics: the test split at the step with the best validation metric.
            **{k: test[k] for k in metrics},
            "test": {k: test[k] for k in reported},
            "validation": {k: (selection.best_validation or no_metrics)[k]
                           for k in reported},
            "last_validation": {k: (selection.last_validation or no_metrics)[k] for k in metrics},
            "selected_step": selection.best_step,
            "select_on": selection.select_on,
            # The best validation step of each tracked metric and the test split there (the headline is select_on's).
            "selection": {metric: {"step": best["step"], "validation": {k: best["validation"][k] for k in metrics},
                                   "test": {k: best["test"][k] for k in metrics}}
                          for metric, best in selection.by_metric.items()},
            "stopped_early": step < budget.steps and diverged is None,
            "diverged": diverged,  # None, or why training stopped: the loss diverged (the launcher exits with 3)
            "warnings": selection.warnings + [w for w in (disagreement, late) if w],
            "restored_from": self.loop.restored_from,
            **self.dataset.info(),
            "params": self.dense_params + accounting["params"],
            "dense_params": self.dense_params,
            "embedding_params": accounting["params"],
            "embedding_bytes": accounting["bytes"],
            "embedding_optimizer_bytes": accounting["optimizer_bytes"],
            # Of those (and a disk tier's caches), what this process holds in device memory and in host memory (a
            # disk tier's files count in neither): what the memory check compared with each memory.
            "embedding_device_bytes": memory.device,
            "embedding_host_bytes": memory.host,
            "compression_ratio": accounting["full_bytes"] / accounting["bytes"],
            "flops_per_example": self.forward_flops,
            "train_flops_per_example": self.train_flops,
            # Steps this run (and its resumes) trained: not those of a checkpoint.restore's run.
            "examples_per_sec": (step - restored) * batch_size / self.loop.train_time,
            # This process's loop: steps per call, calls, and where its train time went (waiting for input blocks,
            # dispatching calls, reading losses back at log points -- which waits for the device).
            "loop": {"steps_per_call": self.steps_per_call, **self.clock},
            "compile_time_s": self.compile_time,
            "train_time_s": self.loop.train_time,
            "wall_time_s": time.perf_counter() - self.run_start,
            "peak_rss_bytes": peak_rss_bytes(),
            **self.rss.summary(),  # its split: the process's own memory, file-backed pages (sampled peaks)
            "steps": step,
            "budget_steps": budget.steps,
            "batch_size": batch_size,
            "examples_per_epoch": budget.examples_per_epoch,
            "epochs": step * batch_size / budget.examples_per_epoch if budget.examples_per_epoch else None,
            "final_train_loss": self.loop.loss,
            "tables": accounting["tables"],
            # What embedding.kernel ran and why (recjax/kernel_choice.py: "auto" measured, cached or shipped).
            "embedding_kernel": self.task.collection.kernel_choice,
            **({} if self.dynamic is None else {"dynamic_tables": self.dynamic.summary()}),
            **self.backend.summary(),
        }


def _describe_layout(layout: dict | None) -> str:
    if layout is None:
        return "one device"
    return "mesh " + ",".join(f"{axis}={size}" for axis, size in layout["mesh_shape"].items())


def flops_per_example(compiled, batch_size: int) -> float:
    """FLOPs/example from XLA's cost analysis of a compiled step."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax returns one dict per device
        cost = cost[0]
    return float(cost.get("flops", float("nan"))) / batch_size


def dense_param_count(params) -> int:
    return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params)))


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
