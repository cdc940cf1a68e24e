"""bf16 against FP8 on one GPU, in one command that ends within `--budget` seconds: issue 73's GPU
measurements, run after issue 64's session (gpu_session.py) on a lent GPU.

    python scripts/tools/gpu_fp8.py --out DIR                          # on one NVIDIA GPU (8.9 and up)
    JAX_PLATFORMS=cpu python scripts/tools/gpu_fp8.py --tiny --out DIR  # the rehearsal on a CPU

1. GPT-2 124M and Llama 3.2 1B (bf16) under model.fp8 none, tensorwise and rowwise: the median
   step's tokens/s and MFU (model.dtype's peak), and the loss over the steps (300; its last and the
   mean of its last 50) against none's.
2. The experts' grouped GEMM at OLMoE-1B-7B's shapes (64 experts, 2048 -> 1024, 8 of them a
   token), forward + backward, through each recipe (jaxpar.nn.recipes) by the plan's kernel here.
It writes DIR/gpu_fp8.md as each row ends; a switch becomes a default only where it is faster
with the loss within 1%.
"""

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import run_once
from gpu_gemm import timed

RECIPES = ("none", "tensorwise", "rowwise")
FULL = SimpleNamespace(configs=(("gpt2", {"train.batch_size": 16}), ("llama3.2-1b", {"train.batch_size": 4})),
                       steps=300, tail=50, gemm=(8192, 2048, 1024, 64))
TINY = SimpleNamespace(configs=(("tiny", {}), ("tiny_llama", {})), steps=6, tail=2, gemm=(256, 32, 16, 8))


def train_row(config: str, keys: dict, recipe: str, shape) -> dict:
    """One run's speed and losses in `recipe`, bf16, one device, one pass a step."""
    result = run_once(config, shape.steps, **keys, **{"model.dtype": "bfloat16", "model.fp8": recipe,
                                                      "train.micro_batch": "0"})
    losses = [result.losses[s] for s in sorted(result.losses)]
    summary = result.info["summary"]
    return {"config": config, "recipe": recipe, "tokens_per_s": summary["tokens_per_s_median"],
            "mfu": summary["mfu_median"], "last": losses[-1], "tail": float(np.mean(losses[-shape.tail:]))}


def gemm_row(recipe: str, shape) -> dict:
    """The grouped GEMM's forward + backward in `recipe` (bf16 operands), even groups, its ms."""
    from jaxpar.core.execution import ExecutionPlan
    from jaxpar.nn import moe, recipes
    from jaxpar.nn.grouped_gemm import kernel_gemm
    rows, d, f, experts = shape.gemm
    m = SimpleNamespace(dtype="bfloat16", fp8=recipe, fp8_head=False)
    platform = jax.devices()[0].platform
    kernel = moe.gemm_of(SimpleNamespace(moe_gemm="auto", n_experts=experts), platform)[0]
    chosen = recipes.recipe_for(m, platform, jax.devices()[0].device_kind) if platform != "tpu" else None
    recipe_obj = recipes.of(ExecutionPlan(platform=platform, recipe=chosen), jnp.bfloat16)
    sizes = jnp.full((experts,), rows // experts, jnp.int32)
    gemm = recipe_obj.grouped(lambda x, w, s: kernel_gemm(x, w, s, kernel, platform != "tpu"), sizes)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(rows, d)), jnp.bfloat16)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(experts, d, f)) * d ** -0.5, jnp.bfloat16)
    step = jax.jit(jax.grad(lambda x, w: jnp.sum(gemm(x, w)), argnums=(0, 1)))
    return {"recipe": recipe, "kernel": kernel, "ms": 1e3 * timed(step, x, w)}


def table(trains: list[dict], gemms: list[dict]) -> str:
    base = {r["config"]: r for r in trains if r["recipe"] == "none"}
    lines = ["| config | model.fp8 | tokens/s | vs none | MFU | last loss | mean of the last | vs none |",
             "|---|---|---|---|---|---|---|---|"]
    for r in trains:
        b = base.get(r["config"], r)
        lines.append(f"| {r['config']} | {r['recipe']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x | {r['mfu']:.1%} | {r['last']:.4f} | "
                     f"{r['tail']:.4f} | {r['tail'] / b['tail'] - 1:+.2%} |")
    lines += ["", "| grouped GEMM, fwd + bwd | kernel | ms |", "|---|---|---|"]
    lines += [f"| {g['recipe']} | {g['kernel']} | {g['ms']:.3f} |" for g in gemms]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: the rehearsal on a CPU")
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds; past it nothing starts")
    args = parser.parse_args(argv)
    shape, end = (TINY if args.tiny else FULL), time.monotonic() + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    trains, gemms = [], []
    for recipe in RECIPES:  # the GEMMs first: seconds each
        if time.monotonic() < end:
            gemms.append(gemm_row(recipe, shape))
    for config, keys in shape.configs:
        for recipe in RECIPES:
            if time.monotonic() < end:
                trains.append(train_row(config, keys, recipe, shape))
                (args.out / "gpu_fp8.md").write_text(table(trains, gemms))
    text = table(trains, gemms)
    (args.out / "gpu_fp8.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
