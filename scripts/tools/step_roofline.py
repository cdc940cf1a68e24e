"""Where a compiled train step's estimated time goes: the roofline `jaxpar.plan` ranks layouts by
(jaxpar.planning.roofline), and its dearest ops, each with its runs per step, FLOPs, bytes and the
JAX operation it came from.

    python scripts/tools/step_roofline.py --target gpu:h100-8 --config gpt2 --mesh.dp=8 \\
        --train.batch_size=512 --train.micro_batch=64 [--top 20]
"""

import argparse
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices: nothing runs here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--config", default="gpt2")
    parser.add_argument("--top", type=int, default=20)
    args, rest = parser.parse_known_args()
    from jaxpar.core.config import load_config, parse_overrides
    from jaxpar.core.errors import exit_on_user_error
    with exit_on_user_error("step_roofline"):
        cfg = load_config(args.config, parse_overrides(rest))
        report(cfg, args.target, args.top)


def report(cfg, target_name: str, top: int) -> None:
    from jaxpar.data.loader import load_dataset
    from jaxpar.parallel import hlo
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.planning import roofline
    from jaxpar.planning.hardware import chip_for, parse_target, target_devices
    from jaxpar.training.step.build import build
    target = parse_target(target_name)
    devices = target_devices(target)
    tokenizer = load_dataset(cfg.data, cfg.model.block_size).tokenizer
    chip = chip_for(target, devices, cfg.model.dtype)
    text = build(cfg, build_mesh(cfg, devices), tokenizer).compile_abstract().as_text()
    model = roofline.Roofline(text, chip, len(devices))
    step = model.step()
    print(f"{target_name} ({chip.kind}): step >= {1e3 * step.seconds:,.1f} ms; ops {1e3 * (step.seconds - step.exposed_comm_s):,.1f} ms "
          f"({1e3 * step.compute_bound_s:,.1f} of them FLOP-bound), collectives {1e3 * step.comm_s:,.1f} ms "
          f"({1e3 * step.exposed_comm_s:,.1f} exposed); {step.flops / 1e12:,.1f} TFLOP and "
          f"{step.bytes / 1e9:,.1f} GB of HBM traffic per chip")
    runs = hlo.multiplicities(model.lines, model.entry)
    rows = []
    for name in model.memo:
        shapes = {o.name: o.shape for o in model.comps[name]}
        for op in model.comps[name]:
            if op.opcode not in ("while", "conditional", "call", "async-start") and not hlo.collective_of(op.line):
                cost = model.op_cost(op, shapes)
                rows.append((cost.seconds * runs[name], runs[name], cost, op))
    rows.sort(key=lambda r: -r[0])
    print(f"\n| ms a step | runs | GFLOP a run | MB a run | bound by | op | result | from |\n|{'---|' * 8}")
    for seconds, times, cost, op in rows[:top]:
        source = re.search(r'op_name="([^"]*)"', op.line)
        source = "/".join(source.group(1).split("/")[-2:]) if source else ""
        bound = "FLOPs" if cost.compute_bound_s else "bytes"
        print(f"| {1e3 * seconds:,.2f} | {times} | {cost.flops / 1e9:,.1f} | {cost.bytes / 1e6:,.1f} | {bound} | "
              f"{op.opcode} | {op.shape[:48]} | {source[:60]} |")


if __name__ == "__main__":
    sys.exit(main())
