"""A jitted function over many rows, in passes of a fixed number of rows on a mesh: what
`jaxpar.eval`'s loss and the downstream tasks' scores both do.

Each pass holds `rows` rows, rounded up to a multiple of the mesh's batch ways (whole rows on
every data replica); the last pass is padded with repeats of its rows, and only the real rows'
results are kept. The first pass, which compiles, is left out of the time.
"""

import sys
import time

import jax
import numpy as np
from tqdm import tqdm

from jaxpar.core.sharding import batch_sharding, split_ways


def passes_rows(mesh, rows: int) -> int:
    """`rows` rounded up to whole rows on every data replica."""
    ways = split_ways(mesh, "batch")
    return -(-rows // ways) * ways


def over_rows(fn, batch_at, total: int, mesh, rows: int, progress: bool = False, unit: str = "row"):
    """(fn's results for rows 0..total-1, concatenated; the seconds past the first pass).
    batch_at(first, count) gives the arrays of those rows, leading dim count; fn takes them on
    the mesh, split over its batch axes, and returns one result per row."""
    rows, sharding = passes_rows(mesh, rows), batch_sharding(mesh, leading=0)
    out, seconds = [], 0.0
    with jax.set_mesh(mesh), tqdm(total=total, unit=unit, disable=not progress, file=sys.stderr) as bar:
        for first in range(0, total, rows):
            count = min(rows, total - first)
            arrays = [np.resize(a, (rows, *a.shape[1:])) for a in batch_at(first, count)]  # padded with repeats
            start = time.perf_counter()
            result = np.asarray(fn(*(jax.device_put(a, sharding) for a in arrays)))
            if first:  # the first pass includes the compile
                seconds += time.perf_counter() - start
            out.append(result[:count])
            bar.update(count)
    return np.concatenate(out), seconds
