"""Benchmark (not a test): every registered pipeline schedule at one pp and M, side by side.

From each schedule's table: ticks, the bubble, the most stage inputs in flight on a stage, the
input and gradient slots each stage allocates, and the forwards run again a microbatch. From the
compiled train step of a small GPT-2 (8 layers, so every schedule's chunks divide it) on pp forced
CPU host devices: the collective-permutes per step, their count and bytes (XLA's optimized HLO),
and XLA's temporaries. Prints Markdown.

    python scripts/experiments/schedule_compare.py [--pp 4] [--microbatches 8] [--section.field=value ...]
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jaxpar.core.config import load_config, parse_overrides  # noqa: E402
from jaxpar.core.errors import UserError  # noqa: E402
from jaxpar.parallel import hlo  # noqa: E402
from jaxpar.parallel.mesh import build_mesh  # noqa: E402
from jaxpar.parallel.schedules import SCHEDULES, make_schedule  # noqa: E402
from jaxpar.training.step.build import build  # noqa: E402

MODEL = {"model.n_layer": "8", "train.batch_size": "16", "train.micro_batch": "0", "train.eval_every": "0"}


def least_virtual(name: str) -> int:
    """pipeline.virtual 1 where the schedule takes it, else 2 (interleaved's least)."""
    try:
        SCHEDULES[name].chunks_per_stage(1)
        return 1
    except UserError:
        return 2


def compiled_permutes(name: str, pp: int, M: int, virtual: int, overrides: dict) -> dict:
    cfg = load_config(None, {**MODEL, **overrides, "mesh.pp": str(pp), "pipeline.schedule": name,
                             "pipeline.microbatches": str(M), "pipeline.virtual": str(virtual)})
    mesh = build_mesh(cfg, jax.devices()[:pp])
    compiled = build(cfg, mesh, vocab=65).compile_abstract()
    summary = hlo.compiled_summary(compiled)
    permutes = summary["collectives"].get("collective-permute", {"count": 0, "bytes": 0})
    return {"permutes": permutes["count"], "permute_bytes": permutes["bytes"], "temp": summary["temp_bytes"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    args, rest = parser.parse_known_args()
    overrides = parse_overrides(rest)
    print(f"pp={args.pp}, M={args.microbatches}; the compiled step: GPT-2 of 8 layers, n_embd "
          f"{load_config(None, overrides).model.n_embd}, batch 16, float32, on {args.pp} CPU host devices\n")
    print("| schedule | V | ticks | bubble | inputs in flight (most, a stage) | slots: inputs + grads | forwards rerun "
          "| collective-permutes a step | their bytes (MiB) | temporaries (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in SCHEDULES:
        virtual = least_virtual(name)
        s = make_schedule(name, args.pp, args.microbatches, virtual)
        c = compiled_permutes(name, args.pp, args.microbatches, virtual, overrides)
        flight = max(s.in_flight(stage) for stage in range(s.pp))
        print(f"| {name} | {s.virtual} | {s.ticks} | {s.bubble_fraction:.1%} | {flight} | {s.input_slots} + "
              f"{s.grad_slots} | {s.rerun_factors[0]:.2f} | {c['permutes']} | {c['permute_bytes'] / 2**20:.2f} "
              f"| {c['temp'] / 2**20:.2f} |")


if __name__ == "__main__":
    main()
