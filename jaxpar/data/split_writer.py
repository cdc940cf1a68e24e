"""train.bin and val.bin written as documents arrive: each document's tokens are appended to
train.bin, and at its end its last val_fraction (or all of it, or none) moves to val.bin, each
part closed by the end-of-text token. Files are written under a .partial suffix until committed."""

import os
from pathlib import Path

import numpy as np

from jaxpar.data.prepared import DTYPES

SPLITS = ("train", "val")
PARTIAL = ".partial"  # the suffix of a file still being written
COPY_BYTES = 1 << 24


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


class SplitWriter:
    """Appends each document's tokens to train.bin, then moves their last val_fraction to
    val.bin: a document's token count is known only at its end."""

    def __init__(self, out: Path, dtype: str, eot_id: int | None, val_fraction: float):
        self.dtype, self.eot_id, self.val_fraction = DTYPES[dtype], eot_id, val_fraction
        self.files = {split: open(out / f"{split}.bin{PARTIAL}", "w+b") for split in SPLITS}
        self.tokens = dict.fromkeys(SPLITS, 0)
        self.documents = dict.fromkeys(SPLITS, 0)
        self.document_start = 0  # in train.bin, in tokens

    def add(self, ids: np.ndarray) -> None:
        self.files["train"].write(ids.astype(self.dtype).tobytes())
        self.tokens["train"] += len(ids)

    def end_document(self, to_val: bool | None = None) -> None:
        """The document ends: its last val_fraction of tokens go to val, or (to_val given) all of
        it goes to val or stays in train."""
        n = self.tokens["train"] - self.document_start
        n_val = int(n * self.val_fraction) if to_val is None else n * to_val
        self._move_to_val(self.tokens["train"] - n_val)
        for split, count in (("train", n - n_val), ("val", n_val)):
            if count:
                self.documents[split] += 1
                if self.eot_id is not None:
                    self.files[split].write(np.array([self.eot_id], self.dtype).tobytes())
                    self.tokens[split] += 1
        self.document_start = self.tokens["train"]

    def _move_to_val(self, cut: int) -> None:
        train, item = self.files["train"], self.dtype.itemsize
        train.seek(cut * item)
        while block := train.read(COPY_BYTES):
            self.files["val"].write(block)
        train.truncate(cut * item)
        train.seek(0, os.SEEK_END)
        self.tokens["val"] += self.tokens["train"] - cut
        self.tokens["train"] = cut

    def close(self) -> None:
        for file in self.files.values():
            file.close()
