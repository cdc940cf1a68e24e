"""Benchmark (not a test): pipeline schedules at pp=4 on forced CPU host devices.

For each schedule and microbatch count: the compiled step's memory (XLA memory_analysis), the
median step time, the bubble from the table, the stage inputs and output gradients each stage
holds, and the hardware FLOPs per model FLOP. Prints Markdown.

    python scripts/experiments/bench_pipeline.py [--schedules gpipe,1f1b] [--microbatches 4,8,16] [--virtual 2]
        [--steps N] [--section.field=value ...]
"""

import argparse
import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)

from jaxpar.core.config import load_config, parse_overrides  # noqa: E402
from jaxpar.parallel.mesh import parse_mesh_spec  # noqa: E402
from jaxpar.train import run  # noqa: E402

# The default model (4 layers: one per stage) on a batch that splits into 4, 8 and 16 microbatches.
BASE = {"train.batch_size": "32", "train.eval_every": "0", "train.micro_batch": "0"}


def measure(spec: str, schedule: str | None, microbatches: int | None, overrides: dict, steps: int,
            virtual: int) -> dict:
    pipeline = {} if schedule is None else {
        "pipeline.schedule": schedule, "pipeline.microbatches": str(microbatches),
        "pipeline.virtual": str(virtual if schedule == "interleaved" else 1)}
    cfg = load_config(None, {**BASE, **parse_mesh_spec(spec), **pipeline, **overrides,
                             "train.steps": str(steps)})
    n_devices = cfg.mesh.dp * cfg.mesh.tp * cfg.mesh.pp
    info = run(cfg, devices=jax.devices()[:n_devices], progress=False).info
    compiled, summary, pipe = info["compiled"], info["summary"], info["pipeline"]
    name = f"{schedule}, V={virtual}" if schedule == "interleaved" else schedule or "-"
    return {"layout": spec, "schedule": name, "microbatches": microbatches or 1,
            "bubble": pipe["bubble_fraction"], "inputs_held": pipe.get("inputs_held_per_stage", "-"),
            "grads_held": pipe.get("grads_held_per_stage", "-"),
            "hfu_factor": pipe.get("hardware_flops_factor", 1.0),
            "temp_bytes": compiled["temp_bytes"], "peak_memory_bytes": compiled["peak_memory_bytes"],
            "step_ms": summary["step_time_ms_median"], "final_loss": summary["final_loss"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--microbatches", default="4,8,16")
    parser.add_argument("--virtual", type=int, default=2, help="layer chunks per stage, for interleaved")
    args, rest = parser.parse_known_args()
    runs = [("dp=1", None, None)] + [("pp=4", schedule, int(M)) for M in args.microbatches.split(",")
                                     for schedule in args.schedules.split(",")]
    rows = [measure(*r, parse_overrides(rest), args.steps, args.virtual) for r in runs]
    print(json.dumps(rows, indent=1), file=sys.stderr)
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    print("| layout | schedule | M | bubble (table) | inputs + grads held per stage | HFU/MFU "
          "| temporaries (MiB) | peak (MiB) | step (ms) | vs 1 device | final loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    single = rows[0]["step_ms"]
    for r in rows:
        print(f"| {r['layout']} | {r['schedule']} | {r['microbatches']} | {r['bubble']:.1%} "
              f"| {r['inputs_held']} + {r['grads_held']} | {r['hfu_factor']:.2f} "
              f"| {mib(r['temp_bytes'])} | {mib(r['peak_memory_bytes'])} "
              f"| {r['step_ms']:.1f} | {r['step_ms'] / single:.2f}x | {r['final_loss']:.5f} |")


if __name__ == "__main__":
    main()
