"""Paths from the user, checked before any work, and the file system's refusals in one line.

Every path a command takes (its flags, its config's path keys, its inputs) goes through `checked`
before anything is read or written: a name the file system refuses (a component over its length
limit, links round a circle, no permission) is a UserError that
names the path and the reason (`File name too long (ENAMETOOLONG)`), so the command exits 2 with
nothing half-written. A missing path passes: the command says what it needs there.

An output folder goes through `output_folder`, which also follows a symbolic link to the folder it
names: the command works in that folder and leaves the link as it is, on its first run and every
run after. A link to nothing is refused.

An OSError that still escapes a command (a disk that fills while it writes) is worded the same
way by `errors.exit_on_user_error`, the last net.
"""

import errno
import os
from pathlib import Path

from jaxpar.core.errors import FIXES, UserError, os_error_message, reason

PATH_MAX = 4096  # Linux's, in bytes, with the final NUL


def path_error(flag: str, path, code: int, why: str = "") -> UserError:
    """os_error_message's line for `code` at `path`, `why` said after the reason."""
    error = OSError(code, os.strerror(code), str(path))
    return UserError(f"{flag} '{path}': {reason(error)}{why}; {FIXES[code]}")


def nearest_existing(path: Path) -> Path:
    """`path` itself, or the closest of its ancestors that exists (a link counts as existing)."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def name_max(folder: Path) -> int:
    """The longest name, in bytes, that the file system holding `folder` takes."""
    try:
        return os.pathconf(folder if folder.is_dir() else folder.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def checked(path, flag: str, spare: int = 0) -> Path:
    """`path` as a Path, once the file system would take its name, and a name `spare` bytes longer
    beside it (the partial file or the lock a command derives from it); a UserError naming it and
    the reason otherwise. Nothing is made or changed."""
    path = Path(path)
    if (size := len(os.fsencode(str(path)))) >= PATH_MAX:
        raise path_error(flag, path, errno.ENAMETOOLONG, f": {size:,} bytes, where a path takes {PATH_MAX - 1:,}")
    limit = name_max(nearest_existing(path.absolute()))
    if longest := max((len(os.fsencode(part)) for part in path.parts if len(os.fsencode(part)) > limit), default=0):
        raise path_error(flag, path, errno.ENAMETOOLONG, f": a name in it has {longest} bytes, where this file "
                         f"system takes {limit}")
    if spare and len(os.fsencode(path.name)) + spare > limit:
        raise path_error(flag, path, errno.ENAMETOOLONG, f": its name has {len(os.fsencode(path.name))} bytes, "
                         f"and jaxpar writes a name {spare} bytes longer beside it, where this file system takes {limit}")
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        pass  # missing, a link to nothing, or below a file: the command says what it needs there
    except OSError as e:
        raise UserError(os_error_message(e, flag)) from None
    return path


def given(flag: str):
    """An argparse `type` for a path flag: the text, once `checked`."""
    def check(text: str) -> str:
        checked(text, flag)
        return text
    check.__name__ = "path"  # argparse names the type in its own messages
    return check


def output_folder(path, flag: str = "--out", spare: int = 0) -> Path:
    """The folder a command writes, checked as `check_output_dir` checks it (and `checked` with
    `spare`). A symbolic link gives the folder it names, so the command works through the link and
    keeps it; a link to nothing is refused."""
    path = checked(path, flag, spare)
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if not target.is_dir():
            what = "a file" if target.exists() else "nothing"
            raise UserError(f"{flag} '{path}' is a symbolic link to '{target}', which is {what}; make that "
                            f"folder, or pass another {flag}")
        path = target
    check_output_dir(path, flag)
    return checked(path, flag, spare)  # the folder a link names must leave room too


def check_output_dir(path: Path, flag: str = "--out") -> None:
    """A UserError unless `path` is a directory, or one that mkdir can make, that we may write."""
    checked(path, flag)
    existing = nearest_existing(path)
    if existing.is_symlink() and not existing.exists():
        raise UserError(f"{flag} '{path}' is inside '{existing}', a symbolic link to nothing; make the folder "
                        f"it names, or pass another {flag}")
    if not existing.is_dir():
        inside = "" if existing == path else f" is inside '{existing}', which"
        raise UserError(f"{flag} '{path}'{inside} is a file, not a directory; pass a directory")
    check_writable(existing, path, flag)


def check_writable(folder: Path, path: Path, flag: str) -> None:
    """A UserError unless this user may make files in `folder` (where `path` goes): its disk
    read-only and its permissions are told apart."""
    if os.access(folder, os.W_OK | os.X_OK):
        return
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = (f"'{folder}' is on a read-only disk (EROFS)" if read_only else
           f"this user may not write in '{folder}'")
    raise UserError(f"{flag} '{path}' cannot be written: {why}; pass another directory")
