"""A roofline over a compiled step: how long its ops take at best on one chip, read from the HLO.

Each op that runs (a fusion, a dot, a copy, a custom call) takes at least the longer of
    its FLOPs / the chip's peak   and   the bytes it reads and writes / the chip's HBM bandwidth;
a while loop's body counts once per iteration, a conditional costs its dearest branch (a pipeline
tick waits for its slowest stage), and a collective costs the ring model's time
(`estimate.collective_seconds`) less the ops XLA scheduled between its start and its done. The step
is the sum. FLOPs are the dots' and convolutions' (wherever they are fused) and the fused attention
kernels' (from their shapes); bytes are a fused op's operands and results, counting only the
slice a dynamic-slice reads and the update an in-place dynamic-update-slice writes. The experts'
grouped GEMMs (Megablox's, tokamax's, a ragged dot) are charged at the routed rows, each token's k,
assuming balanced routing: a dispatch's receive buffer has room for up to ep times them (dropless),
which memory holds but the kernels skip; the ragged all-to-alls that fill and empty it are timed
at those rows too (`ragged_routed_bytes`), not at the buffer. A GEMM runs at the peak of its
operands' dtype: an FP8 one (model.fp8: a cuBLASLt `__cublas$lt$matmul$f8` call, or a Triton GEMM
whose dot takes f8e4m3fn/f8e5m2 operands) at the chip's FP8 peak where it has FP8 units (H100:
1,979 TFLOP/s dense), the others at bf16's or f32's. The FP8 recipes' quantize passes (each
operand's amax, its scaling and cast to FP8; the product's rescaling where XLA does not fold it
into the GEMM) are fusions without a dot: charged by the bytes they read and write, like any
other. Every term is a lower bound on its op's time, so the step is an upper bound on speed: it
leaves out kernel launch and loop overheads, caches, layouts that pad a tile, uneven routing, and
collectives slower than the model. The planner adds the host transfers of offloaded state
(jaxpar.planning.estimate) whole, as if nothing overlapped them: there the bound may be slower
than a step that hides them.
"""

import dataclasses
import re

from jaxpar.models.flops import datasheet_peak
from jaxpar.parallel import hlo
from jaxpar.planning.estimate import collective_seconds
from jaxpar.planning.hlo_ops import FLOAT_ARRAY, Op, called, dims, is_fp8, is_grouped_gemm, op_flops, parse

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
        "replica-id", "opt-barrier", "optimization-barrier", "add-dependency", "copy-start", "copy-done",
        "async-done", "iota"}
SLICES = {"dynamic-slice", "slice", "gather"}


@dataclasses.dataclass
class Cost:
    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0  # the ops' roofline time plus exposed communication
    compute_bound_s: float = 0.0  # the part of `seconds` where FLOPs, not bytes, set an op's time
    comm_s: float = 0.0  # communication alone, as if nothing overlapped it
    exposed_comm_s: float = 0.0
    uncharged_flops: float = 0.0  # the grouped GEMMs' FLOPs over their buffers' unrouted rows

    def add(self, other: "Cost", times: float = 1.0) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + times * getattr(other, field.name))


def read_bytes(comps: dict, computation: str, param: str) -> float:
    """Bytes a fused computation reads of one parameter: the slices taken of it (through bitcasts
    and nested fusions), nothing where it is updated in place, else all of it."""
    inner = comps.get(computation, [])
    shape = next((o.shape for o in inner if o.name == param), "")
    users = [o for o in inner if param in o.operands]
    if not users:  # unused, or the computation's result itself
        return hlo.shape_bytes(shape) if inner and inner[-1].name == param else 0.0
    total = 0.0
    for user in users:
        if user.opcode in SLICES and user.operands[0] == param:
            total += hlo.shape_bytes(user.shape)
        elif user.opcode == "dynamic-update-slice" and user.operands[0] == param:
            continue
        elif user.opcode == "bitcast":
            total += read_bytes(comps, computation, user.name)
        elif user.opcode == "fusion" and (callee := called(user, "calls")):
            index = user.operands.index(param)
            nested = next((o.name for o in comps.get(callee, []) if o.opcode == "parameter"
                           and re.search(rf"parameter\({index}\)", o.line)), None)
            total += read_bytes(comps, callee, nested) if nested else hlo.shape_bytes(shape)
        else:
            return hlo.shape_bytes(shape)
    return min(total, hlo.shape_bytes(shape))


def fusion_bytes(op: Op, comps: dict, shapes: dict) -> float:
    """Operands as read (`read_bytes`) and results as written (an in-place update writes its
    update)."""
    callee = called(op, "calls") or ""
    inner = comps.get(callee, [])
    if not inner:
        return sum(hlo.shape_bytes(shapes.get(n, "")) for n in op.operands) + hlo.shape_bytes(op.shape)
    by_name = {o.name: o for o in inner}
    total = sum(read_bytes(comps, callee, o.name) for o in inner if o.opcode == "parameter")
    root = inner[-1]
    outputs = [by_name.get(n) for n in root.operands] if root.opcode == "tuple" else [root]
    for out in outputs:
        while out is not None and out.opcode == "bitcast":
            out = by_name.get(out.operands[0])
        if out is not None and out.opcode == "dynamic-update-slice":
            total += hlo.shape_bytes(by_name[out.operands[1]].shape) if out.operands[1] in by_name else 0
        elif out is not None:
            total += hlo.shape_bytes(out.shape)
    return total


def op_bytes(op: Op, comps: dict, shapes: dict) -> float:
    if op.opcode == "fusion":
        return fusion_bytes(op, comps, shapes)
    if op.opcode in SLICES:
        return 2.0 * hlo.shape_bytes(op.shape)
    if op.opcode == "dynamic-update-slice":
        return 2.0 * hlo.shape_bytes(shapes.get(op.operands[1], ""))
    return sum(hlo.shape_bytes(shapes.get(n, "")) for n in op.operands) + hlo.shape_bytes(op.shape)


def routed_bytes(op: Op, shapes: dict, share: float) -> float:
    """A grouped GEMM's bytes with its rows (its 2-D arrays: the rows in, the rows out) at the
    routed share; its groups' matrices (3-D) and integer metadata whole."""
    arrays = [shapes.get(n, "") for n in op.operands] + [op.shape]
    return sum(hlo.shape_bytes(a) * (share if len(dims(a)) == 2 and FLOAT_ARRAY.match(a) else 1.0)
               for a in arrays)


def ragged_routed_bytes(op: Op, result_bytes: float, shapes: dict) -> float:
    """A ragged all-to-all's bytes under balanced routing: the smaller of the rows it sends (its
    first operand) and its result. The dispatch sends a device's routed rows (its tokens x k, or
    what a capacity leaves) into a receive buffer with room for up to ep times them; the combine
    sends that buffer's filled rows back into the routed rows' places; either way the routed rows
    cross. XLA's memory figure still holds the whole buffer. Its result's bytes where the operand's
    shape is not in the HLO."""
    sent = hlo.shape_bytes(shapes.get(op.operands[0], "")) if op.operands else 0
    return min(result_bytes, sent) if sent else result_bytes


class Roofline:
    """The step's cost on one chip of `devices`; computations are costed once and memoised.
    `routed_share`: the share of a grouped GEMM's rows that are routed (jaxpar.planning.estimate's
    `dispatch_rows_factor`, inverted): the experts' kernels skip the rest."""

    def __init__(self, hlo_text: str, chip, devices: int, routed_share: float = 1.0):
        self.comps, self.lines, self.entry = parse(hlo_text)
        self.chip, self.devices, self.memo = chip, devices, {}
        self.routed_share = routed_share

    def peak(self, dtype: str) -> float:
        """FLOP/s of a matmul whose operands are `dtype` (an HLO element type): an FP8 one's at
        the chip's FP8 peak where it has FP8 units, else at the compute dtype's."""
        if is_fp8(dtype) and self.chip.fp8_peak_flops:
            return self.chip.fp8_peak_flops
        sheet = datasheet_peak(self.chip.kind, "float32" if dtype in ("f32", "f64") else "bfloat16")
        return sheet or self.chip.peak_flops

    def step(self) -> Cost:
        return self.computation(self.entry)

    def computation(self, name: str) -> Cost:
        if name in self.memo:
            return self.memo[name]
        ops = self.comps.get(name, [])
        shapes = {o.name: o.shape for o in ops}
        cost, in_flight = Cost(), {}  # async collectives: start name -> [seconds, seconds of ops since]
        for op in ops:
            if op.opcode.endswith("-done"):
                if op.operands and op.operands[0] in in_flight:
                    seconds, overlap = in_flight.pop(op.operands[0])
                    exposed = max(0.0, seconds - overlap)
                    cost.add(Cost(seconds=exposed, exposed_comm_s=exposed))
                continue
            comm = self.collective_seconds(op, name, shapes)
            if comm is None:
                part = self.op_cost(op, shapes)
            elif op.opcode.endswith("-start"):
                in_flight[op.name] = [comm, 0.0]
                part = Cost(comm_s=comm)
            else:
                part = Cost(seconds=comm, comm_s=comm, exposed_comm_s=comm)
            for pending in in_flight.values():
                pending[1] += part.seconds
            cost.add(part)
        for seconds, overlap in in_flight.values():  # started, never awaited here: exposed
            cost.add(Cost(seconds=max(0.0, seconds - overlap), exposed_comm_s=max(0.0, seconds - overlap)))
        self.memo[name] = cost
        return cost

    def collective_seconds(self, op: Op, computation: str, shapes: dict) -> float | None:
        """The ring model's seconds for a collective op (an async computation's too), a ragged
        all-to-all at its routed rows (`ragged_routed_bytes`); None for others."""
        if op.opcode == "async-start" and (callee := called(op, "calls")):
            inner = self.comps.get(callee, [])
            shapes = {o.name: o.shape for o in inner}
            op = next((o for o in inner if hlo.collective_of(o.line)), Op("", "", "", [], "", ""))
        found = hlo.collective_of(op.line, computation)
        if found is None:
            return None
        kind, size, group = found
        if kind == "ragged-all-to-all":
            size = ragged_routed_bytes(op, size, shapes)
        return collective_seconds([{"kind": kind, "bytes": size, "group": group, "count": 1}], self.chip,
                                  self.devices)

    def op_cost(self, op: Op, shapes: dict) -> Cost:
        """A non-collective op: a loop, a branch or a call by what it runs, else its roofline."""
        if op.opcode == "while":
            trips = hlo.trip_count(op.line, self.lines)
            body = Cost()
            body.add(self.computation(called(op, "body") or ""), trips)
            return body
        if op.opcode == "conditional":
            listed = re.search(r"branch_computations=\{([^}]*)\}", op.attrs)
            names = ([n.strip().lstrip("%") for n in listed.group(1).split(",")] if listed else
                     [n for n in (called(op, "true_computation"), called(op, "false_computation")) if n])
            return max((self.computation(n) for n in names), key=lambda c: c.seconds, default=Cost())
        if op.opcode in ("call", "async-start") and (callee := called(op, "to_apply") or called(op, "calls")):
            return self.computation(callee)
        if op.opcode in FREE:
            return Cost()
        flops = op_flops(op, self.comps, shapes)
        size, uncharged = op_bytes(op, self.comps, shapes), 0.0
        if self.routed_share != 1.0 and is_grouped_gemm(op):  # charged at the routed rows
            uncharged = sum(flops.values()) * (1 - self.routed_share)
            flops = {dtype: f * self.routed_share for dtype, f in flops.items()}
            size = routed_bytes(op, shapes, self.routed_share)
        compute = sum(f / self.peak(dtype) for dtype, f in flops.items())
        memory = size / self.chip.hbm_bytes_per_s
        return Cost(flops=sum(flops.values()), bytes=size, seconds=max(compute, memory),
                    compute_bound_s=compute if compute >= memory else 0.0, uncharged_flops=uncharged)


def estimate(hlo_text: str, chip, devices: int, routed_share: float = 1.0) -> dict:
    """The roofline of a compiled step on one chip: FLOPs and bytes it counts, and seconds; the
    grouped GEMMs' FLOPs over unrouted rows apart (`routed_share`, see Roofline)."""
    cost = Roofline(hlo_text, chip, devices, routed_share).step()
    return {"hlo_flops_per_chip": cost.flops, "hbm_bytes_per_chip": cost.bytes,
            "compute_s": cost.seconds - cost.exposed_comm_s, "compute_bound_s": cost.compute_bound_s,
            "comm_s": cost.comm_s, "exposed_comm_s": cost.exposed_comm_s, "step_s": cost.seconds,
            "unrouted_flops_per_chip": cost.uncharged_flops}
