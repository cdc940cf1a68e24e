"""The DeepSeek-V3 family's kernels on one GPU, in one command (about 4 minutes on one GPU).

    python scripts/tools/gpu_deepseek.py --out DIR                          # on an NVIDIA GPU
    JAX_PLATFORMS=cpu python scripts/tools/gpu_deepseek.py --tiny --out DIR  # tiny shapes, on a CPU

It prints one table, and writes it to DIR/gpu_deepseek.md and DIR/gpu_deepseek.json:
1. Attention at latent attention's head dims (Moonlight's: 16 heads of 128 + 64 query-key dims,
   the 128 value dims padded to 192 as the model passes them), bfloat16, causal: the kernel that
   `model.attention=auto` runs here (tokamax's Triton kernel on a GPU), jaxpar's xla attention and
   cuDNN asked for the same heads: forward + backward time, and each output's and gradient's
   error relative to a float32 reference.
2. `moonlight-16b-a3b` cut to 4 layers (the dense one and 3 of 64 routed experts, top-6, beside 2
   shared), block 4096, 4 rows in one pass (--moonlight-rows): a step with the plan's grouped
   GEMM (`auto`) and with XLA's `ragged_dot` (--moonlight-gemms): median step, tokens/s, MFU, peak
   memory.
3. The quick start (`shakespeare_deepseek_cpu`, float32) for a few steps with the plan's kernels
   and with `ragged_dot` and xla attention: tokens/s and the largest difference between the two
   runs' losses.
"""

import argparse
import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check beside it, however this is loaded
from gpu_check import peak_memory_gib, run_once, run_sections, timed

FULL = SimpleNamespace(attention=(2, 16, 4096, 192, 128), moonlight={"model.n_layer": 4, "model.block_size": 4096,
                       "train.batch_size": 4, "train.micro_batch": 4}, moonlight_steps=6, quick_steps=60)
TINY = SimpleNamespace(attention=(1, 2, 128, 48, 32), moonlight={"model.n_layer": 2, "model.block_size": 64,
                       "model.n_embd": 64, "model.n_head": 2, "model.kv_lora_rank": 32, "model.qk_nope_head_dim": 16,
                       "model.qk_rope_head_dim": 8, "model.v_head_dim": 16, "model.mlp_dim": 128,
                       "model.moe_mlp_dim": 32, "model.vocab_size": 512, "model.dtype": "float32",
                       "train.batch_size": 2, "train.micro_batch": 2}, moonlight_steps=3, quick_steps=3)


def relative_error(a, b) -> float:
    a, b = (jnp.asarray(x, jnp.float32) for x in (a, b))
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def attention_rows(shape) -> list[dict]:
    """Each kernel at latent attention's head dims: fwd+bwd ms, errors against float32."""
    from jaxpar.nn import kernels, tokamax_kernels
    from jaxpar.nn.attention import causal_attention
    B, H, T, D, Dv = shape.attention
    q, k, v, cot = (jax.random.normal(key, (B, H, T, D), jnp.float32) for key in jax.random.split(jax.random.key(0), 4))
    v = v.at[..., Dv:].set(0.0)  # the model pads the values to the query-key width
    cot = cot.transpose(0, 2, 1, 3)
    flash = lambda q, k, v: jax.nn.dot_product_attention(*(a.transpose(0, 2, 1, 3) for a in (q, k, v)),
                                                         is_causal=True, implementation="cudnn")
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    auto = kernels.resolve(SimpleNamespace(attention="auto", head_size=D, dropout=0.0, dtype="bfloat16",
                                           block_size=T), jax.default_backend(),
                           cudnn_heads=kernels.cudnn_head_max(jax.devices()[0]))
    ways = {"xla": lambda q, k, v: causal_attention(q, k, v, 0.0, None),
            "tokamax": lambda q, k, v: tokamax_kernels.attention(q, k, v, on_gpu=on_gpu), "cudnn": flash}
    grads = lambda fn: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cot),
                                                  (0, 1, 2)))
    _, exact = grads(ways["xla"])(q, k, v)
    exact_out = ways["xla"](q, k, v)
    rows = []
    for name, fn in ways.items():
        row = {"kernel": name, "auto": name == auto[0], "shape": [B, H, T, D], "value_dims": Dv}
        try:
            low = [a.astype(jnp.bfloat16) for a in (q, k, v)]
            out, (_, dgrads) = jax.jit(fn)(*low), grads(fn)(*low)
            row.update({"error_out": relative_error(out, exact_out),
                        **{f"error_d{n}": relative_error(g, e) for n, g, e in zip("qkv", dgrads, exact)},
                        "forward_backward_ms": 1e3 * timed(grads(fn), *low)})
        except Exception as error:  # noqa: BLE001  (cuDNN refuses some head dims: its line is the figure)
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:240]}"
        rows.append(row)
    return rows


def moonlight_rows(shape, gemms: tuple) -> list[dict]:
    rows = []
    for gemm in gemms:
        run = (f"moonlight-16b-a3b, {shape.moonlight['model.n_layer']} layers, "
               f"{shape.moonlight['train.batch_size']} rows in a pass, moe_gemm={gemm}")
        try:  # XLA's ragged_dot may not fit: its backward is a dense product over all 64 experts
            result = run_once("moonlight-16b-a3b", shape.moonlight_steps, **shape.moonlight, **{"model.moe_gemm": gemm})
        except Exception as error:  # noqa: BLE001
            rows.append({"run": run, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:240]}"})
            continue
        rows.append({"run": run, **result.info["summary"], "peak_gib": peak_memory_gib(),
                     "compile_s": result.info["compile_s"], "execution": result.info["execution"]})
    return rows


def quick_start_rows(shape) -> list[dict]:
    results = {name: run_once("shakespeare_deepseek_cpu", shape.quick_steps, **keys) for name, keys in
               (("plan's kernels", {}), ("ragged_dot, xla attention", {"model.moe_gemm": "ragged_dot",
                                                                     "model.attention": "xla"}))}
    first = next(iter(results.values())).losses
    return [{"run": f"shakespeare_deepseek_cpu, {name}", **r.info["summary"], "peak_gib": None,
             "execution": r.info["execution"],
             "max_loss_diff": max(abs(r.losses[s] - first[s]) for s in first), "last_loss": r.losses[max(r.losses)]}
            for name, r in results.items()]


def table(found: dict) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = [f"device: {found['device']}, jax {found['jax']}, {found['date']}"]
    lines += [f"\n{name} failed: {error}" for name, error in found["errors"].items()]
    if "attention" in found:
        lines += ["", "| kernel | fwd+bwd ms | rel. error out / dq / dk / dv |", "|---|---|---|"]
        lines += [f"| {r['kernel']}{' (auto)' if r['auto'] else ''} {r['shape']} v {r['value_dims']} | "
                  + (f"{r['forward_backward_ms']:.3f} | " + " / ".join(f"{r['error_' + n]:.1e}" for n in
                                                                      ("out", "dq", "dk", "dv")) + " |"
                     if "error" not in r else f"- | {r['error']} |") for r in found["attention"]]
    runs = found.get("moonlight", []) + found.get("quick_start", [])
    if runs:
        lines += ["", "| run | step ms | tokens/s | MFU | peak GiB | max loss diff |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['run']} | {r['step_time_ms_median']:,.2f} | {r['tokens_per_s_median']:,.0f} | "
                  f"{r['mfu_median']:.1%} | {fmt(r['peak_gib'], '.2f')} | {fmt(r.get('max_loss_diff'), '.2e')} |"
                  if "error" not in r else f"| {r['run']} | {r['error']} | | | | |" for r in runs]
        lines += ["", *(f"{r['run']}: attention {r['execution']['attention']}, grouped GEMM "
                        f"{r['execution'].get('moe', {}).get('grouped_gemm')}" for r in runs if "execution" in r)]
    return "\n".join(lines)


SECTIONS = ("attention", "moonlight", "quick_start")


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, on a CPU")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"some of {','.join(SECTIONS)}")
    parser.add_argument("--moonlight-rows", type=int, help="Moonlight's rows in one pass (default: 4, tiny: 2)")
    parser.add_argument("--moonlight-gemms", default="auto,ragged_dot",
                        help="Moonlight's grouped GEMMs, in order; one a process gives each its own peak memory")
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else FULL
    if args.moonlight_rows:
        rows = {"train.batch_size": args.moonlight_rows, "train.micro_batch": args.moonlight_rows}
        shape = SimpleNamespace(**{**vars(shape), "moonlight": {**shape.moonlight, **rows}})
    args.out.mkdir(parents=True, exist_ok=True)
    measure = {"attention": attention_rows, "quick_start": quick_start_rows,
               "moonlight": functools.partial(moonlight_rows, gemms=tuple(args.moonlight_gemms.split(",")))}
    found = run_sections({name: functools.partial(measure[name], shape) for name in args.sections.split(",")},
                         table, args.out / "gpu_deepseek")
    print(table(found))
    return found


if __name__ == "__main__":
    main(sys.argv[1:])
