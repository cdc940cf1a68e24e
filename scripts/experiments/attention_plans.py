"""GPT-2 124M on a TPU slice or an H100 node, the xla attention kernel against the fused one: the
compiled HBM per chip, the roofline's step time (the fastest micro-batch), and the largest micro-batch that fits.

Each (target, block, kernel) is one `python -m jaxpar.plan` run over data parallelism with ZeRO 1
and micro-batches 1 to 64 (no remat), 524,288 tokens a step (batch 512 at block 1024, 256 at 2048).
Prints one markdown table; nothing runs on the chips, so this works on any machine with the
`tpu` extra (and JAX's CUDA plugin for gpu targets).

    python scripts/experiments/attention_plans.py --targets tpu:v5e-8,gpu:h100-8 --blocks 1024,2048
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

FUSED = {"tpu": "splash", "gpu": "cudnn"}
TOKENS = 512 * 1024
MICRO = "1,2,4,8,16,32,64"


def plan(target: str, block: int, kernel: str, layout: str, zero: int, out: Path) -> list[dict]:
    command = [sys.executable, "-m", "jaxpar.plan", "--config", "gpt2", "--target", target,
               "--layouts", layout, "--zero", str(zero), "--micro-batch", MICRO, "--remat", "none",
               f"--train.batch_size={TOKENS // block}", f"--model.block_size={block}",
               f"--model.attention={kernel}", "--max-compiles", "16", "--out", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "plan.json").read_text())["layouts"]


def row(target: str, block: int, kernel: str, layouts: list[dict]) -> str:
    compiled = [c for c in layouts if c["status"] in ("compiled", "out of memory")]
    rows = TOKENS // block // (compiled[0]["layout"]["dp"] if compiled else 1)
    for c in compiled:  # a micro-batch above a device's rows is all of them: the same program
        c["layout"]["micro_batch"] = min(c["layout"]["micro_batch"], rows)
    fits = sorted((c for c in compiled if c["fits"]), key=lambda c: c["layout"]["micro_batch"])
    largest = fits[-1] if fits else None
    by_mb = {c["layout"]["micro_batch"]: c for c in compiled}
    at_8 = by_mb.get(8, {}).get("compiled", {})
    hbm_8 = f"{at_8['peak_memory_bytes'] / 2**30:,.1f}" if "peak_memory_bytes" in at_8 else (
        f"needs {at_8['needs_bytes'] / 2**30:,.1f}" if "needs_bytes" in at_8 else "-")
    if largest is None:
        return f"| {target} | {block} | {kernel} | none | - | {hbm_8} | - | - | - |"
    best = min(fits, key=lambda c: c["compiled"]["step_s"])["compiled"]
    best_mb = min(fits, key=lambda c: c["compiled"]["step_s"])["layout"]["micro_batch"]
    return (f"| {target} | {block} | {kernel} | {largest['layout']['micro_batch']} | "
            f"{largest['compiled']['peak_memory_bytes'] / 2**30:,.1f} | {hbm_8} | "
            f"{1e3 * best['step_s']:,.1f} (micro-batch {best_mb}) | {best['tokens_per_s']:,.0f} | {100 * best['mfu']:.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="tpu:v5e-8,gpu:h100-8")
    parser.add_argument("--blocks", default="1024,2048")
    parser.add_argument("--layout", default="dp=-1", help="mesh of every plan (default: all data parallel)")
    parser.add_argument("--zero", type=int, default=1)
    args = parser.parse_args()
    print("| target | block | attention | largest micro-batch that fits | HBM/chip GiB at it | "
          "HBM/chip GiB at micro-batch 8 | fastest step ms ≥ | tokens/s ≤ | MFU ≤ |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for target in args.targets.split(","):
            for block in map(int, args.blocks.split(",")):
                for kernel in ("xla", FUSED[target.split(":")[0]]):
                    out = Path(scratch) / f"{target.replace(':', '-')}-{block}-{kernel}"
                    print(row(target, block, kernel, plan(target, block, kernel, args.layout, args.zero, out)),
                          flush=True)


if __name__ == "__main__":
    main()
