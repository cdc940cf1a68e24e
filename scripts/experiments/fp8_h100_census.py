"""The GEMMs of a train step compiled for H100s from this machine (compile-only: jax[cuda12] with
JAX_PLATFORMS=cpu, no GPU, no autotuning) under each model.fp8 recipe, with XLA's Triton GEMMs on
and off: `__cublas$lt$matmul$f8` custom calls, the other cuBLAS GEMMs, Triton GEMM fusions of f8
operands and of bf16/f32 ones. FP8 GEMMs per layer are checked against three (forward, dX, dW) for
each of a layer's projections; the lm_head stays in model.dtype (model.fp8_head=false).

    JAX_PLATFORMS=cpu python scripts/experiments/fp8_h100_census.py [--target gpu:h100-8]
        [--configs gpt2,llama3.2-1b] [--recipes none,tensorwise,rowwise] [--n-layer N]
        [--hlo-dir DIR] [--section.field=value ...]

The step is jaxpar's (jaxpar.training.step.build, as jaxpar.plan compiles a candidate) at dp=8, one
sequence a device, bfloat16. Counts are runs per step: an instruction inside the layers' scan
counts once per iteration (jaxpar.parallel.hlo.multiplicities). cuDNN's attention calls are no
GEMMs here. The full GPT-2 124M and Llama 3.2 1B compile in about 10 minutes on 2 CPU cores
(GPT-2's 12 unrolled layers take most of it). Needs the gpu extra.
"""

import argparse
import collections
import datetime
import os
import platform
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices: nothing runs here

from jaxpar.planning.gemms import gemm_ops
from jaxpar.planning.hlo_ops import is_fp8

RECIPES = ("none", "tensorwise", "rowwise")
NO_TRITON = "xla_gpu_enable_triton_gemm=false"
# Each family's projections (name, forward einsum), as its block calls `project`:
# jaxpar/models/gpt2/model.py `block`, jaxpar/models/llama/model.py `attention_part` and `swiglu_mlp`.
PROJECTIONS = {
    "gpt2": (("qkv", "nc,cshd->nshd"), ("attn_out", "nhd,hdc->nc"), ("mlp_in", "nc,cf->nf"),
             ("mlp_out", "nf,cf->nc")),
    "llama": (("q", "nc,chd->nhd"), ("kv", "nc,cskd->nskd"), ("attn_out", "nhd,hdc->nc"),
              ("gate_up", "nc,czf->nzf"), ("mlp_out", "nf,cf->nc")),
}
KINDS = ("cublas_f8", "cublas_other", "triton_f8", "triton_other", "loose_dot")
OP_NAME = re.compile(r'op_name="([^"]*)"')
SPEC = re.compile(r"[a-z]+,[a-z]+->[a-z]+")
ARRAY = re.compile(r"\w+\[[\d,]*\]")  # a result's first array: the product, not a cuBLAS workspace


def kind_of(op, dtypes: str) -> str:
    """One of KINDS for a GEMM that jaxpar.planning.gemms found, by its op and operand types."""
    fp8 = all(is_fp8(t) for t in dtypes.split(" x "))
    if op.opcode == "custom-call":
        return "cublas_f8" if fp8 else "cublas_other"
    if op.opcode == "fusion":
        return "triton_f8" if fp8 else "triton_other"
    return "loose_dot"


def census(text: str) -> tuple[collections.Counter, collections.Counter]:
    """(runs per step of each GEMM kind, runs of the FP8 GEMMs by (einsum, pass), by ("formats",
    their f8 operands) and by (einsum, pass, result shape)): pass is 'backward' where jax's op
    name says transpose. The GEMMs are jaxpar.planning.gemms', as plan.json counts them."""
    kinds, fp8 = collections.Counter(), collections.Counter()
    for op, dtypes, runs in gemm_ops(text):
        kind = kind_of(op, dtypes)
        kinds[kind] += runs
        if kind.endswith("f8"):
            name = OP_NAME.search(op.line)
            name = name.group(1) if name else ""
            spec = SPEC.findall(name)
            where = "backward" if "transpose(" in name else "forward"
            fp8[(spec[-1] if spec else "?", where)] += runs
            fp8[(spec[-1] if spec else "?", where, ARRAY.search(op.shape).group(0))] += runs
            fp8[("formats", dtypes)] += runs
    return kinds, fp8


def by_projection(family: str, fp8: collections.Counter) -> list[tuple[str, int, int, int, str]]:
    """(projection, forward, dX, dW FP8 GEMM runs, the forward's result shapes), found by each
    pass's einsum: a forward merged with another's (XLA's dot merger) shows as a wider result."""
    from jaxpar.nn.recipes.base import gradient_specs
    rows = []
    for name, spec in PROJECTIONS[family]:
        dx, dw = gradient_specs(spec)
        shapes = " ".join(sorted({k[2] for k in fp8 if k[:2] == (spec, "forward") and len(k) == 3}))
        rows.append((name, fp8[(spec, "forward")], fp8[(dx, "backward")], fp8[(dw, "backward")], shapes or "-"))
    return rows


def compile_step(cfg, devices, vocab: int) -> tuple[str, float]:
    """(the optimized HLO of cfg's train step, seconds to build and compile it), as jaxpar.plan does."""
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.step.build import build
    start = time.perf_counter()
    compiled = build(cfg, build_mesh(cfg, devices), vocab=vocab).compile_abstract()
    return compiled.as_text(), time.perf_counter() - start


def configured(name: str, fp8: str, triton: bool, args, rest: dict):
    from jaxpar.core.config import load_config
    overrides = {"model.fp8": fp8, "model.dtype": "bfloat16", "mesh.dp": str(args.chips),
                 "train.batch_size": str(args.chips), "train.micro_batch": "1",
                 **({"model.n_layer": str(args.n_layer)} if args.n_layer else {}),
                 **({} if triton else {"train.xla_options": NO_TRITON}), **rest}
    return load_config(name, overrides)


def run(args, rest: dict) -> list[str]:
    """Every config x recipe x Triton setting compiled in turn; the Markdown rows."""
    from jaxpar.data.loader import load_dataset, model_ids
    from jaxpar.planning.hardware import parse_target, target_devices
    target = parse_target(args.target)
    devices = target_devices(target)
    args.chips = target.chips
    rows, details, total = [], [], 0.0
    for name in args.configs.split(","):
        for fp8 in args.recipes.split(","):
            for triton in (True, False):
                cfg = configured(name, fp8, triton, args, rest)
                vocab, _ = model_ids(cfg, load_dataset(cfg.data, cfg.model.block_size).tokenizer)
                text, seconds = compile_step(cfg, devices, vocab)
                total += seconds
                tag = f"{name}_{fp8}_{'triton' if triton else 'notriton'}"
                if args.hlo_dir:
                    with open(os.path.join(args.hlo_dir, tag + ".txt"), "w") as out:
                        out.write(text)
                rows.append(table_row(cfg, name, fp8, triton, *census(text), seconds, details))
                print(rows[-1], file=sys.stderr, flush=True)
    return rows + [""] + details + ["", f"total compile time: {total:,.0f} s"]


def table_row(cfg, name, fp8, triton, kinds, fp8_runs, seconds, details) -> str:
    """One Markdown row; a projection table for each FP8 step goes into `details`."""
    m = cfg.model
    family = "llama" if m.family == "llama" else "gpt2"
    layers, projections = m.n_layer, len(PROJECTIONS[family])
    f8 = kinds["cublas_f8"] + kinds["triton_f8"]
    per_layer = f8 / layers
    verdict = ("none, as expected" if fp8 == "none" and not f8 else
               f"= 3 x {projections}" if fp8 != "none" and per_layer == 3 * projections else
               f"DIFFERS from {3 * projections if fp8 != 'none' else 0}: see its projections")
    if fp8 != "none":
        title = f"{name} {fp8} ({'Triton on' if triton else NO_TRITON})"
        details += projection_details(title, family, f8, fp8_runs)
    return (f"| {name} | {layers} ({'unrolled' if m.unroll_layers else 'scan'}) | {fp8} | "
            f"{'on' if triton else 'off'} | {kinds['cublas_f8']} | {kinds['cublas_other']} | {kinds['triton_f8']} | "
            f"{kinds['triton_other']} | {kinds['loose_dot']} | {per_layer:g} ({verdict}) | {seconds:,.0f} s |")


def projection_details(title: str, family: str, f8: int, fp8_runs: collections.Counter) -> list[str]:
    """The Markdown lines of a step's FP8 GEMMs by projection, their operands' formats, and what
    no projection's einsum matched."""
    rows = by_projection(family, fp8_runs)
    unmatched = f8 - sum(a + b + c for _, a, b, c, _ in rows)
    formats = ", ".join(f"{k[1]} ({n})" for k, n in sorted(fp8_runs.items()) if k[0] == "formats")
    return [f"{title}: FP8 GEMM runs a step by projection (all layers)", "",
            "| projection | forward | dX | dW | forward's result |", "|---|---|---|---|---|",
            *(f"| {p} | {a} | {b} | {c} | {r} |" for p, a, b, c, r in rows), "",
            f"FP8 operands: {formats}; FP8 GEMMs no projection's einsum matched: {unmatched}", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="gpu:h100-8")
    parser.add_argument("--configs", default="gpt2,llama3.2-1b")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--n-layer", type=int, default=0, help="layers compiled (0: the config's)")
    parser.add_argument("--hlo-dir", default="", help="write each optimized HLO here")
    args, rest = parser.parse_known_args()
    import jax

    from jaxpar.core.config import parse_overrides
    from jaxpar.core.errors import exit_on_user_error
    with exit_on_user_error("fp8_h100_census"):
        rows = run(args, parse_overrides(rest))
    print(f"`JAX_PLATFORMS=cpu {' '.join(['python'] + sys.argv)}`\n\ncompile-only for {args.target} on {platform.node()} "
          f"({os.cpu_count()} CPUs, no GPU), jax {jax.__version__}, {datetime.date.today()}\n")
    print("| config | layers | model.fp8 | Triton GEMMs | cublas f8 | cublas other | Triton f8 | "
          "Triton bf16/f32 | other dots | FP8 GEMMs a layer | compile |\n|" + "---|" * 11)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
