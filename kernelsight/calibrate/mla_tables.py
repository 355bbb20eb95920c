"""The shared MLA module tables (``mla_context`` / ``mla_generation``) as rows of the MLA op's families.

A ``module`` row times DeepSeek-V3's whole attention module of one layer as vLLM runs it, eagerly: norms,
``fused_qkv_a_proj``, ``q_b_proj``, RoPE, the latent write, the attention op, ``o_proj`` (``simcore.mla``). The op's
own time is the row's latency less the module's other kernels (``mla_row_kernels``; a context row also
``kv_b_proj``, a linear layer of the checkpoint's format), each priced by the same GPU stack's calibration, eagerly
as the tables time them. Those residuals are the rows of ``mla_decode`` (generation) and ``mla_prefill`` (context),
fitted with the η machinery of :mod:`kernelsight.calibrate.fit.eta`.

Which rows describe serving. vLLM's CUDA platform picks the MLA backend by compute capability and KV dtype
(``simcore.mla.mla_decode_backend``). So H100 decodes with FLASH_ATTN_MLA (bf16 KV)
or FLASHMLA (fp8 KV), the L40S, the RTX PRO 6000 (SM 12.0) and the A100 with TRITON_MLA; the generation tables hold
exactly those. A prefill chunk takes the backend's decode path up to its decode threshold (vLLM's
``reorder_batch_threshold``) and the up-projected FlashAttention prefill above it: the context tables label each
shape by the path that ran (the backend's name for short chunks, ``FLASH_ATTN`` above), so every context row of the
folder's own backend or ``FLASH_ATTN`` is a serving row, and a folder whose rows name no backend (``default``: the
RTX PRO 6000 under 0.19) times vLLM's default everywhere. Rows of another backend, of an fp8 activation dtype or of
the older ``attention`` scope (the A100 tables, vLLM 0.14) are reported, not fitted. The fit takes the 16-bit-GEMM
rows (the op is the same kernel whatever the projections' format; those are the rows its neighbours are priced best
on); the quantized-GEMM rows are judged with it.
"""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kernelsight.calibrate.fit.eta import fit_family
from kernelsight.calibrate.rows import MLA_FAMILIES
from kernelsight.simcore.calibration import Calibration
from kernelsight.simcore.eta import DispatchEta, LogPolyEta, SwitchEta
from kernelsight.simcore.gemm_dispatch import BLOCK, DYNAMIC_GROUP, Fp8Scheme
from kernelsight.simcore.hardware import HardwareSpec
from kernelsight.simcore.kernel_shapes import Kernel, PrefillChunk
from kernelsight.simcore.mla import mla_decode_backend, mla_prefill_kernels, mla_row_kernels
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.precision import Precision, resolve_precision
from kernelsight.simcore.step_model import StepConfig, StepModel

#: The tables' model and its total heads (``num_heads`` is the rank's share: tp = 128 / num_heads).
MLA_TABLE_MODEL = "deepseek-ai/DeepSeek-V3"
MLA_TABLE_HEADS = 128
#: The tables' GEMM formats as vLLM quantizations (DeepSeek-V3's fp8 checkpoint: 128x128 weight blocks).
GEMM_QUANTIZATION = {"bf16": None, "fp8_block": "fp8", "nvfp4": "modelopt_fp4"}
#: The label of the up-projected FlashAttention prefill path in the context tables; a folder's label when its rows
#: name no backend.
PREFILL_PATH = "FLASH_ATTN"
DEFAULT_LABEL = "default"
#: Phase of each table → the family its residuals are rows of.
PHASE_FAMILY = {"generation": "mla_decode", "context": "mla_prefill"}


@dataclass(slots=True)
class MLARows:
    """One phase's module rows of a folder, with what the calibration prices around the op."""

    phase: str
    columns: dict[str, np.ndarray]      # the family's key columns + kernel, gemm_dtype, serving
    module_s: np.ndarray                # measured module latency
    others_s: np.ndarray                # the module's other kernels, priced

    @property
    def family(self) -> str:
        return PHASE_FAMILY[self.phase]

    @property
    def residual_s(self) -> np.ndarray:
        return self.module_s - self.others_s

    def subset(self, sel: np.ndarray) -> MLARows:
        return MLARows(self.phase, {k: v[sel] for k, v in self.columns.items()}, self.module_s[sel],
                       self.others_s[sel])

    def fit_columns(self, sel: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The family's columns with the op's residual as ``latency_us`` (rows ``sel``, default all)."""
        r = self if sel is None else self.subset(sel)
        cols = {k: v for k, v in r.columns.items() if k not in ("gemm_dtype", "serving")}
        cols["latency_us"] = r.residual_s * 1e6
        return cols


def _read(path: Path) -> list[dict[str, str]]:
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        return list(csv.DictReader(f))


#: ``mla_row_kernels``' kernels that belong to the decoder layer, not to its attention module (the tables time
#: the module: projections, norms of the latents, RoPE, the latent write, attention, o_proj).
OUTSIDE_MODULE = frozenset({"input_norm", "post_attention_norm"})


def module_other_kernels(model: ModelSpec, phase: str, batch: int, isl: int, tp: int, precision: Precision
                         ) -> list[Kernel]:
    """The kernels of one layer's MLA module around the attention op, for a row of ``batch`` sequences (context:
    ``isl`` new tokens each, and ``kv_b_proj`` over them; generation: one token each)."""
    m = batch * isl if phase == "context" else batch
    ks = [k for k in mla_row_kernels(model, m, tp, precision, 1) if k.name not in OUTSIDE_MODULE]
    if phase == "context":
        ks += mla_prefill_kernels(model, (PrefillChunk(isl, 0, True),) * batch, tp, precision, 1)[:1]   # kv_b_proj
    return ks


def read_mla_rows(folder: Path, phase: str, model: ModelSpec, hw: HardwareSpec, calib: Calibration) -> MLARows | None:
    """The ``module`` rows of ``folder``'s ``mla_<phase>`` table (16-bit activations), with the module's other
    kernels priced eagerly by ``calib`` and each row's ``serving`` flag; None without the table or such rows."""
    path = next((p for p in (folder / f"mla_{phase}.csv.gz", folder / f"mla_{phase}.csv") if p.is_file()), None)
    if path is None:
        return None
    rows = [r for r in _read(path) if r["scope"] == "module" and r["dtype"] == "bf16"
            and r["gemm_dtype"] in GEMM_QUANTIZATION]
    if not rows:
        return None
    models: dict[tuple[str, str, int], StepModel] = {}
    others = np.empty(len(rows))
    for i, r in enumerate(rows):
        g, kv, tp = r["gemm_dtype"], r["kv_dtype"], MLA_TABLE_HEADS // int(r["num_heads"])
        sm = models.get((g, kv, tp))
        if sm is None:
            scheme = Fp8Scheme(BLOCK, DYNAMIC_GROUP, 128, 128) if g == "fp8_block" else None
            prec = resolve_precision("bfloat16", GEMM_QUANTIZATION[g], "fp8" if kv == "fp8" else "auto", scheme,
                                     hw.compute_capability)
            sm = models[(g, kv, tp)] = StepModel(model, hw, calib, prec, StepConfig(tp=tp, enforce_eager=True))
        b = int(r["batch"])
        others[i] = sum(sm.kernel_time_s(k) for k in module_other_kernels(model, phase, b, int(r["isl"]), tp,
                                                                           sm.precision))
    kernel = np.array([r["kernel"] for r in rows])
    kv = np.array([r["kv_dtype"] for r in rows])
    backend = np.array([mla_decode_backend(hw.compute_capability, k) for k in kv])
    serving = (kernel == backend) | (kernel == DEFAULT_LABEL)
    if phase == "context":
        serving |= kernel == PREFILL_PATH
    cols = {"batch": np.array([float(r["batch"]) for r in rows]),
            "num_heads": np.array([float(r["num_heads"]) for r in rows]),
            "kv_dtype": kv, "kernel": kernel, "gemm_dtype": np.array([r["gemm_dtype"] for r in rows]),
            "serving": serving}
    if phase == "context":
        cols["seq_len"] = np.array([float(r["isl"]) for r in rows])
    else:   # ``step`` tokens cached: the new token attends step + 1
        cols["context_len"] = np.array([float(r["step"]) + 1.0 for r in rows])
    module_s = np.array([float(r["latency_us"]) for r in rows]) * 1e-6
    return MLARows(phase, cols, module_s, others)


#: A residual below this share of its module row is noise of the neighbours' prices at the smallest shapes (the
#: L40S's eager rows scatter by ±20 µs around ~70 µs): not a time the op can have, left out of the fit.
MIN_RESIDUAL_SHARE = 0.05


def fit_rows(rows: MLARows) -> np.ndarray:
    """Which rows a fit takes: serving rows with 16-bit GEMMs and a residual the op can have."""
    return (rows.columns["serving"] & (rows.columns["gemm_dtype"] == "bf16")
            & (rows.residual_s >= MIN_RESIDUAL_SHARE * rows.module_s))


def fit_mla_family(rows: MLARows, hw: HardwareSpec, sel: np.ndarray | None = None, residual_grid: bool = True
                   ) -> tuple[SwitchEta, float, dict[str, dict[str, float]]]:
    """η model of one MLA family on the rows ``sel`` (default :func:`fit_rows`)."""
    sel = fit_rows(rows) if sel is None else sel
    model, eta_max, report = fit_family(rows.family, rows.fit_columns(sel), hw, residual_grid=residual_grid)
    return model, eta_max, report   # type: ignore[return-value]


def family_fixed_latency_s(model: SwitchEta) -> float | None:
    """The family's fixed latency as ``family_overheads`` takes it: the default variant's (pooled) fit's."""
    m = model.models[model.default]
    if isinstance(m, DispatchEta):
        m = m.pooled if m.pooled is not None else m.models[m.default]
    return m.overhead_s if isinstance(m, LogPolyEta) else None


def add_mla_families(calib: Calibration, fits: dict[str, SwitchEta]) -> None:
    """Put fitted MLA families into ``calib`` with their family-level fixed latency. ``eta_max`` stays: it clips
    every family, and the MLA families are never priced below their roofline anyway (``StepModel``)."""
    for fam, model in fits.items():
        if fam not in MLA_FAMILIES:
            raise ValueError(f"not an MLA family: {fam}")
        calib.eta[fam] = model
        ovh = family_fixed_latency_s(model)
        if ovh is not None:
            calib.overhead_s[fam] = ovh


def read_folder_rows(folder: Path, model: ModelSpec, hw: HardwareSpec, calib: Calibration) -> dict[str, MLARows]:
    """Both phases' rows of a folder (family → rows), where its tables have module rows."""
    out = {}
    for phase, fam in PHASE_FAMILY.items():
        r = read_mla_rows(folder, phase, model, hw, calib)
        if r is not None:
            out[fam] = r
    return out


__all__ = [
    "DEFAULT_LABEL",
    "GEMM_QUANTIZATION",
    "MIN_RESIDUAL_SHARE",
    "MLA_TABLE_HEADS",
    "MLA_TABLE_MODEL",
    "MLARows",
    "OUTSIDE_MODULE",
    "PHASE_FAMILY",
    "PREFILL_PATH",
    "add_mla_families",
    "family_fixed_latency_s",
    "fit_mla_family",
    "fit_rows",
    "module_other_kernels",
    "read_folder_rows",
    "read_mla_rows",
]
