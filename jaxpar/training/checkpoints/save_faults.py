"""Saves that cannot happen: a checkpoints folder that cannot be written, or a disk without room.

Before the compile, and again before each save, a run proves that the folder takes a new entry (a
directory made and removed: root's os.access does not see a read-only mount) and that the disk
has room for one more checkpoint: its arrays' bytes, which orbax writes uncompressed, plus their
metadata. The save before a full disk or a folder turned read-only is then refused before orbax
starts, and nothing is left half-written.

What still fails inside orbax's background threads (the disk fills while a save writes) comes
back from its wait as one SaveFailed: the failed step's temporary folder is removed, the newest
complete checkpoint is named, and orbax's own tracebacks are kept out of the terminal. Orbax's
other threads then wait minutes for signals that will never come, so the command ends the
process at once after its one line (`SaveFailed.stuck`).
"""

import errno
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path

from jaxpar.core.errors import UserError
from jaxpar.core.removal import remove_tree

TEMPORARY = ".orbax-checkpoint-tmp"  # orbax's suffix for a save in flight
REASONS = ("No space left on device", "Read-only file system", "Permission denied", "Disk quota exceeded")


class SaveFailed(UserError):
    """A checkpoint could not be saved; `stuck`: orbax's threads are left waiting (exit at once,
    after `settle`)."""

    def __init__(self, message: str, directory: Path, step: int, stuck: bool = False):
        super().__init__(message)
        self.directory, self.step, self.stuck = directory, step, stuck

    def settle(self, tries: int = 20, pause_s: float = 0.1) -> None:
        """Remove the failed save's temporary folder until it stays gone: writes still in flight in
        orbax's threads may make it again for a moment."""
        for _ in range(tries):
            failed = remove_temporaries(self.directory, self.step)
            time.sleep(pause_s)
            if not any(self.directory.glob(f"{self.step}{TEMPORARY}*")):
                return
        for why in failed or [f"its temporary folder in '{self.directory}' came back while orbax's threads wrote"]:
            print(f"jaxpar: warning: the failed save {self.step} is left half-written: {why}", file=sys.stderr)


def reason(error: BaseException) -> str:
    """The cause in a few words: the OS's name for it where there is one."""
    if isinstance(error, OSError) and error.errno:
        return os.strerror(error.errno)
    text = " ".join(str(error).split())
    for known in REASONS:
        if known.lower() in text.lower():
            return known
    return f"{type(error).__name__}: {text[:150]}"


def nearest_existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def check_room(directory: Path, nbytes: int) -> None:
    """Raise OSError unless a folder can be made in `directory` (or the nearest folder above it that
    exists) and its disk has `nbytes` free."""
    where = nearest_existing(directory.absolute())
    probe = where / f".jaxpar-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    probe.rmdir()
    free = shutil.disk_usage(where).free
    if free < nbytes:
        raise NoRoom(errno.ENOSPC, f"{free / 2**20:,.1f} MiB free of the {nbytes / 2**20:,.1f} MiB a "
                                   "checkpoint needs")


class NoRoom(OSError):
    """check_room's own finding: the disk's free bytes against a checkpoint's."""


def room_message(error: OSError) -> str:
    """Why check_room failed: the figures where it measured them, else the OS's words."""
    return f"No space left on device: {error.strerror}" if isinstance(error, NoRoom) else reason(error)


def remove_temporaries(directory: Path, step: int) -> list[str]:
    """Remove orbax's temporary folder of `step` (left by a failed save), and nothing else; returns
    why each one that could not be removed stays."""
    failed = []
    if directory.is_dir():
        for path in directory.glob(f"{step}{TEMPORARY}*"):
            try:
                remove_tree(path, missing_ok=True)
            except UserError as e:
                failed.append(str(e))
    return failed


class OrbaxErrors(logging.Filter):
    """Orbax's error records (with their tracebacks) stay out of the terminal: a failed save is
    reported once, as a SaveFailed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


def quiet_orbax_errors() -> None:
    """From the first save on: orbax's threads may log after the run has reported and ended, and
    tensorstore's callbacks into a failed save's closed event loop raise where nothing catches."""
    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, OrbaxErrors) for f in absl_logger.filters):
        absl_logger.addFilter(OrbaxErrors())
    if not isinstance(sys.unraisablehook, ClosedLoopCallbacks):
        sys.unraisablehook = ClosedLoopCallbacks(sys.unraisablehook)


class ClosedLoopCallbacks:
    """sys.unraisablehook, less the 'Event loop is closed' of a failed save's callbacks."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            self.previous(unraisable)


def newest_step(directory: Path, before: int | None = None) -> int | None:
    steps = [int(p.name) for p in directory.iterdir() if re.fullmatch(r"\d+", p.name)] if directory.is_dir() else []
    steps = [s for s in steps if before is None or s < before]
    return max(steps) if steps else None


def save_failed(directory: Path, step: int, why: str, stuck: bool = False) -> SaveFailed:
    """The one line for a save that failed: what failed, the checkpoint that resumes, the fix."""
    left = "".join(f"; {failed}" for failed in remove_temporaries(directory, step))
    last = newest_step(directory, before=step)
    kept = f"the last good checkpoint is {directory / str(last)}" if last is not None else "no checkpoint was saved"
    return SaveFailed(f"cannot save checkpoint {step} in '{directory}' ({why}); {kept}; free space on that "
                      f"disk or make the folder writable, then run the same command to resume{left}", directory,
                      step, stuck)
