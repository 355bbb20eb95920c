"""Calibration: everything fitted (or defaulted) for one GPU, as the step model reads it.

Per kernel family an η model (:mod:`kernelsight.simcore.eta`: ``kernel_s = roof_s / η + overhead_s``) and a fixed
per-kernel latency; the collective backends' latency models (:mod:`kernelsight.simcore.comm`); the host and launch
costs around the kernels (:mod:`kernelsight.simcore.overheads`); the decode kernel's unsplit-path bandwidth. Until a
GPU has fitted tables (``kernelsight calibrate``), :func:`default_calibration` gives documented, physically
plausible defaults. Fitting and transfer are :mod:`kernelsight.calibrate.fit`.

Invariant kept here, not by callers: η is clipped to ``[eta_floor, eta_max]`` so that no prediction is
faster than the roofline divided by the largest η seen in calibration.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kernelsight.simcore.comm import CommModel
from kernelsight.simcore.eta import (
    ConstantEta,
    EtaModel,
    LogisticEta,
    decode_serial_floor_s,
    eta_model_from_dict,
    eta_overhead_of,
    switch_key,
)
from kernelsight.simcore.eta_basis import BASES
from kernelsight.simcore.overheads import HostModel, LaunchModel


@dataclass(slots=True)
class Calibration:
    """Everything fitted (or defaulted) for one GPU."""

    hardware: str
    tier: str  # "default" | "target-measured" | "cross-generation"
    eta: dict[str, EtaModel]
    overhead_s: dict[str, float]  # fixed per-kernel GPU latency by family
    eta_max: float = 1.0  # largest η seen in calibration (physics floor)
    eta_floor: float = 0.02
    comm: dict[str, CommModel] = field(default_factory=dict)  # by backend name
    host: HostModel = field(default_factory=HostModel)
    launch: LaunchModel = field(default_factory=LaunchModel)
    source: str = ""
    licence: str = ""
    notes: str = ""
    #: Per decode variant (KV bytes key, as in ``SwitchEta``): the streaming bandwidth of one CTA on the decode
    #: kernel's unsplit path (:func:`decode_serial_floor_s`); absent: the kernel splits the KV cache.
    decode_cta_bytes_per_s: dict[str, float] = field(default_factory=dict)
    #: The software the kernels were timed under ("vllm", "torch", "cuda", "nccl", ... → version; several
    #: sources' distinct versions joined by " / "): a kernel library picks its kernels per release, so a run served
    #: under another stack may not run the kernels this calibration prices. Empty: not recorded.
    software: dict[str, str] = field(default_factory=dict)
    # init=False: dataclasses.replace() then starts an empty memo instead of sharing the original's (a copy with
    # another eta_max or η model would answer from the old one's cache)
    _memo: dict[tuple[str, tuple[float, ...]], tuple[float, float | None]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # The step model's memo tables (token-parallel parts, attention times) per (model, GPU, precision, step config):
    # they are pure functions of those and of this calibration, so every engine built on it shares them (a search's
    # points, a benchmark's repeated runs) instead of re-pricing the same shapes (see StepModel.__init__).
    step_memos: dict[tuple, tuple[dict, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def kernel_eta(self, family: str, features: tuple[float, ...]) -> float:
        """η of one kernel, clipped to [eta_floor, eta_max] (memoized: the step model asks repeatedly)."""
        return self._eta_overhead(family, features)[0]

    def kernel_overhead_s(self, family: str, features: tuple[float, ...] | None = None) -> float:
        """Fixed per-launch latency; a fitted η model may carry its own (per GEMM format, per shape)."""
        if features is not None:
            own = self._eta_overhead(family, features)[1]
            if own is not None:
                return own
        return self.overhead_s.get(family, self.overhead_s.get("default", 0.0))

    def kernel_eta_overhead_s(self, family: str, features: tuple[float, ...]) -> tuple[float, float]:
        """(``kernel_eta``, ``kernel_overhead_s``) of one kernel with one memo lookup (the step model's hot path)."""
        eta, own = self._eta_overhead(family, features)
        if own is None:
            own = self.overhead_s.get(family, self.overhead_s.get("default", 0.0))
        return eta, own

    def decode_floor_s(self, features: Sequence[float], num_sms: int) -> float:
        """Least time of one decode attention kernel (features of ``attention_decode_kernel``); 0 if none."""
        if not self.decode_cta_bytes_per_s or features[2] != features[3]:   # GQA: the split path
            return 0.0
        bw = self.decode_cta_bytes_per_s.get(switch_key(features[5]))
        return decode_serial_floor_s(features, num_sms, bw) if bw else 0.0

    def _eta_overhead(self, family: str, features: tuple[float, ...]) -> tuple[float, float | None]:
        key = (family, features)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        model = self.eta.get(family) or self.eta["default"]
        eta, own = eta_overhead_of(model, features)
        if len(self._memo) > 200_000:   # bounded: decode contexts make many distinct keys
            self._memo.clear()
        out = (min(max(eta, self.eta_floor), self.eta_max), own)
        self._memo[key] = out
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "hardware": self.hardware,
            "tier": self.tier,
            "source": self.source,
            "licence": self.licence,
            "notes": self.notes,
            "eta_max": self.eta_max,
            "eta_floor": self.eta_floor,
            "eta": {k: v.to_dict() for k, v in self.eta.items()},
            "overhead_s": dict(self.overhead_s),
            "comm": {k: v.to_dict() for k, v in self.comm.items()},
            "host": self.host.to_dict(),
            "launch": self.launch.to_dict(),
            **({"decode_cta_bytes_per_s": dict(self.decode_cta_bytes_per_s)} if self.decode_cta_bytes_per_s else {}),
            **({"software": dict(self.software)} if self.software else {}),
        }


def _bases(d: Any) -> set[str]:
    """Every smooth-model basis named anywhere inside a serialized η model."""
    out: set[str] = set()
    stack = [d]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if x.get("form") == "logpoly":
                basis = str(x.get("basis"))
                # a basis of another width is an older layout of it (the MoE basis gained the block padding)
                width = len(BASES[basis][1]) if basis in BASES else None
                out.add(basis if width is None or len(x.get("center", ())) == width else f"{basis} (older layout)")
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return out


#: η of the FusedMoE layer in files written before it had its own model (they priced the expert GEMMs with the bf16
#: GEMM model on other features) or before its basis counted the block padding: the built-in default until the file
#: is rebuilt.
LEGACY_MOE_ETA = ConstantEta(0.6)


def calibration_from_dict(d: dict[str, Any]) -> Calibration:
    hardware, tier = d["hardware"], d["tier"]
    eta = {k: eta_model_from_dict(v) for k, v in d["eta"].items()}
    if "moe_gemm" in d["eta"] and _bases(d["eta"]["moe_gemm"]) - {"moe"}:
        eta["moe_gemm"] = LEGACY_MOE_ETA
    return Calibration(
        hardware=hardware,
        tier=tier,
        eta=eta,
        overhead_s={k: float(v) for k, v in d["overhead_s"].items()},
        eta_max=float(d.get("eta_max", 1.0)),
        eta_floor=float(d.get("eta_floor", 0.02)),
        comm={k: CommModel.from_dict(v) for k, v in d.get("comm", {}).items()},
        host=HostModel(**d.get("host", {})),
        launch=LaunchModel(**d.get("launch", {})),
        source=d.get("source", ""),
        licence=d.get("licence", ""),
        notes=d.get("notes", ""),
        decode_cta_bytes_per_s={k: float(v) for k, v in d.get("decode_cta_bytes_per_s", {}).items()},
        software={str(k): str(v) for k, v in d.get("software", {}).items()},
    )


def default_calibration(hardware: str) -> Calibration:
    """Defaults for a GPU with no fitted table.

    Numbers are round values typical of current NVIDIA datacenter GPUs running vLLM's kernels:
    GEMMs reach ~85% of the DRAM roof when memory-bound and ~80% of peak when large; attention
    kernels are less efficient at small shapes; elementwise kernels stream at ~70% of bandwidth;
    every kernel costs a few µs of fixed latency. They are placeholders for fitted tables, not fits.
    """
    eta: dict[str, EtaModel] = {
        "gemm": ConstantEta(0.85),
        "moe_gemm": LEGACY_MOE_ETA,
        "attn_prefill": LogisticEta(lo=0.2, hi=0.7, x0=512.0, slope=1.0, index=1),
        "attn_decode": LogisticEta(lo=0.3, hi=0.8, x0=256.0, slope=1.0, index=1),
        "default": ConstantEta(0.7),
    }
    return Calibration(
        hardware=hardware,
        tier="default",
        eta=eta,
        overhead_s={"default": 2.0e-6, "gemm": 3.0e-6, "attn_prefill": 5.0e-6, "attn_decode": 5.0e-6},
        eta_max=1.0,
        comm={
            "nccl": CommModel(alpha_s=1.5e-5, bus_bytes_per_s_fraction=0.7),
            "custom": CommModel(alpha_s=6.0e-6, bus_bytes_per_s_fraction=0.6),
        },
        source="kernelsight built-in defaults (no measurements)",
        licence="Apache-2.0",
    )


def vllm_release(version: str | None) -> tuple[int, ...] | None:
    """``"0.19.0"`` → (0, 19, 0), for comparing releases; None for text that names no single release (a
    cross-generation calibration's merged ``"0.14.0 / 0.24.0"``, an empty record)."""
    m = re.fullmatch(r"v?(\d+(?:\.\d+)*)(?:[.+\-]?[A-Za-z]\w*)?", (version or "").strip())
    if not m:
        return None
    parts = [int(x) for x in m.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:   # 0.19 and 0.19.0 are one release
        parts.pop()
    return tuple(parts)


def stack_note(calib: Calibration, vllm_version: str | None) -> str | None:
    """One report line when ``calib``'s kernels were not timed under the vLLM release a run is priced for (a kernel
    library picks its kernels per release: the run may run others); None when they were, or none was asked for."""
    if not vllm_version:
        return None
    timed = calib.software.get("vllm", "")
    wanted = vllm_release(vllm_version)
    if timed == vllm_version or (wanted is not None and vllm_release(timed) == wanted):
        return None
    where = (f"other GPUs' kernels timed under vLLM {timed}" if calib.tier == "cross-generation" and timed
             else f"kernels timed under vLLM {timed}" if timed else "kernels timed under unrecorded software")
    return (f"no calibration of {calib.hardware} was timed under vLLM {vllm_version}: priced with its "
            f"{calib.tier} calibration ({where})")


__all__ = [
    "Calibration",
    "calibration_from_dict",
    "default_calibration",
    "stack_note",
    "vllm_release",
]
