"""Benchmark (not a test): FP8 against bf16 over whole runs. Each config trains in bf16 under every
FP8 recipe and without one (model.fp8=none), for the same seeds, each run in its own process on
the quick start's mesh; the table gives each recipe's final val losses, their mean, and the mean's
difference from bf16's. Prints Markdown; the runs stay under --out.

    python scripts/experiments/fp8_convergence.py --out /tmp/fp8runs [--configs shakespeare_char_cpu,shakespeare_llama_cpu]
        [--recipes none,tensorwise,rowwise] [--seeds 0,1,2] [--mesh dp=2,tp=2]
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def final_val_loss(run: Path) -> float:
    return json.loads((run / "run.json").read_text())["summary"]["final_val_loss"]


def train(config: str, recipe: str, seed: int, mesh: str, run: Path) -> float:
    if not (run / "run.json").exists():
        cmd = [sys.executable, "-m", "jaxpar.train", "--config", config, "--mesh", mesh, "--seed", str(seed),
               "--model.dtype=bfloat16", f"--model.fp8={recipe}", "--out", str(run)]
        start = time.time()
        done = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        print(f"{run.name}: {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    return final_val_loss(run)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--configs", default="shakespeare_char_cpu,shakespeare_llama_cpu")
    ap.add_argument("--recipes", default="none,tensorwise,rowwise")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--mesh", default="dp=2,tp=2")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"| config | model.fp8 | final val loss, seeds {', '.join(map(str, seeds))} | mean | against bf16 |")
    print("|---|---|---|---|---|")
    for config in args.configs.split(","):
        means = {}
        for recipe in args.recipes.split(","):
            losses = [train(config, recipe, s, args.mesh, args.out / f"{config}-{recipe}-{s}") for s in seeds]
            means[recipe] = sum(losses) / len(losses)
            against = f"{means[recipe] / means['none'] - 1:+.2%}" if "none" in means and recipe != "none" else ""
            print(f"| {config} | {recipe} | {', '.join(f'{v:.4f}' for v in losses)} | {means[recipe]:.4f} | {against} |",
                  flush=True)


if __name__ == "__main__":
    main()
