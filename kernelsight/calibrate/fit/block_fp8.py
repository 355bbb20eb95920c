"""How a block-scaled FP8 kernel's GPU time compares with the per-tensor FP8 kernel's, from measured GEMM rows.

The block-fp8 rows of the shared tables are timed through vLLM's eager per-call path: host dispatch puts a floor of
55–300 µs under every call (the kernel's smallest latency anywhere in the sweep), so a decode-sized GEMM's row says
nothing about its GPU time, which CUDA graphs would leave. Rows well above that floor are GPU-bound; on those the
ratio of the block kernel's latency to the per-tensor kernel's at the same shape is what the step model applies to
the per-tensor model (``simcore.gemm_dispatch.BLOCK_FP8_TIME_RATIO``), split by which fp8 roof binds.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kernelsight.simcore import kernels as K
from kernelsight.simcore.hardware import HardwareSpec
from kernelsight.simcore.roofline import wave_utilization

#: A block row counts as GPU-bound when its latency exceeds this multiple of the kernel's smallest latency.
GPU_BOUND_FACTOR = 3.0


def _median_by_shape(cols: Mapping[str, np.ndarray], dtype: str) -> dict[tuple[int, int, int], tuple[float, str]]:
    sel = np.asarray(cols["dtype"]).astype(str) == dtype
    m, n, k = (np.asarray(cols[c])[sel].astype(int) for c in ("m", "n", "k"))
    lat = np.asarray(cols["latency_us"], dtype=float)[sel]
    kern = np.asarray(cols["kernel"]).astype(str)[sel] if "kernel" in cols else np.full(len(lat), dtype)
    groups: dict[tuple[int, int, int], list[float]] = {}
    names: dict[tuple[int, int, int], str] = {}
    for key, t, name in zip(zip(m.tolist(), n.tolist(), k.tolist(), strict=True), lat.tolist(), kern.tolist(),
                            strict=True):
        groups.setdefault(key, []).append(t)
        names[key] = name
    return {key: (float(np.median(v)), names[key]) for key, v in groups.items()}


def compute_bound(m: int, n: int, k: int, hw: HardwareSpec) -> bool:
    """Whether the fp8 compute roof (wave-quantized) binds a W8A8 GEMM of this shape rather than DRAM."""
    kern = K.gemm_kernel("gemm", m, n, k, "fp8", 1.0, 2.0)
    compute_s = kern.flops * wave_utilization(kern.tiles, hw.num_sms) / hw.peak_flops_per_s("fp8")
    return compute_s >= kern.bytes_moved / hw.usable_mem_bytes_per_s


def block_fp8_time_ratios(cols: Mapping[str, np.ndarray], hw: HardwareSpec
                          ) -> dict[str, dict[str, tuple[float, int]]]:
    """Per block kernel and regime (``memory`` / ``compute``): (median block ÷ per-tensor latency, shapes used)."""
    block = _median_by_shape(cols, "fp8_block")
    per_tensor = _median_by_shape(cols, "fp8")
    floor: dict[str, float] = {}
    for t, name in block.values():
        floor[name] = min(floor.get(name, np.inf), t)
    ratios: dict[str, dict[str, list[float]]] = {}
    for shape, (t, name) in block.items():
        if shape not in per_tensor or t <= GPU_BOUND_FACTOR * floor[name]:
            continue
        regime = "compute" if compute_bound(*shape, hw) else "memory"
        ratios.setdefault(name, {}).setdefault(regime, []).append(t / per_tensor[shape][0])
    return {name: {regime: (float(np.median(v)), len(v)) for regime, v in by.items()} for name, by in ratios.items()}


__all__ = ["GPU_BOUND_FACTOR", "block_fp8_time_ratios", "compute_bound"]
