"""The layouts jaxpar.plan searches: every split of a target's devices over the mesh's planned axes
(jaxpar.core.axes), left by each size of the other axes (--cp, --ep; for a mixture of experts,
every ep dividing its expert count by default), or the meshes a user lists, each as {axis key:
size}; and the recompute policies, offloads and FP8 recipes it tries with each."""

import itertools
import math

from jaxpar.core.axes import AXES, EXPERT_AXIS
from jaxpar.core.errors import UserError
from jaxpar.core.remat import HOST, POLICIES, has_host_memory
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


def expert_sizes(model, devices: int) -> list[int]:
    """The ep sizes `--ep auto` tries: every divisor of a mixture's expert count that divides the
    devices (each device holds the same number of experts), as auto tries dp, tp and pp; 1 alone
    for a dense model."""
    experts = getattr(model, "n_experts", 0) or 1
    return [size for size in range(1, experts + 1) if experts % size == 0 and devices % size == 0]


# The axes outside the split whose sizes `auto` chooses from the model (the rest default to 1).
AUTO_SIZES = {EXPERT_AXIS.key: expert_sizes}


def fixed_sizes(asked: dict[str, str], model, devices: int) -> dict[str, list[int]]:
    """The sizes `--layouts auto` tries of each axis it does not split the devices over, by key,
    from the flags' text ({'cp': '1,2', 'ep': 'auto'}): the sizes listed, or `auto`'s."""
    fixed = {}
    for key, text in asked.items():
        if key in AUTO_SIZES and text.strip() == "auto":
            fixed[key] = AUTO_SIZES[key](model, devices)
            continue
        fixed[key] = int_list(text, f"--{key}")
        if not fixed[key] or min(fixed[key]) < 1:
            raise UserError(f"--{key} takes positive sizes, got {text!r}")
    return fixed


def int_list(text: str, flag: str) -> list[int]:
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, got {text!r}") from None


def choices(asked: str, known: tuple[str, ...], flag: str) -> list[str]:
    """A flag's comma-separated values, each one of `known`, or all of them for auto."""
    if asked.strip() == "auto":
        return list(known)
    values = [v.strip() for v in asked.split(",") if v.strip()]
    if not values or set(values) - set(known):
        raise UserError(f"{flag} takes values from {', '.join(known)} (or auto), got {asked!r}")
    return values


def fp8_choices(asked: str | None, configured: str, platform: str) -> list[str]:
    """The model.fp8 values to try (`--fp8`): the config's alone where none is asked for, those
    listed, or auto's: every registered one whose recipe runs on the target's platform."""
    from jaxpar.nn.recipes import FP8, RECIPES
    if asked is None:
        return [configured]
    if asked.strip() == "auto":
        return [name for name, recipe in FP8.items() if platform in RECIPES[recipe].platforms]
    return choices(asked, tuple(FP8), "--fp8")


def host_memory_choices(target, devices: list, remats: list, offloads: list, auto: set) -> tuple[list, list]:
    """The policies and offloads to try on these devices: those that keep state in host memory
    only where the devices have that memory kind (left out of an `auto`, else refused)."""
    if has_host_memory(devices):
        return remats, offloads
    offloading = [r for r in remats if POLICIES[r].offloads] + [o for o in offloads if o != "none"]
    asked = [v for v in offloading if ("remat" if v in POLICIES else "offload") not in auto]
    if asked:
        raise UserError(f"--target {target.name}: its devices have no {HOST} memory kind to offload to, "
                        f"so {', '.join(asked)} cannot run there; plan without it")
    return [r for r in remats if not POLICIES[r].offloads], ["none"]
