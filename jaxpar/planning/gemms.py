"""A compiled step's GEMMs by operand dtype, as plan.json lists them: {"f8e4m3fn x f8e4m3fn": runs,
"bf16 x bf16": runs, ...}, each counted once per run of its computation in a step (a loop body's
once per iteration: jaxpar.parallel.hlo.multiplicities).

A GEMM is what scripts/experiments/fp8_h100_census.py counts: a cuBLAS custom call (its first two
operands: `__cublas$lt$matmul$f8`'s are FP8, its scales follow), a Triton GEMM fusion (the dot
inside it), or a dot outside those fusions (on a TPU or a CPU, inside whatever fusion holds it).
cuDNN's attention kernels and the experts' grouped-GEMM kernels are not counted.
"""

import collections
import re

from jaxpar.parallel import hlo
from jaxpar.planning.hlo_ops import Op, called, element_type, is_fp8, parse

TRITON_GEMM = re.compile(r'"kind":"__triton(?:_nested)?_gemm(?:_fusion)?"')
CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def reached(comps: dict, name: str) -> list[str]:
    """`name` and every computation its ops call, recursively."""
    seen, todo = [], [name]
    while todo:
        if (current := todo.pop()) not in seen:
            seen.append(current)
            todo += [callee for op in comps.get(current, []) for _, callee in hlo.CALL.findall(op.line)]
    return seen


def pair(op: Op, types: dict) -> str:
    """"lhs x rhs": the element types of an op's first two operands."""
    return " x ".join(types.get(name, "?") for name in op.operands[:2])


def gemm_of(op: Op, comps: dict, types: dict, in_triton_gemm: bool) -> str | None:
    """The operand dtypes of the GEMM an op runs ("bf16 x bf16"), or None for any other op; a
    dot inside a Triton GEMM fusion (`in_triton_gemm`) is its fusion's."""
    if op.opcode == "custom-call":
        target = CUSTOM_CALL.search(op.attrs)
        return pair(op, types) if target and "cublas" in target.group(1) else None
    if op.opcode == "fusion" and TRITON_GEMM.search(op.attrs):
        for name in reached(comps, called(op, "calls") or ""):
            inner = {o.name: element_type(o.shape) for o in comps.get(name, [])}
            dot = next((o for o in comps.get(name, []) if o.opcode == "dot"), None)
            if dot is not None:
                return pair(dot, inner)
        return "?"
    if op.opcode == "dot" and not in_triton_gemm:
        return pair(op, types)
    return None


def gemm_ops(hlo_text: str):
    """(op, its operands' "lhs x rhs" element types, its runs per step) of every GEMM of a compiled
    step: a cuBLAS call, a Triton GEMM fusion, or a dot outside those."""
    comps, lines, entry = parse(hlo_text)
    runs = hlo.multiplicities(lines, entry)
    fused = {name for ops in comps.values() for op in ops if op.opcode == "fusion" and TRITON_GEMM.search(op.attrs)
             for name in reached(comps, called(op, "calls") or "")}
    for name, ops in comps.items():
        types = {o.name: element_type(o.shape) for o in ops}
        for op in ops:
            if (dtypes := gemm_of(op, comps, types, name in fused)) is not None:
                yield op, dtypes, runs.get(name, 0)


def gemm_dtypes(hlo_text: str) -> dict[str, int]:
    """{"lhs x rhs" element types: runs per step} of every GEMM of a compiled step, most first."""
    counts: collections.Counter = collections.Counter()
    for _, dtypes, runs in gemm_ops(hlo_text):
        counts[dtypes] += runs
    return dict(sorted(((k, n) for k, n in counts.items() if n), key=lambda kv: (-kv[1], kv[0])))


def fp8_gemms(counts: dict[str, int]) -> int:
    """How many of `gemm_dtypes`' runs are FP8 GEMMs (both operands FP8)."""
    return sum(n for dtypes, n in counts.items() if all(is_fp8(t) for t in dtypes.split(" x ")))
