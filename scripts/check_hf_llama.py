"""Check jaxpar's Hugging Face Llama in/out end to end against real transformers, on Tiny Shakespeare.

Needs torch and transformers 5.x, which jaxpar itself never does: run it in a separate venv, and point
--jaxpar-python at a Python that has jaxpar (the commands run as `python -m jaxpar.<cmd>` subprocesses):

    /tmp/torchref-venv/bin/python scripts/check_hf_llama.py [--jaxpar-python .venv/bin/python] [--work DIR]

It makes a random LlamaForCausalLM (GQA 4/2 heads, llama3 rope scaling, untied lm_head, every RMSNorm
weight moved off 1) with a character-level tokenizer.json for Tiny Shakespeare, saves it in WORK/hf, tokenizes
the text into WORK/data with jaxpar.prepare, and checks, printing the numbers and PASS/FAIL for each:

  1. `jaxpar.eval --hf` gives transformers' loss over every 256-token block of val, within 1e-4 relative;
  2. `jaxpar.sample --hf --temperature 0` (on one device and on tp=2) gives transformers' greedy text;
  3. after 20 steps of `jaxpar.train --init-from` on tp=2, `jaxpar.export` loads in transformers, which
     gives the greedy text of `jaxpar.sample --ckpt` and jaxpar's logits (max abs diff <= 1e-3); a
     bfloat16 export is loaded too and its dtype reported.

It exits 1 if any check fails; a failing jaxpar command is printed with its output. CPU only, a few minutes.
WORK (default /tmp/check_hf_llama) keeps everything for a look afterwards; its subfolders are replaced each run.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
SEED = 1234
VOCAB = 65
BLOCK = 256
PROMPT = "ROMEO:"
NEW_TOKENS = 40
EVAL_RTOL = 1e-4
LOGITS_ATOL = 1e-3
STEPS = 20
SUBDIRS = ("hf", "data", "run", "export", "export_bf16")
LLAMA = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": BLOCK,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
         "attention_bias": False, "mlp_bias": False,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
         # no bos/eos: '\n' is token 0 and generate would stop at an eos, where jaxpar does not
         "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
         "initializer_range": 0.2}  # 0.02 gives logits near 0: a weaker test, and near-ties for greedy

TOKENIZER_SIDE = """
import sys
from pathlib import Path
from jaxpar.data.tokenizer import CharTokenizer
from jaxpar.inference.export import tokenizer_files
text_file, out, block = sys.argv[1:]
tok = CharTokenizer.from_text(Path(text_file).read_text(encoding="utf-8"))
for name, text in tokenizer_files(tok, int(block)).items():
    (Path(out) / name).write_text(text, encoding="utf-8")
print(tok.vocab_size)
"""

LOGITS_SIDE = """
import sys
import jax, numpy as np
from jaxpar.inference import sample
from jaxpar.models.family import abstract_model
run_dir, ids_file, logits_file = sys.argv[1:]
model = sample.load(run_dir)
ids = np.load(ids_file)
net, _, _ = abstract_model(model.cfg, model.vocab_size)
with jax.set_mesh(model.mesh):
    logits = jax.jit(net)(model.params, ids)
np.save(logits_file, np.asarray(logits, np.float32)[..., :model.tokenizer.vocab_size])
"""


class CommandFailed(Exception):
    """A jaxpar command exited non-zero; the message holds the command and its output."""


def jaxpar(python: str, args: list[str]) -> str:
    """Run `python args...` in the repo root; its stdout, or CommandFailed with the command and output."""
    shown = " ".join([Path(python).name, *("'<snippet>'" if "\n" in a else a for a in args)])
    print(f"$ {shown}", flush=True)
    start = time.perf_counter()
    done = subprocess.run([python, *args], check=False, cwd=ROOT, capture_output=True, text=True,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise CommandFailed(f"exit {done.returncode}: {python} {' '.join(args)}\n"
                            f"--- stdout ---\n{done.stdout}--- stderr ---\n{done.stderr}")
    print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)
    return done.stdout


def verdict(name: str, ok: bool, results: dict) -> None:
    results[name] = ok
    print(f"{name}: {'PASS' if ok else 'FAIL'}\n", flush=True)


# ---- setup ----

def build_model():
    """The random Llama in float32, eager attention, every RMSNorm weight moved off its init of 1."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA, attn_implementation="eager")).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, modeling_llama.LlamaRMSNorm):
                module.weight.add_(0.1 * torch.randn_like(module.weight))
    return model


def setup(python: str, work: Path, build) -> None:
    """WORK/hf (the model `build` makes, and its tokenizer) and WORK/data (jaxpar.prepare's train.bin, val.bin)."""
    for name in SUBDIRS:
        shutil.rmtree(work / name, ignore_errors=True)
    hf = work / "hf"
    hf.mkdir(parents=True)
    model = build()
    model.save_pretrained(hf)
    vocab = int(jaxpar(python, ["-c", TOKENIZER_SIDE, str(TEXT), str(hf), str(BLOCK)]).strip())
    assert vocab == VOCAB, f"the char tokenizer of {TEXT} has {vocab} tokens, not {VOCAB}"
    print(f"{hf}: {', '.join(sorted(p.name for p in hf.iterdir()))}")
    print(jaxpar(python, ["-m", "jaxpar.prepare", str(TEXT), "--out", str(work / "data"),
                          "--tokenizer", str(hf / "tokenizer.json")]).rstrip())


def load_hf(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(path)


def hf_greedy(model, tokenizer, prompt: str = PROMPT, new_tokens: int = NEW_TOKENS) -> str:
    """transformers' greedy continuation of prompt, decoded with the prompt."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + new_tokens, f"generate stopped early: {out.shape}"
    return tokenizer.decode(out[0].tolist())


def jaxpar_greedy(python: str, source: list[str], new_tokens: int = NEW_TOKENS) -> str:
    """jaxpar.sample's greedy text (it prints the prompt, the new text, then one newline)."""
    out = jaxpar(python, ["-m", "jaxpar.sample", *source, "--temperature", "0", "--prompt", PROMPT,
                          "--max-new-tokens", str(new_tokens)])
    return out.removesuffix("\n")


def same_text(label: str, hf_text: str, jaxpar_text: str) -> bool:
    same = hf_text == jaxpar_text
    print(f"{label}: {'match' if same else 'DIFFER'}\n  transformers: {hf_text!r}\n  jaxpar:       {jaxpar_text!r}")
    return same


# ---- check 1: val loss ----

def val_tokens(data: Path) -> np.ndarray:
    meta = json.loads((data / "meta.json").read_text())
    return np.fromfile(data / "val.bin", dtype=np.dtype(meta["dtype"]).newbyteorder("<"))


def hf_val_loss(model, tokens: np.ndarray, rows: int = 16) -> tuple[float, int]:
    """Mean next-token cross entropy over every non-overlapping BLOCK of tokens, as jaxpar.eval's blocks;
    (loss, blocks)."""
    blocks = (len(tokens) - 1) // BLOCK
    window = tokens[:blocks * BLOCK + 1].astype(np.int64)
    inputs, targets = window[:-1].reshape(blocks, BLOCK), window[1:].reshape(blocks, BLOCK)
    losses = []
    with torch.no_grad():
        for first in range(0, blocks, rows):
            logits = model(torch.from_numpy(inputs[first:first + rows])).logits.float()
            per_token = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), torch.from_numpy(targets[first:first + rows]), reduction="none")
            losses.append(per_token.mean(dim=1).double().numpy())
    return float(np.concatenate(losses).mean()), blocks


def check_eval(python: str, work: Path, model, results: dict) -> None:
    print("== check 1: jaxpar.eval --hf vs transformers, val loss ==")
    out = jaxpar(python, ["-m", "jaxpar.eval", "--hf", str(work / "hf"), "--data", str(work / "data"),
                          "--block-size", str(BLOCK)])
    ours = json.loads(out.strip().splitlines()[-1])
    print(f"  jaxpar.eval: {json.dumps(ours)}")
    theirs, blocks = hf_val_loss(model, val_tokens(work / "data"))
    rel = abs(ours["loss"] - theirs) / abs(theirs)
    print(f"  transformers: {blocks} blocks x {BLOCK}, loss {theirs:.8f}\n  jaxpar:       {ours['blocks']} blocks "
          f"x {BLOCK}, loss {ours['loss']:.8f}\n  relative diff {rel:.3g} (<= {EVAL_RTOL:g} needed)")
    verdict("check 1 (eval --hf loss)", rel <= EVAL_RTOL and ours["blocks"] == blocks, results)


# ---- check 2: greedy sampling from the HF directory ----

def check_sample(python: str, work: Path, model, tokenizer, results: dict, meshes: tuple) -> None:
    print(f"== check 2: jaxpar.sample --hf --temperature 0 vs transformers generate, {NEW_TOKENS} tokens ==")
    hf_text = hf_greedy(model, tokenizer)
    ok = True
    for mesh in meshes:
        text = jaxpar_greedy(python, ["--hf", str(work / "hf"), "--mesh", mesh])
        ok &= same_text(f"  --mesh {mesh}", hf_text, text)
    verdict(f"check 2 (sample --hf greedy, {' and '.join(meshes)})", ok, results)


# ---- check 3: fine-tune, export, reload ----

def finetune_and_export(python: str, work: Path, mesh: str) -> None:
    run = work / "run"
    out = jaxpar(python, ["-m", "jaxpar.train", "--init-from", str(work / "hf"), "--data.path", str(work / "data"),
                          "--mesh", mesh, "--steps", str(STEPS), "--log-every", "5", "--out", str(run),
                          "--fresh", "--train.eval_every=0"])
    print("  " + "\n  ".join(out.rstrip().splitlines()[-4:]))
    for name, dtype in (("export", "float32"), ("export_bf16", "bfloat16")):
        print("  " + jaxpar(python, ["-m", "jaxpar.export", "--ckpt", str(run), "--out", str(work / name),
                                     "--force", "--dtype", dtype]).rstrip())


def jaxpar_logits(python: str, run: Path, ids: np.ndarray) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        np.save(f"{tmp}/ids.npy", ids)
        jaxpar(python, ["-c", LOGITS_SIDE, str(run), f"{tmp}/ids.npy", f"{tmp}/logits.npy"])
        return np.load(f"{tmp}/logits.npy")


def check_export(python: str, work: Path, results: dict, mesh: str) -> None:
    print(f"== check 3: {STEPS} steps of jaxpar.train on {mesh}, jaxpar.export, transformers reload ==")
    finetune_and_export(python, work, mesh)
    model, tokenizer = load_hf(work / "export", attn_implementation="eager")
    print(f"  {work / 'export'} in transformers: {type(model).__name__}, dtype {model.dtype}, "
          f"max_position_embeddings {model.config.max_position_embeddings}, rope {model.config.rope_parameters}")
    ok = same_text(f"  greedy {NEW_TOKENS} tokens after {PROMPT!r}", hf_greedy(model, tokenizer),
                   jaxpar_greedy(python, ["--ckpt", str(work / "run")]))
    ids = np.random.default_rng(SEED).integers(0, VOCAB, (2, 32)).astype(np.int32)
    ours = jaxpar_logits(python, work / "run", ids)
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()
    diff = np.abs(theirs - ours).max()
    print(f"  logits on {ids.shape[0]} x {ids.shape[1]} random tokens: max abs diff {diff:.3g} "
          f"(largest |logit| {np.abs(ours).max():.3g}; <= {LOGITS_ATOL:g} needed)")
    bf16, _ = load_hf(work / "export_bf16")
    print(f"  {work / 'export_bf16'} in transformers (from_pretrained, no dtype given): loads, dtype {bf16.dtype}, "
          f"config dtype {getattr(bf16.config, 'dtype', None)}")
    verdict(f"check 3 (export after {mesh} fine-tuning: greedy text, logits)", ok and diff <= LOGITS_ATOL, results)


def attempt(name: str, check, results: dict) -> None:
    """Run one check; a failing jaxpar command (or a Python error) fails it, and the others still run."""
    try:
        check()
    except CommandFailed as err:
        print(f"jaxpar command failed, {err}")
        verdict(name, False, results)
    except Exception as err:  # noqa: BLE001 - report and go on to the other checks
        print(f"{type(err).__name__}: {err}")
        verdict(name, False, results)


def main(build=build_model, sample_meshes: tuple = ("dp=1", "tp=2"), train_mesh: str = "tp=2",
         work: str = "/tmp/check_hf_llama", doc: str = __doc__) -> None:
    """Set up, run the three checks on `build`'s model, print the summary; exit 1 if any failed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--jaxpar-python", default=str(ROOT / ".venv" / "bin" / "python"),
                        help="a Python with jaxpar installed (default: the repo's .venv)")
    parser.add_argument("--work", type=Path, default=Path(work),
                        help=f"where the model, data, run and exports go (default: {work})")
    args = parser.parse_args()
    import transformers
    transformers.utils.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, jaxpar from {args.jaxpar_python}")
    start, python, work = time.perf_counter(), args.jaxpar_python, args.work.resolve()
    try:
        setup(python, work, build)
    except CommandFailed as err:
        sys.exit(f"setup failed: jaxpar command failed, {err}")
    model, tokenizer = load_hf(work / "hf", dtype=torch.float32, attn_implementation="eager")
    results = {}
    attempt("check 1 (eval --hf loss)", lambda: check_eval(python, work, model, results), results)
    attempt(f"check 2 (sample --hf greedy, {' and '.join(sample_meshes)})",
            lambda: check_sample(python, work, model, tokenizer, results, sample_meshes), results)
    attempt(f"check 3 (export after {train_mesh} fine-tuning: greedy text, logits)",
            lambda: check_export(python, work, results, train_mesh), results)
    print(f"== summary ({time.perf_counter() - start:.0f} s) ==")
    for name, ok in results.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    sys.exit(0 if all(results.values()) else 1)


if __name__ == "__main__":
    main()
