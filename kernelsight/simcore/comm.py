"""Collective communication time: α + bus bytes / achieved bandwidth.

A ring all-reduce moves 2(T−1)/T of the message through each GPU's link. vLLM uses its custom
all-reduce (one-shot/two-shot over NVLink P2P) for small messages and NCCL otherwise; on PCIe-only
machines the custom path is disabled.
"""

from __future__ import annotations

from kernelsight.simcore.calibration import Calibration
from kernelsight.simcore.hardware import HardwareSpec

#: vLLM's custom all-reduce handles messages up to this size (its default buffer is 8 MiB).
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 1024 * 1024


def has_fast_interconnect(hw: HardwareSpec) -> bool:
    """NVLink/xGMI-class links: well above the PCIe bandwidth."""
    return hw.intra_node_bytes_per_s > 1.5 * hw.pcie_bytes_per_s


def allreduce_backend(hw: HardwareSpec, message_bytes: float, num_gpus: int) -> str:
    if has_fast_interconnect(hw) and num_gpus in (2, 4, 6, 8) and message_bytes <= CUSTOM_ALLREDUCE_MAX_BYTES:
        return "custom"
    return "nccl"


def ring_bus_bytes(message_bytes: float, num_gpus: int) -> float:
    return 2.0 * (num_gpus - 1) / num_gpus * message_bytes


def allreduce_s(message_bytes: float, num_gpus: int, hw: HardwareSpec, calib: Calibration) -> float:
    """Time of one all-reduce of ``message_bytes`` across ``num_gpus`` GPUs of one node."""
    if num_gpus <= 1:
        return 0.0
    backend = allreduce_backend(hw, message_bytes, num_gpus)
    model = calib.comm.get(backend) or calib.comm["nccl"]
    link_bytes_per_s = hw.intra_node_bytes_per_s * model.bus_bytes_per_s_fraction
    return model.alpha_for(num_gpus) + ring_bus_bytes(message_bytes, num_gpus) / link_bytes_per_s
