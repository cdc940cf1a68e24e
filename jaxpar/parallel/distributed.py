"""Multi-process runs on JAX's own runtime: `jax.distributed` from `--dist.*` flags or a cluster launch.

Must run before JAX initialises its backends. Each process then sees every process's devices.
"""

import contextlib
import os
import sys
import threading

import jax

from jaxpar.core.config import Config
from jaxpar.core.errors import UserError
from jaxpar.parallel.mesh import force_host_devices, requested_devices

# A process that stops sending heartbeats for this long counts as dead, and the survivors stop
# with an error instead of waiting in a collective forever. Well inside a minute, well above a
# long compile's pause (heartbeats come from a separate thread).
HEARTBEAT_TIMEOUT_S = 20
# XLA's own start-up timeout ends the process with a native abort (exit 134 and a C++ trace);
# jaxpar's watchdog ends it first, with one line, this long before.
WATCHDOG_LEAD_S = 30
SHUTDOWN_TIMEOUT_S = 30


def cluster_launch() -> bool:
    """True under `srun` or `mpirun` with several tasks: jax.distributed detects the rest itself."""
    return any(int(os.environ.get(var, "1")) > 1 for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))


def initialize(cfg: Config) -> None:
    """Join the other processes (if any) and give this one its share of forced CPU devices."""
    d = cfg.dist
    if d.num_processes == 1 and not cluster_launch():
        force_host_devices(cfg.mesh)
        return
    needed = requested_devices(cfg.mesh)
    if d.num_processes > 1 and needed and needed % d.num_processes:
        raise UserError(f"the mesh's {needed} devices do not split evenly over "
                        f"dist.num_processes={d.num_processes}")
    if d.num_processes > 1 and needed:
        force_host_devices(cfg.mesh, per_process=needed // d.num_processes)
    explicit = {"coordinator_address": d.coordinator, "num_processes": d.num_processes,
                "process_id": d.process_id} if d.num_processes > 1 else {}
    with start_up_watchdog(d):
        jax.distributed.initialize(**explicit, initialization_timeout=d.init_timeout + WATCHDOG_LEAD_S,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                                   shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)


@contextlib.contextmanager
def start_up_watchdog(d):
    """Exit with one line and code 2 if the processes have not all joined within dist.init_timeout
    seconds. A thread can say so: jax.distributed waits in native code, without the GIL."""
    joined = threading.Event()

    def watch():
        if joined.wait(d.init_timeout):
            return
        where = d.coordinator or "the cluster's coordinator"
        if launch_rank(d) == 0:
            what = (f"not every process joined within {d.init_timeout} s (process 0 waits at {where} for "
                    f"dist.num_processes={d.num_processes}); start the others with the same "
                    "--dist.coordinator and their own --dist.process_id")
        else:
            what = (f"process {launch_rank(d)} could not join process 0 at {where} within {d.init_timeout} s; "
                    "start process 0 (dist.process_id=0) there")
        print(f"jaxpar.train: error: {what}, or raise --dist.init_timeout", file=sys.stderr, flush=True)
        os._exit(2)

    threading.Thread(target=watch, name="jaxpar-start-up-watchdog", daemon=True).start()
    try:
        yield
    finally:
        joined.set()


def launch_rank(d) -> int:
    """This process's id, from --dist.process_id or the cluster launcher's environment."""
    if d.num_processes > 1:
        return d.process_id
    return int(os.environ.get("SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def is_main_process() -> bool:
    """Process 0 prints the progress bar and writes the run's files."""
    return jax.process_index() == 0


@contextlib.contextmanager
def exit_if_a_peer_fails(prog: str):
    """With several processes, a runtime error (a peer died: its collectives fail) ends this one
    with one line and exit code 1, at once: a normal exit would wait at the distributed shutdown
    barrier for the dead peer and then abort with a long trace."""
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        if jax.process_count() == 1:
            raise
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"{prog}: error: process {jax.process_index()} of {jax.process_count()} stopped: "
              f"{first_line}; another process probably died, see its log", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
