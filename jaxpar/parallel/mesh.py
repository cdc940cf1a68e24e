"""The device mesh: parse `dp=2,tp=2`, force CPU host devices when needed, build an Auto-typed Mesh.

The axes, their `--mesh` keys, their device order and their checks come from jaxpar.core.axes.
"""

import math
import os

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxpar.core.axes import AXES, KEYS, NAMES, check_axes, sizes_of
from jaxpar.core.config import Config, MeshConfig
from jaxpar.core.errors import UserError
from jaxpar.core.platform import MAX_HOST_DEVICES


def parse_mesh_spec(spec: str) -> dict[str, str]:
    """'dp=2,tp=2' -> {'mesh.dp': '2', 'mesh.tp': '2'}; omitted axes keep their value (default 1)."""
    overrides = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        axis, sep, size = part.partition("=")
        axis = axis.strip()
        if not sep or axis not in KEYS:
            raise UserError(f"bad mesh entry '{part}' in --mesh {spec!r}; use AXIS=SIZE with AXIS "
                            f"in {', '.join(KEYS)}, e.g. --mesh dp=2,tp=2")
        try:
            int(size)
        except ValueError:
            raise UserError(f"mesh axis {axis} needs an integer size (or -1), got {size!r}") from None
        if f"mesh.{axis}" in overrides:
            raise UserError(f"mesh axis {axis} is given twice in --mesh {spec!r}; name each axis once")
        overrides[f"mesh.{axis}"] = size.strip()
    # A spec replaces the whole mesh: axes it omits are 1.
    return {f"mesh.{a}": "1" for a in KEYS} | overrides


def mesh_help() -> str:
    """--mesh's help, from the axis table."""
    return ("e.g. dp=2,tp=2; axes " + ", ".join(f"{a.key} ({a.name})" for a in AXES)
            + "; omitted axes are 1, one axis may be -1 (inferred)")


def requested_devices(mesh: MeshConfig) -> int | None:
    """Devices the mesh needs, or None when one axis is inferred (-1) from the device count."""
    sizes = sizes_of(mesh).values()
    return None if -1 in sizes else math.prod(sizes)


def force_host_devices(mesh: MeshConfig, per_process: int | None = None, asked: str = "") -> None:
    """On a CPU-only machine, give JAX as many host devices as the mesh needs, up to
    MAX_HOST_DEVICES; `asked` names what asks for them in the error past that (default: the mesh).

    Must run before JAX initialises its backends. A device count the user set (XLA_FLAGS,
    JAX_NUM_CPU_DEVICES, or jax.config) wins. On a GPU or TPU host the CPU count is irrelevant: the mesh uses the
    accelerators, so setting it is harmless.
    """
    needed = per_process or requested_devices(mesh)
    user_set = ("xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
                or "JAX_NUM_CPU_DEVICES" in os.environ or jax.config.jax_num_cpu_devices > 0)
    if needed and needed > MAX_HOST_DEVICES and not user_set:
        spec = ",".join(f"{key}={size}" for key, size in sizes_of(mesh).items() if size != 1)
        spread = "" if asked else ", or spread the mesh over processes (dist.num_processes)"
        raise UserError(f"{asked or f'the mesh {spec}'} asks for {needed} devices in this process, and jaxpar starts "
                        f"at most {MAX_HOST_DEVICES} CPU host devices (XLA:CPU runs a thread for each; 8192 took 100 s "
                        f"to start on 2 cores); ask for at most {MAX_HOST_DEVICES}{spread}")
    if needed and needed > 1 and not user_set:
        try:
            jax.config.update("jax_num_cpu_devices", needed)
        except RuntimeError:
            pass  # backends already initialised (library use): keep the devices that exist


def infer_axis(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
    """Every axis's size by key, a -1 one set to what the other axes leave of num_devices."""
    sizes = dict(sizes)
    unknown = [key for key, size in sizes.items() if size == -1]
    if unknown:
        known = math.prod(s for s in sizes.values() if s != -1)
        if num_devices % known:
            raise UserError(f"cannot infer the -1 mesh axis: {num_devices} devices are not "
                            f"divisible by the other axes' product {known}")
        sizes[unknown[0]] = num_devices // known
    return sizes


def resolve_mesh_shape(cfg: Config, num_devices: int) -> dict[str, int]:
    """cfg's mesh sizes on `num_devices` (one -1 inferred), checked by every axis's checks. What
    the model's strategy and kernels need of the sizes is asked where the plan is made
    (jaxpar.training.step.execution)."""
    sizes = infer_axis(sizes_of(cfg.mesh), num_devices)
    if math.prod(sizes.values()) != num_devices:
        spec = ",".join(f"{key}={size}" for key, size in sizes.items())
        raise UserError(f"mesh {spec} uses {math.prod(sizes.values())} devices but {num_devices} are "
                        f"available; make the product {num_devices}, or use -1 for one axis")
    check_axes(cfg.run, sizes)
    return sizes


def build_mesh(cfg: Config, devices=None) -> Mesh:
    """An Auto-typed Mesh over `devices` (default: all), validated against cfg."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(cfg, len(devices))
    # jax.make_mesh lays devices out by topology and process, the last axis the most local, so
    # the axes go in by locality: a tensor group stays on one host where it can (its all-reduces
    # run in every layer), and a context ring next to it (its K/V blocks move every layer too).
    # The grid is then put back in the mesh's axis order.
    local_order = sorted(AXES, key=lambda a: a.locality)
    shape, names = tuple(sizes[a.key] for a in local_order), tuple(a.name for a in local_order)
    try:
        grid = jax.make_mesh(shape, names, devices=devices).devices
    except (ValueError, NotImplementedError):
        # A TPU torus whose physical axes do not factor into these sizes (v5p's 4x4x4 as 16x2x2):
        # let an axis of the mesh span part of a physical axis.
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(grid.transpose([local_order.index(a) for a in AXES]), NAMES,
                axis_types=(AxisType.Auto,) * len(AXES))


def axes_crossing_processes(mesh: Mesh) -> list[str]:
    """The CLI names of the mesh axes whose device groups span more than one process: their
    collectives cross the links between hosts."""
    process = np.vectorize(lambda d: d.process_index)(mesh.devices)
    crossing = []
    for i, axis in enumerate(AXES):
        groups = np.moveaxis(process, i, -1).reshape(-1, process.shape[i])
        if (groups != groups[:, :1]).any():
            crossing.append(axis.key)
    return crossing


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """{'dp': .., 'tp': .., 'pp': .., ...} for logs and run.json."""
    return {axis.key: mesh.shape[axis.name] for axis in AXES}
