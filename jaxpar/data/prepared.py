"""Reading what `python -m jaxpar.prepare` wrote: meta.json checked, train.bin and val.bin
memory-mapped read-only. Each inconsistency is one UserError naming the file and the fix."""

import json
from pathlib import Path

import numpy as np

from jaxpar.core.errors import UserError

FORMAT = 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SPLITS = ("train", "val")
AGAIN = "run python -m jaxpar.prepare again"


def read_meta(directory: Path) -> dict:
    path = directory / "meta.json"
    if not directory.is_dir():
        raise UserError(f"prepared data '{directory}' is not a directory; run python -m "
                        f"jaxpar.prepare INPUT... --out {directory} first")
    if not path.is_file():
        raise UserError(f"'{path}' not found: '{directory}' was not prepared, or its "
                        f"jaxpar.prepare did not finish; {AGAIN}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        missing = [key for key in ("vocab_size", "dtype") if key not in meta]
        missing += [f"splits.{split}.tokens" for split in SPLITS
                    if "tokens" not in meta.get("splits", {}).get(split, {})]
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"'{path}' cannot be read as JSON ({e.__class__.__name__}: "
                        f"{str(e).splitlines()[0]}); {AGAIN}") from None
    if missing:
        raise UserError(f"'{path}' lacks {', '.join(missing)}: it is not a jaxpar.prepare "
                        f"meta.json; {AGAIN}")
    if meta.get("format", FORMAT) > FORMAT:
        raise UserError(f"'{path}' has format {meta['format']}, newer than this jaxpar reads "
                        f"({FORMAT}); use the jaxpar that wrote it, or {AGAIN}")
    return meta


def check_vocab(meta: dict, path: Path) -> np.dtype:
    """The token dtype meta.json names, which must hold every id below vocab_size."""
    name = meta.get("dtype")
    if name not in DTYPES:
        raise UserError(f"'{path}' says dtype {name!r}; token files are uint16 or uint32; {AGAIN}")
    vocab = meta["vocab_size"]
    if not isinstance(vocab, int) or not 0 < vocab <= 2 ** (8 * DTYPES[name].itemsize):
        raise UserError(f"'{path}' says vocab_size {vocab!r}, which {name} token ids cannot "
                        f"cover; {AGAIN}")
    return DTYPES[name]


def map_split(directory: Path, split: str, tokens, dtype: np.dtype) -> np.memmap:
    path = directory / f"{split}.bin"
    if not path.is_file():
        raise UserError(f"'{path}' not found; {AGAIN}")
    size = path.stat().st_size
    if size % dtype.itemsize or not isinstance(tokens, int) or size != tokens * dtype.itemsize:
        raise UserError(f"'{path}' has {size:,} bytes, but meta.json says {tokens!r} {dtype.name}"
                        f" tokens ({dtype.itemsize} bytes each): it is truncated or from another "
                        f"run; {AGAIN}")
    if not size:
        raise UserError(f"'{path}' is empty; {AGAIN} with longer inputs")
    return np.memmap(path, dtype=dtype, mode="r")


def read_prepared(directory) -> tuple[dict, np.memmap, np.memmap]:
    """(meta, train, val) of a jaxpar.prepare directory, the tokens memory-mapped read-only."""
    directory = Path(directory)
    meta = read_meta(directory)
    dtype = check_vocab(meta, directory / "meta.json")
    train, val = (map_split(directory, split, meta["splits"][split]["tokens"], dtype)
                  for split in SPLITS)
    return meta, train, val
