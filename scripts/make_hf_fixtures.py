"""Make the Hugging Face GPT-2 test fixtures with real transformers, and check an export with it.

Needs torch and transformers, which jaxpar itself never does: run it in a separate venv, e.g.

    python -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers safetensors numpy
    /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py            # writes tests/fixtures/hf_gpt2_tiny

The fixture is a tiny random GPT2LMHeadModel (vocab 101, not a multiple of 64, so jaxpar's
vocabulary padding is exercised), saved with save_pretrained, with its float32 logits on a fixed
2 x 16 input: tests/test_hf.py loads it into jaxpar and compares.

    /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py --check HF_DIR --ckpt RUN_DIR

loads an export (python -m jaxpar.export) with transformers and compares its logits and greedy
tokens with jaxpar's own from the run's checkpoint. jaxpar runs from this checkout in
--jaxpar-python (default: this Python), which needs jaxpar's dependencies, e.g. .venv/bin/python.
"""

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "hf_gpt2_tiny"
SEED = 1234
INPUT_SHAPE = (2, 16)


def make_fixture(out: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                        activation_function="gelu_new", bos_token_id=100, eos_token_id=100,
                        initializer_range=0.2)  # GPT-2's 0.02 gives logits near 0: a weaker test
    model = GPT2LMHeadModel(config).eval()
    # The init leaves every bias and LayerNorm at 0 and 1: random ones check their mapping too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    input_ids = np.random.default_rng(SEED).integers(0, config.vocab_size, INPUT_SHAPE)
    with torch.no_grad():
        logits = model(torch.from_numpy(input_ids)).logits.float().numpy()
    np.save(out / "input_ids.npy", input_ids.astype(np.int32))
    np.save(out / "logits.npy", logits.astype(np.float32))
    sizes = ", ".join(f"{p.name} {p.stat().st_size:,} B" for p in sorted(out.iterdir()))
    print(f"wrote {out}: {sizes}")


JAXPAR_SIDE = """
import json, sys
import jax, numpy as np
from jaxpar.inference import sample
from jaxpar.models.family import abstract_model
run_dir, ids_file, logits_file, prompt, new_tokens = sys.argv[1:]
model = sample.load(run_dir)
ids = np.load(ids_file)
net, _, _ = abstract_model(model.cfg, model.vocab_size)
with jax.set_mesh(model.mesh):
    logits = jax.jit(net)(model.params, ids)
np.save(logits_file, np.asarray(logits)[..., :model.tokenizer.vocab_size])
generated = sample.generate(model, prompt, int(new_tokens), temperature=0)
print(json.dumps(generated.texts[0]))
"""


def jaxpar_side(python: str, run_dir: Path, ids: np.ndarray, prompt: str, new_tokens: int):
    """(jaxpar's logits of ids, its greedy text after prompt), from `python`, which has jax."""
    import json
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        np.save(f"{tmp}/ids.npy", ids)
        env = os.environ | {"PYTHONPATH": str(ROOT)}
        done = subprocess.run([python, "-c", JAXPAR_SIDE, str(Path(run_dir).resolve()),
                               f"{tmp}/ids.npy", f"{tmp}/logits.npy", prompt, str(new_tokens)],
                              cwd=ROOT,
                              capture_output=True, text=True, env=env)
        if done.returncode:
            sys.exit(f"the jaxpar side failed:\n{done.stderr}")
        return np.load(f"{tmp}/logits.npy"), json.loads(done.stdout.strip().splitlines()[-1])


def check_export(export_dir: Path, run_dir: Path, prompt: str, new_tokens: int, python: str) -> None:
    """Compare transformers on the export with jaxpar on the run it came from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(export_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    vocab, block = model.config.vocab_size, model.config.n_positions
    ids = np.random.default_rng(SEED).integers(0, vocab, (2, min(16, block))).astype(np.int32)
    prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
    new_tokens = min(new_tokens, block - prompt_ids.shape[1])  # transformers stops at n_positions
    jaxpar_logits, jaxpar_text = jaxpar_side(python, run_dir, ids, prompt, new_tokens)
    with torch.no_grad():
        logits = model(torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()
    diff = np.abs(logits - jaxpar_logits)
    print(f"logits on {ids.shape[0]} x {ids.shape[1]} random tokens: max abs diff {diff.max():.3g}, "
          f"max rel diff {(diff / np.maximum(np.abs(jaxpar_logits), 1e-6)).max():.3g} "
          f"(largest |logit| {np.abs(jaxpar_logits).max():.3g})")
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=new_tokens, do_sample=False,
                             attention_mask=torch.ones_like(prompt_ids),
                             pad_token_id=model.config.eos_token_id or 0)
    hf_text = tokenizer.decode(out[0].tolist())
    same = hf_text == jaxpar_text
    print(f"greedy {new_tokens} tokens after {prompt!r}: transformers and jaxpar "
          f"{'match' if same else 'DIFFER'}")
    print(f"  transformers: {hf_text!r}")
    print(f"  jaxpar:       {jaxpar_text!r}")
    if not same:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURE, help=f"default: {FIXTURE}")
    parser.add_argument("--check", type=Path, metavar="HF_EXPORT_DIR",
                        help="compare this export with its run (--ckpt) instead of making fixtures")
    parser.add_argument("--ckpt", type=Path, metavar="RUN_DIR", help="the run exported to --check")
    parser.add_argument("--prompt", default="ROMEO:\n", help="for the greedy generation")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--jaxpar-python", default=sys.executable,
                        help="a Python with jaxpar's dependencies (default: this one)")
    args = parser.parse_args()
    if args.check is None:
        make_fixture(args.out)
    elif args.ckpt is None:
        parser.error("--check needs --ckpt RUN_DIR, the run that was exported")
    else:
        check_export(args.check, args.ckpt, args.prompt, args.new_tokens, args.jaxpar_python)


if __name__ == "__main__":
    main()
