"""SIGTERM and SIGINT during a run: the first asks it to stop cleanly, a second to stop at once.

The handlers are installed when a run starts, before its data, checkpoints or compile, so a
signal at any moment is a request, never a traceback. The run looks at the request where
stopping is safe: after restoring, after compiling, after the first evaluation (each before any
step, so the run ends having saved nothing new) and after every step (it saves that step).

A second signal ends the process from its handler, in one line, with the shell's code for that
signal: no exception is raised through whatever library code the main thread is in (orbax would
log it as a failure). A save in flight is discarded (orbax writes into a temporary folder and
renames it at the end), so the newest complete checkpoint stays as it was; the run's lock is
released first.
"""

import os
import signal
import sys
import threading
from typing import Self

import jax
import numpy as np

SYNC_EVERY = 10  # steps between the processes' comparisons of their stop flags


class StopRequest:
    """The run's stop flag, set by SIGTERM and SIGINT (or by `ask`, as tests do). `prog` names the
    command in the line a second signal prints."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, prog: str = "jaxpar"):
        self.prog = prog
        self.signal_name: str | None = None
        self.before_forced_exit: list = []  # callables that must run even then (the lock's release)
        self._previous: dict = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():  # handlers only install there
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        return self

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            self.exit_at_once(signum)
        self.signal_name = name
        print(f"\n{self.prog}: {name}: stopping at the next safe point (a step ends and is saved); "
              f"send it again to stop at once, without saving", file=sys.stderr, flush=True)

    def exit_at_once(self, signum: int) -> None:
        for release in self.before_forced_exit:
            release()
        print(f"{self.prog}: stopped at once by a second {signal.Signals(signum).name}; a save in progress is "
              "discarded, and the newest complete checkpoint resumes", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + signum)  # without waiting for the writers' threads

    def ask(self, signal_name: str = "SIGTERM") -> None:
        self.signal_name = self.signal_name or signal_name

    def now(self) -> str | None:
        """The signal to stop on, agreed by every process (a collective: call it on all)."""
        if jax.process_count() == 1:
            return self.signal_name
        from jax.experimental import multihost_utils
        if not multihost_utils.process_allgather(np.int32(self.signal_name is not None)).any():
            return None
        return self.signal_name or "SIGTERM (on another process)"

    def agreed(self, updates: int) -> str | None:
        """The signal to stop on after `updates` steps, or None to go on.

        A save is collective, so every process must stop at the same step: with several, they
        compare their flags every SYNC_EVERY steps (a small all-gather), and stop if any has one.
        """
        if jax.process_count() > 1 and updates % SYNC_EVERY:
            return None
        return self.now()

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
