"""What jaxpar wrote in a folder, recorded there, so that it removes or overwrites only that.

A command names the outputs it may write in a folder, each a file or a folder, before any work
(`Outputs.check`). A name that already exists is jaxpar's only if the folder's record
(`.jaxpar-written.json`) lists it. Anything else in its place is refused in one line, before the
compile, and left as it was: a user's file, a folder where a file goes (or the reverse), a
symbolic link. Names are recorded before they are made (`claim`), so a command killed between
the two leaves a record naming a file that is not there, which is harmless.

Runs written before the record existed are recognised by their run.json, which only jaxpar.train
writes (it names jaxpar's version): the run's usual outputs beside it are adopted as jaxpar's.
"""

import json
import os
from pathlib import Path

from jaxpar.core.errors import UserError

RECORD = ".jaxpar-written.json"
FILE, FOLDER = "file", "folder"


def kind_of(path: Path) -> str | None:
    """FILE, FOLDER, "symbolic link", "special file" or None (nothing there); never follows a link."""
    if path.is_symlink():
        return "symbolic link"
    if not path.exists():
        return None
    return FOLDER if path.is_dir() else FILE if path.is_file() else "special file"


def read_record(folder: Path) -> set[str]:
    """The names the record lists: only plain names, never a path elsewhere; none where it does not read."""
    try:
        names = json.loads((folder / RECORD).read_text())["written"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    if not isinstance(names, list):
        return set()
    return {n for n in names if isinstance(n, str) and os.path.basename(n) == n and n not in ("", ".", "..")}


class Outputs:
    """The outputs a command may write in `folder`: {name: FILE or FOLDER}. `legacy`: a file whose
    presence, as `is_legacy(path)` judges it, marks a folder written before the record."""

    def __init__(self, folder, names: dict[str, str], flag: str = "--out", legacy=None):
        self.folder, self.names, self.flag, self.legacy = Path(folder), dict(names), flag, legacy

    def recorded(self) -> set[str]:
        names = read_record(self.folder)
        mark = self.folder / self.legacy[0] if self.legacy else None
        if not names and mark is not None and kind_of(mark) == FILE and self.legacy[1](mark):
            names = {n for n in self.names if kind_of(self.folder / n) == self.names[n]}
        return names

    def check(self) -> None:
        """A UserError for the first output whose path holds what jaxpar did not write, or the wrong
        kind of thing; nothing is changed."""
        record = kind_of(self.folder / RECORD)
        if record not in (None, FILE):
            raise UserError(f"'{self.folder / RECORD}' is a {record}, where jaxpar keeps the record of "
                            f"what it wrote; move it away, or pass another {self.flag}")
        ours = self.recorded()
        for name, kind in self.names.items():
            path, found = self.folder / name, kind_of(self.folder / name)
            if found is None:
                continue
            if found != kind:
                raise UserError(f"'{path}' is a {found}, where jaxpar writes a {kind}; move it away, "
                                f"or pass another {self.flag}")
            if name not in ours:
                raise UserError(f"'{path}' was not written by jaxpar, which would overwrite it; move it "
                                f"away, or pass another {self.flag}")

    def claim(self, *names: str) -> None:
        """Record `names` as jaxpar's, before they are written."""
        assert set(names) <= set(self.names), f"{names} are not among the outputs {sorted(self.names)}"
        self._write_record(self.recorded() | set(names))

    def release(self, *names: str) -> None:
        """Remove `names` (files or folders) that jaxpar wrote, and their lines of the record; the
        record itself goes when it lists nothing more. A removal that fails is a UserError."""
        from jaxpar.core.removal import remove_tree
        ours = self.recorded()
        for name in names:
            if name in ours and kind_of(self.folder / name) == self.names[name]:
                remove_tree(self.folder / name)
        left = ours - set(names)
        if left:
            self._write_record(left)
        else:
            remove_tree(self.folder / RECORD, missing_ok=True)

    def _write_record(self, names: set[str]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / (RECORD + ".tmp")
        partial.write_text(json.dumps({"written_by": "jaxpar", "written": sorted(names)}, indent=1) + "\n")
        os.replace(partial, self.folder / RECORD)


def replace_text(path: Path, text: str, partial_suffix: str = ".partial") -> None:
    """Write `path` whole or not at all: the text goes to a partial file, renamed over `path` once
    complete, so an interrupted or failed write leaves `path` as it was (and the partial removed)."""
    partial = path.with_name(path.name + partial_suffix)
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)  # gone already, unless the write failed
