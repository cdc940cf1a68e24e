"""An HLO module's ops, read from its text, and the FLOPs each one computes.

`parse` gives every computation's instructions in schedule order; `op_flops` counts a dot's,
a convolution's (XLA:TPU writes small batched dots as dilated convolutions: only the positions
that land on real input count, as in XLA's own cost analysis), a ragged dot's and the experts'
grouped-GEMM kernels', a cuBLAS call's and a fused attention kernel's FLOPs, and a fusion's as the
sum of the ops inside it, each by its operands' element type (an FP8 GEMM's are f8e4m3fn or
f8e5m2, a cuBLASLt f8 call's its first two operands').
"""

import dataclasses
import math
import re

from jaxpar.parallel import hlo

INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\(([^)]*)\)(.*)$")
OPERAND = re.compile(r"%([\w.\-]+)")
# FLOPs of one attention kernel call = matmuls x 2 x (batch x heads x q_len x head_dim) x kv_len,
# times the share of tiles a causal mask leaves: forward QK^T and PV; backward recomputes QK^T
# and forms dV, dP, dQ, dK (splash's dq and dkv kernels split them 3 + 4).
ATTENTION_MATMULS = {"__cudnn$fmhaSoftmax": 2, "__cudnn$fmhaSoftmaxBackward": 5,
                     "splash_mqa_fwd": 2, "splash_mqa_dkv": 4, "splash_mqa_dq": 3,
                     "pallas_flash_attention_fwd": 2, "pallas_flash_attention_vjp": 5}  # the last: tokamax's Triton
CAUSAL_TILE = 128


@dataclasses.dataclass
class Op:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    line: str


def parse(hlo_text: str) -> tuple[dict[str, list[Op]], dict[str, list[str]], str]:
    """({computation: its ops in schedule order}, {computation: its lines}, the entry's name)."""
    lines, entry = hlo.computations(hlo_text)
    comps: dict[str, list[Op]] = {}
    for name, body in lines.items():
        comps[name] = [Op(m[1], m[2], m[3], OPERAND.findall(m[4]), m[5], m[0])
                       for m in map(INSTRUCTION.match, body) if m]
    return comps, lines, entry


def dims(shape: str) -> list[int]:
    found = hlo.ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def numbers(attrs: str, key: str) -> list[int]:
    found = re.search(key + r"=\{([\d,]*)\}", attrs)
    return [int(d) for d in found.group(1).split(",") if d] if found else []


def dot_flops(op: Op, shapes: dict) -> float:
    lhs = dims(shapes.get(op.operands[0], ""))
    contracted = math.prod(lhs[d] for d in numbers(op.attrs, "lhs_contracting_dims") if d < len(lhs))
    return 2.0 * math.prod(dims(op.shape)) * contracted


def valid_positions(out: int, size: int, stride: int, pad_low: int, lhs_dilate: int, rhs_dilate: int,
                    length: int) -> int:
    """(output, window) pairs of one spatial dim that land on a real input element, as XLA's cost
    analysis counts them: padding and a dilated input's holes do no work."""
    count = 0
    for k in range(size):
        first = k * rhs_dilate - pad_low  # input index (in the dilated input) at output 0
        lo = max(0, -(first // stride) if first < 0 else 0)
        for o in range(lo, out):
            index = o * stride + first
            if index > (length - 1) * lhs_dilate:
                break
            count += index >= 0 and index % lhs_dilate == 0
    return count


def window(attrs: str, rank: int) -> list[dict]:
    text = re.search(r"window=\{([^}]*)\}", attrs)
    fields = dict(item.split("=") for item in text.group(1).split()) if text else {}
    per_dim = lambda key, default: [int(x) for x in fields[key].split("x")] if key in fields else [default] * rank
    pads = [tuple(int(x) for x in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields else [(0, 0)] * rank
    return [{"size": s, "stride": t, "pad": p[0], "lhs": a, "rhs": b} for s, t, p, a, b in zip(
        per_dim("size", 1), per_dim("stride", 1), pads, per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1))]


def convolution_flops(op: Op, shapes: dict) -> float:
    """2 x batch x output features x input features per group x valid spatial positions."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", op.attrs)
    lhs, rhs, out = dims(shapes.get(op.operands[0], "")), dims(shapes.get(op.operands[1], "")), dims(op.shape)
    if not labels or not lhs or not rhs:
        return 0.0
    lhs_l, _, out_l = labels.groups()
    spatial = sorted(c for c in lhs_l if c.isdigit())
    groups = int(re.search(r"feature_group_count=(\d+)", op.attrs).group(1)) if "feature_group_count" in op.attrs else 1
    positions = math.prod(valid_positions(out[out_l.index(c)], w["size"], w["stride"], w["pad"], w["lhs"], w["rhs"],
                                          lhs[lhs_l.index(c)])
                          for c, w in zip(spatial, window(op.attrs, len(spatial))))
    return 2.0 * lhs[lhs_l.index("b")] * out[out_l.index("f")] * lhs[lhs_l.index("f")] / groups * positions


FLOAT_ARRAY = re.compile(r"\(?(bf16|f16|f32|f8e\d+m\d+\w*)\[")  # the last: FP8's, f8e4m3fn and f8e5m2
ELEMENT = re.compile(r"\(?([a-z][a-z\d]*)\[")


def element_type(shape: str) -> str:
    """An HLO shape's element type ('bf16', 'f8e4m3fn'; a tuple's first), '?' if it has none."""
    found = ELEMENT.match(shape)
    return found.group(1) if found else "?"


def is_fp8(dtype: str) -> bool:
    """Whether an element type is one of the FP8 formats (f8e4m3fn, f8e5m2, ...)."""
    return dtype.startswith("f8")


def float_operands(op: Op, shapes: dict) -> list[tuple[str, str]]:
    """(dtype, shape) of an op's floating-point operands, in order (a kernel's integer metadata left out)."""
    return [(m.group(1), shapes[o]) for o in op.operands if (m := FLOAT_ARRAY.match(shapes.get(o, "")))]


def attention_flops(op: Op, shapes: dict) -> float:
    """A fused attention kernel's FLOPs from its query and key operands; 0 for other custom calls."""
    target = re.search(r'custom_call_target="([^"]+)"', op.attrs)
    name = target.group(1) if target and target.group(1) != "tpu_custom_call" else op.name
    if name == "__gpu$xla.gpu.triton":  # a Pallas-Triton kernel names itself in its backend config
        name = (re.search(r'name = "([^"]+)"', op.attrs) or [None, name])[1]
    matmuls = next((n for key, n in ATTENTION_MATMULS.items() if name == key or name.startswith(key + "_")
                    or (key.startswith("splash") and name.startswith(key))), 0)
    if not matmuls:
        return 0.0
    arrays = [dims(shape) for _, shape in float_operands(op, shapes)]  # not splash's mask tables
    if len(arrays) < 2:
        return 0.0
    q, k = arrays[0], arrays[1]
    kv_len = k[-2] if name.startswith("splash") else k[1]  # splash: (..., seq, d); cuDNN: (b, seq, h, d)
    q_len = q[-2] if name.startswith("splash") else q[1]
    tiles = max(1, q_len // CAUSAL_TILE)
    causal = (tiles + 1) / (2 * tiles)
    return 2.0 * matmuls * math.prod(q) * kv_len * causal


def gemm_flops(op: Op, shapes: dict) -> float:
    """cuBLAS custom calls name their contraction in backend_config's dot_dimension_numbers."""
    config = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', op.attrs)
    lhs = dims(shapes.get(op.operands[0], ""))
    contracted = math.prod(lhs[int(d.strip('" '))] for d in config.group(1).split(",") if d.strip()) if config else 0
    return 2.0 * math.prod(dims(op.shape)) * contracted


# jaxpar.nn.tokamax_kernels's kernels, forward and backward: tokamax names its ops' arguments in the metadata
TOKAMAX_RAGGED_DOTS = re.compile(r"tokamax:.*ragged_dot_dimension_numbers")
# XLA:TPU's kernels: Megablox's gmm and tgmm, and jax.lax.ragged_dot's own (its forward and input
# gradient; "ragged-dot-metadata" beside it only lays out the groups).
TPU_GROUPED = re.compile(r"(t?gmm|ragged-dot(?!-metadata)[\w-]*)(\.|$)")


def is_grouped_gemm(op: Op) -> bool:
    """Whether an op is the experts' grouped GEMM: rows sorted by group, each group by its own
    matrix, skipping the rows past the groups (an HLO ragged-dot, or a kernel's custom call)."""
    if op.opcode == "ragged-dot":
        return True
    target = re.search(r'custom_call_target="([^"]+)"', op.attrs)
    if op.opcode != "custom-call" or not target:
        return False
    if target.group(1) == "__gpu$xla.gpu.triton":
        return bool(TOKAMAX_RAGGED_DOTS.search(op.attrs))
    return target.group(1) == "tpu_custom_call" and bool(TPU_GROUPED.match(op.name))


def grouped_gemm_flops(op: Op, shapes: dict) -> float:
    """Megablox's gmm (lhs (m, k) by groups of rhs -> (m, n)) and tgmm (lhs (k, m), rhs (m, n) ->
    (groups, k, n)), XLA:TPU's ragged-dot kernel (as gmm), and tokamax's Triton ragged dots on GPUs
    (lhs (m, k) -> (m, n), or the weights' gradient (groups, k, n)): 2 m k n, over every row it is
    given (a dispatch's buffer counted as full, so up to ep times the routed rows' FLOPs; the
    roofline charges the routed share)."""
    if op.opcode != "custom-call" or not is_grouped_gemm(op):
        return 0.0
    floats = float_operands(op, shapes)
    return 2.0 * math.prod(dims(floats[0][1])) * dims(op.shape)[-1] if floats else 0.0


def ragged_dot_flops(op: Op, shapes: dict) -> float:
    """An HLO ragged-dot's: each lhs element meets one group's matrix, so 2 x the lhs's elements
    x the rhs's free dims (neither contracted, grouped nor batched)."""
    lhs, rhs = dims(shapes.get(op.operands[0], "")), dims(shapes.get(op.operands[1], ""))
    bound = {d for key in ("rhs_contracting_dims", "rhs_group_dims", "rhs_batch_dims") for d in numbers(op.attrs, key)}
    return 2.0 * math.prod(lhs) * math.prod(n for d, n in enumerate(rhs) if d not in bound)


def op_flops(op: Op, comps: dict, shapes: dict) -> dict[str, float]:
    """{the operands' dtype (the first operand's element type): FLOPs} of an op, a fusion's summed
    over the ops inside it."""
    dtype = element_type(shapes.get(op.operands[0], "")) if op.operands else "?"
    if op.opcode == "dot":
        return {dtype: dot_flops(op, shapes)}
    if op.opcode == "convolution":
        return {dtype: convolution_flops(op, shapes)}
    if op.opcode == "ragged-dot":
        return {dtype: ragged_dot_flops(op, shapes)}
    if op.opcode == "custom-call":
        flops = (gemm_flops(op, shapes) if "__cublas$" in op.attrs else
                 attention_flops(op, shapes) or grouped_gemm_flops(op, shapes))
        floats = float_operands(op, shapes)
        return {floats[0][0] if floats else dtype: flops} if flops else {}
    total: dict[str, float] = {}
    if op.opcode == "fusion" and (callee := called(op, "calls")):
        inner = comps.get(callee, [])
        names = {o.name: o.shape for o in inner}
        for o in inner:
            for kind, flops in op_flops(o, comps, names).items():
                total[kind] = total.get(kind, 0.0) + flops
    return total


def called(op: Op, kind: str) -> str | None:
    found = re.search(rf"\b{kind}=%?([\w.\-]+)", op.attrs)
    return found.group(1) if found else None
