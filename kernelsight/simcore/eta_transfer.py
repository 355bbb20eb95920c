"""Cross-generation tier: η for a GPU nobody measured, from other GPUs' fitted calibrations.

Transfer rule (documented contract):

1. **Device-independent axis.** Every fitted :class:`LogPolyEta` is a function of log-features of
   which the device-dependent ones are *normalized by the spec*: arithmetic intensity ÷ machine
   balance (peak FLOP/s of the kernel's dtype ÷ DRAM bandwidth), work units ÷ SM count, working set ÷
   L2 size. Moving a model to another GPU = keeping its coefficients and swapping in the target's spec
   constants. So a GEMM that sits at the ridge point of the target is predicted with the efficiency a
   source GPU had at *its* ridge point, not at the same m, n, k.
2. **Only the smooth part transfers.** The target-tier residual lattice encodes one GPU's library
   kernel choices (tile configs, split-K heuristics, which fp8 kernel vLLM dispatched) and is dropped.
3. **Ensemble by spec similarity.** With several sources, η and the fixed latency are the weighted
   geometric mean of the transferred models, weights ∝ exp(−d/τ) with d the distance between the
   two specs in log space (balance, bandwidth, SMs, L2, clock) — a GPU closer to the target (same
   generation, similar balance) counts more, but every source contributes.
4. Variants no source measured (e.g. fp8 GEMM when only bf16 was measured) fall back to the closest
   variant the sources have, run on the target's dtype peak.
5. Collectives: α and achieved-bandwidth fraction per backend are averaged (geometric) over the
   sources whose interconnect class (NVLink-class vs PCIe) matches the target's; otherwise over all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from kernelsight.simcore.calibration import (
    Calibration,
    CommModel,
    EnsembleEta,
    EtaModel,
    LogPolyEta,
    SwitchEta,
    default_calibration,
)
from kernelsight.simcore.hardware import HardwareSpec

#: Temperature of the similarity weights (units of the log-spec distance).
SIMILARITY_TAU = 1.0
TRANSFERRED_FAMILIES: tuple[str, ...] = ("gemm", "attn_prefill", "attn_decode", "lm_head", "moe_gemm")


def spec_vector(hw: HardwareSpec) -> tuple[float, ...]:
    """Log-spec coordinates used for similarity: balance, bandwidth, SMs, L2, clock."""
    return (
        math.log(hw.machine_balance_flops_per_byte),
        math.log(hw.mem_bytes_per_s),
        math.log(hw.num_sms),
        math.log(max(hw.l2_bytes, 1)),
        math.log(max(hw.boost_clock_hz, 1.0)),
    )


def similarity_weights(
    target: HardwareSpec, sources: Sequence[HardwareSpec], tau: float = SIMILARITY_TAU
) -> list[float]:
    t = spec_vector(target)
    dists = [math.sqrt(sum((a - b) ** 2 for a, b in zip(t, spec_vector(s), strict=True))) for s in sources]
    raw = [math.exp(-d / tau) for d in dists]
    total = sum(raw)
    return [r / total for r in raw]


def retarget(model: EtaModel, family: str, variant: str | None, target: HardwareSpec) -> EtaModel:
    """A source model re-expressed on the target's spec constants, residual lattice dropped."""
    from kernelsight.simcore.eta_fit import device_constants  # local: eta_fit imports this module's peers

    if isinstance(model, LogPolyEta):
        fam = "gemm" if model.basis == "gemm" else family
        dev = device_constants(fam, variant if fam == "gemm" else "2", target)
        return replace(model, device=dev, grid=None)
    if isinstance(model, SwitchEta):
        return SwitchEta(
            model.index, {k: retarget(m, family, k, target) for k, m in model.models.items()}, model.default
        )
    if isinstance(model, EnsembleEta):
        return EnsembleEta(tuple(retarget(m, family, variant, target) for m in model.members), model.weights)
    return model


def transfer_family(
    family: str,
    sources: Sequence[tuple[Calibration, HardwareSpec]],
    weights: Sequence[float],
    target: HardwareSpec,
) -> EtaModel | None:
    picked = [(c.eta[family], w) for (c, _), w in zip(sources, weights, strict=True) if family in c.eta]
    if not picked:
        return None
    total = sum(w for _, w in picked)
    if all(isinstance(m, SwitchEta) for m, _ in picked):
        switches: list[tuple[SwitchEta, float]] = [(m, w / total) for m, w in picked]  # type: ignore[misc]
        keys = sorted({k for m, _ in switches for k in m.models})
        out: dict[str, EtaModel] = {}
        for key in keys:
            members, ws = [], []
            for m, w in switches:
                sub_key = key if key in m.models else _closest_key(key, list(m.models))
                members.append(retarget(m.models[sub_key], family, key, target))
                ws.append(w)
            out[key] = EnsembleEta(tuple(members), tuple(w / sum(ws) for w in ws))
        default = max((m.default for m, _ in switches), key=[m.default for m, _ in switches].count)
        return SwitchEta(switches[0][0].index, out, default)
    variant = "0" if family in ("lm_head", "moe_gemm") else None
    members = tuple(retarget(m, family, variant, target) for m, _ in picked)
    return EnsembleEta(members, tuple(w / total for _, w in picked))


def _closest_key(key: str, keys: list[str]) -> str:
    """Nearest categorical value (fp8 block-scaled ↔ fp8 per-tensor ↔ bf16; KV 1 ↔ 2 bytes)."""
    return min(keys, key=lambda k: abs(float(k) - float(key)))


def _fast_link(hw: HardwareSpec) -> bool:
    return hw.intra_node_bytes_per_s > 1.5 * hw.pcie_bytes_per_s


def transfer_comm(
    sources: Sequence[tuple[Calibration, HardwareSpec]], target: HardwareSpec
) -> dict[str, CommModel]:
    same = [c for c, h in sources if _fast_link(h) == _fast_link(target)]
    pool = same or [c for c, _ in sources]
    out: dict[str, CommModel] = {}
    for backend in sorted({b for c in pool for b in c.comm}):
        ms = [c.comm[backend] for c in pool if backend in c.comm]
        alpha = math.exp(sum(math.log(m.alpha_s) for m in ms) / len(ms))
        frac = math.exp(sum(math.log(m.bus_bytes_per_s_fraction) for m in ms) / len(ms))
        out[backend] = CommModel(alpha, frac)
    return out


def cross_generation_calibration(
    target: HardwareSpec, sources: Sequence[tuple[Calibration, HardwareSpec]], tau: float = SIMILARITY_TAU
) -> Calibration:
    """Calibration for ``target`` from measured calibrations of other GPUs (see the module docstring)."""
    sources = [(c, h) for c, h in sources if h.name != target.name]
    if not sources:
        raise ValueError("cross-generation transfer needs at least one calibration of another GPU")
    weights = similarity_weights(target, [h for _, h in sources], tau)
    calib = default_calibration(target.name)
    calib.tier = "cross-generation"
    for fam in TRANSFERRED_FAMILIES:
        model = transfer_family(fam, sources, weights, target)
        if model is not None:
            calib.eta[fam] = model
    for fam in TRANSFERRED_FAMILIES:
        vals = [
            (c.overhead_s[fam], w) for (c, _), w in zip(sources, weights, strict=True) if fam in c.overhead_s
        ]
        if vals:
            calib.overhead_s[fam] = math.exp(sum(w * math.log(v) for v, w in vals) / sum(w for _, w in vals))
    calib.eta_max = max(c.eta_max for c, _ in sources)
    comm = transfer_comm(sources, target)
    if comm:
        calib.comm.update(comm)
    names = ", ".join(f"{h.name} ({w:.2f})" for (_, h), w in zip(sources, weights, strict=True))
    calib.source = f"transferred from target-measured calibrations of {names} (weights in parentheses)"
    calib.licence = "; ".join(sorted({c.licence for c, _ in sources if c.licence}))
    calib.notes = (
        "cross-generation tier: source η models re-expressed on this GPU's spec (machine balance, "
        "SM count, L2), residual lattices dropped, geometric mean weighted by spec similarity"
    )
    return calib
