"""Read a compiled step: which collectives it runs (count and bytes), and whether its memory fits."""

import math
import os
import re
from collections import defaultdict

from jaxpar.core.errors import UserError

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "ragged-all-to-all")
# `%name = <result shape> <op>(` where <op> may carry an async `-start` suffix.
OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(KINDS) + r")(-start)?\(")
ARRAY = re.compile(r"([a-z]+\d*(?:e\d+m\d+[a-z\d]*)?)\[([\d,]*)\]")  # the FP8 types too: f8e4m3fn, f8e5m2
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
            "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "token": 0,  # token[]: an ordering edge, no data
            "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
            "f8e3m4": 1, "f8e8m0fnu": 1}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO result shape, e.g. 'f32[128,512]{1,0}' or a tuple of them."""
    total = 0
    for dtype, dims in ARRAY.findall(shape):
        total += ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


# XLA:TPU fuses an all-reduce and the slice of it that a device keeps into a computation of this
# name, which it runs as a reduce-scatter.
FUSED_REDUCE_SCATTER = "all-reduce-scatter"
# Computations and the calls between them, to count what a while loop runs once per iteration.
HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
CALL = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
SCALAR_CONSTANT = re.compile(r"=\s*[su](?:32|64)\[\]\S*\s+constant\((\d+)\)")
GROUP_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
GROUP_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]")
CHANNEL = re.compile(r"\bchannel_id=(\d+)")
# Newer XLA: replica_groups=mesh['axis_0'=16,'axis_1'=2] {'axis_0'}: the named axes form a group.
GROUP_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """({computation name: its instruction lines}, the entry computation's name). An attribute
    that runs over several lines (a Pallas kernel's metadata) is joined to its instruction."""
    comps, entry, current = {}, "", None
    for line in hlo_text.splitlines():
        if current is None:
            match = HEADER.match(line)
            if match:
                current = match.group(1)
                comps[current] = []
                entry = current if line.startswith("ENTRY") else entry
        elif line.rstrip() == "}":
            current = None
        elif line[:1].isspace() or not comps[current]:
            comps[current].append(line)
        else:
            comps[current][-1] += line
    return comps, entry


def trip_count(while_line: str, comps: dict) -> int:
    """Iterations of a while op: XLA's known_trip_count where it annotates one, else the loop
    bound in the condition (a scan counts up from 0 to a constant); 1 if neither is there."""
    if match := KNOWN_TRIPS.search(while_line):
        return int(match.group(1))
    condition = re.search(r"condition=%?([\w.\-]+)", while_line)
    for line in comps.get(condition.group(1) if condition else "", []):
        if match := SCALAR_CONSTANT.search(line):
            return int(match.group(1))
    return 1


def multiplicities(comps: dict, entry: str) -> dict[str, int]:
    """How many times each computation runs per execution of the entry. Each branch of a
    conditional counts as taken (an upper bound)."""
    runs: dict = defaultdict(int)

    def visit(name: str, times: int):
        runs[name] += times
        for line in comps.get(name, []):
            trips = trip_count(line, comps) if " while(" in line else 1
            callees = [(kind, callee) for kind, callee in CALL.findall(line)]
            if match := BRANCHES.search(line):
                callees += [("branch", c.strip().lstrip("%")) for c in match.group(1).split(",")]
            for kind, callee in callees:
                visit(callee, times * (trips if kind == "body" else 1))
    if entry:
        visit(entry, 1)
    return runs


def group_size(line: str) -> int | None:
    """Devices in each replica group of a collective; None when the op names no groups."""
    if match := GROUP_IOTA.search(line):
        return int(match.group(1))
    if match := GROUP_MESH.search(line):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", match.group(1)))
        return math.prod(int(sizes[axis]) for axis in re.findall(r"'([^']+)'", match.group(2)))
    if (match := GROUP_LIST.search(line)) and match.group(1):
        return len(match.group(1).split(","))
    return None


def collective_of(line: str, computation: str = "") -> tuple[str, int, int | None] | None:
    """(kind, result bytes, group size) of the collective an HLO line runs, or None. For an async
    pair the `-start` op stands for both; bytes are one op's result size: for an all-gather the
    gathered tensor, for a reduce-scatter one device's shard."""
    match = OP.search(line)
    if not match:
        return None
    shape, kind, is_async = match.groups()
    if is_async:  # the start op's result tuple holds the operand, the result and, on TPU, a
        # collective-permute's scalar contexts
        parts = ARRAY.findall(shape)
        parts = [part for part in parts if part[1]] or parts
        shape = "{}[{}]".format(*parts[-1]) if parts else shape
    size, group = shape_bytes(shape), group_size(line)
    if kind == "all-reduce" and computation.startswith(FUSED_REDUCE_SCATTER) and group:
        kind, size = "reduce-scatter", size // group  # TPU runs the fusion as one
    return kind, size, group


def collective_ops(hlo_text: str) -> list[dict]:
    """One entry per (kind, result bytes, group size): {'kind', 'bytes', 'group', 'count'}, where
    count is the runs per step (a loop body's ops count once per iteration); see `collective_of`."""
    comps, entry = computations(hlo_text)
    runs = multiplicities(comps, entry) if entry else defaultdict(lambda: 1)
    found: dict = defaultdict(int)
    channels: dict = defaultdict(int)  # (channel id, op): its runs a step
    for name, lines in (comps or {"": hlo_text.splitlines()}).items():
        here: dict = defaultdict(int)  # (channel id, op): its lines in this computation
        for line in lines:
            if not (op := collective_of(line, name)):
                continue
            # XLA:TPU runs one async collective as pieces in several fusions (start, continuations,
            # done), each naming the op and its channel: counted once. XLA:CPU gives distinct ops
            # one channel id (a step's several collective-permutes, an all-reduce): a channel
            # names one op only together with its kind and size, and each line of one
            # computation is an op of its own. The MoE dispatch's ragged-all-to-alls are each
            # its own op, though XLA gives them one channel.
            if (channel := CHANNEL.search(line)) and op[0] != "ragged-all-to-all":
                here[channel.group(1), op] += 1
            else:
                found[op] += runs[name]
        for key, lines_here in here.items():
            channels[key] = max(channels[key], lines_here * runs[name])
    for (_, op), count in channels.items():
        found[op] += count
    return [{"kind": kind, "bytes": size, "group": group, "count": count}
            for (kind, size, group), count in found.items() if count]


def totals(ops: list[dict]) -> dict[str, dict[str, int]]:
    """{kind: {'count': n, 'bytes': b}} per step, summed over `collective_ops`' entries."""
    by_kind: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    for op in ops:
        by_kind[op["kind"]]["count"] += op["count"]
        by_kind[op["kind"]]["bytes"] += op["count"] * op["bytes"]
    return {kind: dict(by_kind[kind]) for kind in KINDS if kind in by_kind}


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """{kind: {'count': n, 'bytes': b}}: the collectives a step runs, per step."""
    return totals(collective_ops(hlo_text))


def memory_summary(compiled) -> dict:
    """Per-device memory of the compiled step (XLA's estimate); {} where XLA gives none."""
    memory = compiled.memory_analysis()
    if memory is None:
        return {}
    sizes = {"argument_bytes": memory.argument_size_in_bytes,
             "output_bytes": memory.output_size_in_bytes,
             "alias_bytes": memory.alias_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes}
    # donated outputs reuse their argument buffers
    sizes["peak_memory_bytes"] = (sizes["argument_bytes"] + sizes["output_bytes"]
                                  - sizes["alias_bytes"] + sizes["temp_bytes"])
    # Host memory (pinned_host: offloaded state): a compile-only TPU's device figures leave it
    # out, and these hold it. XLA:CPU keeps every memory kind in one and gives 0 here.
    if hasattr(memory, "host_argument_size_in_bytes"):
        sizes["host_memory_bytes"] = (memory.host_argument_size_in_bytes + memory.host_output_size_in_bytes
                                      - memory.host_alias_size_in_bytes + memory.host_temp_size_in_bytes)
    return sizes


def compiled_summary(compiled) -> dict:
    """Per-device memory of the compiled step (XLA's estimate) and the collectives it runs."""
    return {**memory_summary(compiled), "collectives": collectives(compiled.as_text())}


def host_available_bytes() -> int | None:
    """RAM the OS can still give this process: MemAvailable on Linux, else physical RAM."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_bytes_limit(device) -> int | None:
    """An accelerator's memory as its runtime reports it; None for host (CPU) and compile-only devices."""
    return (device.memory_stats() or {}).get("bytes_limit")


def check_fits_in_memory(summary: dict, local: list) -> None:
    """A UserError, before anything is written, when XLA's memory estimate cannot fit the devices.

    An accelerator reports its own limit; this process's host (CPU) devices share the host's RAM,
    so there the estimate counts once per local device.
    """
    need = summary.get("peak_memory_bytes")
    if not need or not local:
        return
    if (limit := device_bytes_limit(local[0])) is not None:
        have, where, need_all = limit, "a device holds", need
    else:
        have, where, need_all = host_available_bytes(), "this host has free", need * len(local)
    if have and need_all > have:
        gib = 2**30
        raise UserError(f"the train step needs {need_all / gib:,.1f} GiB (XLA's estimate) but {where} "
                        f"{have / gib:,.1f} GiB; lower train.micro_batch, model.block_size or the "
                        "model size, or spread it over more devices with --mesh")
