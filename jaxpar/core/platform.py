"""Which JAX platforms start: on a machine with no TPU and no GPU attached, the CPU alone.

The `tpu` extra installs libtpu, and JAX tries a TPU first wherever libtpu is installed. Without a
TPU, libtpu prints start-up errors (worker hostnames, accelerator type) into every command's
stderr before JAX falls back to the CPU. Compiling for a TPU pod slice (`jaxpar.plan --target
tpu:...`) loads libtpu's topologies on its own, so it works either way.
"""

import importlib.util
import os

GPUS = ("gpu", "cuda")  # the names JAX gives an NVIDIA GPU's platform
# The most CPU host devices a process is given (jaxpar.parallel.mesh.force_host_devices). XLA:CPU
# runs a thread for each, and its start-up grows faster than the count: on 2 cores 2048 started in
# 1 s, 4096 in 13 s, 8192 in 100 s, and 99999 ran 8 minutes into a native abort (no threads left).
MAX_HOST_DEVICES = 4096


def attached_accelerators() -> bool:
    """Whether a TPU or a GPU is attached, by JAX's own checks of the PCI devices."""
    from jax._src import hardware_utils  # what JAX checks before it starts libtpu
    return (hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
            or hardware_utils.has_visible_nvidia_gpu() or hardware_utils.num_available_amd_gpus(stop_at=1) > 0)


def skip_absent_tpu() -> None:
    """Start the CPU platform alone where libtpu is installed but nothing but the CPU could run.
    JAX_PLATFORMS or JAX_FORCE_TPU_INIT, when set, decide instead."""
    if (os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ
            or importlib.util.find_spec("libtpu") is None or attached_accelerators()):
        return
    import jax
    jax.config.update("jax_platforms", "cpu")
