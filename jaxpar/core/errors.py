"""User-facing errors: one line that names the problem and the fix, and exit code 2."""

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path


class UserError(Exception):
    """Bad input from the user (config, mesh, data). Reported as one line, exit code 2."""


@contextlib.contextmanager
def exit_on_user_error(prog: str = "jaxpar"):
    """Turn a UserError into `prog: error: message` on stderr and exit code 2."""
    try:
        yield
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
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


def check_output_dir(path: Path, flag: str = "--out") -> None:
    """A UserError unless `path` is a directory, or one that mkdir can make, that we may write."""
    existing = path
    while not existing.exists():  # mkdir(parents=True) starts from the nearest existing ancestor
        existing = existing.parent
    if not existing.is_dir():
        inside = "" if existing == path else f" is inside '{existing}', which"
        raise UserError(f"{flag} '{path}'{inside} is a file, not a directory; pass a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} '{path}' cannot be written: this user may not write in "
                        f"'{existing}'; pass another directory")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are UserErrors: one line and exit 2, like every other bad input."""

    def error(self, message):
        raise UserError(f"{message}; see --help")
