"""The named configs and TOML files: where `--config NAME` is found, and a file read into its
tables, each problem one line (not UTF-8, not readable, not TOML)."""

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
