"""Benchmark (not a test): why the FP8 recipes are refused on TPU v5e and v5p. One projection at
Llama-3-8B's MLP shape (2048 tokens, 4096 -> 14336), forward and both gradients, compiled for one
chip of each (compile-only, libtpu) in bf16 and in tensorwise FP8: the operand types of the
optimized HLO's dots, XLA's cost analysis (FLOPs, bytes accessed), and each one's roofline time at
the chip's bf16 peak and HBM bandwidth (jaxpar.planning.hardware.CHIPS: neither chip has an FP8
rate). Prints Markdown.

    python scripts/experiments/fp8_tpu_check.py      # needs libtpu: pip install -e '.[tpu]'
"""

import functools
import re

import jax
import jax.numpy as jnp

from jaxpar.nn.recipes import default
from jaxpar.nn.recipes.fp8 import Tensorwise
from jaxpar.planning.hardware import CHIPS, parse_target, tpu_devices

T, D, F = 2048, 4096, 14336


def operand_types(text: str) -> list[str]:
    """Each dot's (or TPU convolution's) two operand types, looked up where they are defined."""
    types = dict(re.findall(r"%([\w.-]+) = (\w+)\[", text))
    dots = re.findall(r" (?:convolution|dot)\(%([\w.-]+), %([\w.-]+)\)", text)
    return [f"{types.get(a, '?')} x {types.get(b, '?')}" for a, b in dots]


def compiled(recipe, device):
    sharding = jax.sharding.SingleDeviceSharding(device)
    x, w = (jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in ((T, D), (D, F)))
    g = jax.ShapeDtypeStruct((T, F), jnp.float32, sharding=sharding)

    def step(x, w, g):
        y, back = jax.vjp(functools.partial(recipe.project, "td,df->tf"), x, w)
        return y, *back(g)
    return jax.jit(step).lower(x, w, g).compile()


def main():
    print("| chip | matmuls | dot operands (fwd, dX, dW) | GFLOP | MB accessed | roofline ms |")
    print("|---|---|---|---|---|---|")
    for name in ("tpu:v5e-8", "tpu:v5p-8"):
        target = parse_target(name)
        chip, device = CHIPS[target.generation], tpu_devices(target)[0]
        for recipe in (default("bfloat16"), Tensorwise("bfloat16")):
            c = compiled(recipe, device)
            cost = c.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            flops, moved = cost.get("flops", 0.0), cost.get("bytes accessed", 0.0)
            ms = 1e3 * max(flops / chip.peak_flops, moved / chip.hbm_bytes_per_s)
            print(f"| {name} | {recipe.name} | {'; '.join(operand_types(c.as_text()))} | {flops / 1e9:.0f} | "
                  f"{moved / 1e6:.0f} | {ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
