"""`python -m jaxpar.export --ckpt RUN_DIR --out HF_DIR [--dtype bfloat16]`: a checkpoint as a
Hugging Face GPT2LMHeadModel or LlamaForCausalLM, by its model.family.

HF_DIR gets config.json, model.safetensors (shards and their index above 5 GB, as save_pretrained
writes them), and (for every tokenizer but tiktoken's) tokenizer.json
and tokenizer_config.json, so that transformers' AutoModelForCausalLM.from_pretrained(HF_DIR) and
AutoTokenizer.from_pretrained(HF_DIR) both load it. Everything is written to a temporary folder
beside HF_DIR and renamed into place, so HF_DIR is never half-written.
"""

import json
import os
import shutil
import sys
from pathlib import Path

from jaxpar.core.errors import ArgumentParser, UserError, check_output_dir, exit_on_user_error


def check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out '{out}' is a file, not a directory; pass a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out '{out}' exists and is not empty; pass --force to replace it, or "
                        "another directory")
    check_output_dir(out)


def tokenizer_files(tokenizer, block_size: int) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json for AutoTokenizer; none for tiktoken, which has no
    tokenizer.json here (its GPT-2 encoding is Hugging Face's 'gpt2' tokenizer)."""
    from jaxpar.data.tokenizer import tokenizer_json
    text = tokenizer_json(tokenizer)
    if text is None:
        return {}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
              "clean_up_tokenization_spaces": False}
    if tokenizer.eot_id is not None:
        eot = tokenizer.decode([tokenizer.eot_id])
        config |= {"bos_token": eot, "eos_token": eot, "unk_token": eot}
    return {"tokenizer.json": text, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


DTYPES = ("float32", "bfloat16")


def export(ckpt, out, force: bool = False, dtype: str = "float32",
           max_shard_bytes: int | None = None) -> tuple[int, list[str]]:
    """Write the newest checkpoint of the run `ckpt` to `out` as a Hugging Face model, its tensors
    in `dtype`; returns (the checkpoint's step, the files written)."""
    import ml_dtypes
    import numpy as np

    from jaxpar.formats.hf_files import MAX_SHARD_BYTES, save_weights
    from jaxpar.inference import sample
    from jaxpar.models.hf import hf_config, hf_state_dict
    out = Path(out)
    check_out_dir(out, force)
    model = sample.load(ckpt, "dp=1")  # on one device: the params whole, as the file holds them
    vocab, block = model.vocab_size, model.cfg.model.block_size
    array_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    tensors = hf_state_dict(model.params, model.cfg, vocab, array_dtype)  # refuses before anything is written
    texts = {"config.json": json.dumps(hf_config(model.cfg, vocab, model.tokenizer.eot_id, dtype),
                                       indent=2) + "\n"}
    texts |= tokenizer_files(model.tokenizer, block)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        staging.mkdir()
        weights = save_weights(tensors, staging, max_shard_bytes or MAX_SHARD_BYTES)
        for name, text in texts.items():
            (staging / name).write_text(text, encoding="utf-8")
        replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model.step, sorted([*weights, *texts])


def replace_dir(new: Path, out: Path) -> None:
    """Put the folder `new` at `out`, which may hold an older one (then removed)."""
    if not out.exists():
        new.rename(out)
        return
    old = out.parent / f".{out.name}.replaced-{os.getpid()}"
    out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="jaxpar.export",
                            description="Write a checkpoint as a Hugging Face directory (GPT-2 or Llama).")
    parser.add_argument("--ckpt", required=True,
                        help="a training run's --out directory, or its checkpoints folder")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
    parser.add_argument("--force", action="store_true", help="replace --out if it is not empty")
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
