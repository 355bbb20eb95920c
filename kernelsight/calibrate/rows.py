"""Measured kernel rows as the step model's kernels, and what a calibration predicts for them.

Each measured row (a GEMM, prefill or decode attention shape of the measurement schema) is mapped onto the same
:class:`~kernelsight.simcore.kernels.Kernel` the step model builds (so calibration and simulation share FLOPs,
bytes and tiles), giving its roofline time on a GPU. The row-level predictions here (``kernel_s = roof_s / η +
overhead_s``, vectorized over a table, with the decode floor) are what ``calibrate predict`` and ``calibrate eval``
report and what the fitter judges a prior by; the step model prices one kernel at a time through
:class:`~kernelsight.simcore.calibration.Calibration` and gets the same numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kernelsight.simcore import kernels as K
from kernelsight.simcore.calibration import Calibration
from kernelsight.simcore.eta import (
    DispatchEta,
    EnsembleEta,
    LogPolyEta,
    SwitchEta,
    decode_serial_floor_s,
    fitted_gemm_nk,
    switch_key,
)
from kernelsight.simcore.fp4_dispatch import NVFP4, NVFP4_BYTES_PER_ELEMENT
from kernelsight.simcore.hardware import HardwareSpec
from kernelsight.simcore.mla import mla_decode_attention_kernel, mla_prefill_attention_kernel
from kernelsight.simcore.model_spec import MLASpec
from kernelsight.simcore.roofline import roofline_s

Columns = Mapping[str, np.ndarray]

#: The MLA shape of the shared module tables' model (DeepSeek-V3; Kimi K2 and R1 share it): the ranks, not the
#: heads, which each row gives.
MLA_TABLE_SPEC = MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128)

KERNEL_FAMILIES: tuple[str, ...] = ("gemm", "attn_prefill", "attn_decode", "moe_gemm", "attn_encoder")
#: vLLM's MLA attention op (``simcore.mla``): rows come from the module tables less the module's other kernels
#: (``calibrate.mla_tables``), never from a measurement folder's own family files.
MLA_FAMILIES: tuple[str, ...] = ("mla_prefill", "mla_decode")
#: Bytes per element of the dtype names a measurement's ``kv_dtype`` may hold ("auto": vLLM's name for the model's
#: own 16-bit dtype).
ELEMENT_BYTES = {
    "auto": 2.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "half": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "int8": 1.0,
    "fp32": 4.0,
    "float": 4.0,
}
#: Which feature selects the sub-model (categorical variant) per family.
SWITCH_INDEX = {"gemm": 3, "attn_prefill": 6, "attn_decode": 5, "moe_gemm": 4, "attn_encoder": 6, "mla_prefill": 6,
                "mla_decode": 5}


# ------------------------------------------------------------------------------------------------
# measured rows → kernels
# ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class KernelRows:
    """Per-row kernel quantities of one family (vectors of equal length)."""

    family: str
    flops: np.ndarray
    bytes_moved: np.ndarray
    tiles: np.ndarray
    compute_dtype: np.ndarray  # str
    features: np.ndarray  # rows × nf
    variant: np.ndarray  # str: sub-model key (switch_key of the categorical feature)
    kernel: np.ndarray | None = None  # str: the vLLM kernel that ran (``kernel`` column), when known

    def __len__(self) -> int:
        return len(self.flops)


def gemm_weight_bytes(dtype: str) -> float:
    """Weight bytes per parameter of a measured GEMM format: 16-bit, 8-bit (fp8, fp8_block, int8), or NVFP4's packed
    4-bit values with an FP8 scale per 16 (``fp4_dispatch.NVFP4_BYTES_PER_ELEMENT``)."""
    if dtype == NVFP4:
        return NVFP4_BYTES_PER_ELEMENT
    return 2.0 if dtype in ("bf16", "fp16") else 1.0


def element_bytes(dtype: str) -> float:
    try:
        return ELEMENT_BYTES[dtype]
    except KeyError as exc:
        raise ValueError(f"unknown element dtype {dtype!r}") from exc


def _row_kernel(family: str, key: tuple) -> K.Kernel:
    if family == "gemm":
        dtype, m, n, k = key
        return K.gemm_kernel("gemm", int(m), int(n), int(k), dtype, gemm_weight_bytes(dtype), 2.0)
    if family == "attn_prefill":
        batch, seq, qh, kvh, hd, kv_dtype, window, *cached = key
        chunks = (K.PrefillChunk(int(seq), int(cached[0]) if cached else 0, True),) * int(batch)
        return K.attention_prefill_kernel(
            chunks, int(qh), int(kvh), int(hd), 2.0, element_bytes(kv_dtype), int(window) or None
        )
    if family == "attn_decode":
        batch, cached, qh, kvh, hd, kv_dtype, window = key
        return K.attention_decode_kernel(
            int(batch),
            int(batch) * (int(cached) + 1),
            int(qh),
            int(kvh),
            int(hd),
            2.0,
            element_bytes(kv_dtype),
            window=int(window) or None,
        )
    if family == "attn_encoder":
        batch, seq, heads, hd, dtype = key
        return K.attention_encoder_kernel(int(batch), int(seq), int(heads), int(hd), element_bytes(dtype))
    if family == "mla_decode":
        batch, ctx, heads, kv_dtype = key
        return mla_decode_attention_kernel(MLA_TABLE_SPEC, int(batch), int(batch) * int(ctx), int(heads), 2.0,
                                           element_bytes(kv_dtype))
    if family == "mla_prefill":
        batch, seq, heads, kv_dtype = key
        return mla_prefill_attention_kernel(MLA_TABLE_SPEC, (K.PrefillChunk(int(seq), 0, True),) * int(batch),
                                            int(heads), 2.0, element_bytes(kv_dtype), measured=True)
    if family == "moe_gemm":
        dtype, tokens, hidden, inter, topk, experts, tp, ep, distribution, *scope = key
        # the rank holds inter / tp of every expert (TP) or experts / ep whole experts (EP); the routing relation
        # gives its token-slots and touched experts, as for a serving step
        return K.fused_moe_kernel(int(tokens), int(hidden), int(inter) // max(int(tp), 1), int(topk), int(experts),
                                  dtype, int(ep), distribution, rank_tokens_only=scope == [RANK_TOKENS])
    raise ValueError(f"no kernel mapping for family {family!r}")


_KEY_COLUMNS = {
    "gemm": ("dtype", "m", "n", "k"),
    "attn_prefill": ("batch", "seq_len", "num_heads", "num_kv_heads", "head_dim", "kv_dtype", "window"),
    "attn_decode": ("batch", "cached_len", "num_heads", "num_kv_heads", "head_dim", "kv_dtype", "window"),
    "attn_encoder": ("batch", "seq_len", "num_heads", "head_dim", "dtype"),
    "moe_gemm": ("dtype", "num_tokens", "hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size",
                 "moe_ep_size", "distribution"),
    # the MLA op's rows (``calibrate.mla_tables``): sequences, tokens each attends (decode: cached + 1; prefill: its
    # new tokens, nothing cached), the rank's heads, the KV-cache dtype
    "mla_decode": ("batch", "context_len", "num_heads", "kv_dtype"),
    "mla_prefill": ("batch", "seq_len", "num_heads", "kv_dtype"),
}


#: Key columns a family's table may carry: the MoE tables' ``token_scope`` (see :data:`RANK_TOKENS`); a prefill
#: chunk's cached tokens (``cached_len``: a layer profile's rows).
_OPTIONAL_KEY_COLUMNS = {"moe_gemm": ("token_scope",), "attn_prefill": ("cached_len",)}
#: ``token_scope`` of MoE rows timed with only the tokens that picked the rank's experts entering the layer (the
#: measurement harness behind the shared A100 tables, vLLM 0.14: there the 8 picks of a lone token all land on
#: the timed rank — 223 µs at EP 8 against 219 µs at EP 1 —, where the 0.19 / 0.24 tables time every token
#: entering and only the rank's share of the picks computed — 37-56 µs).
RANK_TOKENS = "rank"


def kernel_rows(family: str, cols: Columns) -> KernelRows:
    """Map measured rows to kernels via the step model's constructors (deduplicated: shapes repeat).

    The ``kernel`` column (the vLLM kernel that ran), when present, is carried along as ``KernelRows.kernel``.
    """
    names = _KEY_COLUMNS[family] + tuple(c for c in _OPTIONAL_KEY_COLUMNS.get(family, ()) if c in cols)
    n = len(cols[names[0]])
    keys = list(zip(*(cols[c].tolist() for c in names), strict=True))
    uniq: dict[tuple, int] = {}
    inverse = np.empty(n, dtype=np.int64)
    for i, key in enumerate(keys):
        inverse[i] = uniq.setdefault(key, len(uniq))
    kernels = [_row_kernel(family, key) for key in uniq]
    if not kernels:
        nf = {"gemm": 4, "attn_prefill": 8, "attn_decode": 7, "moe_gemm": 9, "attn_encoder": 8, "mla_prefill": 8,
              "mla_decode": 7}[family]
        z = np.zeros(0)
        return KernelRows(family, z, z, z, np.zeros(0, dtype=str), np.zeros((0, nf)), np.zeros(0, dtype=str))
    flops = np.array([k.flops for k in kernels])[inverse]
    bytes_moved = np.array([k.bytes_moved for k in kernels])[inverse]
    tiles = np.array([k.tiles for k in kernels], dtype=float)[inverse]
    dtype = np.array([k.dtype for k in kernels])[inverse]
    feats = np.array([k.features for k in kernels], dtype=float)[inverse]
    variant = np.array([switch_key(f) for f in feats[:, SWITCH_INDEX[family]]]) if n else np.zeros(0, str)
    kernel = np.asarray(cols["kernel"]).astype(str) if "kernel" in cols else None
    return KernelRows(family, flops, bytes_moved, tiles, dtype, feats, variant, kernel)


def roofline_rows_s(rows: KernelRows, hw: HardwareSpec) -> np.ndarray:
    """Roofline seconds of every row on ``hw`` (per-row compute dtype peak)."""
    out = np.empty(len(rows))
    for dt in np.unique(rows.compute_dtype):
        sel = rows.compute_dtype == dt
        out[sel] = roofline_s(
            rows.flops[sel],
            rows.bytes_moved[sel],
            rows.tiles[sel],
            hw.peak_flops_per_s(str(dt)),
            hw.usable_mem_bytes_per_s,
            hw.num_sms,
        )
    return out


def take_rows(rows: KernelRows, sel: np.ndarray) -> KernelRows:
    """The rows where ``sel`` holds (a boolean mask or indices)."""
    return KernelRows(
        rows.family,
        rows.flops[sel],
        rows.bytes_moved[sel],
        rows.tiles[sel],
        rows.compute_dtype[sel],
        rows.features[sel],
        rows.variant[sel],
        None if rows.kernel is None else rows.kernel[sel],
    )


# ------------------------------------------------------------------------------------------------
# what a calibration predicts for measured rows
# ------------------------------------------------------------------------------------------------
def predict_rows_s(family: str, cols: Columns, hw: HardwareSpec, calib: Calibration) -> np.ndarray:
    """Predicted latency (s) of each measured row under a calibration (vectorized over variants)."""
    rows = kernel_rows(family, cols)
    return rows_time_s(calib, family, rows, roofline_rows_s(rows, hw), hw)


def rows_time_s(calib: Calibration, family: str, rows: KernelRows, roof_s: np.ndarray, hw: HardwareSpec
                ) -> np.ndarray:
    """Predicted latency (s) of kernel rows whose roofline times are ``roof_s``.

    GEMMs wider than any the calibration was fitted on take η at the widest (as the step model prices them)."""
    if family == "gemm" and len(rows):
        n_max, k_max = fitted_gemm_nk(calib.eta.get(family))
        if (rows.features[:, 1] > n_max).any() or (rows.features[:, 2] > k_max).any():
            features = rows.features.copy()
            features[:, 1] = np.minimum(features[:, 1], n_max)
            features[:, 2] = np.minimum(features[:, 2], k_max)
            rows = dataclasses.replace(rows, features=features)
    eta, ovh = eta_and_overhead(calib, family, rows)
    t = roof_s / eta + ovh
    if family == "attn_decode" and calib.decode_cta_bytes_per_s:
        t = np.maximum(t, decode_floor_rows_s(rows, hw, calib.decode_cta_bytes_per_s))
    return t


def decode_floor_rows_s(rows: KernelRows, hw: HardwareSpec, cta_bytes_per_s: Mapping[str, float]) -> np.ndarray:
    """``decode_serial_floor_s`` of every decode row (0 where its variant has no unsplit path)."""
    out = np.zeros(len(rows))
    for key, bw in cta_bytes_per_s.items():
        # only rows with one query head per KV head can take the path (a minority of a sweep)
        for i in np.flatnonzero((rows.variant == key) & (rows.features[:, 2] == rows.features[:, 3])):
            out[i] = decode_serial_floor_s(rows.features[i], hw.num_sms, bw)
    return out


def eta_and_overhead(calib: Calibration, family: str, rows: KernelRows) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized ``kernel_eta`` (clipped to [eta_floor, eta_max]) and ``kernel_overhead_s``.

    Where the calibration has per-kernel models, ``rows.kernel`` (when known) picks them; otherwise, and for
    kernel names it has no model of, its learned dispatch rule does.
    """
    model = calib.eta.get(family) or calib.eta["default"]
    eta = np.empty(len(rows))
    ovh = np.full(len(rows), calib.kernel_overhead_s(family))
    for v in np.unique(rows.variant) if len(rows) else []:
        sel = rows.variant == v
        sub = (
            model.pick(tuple(rows.features[np.flatnonzero(sel)[0]]))
            if isinstance(model, SwitchEta)
            else model
        )
        if isinstance(sub, DispatchEta):
            e, o = sub.eta_and_overhead_array(rows.features[sel], None if rows.kernel is None else rows.kernel[sel])
            eta[sel], ovh[sel] = e, o
        elif isinstance(sub, LogPolyEta | EnsembleEta):
            e, o = sub.eta_and_overhead_array(rows.features[sel])
            eta[sel] = e
            if not (isinstance(sub, LogPolyEta) and sub.overhead_s is None):
                ovh[sel] = o
        else:
            eta[sel] = [sub.eta(tuple(f)) for f in rows.features[sel]]
    return np.clip(eta, calib.eta_floor, calib.eta_max), ovh


__all__ = [
    "ELEMENT_BYTES",
    "KERNEL_FAMILIES",
    "MLA_FAMILIES",
    "MLA_TABLE_SPEC",
    "SWITCH_INDEX",
    "Columns",
    "KernelRows",
    "decode_floor_rows_s",
    "element_bytes",
    "gemm_weight_bytes",
    "eta_and_overhead",
    "kernel_rows",
    "predict_rows_s",
    "roofline_rows_s",
    "rows_time_s",
    "take_rows",
]
