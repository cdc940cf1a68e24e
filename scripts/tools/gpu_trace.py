"""The GPU kernels of a jax.profiler trace, by name and by category (gpu_check.py's kernels
section), grouped as ../shared/gpu/trace_kernels.py groups torch's profile of nanoGPT."""

import collections
import gzip
import json
from glob import glob
from pathlib import Path

# The kernel categories of ../shared/gpu/trace_kernels.py, first match wins: torch's profile
# of nanoGPT is grouped the same way.
CATEGORIES = [("attention", ("fmha", "flash", "sdpa", "attention", "cudnn")),
              ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma", "_dot")),
              ("optimizer", ("multi_tensor", "adam", "foreach")),
              ("reduce", ("reduce", "reduction", "softmax", "norm", "cross_entropy", "nll")),
              ("copy/transpose", ("memcpy", "memset", "copy", "transpose", "concatenate", "slice", "cat_")),
              ("elementwise/fusion", ("fusion", "triton", "elementwise", "vectorized", "loop", "convert",
                                      "add", "mul"))]


def trace_kernels(trace_dir: Path) -> collections.Counter:
    """{kernel name: microseconds} of a jax.profiler trace's device streams (none on a CPU)."""
    paths = sorted(glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))
    if not paths:
        return collections.Counter()
    data = json.loads(gzip.decompress(Path(paths[-1]).read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    named = lambda kind: {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                          if e.get("ph") == "M" and e.get("name") == kind}
    processes = {pid: name for (pid, _), name in named("process_name").items()}
    gpu = {p for p, n in processes.items() if "gpu" in n.lower() or ("device" in n.lower() and "host" not in n.lower())}
    # Kernels sit on "Stream #..." lines; the "XLA Ops" and "XLA Modules" lines repeat them.
    streams = {key for key, name in named("thread_name").items() if key[0] in gpu and name.lower().startswith("stream")}
    kernels = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu and (not streams or (e["pid"], e.get("tid")) in streams):
            kernels[e["name"]] += e.get("dur", 0)
    return kernels


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")
