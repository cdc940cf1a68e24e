"""Where one train step's time goes on this machine: a jax.profiler trace of a few steps, each XLA
op's time put in a category by the source function that made it (the compiled HLO's stack frames).

    python scripts/tools/profile_step.py [--config F] [--section.field=value ...] [--steps N] [--trace A:B]

Prints a Markdown table: per category, ms per step and share of the ops' time, then the step's
wall time and what the ops do not cover (host work, dispatch, waiting). Categories: matmuls
(attention's apart), attention's softmax and masking, LayerNorm, GELU, the loss, the optimizer,
copies and transposes, and the rest.
"""

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import jax

from jaxpar.core.config import load_config, parse_overrides
from jaxpar.data.loader import load_dataset
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.run import trainer
from jaxpar.training.step.build import build

# (category, source function names that put an op there), first match along the stack wins.
BY_FUNCTION = [("attention softmax, mask", {"attention_scores", "attention_forward", "attention_backward", "sum_by_key_block",
                                            "attention_core", "causal_attention", "physical_transpose"}),
               ("LayerNorm", {"layer_norm"}), ("GELU", {"gelu"}),
               ("loss (logits, cross-entropy)", {"cross_entropy", "logits_of"}),
               ("embedding", {"embed"})]
SECTION = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)$")


def stack_tables(hlo: str) -> tuple[dict, dict]:
    """({frame id: (file, function, parent frame id)}, {op name: frame id}) from the HLO text."""
    tables, current = collections.defaultdict(dict), None
    for line in hlo.splitlines():
        if SECTION.match(line):
            current = line
        elif current and (m := re.match(r"^(\d+) (.*)$", line)):
            tables[current][int(m.group(1))] = m.group(2)
        elif not line.strip():
            current = None
    files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    functions = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    locations = {k: tuple(map(int, re.findall(r"(?:file_name_id|function_name_id)=(\d+)", v)))
                 for k, v in tables["FileLocations"].items()}
    frames = {}
    for k, v in tables["StackFrames"].items():
        location, parent = map(int, re.findall(r"=(\d+)", v))
        file_id, function_id = locations[location]
        frames[k] = (files[file_id], functions[function_id], parent - 1)  # 1-based; 0: none
    ops = {m.group(1): int(m.group(2)) for m in
           re.finditer(r"%([\w.\-]+) = .*?stack_frame_id=(\d+)", hlo)}
    return frames, ops


def category(op: str, hlo_line: str, frame: int | None, frames: dict) -> str:
    if "dot_general" in hlo_line or op.startswith(("dot", "ynn_fusion")):
        return "matmuls: attention" if re.search(r"bh\w+,bh\w+->", hlo_line) else "matmuls: projections"
    if op.startswith(("copy", "transpose")) or "transpose_copy" in op:
        return "copies, transposes"
    seen = set()
    while frame and frame in frames and frame not in seen:
        seen.add(frame)
        file, function, parent = frames[frame]
        if "optax" in file:
            return "optimizer (AdamW, clipping, norm)"
        for name, functions in BY_FUNCTION:
            if function in functions:
                return name
        frame = parent
    return "other elementwise, reductions"


def profile(cfg, trace: str) -> tuple[dict, float, int]:
    """({category: op seconds per step}, wall seconds per step, traced steps)."""
    start, end = map(int, trace.split(":"))
    devices = jax.devices()[: cfg.mesh.dp * cfg.mesh.tp * cfg.mesh.pp]
    with tempfile.TemporaryDirectory() as out:
        trainer.run(cfg, Path(out), devices, progress=False, fresh=True, profile=trace)
        trace_file = next(Path(out).rglob("*.trace.json.gz"))
        events = json.load(gzip.open(trace_file))["traceEvents"]
    tokenizer = load_dataset(cfg.data, cfg.model.block_size).tokenizer  # the vocabulary the run trained with
    hlo = build(cfg, build_mesh(cfg, devices), tokenizer).compile_abstract().as_text()
    frames, op_frames = stack_tables(hlo)
    lines = {m.group(1): m.group(0) for m in re.finditer(r"%([\w.\-]+) = [^\n]*", hlo)}
    spent = collections.Counter()
    for e in events:
        args = e.get("args", {})
        if e.get("ph") == "X" and args.get("hlo_module") == "jit_step" and "hlo_op" in args:
            op = args["hlo_op"]
            name = category(op, lines.get(op, ""), op_frames.get(op), frames) if op in lines else "unmatched"
            spent[name] += e["dur"] / 1e6
    steps = end - start
    wall = [e["dur"] / 1e6 for e in events if e.get("ph") == "X" and e["name"] == "ThunkExecutor::Execute (wait for completion)"]
    wall_per_step = (sum(wall) / len(wall)) if wall else float("nan")
    return {k: v / steps for k, v in spent.items()}, wall_per_step, steps


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config")
    parser.add_argument("--steps", default="30", help="steps to train (default 30)")
    parser.add_argument("--trace", default="20:25", help="steps START:END to trace (default 20:25)")
    args, rest = parser.parse_known_args(argv)
    cfg = load_config(args.config, {"train.steps": args.steps, "train.eval_every": "0",
                                    **parse_overrides(rest)})
    spent, wall, steps = profile(cfg, args.trace)
    total = sum(spent.values())
    print("| category | ms per step | share of op time |\n|---|---|---|")
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {1e3 * seconds:.2f} | {100 * seconds / total:.1f}% |")
    print(f"| **all ops** | **{1e3 * total:.2f}** | |")
    print(f"\nthe step's execution: {1e3 * wall:.2f} ms (mean of {steps} traced steps); the ops sum "
          f"to {100 * total / wall:.0f}% of it (above 100%: ops ran side by side)")


if __name__ == "__main__":
    main(sys.argv[1:])
