"""How much a train step reduces over 'data' as its microbatches grow: the compiled step's
collectives (loop-aware counts, jaxpar.parallel.hlo) at each micro-batch size and ZeRO stage.

Gradients are summed on each device and reduced once a step (jaxpar.training.step.step,
accumulate_locally), so the all-reduce / reduce-scatter columns do not grow with the passes.
ZeRO-3's all-gathers of the weights do: every pass needs every layer's weights.

    python scripts/tools/grad_reductions.py --config tiny --target cpu:2 --layouts "dp=2" \
        --zero 0,2,3 --micro-batch 1,4 --train.batch_size=8
    python scripts/tools/grad_reductions.py --config gpt2 --target tpu:v5e-8 --layouts "dp=8" \
        --zero 0,2 --micro-batch 1,64 --train.batch_size=512
"""

import argparse
import sys


def data_collectives(ops: list[dict], dp: int) -> dict[str, tuple[int, float]]:
    """{kind: (count, MiB)} of the ops whose groups span the data axis (group size dp)."""
    found: dict = {}
    for op in ops:
        if op["group"] in (dp, None) and op["kind"] != "collective-permute":
            count, mib = found.get(op["kind"], (0, 0.0))
            found[op["kind"]] = (count + op["count"], mib + op["count"] * op["bytes"] / 2**20)
    return found


def main(argv: list[str]) -> None:
    from jaxpar.core.config import load_config, parse_overrides
    from jaxpar.data.loader import load_dataset
    from jaxpar.parallel import hlo
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.planning.hardware import parse_target, target_devices
    from jaxpar.planning.plan import enumerate_candidates
    from jaxpar.training.step.build import build

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--config", None), ("--target", "cpu:2"), ("--layouts", "dp=2"),
                          ("--zero", "0,2"), ("--micro-batch", "auto")):
        parser.add_argument(flag, default=default)
    args, rest = parser.parse_known_args(argv)
    cfg = load_config(args.config, parse_overrides(rest))
    target = parse_target(args.target)
    devices = target_devices(target)
    tokenizer = load_dataset(cfg.data, cfg.model.block_size).tokenizer
    zeros = tuple(int(z) for z in args.zero.split(","))
    kinds = ("all-reduce", "reduce-scatter", "all-gather")
    print(f"{cfg.model.family}, batch {cfg.train.batch_size} x {cfg.model.block_size}, {args.target}")
    print("| layout | ZeRO | rows/pass | passes | " + " | ".join(f"{k} (count, MiB)" for k in kinds) + " |")
    print("|---|---|---|---|" + "---|" * len(kinds))
    for c in enumerate_candidates(cfg, len(devices), args.layouts, zeros, args.micro_batch, ("none",)):
        if c.status == "skipped":
            continue
        built = build(c.cfg, build_mesh(c.cfg, devices), tokenizer)
        passes = built.plan.passes
        try:
            ops = hlo.collective_ops(built.compile_abstract().as_text())
        except Exception as error:  # the compiler refuses a step that cannot fit
            ops, cells = None, [str(error).strip().splitlines()[0][:90]] + [""] * (len(kinds) - 1)
        if ops is not None:
            found = data_collectives(ops, c.layout["dp"])
            cells = [f"{found[k][0]}, {found[k][1]:,.2f}" if k in found else "-" for k in kinds]
        layout = ",".join(f"{a}={c.layout[a]}" for a in ("dp", "tp", "pp", "cp") if c.layout[a] > 1)
        rows = cfg.train.batch_size // passes // c.layout["dp"]
        print(f"| {layout} | {c.layout['zero']} | {rows} | {passes} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
