"""`python -m jaxpar.export --ckpt RUN_DIR --out HF_DIR [--dtype bfloat16] [--force]`: a checkpoint as a
Hugging Face directory (jaxpar.inference.export writes it)."""

import sys

from jaxpar.core.errors import ArgumentParser, exit_on_user_error
from jaxpar.core.paths import given
from jaxpar.inference.export import DTYPES, export


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="jaxpar.export",
                            description="Write a checkpoint as a Hugging Face directory (GPT-2 or Llama).")
    parser.add_argument("--ckpt", required=True, type=given("--ckpt"),
                        help="a training run's --out directory, or its checkpoints folder")
    parser.add_argument("--out", required=True, type=given("--out"), help="the Hugging Face directory to write")
    parser.add_argument("--force", action="store_true",
                        help="replace an earlier export in --out: only the files it lists in its "
                             "jaxpar_export.json; a folder holding anything else is refused")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="the tensors' dtype in the files (the master weights are float32)")
    return parser


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error("jaxpar.export"):
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        step, files = export(args.ckpt, args.out, args.force, args.dtype)
    print(f"jaxpar.export: step {step} of {args.ckpt} -> {args.out}: {', '.join(files)}")
    if "tokenizer.json" not in files:
        print("jaxpar.export: note: a tiktoken tokenizer has no tokenizer.json; load Hugging "
              "Face's tokenizer of the same encoding (e.g. 'gpt2') with AutoTokenizer",
              file=sys.stderr)


if __name__ == "__main__":
    main()
