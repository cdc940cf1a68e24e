"""Benchmark (not a test): each FP8 recipe's signal-to-noise ratio against bf16 at Llama-3-8B's MLP
shape (tokens x 4096 -> 14336), the output, dX and dW of one up-projection, as torchao's
test_float8_linear measures it (tests/test_fp8.py holds them to 20 dB). Prints Markdown.

    python scripts/experiments/fp8_snr.py [--tokens 2048]
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.nn import recipes
from jaxpar.nn.recipes.fp8 import Fp8


def snr_db(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return 10 * np.log10(np.sum(want ** 2) / np.sum((got - want) ** 2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    tokens, d, f = ap.parse_args().tokens, 4096, 14336
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(tokens, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(d, f)) * d ** -0.5, jnp.bfloat16)
    g = jnp.asarray(rng.normal(size=(tokens, f)) * 1e-3, jnp.float32)

    def results(recipe):
        y, back = jax.vjp(jax.jit(functools.partial(recipe.project, "td,df->tf")), x, w)
        return (y, *back(g))
    want = results(recipes.default("bfloat16"))
    print(f"| model.fp8 | output dB | dX dB | dW dB |  ({tokens} x {d} -> {f}, bf16 operands) |")
    print("|---|---|---|---|---|")
    for name, cls in recipes.RECIPES.items():
        if issubclass(cls, Fp8):
            got = results(cls("bfloat16"))
            print(f"| {name} | " + " | ".join(f"{snr_db(a, b):.1f}" for a, b in zip(got, want, strict=True)) + " | |")


if __name__ == "__main__":
    main()
