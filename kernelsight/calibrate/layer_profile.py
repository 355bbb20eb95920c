"""A per-layer profile (LLMServingSim's profile bundle) as target-tier kernel rows of the kernel model.

A bundle times one model's layer ops inside one vLLM release on one GPU (``meta.yaml``; per TP degree ``tpN/``:
``dense.csv``, ``per_sequence.csv``, ``attention.csv``, the skew tables). Each op is a kernel of known shape:

==================  ========================================================================================
op                  kernel of the step model (:mod:`kernelsight.simcore.kernels`), one rank's shapes
==================  ========================================================================================
qkv_proj, o_proj,   GEMM rows (m = tokens; n, k from the model config and the TP degree)
gate_up_proj,
down_proj, lm_head
layernorm,          elementwise rows of the norm / RoPE / activation / embedding / sampler families, with the
final_layernorm,    bytes the step model moves for them
rotary_emb, act_fn,
embedding, sampler
attention           pure prefill rows (one chunk of ``prefill_chunk`` tokens over ``kv_prefill`` cached ones)
                    and pure decode rows (``n_decode`` sequences over ``kv_decode`` cached tokens); the
                    mixed rows (both at once) are what the step model's two attention kernels are checked
                    against (:func:`mixed_attention_check`)
==================  ========================================================================================

The GEMM and attention rows are written in the measurement schema and fitted as any kernel table is; the
elementwise families get a constant η and a fixed latency each (:func:`fit_elementwise`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kernelsight.calibrate.measurements import SCHEMA, Table
from kernelsight.profiles import UnknownModelError, bundled_hardware_name, load_hardware, load_model
from kernelsight.simcore import kernels as K
from kernelsight.simcore.calibration import Calibration
from kernelsight.simcore.eta import ConstantEta
from kernelsight.simcore.hardware import HardwareSpec
from kernelsight.simcore.model_spec import ModelSpec

#: Licence and origin of the bundles this reads (the format is LLMServingSim's profiler output).
BUNDLE_FORMAT = "LLMServingSim profile bundle (meta.yaml, tpN/dense.csv, per_sequence.csv, attention.csv)"
#: dense.csv / per_sequence.csv ops that are GEMMs.
GEMM_OPS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
#: Elementwise ops → the step model's family.
ELEMENTWISE_OPS = {"layernorm": K.NORM, "final_layernorm": K.NORM, "rotary_emb": K.ROPE, "act_fn": K.ACTIVATION,
                   "embedding": K.EMBEDDING, "sampler": K.SAMPLER, "qk_norm": K.NORM}
_DTYPES = {"bf16": ("bf16", 2.0), "bfloat16": ("bf16", 2.0), "fp16": ("fp16", 2.0), "float16": ("fp16", 2.0)}


class ProfileError(ValueError):
    """A directory that is not a readable profile bundle."""


@dataclass(slots=True)
class LayerProfile:
    """One bundle: its ``meta.yaml``, the GPU profile it names, the model (as profiled) and its TP folders."""

    path: Path
    meta: dict[str, Any]
    hardware: str                 # bundled GPU profile name
    model: ModelSpec              # the model profiled (each tpN/ folder holds its layers' shapes divided by N)
    dtype: str                    # GEMM format name of the measurement schema ("bf16")
    act_bytes: float
    tp_dirs: dict[int, Path]      # TP degree → folder of one rank's shapes

    @property
    def vllm_version(self) -> str:
        return str(self.meta.get("vllm_version", ""))

    def software(self) -> dict[str, str]:
        """The versions the bundle was timed under, as ``Calibration.software`` records them."""
        found = {"vllm": self.meta.get("vllm_version"), "cuda": self.meta.get("cuda_version"),
                 "torch": self.meta.get("torch_version")}
        return {k: str(v) for k, v in found.items() if v not in (None, "")}


def find_bundles(root: str | Path) -> list[Path]:
    """Every bundle (a folder holding ``meta.yaml``) at or below ``root``, sorted."""
    root = Path(root)
    if (root / "meta.yaml").is_file():
        return [root]
    return sorted(p.parent for p in root.rglob("meta.yaml"))


def read_profile(path: str | Path, hardware: str | None = None) -> LayerProfile:
    """Read one bundle (``path`` holds ``meta.yaml``). The GPU is ``hardware`` or the bundle's ``gpu`` name."""
    import yaml  # the bundle's own format

    path = Path(path)
    meta_path = path / "meta.yaml"
    if not meta_path.is_file():
        raise ProfileError(f"{path}: no meta.yaml (not a profile bundle)")
    try:
        meta = yaml.safe_load(meta_path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ProfileError(f"{meta_path}: not YAML ({exc})") from None
    if not isinstance(meta, dict):
        raise ProfileError(f"{meta_path}: expected a mapping")
    gpu = hardware or next((bundled_hardware_name(str(meta[k])) for k in ("gpu", "hardware")
                            if meta.get(k) and bundled_hardware_name(str(meta[k]))), None)
    if gpu is None:
        raise ProfileError(f"{meta_path}: no bundled GPU profile for gpu {meta.get('gpu')!r}: pass --hardware")
    hw_name = load_hardware(gpu).name
    if not meta.get("model"):
        raise ProfileError(f"{meta_path}: names no model")
    dtype = _DTYPES.get(str(meta.get("variant", "bf16")).lower())
    if dtype is None:
        raise ProfileError(f"{meta_path}: variant {meta.get('variant')!r} is not a 16-bit profile (bf16, fp16)")
    # engine_effective's hf_overrides are the last TP degree's emulation (heads and intermediate size divided by it):
    # each tpN/ folder's shapes are the model's own divided by N, so the model is read as published
    model = _profiled_model(str(meta["model"]))
    tp_dirs = {int(d.name[2:]): d for d in sorted(path.glob("tp*")) if d.name[2:].isdigit() and d.is_dir()}
    if not tp_dirs:
        raise ProfileError(f"{path}: no tpN/ folders")
    return LayerProfile(path, meta, hw_name, model, dtype[0], dtype[1], tp_dirs)


def _profiled_model(model_id: str) -> ModelSpec:
    try:
        return load_model(model_id)
    except UnknownModelError as exc:
        raise ProfileError(f"{exc} (the bundle's meta.yaml model)") from None


def _read_csv(path: Path, columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    import csv

    if not path.is_file():
        raise ProfileError(f"{path}: missing")
    with path.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    missing = [c for c in columns if rows and c not in rows[0]]
    if missing or not rows:
        raise ProfileError(f"{path}: {'no rows' if not rows else 'missing columns ' + ', '.join(missing)}")
    out: dict[str, np.ndarray] = {}
    for c in columns:
        vals = [r[c] for r in rows]
        try:
            out[c] = np.array([float(v) for v in vals])
        except ValueError:
            out[c] = np.array(vals)
    return out


# -- rows ------------------------------------------------------------------------------------------------------
def _gemm_nk(model: ModelSpec, op: str, tp: int) -> tuple[int, int]:
    h, d = model.hidden_size, model.head_dim
    q_heads, kv_heads = model.num_attention_heads // tp, max(model.num_kv_heads // tp, 1)
    inter = model.intermediate_size // tp
    return {"qkv_proj": ((q_heads + 2 * kv_heads) * d, h), "o_proj": (h, q_heads * d),
            "gate_up_proj": (2 * inter, h), "down_proj": (h, inter),
            "lm_head": (-(-model.vocab_size // tp), h)}[op]


def _elementwise_bytes(model: ModelSpec, op: str, rows: np.ndarray, tp: int, act_bytes: float) -> np.ndarray:
    """Bytes the step model moves for one elementwise op over ``rows`` tokens (or sequences: the sampler), as
    :mod:`kernelsight.simcore.kernels` builds them."""
    h, d = model.hidden_size, model.head_dim
    q_heads, kv_heads = model.num_attention_heads // tp, max(model.num_kv_heads // tp, 1)
    if op in ("layernorm", "final_layernorm"):
        return 3.0 * rows * h * act_bytes
    if op == "qk_norm":
        return 3.0 * rows * (q_heads + kv_heads) * d * act_bytes
    if op == "rotary_emb":
        return 2.0 * rows * (q_heads + kv_heads) * d * act_bytes
    if op == "act_fn":
        return 3.0 * rows * (model.intermediate_size // tp) * act_bytes
    if op == "embedding":
        return 2.0 * rows * h * act_bytes
    if op == "sampler":
        return 3.0 * rows * model.vocab_size * K._FP32_BYTES
    raise ValueError(op)


def _table(family: str, cols: dict[str, np.ndarray]) -> Table:
    header = tuple(cols)
    n = len(next(iter(cols.values())))
    raw = [[str(cols[c][i]) for c in header] for i in range(n)]
    return Table(family, cols, header, raw)


def profile_tables(profile: LayerProfile) -> dict[str, Table]:
    """The bundle's GEMM, pure prefill and pure decode attention rows, every TP folder's, in the measurement schema
    (an ``attn_prefill`` row carries its cached tokens in ``cached_len``)."""
    m = profile.model
    gemm: dict[str, list] = {c: [] for c in (*SCHEMA["gemm"], "latency_us")}
    pre: dict[str, list] = {c: [] for c in (*SCHEMA["attn_prefill"], "cached_len", "latency_us")}
    dec: dict[str, list] = {c: [] for c in (*SCHEMA["attn_decode"], "latency_us")}
    kv_dtype = profile.dtype
    for tp, folder in profile.tp_dirs.items():
        dense = _read_csv(folder / "dense.csv", ("layer", "tokens", "time_us"))
        per_seq = _read_csv(folder / "per_sequence.csv", ("layer", "sequences", "time_us"))
        for op, rows, t in [*zip(dense["layer"], dense["tokens"], dense["time_us"], strict=True),
                            *zip(per_seq["layer"], per_seq["sequences"], per_seq["time_us"], strict=True)]:
            if op in GEMM_OPS:
                n, k = _gemm_nk(m, str(op), tp)
                for c, v in zip(("dtype", "m", "n", "k", "latency_us"), (profile.dtype, rows, n, k, t),
                                strict=True):
                    gemm[c].append(v)
        att = _read_csv(folder / "attention.csv", ("prefill_chunk", "kv_prefill", "n_decode", "kv_decode", "time_us"))
        q_heads, kv_heads = m.num_attention_heads // tp, max(m.num_kv_heads // tp, 1)
        for chunk, kv_p, n_dec, kv_d, t in zip(att["prefill_chunk"], att["kv_prefill"], att["n_decode"],
                                               att["kv_decode"], att["time_us"], strict=True):
            if chunk > 0 and n_dec == 0:
                for c, v in zip(("batch", "seq_len", "num_heads", "num_kv_heads", "head_dim", "kv_dtype", "window",
                                 "cached_len", "latency_us"),
                                (1, chunk, q_heads, kv_heads, m.head_dim, kv_dtype, 0, kv_p, t), strict=True):
                    pre[c].append(v)
            elif chunk == 0 and n_dec > 0:
                for c, v in zip(("batch", "cached_len", "num_heads", "num_kv_heads", "head_dim", "kv_dtype", "window",
                                 "latency_us"), (n_dec, kv_d, q_heads, kv_heads, m.head_dim, kv_dtype, 0, t),
                                strict=True):
                    dec[c].append(v)
    out = {}
    for fam, cols in (("gemm", gemm), ("attn_prefill", pre), ("attn_decode", dec)):
        if cols["latency_us"]:
            out[fam] = _table(fam, {c: np.array(v) for c, v in cols.items()})
    return out


def elementwise_rows(profile: LayerProfile) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """family → (bytes moved, measured seconds) of the bundle's elementwise ops, every TP folder's."""
    out: dict[str, tuple[list, list]] = {}
    for tp, folder in profile.tp_dirs.items():
        for name, rows_col in (("dense.csv", "tokens"), ("per_sequence.csv", "sequences")):
            t = _read_csv(folder / name, ("layer", rows_col, "time_us"))
            for op in np.unique(t["layer"]):
                fam = ELEMENTWISE_OPS.get(str(op))
                if fam is None:
                    continue
                sel = t["layer"] == op
                b, s = out.setdefault(fam, ([], []))
                b.extend(_elementwise_bytes(profile.model, str(op), t[rows_col][sel], tp, profile.act_bytes))
                s.extend(t["time_us"][sel] * 1e-6)
    return {f: (np.array(b), np.array(s)) for f, (b, s) in out.items()}


# -- fitting ---------------------------------------------------------------------------------------------------
def fit_elementwise(rows: Mapping[str, tuple[np.ndarray, np.ndarray]], hw: HardwareSpec
                    ) -> dict[str, tuple[float, float]]:
    """family → (η, fixed latency s) of ``time = bytes / (η · DRAM bandwidth) + latency``, least squares on relative
    error (small ops weigh as much as large ones), both kept positive."""
    out: dict[str, tuple[float, float]] = {}
    bw = hw.usable_mem_bytes_per_s
    for fam, (bytes_moved, time_s) in rows.items():
        roof_s = bytes_moved / bw
        w = 1.0 / time_s
        a = np.column_stack([roof_s * w, w])
        (inv_eta, ovh_s), *_ = np.linalg.lstsq(a, np.ones_like(time_s), rcond=None)
        if ovh_s < 0 or inv_eta <= 0:     # one term alone: the better of bandwidth-only or latency-only
            inv_eta = max(float(np.median(time_s / roof_s)), 1e-3)
            ovh_s = 0.0
        out[fam] = (1.0 / float(inv_eta), float(ovh_s))
    return out


def apply_elementwise(calib: Calibration, fitted: Mapping[str, tuple[float, float]]) -> None:
    """Put the fitted elementwise families into ``calib`` (η capped at the calibration's physics ceiling)."""
    for fam, (eta, ovh_s) in fitted.items():
        calib.eta[fam] = ConstantEta(min(eta, calib.eta_max))
        calib.overhead_s[fam] = ovh_s


# -- checks ----------------------------------------------------------------------------------------------------
def mixed_attention_check(profile: LayerProfile, calib: Calibration) -> dict[str, float]:
    """The mixed rows (one prefill chunk and decodes in one batch) against the step model's price of the same batch
    (:class:`~kernelsight.simcore.step_model.StepModel`, eager as the profile ran: the prefill kernel, and the
    decodes as the step model runs them beside a prefill — unsplit, no faster than their longest context streams).
    Returns the rows, the MAPE and the predicted/measured ratio's median, p10 and p90."""
    from kernelsight.simcore.precision import resolve_precision
    from kernelsight.simcore.step_model import StepConfig, StepModel

    hw = load_hardware(profile.hardware)
    m = profile.model
    precision = resolve_precision(m.torch_dtype, m.quantization, "auto", fp8_scheme=m.fp8_scheme)
    ratios = []
    for tp, folder in profile.tp_dirs.items():
        att = _read_csv(folder / "attention.csv", ("prefill_chunk", "kv_prefill", "n_decode", "kv_decode", "time_us"))
        step = StepModel(m, hw, calib, precision, StepConfig(tp=tp, enforce_eager=True))
        for chunk, kv_p, n_dec, kv_d, t_us in zip(att["prefill_chunk"], att["kv_prefill"], att["n_decode"],
                                                  att["kv_decode"], att["time_us"], strict=True):
            if not (chunk > 0 and n_dec > 0):
                continue
            contexts = [int(kv_d) + 1] * int(n_dec)
            t_s = _attention_s(step, (K.PrefillChunk(int(chunk), int(kv_p), True),), contexts)
            ratios.append(t_s / m.num_layers / (t_us * 1e-6))
    if not ratios:
        return {"rows": 0}
    r = np.array(ratios)
    return {"rows": len(r), "mape_pct": float(np.mean(np.abs(r - 1.0)) * 100), "median_ratio": float(np.median(r)),
            "p10_ratio": float(np.percentile(r, 10)), "p90_ratio": float(np.percentile(r, 90))}


def _attention_s(step: Any, prefill: tuple, contexts: list[int]) -> float:
    """One step's attention (prefill and decode) as the step model prices it, decode contexts given one by one."""
    batch = K.BatchShape(prefills=prefill, num_decodes=len(contexts), decode_context_tokens=sum(contexts),
                         decode_context_top=tuple(sorted(contexts, reverse=True)))
    fam = step.breakdown_dict(batch)
    return fam[K.ATTN_PREFILL] + fam[K.ATTN_DECODE]


def skew_check(profile: LayerProfile, calib: Calibration) -> dict[str, dict[str, float]]:
    """The skew rows (a batch of ``n`` decodes, ``nb`` of them at ``kv_big`` cached tokens and the rest at ``kvs``,
    with a prefill chunk in the mixed regime) against the step model. The profile's ``alpha`` places the skewed
    batch's time between the same batch at the mean length (0) and with every sequence at ``kv_big`` (1); the step
    model's alpha is taken the same way from its own three prices. Per regime: rows, the median measured and
    predicted alpha, and the median absolute difference (a row whose three measured times nearly coincide has an
    alpha of noise, up to ±1,000: medians, not means)."""
    from kernelsight.simcore.precision import resolve_precision
    from kernelsight.simcore.step_model import StepConfig, StepModel

    hw = load_hardware(profile.hardware)
    m = profile.model
    precision = resolve_precision(m.torch_dtype, m.quantization, "auto", fp8_scheme=m.fp8_scheme)
    cols = ("regime", "n", "nb", "pc", "kp", "kvs", "kv_big", "kv_mean", "alpha")
    by_regime: dict[str, tuple[list, list]] = {}
    for tp, folder in profile.tp_dirs.items():
        path = folder / "skew.csv"
        if not path.is_file():
            continue
        t = _read_csv(path, cols)
        step = StepModel(m, hw, calib, precision, StepConfig(tp=tp, enforce_eager=True))

        for i in range(len(t["n"])):
            try:
                measured = float(t["alpha"][i])
            except ValueError:      # a row the profiler left without a result
                continue
            n, nb = int(t["n"][i]), int(t["nb"][i])
            big, small, mean = int(t["kv_big"][i]) + 1, int(t["kvs"][i]) + 1, int(round(float(t["kv_mean"][i]))) + 1
            pc = int(t["pc"][i])
            prefill = (K.PrefillChunk(pc, int(t["kp"][i]), True),) if pc > 0 else ()
            t_mean, t_max = _attention_s(step, prefill, [mean] * n), _attention_s(step, prefill, [big] * n)
            t_skew = _attention_s(step, prefill, [big] * nb + [small] * (n - nb))
            if t_max - t_mean <= 0.01 * t_mean:     # the three prices too close to place the skewed one between
                continue
            meas, pred = by_regime.setdefault(str(t["regime"][i]), ([], []))
            meas.append(measured)
            pred.append((t_skew - t_mean) / (t_max - t_mean))
    out = {}
    for regime, (meas, pred) in sorted(by_regime.items()):
        a, b = np.array(meas), np.array(pred)
        out[regime] = {"rows": len(a), "median_measured_alpha": float(np.median(a)),
                       "median_predicted_alpha": float(np.median(b)),
                       "median_abs_diff": float(np.median(np.abs(a - b)))}
    return out


# -- the whole import ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ProfileImport:
    """``import-profile``'s result: the calibration, the fit report and the mixed-batch check per bundle."""

    calibration: Calibration
    report: Any                              # calibrate.fit.eta.FitReport
    profiles: list[LayerProfile]
    tables: dict[str, Table]                 # the pooled GEMM and attention rows, in the measurement schema
    elementwise: dict[str, tuple[float, float]]
    mixed_checks: dict[str, dict[str, float]]
    skew_checks: dict[str, dict[str, dict[str, float]]]


def _shown(path: Path, root: Path) -> str:
    """A bundle's path as the source records it: from the folder above ``root`` (no machine-specific prefix)."""
    try:
        return str(path.resolve().relative_to(root.resolve().parent))
    except ValueError:
        return str(path)


def import_profiles(root: str | Path, hardware: str | None = None, *, workers: int = 0, use_prior: bool = True,
                    licence: str = "") -> ProfileImport:
    """Fit a target-tier calibration from every bundle at or below ``root`` (all of one GPU and one vLLM release:
    their rows are pooled), on the GPU's cross-generation calibration as prior (what the bundles do not time —
    other formats, MoE, collectives, host — comes from there)."""
    from kernelsight.calibrate.evaluate import cross_generation_for, fit_target
    from kernelsight.calibrate.measurements import concat_tables

    paths = find_bundles(root)
    if not paths:
        raise ProfileError(f"{root}: no profile bundle (a folder with meta.yaml) at or below it")
    profiles = [read_profile(p, hardware) for p in paths]
    stacks = {(p.hardware, p.vllm_version) for p in profiles}
    if len(stacks) > 1:
        raise ProfileError(f"{root}: bundles of several GPUs or vLLM releases ({sorted(stacks)}): a calibration "
                           "belongs to one GPU and one software stack; import one at a time")
    hw = load_hardware(profiles[0].hardware)
    tables: dict[str, Table] = {}
    ew: dict[str, tuple[list, list]] = {}
    for p in profiles:
        for fam, t in profile_tables(p).items():
            tables[fam] = concat_tables(tables[fam], t) if fam in tables else t
        for fam, (b, s) in elementwise_rows(p).items():
            eb, es = ew.setdefault(fam, ([], []))
            eb.extend(b)
            es.extend(s)
    prior = cross_generation_for(hw) if use_prior else None
    source = "; ".join(f"{BUNDLE_FORMAT}: {_shown(p.path, Path(root))} ({p.meta.get('model')} "
                       f"{p.meta.get('variant', '')}, TP {', '.join(map(str, p.tp_dirs))}; {p.meta.get('gpu', '')}; "
                       f"vLLM {p.vllm_version})" for p in profiles)
    calib, report = fit_target(tables, hw, source=source, licence=licence, workers=workers, prior=prior)
    if prior is not None and not calib.decode_cta_bytes_per_s and not any(
            p.model.num_attention_heads == p.model.num_kv_heads for p in profiles):
        # GQA decode rows cannot show FA2's unsplit per-CTA stream (only MHA shapes take it): the prior's stands
        calib.decode_cta_bytes_per_s = dict(prior.decode_cta_bytes_per_s)
    elementwise = fit_elementwise({f: (np.array(b), np.array(s)) for f, (b, s) in ew.items()}, hw)
    apply_elementwise(calib, elementwise)
    calib.software = profiles[0].software()
    calib.notes = ("target-measured tier from per-layer profiles: each layer op a kernel of known shape (GEMMs, "
                   "pure prefill and decode attention fitted as kernel tables; norm, RoPE, activation, embedding and "
                   "sampler a constant η and fixed latency each)"
                   + (f"; on the cross-generation tier as prior ({prior.source})" if prior is not None else ""))
    checks = {str(p.path): mixed_attention_check(p, calib) for p in profiles}
    skews = {str(p.path): skew_check(p, calib) for p in profiles}
    return ProfileImport(calib, report, profiles, tables, elementwise, checks, skews)
