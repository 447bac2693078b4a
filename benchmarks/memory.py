r"""Memory benchmark: a run's peak resident memory against the bytes `recjax.guards.check_memory` accounts for
(embedding tables + sparse optimizer state, + the host copy async checkpoints keep), to size its margin
(MEMORY_MARGIN, MEMORY_MARGIN_BYTES).

    python benchmarks/memory.py                       # 2 table sizes x 2 optimizers x 3 checkpoint modes (~10 min)
    python benchmarks/memory.py --rows 1000000 --dim 32 --optimizers lazy_adam --checkpoints async

Each case runs in a fresh process (peak RSS is per process): the synthetic DLRM with 4 one-hot features of
`rows / 4` ids each, `--steps` steps of batch 512, a checkpoint every `--steps / 2` steps (async, sync or none). One
JSON line per case: the accounted state bytes, the process's resident memory before `train_and_evaluate` (imports,
JAX's CPU runtime) and its peak after, `growth` = peak - before, and growth / state: what a run needs per byte of
tables and optimizer state, on top of a fixed part (the compiled steps, the data, the libraries' buffers) that the
small tables show.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run_case(rows: int, dim: int, optimizer: str, checkpoints: str, steps: int) -> dict:
    """One training run in this process; its memory figures."""
    sys.path.insert(0, str(REPO))
    from recjax import cli

    cli.tune_malloc()  # as the launcher runs
    cli.use_cpu_if_no_accelerator()
    import jax

    jax.devices()  # the runtime up before the baseline
    from experiments.configs.dlrm_synthetic import get_config
    from recjax.train import train_and_evaluate

    config = get_config()
    config.data.vocab_sizes = (rows // 4,) * 4
    config.data.eval_examples = 4096
    config.embedding.dim = dim
    config.model.dlrm.bottom_mlp = (64, dim)
    config.optimizer.sparse.name = optimizer
    config.train.steps = steps
    config.train.eval_every = steps
    config.train.progress_bar = False
    config.checkpoint.enabled = checkpoints != "none"
    config.checkpoint.async_save = checkpoints == "async"
    config.checkpoint.every_steps = max(steps // 2, 1)
    config.checkpoint.every_minutes = 0.0
    before = rss_bytes()
    with tempfile.TemporaryDirectory(prefix="recjax_memory_") as workdir:
        summary = train_and_evaluate(config, workdir)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    state = summary["embedding_bytes"] + summary["embedding_optimizer_bytes"]
    return {"benchmark": "memory", "rows": rows, "dim": dim, "optimizer": optimizer, "checkpoints": checkpoints,
            "steps": steps, "state_bytes": state, "rss_before": before, "peak_rss": peak, "growth": peak - before,
            "growth_over_state": round((peak - before) / state, 3),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="250000,1000000", help="comma-separated total rows (4 features)")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--optimizers", default="rowwise_adagrad,lazy_adam")
    parser.add_argument("--checkpoints", default="none,sync,async", help="none, sync and / or async saves")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = parser.parse_args()
    if args.case:
        rows, optimizer, checkpoints = args.case.split(":")
        print(json.dumps(run_case(int(rows), args.dim, optimizer, checkpoints, args.steps)), flush=True)
        return
    for rows in (int(r) for r in args.rows.split(",")):
        for optimizer in args.optimizers.split(","):
            for checkpoints in args.checkpoints.split(","):
                out = subprocess.run([sys.executable, __file__, f"--case={rows}:{optimizer}:{checkpoints}",
                                      f"--dim={args.dim}", f"--steps={args.steps}"], capture_output=True, text=True,
                                     cwd=REPO)
                if out.returncode:
                    raise SystemExit(f"case {rows}:{optimizer}:{checkpoints} failed:\n{out.stderr[-3000:]}")
                print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
