"""Collective communication time: the latency model of a collective backend, and what a step asks of it.

Each backend's :class:`CommModel` (a :class:`~kernelsight.simcore.calibration.Calibration` carries one per
backend) holds measured (or transferred) piecewise α–β curves per (op, dtype class, GPU count) and an α–β line
for anything else; every time is at least the bus bytes over the link bandwidth (a ring all-reduce moves
2(T−1)/T of the message through each GPU's link). Which implementation vLLM runs an all-reduce on (custom all-reduce,
symmetric memory, NCCL) is :mod:`kernelsight.simcore.allreduce_dispatch`; :func:`allreduce_s` prices each from its
own curve. Fitting and transfer: :mod:`kernelsight.calibrate.fit.comm`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernelsight.simcore.allreduce_dispatch import (
    NCCL,
    allreduce_implementation,
    allreduce_pricing_backend,
    has_fast_interconnect,
)
from kernelsight.simcore.hardware import HardwareSpec

#: Collective ops with a bus-bytes rule; message_bytes is the full (reduced / gathered / exchanged) buffer.
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

_DTYPE_CLASS = {
    "half": "16", "fp16": "16", "float16": "16", "bf16": "16", "bfloat16": "16",
    "int8": "8", "uint8": "8", "fp8": "8", "float8": "8",
    "float": "32", "fp32": "32", "float32": "32",
}


def comm_dtype_class(dtype: str) -> str:
    """Element width class of a collective's dtype: NCCL costs depend on it (reduction kernels, NVLS support)."""
    return _DTYPE_CLASS.get(str(dtype).lower(), str(dtype).lower())


def comm_bus_factor(op: str, num_gpus: int) -> float:
    """Bytes each GPU moves over its link per message byte (NCCL's "bus bandwidth" convention):
    ring all-reduce 2(T−1)/T, all-gather / reduce-scatter / all-to-all (T−1)/T."""
    t = max(int(num_gpus), 1)
    return (2.0 if op == "all_reduce" else 1.0) * (t - 1) / t


def nearest_gpu_count(counts: Iterable[int], num_gpus: int) -> int:
    """The measured GPU count closest to ``num_gpus`` in ratio (ties: the larger), for what a count borrows from
    another (a collective's curve, shape or α)."""
    t = max(int(num_gpus), 1)
    return min(counts, key=lambda c: (abs(math.log(c / t)), -c))


def comm_curve_key(op: str, dtype_class: str, num_gpus: int) -> str:
    return f"{op}/{dtype_class}/{int(num_gpus)}"


@dataclass(frozen=True, slots=True)
class CommCurve:
    """Measured latency of one collective (op, dtype class, GPU count) of one backend, as a piecewise α–β line.

    Between knots the time is linear in the message size (each segment is an α–β line, exact for a single
    protocol regime; protocol switches show as kinks); below the first knot it stays at the first knot's
    latency (the α floor); beyond the last knot it grows at ``tail_s_per_byte`` (the asymptotic bandwidth).
    Knot latencies are non-decreasing, so the curve is monotone.
    """

    message_bytes: tuple[float, ...]
    latency_s: tuple[float, ...]
    tail_s_per_byte: float  # per message byte beyond the last knot

    def time_s(self, message_bytes: float) -> float:
        b, t = self.message_bytes, self.latency_s
        if message_bytes >= b[-1]:
            return t[-1] + (message_bytes - b[-1]) * self.tail_s_per_byte
        if message_bytes <= b[0]:
            return t[0]
        j = bisect.bisect_right(b, message_bytes)
        w = (message_bytes - b[j - 1]) / (b[j] - b[j - 1])
        return t[j - 1] + w * (t[j] - t[j - 1])

    def to_dict(self) -> dict[str, Any]:
        return {"message_bytes": list(self.message_bytes), "latency_s": list(self.latency_s),
                "tail_s_per_byte": self.tail_s_per_byte}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CommCurve:
        return cls(tuple(float(x) for x in d["message_bytes"]), tuple(float(x) for x in d["latency_s"]),
                   float(d["tail_s_per_byte"]))


@dataclass(frozen=True, slots=True)
class CommModel:
    """Latency model of one collective backend (``nccl``; the all-reduce implementations ``custom``, ``symm_mem``
    and their ``_eager`` variants, fitted from the rows vLLM dispatched to them).

    ``curves`` (by :func:`comm_curve_key`) hold measured or transferred piecewise α–β curves; anything they do
    not cover falls back to the single α–β line ``t = alpha_s + bus_bytes / (fraction · link bandwidth)``
    (``alpha_s_by_gpus`` refines α per GPU count: NCCL's latency grows with the ring size). Every time is at
    least the physical bound bus bytes / link bandwidth. Calibration files without ``curves`` still load.
    """

    alpha_s: float
    bus_bytes_per_s_fraction: float  # of the spec interconnect bandwidth actually reached
    alpha_s_by_gpus: dict[str, float] = field(default_factory=dict)
    curves: dict[str, CommCurve] = field(default_factory=dict)
    # init=False: dataclasses.replace() (e.g. other curves) starts an empty memo instead of sharing the original's
    _memo: dict[tuple[str, float, int, str, float], float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def alpha_for(self, num_gpus: int) -> float:
        return self.alpha_s_by_gpus.get(str(int(num_gpus)), self.alpha_s)

    def curve_for(self, op: str, num_gpus: int, dtype: str = "bf16") -> tuple[CommCurve, int] | None:
        """The curve of (op, dtype class, GPU count), else of the same dtype class at the nearest measured GPU
        count, else of another dtype class; with the GPU count it was measured at (None: no curve for op)."""
        cls = comm_dtype_class(dtype)
        found = [(k.split("/"), c) for k, c in self.curves.items() if k.startswith(op + "/")]
        if not found:
            return None
        same = [(int(p[2]), c) for p, c in found if p[1] == cls] or [
            (int(p[2]), c) for p, c in found if p[1] == "16"] or [(int(p[2]), c) for p, c in found]
        g = nearest_gpu_count([gc[0] for gc in same], num_gpus)
        return next(c for gc, c in same if gc == g), g

    def time_s(self, op: str, message_bytes: float, num_gpus: int, link_bytes_per_s: float,
               dtype: str = "bf16") -> float:
        """Seconds of one collective of ``message_bytes`` over ``num_gpus`` GPUs whose links carry
        ``link_bytes_per_s`` each (one direction). Memoized: the step model asks for few distinct sizes."""
        if num_gpus <= 1:
            return 0.0
        key = (op, float(message_bytes), int(num_gpus), comm_dtype_class(dtype), float(link_bytes_per_s))
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        bus = comm_bus_factor(op, num_gpus) * message_bytes
        found = self.curve_for(op, num_gpus, dtype)
        if found is None:
            t = self.alpha_for(num_gpus) + bus / (link_bytes_per_s * self.bus_bytes_per_s_fraction)
        else:
            curve, g = found
            # another GPU count: the same bus bytes per GPU cost about the same (the message is rescaled)
            t = curve.time_s(bus / comm_bus_factor(op, g)) if g != int(num_gpus) else curve.time_s(message_bytes)
        t = max(t, bus / link_bytes_per_s)
        if len(self._memo) > 50_000:
            self._memo.clear()
        self._memo[key] = t
        return t

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "alpha_s": self.alpha_s,
            "bus_bytes_per_s_fraction": self.bus_bytes_per_s_fraction,
        }
        if self.alpha_s_by_gpus:
            d["alpha_s_by_gpus"] = dict(self.alpha_s_by_gpus)
        if self.curves:
            d["curves"] = {k: c.to_dict() for k, c in sorted(self.curves.items())}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CommModel:
        """Reads both the α–β-only files (alpha_s / bus_bytes_per_s_fraction) and files with curves."""
        return cls(
            float(d["alpha_s"]),
            float(d["bus_bytes_per_s_fraction"]),
            {str(g): float(a) for g, a in d.get("alpha_s_by_gpus", {}).items()},
            {str(k): CommCurve.from_dict(v) for k, v in d.get("curves", {}).items()},
        )


def ring_bus_bytes(message_bytes: float, num_gpus: int) -> float:
    return 2.0 * (num_gpus - 1) / num_gpus * message_bytes


def collective_s(
    op: str,
    message_bytes: float,
    num_gpus: int,
    hw: HardwareSpec,
    comm: Mapping[str, CommModel],
    backend: str = "nccl",
    dtype: str = "bf16",
) -> float:
    """Time of one collective (all_reduce / all_gather / reduce_scatter / all_to_all) of ``message_bytes``
    (the full buffer) across ``num_gpus`` GPUs of one node, priced by ``comm`` (the calibration's models by
    backend name: ``Calibration.comm``). Memoized per model: cheap per step."""
    if num_gpus <= 1:
        return 0.0
    model = comm.get(backend) or comm["nccl"]
    return model.time_s(op, message_bytes, num_gpus, hw.intra_node_bytes_per_s, dtype)


def pricing_model(comm: Mapping[str, CommModel], implementation: str, cuda_graph: bool = True
                  ) -> tuple[CommModel, bool]:
    """(the model that prices ``implementation`` in that mode, whether it is a graph-mode model standing in for an
    eager one). Its own curves (``custom``, ``symm_mem``, ``nccl``, or their ``_eager`` variants where measured),
    else the graph-mode curves of the implementation, else NCCL's model — what a calibration without rows of that
    implementation can offer (a bundled calibration transfers the missing ones from GPUs that have them:
    :mod:`kernelsight.calibrate.fit.comm`)."""
    def own(name: str) -> CommModel | None:
        # a backend without curves is the default α–β line of one nobody measured or transferred (L40S's custom
        # all-reduce): NCCL's measured curve prices it better
        model = comm.get(name)
        return model if model is not None and model.curves else None

    if not cuda_graph:
        model = own(allreduce_pricing_backend(implementation, cuda_graph))
        if model is not None:
            return model, False
    return (own(implementation) or comm[NCCL]), not cuda_graph


def allreduce_implementation_s(implementation: str, message_bytes: float, num_gpus: int, hw: HardwareSpec,
                               comm: Mapping[str, CommModel], cuda_graph: bool = True, dtype: str = "bf16") -> float:
    """Time of one all-reduce on a given implementation (:mod:`~kernelsight.simcore.allreduce_dispatch` names).

    Outside a CUDA graph without an eager curve of its own (NCCL: the rows measured eager all ran NCCL's graph
    time plus one device copy of the message — +0.7 ms per GiB on H100, +1.2 on A100 and the RTX PRO 6000, i.e.
    2 × bytes at their DRAM bandwidth), the graph curve plus that copy."""
    if num_gpus <= 1:
        return 0.0
    model, stand_in = pricing_model(comm, implementation, cuda_graph)
    t = model.time_s("all_reduce", message_bytes, num_gpus, hw.intra_node_bytes_per_s, dtype)
    return t + (2.0 * message_bytes / hw.usable_mem_bytes_per_s if stand_in else 0.0)


def allreduce_s(message_bytes: float, num_gpus: int, hw: HardwareSpec, comm: Mapping[str, CommModel],
                cuda_graph: bool = True, dtype: str = "bf16", custom_all_reduce: bool = True) -> float:
    """Time of one TP all-reduce of ``message_bytes`` across ``num_gpus`` GPUs of one node, on the implementation
    vLLM dispatches it to (:func:`~kernelsight.simcore.allreduce_dispatch.allreduce_implementation`: custom
    all-reduce, symmetric memory or NCCL), priced by that implementation's curve (``comm``: the calibration's
    collective models by backend name)."""
    if num_gpus <= 1:
        return 0.0
    impl = allreduce_implementation(hw, num_gpus, message_bytes, dtype, cuda_graph, custom_all_reduce)
    return allreduce_implementation_s(impl, message_bytes, num_gpus, hw, comm, cuda_graph, dtype)


__all__ = [
    "COMM_OPS",
    "CommCurve",
    "CommModel",
    "allreduce_implementation_s",
    "allreduce_s",
    "collective_s",
    "comm_bus_factor",
    "comm_curve_key",
    "comm_dtype_class",
    "has_fast_interconnect",
    "nearest_gpu_count",
    "pricing_model",
    "ring_bus_bytes",
]
