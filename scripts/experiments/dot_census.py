"""Every dot of a compiled train step: its einsum, pass, operand and result dtypes, and whether
XLA:CPU runs it in a YNNPACK fusion (its bf16 kernels) or converts it first. One device.

    python scripts/experiments/dot_census.py [--config F] [--section.field=value ...]

The table in docs/benchmarks.md ("On a CPU with bf16 instructions") is this script's output for the
baby GPT in bf16.
"""

import collections
import re
import sys

import jax

from jaxpar.core.config import load_config, parse_overrides
from jaxpar.data.loader import load_dataset
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.step.build import build

DOT = re.compile(r"= (\w+)\[[^=]* dot\(%([\w.\-]+), %([\w.\-]+)\)")
SPEC = re.compile(r"[a-z]+,[a-z]+->[a-z]+")


def runners(hlo: str) -> dict:
    """{fused computation: what runs it}: YNNPACK for its fusions, else the fusion's kind."""
    found = {}
    for line in hlo.splitlines():
        if m := re.search(r"fusion\(.*kind=(\w+), calls=%([\w.\-]+)", line):
            found[m.group(2)] = "YNNPACK" if "ynn_fusion" in line.split("=")[0] else m.group(1)
    return found


def census(hlo: str) -> collections.Counter:
    rows, run_by = collections.Counter(), runners(hlo)
    for block in re.split(r"\n(?=(?:ENTRY )?%\S+ \()", hlo):
        name = (re.match(r"(?:ENTRY )?%(\S+) ", block) or [None, ""])[1]
        types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", block))
        types.update(re.findall(r"([\w.\-]+): (\w+)\[", block.split("\n", 1)[0]))
        for line in block.splitlines():
            if not (m := DOT.search(line)):
                continue
            op = re.search(r'op_name="([^"]+)"', line)
            spec = SPEC.search(op.group(1)) if op else None
            where = "backward" if op and "transpose(" in op.group(1) else "forward"
            dtypes = f"{types.get(m.group(2))} x {types.get(m.group(3))} -> {m.group(1)}"
            rows[(spec.group(0) if spec else "(unnamed)", where, dtypes, run_by.get(name, "XLA"))] += 1
    return rows


def main(argv: list[str]) -> None:
    config = argv[argv.index("--config") + 1] if "--config" in argv else None
    rest = [a for i, a in enumerate(argv) if a != "--config" and (i == 0 or argv[i - 1] != "--config")]
    cfg = load_config(config, parse_overrides(rest))
    tokenizer = load_dataset(cfg.data, cfg.model.block_size).tokenizer
    hlo = build(cfg, build_mesh(cfg, jax.devices()[:1]), tokenizer).compile_abstract().as_text()
    print("| einsum | pass | dot | run by | count |\n|---|---|---|---|---|")
    for (spec, where, dtypes, runner), n in sorted(census(hlo).items()):
        print(f"| `{spec}` | {where} | {dtypes} | {runner} | {n} |")


if __name__ == "__main__":
    main(sys.argv[1:])
