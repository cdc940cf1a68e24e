"""Removing what jaxpar wrote, and saying so when it cannot: no removal's error is ever ignored.

A symbolic link is removed as a link: its target, which jaxpar did not make, is never touched.
"""

import os
import shutil
from pathlib import Path

from jaxpar.core.errors import UserError


def cannot_remove(path: Path, error: OSError) -> UserError:
    where = error.filename if getattr(error, "filename", None) else path
    why = os.strerror(error.errno) if error.errno else str(error)
    return UserError(f"cannot remove '{where}' ({why}); make its folder writable, or remove it by hand, "
                     "then run the same command again")


def remove_tree(path: Path, missing_ok: bool = False) -> None:
    """Remove the file, link or folder at `path` (a folder with all it holds); a UserError if any
    part of it cannot be removed."""
    path = Path(path)
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        if not missing_ok:
            raise cannot_remove(path, FileNotFoundError(2, "No such file or directory")) from None
    except OSError as e:
        raise cannot_remove(path, e) from None


def remove_if_empty(folder: Path) -> bool:
    """Remove `folder` if it holds nothing; whether it did. A folder that holds something stays;
    any other failure is a UserError."""
    try:
        folder.rmdir()
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        if Path(folder).is_dir() and any(Path(folder).iterdir()):
            return False
        raise cannot_remove(Path(folder), e) from None
