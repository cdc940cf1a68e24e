"""One writer per output folder: an exclusive lock on `<out>/jaxpar.lock`. train holds it from before
the checkpoints are read until the run ends; prepare, bench, plan and export while they write.

The lock is the kernel's (flock), so it dies with its holder: a lock file left by a killed run is
stale, and the next run takes it over. The file names its holder (host, pid, start time) for the
one-line refusal a second run gets. Taking the lock is also the first write into --out, so an
--out that cannot be written (a read-only file system, which root's os.access does not see) is
found here, before anything is compiled.
"""

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Self

from jaxpar.core.errors import UserError
from jaxpar.core.removal import remove_if_empty

LOCK_NAME = "jaxpar.lock"


def holder_text(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on {holder['host']}, since {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet written its name"


class RunLock:
    """`with RunLock(out_dir):` holds the lock, or raises UserError naming its holder. On exit the
    lock file goes, and so do the folders this lock made, where nothing else was put."""

    def __init__(self, out_dir, flag: str = "--out"):
        self.out_dir, self.path, self.flag = Path(out_dir), Path(out_dir) / LOCK_NAME, flag
        self.created: list[Path] = []  # the folders this lock made, deepest first
        self.fd = None

    def __enter__(self) -> Self:
        try:
            missing = self.out_dir.absolute()
            while not missing.exists():
                self.created.append(missing)
                missing = missing.parent
            self.out_dir.mkdir(parents=True, exist_ok=True)
            while self.fd is None:
                self.fd = self._take()
            started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            os.ftruncate(self.fd, 0)
            os.write(self.fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                          "started": started}).encode())  # a full disk fails here
        except OSError as e:
            self.release()  # the lock file we made, and the folders, go
            reason = os.strerror(e.errno) if e.errno else str(e)
            raise UserError(f"{self.flag} '{self.out_dir}' cannot be written ({reason}); free space on that "
                            "disk, or pass a directory this user may write") from None
        return self

    def _take(self) -> int | None:
        """The locked file's descriptor; None when the file was replaced while we waited (try again)."""
        kind = "folder" if self.path.is_dir() and not self.path.is_symlink() else "symbolic link"
        if self.path.is_symlink() or self.path.is_dir():  # never written through, nor taken for a lock
            raise UserError(f"'{self.path}' is a {kind}, where jaxpar keeps its lock file; move it away, "
                            f"or pass another {self.flag}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise UserError(f"{self.flag} '{self.out_dir}' is in use by another jaxpar command "
                            f"({holder_text(self.path)}); wait for it to end, stop it, or pass another "
                            f"{self.flag}") from None
        try:  # the holder we waited on may have removed the file we locked: lock the new one
            same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return None
        return fd

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # before the unlock: a waiter then sees a new file
            os.close(self.fd)
            self.fd = None
        self._remove_dirs()

    def _remove_dirs(self) -> None:
        for folder in self.created:
            if not remove_if_empty(folder):  # not empty: the run wrote its outputs there
                return
