"""The named configs and TOML files: where `--config NAME` is found, a file read into its
tables, and a value, from a file or the command line, as its key's type; each problem one line
(not UTF-8, not readable, not TOML, a value of the wrong kind)."""

import math
import os
import tomllib
from pathlib import Path

from jaxpar.core.errors import UserError

# The named configs: installed inside the package (pyproject maps configs/ to jaxpar/configs), or
# the repository's top-level configs/ in an editable install.
_PACKAGE = Path(__file__).resolve().parent.parent  # jaxpar/
CONFIG_DIR = next((d for d in (_PACKAGE / "configs", _PACKAGE.parent / "configs") if d.is_dir()),
                  _PACKAGE / "configs")


def resolve_config_path(name_or_path: str) -> Path:
    """A path to a TOML file, or the name of one in configs/ (with or without .toml)."""
    path = Path(name_or_path)
    candidates = [path, CONFIG_DIR / path.name, CONFIG_DIR / f"{path.name}.toml"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if path.is_dir():
        raise UserError(f"config file '{name_or_path}' is a directory; pass a TOML file")
    raise UserError(f"config file '{name_or_path}' not found; pass a TOML path or one of: "
                    + ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))))


def read_toml(file: Path) -> dict:
    """The file's TOML; a file that cannot be read, is not UTF-8 or not TOML is one line."""
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"config file '{file}' is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise UserError(f"config file '{file}' cannot be read ({e.strerror}); pass a readable TOML file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file '{file}' is not valid TOML: {e}") from None


TOML_KINDS = {list: " (a TOML array)", dict: " (a TOML table)"}
ONE = {int: "a single integer", float: "a single number", bool: "true or false", str: "a single string"}


def coerce(key: str, typ: type, value):
    """A command-line string, or a TOML value of the field's own kind, as the field's type. A value
    of another kind (an array or table, true for a number, 2.0 for an integer) is one line naming
    `key`, the value and the kind expected."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(value, str) and typ is not str:
        return parse_text(key, typ, value)
    if typ is bool and isinstance(value, bool) or typ is int and number and isinstance(value, int):
        return value
    if typ is float and number:
        return finite(key, float(value))
    if typ is str and (number or isinstance(value, (str, os.PathLike))):
        return str(value)
    shown = next((kind for cls, kind in TOML_KINDS.items() if isinstance(value, cls)), "")
    raise UserError(f"{key} expects {typ.__name__}, got {value!r}{shown}; give it {ONE[typ]}")


def parse_text(key: str, typ: type, text: str):
    """A command-line (or TOML string) value as an int, a float or a bool."""
    try:
        if typ is bool:
            if text.lower() not in ("true", "1", "yes", "false", "0", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        return int(text) if typ is int else finite(key, float(text))
    except ValueError:
        raise UserError(f"{key} expects {typ.__name__}, got {text!r}; give it {ONE[typ]}") from None


def finite(key: str, number: float) -> float:
    if not math.isfinite(number):  # nan passes every `< 0` check, and inf is no setting
        raise UserError(f"{key} must be a finite number, got {number}")
    return number
