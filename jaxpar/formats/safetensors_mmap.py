"""Read a safetensors file as memory-mapped numpy arrays, so a reader touches only what it indexes.

The format: an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape
and byte range, then the data. The safetensors package reads whole tensors or 2-D slices of them;
a memory map lets jaxpar.models.hf reshape a tensor first and then read any slice of that view.
"""

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxpar.core.errors import UserError

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


def open_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only memory-mapped array: indexing one reads
    only the pages it touches. The format: an 8-byte header length, a JSON header, the data."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        data = np.memmap(path, np.uint8, "r", offset=8 + length)
        entries = [(name, info["dtype"], info["shape"], *info["data_offsets"])
                   for name, info in header.items() if name != "__metadata__"]
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, ValueError, OSError, KeyError,
            TypeError, AttributeError) as e:
        raise UserError(f"'{path}' is not a readable safetensors file ({type(e).__name__}); "
                        "save it again with save_pretrained") from None
    tensors = {}
    for name, dtype, shape, begin, end in entries:
        if dtype not in DTYPES:
            raise UserError(f"'{path}': tensor {name} has dtype {dtype}; jaxpar reads "
                            f"{', '.join(DTYPES)}")
        if end > data.size:
            raise UserError(f"'{path}' is truncated (tensor {name} ends past the file); copy it "
                            "again")
        tensors[name] = data[begin:end].view(DTYPES[dtype]).reshape(shape)
    return tensors
