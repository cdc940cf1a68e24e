"""Benchmark (not a test): ZeRO stages 0-3 at dp=4 on forced CPU host devices.

For each stage: bytes per device measured from the arrays, the compiled step's memory analysis,
the median step time, and the collectives in the compiled HLO. Prints a Markdown table.

    python scripts/experiments/bench_zero.py [--steps N] [--section.field=value ...]
"""

import argparse
import json
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)

from jaxpar.core.config import load_config, parse_overrides  # noqa: E402
from jaxpar.data.loader import BatchLoader, load_dataset  # noqa: E402
from jaxpar.parallel.hlo import collectives  # noqa: E402
from jaxpar.parallel.mesh import build_mesh, parse_mesh_spec  # noqa: E402
from jaxpar.training import step as steps  # noqa: E402
from jaxpar.training.step.build import build  # noqa: E402

# Large enough that the weights, not the activations, dominate a device's memory.
MODEL = {"model.n_layer": "4", "model.n_head": "8", "model.n_embd": "512", "model.block_size": "64",
         "train.batch_size": "8", "train.micro_batch": "0", "train.eval_every": "0"}


def measure(stage: int, overrides: dict, n_steps: int) -> dict:
    cfg = load_config(None, {**MODEL, **parse_mesh_spec("dp=4"), **overrides, "train.zero": str(stage)})
    data = load_dataset(cfg.data, cfg.model.block_size)
    built = build(cfg, build_mesh(cfg), data.tokenizer)  # as jaxpar.train builds it
    with jax.set_mesh(built.mesh):
        state = built.init_state()
        loader = BatchLoader(data, "train", 0, cfg.train.batch_size, built.plan.passes,
                             cfg.model.block_size, built.mesh)
        compiled = built.train_step(loader.sharding).lower(state, loader(0)).compile()
        memory = compiled.memory_analysis()
        row = {"stage": stage,
               "params_per_device": steps.bytes_per_device(state.params),
               "opt_state_per_device": steps.bytes_per_device(state.opt_state),
               "params_total": steps.bytes_total(state.params),
               "opt_state_total": steps.bytes_total(state.opt_state),
               "temp_bytes": memory.temp_size_in_bytes,
               "argument_bytes": memory.argument_size_in_bytes,
               "collectives": collectives(compiled.as_text())}
        times = []
        for i in range(n_steps):
            batch = loader(i)
            start = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        row["step_ms"] = 1e3 * statistics.median(times[1:])
        row["loss"] = float(metrics["loss"])
    return row


def mib(n):
    return f"{n / 2**20:.1f}"


def table(rows: list[dict]) -> str:
    kinds = ["all-reduce", "all-gather", "reduce-scatter"]
    lines = ["| ZeRO | params/device (MiB) | opt state/device (MiB) | compiled args + temps (MiB) | step (ms) | "
             + " | ".join(f"{k}: count, MiB" for k in kinds) + " |",
             "|---|---|---|---|---|" + "---|" * len(kinds)]
    for r in rows:
        c = r["collectives"]
        lines.append(f"| {r['stage']} | {mib(r['params_per_device'])} of {mib(r['params_total'])} | "
                     f"{mib(r['opt_state_per_device'])} of {mib(r['opt_state_total'])} | "
                     f"{mib(r['argument_bytes'])} + {mib(r['temp_bytes'])} | {r['step_ms']:.0f} | "
                     + " | ".join(f"{c.get(k, {}).get('count', 0)}, {mib(c.get(k, {}).get('bytes', 0))}"
                                  for k in kinds) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", help="also write the rows here")
    args, rest = parser.parse_known_args()
    rows = [measure(stage, parse_overrides(rest), args.steps) for stage in (0, 1, 2, 3)]
    print(table(rows))
    print("losses (must agree):", [round(r["loss"], 5) for r in rows], file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
