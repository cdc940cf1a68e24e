"""Benchmark (not a test): whether DeepSeek-V3's block-scaled FP8 (activations scaled per 1x128 tile
along the contracted dim, weights per 128x128 block) compiles to FP8 GEMMs for an H100, written in
JAX as one FP8 dot per 128-wide block of the contracted dim, each scaled and summed in float32. One
projection at Llama-3-8B's MLP shape (2048 tokens, 4096 -> 14336), forward and both gradients,
compile-only (jax[cuda12] with JAX_PLATFORMS=cpu): each GEMM's kernel, operands and result, and
XLA's temporaries, beside jaxpar's tensorwise recipe. Prints Markdown.

    JAX_PLATFORMS=cpu python scripts/experiments/fp8_block_scaled.py      # pip install -e '.[gpu]'
"""

import functools
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices: nothing runs here

import jax
import jax.numpy as jnp

from jaxpar.nn.recipes.fp8 import E4M3, Tensorwise
from jaxpar.planning.hardware import parse_target, target_devices

T, K, N, BLOCK = 2048, 4096, 14336, 128
BIG = float(jnp.finfo(E4M3).max)


def tiles(a):
    """a (rows, cols) -> (its e4m3 values (rows, cols/128, 128), a scale per 1x128 tile)."""
    rows, cols = a.shape
    blocks = a.reshape(rows, cols // BLOCK, BLOCK).astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=2, keepdims=True), 1e-12) / BIG
    return jnp.clip(blocks / scale, -BIG, BIG).astype(E4M3), scale


def squares(w):
    """w (K, N) -> (its e4m3 values (K/128, 128, N), a scale per 128x128 block (K/128, 1, N))."""
    blocks = w.reshape(K // BLOCK, BLOCK, N // BLOCK, BLOCK).astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(1, 3), keepdims=True), 1e-12) / BIG
    q = jnp.clip(blocks / scale, -BIG, BIG).astype(E4M3).reshape(K // BLOCK, BLOCK, N)
    return q, jnp.repeat(scale.reshape(K // BLOCK, 1, N // BLOCK), BLOCK, axis=2)


def blocked(xq, sx, wq, sw):
    """One FP8 dot per block of the contracted dim (batched), each scaled, summed in float32."""
    part = jnp.einsum("tkb,kbn->ktn", xq, wq, preferred_element_type=jnp.float32)
    return jnp.sum(part * jnp.transpose(sx, (1, 0, 2)) * sw, axis=0)


@jax.custom_vjp
def block_scaled(x, w):
    return blocked(*tiles(x), *squares(w))


def _forward(x, w):
    return block_scaled(x, w), (x, w)


def _backward(residuals, g):
    x, w = residuals
    gq, sg = tiles(g)
    wt = w.T.reshape(N // BLOCK, BLOCK, K // BLOCK, BLOCK).astype(jnp.float32)
    swt = jnp.maximum(jnp.max(jnp.abs(wt), axis=(1, 3), keepdims=True), 1e-12) / BIG
    wtq = jnp.clip(wt / swt, -BIG, BIG).astype(E4M3).reshape(N // BLOCK, BLOCK, K)
    dx = blocked(gq, sg, wtq, jnp.repeat(swt.reshape(N // BLOCK, 1, K // BLOCK), BLOCK, axis=2))
    (xq, sx), (gtq, sgt) = tiles(x.T), tiles(g.T)  # tiles along the tokens
    part = jnp.einsum("ktb,ntb->tkn", xq, gtq, preferred_element_type=jnp.float32)
    dw = jnp.sum(part * jnp.transpose(sx, (1, 0, 2)) * jnp.transpose(sgt, (1, 2, 0)), axis=0)
    return dx.astype(x.dtype), dw.astype(w.dtype)


block_scaled.defvjp(_forward, _backward)

GEMM = re.compile(r'= (\(?[\w\[\]{},. ]*?\)?) (?:custom-call|fusion)\(([^)]*)\).*?(__cublas\$lt\$matmul\$f8|'
                  r'__cublas\$lt\$matmul|__cublas\$gemm|__triton_nested_gemm_fusion|__triton_gemm)')
ARRAY = re.compile(r"\w+\[[\d,]*\]")


def first_array(result: str) -> str:
    """The first array of an instruction's result (a custom call's: its product, then its workspace)."""
    return ARRAY.search(result).group(0)


def main():
    device = target_devices(parse_target("gpu:h100-1"))[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    x, w = (jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in ((T, K), (K, N)))
    g = jax.ShapeDtypeStruct((T, N), jnp.float32, sharding=sharding)
    print("| recipe | GEMMs (kernel: result) | XLA temporaries |")
    print("|---|---|---|")
    for name, f in (("tensorwise", functools.partial(Tensorwise("bfloat16").project, "td,df->tf")),
                    ("block-scaled 1x128 / 128x128", block_scaled)):
        def step(x, w, g, f=f):
            y, back = jax.vjp(f, x, w)
            return y, *back(g)
        compiled = jax.jit(step, compiler_options={"xla_gpu_enable_triton_gemm": False}).lower(x, w, g).compile()
        found = [f"{kind}: {first_array(result)}" for result, _, kind in GEMM.findall(compiled.as_text())]
        temp = compiled.memory_analysis().temp_size_in_bytes / 2 ** 30
        print(f"| {name} | {'; '.join(found)} | {temp:.2f} GiB |", flush=True)


if __name__ == "__main__":
    main()
