"""gpu_check.py's grouped-GEMM section: the experts' GEMM by every kernel and lowering this jax has
(the plan's, the blocked GEMM, XLA's `ragged_dot`, jax's Pallas-Triton lowering of it, XLA's cuDNN
grouped GEMM) against one dense dot of the same rows, forward and forward + backward, each one's
output against `ragged_dot`'s."""

import functools
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp


def timed(fn, *args, repeats: int = 10) -> float:
    """Seconds per call, compiled and warmed first."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


RAGGED_ROUTES = {  # jax.lax.ragged_dot lowered another way: (XLA options, jax's Pallas-Triton lowering)
    "ragged_dot, Pallas-Triton lowering": ({}, True),  # jax's, all three legs (GPUs; elsewhere XLA's)
    "ragged_dot, cuDNN fusion": ({"xla_gpu_experimental_use_ragged_dot_fusion": True}, False),  # forward, dlhs
}


def jitted(fn, options: dict | None = None, triton: bool = False):
    """jit(fn) compiled with XLA `options`, traced and lowered with jax's Pallas-Triton
    ragged_dot lowering on or off (a jit-keyed switch with no public context manager)."""
    from jax._src import config as jax_config
    compiled = jax.jit(fn, compiler_options=options or None)

    def call(*args):
        with jax_config.jax_ragged_dot_use_gpu_pallas_triton_lowering(triton):
            return compiled(*args)
    return call


MOSAIC = {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1}  # in jax's own sweep


def mosaic_gemm():
    """x (rows, K) @ w[group] (G, K, N) by jax's Mosaic-GPU kernels for Hopper (jax.experimental.
    pallas.ops.gpu), all three legs: ragged_dot, it with the weights transposed (dlhs), and
    transposed_ragged_dot (drhs); bf16 in and out, returned as float32 like the others."""
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    from jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu import transposed_ragged_dot

    @jax.custom_vjp
    def gemm(x, w, sizes):
        return ragged_dot(x, w, group_sizes=sizes, **MOSAIC).astype(jnp.float32)

    def forward(x, w, sizes):
        return gemm(x, w, sizes), (x, w, sizes)

    def backward(saved, dy):
        x, w, sizes = saved
        dy = dy.astype(x.dtype)
        dx = ragged_dot(dy, w, group_sizes=sizes, transpose_rhs=True, **MOSAIC)
        return dx, transposed_ragged_dot(x, dy, group_sizes=sizes, **MOSAIC).astype(w.dtype), None

    gemm.defvjp(forward, backward)
    return gemm


def gemm_kinds(gemm_here: str) -> dict:
    """{name: (fn(x, w, sizes), XLA options, Pallas-Triton lowering)} of the GEMMs measured."""
    from jaxpar.nn import grouped_gemm
    kinds = {"dense": (lambda x, w, _: (x @ w[0]).astype(jnp.float32), {}, False)}
    for gemm in dict.fromkeys((gemm_here, "blocks", "ragged_dot")):
        fn = (grouped_gemm.blocked_gemm if gemm == "blocks" else
              functools.partial(grouped_gemm.grouped_gemm, gemm=gemm, interpret=jax.default_backend() != "tpu"))
        kinds[gemm] = (fn, {}, False)
    ragged = functools.partial(grouped_gemm.grouped_gemm, gemm="ragged_dot")
    kinds |= {name: (ragged, options, triton) for name, (options, triton) in RAGGED_ROUTES.items()}
    if jax.default_backend() == "gpu" and any(h in jax.devices()[0].device_kind for h in ("H100", "H200")):  # wgmma
        kinds["jax Mosaic-GPU ragged_dot"] = (mosaic_gemm(), {}, False)
    return kinds


def gemm_rows(shape) -> list[dict]:
    """The plan's grouped GEMM, the blocked GEMM, XLA's ragged_dot and its other lowerings against
    one dense dot of the same rows; each one's largest difference from ragged_dot's output,
    relative to its largest. A kind that fails gives its error's line in its row."""
    from jaxpar.nn import moe
    gemm_here, note = moe.gemm_of(SimpleNamespace(moe_gemm="auto"), jax.default_backend())
    M, K, N = shape.gemm
    rows = []
    for experts in shape.experts:
        keys = jax.random.split(jax.random.key(0), 2)
        x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
        w = jax.random.normal(keys[1], (experts, K, N), jnp.bfloat16) * 0.02
        sizes = jnp.full((experts,), M // experts, jnp.int32)
        kinds = gemm_kinds(gemm_here)
        exact = jax.jit(kinds["ragged_dot"][0])(x, w, sizes)
        for kind, (fn, options, triton) in kinds.items():
            row = {"experts": experts, "gemm": kind, "rows": M, "note": note if kind == gemm_here else None}
            try:  # a lowering this jax or GPU lacks keeps the other rows
                loss = lambda x, w, s, fn=fn: jnp.sum(fn(x, w, s))
                forward = jitted(fn, options, triton)
                out = forward(x, w, sizes)
                diff = None if kind == "dense" else float(jnp.max(jnp.abs(out - exact)) / jnp.max(jnp.abs(exact)))
                row |= {"max_rel_diff_vs_ragged_dot": diff, "forward_ms": 1e3 * timed(forward, x, w, sizes),
                        "forward_backward_ms": 1e3 * timed(jitted(jax.grad(loss, (0, 1)), options, triton), x, w, sizes)}
            except Exception as error:  # noqa: BLE001
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            rows.append(row)
    return rows
