"""Step time: Σ kernel times (roofline / η + fixed latency) + all-reduces + exposed launch + host.

The token-parallel part of a step (GEMMs, norms, activations...) depends only on the padded token count,
the LM head and sampler only on the rows that sample, so both are cached by those numbers; attention is
computed per step from the batch composition. Decode-only windows (the hot path of fast-forward) are
evaluated for many steps at once.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np

from kernelsight.simcore import kernels as K
from kernelsight.simcore.calibration import Calibration
from kernelsight.simcore.comm import allreduce_s
from kernelsight.simcore.compiled import mypyc_attr
from kernelsight.simcore.eta import EnsembleEta, SwitchEta, fitted_gemm_nk, switch_key
from kernelsight.simcore.gemm_dispatch import BLOCK_KERNELS, block_time_ratio
from kernelsight.simcore.hardware import HardwareSpec
from kernelsight.simcore.kernels import FAMILIES, FAMILY_INDEX, BatchShape, Kernel, PrefillChunk
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.moe_routing import DEFAULT_EXPERT_ROUTING
from kernelsight.simcore.precision import Precision
from kernelsight.simcore.roofline import kernel_roofline_s
from kernelsight.simcore.vision_encoder import encoder_allreduces, encoder_kernel_launches, encoder_kernels


def default_cudagraph_capture_sizes(max_num_seqs: int, max_capture_size: int | None = None) -> tuple[int, ...]:
    """vLLM's capture list: 1, 2, 4, then steps of 8 to 256, then steps of 16, up to the max size.

    The max defaults to min(2 · max_num_seqs, 512) as in vLLM.
    """
    cap = max_capture_size if max_capture_size is not None else min(2 * max_num_seqs, 512)
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max(cap, 272) + 1, 16))
    return tuple(s for s in sizes if s <= cap)


_I_ATTN_PREFILL = FAMILY_INDEX[K.ATTN_PREFILL]
_I_ATTN_DECODE = FAMILY_INDEX[K.ATTN_DECODE]
_I_LAUNCH = FAMILY_INDEX[K.LAUNCH]
_I_HOST = FAMILY_INDEX[K.HOST]
_I_ENCODER = FAMILY_INDEX[K.ENCODER]

#: A block-fp8 model's time above these multiples of its fixed latency (the eager host floor of its rows) is
#: the kernel's own GPU time (from 3x) or partly so (from 2x): calibrate.fit.block_fp8.GPU_BOUND_FACTOR.
_GPU_BOUND_LO = 2.0
_GPU_BOUND_HI = 3.0


#: Linear layers whose fp8 input quantization torch.compile fuses into the kernel that produces their input.
_QUANT_FUSED_INPUTS = frozenset({"qkv_proj", "gate_up_proj", "down_proj", "shared_expert_gate_up",
                                 "shared_expert_down"})


def _fits_own_nvfp4_rows(calib: Calibration) -> bool:
    """Whether the calibration's NVFP4 GEMM model was fitted on this GPU's own rows (not transferred)."""
    model = calib.eta.get(K.GEMM)
    if not isinstance(model, SwitchEta):
        return False
    sub = model.models.get(switch_key(K.GEMM_FORMAT_CODES["nvfp4"]))
    return sub is not None and not isinstance(sub, EnsembleEta)


def _fits_own_block_rows(calib: Calibration) -> bool:
    """Whether the calibration's block-fp8 GEMM model was fitted on this GPU's rows (not transferred)."""
    model = calib.eta.get(K.GEMM)
    if not isinstance(model, SwitchEta):
        return False
    sub = model.models.get(switch_key(K.GEMM_FORMAT_CODES["fp8_block"]))
    return sub is not None and not isinstance(sub, EnsembleEta)


FULL_GRAPH = "full"
PIECEWISE = "piecewise"
EAGER = "eager"
#: Families whose time never goes below their roofline (fitted η may exceed 1 on L2-warm table rows).
_FLOORED_AT_ROOF = frozenset({K.MOE_GEMM, K.MLA_DECODE, K.MLA_PREFILL})


@dataclass(frozen=True, slots=True)
class StepConfig:
    tp: int = 1
    cudagraph_capture_sizes: tuple[int, ...] = ()
    enforce_eager: bool = False
    async_scheduling: bool = True     # vLLM 0.33's default: host work overlaps the GPU
    max_model_len: int = 0            # 0: the model's max_position_embeddings (vLLM's default)
    custom_all_reduce: bool = True    # not vLLM's --disable-custom-all-reduce
    expert_routing: str = DEFAULT_EXPERT_ROUTING   # how tokens pick experts (MoE: the experts a batch touches)
    moe_ep_size: int = 1              # > 1: experts split whole over the TP group (EP at one DP rank)
    expert_load_imbalance: float | None = None     # with moe_ep_size: the busiest rank's share, as an override

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        # rebuilt through __init__ (plan's and --replica-processes' workers get it pickled): compiled by mypyc
        # (kernelsight.accel) a frozen class refuses the field-by-field __setstate__ of a slots dataclass
        return type(self), tuple(getattr(self, f.name) for f in fields(self))


_SNAP_PER_OCTAVE = 64      # context-length grid for η lookups: ≤ 1.1% apart

#: FlashAttention-2 splits a decode batch's KV cache only while its (sequence, KV head) CTAs are fewer than 80% of
#: two per SM (``num_splits_heuristic(..., num_SMs * 2, ...)``: 128-thread CTAs, two resident per SM).
_FA2_UNSPLIT_CTAS_PER_SM = 0.8 * 2
#: Batch at which the decode kernel's DRAM bandwidth is read off its model (``_cold_decode_bytes_per_s``).
_COLD_DECODE_BATCH = 128
#: The most splits FlashAttention-2's heuristic picks (``set_params_splitkv``'s ``max_splits``).
_FA2_MAX_SPLITS = 128


def fa2_num_splits(batch_nheads_mblocks: int, num_sms_x2: int, num_n_blocks: int,
                   max_splits: int = _FA2_MAX_SPLITS) -> int:
    """FlashAttention-2's ``num_splits_heuristic`` (flash_api.cpp): 1 once the CTAs fill 80% of the slots; else the
    fewest splits whose wave efficiency reaches 85% of the best, skipping counts that give the same split size."""
    if batch_nheads_mblocks >= 0.8 * num_sms_x2:
        return 1
    max_splits = min(max_splits, num_sms_x2, num_n_blocks)

    def eligible(s: int) -> bool:
        return s == 1 or -(-num_n_blocks // s) != -(-num_n_blocks // (s - 1))

    eff = []
    for s in range(1, max_splits + 1):
        waves = np.float32(batch_nheads_mblocks * s) / np.float32(num_sms_x2)    # the kernel's host code: float
        eff.append(float(waves / np.float32(math.ceil(waves))) if eligible(s) else 0.0)
    best = max(eff, default=0.0)
    for s in range(1, max_splits + 1):
        if eligible(s) and eff[s - 1] >= 0.85 * best:
            return s
    return 1


def _snap_log(x: float) -> float:
    """Nearest point of a geometric grid with 64 points per octave (η varies smoothly in log-space)."""
    if x <= 1.0:
        return x
    return float(2.0 ** (round(math.log2(x) * _SNAP_PER_OCTAVE) / _SNAP_PER_OCTAVE))


def prefill_composed_kernel(model: ModelSpec, prefills: tuple[PrefillChunk, ...], tp: int, precision: Precision
                            ) -> list[Kernel]:
    """The up-projected prefill's attention as the dense families compose it (``attn_prefill``): the kernel whose
    fixed latency an MLA prefill op keeps on the GPU."""
    return [K.mla_prefill_kernels(model, prefills, tp, precision, 1)[1]]


def eta_lookup_features(family: str, features: tuple[float, ...]) -> tuple[float, ...]:
    """Features at which η is looked up: token counts above 64 rounded up to a multiple of 16 (one less when
    not a multiple: both keep every 64/128-row tile count and the 16-alignment unchanged), mean lengths
    snapped to a 1/64-octave grid."""
    if family == K.MOE_GEMM:   # slots per touched expert and all slots: smooth in log-space
        return (_snap_log(features[0]),) + features[1:5] + tuple(_snap_log(x) for x in features[5:])
    if family == K.GEMM:
        m = features[0]
        if m > 64:
            # up to the next multiple of 16 (minus one when m is not one, so that η's alignment term stays)
            snapped = math.ceil(m / 16.0) * 16
            return (float(snapped if m % 16 == 0 else snapped - 1),) + features[1:]
        return features
    if family in (K.ATTN_DECODE, K.MLA_DECODE):
        return (features[0], _snap_log(features[1])) + features[2:]
    if family in (K.ATTN_PREFILL, K.MLA_PREFILL):
        return (features[0], _snap_log(features[1]), _snap_log(features[2])) + features[3:]
    return features


class StepPricer(Protocol):
    """What the engine asks of its step model: a StepModel, or anything that prices steps as one does (the
    server's ScaledStepModel wraps one; a protocol, so that a compiled engine takes it too)."""

    def step(self, batch: BatchShape) -> tuple[np.ndarray, float]: ...

    def decode_window(self, num_decodes: int, context_tokens_start: int, num_steps: int,
                      top: tuple[int, ...] = ()) -> tuple[list[float], np.ndarray]: ...


@mypyc_attr(allow_interpreted_subclasses=True)    # dp_group, spec_decode_step, mtp price some kernels their own way
class StepModel:
    """Predicts the duration of one engine step on one GPU model."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, calib: Calibration, precision: Precision,
                 config: StepConfig) -> None:
        self.model, self.hw, self.calib, self.precision, self.config = model, hw, calib, precision, config
        self._capture = tuple(sorted(config.cudagraph_capture_sizes))
        self._row_cache: dict[int, tuple[np.ndarray, float]]
        self._sampling_cache: dict[int, tuple[np.ndarray, float]]
        self._decode_eta: dict[tuple[int, float], tuple[float, float]]
        self._prefill_attn_memo: dict[tuple[tuple[int, int], ...], float]
        (self._row_cache, self._sampling_cache, self._decode_eta,
         self._prefill_attn_memo) = self._memo_tables(model, hw, calib, precision, config)
        self._attn_peak_flops_per_s = hw.peak_flops_per_s("bf16")   # attention kernels run in bf16
        self._l2_bytes, self._dram_bytes_per_s = float(hw.l2_bytes), hw.usable_mem_bytes_per_s
        self._gemm_n_max, self._gemm_k_max = fitted_gemm_nk(calib.eta.get(K.GEMM))
        self._n_families = len(FAMILIES)
        # Where the GPU has FP8 tensor cores but its calibration never timed (under CUDA graphs) the fp8 kernel vLLM
        # runs — every fp8 GEMM of a transferred table, block-scaled ones everywhere — an fp8 GEMM is priced no
        # slower than the same GEMM in the 16-bit dtype (see _fp8_linear_s).
        self._fp8_tc = hw.fp8_flops_per_s is not None
        self._fp8_measured = calib.tier == "target-measured"
        self._block_measured = self._fp8_measured and _fits_own_block_rows(calib)
        self._nvfp4_measured = self._fp8_measured and _fits_own_nvfp4_rows(calib)
        m, tp, p = model, config.tp, precision
        q_heads, kv_heads = m.num_attention_heads // tp, max(m.num_kv_heads // tp, 1)
        self._decode_consts = (q_heads, kv_heads, m.head_dim, p.kv_bytes_per_element, p.act_bytes, m.sliding_window,
                               hw.num_sms, self._attn_peak_flops_per_s, hw.usable_mem_bytes_per_s,
                               q_heads == kv_heads, m.num_layers)
        # MLA and mixed sliding/full layers price attention as several kernels (kernels.attention_kernels): the
        # inline GQA decode path below is for one uniform attention kind
        self._generic_attention = model.has_mixed_attention
        # the MLA attention families this calibration measured (``mla.py``): each priced as one kernel of its own
        self.mla_families: frozenset[str] = (frozenset(f for f in (K.MLA_PREFILL, K.MLA_DECODE) if f in calib.eta)
                                             if m.mla else frozenset())
        self._mla_excess_memo: dict[tuple[int, float], float] = {}
        self._decode_batch_terms: dict[int, tuple[float, float]] = {}   # _decode_eta_s: per batch size
        self._mla_prefill_host_memo: dict[tuple[tuple[int, int], ...], float] = {}
        # decode attention as a serving step streams it (see _decode_stream_s): the kernel's DRAM-side bandwidth, and
        # on FlashAttention-2's unsplit GQA path the bandwidth one CTA streams at and the longest contexts it needs
        self._decode_cold_bw = 0.0
        self._decode_cold_ref_bytes = 0.0
        self._decode_cta_bw = 0.0
        self.decode_top_k = 0
        # FlashAttention-2's split-KV unit for hdim (its kBlockN), and per padded decode batch the split size a full
        # CUDA graph replays (see _graph_split_tokens)
        self._fa2_block_n = 256 if m.head_dim <= 64 else (128 if m.head_dim <= 128 else 64)
        self._graph_split: dict[int, int | None] = {}
        if not self._generic_attention and not m.sliding_window:
            self._decode_cold_bw = self._cold_decode_bytes_per_s()
            cta_bw = calib.decode_cta_bytes_per_s.get(switch_key(p.kv_bytes_per_element), 0.0)
            if cta_bw > 0 and self._decode_cold_bw > 0 and q_heads != kv_heads:
                self._decode_cta_bw = cta_bw
                # contexts beyond the top k never stream alone: k·kv_heads CTAs already draw the whole bandwidth
                self.decode_top_k = math.ceil(self._decode_cold_bw / cta_bw / kv_heads) + 1
        # decode_window's first step: ((num_decodes, start context, top), (breakdown, seconds)) of the last call
        self._window_first: tuple[tuple[int, int, tuple[int, ...]] | None,
                                  tuple[np.ndarray, float] | None] = (None, None)
        self._encoder_memo: dict[tuple, float] = {}

    def _memo_tables(self, model: ModelSpec, hw: HardwareSpec, calib: Calibration, precision: Precision,
                     config: StepConfig) -> tuple[dict, dict, dict, dict]:
        """The four memo tables: a plain StepModel shares them with every other one on the same calibration, model,
        GPU, precision and step config (their values depend on nothing else); subclasses, which price some kernels
        their own way, keep private ones."""
        if type(self) is not StepModel:
            return {}, {}, {}, {}
        # the GPU spec's ``sources`` (where each datasheet number came from) is a dict and prices nothing
        hw_key = tuple(getattr(hw, f.name) for f in dataclasses.fields(hw) if f.name != "sources")
        key = (model, hw_key, precision, config)
        try:
            tables = calib.step_memos.get(key)
        except TypeError:                 # a spec holding an unhashable field: nothing to share by
            return {}, {}, {}, {}
        if tables is None:
            if len(calib.step_memos) > 64:   # bounded: a long search over many configurations
                calib.step_memos.clear()
            tables = calib.step_memos[key] = ({}, {}, {}, {})
        return tables  # type: ignore[no-any-return,return-value]

    # -- single kernels --------------------------------------------------------------------------
    def kernel_time_s(self, k: Kernel) -> float:
        """Time of all ``k.count`` launches of one kernel: roofline / η + fixed latency.

        The roofline uses the exact shape; η and the fixed latency are looked up at the shape snapped to a
        fine grid (see :func:`eta_lookup_features`), so that a simulation's steps hit the calibration's
        memo instead of re-evaluating its model for every new context length or token count.
        """
        roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, self.hw)
        features = eta_lookup_features(k.family, k.features)
        if k.family == K.GEMM and (features[1] > self._gemm_n_max or features[2] > self._gemm_k_max):
            # Wider than any GEMM the tables measured: η held at the widest (the measured GEMVs' bandwidth is flat
            # in n from 16k to 65k), the roofline exact. The smooth model clamps each basis axis alone, and the
            # others (tiles, bytes/L2) still move it: the LM head fell from 1.45 to 1.29 TB/s at n = 128,256.
            features = (features[0], min(features[1], self._gemm_n_max), min(features[2], self._gemm_k_max)
                        ) + features[3:]
        eta, overhead_s = self.calib.kernel_eta_overhead_s(k.family, features)
        # η may exceed 1 (the tables time L2-warm kernels faster than DRAM), but no more than the L2 holds can come
        # from it: a model extrapolated beyond its rows must not read the rest faster than DRAM delivers
        t = max(roof / eta + overhead_s, (k.bytes_moved - self._l2_bytes) / self._dram_bytes_per_s)
        if k.family == K.ATTN_DECODE and self.calib.decode_cta_bytes_per_s:
            t = max(t, self.calib.decode_floor_s(k.features, self.hw.num_sms))   # exact shape, like the roof
        if k.family in _FLOORED_AT_ROOF:
            # a serving step's MoE layers each read other experts' weights, cold in L2: never below the DRAM
            # roofline (the MoE tables repeat one layer, L2-warm, and η > 1 fits their fastest rows); the MLA
            # families likewise (fitted on the module tables' residuals, never credited with more than the roof)
            t = max(t, roof)
        if k.impl and k.dtype == "fp8":
            t = max(self._fp8_linear_s(k, t), roof)
        elif k.impl and k.dtype == "fp4":
            t = max(self._nvfp4_linear_s(k, t), roof)
        return t * k.count

    def _nvfp4_linear_s(self, k: Kernel, t: float) -> float:
        """One launch of a W4A4 NVFP4 linear layer whose NVFP4 model gives ``t``.

        As for fp8, the measured rows time the activation quant (scaled_fp4_quant) before the GEMM, which compiled
        models fuse into the norm / SiLU-and-mul (vLLM's FlashInfer NVFP4 kernels take pre-quantized input). Where
        the NVFP4 model is transferred (a GPU never measured in FP4), the time is capped at the same GEMM's in fp8
        and in the 16-bit dtype, as a transferred fp8 GEMM is at the 16-bit one (``_fp8_linear_s``): fewer bytes at a
        higher peak are not slower, while the only FP4-measured kernel (FlashInfer's CUTLASS GEMM on the RTX PRO
        6000) carries a k-proportional floor at small n (~21 µs at k = 4096 for any n ≤ 4096, m ≤ 256: one CTA's
        k-loop, no split-K) that nothing says the target's kernel shares."""
        t -= self._fused_quant_saving_s(k)
        if not self._nvfp4_measured:
            m, n, kk = (int(x) for x in k.features[:3])
            a = self.precision.act_bytes
            fp8 = K.gemm_kernel(k.name, m, n, kk, "fp8", 1.0, a) if self._fp8_tc else None
            bf16 = K.gemm_kernel(k.name, m, n, kk, self.precision.act_dtype, a, a)
            t = min(t, *(self.kernel_time_s(x) for x in (fp8, bf16) if x is not None))
        return t

    def _fused_quant_saving_s(self, k: Kernel) -> float:
        """Fixed latency a quantized linear layer's model carries in excess of the bf16 GEMM's at its shape, when its
        activation quant is fused into the kernel before it (CUDA graphs / compiled: qkv, gate_up, down); else 0."""
        if k.name not in _QUANT_FUSED_INPUTS or self.config.enforce_eager:
            return 0.0
        f1 = eta_lookup_features(K.GEMM, k.features)
        f0 = f1[:3] + (float(K.GEMM_FORMAT_CODES["bf16"]),)
        return max(self.calib.kernel_overhead_s(K.GEMM, f1) - self.calib.kernel_overhead_s(K.GEMM, f0), 0.0)

    def _fp8_linear_s(self, k: Kernel, t: float) -> float:
        """One launch of a W8A8 linear layer whose per-tensor fp8 model gives ``t``, as the kernel vLLM runs.

        Block-scaled kernels: the shared block tables time eager dispatch, a host floor of 55-300 µs per call that
        the fitted block model carries as its fixed latency and that CUDA graphs remove. Where the GPU's own block
        model puts a shape well above that floor (≥ 3×: GPU-bound, where it is 1-3% off the rows) it prices the
        kernel; below 2× the floor the per-tensor model times the kernel's GPU-bound ratio to it does
        (``gemm_dispatch.BLOCK_FP8_TIME_RATIO``, by which fp8 roof binds); in between they blend geometrically, so
        the time stays continuous in m.

        Where the kernel's GPU time was not measured on this GPU (a transferred table; a block kernel below its
        floor) and the GPU has FP8 tensor cores, that fallback is capped at the same GEMM's time in the 16-bit dtype:
        half the weight bytes at twice the peak are not slower, and the per-tensor model would otherwise carry the
        measured CUTLASS kernel's own tile-config steps (H100: 1.3-1.5x bf16 for m 129-256 at n 2560) onto kernels
        that do not have them. The caller floors the result at the kernel's roofline: in a forward pass each layer's
        weights come from DRAM, while the L40S fp8 tables (96 MB L2) timed weights of up to ~13 MB faster than DRAM
        delivers them (0.6-0.8x the roof).
        """
        # The table rows time vLLM's linear op eagerly: the activation-quant kernel, then the GEMM (fp8 rows are
        # ~2.4 us slower than bf16 at tiny shapes on all three GPUs measured, one launch). Compiled models fuse
        # that quant into the RMSNorm / SiLU-and-mul before these layers, so the fp8 model's fixed latency in
        # excess of the bf16 GEMM's is not paid there (o_proj's input comes from attention: not fused).
        if k.name in _QUANT_FUSED_INPUTS and not self.config.enforce_eager:
            t -= self._fused_quant_saving_s(k)
        block = k.impl in BLOCK_KERNELS
        if block:
            wave_u = math.ceil(max(k.tiles, 1) / self.hw.num_sms) * self.hw.num_sms / max(k.tiles, 1)
            compute_bound = (k.flops * wave_u / self.hw.peak_flops_per_s("fp8")
                             >= k.bytes_moved / self.hw.usable_mem_bytes_per_s)
            t *= block_time_ratio(k.impl, compute_bound)
        if self._fp8_tc and (block or not self._fp8_measured):
            m, n, kk = (int(x) for x in k.features[:3])
            a = self.precision.act_bytes
            twin = K.gemm_kernel(k.name, m, n, kk, self.precision.act_dtype, a, a)
            t = min(t, self.kernel_time_s(twin))
        if block and self._block_measured:
            features = eta_lookup_features(K.GEMM, k.features[:3] + (float(K.GEMM_FORMAT_CODES["fp8_block"]),))
            floor_s = self.calib.kernel_overhead_s(K.GEMM, features)
            roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, self.hw)
            own = roof / self.calib.kernel_eta(K.GEMM, features) + floor_s
            if floor_s > 0 and own > _GPU_BOUND_LO * floor_s:
                w = min(math.log(own / (_GPU_BOUND_LO * floor_s)) / math.log(_GPU_BOUND_HI / _GPU_BOUND_LO), 1.0)
                t = math.exp(w * math.log(own) + (1.0 - w) * math.log(t))
        return t

    # -- graph mode and padding --------------------------------------------------------------------
    def graph_mode(self, batch: BatchShape) -> tuple[str, int]:
        """(mode, padded token rows). Decode-only batches replay a full graph, mixed ones piecewise."""
        return self._graph_mode(batch.num_tokens, batch.is_decode_only)

    def _graph_mode(self, m: int, decode_only: bool) -> tuple[str, int]:
        capture = self._capture
        if self.config.enforce_eager or not capture or m > capture[-1]:
            return EAGER, m
        return (FULL_GRAPH if decode_only else PIECEWISE), capture[bisect.bisect_left(capture, m)]

    # -- the cached token-parallel part -------------------------------------------------------------
    def _token_part(self, m_padded: int, sampling_rows: int) -> tuple[np.ndarray, float]:
        """(seconds per family, their sum) of everything but attention, launch and host: cached per row
        count and per sampling-row count separately (mixed steps vary both, each takes few values)."""
        rows = self._row_cache.get(m_padded)
        if rows is None:
            arr = np.zeros(self._n_families)
            c = self.config
            for k in K.row_kernels(self.model, m_padded, c.tp, self.precision, c.expert_routing, c.moe_ep_size,
                                   c.expert_load_imbalance):
                arr[FAMILY_INDEX[k.family]] += self.kernel_time_s(k)
            tp = self.config.tp
            if tp > 1:
                msg = K.allreduce_message_bytes(self.model, m_padded, self.precision)
                # the implementation vLLM dispatches to (custom / symmetric memory / NCCL), at its in-graph GPU
                # time in every mode: an eager step's host cost of each launch is in the launch term already
                arr[FAMILY_INDEX[K.ALL_REDUCE]] = (K.allreduces_per_step(self.model)
                                                   * allreduce_s(msg, tp, self.hw, self.calib.comm,
                                                                 custom_all_reduce=self.config.custom_all_reduce))
            rows = self._row_cache[m_padded] = (arr, float(arr.sum()))
        samp = self._sampling_cache.get(sampling_rows)
        if samp is None:
            arr = np.zeros(self._n_families)
            for k in K.sampling_kernels(self.model, sampling_rows, self.config.tp, self.precision):
                arr[FAMILY_INDEX[k.family]] += self.kernel_time_s(k)
            samp = self._sampling_cache[sampling_rows] = (arr, float(arr.sum()))
        return rows[0] + samp[0], rows[1] + samp[1]

    def _launch_s(self, mode: str, gpu_s: float, extra_cpu_s: float = 0.0) -> float:
        """CPU launch time not hidden behind GPU work (launches run ahead of the GPU asynchronously);
        ``extra_cpu_s``: host work of ops run outside the graphs beyond their launches (measured MLA ops)."""
        lm = self.calib.launch
        if mode == FULL_GRAPH:
            return lm.full_graph_step_s
        if mode == PIECEWISE:
            cpu_s = lm.piecewise_per_layer_s * self.model.num_layers
        else:
            cpu_s = lm.eager_per_kernel_s * self.model.num_layers * 14
        return max(cpu_s + extra_cpu_s - gpu_s, 0.0) + lm.full_graph_step_s

    # -- public step API ----------------------------------------------------------------------------
    def breakdown_s(self, batch: BatchShape) -> np.ndarray:
        """Seconds per family (ordered as ``kernels.FAMILIES``) for one step."""
        return self.step(batch)[0]

    def step(self, batch: BatchShape) -> tuple[np.ndarray, float]:
        """(seconds per family, total seconds) of one step: the engine's hot path, no array reductions."""
        # the batch's counts once here, not through its properties (each re-sums the prefill chunks)
        prefills, num_decodes = batch.prefills, batch.num_decodes
        num_tokens = sampling_rows = num_decodes
        for p in prefills:
            num_tokens += p.num_new_tokens
            if p.samples:
                sampling_rows += 1
        mode, m_padded = self._graph_mode(num_tokens, not prefills)
        out, base_s = self._token_part(m_padded, sampling_rows)
        attn_s = 0.0
        if prefills:
            t = self._prefill_attention_s(prefills)
            out[_I_ATTN_PREFILL] += t
            attn_s += t
        if num_decodes:
            t = self._decode_attention_s(num_decodes, batch.decode_context_tokens, batch.decode_context_top,
                                         bool(prefills))
            out[_I_ATTN_DECODE] += t
            attn_s += t
        if batch.encoder_items:
            # items given as embeddings (no patches) hold encoder-cache slots but run no encoder kernel
            encoded = tuple(it for it in batch.encoder_items if it.encoder_seq_lens)
            if encoded:
                t = self.encoder_pass_s(encoded)
                out[_I_ENCODER] += t
                attn_s += t
        extra = (self.mla_host_s(prefills, num_decodes, batch.decode_context_tokens)
                 if self.mla_families and mode != FULL_GRAPH else 0.0)
        return self._finish(out, base_s + attn_s, mode, num_decodes + len(prefills), num_tokens, extra)

    def _decode_step(self, num_decodes: int, context_tokens: int, top: tuple[int, ...]) -> tuple[np.ndarray, float]:
        """:meth:`step` of a decode-only batch of ``num_decodes`` > 0 sequences, without building one: the same
        operations in the same order (a decode window's first step)."""
        mode, m_padded = self._graph_mode(num_decodes, True)
        out, base_s = self._token_part(m_padded, num_decodes)
        attn_s = 0.0
        t = self._decode_attention_s(num_decodes, context_tokens, top, False)
        out[_I_ATTN_DECODE] += t
        attn_s += t
        extra = self.mla_host_s((), num_decodes, context_tokens) if self.mla_families and mode != FULL_GRAPH else 0.0
        return self._finish(out, base_s + attn_s, mode, num_decodes, num_decodes, extra)

    def _finish(self, out: np.ndarray, kernels_s: float, mode: str, num_seqs: int, num_tokens: int,
                extra_cpu_s: float = 0.0) -> tuple[np.ndarray, float]:
        """Add the exposed launch and host time to a step whose kernels (and collectives) take kernels_s
        (``extra_cpu_s``: see :meth:`_launch_s`)."""
        launch_s = self._launch_s(mode, kernels_s, extra_cpu_s)
        gpu_s = kernels_s + launch_s
        host = self.calib.host
        host_s = host.exposed_s(host.cpu_s(num_seqs, num_tokens), gpu_s, self.config.async_scheduling)
        out[_I_LAUNCH] = launch_s
        out[_I_HOST] = host_s
        return out, gpu_s + host_s

    # -- the vision encoder ----------------------------------------------------------------------------
    def encoder_kernels(self, items: tuple) -> list[Kernel]:
        """The kernels of one batched encoder pass over ``items`` (``vision_encoder.encoder_kernels``), their
        attention in the calibration's ``attn_encoder`` family, or as prefill attention where it has none."""
        vision = self.model.vision
        if vision is None:
            raise ValueError(f"model {self.model.name!r} has no vision encoder")
        ks = encoder_kernels(vision, items, self.config.tp)
        if K.ATTN_ENCODER not in self.calib.eta:
            ks = [dataclasses.replace(k, family=K.ATTN_PREFILL) if k.family == K.ATTN_ENCODER else k for k in ks]
        return ks

    def encoder_pass_s(self, items: tuple) -> float:
        """One batched encoder pass over ``items``: its kernels, its all-reduces under TP, and the eager launches
        the GPU does not hide (vLLM runs the encoder outside CUDA graphs). Memoized on the items' shapes."""
        key = tuple((it.encoder_seq_lens, it.grid_thw) for it in items)
        memo = self._encoder_memo
        t = memo.get(key)
        if t is None:
            gpu_s = sum(self.kernel_time_s(k) for k in self.encoder_kernels(items))
            tp = self.config.tp
            if tp > 1:
                n, msg = encoder_allreduces(self.model.vision, items)  # type: ignore[arg-type]
                gpu_s += n * allreduce_s(msg, tp, self.hw, self.calib.comm,
                                         custom_all_reduce=self.config.custom_all_reduce)
            cpu_s = self.calib.launch.eager_per_kernel_s * encoder_kernel_launches(self.model.vision)  # type: ignore[arg-type]
            t = gpu_s + max(cpu_s - gpu_s, 0.0)
            if len(memo) > 10_000:
                memo.clear()
            memo[key] = t
        return t

    def encoder_roofline_s(self, items: tuple) -> float:
        """The encoder pass's roofline bound: Σ over its kernels of max(FLOPs / peak, bytes / bandwidth)."""
        return sum(kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, self.hw) * k.count
                   for k in self.encoder_kernels(items))

    def _prefill_attention_s(self, prefills: tuple[PrefillChunk, ...]) -> float:
        """Prefill attention time, memoized on the chunks' exact (new, cached) token counts: the kernel is a
        function of those alone, and a workload's prompt lengths repeat (a random dataset's ~200 lengths)."""
        key = tuple([(c.num_new_tokens, c.num_cached_tokens) for c in prefills])
        t = self._prefill_attn_memo.get(key)
        if t is None:
            if len(self._prefill_attn_memo) > 100_000:   # bounded: mixed batches make many distinct keys
                self._prefill_attn_memo.clear()
            if self._generic_attention:
                ks = K.attention_kernels(self.model, BatchShape(prefills), self.config.tp, self.precision,
                                         self.mla_families)
                t = sum(self.kernel_time_s(k) for k in ks)
                if K.MLA_PREFILL in self.mla_families:   # the op's host work is the launch term's (mla_host_s)
                    t -= self._mla_excess_s(ks[-1], prefill_composed_kernel(self.model, prefills, self.config.tp,
                                                                            self.precision)) * self.model.num_layers
            else:
                t = self.kernel_time_s(self._prefill_attention_kernel(BatchShape(prefills)))
            self._prefill_attn_memo[key] = t
        return t

    def _prefill_attention_kernel(self, batch: BatchShape) -> Kernel:
        m, tp, p = self.model, self.config.tp, self.precision
        return K.attention_prefill_kernel(batch.prefills, m.num_attention_heads // tp, max(m.num_kv_heads // tp, 1),
                                          m.head_dim, p.act_bytes, p.kv_bytes_per_element, m.sliding_window,
                                          m.num_layers)

    def _decode_attention_s(self, num_decodes: int, context_tokens: int, top: tuple[int, ...] = (),
                            mixed: bool = False) -> float:
        """Decode attention of one step, all layers: the calibrated kernel (``_decode_eta_s``), no faster than a
        serving step streams the KV cache (``_decode_stream_s``; ``top``: the longest contexts, longest first;
        ``mixed``: the step also prefills)."""
        if self._generic_attention:
            ks = K.attention_kernels(self.model, BatchShape((), num_decodes, context_tokens), self.config.tp,
                                     self.precision, self.mla_families)
            t = sum(self.kernel_time_s(k) for k in ks)
            if K.MLA_DECODE in self.mla_families:   # the op's host work is the launch term's (mla_host_s)
                t -= self._mla_decode_excess_s(num_decodes, context_tokens) * self.model.num_layers
            return t
        t = self._decode_eta_s(num_decodes, context_tokens)
        if self._decode_cold_bw:
            t = max(t, self._decode_stream_s(num_decodes, context_tokens, top, mixed))
        return t * self._decode_consts[10]

    # -- measured MLA: the eager op's host work ---------------------------------------------------------
    def _mla_excess_s(self, k: Kernel, composed: list[Kernel]) -> float:
        """Per layer, the part of a measured MLA family's fixed latency that is the op's host work, not GPU time.

        The module tables time vLLM's MLA attention op eagerly. At their smallest shapes (1-2 sequences, a few
        tokens, 1-32 heads) the op's residual is, median over the rows, 54 µs (H100, FLASH_ATTN_MLA) and 78 µs
        (FlashMLA, fp8 KV), 23 µs (L40S, Triton MLA), 31-36 µs (RTX PRO 6000, Triton MLA) and 37-39 µs (its 0.19
        stack), nearly flat in the heads; the calibration's own fixed latencies of the kernels the op launches (the
        decode attention kernel and the two bf16 bmms: ``composed``) sum to 12-21 µs there. The rest (metadata,
        splits, Python: ~3 µs a launch) runs on the CPU: so the op's GPU time keeps the composed kernels' fixed
        latency (as every other kernel keeps its per-kernel one) and the excess goes to the launch term
        (`mla_host_s`), where it counts only when the CPU is behind the GPU; a full CUDA graph replays the op
        without it. Never more than the kernel holds above its roofline."""
        own = self.calib.kernel_eta_overhead_s(k.family, eta_lookup_features(k.family, k.features))[1]
        fixed = sum(self.calib.kernel_eta_overhead_s(c.family, eta_lookup_features(c.family, c.features))[1]
                    for c in composed)
        roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, self.hw)
        return max(min(own - fixed, self.kernel_time_s(k) / k.count - roof), 0.0)

    def _mla_decode_excess_s(self, num_decodes: int, context_tokens: int) -> float:
        """:meth:`_mla_excess_s` of the decode op, memoized per (batch, snapped mean context)."""
        key = (num_decodes, _snap_log(context_tokens / max(num_decodes, 1)))
        hit = self._mla_excess_memo.get(key)
        if hit is None:
            m, tp, p = self.model, self.config.tp, self.precision
            (k,) = K.mla_decode_kernels(m, num_decodes, context_tokens, tp, p, 1, measured=True)
            hit = self._mla_excess_s(k, K.mla_decode_kernels(m, num_decodes, context_tokens, tp, p, 1))
            if len(self._mla_excess_memo) > 100_000:
                self._mla_excess_memo.clear()
            self._mla_excess_memo[key] = hit
        return hit

    def mla_host_s(self, prefills: tuple[PrefillChunk, ...], num_decodes: int, context_tokens: int) -> float:
        """CPU time of a step's measured MLA ops beyond their kernels' launches, all layers (0 without them): what
        an op run outside a full CUDA graph adds to the launch term."""
        out = 0.0
        if prefills and K.MLA_PREFILL in self.mla_families:
            key = tuple([(c.num_new_tokens, c.num_cached_tokens) for c in prefills])
            hit = self._mla_prefill_host_memo.get(key)
            if hit is None:
                (k,) = [k for k in K.attention_kernels(self.model, BatchShape(prefills), self.config.tp,
                                                       self.precision, self.mla_families) if k.family == K.MLA_PREFILL]
                hit = self._mla_excess_s(k, prefill_composed_kernel(self.model, prefills, self.config.tp,
                                                                    self.precision))
                if len(self._mla_prefill_host_memo) > 100_000:
                    self._mla_prefill_host_memo.clear()
                self._mla_prefill_host_memo[key] = hit
            out += hit
        if num_decodes and K.MLA_DECODE in self.mla_families:
            out += self._mla_decode_excess_s(num_decodes, context_tokens)
        return out * self.model.num_layers

    def _decode_eta_s(self, num_decodes: int, context_tokens: int) -> float:
        """One layer's decode attention as calibrated: ``kernel_time_s`` of ``attention_decode_kernel``, specialised.

        It runs for every step and twice per decode window, so η is memoized per (batch, snapped mean
        context) and the roofline is evaluated inline (the same expressions, constants read once in
        ``_decode_consts``); the result equals the generic path's.
        """
        key = (num_decodes, _snap_log(context_tokens / max(num_decodes, 1)))
        hit = self._decode_eta.get(key)
        if hit is None:
            m, tp, p = self.model, self.config.tp, self.precision
            k = K.attention_decode_kernel(num_decodes, context_tokens, m.num_attention_heads // tp,
                                          max(m.num_kv_heads // tp, 1), m.head_dim, p.act_bytes,
                                          p.kv_bytes_per_element, m.num_layers, m.sliding_window)
            features = eta_lookup_features(k.family, k.features)
            hit = self.calib.kernel_eta_overhead_s(k.family, features)
            self._decode_eta[key] = hit
        eta, overhead_s = hit
        q_heads, kv_heads, d, kv_bytes, act_bytes, window, n_sm, peak, mem_bw, mha, layers = self._decode_consts
        ctx = context_tokens
        if window and num_decodes:
            ctx = int(min(ctx, num_decodes * window))
        flops = 4.0 * q_heads * d * ctx
        per_batch = self._decode_batch_terms.get(num_decodes)
        if per_batch is None:
            # what depends on the batch size alone: the query bytes and the last wave's utilisation
            tiles = float(max(num_decodes * q_heads, 1))
            per_batch = self._decode_batch_terms[num_decodes] = (2.0 * num_decodes * q_heads * d * act_bytes,
                                                                 math.ceil(tiles / n_sm) * n_sm / tiles)
        q_bytes, wave_u = per_batch
        bytes_moved = ctx * 2.0 * kv_heads * d * kv_bytes + q_bytes
        roof = max(flops * wave_u / peak, bytes_moved / mem_bw)
        t = max(roof / eta + overhead_s, (bytes_moved - self._l2_bytes) / mem_bw)     # as kernel_time_s
        if mha and self.calib.decode_cta_bytes_per_s:     # GQA models never take the unsplit path
            t = max(t, self.calib.decode_floor_s(
                (num_decodes, context_tokens / max(num_decodes, 1), q_heads, kv_heads, d, kv_bytes, window or 0), n_sm))
        return t

    def _cold_decode_bytes_per_s(self) -> float:
        """KV bytes per second the calibrated decode kernel streams from DRAM: its model at 128 sequences of at
        least 2,048 tokens whose KV cache is at least 8x the L2 (the tables time one layer's KV cache again and
        again, L2-warm up to the L2 size). 128 sequences: a batch the tables measure at such lengths (their batches
        of 256 stop at 1,024 tokens; the model extrapolated to 256 x 2,048 read 6% faster than any measured row of
        that size, RTX PRO 6000: 1.56 TB/s against 1.47-1.51)."""
        q_heads, kv_heads, d, kv_bytes = self._decode_consts[:4]
        per_token = 2.0 * kv_heads * d * kv_bytes
        b = _COLD_DECODE_BATCH
        ctx_per_seq = max(2048, math.ceil(8.0 * max(self.hw.l2_bytes, 1) / (b * per_token)))
        self._decode_cold_ref_bytes = b * ctx_per_seq * per_token
        t = self._decode_eta_s(b, b * ctx_per_seq)
        return self._decode_cold_ref_bytes / t if t > 0 else 0.0

    def _graph_split_tokens(self, num_decodes: int) -> int | None:
        """Tokens each split-KV CTA covers when a decode-only batch replays a full CUDA graph, or None (eager).

        vLLM captures its decode graphs with every sequence at max_model_len, and FlashAttention-2 fixes the split
        count (``num_splits_heuristic`` at the padded batch) and the split size (max_seqlen_k / splits) on the host
        at capture: a replay keeps both, so a context shorter than one split is streamed by one CTA per KV head,
        whatever the batch (the tables time eager calls, split by the row's own length)."""
        if num_decodes in self._graph_split:
            return self._graph_split[num_decodes]
        mode, padded = self._graph_mode(num_decodes, True)
        out = None
        if mode == FULL_GRAPH:
            max_len = self.config.max_model_len or self.model.max_position_embeddings
            n_blocks = -(-max_len // self._fa2_block_n)
            splits = fa2_num_splits(padded * self._decode_consts[1], 2 * self.hw.num_sms, n_blocks)
            out = -(-n_blocks // splits) * self._fa2_block_n
        self._graph_split[num_decodes] = out
        return out

    def _decode_stream_s(self, num_decodes: int, context_tokens: int, top: tuple[int, ...], mixed: bool) -> float:
        """Least time of one layer's decode attention in a serving step: the KV cache read from DRAM, and on the
        unsplit path the longest contexts streamed by lone CTAs.

        A step streams every layer's weights and KV cache between two reads of one layer's KV cache, so it comes
        from DRAM, at the bandwidth the kernel reaches beyond the L2 (``_cold_decode_bytes_per_s``): the tables are
        L2-warm below the L2 size (e.g. 2.2-2.7 TB/s on the RTX PRO 6000's 1.79 TB/s GDDR7).

        FlashAttention-2 (vLLM on Ampere, Ada, sm_12x) packs a GQA group's queries into one CTA per (sequence, KV
        head) and splits the KV cache by its ``num_splits_heuristic``; each CTA streams its share at no more than
        one CTA's bandwidth (``decode_cta_bytes_per_s``, measured on the tables' unsplit rows). How the cache is
        split depends on how the kernel runs:

        * a decode-only batch in a full CUDA graph replays the split size fixed at capture, from max_model_len
          (``_graph_split_tokens``): shorter contexts are not split at all;
        * eager (or beyond the captured sizes), the kernel splits by the batch's own longest context while its CTAs
          fill less than 80% of two per SM, and never beyond: the tables' case; a split batch is taken as balanced;
        * a step that also prefills runs its decodes in the prefill's varlen kernel: query length > 1, so never
          split (nor packed: one CTA per query head, a group's query heads reading their KV head's context through
          the L2, so a sequence draws the same DRAM bandwidth and each CTA streams a whole context, as packed).

        The tables time equal contexts; a serving batch's differ, and once fewer CTAs than bandwidth / CTA bandwidth
        are left, the longest stream at that rate. With every CTA advancing at min(c, B/n) (n CTAs left), the
        kernel takes Σbytes/B + p·Σ_j (s_j − s_j+1)·max(0, 1/c − j·h/B) over the streams s_1 ≥ s_2 ≥ ... (each split
        of a context a stream; p bytes per token and KV head, h KV heads): only the longest ``decode_top_k``
        contexts matter.
        """
        kv_heads, d, kv_bytes = self._decode_consts[1:4]
        bw = self._decode_cold_bw
        per_token = 2.0 * d * kv_bytes
        layer_bytes = context_tokens * per_token * kv_heads
        if layer_bytes > self._decode_cold_ref_bytes:
            # a cache larger than the reference: the kernel's model is cold there too, and its fixed time weighs less
            b = _COLD_DECODE_BATCH
            t_ref = self._decode_eta_s(b, b * math.ceil(context_tokens / b))
            bw = max(bw, layer_bytes / t_ref) if t_ref > 0 else bw
        t = layer_bytes / bw
        cta_bw = self._decode_cta_bw
        if not (cta_bw and top):
            return t
        if mixed:
            split = None
        else:
            split = self._graph_split_tokens(num_decodes)
            if split is None and num_decodes * kv_heads < _FA2_UNSPLIT_CTAS_PER_SM * self.hw.num_sms:
                return t              # eager and split: balanced, as the tables time it
        complete = len(top) >= num_decodes
        if split is not None and top[0] > split:
            # each context's splits are streams of their own: whole splits first, then the remainders; without
            # every context, a remainder shorter than the shortest one known may rank below an unknown context
            whole = sum(c // split for c in top)
            rest = sorted((c % split for c in top if c % split), reverse=True)
            if not complete:
                rest = [r for r in rest if r >= top[-1]]
            top = (split,) * whole + tuple(rest)
        inv_c = 1.0 / cta_bw
        n = len(top)
        for j in range(1, n + 1):
            gap = inv_c - j * kv_heads / bw
            if gap <= 0.0:
                break
            if j < n:
                nxt = top[j]
            elif complete:
                nxt = 0
            else:
                break             # the next context is not known (a shorter list than decode_top_k)
            t += (top[j - 1] - nxt) * per_token * gap
        return t

    def step_time_s(self, batch: BatchShape) -> float:
        return self.step(batch)[1]

    def breakdown_dict(self, batch: BatchShape) -> dict[str, float]:
        return dict(zip(FAMILIES, self.breakdown_s(batch).tolist(), strict=True))

    def decode_window(self, num_decodes: int, context_tokens_start: int, num_steps: int,
                      top: tuple[int, ...] = ()) -> tuple[list[float], np.ndarray]:
        """Durations of ``num_steps`` consecutive decode-only steps of the same ``num_decodes`` requests.

        Each step every request's context grows by one token. Attention time is exact at the first and
        last step and linear in between (it is linear in context bytes; η varies slowly over a window).
        ``top``: the longest contexts at the first step (``BatchShape.decode_context_top``).
        Returns (per-step seconds, summed breakdown per family).
        """
        # The engine often asks again for a shorter window from the same start (cut at an arrival or by the KV
        # cache): the first step is then the same computation, kept from the last call.
        key = (num_decodes, context_tokens_start, top)
        if self._window_first[0] == key:
            b0, t0 = self._window_first[1]  # type: ignore[misc]
        else:
            if num_decodes and type(self).step is StepModel.step:
                b0, t0 = self._decode_step(num_decodes, context_tokens_start, top)
            else:     # a subclass's own step (a lockstep rank records its batch) sees the batch
                b0, t0 = self.step(BatchShape((), num_decodes, context_tokens_start, decode_context_top=top))
            self._window_first = (key, (b0, t0))
        if num_steps == 1:
            return [t0], b0.copy()
        # only attention (and with it the exposed launch/host time) changes along the window
        ctx_last = context_tokens_start + (num_steps - 1) * num_decodes
        attn0 = b0[_I_ATTN_DECODE]
        top_last = tuple(c + num_steps - 1 for c in top) if top else top
        attn1 = self._decode_attention_s(num_decodes, ctx_last, top_last)
        kernels1 = t0 - b0[_I_LAUNCH] - b0[_I_HOST] - attn0 + attn1
        mode = self._graph_mode(num_decodes, True)[0]
        extra = self.mla_host_s((), num_decodes, ctx_last) if self.mla_families and mode != FULL_GRAPH else 0.0
        b1, t1 = self._finish(b0.copy(), kernels1, mode, num_decodes, num_decodes, extra)
        b1[_I_ATTN_DECODE] = attn1
        slope = (t1 - t0) / (num_steps - 1)
        durations = [t0 + slope * i for i in range(num_steps)]   # windows are short: lists beat arrays
        return durations, (b0 + b1) * (num_steps / 2.0)
