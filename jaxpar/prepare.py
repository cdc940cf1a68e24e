"""`python -m jaxpar.prepare INPUT... --out DIR --tokenizer SPEC`: text files or records to train.bin,
val.bin, meta.json and tokenizer.json (jaxpar.data.prepare does the work)."""

import signal
import sys

from jaxpar.core.errors import ArgumentParser, UserError, exit_on_user_error
from jaxpar.core.paths import given
from jaxpar.data import corpus
from jaxpar.data.prepare import prepare, summary
from jaxpar.data.records import RecordOptions


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="jaxpar.prepare", description="Tokenize text files or records (jsonl, parquet, Arrow) "
        "into train.bin, val.bin (nanoGPT's format), meta.json and tokenizer.json in --out.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT", type=given("input"),
                        help="files or globs (quote globs): UTF-8 text (each file one document), "
                        "jsonl (.jsonl, .json, .jsonl.gz, .jsonl.zst), .parquet, .arrow or a "
                        "datasets save_to_disk folder (each record one document); documents are "
                        "separated by the end-of-text token (char has none)")
    parser.add_argument("--text-field", default="text", metavar="NAME",
                        help="the records' field or column holding the text (default: text)")
    parser.add_argument("--skip-bad-records", action="store_true",
                        help="leave out records without a string text field and lines that are "
                        "not JSON, counted in meta.json (default: stop at the first, in one line)")
    parser.add_argument("--val-split", choices=("tokens", "documents"),
                        help="tokens: the last --val-fraction of each document's tokens go to val; "
                        "documents: every 1/fraction-th whole document does (default: tokens for "
                        "text files, documents for records, which are often short)")
    parser.add_argument("--out", required=True, metavar="DIR", type=given("--out"), help="the directory to write")
    parser.add_argument("--tokenizer", required=True, metavar="SPEC",
                        help="char, bytes, bpe (trained on the inputs; needs --vocab-size), "
                        "tiktoken:NAME (e.g. tiktoken:gpt2; from tiktoken's cache only), or "
                        "the path of a tokenizer.json")
    parser.add_argument("--vocab-size", type=int, metavar="N", help="bpe only: how many tokens (>= 257)")
    parser.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                        help="the share of each document's tokens, at its end, that goes to "
                        "val.bin, or of the documents with --val-split documents (default 0.1)")
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
            with corpus.interrupted_by_signals("jaxpar.prepare"):
                meta = prepare(args.inputs, args.out, args.tokenizer, args.vocab_size,
                               args.val_fraction, args.force, args.workers, None,
                               args.bpe_sample_bytes, RecordOptions(args.text_field, args.skip_bad_records),
                               args.val_split)
        except KeyboardInterrupt as stop:  # Ctrl-C, or corpus.Interrupted: SIGTERM or SIGINT
            by = f" by {stop}" if isinstance(stop, corpus.Interrupted) else ""
            print(f"jaxpar.prepare: interrupted{by}; nothing new written in {args.out}", file=sys.stderr)
            sys.exit(128 + getattr(stop, "signum", signal.SIGINT))
    print(summary(args.out, meta))


if __name__ == "__main__":  # and only then: the tokenizing workers are started with spawn
    main()
