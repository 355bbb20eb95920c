"""Cross-generation tier: η for a GPU nobody measured, from other GPUs' fitted calibrations.

Transfer rule (documented contract):

1. **Device-independent axis.** Every fitted :class:`LogPolyEta` is a function of log-features of
   which the device-dependent ones are *normalized by the spec*: arithmetic intensity ÷ machine
   balance (peak FLOP/s of the kernel's dtype ÷ DRAM bandwidth), work units ÷ SM count, working set ÷
   L2 size. Moving a model to another GPU = keeping its coefficients and swapping in the target's spec
   constants. So a GEMM that sits at the ridge point of the target is predicted with the efficiency a
   source GPU had at *its* ridge point, not at the same m, n, k.
2. **Only the smooth part transfers.** The target-tier residual lattice and trees encode one GPU's library
   kernel choices (tile configs, split-K heuristics, which fp8 kernel vLLM dispatched) and are dropped; so
   are per-kernel models and the learned dispatch rule: a variant with several kernels transfers its
   pooled smooth model (fitted on all its kernels' rows, as before kernels were told apart).
3. **The L2 benefit is re-expressed, not copied.** Where a working set fits in L2, a source's η already
   holds *its* L2 speed-up over the DRAM roof (η > 1 on the L40S, whose 96 MB L2 sits in front of 864 GB/s
   GDDR6). That speed-up scales with ρ = L2 bandwidth ÷ DRAM bandwidth, which the datasheet does not give
   but its parts do: L2 bandwidth ≈ SMs × clock × a per-SM width (:data:`L2_BYTES_PER_CLOCK_PER_SM`, one
   constant for every GPU). The memory part of the roof is scaled by ``s + (1 − s)/ρ`` (s: share of the
   working set streaming from DRAM, logistic in log bytes/L2), the compute roof is not; the source's factor
   is divided out and the target's put in (:func:`~kernelsight.simcore.eta_basis.cache_gain_ratio`).
   Without it, A100/H100 (ρ ≈ 1.2) predict the L40S (ρ ≈ 6.6) 2–3× too slow on L2-resident attention.
   GEMMs reuse a smaller share of L2 than attention (weight-streaming shapes of ~⅓ L2 show no benefit even
   on the L40S), so their step sits at ~0.2× L2. The decode L2 step's fitted position (in units of the
   source's L2) carries over as well.
4. **Fixed latency transfers as time**, scaled by (source clock ÷ target clock)^0.5
   (:data:`OVERHEAD_CLOCK_EXPONENT`): partly GPU cycles, partly clock-independent.
5. **Ensemble by spec similarity.** With several sources, η and the fixed latency are the weighted
   geometric mean of the transferred models, weights ∝ exp(−d/τ) with d the distance between the
   two specs in log space (balance, bandwidth, SMs, L2, clock) — a GPU closer to the target (same
   generation, similar balance) counts more, but every source contributes.
6. Variants a source did not measure (e.g. fp8 GEMM on the A100) take that source's closest variant (its
   bf16 η) with the compute roof at that variant's peak: no speed-up is credited for a format the source
   never ran (both measured GPUs reach a lower share of peak in fp8 than in bf16); the memory roof, with the
   target format's bytes, stays. Tried: only sources that measured the variant — much worse (fp8 from the
   L40S alone predicts the H100 at 103% MAPE): the other format's η is the better regularizer.
7. Collectives: measured latency curves per (backend, op, dtype class, GPU count) are split into a
   bandwidth part (rescaled to the target's link) and a latency part (scaled by the clock ratio), averaged
   (geometric) over the sources whose interconnect class (NVLink-class vs PCIe) matches the target's;
   otherwise over all, with a PCIe topology prior (:mod:`kernelsight.calibrate.fit.comm` states the rule).
   The fallback α–β line (α, achieved-bandwidth fraction) is averaged the same way.
8. The unsplit decode path of FlashAttention-2 (one query head per KV head: one CTA streams each context alone;
   :func:`~kernelsight.simcore.eta.decode_serial_floor_s`) is a property of the kernel vLLM runs, so a
   target gets it only if vLLM runs FA2 there (NVIDIA compute capability 8.x): the per-CTA bandwidth measured on
   the sources, × (clock ratio)^0.5 (:data:`DECODE_FLOOR_CLOCK_EXPONENT`).

9. **NVFP4 GEMMs from the GPUs measured in FP4.** A GPU with FP4 tensor cores never measured in FP4 (B200, B300,
   GB200, GB300) takes its ``nvfp4`` GEMM variant (W4A4, vLLM's FlashInfer kernels) from the calibrations whose own
   tables hold NVFP4 rows (:data:`FP4_TRANSFER_SOURCES`: the RTX PRO 6000 alone), retargeted as rules 1–4 do for
   every variant: the smooth η kept, its balance axis re-expressed at the target's FP4 peak ÷ DRAM bandwidth with
   NVFP4's bytes (4-bit values + an FP8 scale per 16), SMs and L2 (ρ) swapped, the fixed latency moved by the clock
   ratio, residual lattice and trees dropped; several such sources would be weighted by spec similarity (rule 5).
   The other variants keep the pinned sources (A100 / H100 / L40S), so adding the rule moves no bf16/fp8 η, and
   the calibration's ``eta_max`` is not raised by it (the other kernels' clipping stays as it was). GPUs without FP4
   tensor cores get no ``nvfp4`` variant: vLLM runs NVFP4 there as Marlin W4A16, a bf16 GEMM over 4-bit weights,
   priced by their bf16 η. With one FP4-measured GPU no leave-one-out is possible; ``benchmarks/fp4_accuracy.py``
   measures the rule's self-consistency instead (the PRO 6000's bf16 / fp8 η moved the same way, single-source, to
   the A100 / H100 / L40S against their tables).

10. **Power-limited clocks are the board's.** A GPU whose power limit is below what its SMs draw at the boost
   clock under a dense tensor load (:func:`~kernelsight.simcore.hardware.sustained_clock_share`: the L40S, 350 W for
   142 SMs at 2.52 GHz, holds ~0.82 of it; the L4 ~0.51) reaches a lower share of its datasheet compute peak, and
   its fitted η carries that. A source's compute-bound η is divided by its share and multiplied by the target's
   (``clock_sustain_source`` / ``_target`` in the device constants; memory-bound work keeps its η:
   η × max(u/c_src, 1) / max(u/c_tgt, 1)). GEMMs only: the shared tables show it there (the L40S's large bf16
   GEMMs, left out and transferred from A100/H100, were priced 0.85× their time at the median, 0.93× with the
   rule) and not in attention (its large prefill attention was already priced 1.22× its time; 1.36× with the rule):
   attention's softmax and memory traffic draw less than a dense GEMM's tensor cores. Without it the L40S's
   throttled 79% of peak went to the RTX 4090 (450 W for 128 SMs: unthrottled), whose replay prefilled ~20% slower
   than the GPU did.

11. **MLA by kernel.** The MLA op's families (``mla_decode``, ``mla_prefill``; ``calibrate.mla_tables``) time one
   vLLM kernel each. A target takes ``mla_decode`` only from the sources whose default MLA backend is its own and
   ``mla_prefill`` from every source but on SM 10.x (:func:`mla_sources`); with none, the family is not transferred
   and the composed dense-family pricing stays. Retargeted as rules 1–4 (the decode and prefill bases).

12. **MoE by kernel.** vLLM's FusedMoE layer runs one kernel per expert format, GPU and release
   (:func:`~kernelsight.simcore.moe_dispatch.moe_kernel`: Triton ``fused_moe``, FlashInfer CUTLASS, Marlin, OpenAI's
   Triton MXFP4 kernels, FlashInfer TRT-LLM). A target's format takes the smooth models of the kernel it runs there:
   from each source the same format's if that source ran it by that kernel, else another format's run by it (its
   balance and bytes re-expressed at the target format's); of those, the target architecture's where one ran it;
   weighted by spec similarity (:func:`transfer_moe_by_kernel`). Only where no source ran the kernel does the
   format's pooled model of the target's architecture (else every source's) stand in. Leave-one-GPU-out on the shared
   MoE tables (``benchmarks/moe_accuracy.py``): the L40S's fp8 (Triton there) from the H100's block-fp8 Triton model
   rather than the FlashInfer CUTLASS fp8 models of the H100 and the PRO 6000.

Hyperparameters (τ, the L2 width per SM, the clock exponent, the L2 step's center/width in eta_basis.py)
are global: chosen by leave-one-GPU-out over the three measured GPUs (A100 / H100 / L40S) *jointly*, on the
mean and the worst per-family MAPE of all folds, never per fold or per target. Tried and not kept: one model
fitted jointly on all sources' rows in the spec-normalized features (worse than averaging per-GPU models in
every fold: the shape terms it shares carry each library's kernel choices, not physics).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from kernelsight.calibrate.fit.comm import comm_source_pool, transfer_comm_curves
from kernelsight.calibrate.fit.logpoly import device_constants
from kernelsight.calibrate.rows import MLA_FAMILIES
from kernelsight.simcore import kernels as K
from kernelsight.simcore.attention_dispatch import FLASH_ATTN_2, attention_kernel, kernel_lineage
from kernelsight.simcore.calibration import Calibration, default_calibration, vllm_release
from kernelsight.simcore.comm import CommModel
from kernelsight.simcore.eta import DispatchEta, EnsembleEta, EtaModel, LogPolyEta, SwitchEta, switch_key
from kernelsight.simcore.hardware import HardwareSpec, sustained_clock_share
from kernelsight.simcore.mla import mla_decode_backend
from kernelsight.simcore.moe_dispatch import MARLIN, TRITON, moe_kernel, moe_kernel_class

#: Temperature of the similarity weights (units of the log-spec distance).
SIMILARITY_TAU = 1.0
#: Effective L2 bytes per SM per clock, for ρ = L2 ÷ DRAM bandwidth (:func:`l2_bw_ratio`). One constant for all
#: GPUs, chosen by leave-one-GPU-out over A100 / H100 / L40S jointly (8, 16, 32, 64 tried; 16 best on the mean and
#: the worst family over the three folds). The physical L2 port is wider (~32–64 B/clk/SM); kernels reach part.
L2_BYTES_PER_CLOCK_PER_SM = 16.0
#: Fixed per-kernel latency moves as time × (source clock ÷ target clock)^this: part of it is GPU cycles (scales
#: with the clock), part is not (driver, timer); exponents 0, 0.5, 1 tried leave-one-GPU-out, 0.5 best on the mean.
OVERHEAD_CLOCK_EXPONENT = 0.5
#: The unsplit decode path's per-CTA bandwidth moves with (target clock ÷ source clock)^this. Leave-one-out over the
#: two GPUs that show the path (A100 21.7, L40S 26.2 GB/s), error on A100 / L40S: exponent 0 → +21 / −17 %,
#: 0.5 → −10 / +11 %, 1 → −32 / +48 %.
DECODE_FLOOR_CLOCK_EXPONENT = 0.5
TRANSFERRED_FAMILIES: tuple[str, ...] = ("gemm", "attn_prefill", "attn_decode", "lm_head", "moe_gemm", "mla_prefill",
                                         "mla_decode",
                                         "attn_encoder")
#: GPUs whose MoE model is not transferred: the shared A100 MoE tables time only the tokens that picked the rank's
#: experts (``calibrate.rows.RANK_TOKENS``), so their fit never sees the layer-wide traffic of every token that a
#: vLLM rank carries under EP; leave-one-GPU-out on H100 bf16 MoE rows: 31 % from the A100 alone before that was
#: modelled, 155 % after (its η extrapolated), 23 / 21 % from the L40S / RTX PRO 6000 alone.
MOE_TRANSFER_EXCLUDED: tuple[str, ...] = ("a100-sxm",)
#: The bundled target-measured calibrations whose tables hold NVFP4 GEMM rows: the sources of rule 9.
FP4_TRANSFER_SOURCES: tuple[str, ...] = ("rtx-pro-6000",)
#: The gemm switch key of the NVFP4 (W4A4) format.
NVFP4_KEY = switch_key(K.GEMM_FORMAT_CODES["nvfp4"])


def spec_vector(hw: HardwareSpec) -> tuple[float, ...]:
    """Log-spec coordinates used for similarity: balance, bandwidth, SMs, L2, clock."""
    return (
        math.log(hw.machine_balance_flops_per_byte),
        math.log(hw.usable_mem_bytes_per_s),
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


def l2_bw_ratio(hw: HardwareSpec) -> float:
    """ρ: L2 bandwidth estimated from the spec (SMs × clock × bytes/clk/SM) ÷ DRAM bandwidth."""
    return L2_BYTES_PER_CLOCK_PER_SM * hw.num_sms * hw.boost_clock_hz / hw.usable_mem_bytes_per_s


def overhead_scale(source: HardwareSpec | None, target: HardwareSpec) -> float:
    """Factor on a source's fixed per-kernel latency on the target (rule 4 of the module docstring)."""
    if source is None:
        return 1.0
    return (source.boost_clock_hz / target.boost_clock_hz) ** OVERHEAD_CLOCK_EXPONENT


def retarget(
    model: EtaModel, family: str, variant: str | None, target: HardwareSpec, source: HardwareSpec | None = None
) -> EtaModel:
    """A source model re-expressed on the target's spec constants, residual lattice dropped.

    With the ``source`` spec, the source's L2 benefit is swapped for the target's (ρ of both in the device
    constants, applied by :func:`~kernelsight.simcore.eta_basis.cache_gain_ratio`) and the fixed latency is
    moved by the clock ratio.
    """
    if isinstance(model, LogPolyEta):
        fam = "gemm" if model.basis == "gemm" else family
        if fam in ("gemm", "moe_gemm"):   # the format's balance and bytes (MoE: the format code, bf16 if none)
            key = variant if variant is not None else "0"
        else:
            key = "2"
        dev = device_constants(fam, key, target)
        ovh = model.overhead_s
        if "l2_spill_center" in model.device:  # decode's L2 step, fitted in units of the source's L2: carries over
            dev["l2_spill_center"] = model.device["l2_spill_center"]
        if source is not None:
            dev.update(l2_bw_ratio_source=l2_bw_ratio(source), l2_bw_ratio_target=l2_bw_ratio(target))
            ovh = None if ovh is None else ovh * overhead_scale(source, target)
            cs, ct = sustained_clock_share(source), sustained_clock_share(target)
            if cs != ct and fam == "gemm":   # rule 10: a power-limited clock is the board's, not the architecture's
                dev.update(clock_sustain_source=cs, clock_sustain_target=ct)
        return replace(model, device=dev, grid=None, trees=None, overhead_s=ovh)
    if isinstance(model, DispatchEta):
        # The target has no kernel measurements: transfer the variant's pooled smooth model (all kernels' rows,
        # what a calibration without per-kernel models held), else the majority kernel's.
        base = model.pooled if model.pooled is not None else model.models[model.default]
        return retarget(base, family, variant, target, source)
    if isinstance(model, SwitchEta):
        return SwitchEta(
            model.index,
            {k: retarget(m, family, k, target, source) for k, m in model.models.items()},
            model.default,
        )
    if isinstance(model, EnsembleEta):
        return EnsembleEta(
            tuple(retarget(m, family, variant, target, source) for m in model.members), model.weights
        )
    return model


def transfer_family(
    family: str,
    sources: Sequence[tuple[Calibration, HardwareSpec]],
    weights: Sequence[float],
    target: HardwareSpec,
    target_release: tuple[int, ...] | None = None,
) -> EtaModel | None:
    picked = [(c.eta[family], w, h) for (c, h), w in zip(sources, weights, strict=True) if family in c.eta
              and not (family == "moe_gemm" and h.name in MOE_TRANSFER_EXCLUDED)]
    if family == "moe_gemm":
        by_kernel = transfer_moe_by_kernel(
            [(c.eta[family], w, h, vllm_release(c.software.get("vllm")))
             for (c, h), w in zip(sources, weights, strict=True)
             if isinstance(c.eta.get(family), SwitchEta) and h.name not in MOE_TRANSFER_EXCLUDED],
            target, target_release)
        if by_kernel is not None:
            return by_kernel
        picked = moe_sources(picked, target)
    if family in MLA_FAMILIES:
        picked = mla_sources(picked, target, family)
    if not picked:
        return None
    total = sum(w for _, w, _ in picked)
    if all(isinstance(m, SwitchEta) for m, _, _ in picked):
        switches: list[tuple[SwitchEta, float, HardwareSpec]] = [
            (m, w / total, h) for m, w, h in picked  # type: ignore[misc]
        ]
        keys = {k for m, _, _ in switches for k in m.models}
        if family == "gemm":  # every GEMM format vLLM runs gets a model, measured by a source or not (rule 6)
            keys |= {switch_key(K.GEMM_FORMAT_CODES[f]) for f in ("bf16", "fp8", "fp8_block")}
        out: dict[str, EtaModel] = {}
        for key in sorted(keys):
            members, ws = [], []
            for m, w, h in switches:
                sub_key = key if key in m.models else _closest_key(key, list(m.models))
                member = retarget(m.models[sub_key], family, key, target, h)
                ratio = _format_peak(target, key) / _format_peak(target, sub_key)
                if ratio > 1.0 and isinstance(member, LogPolyEta) and member.basis == "gemm":
                    # stand-in from a slower format: never credit the unmeasured format's higher peak
                    member = replace(member, device=dict(member.device, fallback_peak_ratio=ratio))
                members.append(member)
                ws.append(w)
            out[key] = EnsembleEta(tuple(members), tuple(w / sum(ws) for w in ws))
        default = max((m.default for m, _, _ in switches), key=[m.default for m, _, _ in switches].count)
        return SwitchEta(switches[0][0].index, out, default)
    variant = "0" if family in ("lm_head", "moe_gemm") else None
    members = tuple(retarget(m, family, variant, target, h) for m, _, h in picked)
    return EnsembleEta(members, tuple(w / total for _, w, _ in picked))


def _arch(hw: HardwareSpec) -> str:
    return f"{hw.vendor}:{hw.compute_capability.split('.')[0]}"


#: MoE switch key (``kernel_shapes.MOE_FORMAT_CODES``) → the tables' format name.
MOE_FORMAT_BY_KEY: dict[str, str] = {switch_key(c): f for f, c in K.MOE_FORMAT_CODES.items() if f != "fp16"}


#: MoE kernels whose η carries across architectures: Marlin (one hand-written CUDA kernel on every GPU) and Triton's
#: ``fused_moe`` (one kernel source; its tile configs follow the shape). FlashInfer builds another CUTLASS MoE kernel
#: per SM, and the H100's fp8 one reaches 0.1-0.2 of its roofline where the PRO 6000's reaches 0.3-0.8: by kernel,
#: the PRO 6000's FlashInfer CUTLASS from the H100's was 232-274 % off leave-one-GPU-out. By kernel for Triton and
#: Marlin (``benchmarks/moe_accuracy.py``, the MoE L2 center at 1): the L40S 33 → 24 % (fp8 58 → 26 %, from the H100's
#: block-fp8 Triton rather than two FlashInfer CUTLASS fp8 models), the PRO 6000 under 0.19 39 → 25 %.
PORTABLE_MOE_KERNELS: frozenset[str] = frozenset({MARLIN, TRITON})


def _moe_kernel_models(model: EtaModel, fmt: str, source: HardwareSpec,
                       release: tuple[int, ...] | None) -> dict[str, EtaModel]:
    """A source variant's models by the kernel class each times: a per-kernel model per class it ran, or the one
    model under the class vLLM dispatches for that format on the source (``simcore.moe_dispatch.moe_kernel``)."""
    if isinstance(model, DispatchEta):
        out: dict[str, EtaModel] = {}
        for name in sorted(model.models, key=lambda n: n != model.default):   # the majority kernel first
            out.setdefault(moe_kernel_class(name) or name, model.models[name])
        return out
    return {moe_kernel(fmt, source.compute_capability, release): model}


def transfer_moe_by_kernel(picked: Sequence[tuple[SwitchEta, float, HardwareSpec, tuple[int, ...] | None]],
                           target: HardwareSpec, target_release: tuple[int, ...] | None) -> SwitchEta | None:
    """The MoE η of a target by the kernel vLLM runs there (rule 12): per expert format, the class of the target's
    kernel (``moe_kernel``), and from each source the smooth model of that class — the same format's if the source
    ran that kernel for it, else another format's run by that kernel (re-expressed at the target format's balance
    and bytes, as rule 6); of those, the target's own architecture's where one ran it (:func:`moe_sources`), weighted
    by spec similarity. A format no source ran by that kernel keeps the per-variant rule (:func:`moe_sources`). None
    without sources."""
    if not picked:
        return None
    keys = sorted({k for m, _, _, _ in picked for k in m.models})
    out: dict[str, EtaModel] = {}
    for key in keys:
        fmt = MOE_FORMAT_BY_KEY.get(key, "bf16")
        want = moe_kernel(fmt, target.compute_capability, target_release)
        if want not in PORTABLE_MOE_KERNELS:
            want = ""   # an architecture's own build of the kernel: the format's pooled models below
        same, other = [], []
        for m, w, h, rel in picked:
            if not want:
                break
            if key in m.models and want in (got := _moe_kernel_models(m.models[key], fmt, h, rel)):
                same.append((got[want], w, h))
                continue
            for k in sorted(m.models, key=lambda k: abs(float(k) - float(key))):
                got = _moe_kernel_models(m.models[k], MOE_FORMAT_BY_KEY.get(k, "bf16"), h, rel)
                if want in got:
                    other.append((got[want], w, h))
                    break
        # the same kernel on the target's own architecture where one ran it (the H100's fp8 FlashInfer CUTLASS path
        # reaches 0.1-0.2 of its roofline, the PRO 6000's 0.3-0.8: a property of the kernel on that architecture)
        chosen = moe_sources(same, target) if same else moe_sources(other, target)
        if not chosen:
            # no source ran the target's kernel where it carries over: the format's pooled models of the target's
            # architecture, else of the sources that ran a portable kernel for it (another architecture's build of
            # FlashInfer's CUTLASS MoE says less: the PRO 6000's fp8 from the H100's FlashInfer CUTLASS and the
            # L40S's Triton 77 %, from the L40S's alone 38 %), else every source's
            pool = [(m.models[key] if key in m.models else m.models[_closest_key(key, list(m.models))], w, h, rel)
                    for m, w, h, rel in picked]
            portable = [p for p in pool if moe_kernel(MOE_FORMAT_BY_KEY.get(key, "bf16"), p[2].compute_capability,
                                                      p[3]) in PORTABLE_MOE_KERNELS]
            if not any(_arch(p[2]) == _arch(target) for p in pool) and portable:
                pool = portable
            chosen = moe_sources([(m, w, h) for m, w, h, _ in pool], target)
        total = sum(w for _, w, _ in chosen)
        out[key] = EnsembleEta(tuple(retarget(mm, "moe_gemm", key, target, h) for mm, _, h in chosen),
                               tuple(w / total for _, w, _ in chosen))
    defaults = [m.default for m, _, _, _ in picked]
    return SwitchEta(picked[0][0].index, out, max(defaults, key=defaults.count))


def moe_sources(picked: list, target: HardwareSpec) -> list:
    """The MoE sources a target takes its η from: those of its own architecture (vendor and compute-capability
    major) when any was measured, else all. vLLM picks a FusedMoE kernel per architecture (the shared tables: bf16
    Triton on Hopper and Ada, FlashInfer CUTLASS on 12.x; fp8 per-tensor FlashInfer CUTLASS on Hopper at 0.12-0.19 of
    its roofline, Triton on Ada at ~0.8), so another architecture's η says little about the kernel the target
    runs."""
    same = [p for p in picked if _arch(p[2]) == _arch(target)]
    return same or picked


#: The bundled calibrations whose folders time the MLA module (``mla_*`` tables, scope ``module``, vLLM 0.24): the
#: sources of the MLA families (``benchmarks/build_calibrations.py --mla-only`` finds them in the data; this names them
#: for ``kernelsight profiles``).
MLA_TRANSFER_SOURCES: tuple[str, ...] = ("h100-sxm", "l40s", "rtx-pro-6000")


def mla_sources(picked: list, target: HardwareSpec, family: str) -> list:
    """The sources a target takes an MLA family's η from, by the kernel vLLM runs for it (``simcore.mla``):

    * ``mla_decode``: those whose default MLA decode backend (``mla_decode_backend``, 16-bit KV) is the target's
      (FLASH_ATTN_MLA / FlashMLA on SM 9.0, Triton MLA on the other GPUs measured), else none;
    * ``mla_prefill``: every source, unless the target is an SM 10.x GPU (its MLA prefill runs FlashInfer / cuDNN /
      TRT-LLM kernels no source times): FlashAttention's varlen kernel runs the up-projected prefill on all of them.

    Without a source the family is not transferred and the composed dense-family pricing stays. Leave-one-GPU-out on
    the shared module tables (``benchmarks/mla_accuracy.py``, fit rows, MAPE of the module): decode from the same
    backend L40S 19 % / RTX PRO 6000 19 % / its 0.19 stack 28 % against the composed 26 / 40 / 41 %, from every
    source the H100 39 % against 36 % (another kernel's η); prefill from every source H100 18 / PRO 6000 6 /
    0.19 8 / L40S 14 % against 29 / 17 / 22 / 10 %."""
    if family == "mla_prefill":
        return [] if target.compute_capability.startswith("10.") else picked
    want = mla_decode_backend(target.compute_capability, "bf16")
    return [p for p in picked if mla_decode_backend(p[2].compute_capability, "bf16") == want]


def mla_source_names(target: HardwareSpec, sources: Sequence[HardwareSpec], family: str) -> list[str]:
    """The GPUs (of ``sources``) a cross-generation calibration of ``target`` takes an MLA family from."""
    return [h.name for _, _, h in mla_sources([(None, 1.0, h) for h in sources if h.name != target.name], target,
                                              family)]


def moe_source_names(target: HardwareSpec, sources: Sequence[HardwareSpec]) -> dict[str, tuple[str, list[str]]]:
    """Per expert format, the kernel a cross-generation calibration of ``target`` prices (``moe_kernel``, the newest
    release) and the GPUs (of ``sources``, each taken to have measured every format by the kernel vLLM runs there)
    it takes that format's η from, as :func:`transfer_moe_by_kernel` picks them."""
    srcs = [h for h in sources if h.name != target.name and h.name not in MOE_TRANSFER_EXCLUDED]
    out: dict[str, tuple[str, list[str]]] = {}
    for fmt in ("bf16", "fp8", "fp8_block", "int4_wo", "w4a16_mxfp4"):
        want = moe_kernel(fmt, target.compute_capability)
        ran = {h.name: moe_kernel(fmt, h.compute_capability) for h in srcs}
        picked = [(None, 1.0, h) for h in srcs if ran[h.name] == want] if want in PORTABLE_MOE_KERNELS else []
        if not picked:
            pool = [(None, 1.0, h) for h in srcs]
            portable = [p for p in pool if ran[p[2].name] in PORTABLE_MOE_KERNELS]
            if not any(_arch(p[2]) == _arch(target) for p in pool) and portable:
                pool = portable
            picked = pool
        out[fmt] = (want, [h.name for _, _, h in moe_sources(picked, target)])
    return out


def _format_peak(hw: HardwareSpec, key: str) -> float:
    """Peak FLOP/s of the GEMM format behind a switch key (GEMM_FORMAT_CODES) on ``hw``."""
    code = int(float(key))
    fmt = {c: f for f, c in K.GEMM_FORMAT_CODES.items() if f != "fp16"}.get(code, "bf16")
    return hw.peak_flops_per_s(K.GEMM_COMPUTE_DTYPE[fmt])


def _closest_key(key: str, keys: list[str]) -> str:
    """Nearest categorical value (fp8 block-scaled ↔ fp8 per-tensor ↔ bf16; KV 1 ↔ 2 bytes)."""
    return min(keys, key=lambda k: abs(float(k) - float(key)))


def transfer_fp4_variant(calib: Calibration, target: HardwareSpec,
                         fp4_sources: Sequence[tuple[Calibration, HardwareSpec]], tau: float = SIMILARITY_TAU) -> bool:
    """Add the ``nvfp4`` GEMM variant to ``calib`` (a calibration of ``target``) from the FP4-measured sources (rule 9
    of the module docstring). Nothing happens when the target has no FP4 tensor cores, already has the variant, or
    no source measured it. Returns whether it was added."""
    gemm = calib.eta.get("gemm")
    if target.fp4_flops_per_s is None or not isinstance(gemm, SwitchEta) or NVFP4_KEY in gemm.models:
        return False
    srcs = [(c, h) for c, h in fp4_sources
            if h.name != target.name and isinstance(c.eta.get("gemm"), SwitchEta)
            and NVFP4_KEY in c.eta["gemm"].models]   # type: ignore[union-attr]
    if not srcs:
        return False
    weights = similarity_weights(target, [h for _, h in srcs], tau)
    members = tuple(retarget(c.eta["gemm"].models[NVFP4_KEY], "gemm", NVFP4_KEY, target, h)  # type: ignore[union-attr]
                    for c, h in srcs)
    calib.eta["gemm"] = SwitchEta(gemm.index, {**gemm.models, NVFP4_KEY: EnsembleEta(members, tuple(weights))},
                                  gemm.default)
    names = ", ".join(h.name for _, h in srcs)
    calib.source += f"; nvfp4 GEMMs transferred from {names} (measured in FP4)"
    # the GEMMs' software only: NCCL times none of them
    calib.software = merged_software([calib.software, *({k: v for k, v in c.software.items() if k != "nccl"}
                                                         for c, _ in srcs)])
    return True


def transfer_comm(
    sources: Sequence[tuple[Calibration, HardwareSpec]], target: HardwareSpec
) -> dict[str, CommModel]:
    """Collective models for ``target``: per backend, the sources of its link class (NVLink-class vs PCIe-only)
    that have it if any, else all that have it (:func:`~kernelsight.calibrate.fit.comm.comm_source_pool`).

    Curves by the spec-driven rule of :mod:`kernelsight.calibrate.fit.comm` (bandwidth part rescaled to the
    target's link, latency part by clock within a class); the fallback α–β line as geometric means.
    """
    curves = transfer_comm_curves(sources, target)
    out: dict[str, CommModel] = {}
    for backend in sorted({b for c, _ in sources for b in c.comm}):
        ms = [c.comm[backend] for c, _ in comm_source_pool(sources, target, backend)]
        alpha = math.exp(sum(math.log(m.alpha_s) for m in ms) / len(ms))
        frac = math.exp(sum(math.log(m.bus_bytes_per_s_fraction) for m in ms) / len(ms))
        out[backend] = CommModel(alpha, frac, curves=curves.get(backend, {}))
    return out


def runs_fa2_decode(hw: HardwareSpec) -> bool:
    """Whether vLLM's default attention backend runs FlashAttention-2 on this GPU (Ampere, Ada and RTX Blackwell;
    :mod:`~kernelsight.simcore.attention_dispatch`): Hopper runs FA3, datacenter Blackwell FlashInfer."""
    return attention_kernel(hw) == FLASH_ATTN_2


def borrowed_kernels(target: HardwareSpec, sources: Sequence[HardwareSpec], tau: float = SIMILARITY_TAU
                     ) -> list[tuple[str, float, str]]:
    """What a cross-generation calibration of ``target`` borrows: (source GPU, its weight, the kernels it measured),
    heaviest first. Rule 5 weighs every source by spec similarity, not by kernel: weighting the sources that run the
    target's own kernels more (×2, ×4), or only them, was tried leave-one-GPU-out on the shared tables and was worse
    (A100 from the L40S alone, both FlashAttention-2 and mma.sync: decode attention 51% MAPE against 24% from both
    L40S and H100; ×2: 26%, ×4: 31%; the L40S: GEMM 41 → 43 / 44%) — one source's library quirks outweigh the kernel
    they share (``benchmarks/transfer_by_kernel.py``)."""
    sources = [h for h in sources if h.name != target.name]
    weights = similarity_weights(target, sources, tau) if sources else []
    out = [(h.name, w, kernel_lineage(h)) for h, w in zip(sources, weights, strict=True)]
    return sorted(out, key=lambda x: -x[1])


def transfer_decode_floor(sources: Sequence[tuple[Calibration, HardwareSpec]],
                          target: HardwareSpec) -> dict[str, float]:
    """The unsplit decode path's per-CTA bandwidth (``simcore.eta.decode_serial_floor_s``) for an FA2 target: per
    variant, the geometric mean over the sources that measured it, × (target clock ÷ source clock)^0.5."""
    if not runs_fa2_decode(target):
        return {}
    per_variant: dict[str, list[float]] = {}
    for c, h in sources:
        for key, bw in c.decode_cta_bytes_per_s.items():
            scaled = bw * (target.boost_clock_hz / h.boost_clock_hz) ** DECODE_FLOOR_CLOCK_EXPONENT
            per_variant.setdefault(key, []).append(math.log(scaled))
    return {k: math.exp(sum(v) / len(v)) for k, v in per_variant.items()}


def merged_software(records: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The software several sources' kernels were timed under (their ``Calibration.software``): per component, its
    distinct versions joined by " / "."""
    versions: dict[str, set[str]] = {}
    for record in records:
        for key, joined in record.items():
            versions.setdefault(key, set()).update(joined.split(" / "))
    return {k: " / ".join(sorted(v)) for k, v in versions.items()}


def cross_generation_calibration(
    target: HardwareSpec, sources: Sequence[tuple[Calibration, HardwareSpec]], tau: float = SIMILARITY_TAU,
    fp4_sources: Sequence[tuple[Calibration, HardwareSpec]] = (),
    source_weights: Sequence[float] | None = None,
    vllm_version: str | None = None,
) -> Calibration:
    """Calibration for ``target`` from measured calibrations of other GPUs (see the module docstring); the ``nvfp4``
    GEMM variant from ``fp4_sources`` (rule 9). ``source_weights`` (one per source other than the target, summing
    to 1) replaces rule 5's similarity weights: for experiments (:func:`borrowed_kernels`)."""
    sources = [(c, h) for c, h in sources if h.name != target.name]
    if not sources:
        raise ValueError("cross-generation transfer needs at least one calibration of another GPU")
    weights = list(source_weights) if source_weights is not None else similarity_weights(
        target, [h for _, h in sources], tau)
    calib = default_calibration(target.name)
    calib.tier = "cross-generation"
    releases = [r for c, _ in sources if (r := vllm_release(c.software.get("vllm"))) is not None]
    target_release = vllm_release(vllm_version) if vllm_version else max(releases, default=None)
    for fam in TRANSFERRED_FAMILIES:
        model = transfer_family(fam, sources, weights, target, target_release)
        if model is not None:
            calib.eta[fam] = model
    for fam in TRANSFERRED_FAMILIES:
        eligible = [(c, w, h) for (c, h), w in zip(sources, weights, strict=True) if fam in c.overhead_s
                    and not (fam == "moe_gemm" and h.name in MOE_TRANSFER_EXCLUDED)]
        if fam == "moe_gemm":   # the same sources as its η
            eligible = moe_sources(eligible, target)
        if fam in MLA_FAMILIES:
            eligible = mla_sources(eligible, target, fam)
        vals = [(c.overhead_s[fam] * overhead_scale(h, target), w) for c, w, h in eligible]
        if vals:
            calib.overhead_s[fam] = math.exp(sum(w * math.log(v) for v, w in vals) / sum(w for _, w in vals))
    calib.eta_max = max(c.eta_max for c, _ in sources)
    comm = transfer_comm(sources, target)
    if comm:
        calib.comm.update(comm)
    calib.decode_cta_bytes_per_s = transfer_decode_floor(sources, target)
    calib.software = merged_software([c.software for c, _ in sources])
    names = ", ".join(f"{h.name} ({w:.2f})" for (_, h), w in zip(sources, weights, strict=True))
    calib.source = f"transferred from target-measured calibrations of {names} (weights in parentheses)"
    calib.licence = "; ".join(sorted({c.licence for c, _ in sources if c.licence}))
    calib.notes = (
        "cross-generation tier: source η models re-expressed on this GPU's spec (machine balance, "
        "SM count, L2), residual lattices and trees dropped, geometric mean weighted by spec similarity"
    )
    transfer_fp4_variant(calib, target, fp4_sources, tau)
    return calib
