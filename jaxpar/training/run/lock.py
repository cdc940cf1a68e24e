"""One run per --out across processes: process 0 holds `<out>/jaxpar.lock` (jaxpar.core.out_lock)
for the whole run, and every process stops if it cannot be had."""

import contextlib

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.core.out_lock import RunLock


@contextlib.contextmanager
def locked(out_dir):
    """Process 0 holds out_dir's lock for the whole run (it yields the RunLock, the others None);
    every process stops with a UserError if it cannot be had (a collective when there are several)."""
    import jax

    from jaxpar.parallel.distributed import is_main_process
    with contextlib.ExitStack() as held:
        refused, lock = None, None
        if is_main_process():
            try:
                lock = held.enter_context(RunLock(out_dir))
            except UserError as error:
                refused = error
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            if multihost_utils.process_allgather(np.int32(refused is not None)).any() and refused is None:
                refused = UserError(f"process 0 could not lock --out '{out_dir}'; see its message")
        if refused is not None:
            raise refused
        yield lock
