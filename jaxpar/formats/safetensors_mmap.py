"""Read a safetensors file as memory-mapped numpy arrays, so a reader touches only what it indexes.

The format: an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape
and byte range, then the data. The safetensors package reads whole tensors or 2-D slices of them;
a memory map lets jaxpar.models.hf reshape a tensor first and then read any slice of that view.

The header is untrusted input: its length is bounded by the file and by MAX_HEADER_BYTES before
it is read, and every entry is checked (a known dtype, a shape of whole numbers that its byte range
holds exactly, ranges inside the data and apart from each other) before any array is made.
"""

import itertools
import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxpar.core.errors import UserError

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
MAX_HEADER_BYTES = 100_000_000  # the safetensors package's own limit
FIX = "save it again with save_pretrained, or copy it again"


def open_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only memory-mapped array: indexing one reads
    only the pages it touches. A file whose header does not describe its data is a UserError."""
    header, data_start, size = read_header(path)
    entries = [check_entry(path, name, info, size - data_start)
               for name, info in header.items() if name != "__metadata__"]
    check_apart(path, entries)
    if size == data_start:  # no bytes to map: every tensor is empty
        data = np.zeros(0, np.uint8)
    else:
        try:
            data = np.memmap(path, np.uint8, "r", offset=data_start)
        except (OSError, ValueError) as e:
            raise UserError(f"'{path}' cannot be mapped ({e}); {FIX}") from None
    return {name: data[begin:end].view(DTYPES[dtype]).reshape(shape)
            for name, dtype, shape, begin, end in entries}


def read_header(path: Path) -> tuple[dict, int, int]:
    """(the JSON header, where the data starts, the file's size), the length checked before reading."""
    def bad(what: str) -> UserError:
        return UserError(f"'{path}' is not a readable safetensors file ({what}); {FIX}")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size < 8:
                raise bad(f"{size} bytes, fewer than the 8 of the header's length")
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(size - 8, MAX_HEADER_BYTES):
                limit = "the file" if length > size - 8 else f"the limit of {MAX_HEADER_BYTES:,} bytes"
                raise bad(f"its header's length, {length:,} bytes, is past {limit}")
            text = f.read(length)
    except OSError as e:
        raise bad(os.strerror(e.errno) if e.errno else str(e)) from None
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad(f"the header is not JSON: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    return header, 8 + length, size


def is_count(value) -> bool:
    """A JSON whole number, not negative (true and false are not numbers here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def shown(name: str) -> str:
    """A tensor's name as a one-line message shows it: quoted and escaped if it holds a control
    character, cut short if long."""
    return name if name.isprintable() and len(name) <= 200 else json.dumps(name[:200])


def check_entry(path: Path, name: str, info, data_bytes: int) -> tuple:
    """(name, dtype, shape, begin, end) of one header entry, each field checked."""
    def bad(what: str) -> UserError:
        return UserError(f"'{path}': tensor {shown(name)} {what}; {FIX}")
    if not isinstance(info, dict):
        raise bad(f"is described by {json.dumps(info)[:80]}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise UserError(f"'{path}': tensor {shown(name)} has dtype {json.dumps(dtype)[:80]}; jaxpar reads "
                        f"{', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(is_count(n) for n in shape):
        raise bad(f"has shape {json.dumps(shape)[:80]}, not a list of whole numbers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_count(n) for n in offsets)
            and offsets[0] <= offsets[1]):
        raise bad(f"has data_offsets {json.dumps(offsets)[:80]}, not [begin, end] in bytes with "
                  "0 <= begin <= end")
    begin, end = offsets
    if end > data_bytes:
        raise UserError(f"'{path}' is truncated (tensor {shown(name)} ends at byte {end:,} of the data, which "
                        f"holds {data_bytes:,}); copy it again")
    expected = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
    if end - begin != expected:
        raise bad(f"has shape {shape} of {dtype}, {expected:,} bytes, but its data_offsets span "
                  f"{end - begin:,}")
    return name, dtype, tuple(shape), begin, end


def check_apart(path: Path, entries: list[tuple]) -> None:
    """No two tensors' byte ranges overlap."""
    spans = sorted((begin, end, name) for name, _, _, begin, end in entries if end > begin)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise UserError(f"'{path}': tensors {shown(first)} and {shown(second)} overlap in the data; {FIX}")
