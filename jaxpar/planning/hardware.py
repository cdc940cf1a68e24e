"""Planning targets: the chips `jaxpar.plan` compiles for, their data-sheet figures, their devices.

A target is `tpu:<generation>-<size>`, Cloud TPU's accelerator-type name (v5e-256, v5p-128),
`gpu:h100-N`, one node of N H100s, or `cpu:N`, N forced host devices. TPU and GPU devices are
compile-only topologies (from libtpu, or JAX's CUDA plugin with a GPU target config): XLA compiles
for them on any machine, and nothing ever runs on them.
"""

import dataclasses
import importlib.util
import os
import re
import tempfile
import time

import jax

from jaxpar.core.config import MeshConfig
from jaxpar.core.errors import UserError
from jaxpar.models.flops import FP8, datasheet_peak
from jaxpar.parallel.mesh import force_host_devices

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    kind: str
    hbm_bytes: float  # memory per chip
    peak_flops: float  # dense matmul FLOP/s per chip in the compute dtype (jaxpar.flops.PEAK_FLOPS)
    hbm_bytes_per_s: float  # memory bandwidth per chip
    link_bytes_per_s: float  # one inter-chip link, one direction
    cores_per_chip: int  # v4 and v5p accelerator types count TensorCores, two per chip
    torus_dims: int
    source: str
    # The link between the chip and its host's memory (pinned_host), one direction: what an
    # offloaded optimizer state or layer input crosses. None: not known (nothing offloads).
    host_bytes_per_s: float | None = None
    # Dense FP8 matmul FLOP/s, where the chip has FP8 units (jaxpar.flops.PEAK_FLOPS): the roofline
    # times FP8 GEMMs at it. None: no FP8 units (those GEMMs at the compute dtype's peak).
    fp8_peak_flops: float | None = None


# One table, every figure from the source given beside it; the peaks are jaxpar.models.flops' data-sheet
# table's (bf16 here; chip_for picks the compute dtype's), FP8's where the chip has FP8 units (the
# H100's and H200's; no TPU here has them). Google publishes no TPU's host link: the
# TPUs' is a conservative 15 GB/s a direction, the PCIe figure of "How to Scale Your Model" (part 2,
# whose worked example gives a v6e 1.5e10 bytes/s; it puts the TPUs' PCIe at 16-32 GB/s).
TPU_HOST_LINK = 15e9
CHIPS = {
    # cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16; 16 GB HBM2 at 819 GB/s, of which XLA:TPU gives
    # a program 15.75 GiB ("exceeds available HBM (15.75G)"); ICI 1600 Gbps over 4 ports, i.e.
    # 50 GB/s per port and direction.
    "v5e": Chip("TPU v5e", 15.75 * GiB,
                datasheet_peak("TPU v5e", "bfloat16"), 819e9, 50e9, 1, 2, "cloud.google.com/tpu/docs/v5e; XLA:TPU",
                TPU_HOST_LINK),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16; 95 GiB HBM at 2765 GB/s; 1200 GB/s
    # bidirectional ICI per chip over a 3-D torus's 6 ports, i.e. 100 GB/s per port and direction.
    "v5p": Chip("TPU v5p", 95 * GiB,
                datasheet_peak("TPU v5p", "bfloat16"), 2765e9, 100e9, 2, 3, "cloud.google.com/tpu/docs/v5p", TPU_HOST_LINK),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16; 32 GB HBM at 1640 GB/s; 800 GB/s bidirectional
    # ICI per chip over 4 ports, i.e. 100 GB/s per port and direction.
    "v6e": Chip("TPU v6e", 32 * GiB,
                datasheet_peak("TPU v6e", "bfloat16"), 1640e9, 100e9, 1, 2, "cloud.google.com/tpu/docs/v6e", TPU_HOST_LINK),
    # cloud.google.com/tpu/docs/v4: 275 TFLOPs bf16, 32 GiB HBM at 1200 GB/s; ICI 45 GB/s per link
    # and direction (Austin et al., "How to Scale Your Model", part 2, TPU specs table).
    "v4": Chip("TPU v4", 32 * GiB,
               datasheet_peak("TPU v4", "bfloat16"), 1200e9, 45e9, 2, 3, "cloud.google.com/tpu/docs/v4; scaling book",
               TPU_HOST_LINK),
    # NVIDIA H100 SXM5 data sheet: 989 TFLOPS dense bf16, 80 GB HBM3 at 3.35 TB/s (XLA counts
    # 79.1 GiB usable), NVLink 900 GB/s per GPU, both directions: 450 GB/s each way through NVSwitch,
    # taken here as two links of 225 GB/s so that the ring model gives a ring the full 450. The host
    # link is PCIe Gen5 x16 (the data sheet's "PCIe Gen5: 128 GB/s", both directions): 64 GB/s each way.
    "h100": Chip("NVIDIA H100 SXM", 84929347584,
                 datasheet_peak("NVIDIA H100 SXM", "bfloat16"), 3.35e12, 225e9, 1, 0, "nvidia.com H100 data sheet",
                 64e9, datasheet_peak("NVIDIA H100 SXM", FP8)),
    # NVIDIA H200 SXM data sheet: 141 GB HBM3e at 4.8 TB/s, the H100's 989 TFLOPS dense bf16, NVLink
    # and PCIe. Not a planning target (no compile-only H200 here): scripts/tools/gpu_check.py's bound
    # for a step measured on one.
    "h200": Chip("NVIDIA H200 SXM", 141e9,
                 datasheet_peak("NVIDIA H200", "bfloat16"), 4.8e12, 225e9, 1, 0, "nvidia.com H200 data sheet (SXM)",
                 64e9, datasheet_peak("NVIDIA H200", FP8)),
}
GPU_KINDS = ("h100",)
# What XLA:GPU compiles for (stream_executor.GpuTargetConfigProto): the H100 SXM5's figures from
# NVIDIA's H100 whitepaper (132 SMs, compute capability 9.0, 228 KiB shared memory per SM, 50 MiB
# L2, 3.35 TB/s HBM3, 1.98 GHz boost) and CUDA's per-block limits.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version { major: 12 minor: 8 patch: 0 }
dnn_version_info { major: 9 minor: 7 }
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"""
# Slice shapes by chip count, as Cloud TPU's docs list them.
TORUS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
TORUS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
            256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
TPU_TARGET = re.compile(r"tpu:(v4|v5e|v5p|v6e)-(\d+)$")
CPU_TARGET = re.compile(r"cpu:(\d+)$")
GPU_TARGET = re.compile(r"gpu:(h100)-(\d+)$")  # one NVSwitch node: 1, 2, 4 or 8 GPUs


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as given: tpu:v5e-256
    platform: str  # tpu | cpu
    chips: int
    topology: str = ""  # libtpu's name, e.g. v5e:16x16
    generation: str = ""


def parse_target(name: str) -> Target:
    if match := CPU_TARGET.match(name):
        chips = int(match.group(1))
        if chips < 1:
            raise UserError(f"--target {name}: cpu:N needs N >= 1")
        return Target(name, "cpu", chips)
    if match := GPU_TARGET.match(name):
        gpus = int(match.group(2))
        if gpus not in (1, 2, 4, 8):
            raise UserError(f"--target {name}: gpu targets are one node of 1, 2, 4 or 8 GPUs")
        return Target(name, "gpu", gpus, f"1x1x{gpus}", match.group(1))
    match = TPU_TARGET.match(name)
    if not match:
        raise UserError(f"unknown --target '{name}'; use tpu:<generation>-<size> with generation "
                        f"in {', '.join(k for k in CHIPS if k not in GPU_KINDS)} (e.g. tpu:v5e-256, "
                        "tpu:v5p-128), gpu:h100-N (N = 1, 2, 4, 8), or cpu:N")
    generation, size = match.group(1), int(match.group(2))
    chip = CHIPS[generation]
    shapes = TORUS_3D if chip.torus_dims == 3 else TORUS_2D
    chips = size // chip.cores_per_chip
    if size % chip.cores_per_chip or chips not in shapes:
        sizes = ", ".join(str(n * chip.cores_per_chip) for n in shapes)
        raise UserError(f"--target {name}: no {generation} slice of that size; sizes are {sizes}")
    return Target(name, "tpu", chips, f"{generation}:{shapes[chips]}", generation)


def libtpu_missing(target: Target) -> UserError:
    return UserError(f"--target {target.name} compiles with libtpu, which is not installed; install "
                     f"it with: pip install 'jax[tpu]=={jax.__version__}' (or pip install -e '.[tpu]')")


def cuda_plugin_missing(target: Target) -> UserError:
    return UserError(f"--target {target.name} compiles with JAX's CUDA plugin, which is not installed; "
                     f"install it with: pip install 'jax[cuda12]=={jax.__version__}' (several GB; "
                     "no GPU is needed to compile)")


def compile_only_devices(target: Target, platform: str, **options) -> list:
    """A topology's compile-only devices. The C++ start-up complaints of libtpu or the CUDA
    plugin on a machine without the hardware go to a temporary file, shown only on failure."""
    from jax.experimental import topologies
    # Compile-only devices claim no chip, so libtpu's one-process lock has nothing to guard: two
    # plans (or a plan beside the test suite) may load it at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            topology = topologies.get_topology_desc(platform=platform, **options)
        except Exception as error:
            os.dup2(saved, 2)
            if "libtpu_lockfile" in str(error):
                raise UserError("libtpu is in use by another process (one TPU plan at a time); "
                                "wait for it, or remove /tmp/libtpu_lockfile if none is running") from None
            raise UserError(f"no compile-only devices for {target.name}: "
                            f"{str(error).strip().splitlines()[0]}") from None
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return list(topology.devices)


def tpu_devices(target: Target) -> list:
    """The slice's compile-only devices, one per chip (v4 and v5p in megacore mode)."""
    if importlib.util.find_spec("libtpu") is None:
        raise libtpu_missing(target)
    extra = {"chip_config_name": "megacore"} if CHIPS[target.generation].cores_per_chip > 1 else {}
    if target.chips < 4:  # a slice smaller than one host's default 2x2 chips is its own host
        dims = [int(d) for d in target.topology.split(":")[1].split("x")]
        extra["chips_per_host_bounds"] = tuple(dims + [1] * (3 - len(dims)))
    return compile_only_devices(target, "tpu", topology_name=target.topology, **extra)


def gpu_devices(target: Target) -> list:
    """One node's compile-only GPUs: XLA:GPU compiles for the target config, no GPU needed."""
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        raise cuda_plugin_missing(target)
    return compile_only_devices(target, "cuda", topology_name=target.generation,
                                target_config=H100_TARGET_CONFIG, topology=target.topology)


def cpu_devices(target: Target) -> list:
    """N host devices; call before anything starts JAX's backends (as `jaxpar.train` does)."""
    force_host_devices(MeshConfig(), per_process=target.chips, asked=f"--target {target.name}")  # as jaxpar.train does
    devices = jax.devices("cpu")
    if len(devices) < target.chips:
        raise UserError(f"--target {target.name}: this process has {len(devices)} CPU devices; "
                        "run jaxpar.plan in a fresh process (or set JAX_NUM_CPU_DEVICES)")
    return devices[: target.chips]


def measured_copy_bandwidth(device, size: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a jitted copy (read + write) of `size` bytes on one device."""
    import jax.numpy as jnp
    x = jax.device_put(jnp.ones(size // 4, jnp.float32), device)
    copy = jax.jit(lambda a: a * 1.0001)
    copy(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size / best


def chip_for(target: Target, devices: list, dtype: str) -> Chip:
    """The data-sheet chip of a TPU or GPU target, with the compute dtype's peak (float32 runs as
    TF32 on an H100); for cpu:N, figures measured on this host and split
    over the N devices, which share its cores, memory and memory bus."""
    if target.platform in ("tpu", "gpu"):
        chip = CHIPS[target.generation]
        return dataclasses.replace(chip, peak_flops=datasheet_peak(chip.kind, dtype))
    from jaxpar.models.flops import measure_matmul_peak
    from jaxpar.parallel.hlo import host_available_bytes
    n, bandwidth = target.chips, measured_copy_bandwidth(devices[0])
    # Host memory is the devices' own memory here: an offload is a copy at the copy's bandwidth.
    return Chip(f"host CPU / {n}", (host_available_bytes() or 0) / n,
                measure_matmul_peak(devices[0], dtype) / n, bandwidth / n, bandwidth / (2 * n), 1, 1,
                f"measured here: {dtype} matmul peak, RAM available and a copy's bandwidth, / {n}", bandwidth / n)


def target_devices(target: Target) -> list:
    return {"tpu": tpu_devices, "gpu": gpu_devices, "cpu": cpu_devices}[target.platform](target)
