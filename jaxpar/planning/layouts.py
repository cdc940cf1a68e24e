"""The layouts jaxpar.plan searches: every split of a target's devices over the mesh's planned axes
(jaxpar.core.axes), or the meshes a user lists, each as {axis key: size}."""

import itertools
import math

from jaxpar.core.axes import AXES
from jaxpar.core.errors import UserError
from jaxpar.parallel.mesh import infer_axis, parse_mesh_spec


def factorizations(devices: int, count: int) -> list[tuple[int, ...]]:
    """Every way to write devices as a product of `count` sizes, the first size varying slowest."""
    if count == 1:
        return [(devices,)]
    return [(first, *rest) for first in range(1, devices + 1) if devices % first == 0
            for rest in factorizations(devices // first, count - 1)]


def parse_layouts(spec: str, devices: int, fixed: dict[str, list[int]] | None = None) -> list[dict[str, int]]:
    """Every layout asked for, as {axis key: size}: "auto" is every split of the devices over the
    planned axes (dp, tp, pp), left by each combination of the sizes in `fixed` ({'cp': [1, 2]})
    of the other axes (default 1)."""
    if spec == "auto":
        fixed = fixed or {}
        others = [a.key for a in AXES if not a.planned]
        planned = [a.key for a in AXES if a.planned]
        layouts = []
        for sizes in itertools.product(*(fixed.get(key, [1]) for key in others)):
            left = devices // math.prod(sizes)
            if devices % math.prod(sizes) == 0:
                layouts += [dict(zip(planned, split)) | dict(zip(others, sizes))
                            for split in factorizations(left, len(planned))]
        return [{a.key: layout[a.key] for a in AXES} for layout in layouts]
    layouts = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        sizes = {key.split(".")[1]: int(v) for key, v in parse_mesh_spec(part).items()}
        try:  # a -1 axis is inferred from the target's device count, as --mesh infers it
            sizes = infer_axis(sizes, devices)
        except UserError:
            pass  # left at -1: the trainer's own check lists the layout as skipped, saying why
        layouts.append(sizes)
    return layouts


def int_list(text: str, flag: str) -> list[int]:
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, got {text!r}") from None
