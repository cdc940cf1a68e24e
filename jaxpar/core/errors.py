"""User-facing errors: one line that names the problem and the fix, and exit code 2.

The file system's refusals (an OSError) are worded here too, with the path, the reason and its
code (`File name too long (ENAMETOOLONG)`) and the fix, by `os_error_message`."""

import argparse
import contextlib
import errno
import os
import re
import sys


class UserError(Exception):
    """Bad input from the user (config, mesh, data). Reported as one line, exit code 2."""


FIXES = {
    errno.ENAMETOOLONG: "pass a shorter path",
    errno.ELOOP: "its symbolic links lead round a circle; point them at a real file or folder",
    errno.ENOTDIR: "a part of it is a file, not a folder; pass a path through folders",
    errno.EISDIR: "it is a folder; pass a file",
    errno.EACCES: "this user may not use it; change its permissions, or pass another path",
    errno.EPERM: "this user may not use it; change its permissions, or pass another path",
    errno.EROFS: "its disk is read-only; pass a path on a writable disk",
    errno.ENOSPC: "free space on that disk, or pass a path on another",
    errno.EDQUOT: "free space within this user's quota, or pass a path on another disk",
    errno.ENOENT: "pass an existing path",
    errno.EEXIST: "move it away, or pass another path",
    errno.ENOTEMPTY: "empty it, or pass another path",
    errno.EXDEV: "pass a path on the same disk",
    errno.EIO: "the disk failed to read or write it; check the disk, or pass a path on another",
}


def reason(error: OSError) -> str:
    """`File name too long (ENAMETOOLONG)`: the system's words and the code's name."""
    name = errno.errorcode.get(error.errno or 0)
    words = os.strerror(error.errno) if error.errno else str(error)
    return f"{words} ({name})" if name else words


def os_error_message(error: OSError, flag: str | None = None) -> str:
    """One line for an OSError: the path it names (after `flag`, if given), the reason and the fix."""
    where = f"'{error.filename}'" if error.filename is not None else "a path"
    where = f"{flag} {where}" if flag else where
    fix = FIXES.get(error.errno, "check the path, or pass another")
    return f"{where}: {reason(error)}; {fix}"


@contextlib.contextmanager
def exit_on_user_error(prog: str = "jaxpar"):
    """Turn a UserError into `prog: error: message` on stderr and exit code 2; and so an OSError
    of the file system, in the words of `os_error_message`."""
    try:
        yield
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # the last net: a path the command's own checks could not foresee
        if e.filename is None and e.errno not in FIXES:
            raise
        print(f"{prog}: error: {os_error_message(e)}", file=sys.stderr)
        sys.exit(2)


@contextlib.contextmanager
def exit_on_interrupt(prog: str):
    """Ctrl-C as `prog: interrupted` and the shell's code for it (130), without a traceback. Not
    sys.exit: the interpreter's teardown while XLA still compiles can segfault (exit 139)."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)


@contextlib.contextmanager
def out_of_memory_as_user_error(fix: str):
    """XLA running out of device or host memory becomes a UserError: XLA's own words, then `fix`."""
    from jax.errors import JaxRuntimeError
    try:
        yield
    except JaxRuntimeError as e:
        found = re.search(r"out of memory[^.;\n]*", str(e), re.IGNORECASE)
        if not found:
            raise
        raise UserError(f"{found.group(0).lower()}; {fix}") from None


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are UserErrors: one line and exit 2, like every other bad input."""

    def error(self, message):
        raise UserError(f"{message}; see --help")
