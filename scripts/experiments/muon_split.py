"""Muon's optimizer update, compiled for a target: the FLOPs each chip runs (its dots, read from
the HLO by jaxpar.planning.roofline) and the bytes its collectives move, with the Newton-Schulz work
split over the devices (optimizer.ns_split, jaxpar.training.optimizers.muon) and without (every device
orthogonalises every matrix). The update alone is compiled: the gradients arrive where ZeRO puts
them, and the params and state leave where the train state keeps them.

    python scripts/experiments/muon_split.py --target tpu:v5e-8 --config gpt2 --layouts dp=1 dp=8 --zero 1
    python scripts/experiments/muon_split.py --target tpu:v5e-8 --config gpt2 --layouts dp=4,tp=2 dp=2,pp=4 --zero 3
"""

import argparse
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices: nothing runs here


def compile_update(cfg, tokenizer, devices: list):
    """jit(update)(grads, opt_state, params) -> (params, opt_state), compiled from shapes: the
    optimizer, the model and the ZeRO plan that jaxpar.train builds (jaxpar.training.step.build)."""
    import jax
    import optax

    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.step.build import build
    built = build(cfg, build_mesh(cfg, devices), tokenizer)
    tx, zero_plan, state = built.tx, built.zero, built.abstract_state()
    shapes = built.model.shapes()
    on = lambda tree, where: jax.tree.map(  # noqa: E731
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, where)

    def update(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(update, out_shardings=(zero_plan.params, built.shardings.opt_state))
    with jax.set_mesh(built.mesh):
        return step.lower(on(shapes, zero_plan.grads), state.opt_state, on(shapes, zero_plan.params)).compile()


def row(cfg, tokenizer, target, devices: list, layout: str, split: bool) -> str:
    from jaxpar.parallel import hlo
    from jaxpar.planning import roofline
    from jaxpar.planning.hardware import chip_for
    text = compile_update(cfg, tokenizer, devices).as_text()
    cost = roofline.estimate(text, chip_for(target, devices, cfg.model.dtype), len(devices))
    moved = hlo.collectives(text)
    cells = ", ".join(f"{kind} {c['count']} x, {c['bytes'] / 2**20:,.1f} MiB" for kind, c in moved.items()) or "-"
    return f"| {layout} | {'split' if split else 'every device'} | {cost['hlo_flops_per_chip'] / 1e9:,.2f} | {cells} |"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tpu:v5e-8")
    parser.add_argument("--config", default="gpt2")
    parser.add_argument("--layouts", nargs="+", default=["dp=1", "dp=8"])
    parser.add_argument("--zero", default="1")
    args, rest = parser.parse_known_args(argv)
    from jaxpar.core.config import load_config, parse_overrides
    from jaxpar.data.loader import load_dataset
    from jaxpar.parallel.mesh import parse_mesh_spec
    from jaxpar.planning.hardware import parse_target, target_devices
    target = parse_target(args.target)
    every = target_devices(target)
    print(f"{args.config}, optimizer.name=muon, ZeRO {args.zero}, {args.target}")
    print("| layout | Newton-Schulz | GFLOP per chip | collectives per chip |\n|---|---|---|---|")
    for layout in args.layouts:
        for split in (False, True):
            overrides = {**parse_overrides(rest), **parse_mesh_spec(layout), "optimizer.name": "muon",
                         "optimizer.ns_split": str(split).lower(), "train.zero": args.zero}
            cfg = load_config(args.config, {k: str(v) for k, v in overrides.items()})
            tokenizer = load_dataset(cfg.data, cfg.model.block_size).tokenizer
            size = math.prod(int(n) for n in parse_mesh_spec(layout).values())
            print(row(cfg, tokenizer, target, every[:size], layout, split), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
