"""Multi-host runs through `jax.distributed` (no home-made cluster code).

The launcher passes `--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (or the environment
variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); `initialize` must run before JAX's first
use. Then `jax.devices()` lists every process's devices and the mesh spans them all. Each process reads only its
devices' rows of every global batch (`step.process_rows`: rows [i B/n, (i+1) B/n) for process i of n; the readers'
`rows=` argument), so the global batch is the single-process one whatever the number of processes, and the
processes' shares make the global arrays (`jax.make_array_from_process_local_data` in `step.put_batch`). The loss
and the dense gradients are psum'ed inside the step; evaluation reads each process's share of every validation /
test batch and gathers every process's predictions and labels (each row once); only process 0 writes the
workdir's summary (the others log under `workdir/process_<i>/`).
"""

import os

import jax
from jax._src import distributed  # the coordination-service client: its barrier is the only one with a timeout

from recjax.errors import ConfigError

ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join the cluster if any of the three is given (flags first, then the environment); False if none is.

    A partial set is a ConfigError naming what is missing, before JAX starts.
    """
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    for key, env in ENV.items():
        if given[key] is None and os.environ.get(env):
            given[key] = os.environ[env]
    if all(v is None for v in given.values()):
        return False
    missing = [k for k, v in given.items() if v is None]
    if missing:
        set_ = [f"--{k}" for k, v in given.items() if v is not None]
        raise ConfigError(f"--{missing[0]}", f"multi-host needs --coordinator_address, --num_processes and "
                                             f"--process_id together (or {', '.join(ENV.values())}); got "
                                             f"{', '.join(set_)} without {', '.join('--' + m for m in missing)}")
    try:
        num, index = int(given["num_processes"]), int(given["process_id"])
    except ValueError as error:
        raise ConfigError("--num_processes", f"--num_processes and --process_id must be whole numbers: {error}"
                          ) from None
    if num < 1:
        raise ConfigError("--num_processes", f"must be >= 1, got {num}")
    if not 0 <= index < num:
        raise ConfigError("--process_id", f"must be in [0, {num}) for --num_processes={num}, got {index}")
    if ":" not in str(given["coordinator_address"]):
        raise ConfigError("--coordinator_address", f"must be HOST:PORT, got {given['coordinator_address']!r}")
    # CPU devices of different processes talk through gloo (jax's default CPU collectives are in-process only).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(str(given["coordinator_address"]), num, index)
    return True


# Long enough for the slowest process's compiles on a loaded machine; a process that died ends the wait sooner (the
# coordination service reports it).
BARRIER_TIMEOUT_S = 3600


def barrier(name: str) -> None:
    """Wait until every process reaches `name`; nothing for a single process.

    Gloo opens its connections at the first collective each process runs, and gives a peer only 30 s to arrive
    (a limit JAX does not expose). Compiling the steps can take one process far longer than the other on a loaded
    machine, so the processes meet here, through the coordination service, before their first collective.
    """
    if jax.process_count() > 1:
        distributed.global_state.client.wait_at_barrier(name, BARRIER_TIMEOUT_S * 1000)
