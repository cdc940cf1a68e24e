"""`python -m jaxpar.prepare INPUT... --out DIR --tokenizer SPEC`: tokenize a corpus once into
nanoGPT's train.bin and val.bin, streaming it (bounded memory whatever its size) on all cores.

DIR gets:
  train.bin, val.bin  the token ids, flat: raw little-endian uint16 when vocab_size <= 65536,
                      else uint32, no header (nanoGPT's format: np.memmap(path, dtype, mode="r"))
  meta.json           {"format": 1, "tokenizer": SPEC, "vocab_size": N, "dtype": "uint16",
                       "eot_id": ID or null, "val_fraction": F, "val_split": {KIND: HOW},
                       "input_bytes": B, and for records "text_field", "skipped_records",
                       "splits": {"train": {"tokens": T, "documents": D, "max_token": M,
                                  "mtime_ns": the file's}, "val": {...}} (M, the largest id,
                                  is trusted at load while the mtime is the same),
                       "tokenizer_meta": the tokenizer's to_meta(), enough to rebuild it}
  tokenizer.json      the Hugging Face tokenizer, for every SPEC but tiktoken:NAME

Each text file is one document, and so is each record of a jsonl, parquet or Arrow input
(jaxpar.data.records). With --val-split tokens (text files' default) the last val_fraction of a
document's tokens (rounded down) go to val, the rest to train, each part ending with the
end-of-text token (char has none: there the parts just follow one another), so one file gives
both splits; with --val-split documents (records' default) every 1/val_fraction-th document
goes to val whole. Either way the split is a pure function of the inputs and their order.

Everything is written under temporary names and renamed at the end, meta.json last: a run that
stops early leaves no train.bin, val.bin or meta.json that could pass for complete. DIR is
locked meanwhile (jaxpar.core.out_lock's jaxpar.lock, gone at the end): a second prepare into it
is refused in one line, so meta.json always describes the run that wrote the token files.
SIGTERM or SIGINT stops the workers, removes the partial files and ends the run in one line (exit
128 + the signal's number); so does a full disk (exit 2). `read_prepared(DIR)` checks the files
and memory-maps them for training.
"""

import contextlib
import errno
import json
import os
import sys
import time
from pathlib import Path

from jaxpar.core.errors import UserError
from jaxpar.core.out_lock import LOCK_NAME, RunLock
from jaxpar.core.paths import output_folder
from jaxpar.core.written import replace_text
from jaxpar.data import corpus
from jaxpar.data.records import RecordOptions, RecordPiece, input_size, is_records
from jaxpar.data.split_writer import PARTIAL, SPLITS, SplitWriter, token_dtype
from jaxpar.data.token_files import DTYPES, FORMAT
from jaxpar.data.tokenizer import from_meta, load_tokenizer, tokenizer_json

OUTPUTS = ("train.bin", "val.bin", "tokenizer.json", "meta.json")


def _piece_encoder(tokenizer_meta: dict, dtype: str):
    """piece -> (its input bytes, whether it is whole records, each text's ids, whether the last
    text ends a document, bad records skipped)."""
    tok = from_meta(tokenizer_meta)

    def encode(piece):
        texts, skipped = corpus.texts_of(piece)
        return (piece.size, isinstance(piece, RecordPiece),
                [tok.encode(text).astype(DTYPES[dtype]) for text in texts], piece.last, skipped)
    return encode


def whole_to_val(document: int, val_fraction: float) -> bool:
    """Whether the document-th whole document goes to val: every 1/val_fraction-th one."""
    return int(round((document + 1) * val_fraction, 9)) > int(round(document * val_fraction, 9))


def tokenize(writer: SplitWriter, tok, inputs: list[Path], workers: int, progress: bool | None,
             options: RecordOptions, val_split: str | None) -> tuple[float, int]:
    """Every input's tokens into `writer`, pieces encoded on `workers` processes. A record is a
    document; so is a text file, in pieces. Val takes the last val_fraction of each document's
    tokens, or (val_split "documents", records' default) every 1/val_fraction-th whole document.
    Returns the seconds and the bad records skipped."""
    pieces = (piece for path in inputs for piece in corpus.pieces_of(path, options))
    start, tokens, shown, skipped, whole = time.perf_counter(), 0, 0.0, 0, 0
    encoded = corpus.ordered_map(_piece_encoder, (tok.to_meta(), writer.dtype.name), pieces, workers)
    # closing: an error or a signal here stops the workers now, not when the traceback is freed.
    with contextlib.closing(encoded), corpus.progress_bar(sum(input_size(p) for p in inputs), "tokenizing",
                                                          progress) as bar:
        for size, is_records, documents, last, bad in encoded:
            by_documents = val_split == "documents" or (val_split is None and is_records)
            for i, ids in enumerate(documents):
                writer.add(ids)
                tokens += len(ids)
                if is_records or (last and i == len(documents) - 1):
                    writer.end_document(whole_to_val(whole, writer.val_fraction) if by_documents else None)
                    whole += 1
            skipped += bad
            bar.update(size)
            elapsed = time.perf_counter() - start
            if elapsed - shown > 0.5:
                bar.set_postfix_str(f"{tokens / elapsed:,.0f} tokens/s", refresh=False)
                shown = elapsed
    return time.perf_counter() - start, skipped


def pool_size(workers: int | None, input_bytes: int) -> int:
    """Worker processes for `input_bytes` of text: none (1) for a piece or two."""
    return max(1, min(workers or 1, input_bytes // corpus.CHUNK_BYTES))


def check_out_dir(out: Path, force: bool) -> None:
    """Under out's lock, whose file is the one not counted."""
    if any(path.name != LOCK_NAME for path in out.iterdir()) and not force:
        raise UserError(f"--out '{out}' is not empty; pass --force to write "
                        f"{', '.join(OUTPUTS)} over what is there, or pass another directory")


def check_splits(writer: SplitWriter, val_fraction: float, tokenizer: str) -> None:
    if not sum(writer.tokens.values()):  # then no --val-fraction or --val-split could help
        raise UserError(f"the inputs give no tokens: every document's text is empty or dropped whole by "
                        f"--tokenizer {tokenizer}; pass inputs with text in them (for records, the "
                        "--text-field that holds it)")
    for split in SPLITS:
        if not writer.tokens[split]:
            total = sum(writer.tokens.values())
            raise UserError(f"the {split} split is empty: the inputs' {total} tokens leave none "
                            f"for it with --val-fraction {val_fraction} (each document gives "
                            "val the last fraction of its tokens, rounded down, or with --val-split "
                            "documents every 1/fraction-th document); pass longer inputs, another "
                            "--val-fraction or another --val-split")


def make_meta(tok, writer: SplitWriter, val_fraction: float, input_bytes: int, val_split: dict,
              options: RecordOptions, skipped: int) -> dict:
    return {"format": FORMAT, "tokenizer": tok.spec, "vocab_size": tok.vocab_size,
            "dtype": writer.dtype.name, "eot_id": tok.eot_id, "val_fraction": val_fraction,
            "val_split": val_split, "input_bytes": input_bytes,
            **({"text_field": options.field, "skipped_records": skipped} if "records" in val_split else {}),
            "splits": {split: writer.record(split) for split in SPLITS},
            "tokenizer_meta": tok.to_meta()}


def commit(out: Path, meta: dict, hf_json: str | None) -> None:
    """Rename the finished files into place; meta.json, the mark of a complete DIR, goes last."""
    (out / "meta.json").unlink(missing_ok=True)
    for split in SPLITS:
        os.replace(out / f"{split}.bin{PARTIAL}", out / f"{split}.bin")
    if hf_json is None:
        (out / "tokenizer.json").unlink(missing_ok=True)  # a stale one would contradict meta.json
    else:
        replace_text(out / "tokenizer.json", hf_json)
    replace_text(out / "meta.json", json.dumps(meta, indent=1) + "\n")


def discard_partials(out: Path, error: BaseException) -> None:
    """After `error`, the partial files removed. An OSError (a full or read-only disk) becomes one
    line; a partial file that cannot be removed is said: in that line, or on its own."""
    left = []
    for name in OUTPUTS:
        path = out / f"{name}{PARTIAL}"
        try:
            path.unlink(missing_ok=True)
        except OSError as failed:
            left.append(f"'{path}' could not be removed ({failed.strerror or failed}); remove it by hand")
    if isinstance(error, OSError):
        raise UserError("; ".join([disk_error(error, out), *left])) from None
    if left and isinstance(error, UserError):
        raise UserError("; ".join([str(error), *left])) from None
    if left:
        print(f"jaxpar.prepare: warning: {'; '.join(left)}", file=sys.stderr)


def disk_error(error: OSError, out: Path) -> str:
    """An OSError while the inputs are tokenized into `out`, in words: a full disk, or the file
    (when the system named one) and what the system said."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left to write --out '{out}' ({error.strerror}); free space on that disk or pass an "
                "--out on another, then run again; nothing was written")
    where = f"'{error.filename}'" if error.filename else f"writing --out '{out}'"
    return f"{where}: {error.strerror or error}; fix it, then run again; nothing was written"


def val_split_of(paths: list[Path], val_split: str | None) -> dict:
    """meta.json's record of how each kind of input was split: {"text files": "tokens", ...}."""
    kinds = {"records" if is_records(p) else "text files" for p in paths}
    default = {"text files": "tokens", "records": "documents"}
    return {kind: val_split or default[kind] for kind in sorted(kinds)}


def prepare(inputs: list[str], out, tokenizer: str, vocab_size: int | None = None,
            val_fraction: float = 0.1, force: bool = False, workers: int | None = None,
            progress: bool | None = False, bpe_sample_bytes: int | None = None,
            options: RecordOptions = RecordOptions(), val_split: str | None = None) -> dict:
    """Tokenize `inputs` (files or globs) into `out`; returns meta.json's content and "timing".
    Bad input is a UserError, and leaves `out` as it was. With workers > 1, call it under
    `if __name__ == "__main__":`, since the workers are started with spawn."""
    out = Path(out)
    if not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    paths = corpus.expand_inputs(inputs)
    input_bytes = sum(input_size(path) for path in paths)
    if not input_bytes:
        raise UserError(f"the inputs are empty ({', '.join(map(str, paths))}); pass text files")
    out = output_folder(out)  # through a symbolic link, which stays
    with RunLock(out):  # one writer per --out: two would write the same files in turns
        check_out_dir(out, force)
        started = time.perf_counter()
        tok = load_tokenizer(tokenizer, paths, vocab_size, workers=pool_size(workers, input_bytes),
                             progress=progress, sample_bytes=bpe_sample_bytes, options=options)
        tokenizer_seconds = time.perf_counter() - started
        workers = pool_size(workers or (corpus.default_workers() if tok.parallel else 1), input_bytes)
        hf_json, dtype = tokenizer_json(tok), token_dtype(tok.vocab_size)
        writer = None
        try:
            writer = SplitWriter(out, dtype, tok.eot_id, val_fraction)
            seconds, skipped = tokenize(writer, tok, paths, workers, progress, options, val_split)
            writer.close()
            check_splits(writer, val_fraction, tok.spec)
            meta = make_meta(tok, writer, val_fraction, input_bytes, val_split_of(paths, val_split), options,
                             skipped)
            commit(out, meta, hf_json)
        except BaseException as error:  # the lock then removes the folders it made, if they are empty again
            if writer is not None:
                writer.discard()
            discard_partials(out, error)
            raise
    tokens = sum(writer.tokens.values())
    return {**meta, "timing": {"tokenizer_s": tokenizer_seconds, "tokenize_s": seconds,
                               "tokens_per_s": tokens / seconds, "workers": workers}}


def summary(out, meta: dict) -> str:
    def split(name: str) -> str:
        counts = meta["splits"][name]
        return (f"{name} {counts['tokens']:,} tokens from {counts['documents']} "
                f"document{'s' * (counts['documents'] != 1)}")
    timing = meta["timing"]
    return (f"jaxpar.prepare: wrote {out}: {split('train')}, {split('val')}; {meta['tokenizer']} "
            f"vocab_size {meta['vocab_size']:,} as {meta['dtype']}; tokenizer ready in "
            f"{timing['tokenizer_s']:.1f} s, {meta['input_bytes'] / 2**20:,.1f} MiB tokenized in "
            f"{timing['tokenize_s']:.1f} s: {timing['tokens_per_s']:,.0f} tokens/s on "
            f"{timing['workers']} worker{'s' * (timing['workers'] != 1)}")

