"""Read a compiled step: which collectives it runs (count and bytes), and whether its memory fits."""

import math
import os
import re
from collections import defaultdict

from jaxpar.errors import UserError

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# `%name = <result shape> <op>(` where <op> may carry an async `-start` suffix.
OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(KINDS) + r")(-start)?\(")
ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
            "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO result shape, e.g. 'f32[128,512]{1,0}' or a tuple of them."""
    total = 0
    for dtype, dims in ARRAY.findall(shape):
        total += ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """{kind: {'count': n, 'bytes': b}} over the program; bytes are each op's result size.

    An async pair (`-start` / `-done`) counts once. For an all-gather the result is the gathered
    tensor; for a reduce-scatter it is one device's shard.
    """
    found: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    for line in hlo_text.splitlines():
        match = OP.search(line)
        if match:
            shape, kind, is_async = match.groups()
            if is_async:  # the start op's result tuple holds the operand and the result
                parts = ARRAY.findall(shape)
                shape = "{}[{}]".format(*parts[-1]) if parts else shape
            found[kind]["count"] += 1
            found[kind]["bytes"] += shape_bytes(shape)
    return {kind: dict(found[kind]) for kind in KINDS if kind in found}


def compiled_summary(compiled) -> dict:
    """Per-device memory of the compiled step (XLA's estimate) and the collectives it runs."""
    memory = compiled.memory_analysis()
    sizes = {} if memory is None else {
        "argument_bytes": memory.argument_size_in_bytes, "output_bytes": memory.output_size_in_bytes,
        "alias_bytes": memory.alias_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes}
    if sizes:  # donated outputs reuse their argument buffers
        sizes["peak_memory_bytes"] = (sizes["argument_bytes"] + sizes["output_bytes"]
                                      - sizes["alias_bytes"] + sizes["temp_bytes"])
    return {**sizes, "collectives": collectives(compiled.as_text())}


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


def check_fits_in_memory(summary: dict, local: list) -> None:
    """A UserError, before anything is written, when XLA's memory estimate cannot fit the devices.

    An accelerator reports its own limit; this process's host (CPU) devices share the host's RAM,
    so there the estimate counts once per local device.
    """
    need = summary.get("peak_memory_bytes")
    if not need or not local:
        return
    stats = local[0].memory_stats() or {}
    if "bytes_limit" in stats:
        have, where, need_all = stats["bytes_limit"], "a device holds", need
    else:
        have, where, need_all = host_available_bytes(), "this host has free", need * len(local)
    if have and need_all > have:
        gib = 2**30
        raise UserError(f"the train step needs {need_all / gib:,.1f} GiB (XLA's estimate) but {where} "
                        f"{have / gib:,.1f} GiB; lower train.micro_batch, model.block_size or the "
                        "model size, or spread it over more devices with --mesh")
