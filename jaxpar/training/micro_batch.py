"""`train.micro_batch = "auto"`, resolved on the mesh before anything is traced.

On a GPU or TPU it is the most rows a device takes in one pass (one pass if they fit) whose
compiled train step fits the device's memory by XLA's own memory analysis: a binary search over
the splits of the device's rows, one compile each, the largest first. On a CPU it is 6, the
value tuned for a 2-core CPU's caches (jaxpar.core.config). A pipeline's rows per pass are its
microbatches' (pipeline.microbatches), so there `auto` is 0, no limit.
"""

import copy

from jaxpar.core.axes import PIPE
from jaxpar.core.config import MICRO_BATCH_AUTO, Config
from jaxpar.core.sharding import split_ways
from jaxpar.nn.kernels import platform_of
from jaxpar.parallel import hlo
from jaxpar.training.abstract_step import compile_abstract_step

CPU_MICRO_BATCH = 6


def with_micro_batch(cfg: Config, rows: int) -> Config:
    resolved = copy.deepcopy(cfg)
    resolved.train.micro_batch = rows
    return resolved


def rows_per_pass_options(cfg: Config, mesh) -> list[int]:
    """A device's rows per pass for each split of its rows, most first."""
    rows = cfg.train.batch_size // cfg.train.grad_accum // split_ways(mesh, "batch")
    return [rows // k for k in range(1, rows + 1) if rows % k == 0]


def step_bytes(cfg: Config, vocab: int, mesh, eot_id: int | None) -> int:
    """XLA's peak memory per device of cfg's compiled train step on mesh."""
    return hlo.memory_summary(compile_abstract_step(cfg, vocab, mesh, eot_id)).get("peak_memory_bytes", 0)


def largest_fitting(cfg: Config, vocab: int, mesh, eot_id: int | None, capacity: int) -> tuple[int, int]:
    """(the most rows per pass whose step needs at most `capacity` bytes a device, compiles
    made); the fewest rows where none fits, for the trainer's own memory check to refuse.
    Memory grows with the rows, so a binary search over the options finds it."""
    options = rows_per_pass_options(cfg, mesh)
    fits = lambda rows: step_bytes(with_micro_batch(cfg, rows), vocab, mesh, eot_id) <= capacity
    if len(options) == 1 or fits(options[0]):  # one pass: the common case, one compile
        return options[0], int(len(options) > 1)
    lo, hi, compiles = 1, len(options) - 1, 1  # options[hi] is taken when nothing fits
    while lo < hi:
        middle = (lo + hi) // 2
        compiles += 1
        if fits(options[middle]):
            hi = middle
        else:
            lo = middle + 1
    return options[lo], compiles


def resolve(cfg: Config, vocab: int, mesh, eot_id: int | None, capacity: int | None = None) -> tuple[Config, str | None]:
    """(cfg with train.micro_batch an integer, a one-line account of `auto`'s choice or None)."""
    if cfg.train.micro_batch != MICRO_BATCH_AUTO:
        return cfg, None
    if mesh.shape[PIPE] > 1:
        return with_micro_batch(cfg, 0), None
    platform = platform_of(mesh)
    capacity = capacity or hlo.device_bytes_limit(mesh.devices.flat[0])
    if platform == "cpu" or not capacity:
        return with_micro_batch(cfg, CPU_MICRO_BATCH), None
    rows, compiles = largest_fitting(cfg, vocab, mesh, eot_id, capacity)
    note = (f"train.micro_batch=auto: {rows} rows a pass on each {platform} device, the most whose "
            f"step fits its {capacity / 2**30:,.1f} GiB ({compiles} compile{'s' * (compiles != 1)})")
    return with_micro_batch(cfg, rows), note
