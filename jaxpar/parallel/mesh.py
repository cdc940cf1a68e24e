"""The device mesh: parse `dp=2,tp=2`, force CPU host devices when needed, build an Auto-typed Mesh.

Mesh axes are ('data', 'tensor', 'pipe', 'context'); the CLI names them dp, tp, pp and cp.
"""

import math
import os

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxpar.core.config import Config, MeshConfig
from jaxpar.core.errors import UserError
from jaxpar.models.kernels import check_mesh

MESH_AXES = ("data", "tensor", "pipe", "context")
CLI_AXES = ("dp", "tp", "pp", "cp")  # same order as MESH_AXES


def parse_mesh_spec(spec: str) -> dict[str, str]:
    """'dp=2,tp=2' -> {'mesh.dp': '2', 'mesh.tp': '2'}; omitted axes keep their value (default 1)."""
    overrides = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        axis, sep, size = part.partition("=")
        axis = axis.strip()
        if not sep or axis not in CLI_AXES:
            raise UserError(f"bad mesh entry '{part}' in --mesh {spec!r}; use AXIS=SIZE with AXIS "
                            f"in {', '.join(CLI_AXES)}, e.g. --mesh dp=2,tp=2")
        try:
            int(size)
        except ValueError:
            raise UserError(f"mesh axis {axis} needs an integer size (or -1), got {size!r}") from None
        if f"mesh.{axis}" in overrides:
            raise UserError(f"mesh axis {axis} is given twice in --mesh {spec!r}; name each axis once")
        overrides[f"mesh.{axis}"] = size.strip()
    # A spec replaces the whole mesh: axes it omits are 1.
    return {f"mesh.{a}": "1" for a in CLI_AXES} | overrides


def requested_devices(mesh: MeshConfig) -> int | None:
    """Devices the mesh needs, or None when one axis is inferred (-1) from the device count."""
    sizes = (mesh.dp, mesh.tp, mesh.pp, mesh.cp)
    return None if -1 in sizes else math.prod(sizes)


def force_host_devices(mesh: MeshConfig, per_process: int | None = None) -> None:
    """On a CPU-only machine, give JAX as many host devices as the mesh needs.

    Must run before JAX initialises its backends. A device count the user set (XLA_FLAGS,
    JAX_NUM_CPU_DEVICES, or jax.config) wins. On a GPU or TPU host the CPU count is irrelevant: the mesh uses the
    accelerators, so setting it is harmless.
    """
    needed = per_process or requested_devices(mesh)
    user_set = ("xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
                or "JAX_NUM_CPU_DEVICES" in os.environ or jax.config.jax_num_cpu_devices > 0)
    if needed and needed > 1 and not user_set:
        try:
            jax.config.update("jax_num_cpu_devices", needed)
        except RuntimeError:
            pass  # backends already initialised (library use): keep the devices that exist


def infer_axis(sizes: list[int], num_devices: int) -> list[int]:
    """(dp, tp, pp, cp) with a -1 axis set to what the other axes leave of num_devices."""
    sizes = list(sizes)
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if num_devices % known:
            raise UserError(f"cannot infer the -1 mesh axis: {num_devices} devices are not "
                            f"divisible by the other axes' product {known}")
        sizes[sizes.index(-1)] = num_devices // known
    return sizes


def resolve_mesh_shape(cfg: Config, num_devices: int) -> tuple[int, int, int, int]:
    """Check the mesh against the device count and the model; return (dp, tp, pp, cp)."""
    sizes = infer_axis([cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.cp], num_devices)
    dp, tp, pp, cp = sizes
    spec = ",".join(f"{a}={s}" for a, s in zip(CLI_AXES, sizes))
    if math.prod(sizes) != num_devices:
        raise UserError(f"mesh {spec} uses {math.prod(sizes)} devices but {num_devices} are available; "
                        f"make the product {num_devices}, or use -1 for one axis")
    if cp > 1:
        check_context(cfg, cp, pp, tp)
    if cfg.model.n_head % tp:
        raise UserError(f"tp={tp} does not divide model.n_head={cfg.model.n_head}; "
                        f"choose tp from the divisors of n_head")
    if cfg.model.kv_heads % tp:
        raise UserError(f"tp={tp} does not divide model.n_kv_head={cfg.model.kv_heads}: tensor parallelism "
                        f"splits the KV heads; use tp from the divisors of {cfg.model.kv_heads} and put "
                        f"the other devices on dp (with --zero 3 to split the weights too)")
    if cfg.model.sequence_parallel and cfg.model.block_size % tp:
        raise UserError(f"tp={tp} does not divide model.block_size={cfg.model.block_size}, which "
                        f"sequence parallelism splits over it; choose a block size divisible by tp "
                        f"or pass --model.sequence_parallel=false")
    micro_batch = cfg.train.batch_size // cfg.train.grad_accum
    if micro_batch % dp:
        raise UserError(f"dp={dp} does not divide the batch of {micro_batch} sequences per "
                        f"microbatch (train.batch_size / train.grad_accum); change one of them")
    if pp > 1:
        from jaxpar.parallel.schedule import resolve_microbatches
        resolve_microbatches(cfg, dp, pp)
    return dp, tp, pp, cp


def check_context(cfg: Config, cp: int, pp: int, tp: int) -> None:
    """What context parallelism needs, and the combinations it does not support yet."""
    m = cfg.model
    if m.block_size % (2 * cp):
        raise UserError(f"cp={cp} needs model.block_size divisible by 2*cp={2 * cp} (the sequence is cut into "
                        f"2*cp chunks, two per device); got {m.block_size}")
    if m.dropout > 0:
        raise UserError(f"model.dropout={m.dropout} with cp={cp}: ring attention has no attention dropout; "
                        "pass --model.dropout=0 or drop cp")
    if m.sequence_parallel and m.block_size % (cp * tp):
        raise UserError(f"sequence parallelism with cp={cp} splits the stream over cp*tp={cp * tp}; "
                        f"model.block_size={m.block_size} does not divide by it")


def build_mesh(cfg: Config, devices=None) -> Mesh:
    """An Auto-typed Mesh over `devices` (default: all), validated against cfg."""
    devices = list(jax.devices() if devices is None else devices)
    dp, tp, pp, cp = resolve_mesh_shape(cfg, len(devices))
    check_mesh(cfg.model, devices[0].platform, cp)
    # jax.make_mesh lays devices out by topology and process, the last axis the most local.
    # Tensor goes last, so a tensor group stays on one host where it can: its all-reduces run in
    # every layer. The axes are then put back in MESH_AXES order.
    # Context goes next to it: the ring's K/V blocks move every layer too.
    try:
        grid = jax.make_mesh((dp, pp, cp, tp), ("data", "pipe", "context", "tensor"), devices=devices).devices
    except (ValueError, NotImplementedError):
        # A TPU torus whose physical axes do not factor into these sizes (v5p's 4x4x4 as 16x2x2):
        # let an axis of the mesh span part of a physical axis.
        grid = mesh_utils.create_device_mesh((dp, pp, cp, tp), devices, allow_split_physical_axes=True)
    return Mesh(grid.transpose(0, 3, 1, 2), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def axes_crossing_processes(mesh: Mesh) -> list[str]:
    """The CLI names of the mesh axes whose device groups span more than one process: their
    collectives cross the links between hosts."""
    process = np.vectorize(lambda d: d.process_index)(mesh.devices)
    crossing = []
    for i, name in enumerate(MESH_AXES):
        groups = np.moveaxis(process, i, -1).reshape(-1, process.shape[i])
        if (groups != groups[:, :1]).any():
            crossing.append(CLI_AXES[i])
    return crossing


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """{'dp': .., 'tp': .., 'pp': ..} for logs and run.json."""
    return {cli: mesh.shape[axis] for cli, axis in zip(CLI_AXES, MESH_AXES)}
