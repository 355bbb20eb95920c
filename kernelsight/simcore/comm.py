"""Collective communication time at simulation time.

Each backend's :class:`~kernelsight.simcore.calibration.CommModel` holds measured (or transferred) piecewise
α–β curves per (op, dtype class, GPU count) and an α–β line for anything else; every time is at least the
bus bytes over the link bandwidth (a ring all-reduce moves 2(T−1)/T of the message through each GPU's link).
vLLM uses its custom all-reduce (one-shot/two-shot over NVLink P2P) for small messages and NCCL otherwise;
on PCIe-only machines the custom path is disabled. Fitting and transfer: :mod:`kernelsight.simcore.comm_fit`.
"""

from __future__ import annotations

from kernelsight.simcore.calibration import Calibration
from kernelsight.simcore.hardware import HardwareSpec

#: vLLM's custom all-reduce handles messages below this size (its default buffer is 8 MiB); the measured
#: custom-backend latency at exactly 8 MiB is already NCCL's.
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 1024 * 1024


def has_fast_interconnect(hw: HardwareSpec) -> bool:
    """NVLink/xGMI-class links: well above the PCIe bandwidth."""
    return hw.intra_node_bytes_per_s > 1.5 * hw.pcie_bytes_per_s


def allreduce_backend(hw: HardwareSpec, message_bytes: float, num_gpus: int) -> str:
    if has_fast_interconnect(hw) and num_gpus in (2, 4, 6, 8) and message_bytes < CUSTOM_ALLREDUCE_MAX_BYTES:
        return "custom"
    return "nccl"


def ring_bus_bytes(message_bytes: float, num_gpus: int) -> float:
    return 2.0 * (num_gpus - 1) / num_gpus * message_bytes


def collective_s(
    op: str,
    message_bytes: float,
    num_gpus: int,
    hw: HardwareSpec,
    calib: Calibration,
    backend: str = "nccl",
    dtype: str = "bf16",
) -> float:
    """Time of one collective (all_reduce / all_gather / reduce_scatter / all_to_all) of ``message_bytes``
    (the full buffer) across ``num_gpus`` GPUs of one node. Memoized per model: cheap per step."""
    if num_gpus <= 1:
        return 0.0
    model = calib.comm.get(backend) or calib.comm["nccl"]
    return model.time_s(op, message_bytes, num_gpus, hw.intra_node_bytes_per_s, dtype)


def allreduce_s(message_bytes: float, num_gpus: int, hw: HardwareSpec, calib: Calibration) -> float:
    """Time of one bf16 all-reduce of ``message_bytes`` across ``num_gpus`` GPUs of one node."""
    if num_gpus <= 1:
        return 0.0
    backend = allreduce_backend(hw, message_bytes, num_gpus)
    return collective_s("all_reduce", message_bytes, num_gpus, hw, calib, backend)
