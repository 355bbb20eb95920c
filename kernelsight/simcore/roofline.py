"""The roofline bound of one kernel, with wave quantization over the SMs.

    wave_u = ceil(tiles / num_sms) * num_sms / tiles      (>= 1: a partial last wave idles SMs)
    roof_s = max(flops * wave_u / peak_flops_per_s, bytes / mem_bytes_per_s)

Everything here is a pure function that also accepts numpy arrays, so the calibration fit and
the step model's fast path share one definition.
"""

from __future__ import annotations

import math

import numpy as np

from kernelsight.simcore.hardware import HardwareSpec


def wave_utilization(tiles: float | np.ndarray, num_sms: int) -> float | np.ndarray:
    """Factor ≥ 1 by which a partial last wave stretches a compute-bound kernel."""
    tiles = np.maximum(np.asarray(tiles, dtype=float), 1.0)
    waves = np.ceil(tiles / num_sms)
    out = waves * num_sms / tiles
    return float(out) if out.ndim == 0 else out


def roofline_s(
    flops: float | np.ndarray,
    bytes_moved: float | np.ndarray,
    tiles: float | np.ndarray,
    peak_flops_per_s: float,
    mem_bytes_per_s: float,
    num_sms: int,
) -> float | np.ndarray:
    """Lower bound on a kernel's time: the slower of its compute (wave-quantized) and memory roofs."""
    compute_s = np.asarray(flops, dtype=float) * wave_utilization(tiles, num_sms) / peak_flops_per_s
    memory_s = np.asarray(bytes_moved, dtype=float) / mem_bytes_per_s
    out = np.maximum(compute_s, memory_s)
    return float(out) if out.ndim == 0 else out


def kernel_roofline_s(flops: float, bytes_moved: float, tiles: float, dtype: str, hw: HardwareSpec) -> float:
    """Roofline of one kernel on a given GPU, using the tensor-core peak of its compute dtype.

    Scalar twin of :func:`roofline_s` (same formula) without numpy's per-call overhead: the step model
    calls it on the simulator's hot path.
    """
    tiles = max(float(tiles), 1.0)
    n = hw.num_sms
    wave_u = math.ceil(tiles / n) * n / tiles
    return max(flops * wave_u / hw.peak_flops_per_s(dtype), bytes_moved / hw.usable_mem_bytes_per_s)
