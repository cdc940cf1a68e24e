"""`train.micro_batch = "auto"`, chosen on the mesh before anything is traced, and held in the
execution plan (jaxpar.training.step.build): the config keeps what the user asked.

On a GPU or TPU it is the most rows a device takes in one pass (one pass if they fit) whose
compiled train step fits the device's memory by XLA's own memory analysis: a binary search over
the splits of the device's rows, one compile each, the largest first. On a CPU it is 6, the
value tuned for a 2-core CPU's caches (jaxpar.core.config). A pipeline's rows per pass are its
microbatches' (pipeline.microbatches), so there `auto` is 0, no limit.
"""

from collections.abc import Callable

from jaxpar.core.axes import PIPE
from jaxpar.core.config import MICRO_BATCH_AUTO, TrainConfig
from jaxpar.core.sharding import split_ways
from jaxpar.parallel import hlo

CPU_MICRO_BATCH = 6


def rows_per_pass_options(t: TrainConfig, dp: int) -> list[int]:
    """A device's rows per pass for each split of its rows, most first; dp: the ways rows split."""
    rows = t.batch_size // t.grad_accum // dp
    return [rows // k for k in range(1, rows + 1) if rows % k == 0]


def largest_fitting(options: list[int], fits: Callable[[int], bool]) -> tuple[int, int]:
    """(the most rows per pass in `options` (most first) that `fits`, compiles made); the fewest
    rows where none fits, for the trainer's own memory check to refuse. Memory grows with the
    rows, so a binary search over the options finds it."""
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


def choose(t: TrainConfig, mesh, platform: str, compiled_at: Callable, capacity: int | None = None
           ) -> tuple[int, str | None]:
    """(train.micro_batch as a number, a one-line account of `auto`'s choice or None);
    compiled_at(rows): the train step compiled at that many rows a pass."""
    if t.micro_batch != MICRO_BATCH_AUTO:
        return t.micro_batch, None
    if mesh.shape[PIPE] > 1:
        return 0, None
    capacity = capacity or hlo.device_bytes_limit(mesh.devices.flat[0])
    if platform == "cpu" or not capacity:
        return CPU_MICRO_BATCH, None
    options = rows_per_pass_options(t, split_ways(mesh, "batch"))
    rows, compiles = largest_fitting(
        options, lambda rows: hlo.memory_summary(compiled_at(rows)).get("peak_memory_bytes", 0) <= capacity)
    note = (f"train.micro_batch=auto: {rows} rows a pass on each {platform} device, the most whose "
            f"step fits its {capacity / 2**30:,.1f} GiB ({compiles} compile{'s' * (compiles != 1)})")
    return rows, note
