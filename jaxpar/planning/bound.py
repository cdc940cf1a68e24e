"""The plan's roofline bound for a step that runs here, so a measured step can stand beside it.

`chip_here` picks the planning chip of the devices this process runs on (jaxpar.planning.hardware's
figures, an H100's or H200's; a CPU's measured, as `jaxpar.plan --target cpu:N` measures them), and `step_bound` runs the plan's roofline
(jaxpar.planning.roofline.estimate) over a compiled step's HLO with it. Read-only use of the
planner: nothing here changes what `jaxpar.plan` reports.
"""

import dataclasses
import functools

from jaxpar.models.flops import datasheet_peak
from jaxpar.planning import roofline
from jaxpar.planning.hardware import CHIPS, Chip, chip_for, parse_target

# Device kinds of other parts (H100 PCIe or NVL, H200 NVL) have other peaks and bandwidths than
# the SXM figures of hardware.CHIPS: they get no bound rather than a wrong one.
OTHER_PARTS = ("PCIE", "NVL")


@functools.cache
def chip_here(platform: str, kind: str, devices: int, dtype: str, device=None) -> Chip | None:
    """The planning chip for `devices` devices of this platform and device kind, with the compute
    dtype's peak; None where the planner has no figures for the kind. `device`: a CPU device, on
    which the CPU's peak and bandwidth are measured (once per process and dtype)."""
    if platform == "cpu":
        return chip_for(parse_target(f"cpu:{devices}"), [device], dtype)
    upper = kind.upper()
    if platform != "gpu" or any(part in upper for part in OTHER_PARTS):
        return None
    if "H100" in upper:
        return chip_for(parse_target(f"gpu:h100-{devices}"), [], dtype)
    if "H200" in upper:
        return dataclasses.replace(CHIPS["h200"], peak_flops=datasheet_peak(CHIPS["h200"].kind, dtype))
    return None


def chip_of(devices: list, dtype: str) -> Chip | None:
    """chip_here for these devices (all of one kind)."""
    first = devices[0]
    return chip_here(first.platform, first.device_kind, len(devices), dtype,
                     first if first.platform == "cpu" else None)


def step_bound(hlo_text: str, chip: Chip, devices: int) -> dict:
    """The roofline of a compiled step (`compiled.as_text()`) in milliseconds: the bound, its part
    where FLOPs set an op's time, the communication left exposed, and the chip it assumes."""
    roof = roofline.estimate(hlo_text, chip, devices)
    return {"bound_chip": chip.kind, "bound_chip_source": chip.source, "bound_ms": 1e3 * roof["step_s"],
            "bound_compute_bound_ms": 1e3 * roof["compute_bound_s"],
            "bound_exposed_comm_ms": 1e3 * roof["exposed_comm_s"],
            "bound_hlo_flops": roof["hlo_flops_per_chip"], "bound_hbm_bytes": roof["hbm_bytes_per_chip"]}

