"""The checks that need a real GPU or TPU, in one table: run it on one when it is at hand.

    python scripts/tools/accelerator_check.py            # on a GPU or TPU machine, jaxpar installed
    python scripts/tools/accelerator_check.py --steps 10 --batch 8   # a quicker pass

1. Kernel equivalence: the platform's fused attention (splash on TPU, cuDNN on NVIDIA GPUs)
   against the xla kernel, value and gradients, at GPT-2's head shape (float32 for splash,
   bfloat16 for cuDNN, which takes nothing wider).
2. One data-parallel step's collectives over 'data' (all devices on dp), at one row per pass
   against one pass per step: the gradients are reduced once a step either way.
3. GPT-2 124M for --steps steps on the built-in data (block 1024, bfloat16), the xla kernel
   against the fused one: median tokens/s and MFU.
"""

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp


def kernel_errors(kernel: str, dtype) -> list[float]:
    """Relative max errors of the fused kernel against xla: output, then dq, dk, dv."""
    from jaxpar.nn.attention import causal_attention
    from jaxpar.nn.kernels import cudnn, splash
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (4, 12, 1024, 64), dtype) for key in keys[:3])
    weights = jax.random.normal(keys[3], (4, 1024, 12, 64), jnp.float32)
    fused = functools.partial(splash, interpret=False) if kernel == "splash" else cudnn
    xla = lambda q, k, v: causal_attention(q, k, v, 0.0, None)  # noqa: E731
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * weights)  # noqa: E731
    pairs = [(fused(q, k, v), xla(q, k, v))]
    pairs += list(zip(jax.grad(loss(fused), (0, 1, 2))(q, k, v), jax.grad(loss(xla), (0, 1, 2))(q, k, v)))
    return [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                  / jnp.max(jnp.abs(b.astype(jnp.float32)))) for a, b in pairs]


def data_reductions(micro_batch: int, batch: int) -> str:
    """'count x, MiB' of one step's all-reduces and reduce-scatters, all devices on dp."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from grad_reductions import data_collectives  # scripts/tools/grad_reductions.py

    from jaxpar.core.config import load_config
    from jaxpar.data.loader import load_dataset
    from jaxpar.parallel import hlo
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.step.build import build
    cfg = load_config("gpt2", {"mesh.dp": str(jax.device_count()), "train.micro_batch": str(micro_batch),
                               "train.batch_size": str(batch), "train.zero": "1"})
    tokenizer = load_dataset(cfg.data, cfg.model.block_size).tokenizer
    ops = hlo.collective_ops(build(cfg, build_mesh(cfg), tokenizer).compile_abstract().as_text())
    found = data_collectives(ops, jax.device_count())
    reductions = [found[kind] for kind in ("all-reduce", "reduce-scatter") if kind in found]
    return f"{sum(n for n, _ in reductions)}x, {sum(mib for _, mib in reductions):,.1f} MiB"


def bench(kernel: str, steps: int, batch: int) -> dict:
    from jaxpar.core.config import load_config
    from jaxpar.train import run
    overrides = {"mesh.dp": str(jax.device_count()), "model.attention": kernel, "train.steps": str(steps),
                 "train.batch_size": str(batch), "train.eval_every": "0", "ckpt.every": "0"}
    return run(load_config("gpt2", overrides), out_dir=None, progress=False).info["summary"]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=0, help="sequences per step (default 8 per device)")
    args = parser.parse_args(argv)
    platform = jax.default_backend()
    kernel = {"tpu": "splash", "gpu": "cudnn"}.get(platform)
    if kernel is None:
        sys.exit(f"accelerator_check: needs a GPU or TPU, and JAX's platform is {platform}")
    batch = args.batch or 8 * jax.device_count()
    device = jax.devices()[0]
    rows = [f"device: {device.device_kind} x {jax.device_count()} ({platform}), jax {jax.__version__}", "",
            "| check | result |", "|---|---|"]
    errors = kernel_errors(kernel, jnp.float32 if kernel == "splash" else jnp.bfloat16)
    rows.append(f"| {kernel} vs xla, out / dq / dk / dv (max rel. error) | "
                + " / ".join(f"{e:.1e}" for e in errors) + " |")
    rows.append(f"| data reductions a step, micro-batch 1 ({batch // jax.device_count()} passes) | "
                f"{data_reductions(1, batch)} |")
    rows.append(f"| data reductions a step, one pass | {data_reductions(batch // jax.device_count(), batch)} |")
    for name in ("xla", kernel):
        summary = bench(name, args.steps, batch)
        rows.append(f"| GPT-2 124M, {name}, batch {batch} x 1024, {args.steps} steps | "
                    f"{summary['tokens_per_s_median']:,.0f} tok/s, MFU {summary['mfu_median']:.1%} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
