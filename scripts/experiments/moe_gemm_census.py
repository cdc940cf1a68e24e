"""The experts' GEMMs of a compiled train step, each with its runs and FLOPs, against the routed
FLOPs (each token times its k experts' three matrices, forward and backward): how many times the
routed work the grouped GEMM does. Compile-only targets work from any host.

    JAX_PLATFORMS=cpu python scripts/experiments/moe_gemm_census.py --target gpu:h100-8 \\
        --config olmoe-1b-7b --mesh.ep=8 --train.batch_size=16 [--model.moe_gemm=ragged_dot]

docs/benchmarks.md ("The experts' GEMM on GPUs") holds its output before and after tokamax.
"""

import argparse
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices: nothing runs here

EXPERT_SOURCES = re.compile(r"ragged_dot|tokamax|gmm|grouped_swiglu|einsum")  # einsum: the blocked GEMM's tiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--config", default="shakespeare_moe_cpu")
    args, rest = parser.parse_known_args()
    from jaxpar.core.config import load_config, parse_overrides
    from jaxpar.core.errors import exit_on_user_error
    with exit_on_user_error("moe_gemm_census"):
        report(load_config(args.config, parse_overrides(rest)), args.target)


def routed_flops_per_chip(cfg, chips: int) -> float:
    """Each token's k experts, 6 C F FLOPs a forward (gate and up, then down), times 3 with the
    backward, over the sparse layers; the step's tokens shared evenly by the chips."""
    m = cfg.model
    tokens = cfg.train.batch_size * m.block_size
    return tokens * len(m.sparse_layers) * m.experts_per_token * 18 * m.n_embd * m.moe_mlp_dim / chips


def report(cfg, target_name: str) -> None:
    from jaxpar.data.loader import load_dataset
    from jaxpar.parallel import hlo
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.planning import roofline
    from jaxpar.planning.hardware import chip_for, parse_target, target_devices
    from jaxpar.training.step.build import build
    target = parse_target(target_name)
    devices = target_devices(target)
    mesh = build_mesh(cfg, devices)
    built = build(cfg, mesh, load_dataset(cfg.data, cfg.model.block_size).tokenizer)
    compiled = built.compile_abstract()
    model = roofline.Roofline(compiled.as_text(), chip_for(target, devices, cfg.model.dtype), len(devices))
    step = model.step()
    runs = hlo.multiplicities(model.lines, model.entry)
    plan = built.plan.describe()["moe"]
    print(f"{target_name}, mesh {dict(mesh.shape)}: grouped GEMM {plan['grouped_gemm']}, dispatch {plan['dispatch']}")
    print(f"\n| runs | GFLOP a run | op | result | from |\n|{'---|' * 5}")
    expert = 0.0
    for name in model.memo:
        shapes = {o.name: o.shape for o in model.comps[name]}
        for op in model.comps[name]:
            if op.opcode in ("while", "conditional", "call", "async-start") or hlo.collective_of(op.line):
                continue
            cost = model.op_cost(op, shapes)
            source = re.search(r'op_name="([^"]*)"', op.line)
            source = re.sub(r"tokamax:\{.*", "tokamax ragged_dot", source.group(1)) if source else ""
            if cost.flops and EXPERT_SOURCES.search(source):
                expert += cost.flops * runs[name]
                print(f"| {runs[name]} | {cost.flops / 1e9:,.2f} | {op.opcode} | {op.shape[:40]} | "
                      f"{'/'.join(source.split('/')[-2:])[:50]} |")
    routed = routed_flops_per_chip(cfg, len(devices))
    memory = compiled.memory_analysis()
    used = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes \
        + memory.temp_size_in_bytes
    print(f"\nexperts' GEMMs: {expert / 1e9:,.1f} GFLOP per chip against {routed / 1e9:,.1f} routed: "
          f"{expert / routed:.2f}x; the whole step {step.flops / 1e12:,.2f} TFLOP per chip, "
          f"{used / 2**30:,.1f} GiB per device, roofline step {1e3 * step.seconds:,.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
