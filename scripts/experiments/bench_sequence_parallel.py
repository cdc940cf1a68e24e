"""Benchmark (not a test): Megatron sequence parallelism against plain tensor parallelism.

For tp in --tps, with and without model.sequence_parallel: the train step compiled for tp
devices of --target (host CPU devices, or a TPU slice's compile-only devices with libtpu), its
temporaries per device (XLA memory_analysis) and the collectives in its HLO. Prints Markdown.

    python scripts/experiments/bench_sequence_parallel.py [--target cpu|tpu:v5e-4] [--tps 2,4]
        [--section.field=value ...]
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jaxpar.core.config import load_config, parse_overrides  # noqa: E402
from jaxpar.data.loader import load_dataset  # noqa: E402
from jaxpar.parallel import hlo  # noqa: E402
from jaxpar.parallel.mesh import build_mesh, parse_mesh_spec  # noqa: E402
from jaxpar.planning.hardware import parse_target, tpu_devices  # noqa: E402
from jaxpar.training.step.build import build  # noqa: E402

# A model whose activations dominate its memory: block 512, 256 wide, batch 8.
MODEL = {"model.n_layer": "4", "model.n_head": "8", "model.n_embd": "256", "model.block_size": "512",
         "train.batch_size": "8", "train.micro_batch": "0", "train.zero": "0"}


def measure(devices: list, tp: int, sequence_parallel: bool, overrides: dict) -> dict:
    cfg = load_config(None, {**MODEL, **parse_mesh_spec(f"tp={tp}"), **overrides,
                             "model.sequence_parallel": str(sequence_parallel).lower()})
    tokenizer = load_dataset(cfg.data, cfg.model.block_size).tokenizer
    compiled = build(cfg, build_mesh(cfg, devices[:tp]), tokenizer).compile_abstract()
    return {**hlo.memory_summary(compiled), "collectives": hlo.collectives(compiled.as_text())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cpu", help="cpu, or a TPU slice such as tpu:v5e-4")
    parser.add_argument("--tps", default="2,4")
    args, rest = parser.parse_known_args()
    devices = jax.devices("cpu") if args.target == "cpu" else tpu_devices(parse_target(args.target))
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    print(f"target {args.target}\n")
    print("| tp | sequence parallel | temporaries (MiB) | " + " | ".join(
        f"{kind}: count, MiB" for kind in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")) + " |")
    print("|---|---|---|---|---|---|---|")
    for tp in (int(t) for t in args.tps.split(",")):
        for sequence_parallel in (False, True):
            row = measure(devices, tp, sequence_parallel, parse_overrides(rest))
            ops = row["collectives"]
            cells = [f"{ops.get(k, {}).get('count', 0)}, {mib(ops.get(k, {}).get('bytes', 0))}"
                     for k in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")]
            print(f"| {tp} | {'yes' if sequence_parallel else 'no'} | {mib(row['temp_bytes'])} | "
                  + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
