r"""Kill training with SIGKILL at random moments (during steps and during checkpoint saves), resume it, and compare
the final state with an uninterrupted run's. Used by tests/test_checkpoint_crash.py and benchmarks/checkpoint.py.

    python tests/crash_driver.py --workdir=/tmp/crash --trials=10 --seed=0
    python tests/crash_driver.py --workdir=/tmp/crash --trials=4 --disk   # the killed runs' large tables on disk

One process imports everything once and forks a fresh child per run (JAX's backend is initialised only in the
children, so the fork is safe): the uninterrupted reference, then chains of runs killed again and again in one
workdir (each child resumes from what the last one left), the last child of each chain running to the end. Prints
one JSON line per kill and per chain, then a line with the totals.
"""

import argparse
import json
import os
import pathlib
import signal
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def tiny_config(policy: str, every_steps: int):
    from experiments.configs.dlrm_synthetic import get_config

    config = get_config()
    config.data.vocab_sizes = (200, 50, 1000, 8, 3000, 20)
    config.data.eval_examples = 512
    config.embedding.dim = 8
    config.model.dlrm.bottom_mlp = (16, 8)
    config.model.dlrm.top_mlp = (16, 1)
    config.model.dlrm.dropout = 0.1
    config.train.batch_size = 64
    config.train.steps = 40
    config.train.eval_every = 10
    config.train.log_every = 5
    config.train.progress_bar = False
    config.checkpoint.every_steps = every_steps
    config.checkpoint.policy = policy
    config.checkpoint.keep = 2
    return config


def on_disk(config, tables: pathlib.Path):
    """`config` with C3 (1000 rows) and C5 (3000) on the disk tier, their files in `tables`, behind a cache of 200
    rows (a step reads up to 128 of them: most steps evict)."""
    config = config.copy_and_resolve_references()
    config.tiering.tables = "C3=disk,C5=disk"
    config.tiering.cache_rows = 200
    config.tiering.dir = str(tables)
    return config


def run_child(config, workdir: pathlib.Path, log: pathlib.Path) -> int:
    """Fork a child that trains `config` in `workdir` (stdout / stderr to `log`); its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        from recjax.train import train_and_evaluate

        train_and_evaluate(config, workdir)
        code = 0
    except BaseException as error:  # noqa: BLE001 -- reported through the exit status and the log
        print(f"child failed: {type(error).__name__}: {error}", flush=True)
    finally:
        sys.stdout.flush()
        os._exit(code)


_REAPED: dict[int, int] = {}  # exit codes of children reaped while polling


def wait(pid: int) -> int:
    if pid in _REAPED:
        return _REAPED.pop(pid)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def wait_for(directory: pathlib.Path, step: int, mid_save: bool, pid: int) -> str:
    """Poll until the save of `step` started (`mid_save`) or completed, or the child ended; what was seen. No time
    limit: the child always ends (it trains a fixed budget), and a loaded machine only makes this take longer."""
    while True:
        if (directory / str(step)).exists():
            return f"after save {step}"
        if mid_save and any(directory.glob(f"{step}.orbax-checkpoint-tmp*")):
            return f"during save {step}"
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _REAPED[pid] = os.waitstatus_to_exitcode(status)
            return "ended before the kill"
        time.sleep(0.002)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--trials", type=int, default=10, help="kills in all")
    parser.add_argument("--kills_per_chain", type=int, default=5, help="kills of one run before it may finish")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="consecutive", help="checkpoint.policy of the runs")
    parser.add_argument("--every_steps", type=int, default=3)
    parser.add_argument("--disk", action="store_true", help="the killed runs put two tables on the disk tier (the "
                                                           "reference keeps them in memory)")
    args = parser.parse_args()
    root = pathlib.Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    # Children share compiled executables through the persistent cache, so each compiles once per program.
    jax.config.update("jax_compilation_cache_dir", str(root / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    import recjax.train  # noqa: F401 -- imported once, before any fork
    from recjax import checkpoint

    config = tiny_config(args.policy, args.every_steps)
    rng = __import__("random").Random(args.seed)

    t0 = time.perf_counter()
    code = wait(run_child(config, root / "reference", root / "reference.log"))
    assert code == 0, (root / "reference.log").read_text()
    duration = time.perf_counter() - t0
    steps = list(range(args.every_steps, config.train.steps, args.every_steps))
    chains, kills = [], []
    for chain in range(-(-args.trials // args.kills_per_chain)):
        # One workdir killed again and again: each child resumes from the last complete checkpoint and is killed at a
        # later save, as soon as the save starts (its tmp dir appears: mid-save) or a random 0-50 ms after it
        # completed (mid-steps); the last child runs to the end.
        workdir = root / f"chain{chain}"
        chain_config = on_disk(config, workdir / "tables") if args.disk else config
        n = min(args.kills_per_chain, args.trials - len(kills))
        for i, target in enumerate(sorted(rng.sample(steps, n))):
            mid_save = (len(kills) + i) % 2 == 0
            log = root / f"chain{chain}.{i}.log"
            ckpt = workdir / "checkpoints"
            before = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []
            pid = run_child(chain_config, workdir, log)
            seen = wait_for(ckpt, target, mid_save, pid)
            if not mid_save:
                time.sleep(rng.uniform(0.0, 0.05))
            os.kill(pid, signal.SIGKILL)
            code = wait(pid)
            partial = sorted(p.name for p in ckpt.glob("*.orbax-checkpoint-tmp*")) if ckpt.exists() else []
            text = log.read_text()
            resumed = int(text.split("resuming from checkpoint step ")[1].split(" ")[0].replace(",", "")) if (
                "resuming from checkpoint step" in text) else 0
            kills.append({"chain": chain, "kill": i, "target": seen, "killed": code == -signal.SIGKILL,
                          "killed_during_save": bool(partial), "partial": partial,
                          # the child started from the newest complete checkpoint the previous one left
                          "resumed_from": resumed, "resumed_from_latest": resumed == (before[-1] if before else 0)})
        final_log = root / f"chain{chain}.final.log"
        chains.append({"chain": chain, "finished": wait(run_child(chain_config, workdir, final_log)) == 0})
    # The parent initialises JAX only now, after the last fork.
    reference = checkpoint.read_arrays(checkpoint.open_checkpoint(root / "reference" / "checkpoints"))
    summary_ref = json.loads((root / "reference" / "summary.json").read_text())
    timing = {"examples_per_sec", "compile_time_s", "train_time_s", "wall_time_s", "peak_rss_bytes",
              "peak_rss_anon_bytes", "peak_rss_file_bytes", "loop"}
    if args.disk:  # the tier's own: its summary section, XLA's FLOPs of its step (which maps rows to cache slots),
        # and its bytes in device memory (a cache instead of the disk tables)
        timing |= {"tiering", "flops_per_example", "train_flops_per_example", "embedding_device_bytes"}
    for c in chains:
        workdir = root / f"chain{c['chain']}"
        same = c["finished"]
        if same:
            import numpy as np

            final = checkpoint.read_arrays(checkpoint.open_checkpoint(workdir / "checkpoints"))
            same = sorted(final) == sorted(reference) and all(
                final[k].dtype == reference[k].dtype and np.array_equal(final[k], reference[k]) for k in reference)
            summary = json.loads((workdir / "summary.json").read_text())
            same = same and {k: v for k, v in summary.items() if k not in timing} == {
                k: v for k, v in summary_ref.items() if k not in timing}
        c["identical"] = bool(same)
    for k in kills:
        print(json.dumps(k), flush=True)
    for c in chains:
        print(json.dumps(c), flush=True)
    print(json.dumps({"kills": len(kills), "killed": sum(k["killed"] for k in kills),
                      "killed_during_save": sum(k["killed_during_save"] for k in kills),
                      "resumed_from_latest": sum(k["resumed_from_latest"] for k in kills),
                      "chains": len(chains), "identical": sum(c["identical"] for c in chains),
                      "reference_run_s": round(duration, 3), "total_s": round(time.perf_counter() - t0, 3)}),
          flush=True)


if __name__ == "__main__":
    main()
