"""Reading what `python -m jaxpar.prepare` wrote: meta.json checked, train.bin and val.bin
memory-mapped read-only. Each inconsistency is one UserError naming the file and the fix.

Every token id must lie within meta.json's tokenizer vocabulary (an embedding lookup beyond it
clamps or reads garbage, silently). The largest id prepare recorded is trusted while the file's
mtime is the one it recorded; otherwise (data from before the record, or a file changed since)
one np.max pass over the file finds it: 0.08 s/GB from the page cache, else the disk's read time.
An mtime can be put back (os.utime, some copies), so the record is a first check only: the
loader checks the ids of every batch it builds too (jaxpar.data.loader), with this message."""

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


def largest_id(path: Path, tokens: np.memmap, record: dict) -> int:
    """The split's largest token id: prepare's record while the file is as it left it, else
    found in one pass over the file."""
    recorded, mtime_ns = record.get("max_token"), record.get("mtime_ns")
    if type(recorded) is int and type(mtime_ns) is int and path.stat().st_mtime_ns == mtime_ns:
        return recorded
    return int(tokens.max())


def beyond_vocab(path: Path, top: int, vocab: int, tokenizer: str) -> UserError:
    """The error for a token file holding id `top`, past its tokenizer's `vocab`."""
    return UserError(f"'{path}' holds token id {top}, beyond the vocabulary of {vocab} tokens of "
                     f"meta.json's tokenizer ({tokenizer}): it is not that tokenizer's data, or "
                     f"was changed after jaxpar.prepare; {AGAIN}")


def check_ids(directory: Path, split: str, tokens: np.memmap, meta: dict) -> None:
    path, vocab = directory / f"{split}.bin", meta["vocab_size"]
    top = largest_id(path, tokens, meta["splits"][split])
    if top >= vocab:
        raise beyond_vocab(path, top, vocab, meta.get("tokenizer", "unnamed"))


def read_prepared(directory) -> tuple[dict, np.memmap, np.memmap]:
    """(meta, train, val) of a jaxpar.prepare directory, the tokens memory-mapped read-only,
    every id checked against the vocabulary."""
    directory = Path(directory)
    meta = read_meta(directory)
    dtype = check_vocab(meta, directory / "meta.json")
    train, val = (map_split(directory, split, meta["splits"][split]["tokens"], dtype)
                  for split in SPLITS)
    for split, tokens in zip(SPLITS, (train, val)):
        check_ids(directory, split, tokens, meta)
    return meta, train, val
