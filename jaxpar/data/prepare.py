"""`python -m jaxpar.prepare INPUT... --out DIR --tokenizer SPEC`: tokenize a corpus once into
nanoGPT's train.bin and val.bin, streaming it (bounded memory whatever its size) on all cores.

DIR gets:
  train.bin, val.bin  the token ids, flat: raw little-endian uint16 when vocab_size <= 65536,
                      else uint32, no header (nanoGPT's format: np.memmap(path, dtype, mode="r"))
  meta.json           {"format": 1, "tokenizer": SPEC, "vocab_size": N, "dtype": "uint16",
                       "eot_id": ID or null, "val_fraction": F, "input_bytes": B,
                       "splits": {"train": {"tokens": T, "documents": D}, "val": {...}},
                       "tokenizer_meta": the tokenizer's to_meta(), enough to rebuild it}
  tokenizer.json      the Hugging Face tokenizer, for every SPEC but tiktoken:NAME

Each input file is one document. The last val_fraction of its tokens (rounded down) go to val,
the rest to train, and each part ends with the end-of-text token (char has none: there the
parts just follow one another). So one file gives both splits, and the split is a pure function
of the inputs and their order.

Everything is written under temporary names and renamed at the end, meta.json last: a run that
stops early leaves no train.bin, val.bin or meta.json that could pass for complete.
`read_prepared(DIR)` checks the files and memory-maps them for training.
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from jaxpar.core.errors import ArgumentParser, UserError, check_output_dir, exit_on_user_error
from jaxpar.data import corpus
from jaxpar.data.prepared import DTYPES, FORMAT
from jaxpar.data.tokenizer import from_meta, load_tokenizer, tokenizer_json

SPLITS = ("train", "val")
OUTPUTS = ("train.bin", "val.bin", "tokenizer.json", "meta.json")
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

    def end_document(self) -> None:
        n = self.tokens["train"] - self.document_start
        n_val = int(n * self.val_fraction)
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


def _piece_encoder(tokenizer_meta: dict, dtype: str):
    tok = from_meta(tokenizer_meta)
    return lambda piece: (len(piece.data), piece.last,
                          tok.encode(corpus.decode_piece(piece)).astype(DTYPES[dtype]))


def tokenize(writer: SplitWriter, tok, inputs: list[Path], workers: int,
             progress: bool | None) -> float:
    """Every input's tokens into `writer`, pieces encoded on `workers` processes; the seconds."""
    pieces = (piece for path in inputs for piece in corpus.read_pieces(path))
    start, tokens, shown = time.perf_counter(), 0, 0.0
    encoded = corpus.ordered_map(_piece_encoder, (tok.to_meta(), writer.dtype.name), pieces,
                                 workers)
    with corpus.progress_bar(sum(p.stat().st_size for p in inputs), "tokenizing",
                             progress) as bar:
        for size, last, ids in encoded:
            writer.add(ids)
            if last:
                writer.end_document()
            tokens += len(ids)
            bar.update(size)
            elapsed = time.perf_counter() - start
            if elapsed - shown > 0.5:
                bar.set_postfix_str(f"{tokens / elapsed:,.0f} tokens/s", refresh=False)
                shown = elapsed
    return time.perf_counter() - start


def pool_size(workers: int | None, input_bytes: int) -> int:
    """Worker processes for `input_bytes` of text: none (1) for a piece or two."""
    return max(1, min(workers or 1, input_bytes // corpus.CHUNK_BYTES))


def check_out_dir(out: Path, force: bool) -> None:
    check_output_dir(out)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out '{out}' is not empty; pass --force to write "
                        f"{', '.join(OUTPUTS)} over what is there, or pass another directory")


def check_splits(writer: SplitWriter, val_fraction: float) -> None:
    for split in SPLITS:
        if not writer.tokens[split]:
            total = sum(writer.tokens.values())
            raise UserError(f"the {split} split is empty: the inputs' {total} tokens leave none "
                            f"for it with --val-fraction {val_fraction} (each document gives "
                            "val the last fraction of its tokens, rounded down); pass longer "
                            "inputs or another --val-fraction")


def make_meta(tok, writer: SplitWriter, val_fraction: float, input_bytes: int) -> dict:
    return {"format": FORMAT, "tokenizer": tok.spec, "vocab_size": tok.vocab_size,
            "dtype": writer.dtype.name, "eot_id": tok.eot_id, "val_fraction": val_fraction,
            "input_bytes": input_bytes,
            "splits": {split: {"tokens": writer.tokens[split],
                               "documents": writer.documents[split]} for split in SPLITS},
            "tokenizer_meta": tok.to_meta()}


def commit(out: Path, meta: dict, hf_json: str | None) -> None:
    """Rename the finished files into place; meta.json, the mark of a complete DIR, goes last."""
    (out / "meta.json").unlink(missing_ok=True)
    for split in SPLITS:
        os.replace(out / f"{split}.bin{PARTIAL}", out / f"{split}.bin")
    if hf_json is None:
        (out / "tokenizer.json").unlink(missing_ok=True)  # a stale one would contradict meta.json
    else:
        write_then_rename(out / "tokenizer.json", hf_json)
    write_then_rename(out / "meta.json", json.dumps(meta, indent=1) + "\n")


def write_then_rename(path: Path, text: str) -> None:
    partial = path.with_name(path.name + PARTIAL)
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def prepare(inputs: list[str], out, tokenizer: str, vocab_size: int | None = None,
            val_fraction: float = 0.1, force: bool = False, workers: int | None = None,
            progress: bool | None = False, bpe_sample_bytes: int | None = None) -> dict:
    """Tokenize `inputs` (files or globs) into `out`; returns meta.json's content and "timing".
    Bad input is a UserError, and leaves `out` as it was. With workers > 1, call it under
    `if __name__ == "__main__":`, since the workers are started with spawn."""
    out = Path(out)
    if not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    paths = corpus.expand_inputs(inputs)
    input_bytes = sum(path.stat().st_size for path in paths)
    if not input_bytes:
        raise UserError(f"the inputs are empty ({', '.join(map(str, paths))}); pass text files")
    check_out_dir(out, force)
    started = time.perf_counter()
    tok = load_tokenizer(tokenizer, paths, vocab_size, workers=pool_size(workers, input_bytes),
                         progress=progress, sample_bytes=bpe_sample_bytes)
    tokenizer_seconds = time.perf_counter() - started
    workers = pool_size(workers or (corpus.default_workers() if tok.parallel else 1),
                        input_bytes)
    hf_json, dtype = tokenizer_json(tok), token_dtype(tok.vocab_size)
    made = [d for d in (out, *out.parents) if not d.exists()]  # deepest first
    out.mkdir(parents=True, exist_ok=True)
    writer = SplitWriter(out, dtype, tok.eot_id, val_fraction)
    try:
        seconds = tokenize(writer, tok, paths, workers, progress)
        writer.close()
        check_splits(writer, val_fraction)
        meta = make_meta(tok, writer, val_fraction, input_bytes)
        commit(out, meta, hf_json)
    except BaseException:
        writer.close()
        for name in OUTPUTS:
            (out / f"{name}{PARTIAL}").unlink(missing_ok=True)
        for directory in made:
            if not any(directory.iterdir()):
                directory.rmdir()
        raise
    tokens = sum(writer.tokens.values())
    return {**meta, "timing": {"tokenizer_s": tokenizer_seconds, "tokenize_s": seconds,
                               "tokens_per_s": tokens / seconds, "workers": workers}}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="jaxpar.prepare", description="Tokenize UTF-8 text files into train.bin, val.bin "
        "(nanoGPT's format), meta.json and tokenizer.json in --out.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="UTF-8 text files or globs of them (quote globs); each file is one "
                        "document, and documents are separated by the end-of-text token (char "
                        "has none: its documents are just concatenated)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    parser.add_argument("--tokenizer", required=True, metavar="SPEC",
                        help="char, bytes, bpe (trained on the inputs; needs --vocab-size), "
                        "tiktoken:NAME (e.g. tiktoken:gpt2; from tiktoken's cache only), or "
                        "the path of a tokenizer.json")
    parser.add_argument("--vocab-size", type=int, metavar="N", help="bpe only: how many tokens (>= 257)")
    parser.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                        help="the share of each document's tokens, at its end, that goes to "
                        "val.bin (default 0.1)")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty --out, replacing the files it writes")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="processes that tokenize (default: all cores for bpe, tokenizer.json "
                        "and tiktoken; 1 for char and bytes, which encode faster than they could "
                        "send their text to another process)")
    parser.add_argument("--bpe-sample-bytes", type=int, metavar="N",
                        help="bpe only: train on about N bytes (the same share from the start "
                        "of each input) instead of all of them")
    return parser


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error("jaxpar.prepare"):
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        if args.workers is not None and args.workers < 1:
            raise UserError(f"--workers must be at least 1, got {args.workers}")
        if args.bpe_sample_bytes is not None and args.tokenizer != "bpe":
            raise UserError("--bpe-sample-bytes is for --tokenizer bpe only; drop it")
        try:
            meta = prepare(args.inputs, args.out, args.tokenizer, args.vocab_size,
                           args.val_fraction, args.force, args.workers, None,
                           args.bpe_sample_bytes)
        except KeyboardInterrupt:
            print(f"jaxpar.prepare: interrupted; nothing new written in {args.out}",
                  file=sys.stderr)
            sys.exit(130)
    print(summary(args.out, meta))


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


if __name__ == "__main__":
    main()
