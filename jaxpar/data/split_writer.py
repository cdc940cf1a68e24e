"""train.bin and val.bin written as documents arrive: each document's tokens are appended to
train.bin, and at its end its last val_fraction (or all of it, or none) moves to val.bin, each
part closed by the end-of-text token. Files are written under a .partial suffix until committed.

Each split's largest token id is kept as the tokens go by (for meta.json, so that loading need
not scan the file): train's from each piece's maximum, val's from the blocks moved to it."""

import contextlib
import os
from pathlib import Path

import numpy as np

from jaxpar.data.token_files import DTYPES

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
        self.paths = {split: out / f"{split}.bin{PARTIAL}" for split in SPLITS}
        self.files = {split: open(path, "w+b") for split, path in self.paths.items()}
        self.tokens = dict.fromkeys(SPLITS, 0)
        self.documents = dict.fromkeys(SPLITS, 0)
        self.max_token = dict.fromkeys(SPLITS, 0)
        self.document_start = 0  # in train.bin, in tokens
        # The open document's pieces as (start, end, largest id), and the last piece's ids.
        self.pieces: list[tuple[int, int, int]] = []
        self.last_piece = np.empty(0, self.dtype)

    def add(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        self.files["train"].write(ids.tobytes())
        if len(ids):
            self.pieces.append((self.tokens["train"], self.tokens["train"] + len(ids), int(ids.max())))
            self.last_piece = ids
        self.tokens["train"] += len(ids)

    def end_document(self, to_val: bool | None = None) -> None:
        """The document ends: its last val_fraction of tokens go to val, or (to_val given) all of
        it goes to val or stays in train."""
        n = self.tokens["train"] - self.document_start
        n_val = int(n * self.val_fraction) if to_val is None else n * to_val
        self._note_train_max(self.tokens["train"] - n_val)
        self._move_to_val(self.tokens["train"] - n_val)
        for split, count in (("train", n - n_val), ("val", n_val)):
            if count:
                self.documents[split] += 1
                if self.eot_id is not None:
                    self.files[split].write(np.array([self.eot_id], self.dtype).tobytes())
                    self.tokens[split] += 1
                    self.max_token[split] = max(self.max_token[split], self.eot_id)
        self.document_start = self.tokens["train"]
        self.pieces = []

    def _note_train_max(self, cut: int) -> None:
        """The open document's tokens before `cut` stay in train: their largest id counts there.
        Only the piece the cut splits needs its ids again, from memory if it is the last piece,
        else (a val part longer than the last piece) read back from train.bin: one piece at most."""
        for start, end, top in self.pieces:
            if end <= cut:
                self.max_token["train"] = max(self.max_token["train"], top)
            elif start < cut:
                if end == self.tokens["train"]:
                    kept = self.last_piece[:cut - start]
                else:
                    self.files["train"].seek(start * self.dtype.itemsize)
                    kept = np.frombuffer(self.files["train"].read((cut - start) * self.dtype.itemsize),
                                         self.dtype)
                    self.files["train"].seek(0, os.SEEK_END)
                self.max_token["train"] = max(self.max_token["train"], int(kept.max()))

    def _move_to_val(self, cut: int) -> None:
        train, item = self.files["train"], self.dtype.itemsize
        train.seek(cut * item)
        while block := train.read(COPY_BYTES):
            self.files["val"].write(block)
            self.max_token["val"] = max(self.max_token["val"], int(np.frombuffer(block, self.dtype).max()))
        train.truncate(cut * item)
        train.seek(0, os.SEEK_END)
        self.tokens["val"] += self.tokens["train"] - cut
        self.tokens["train"] = cut

    def close(self) -> None:
        for file in self.files.values():
            file.close()

    def discard(self) -> None:
        """Closed after a failure, its files about to be removed: a flush that fails (the full
        disk that stopped it) loses only bytes that were going anyway, and each file is closed
        even then."""
        for file in self.files.values():
            with contextlib.suppress(OSError):
                file.close()

    def record(self, split: str) -> dict:
        """meta.json's account of a closed split: its tokens, documents, largest id, and the
        file's mtime_ns. Loading trusts max_token only while the mtime is the same: every write
        sets it (a rename, as commit does, keeps it), so a file overwritten after this, even with
        as many tokens, is scanned again. A fingerprint of sampled blocks could miss an edit
        between them, and a full one costs the very pass it would save; a copy that gets a new
        mtime just costs that one pass (np.max, 0.08 s/GB cached) at each load."""
        return {"tokens": self.tokens[split], "documents": self.documents[split],
                "max_token": self.max_token[split],
                "mtime_ns": self.paths[split].stat().st_mtime_ns}
