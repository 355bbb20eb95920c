"""Fit η (and the fixed per-kernel latency) of a whole GPU from its kernel measurements: pure numpy, no I/O.

Measured rows become kernels and roofline times (:mod:`kernelsight.calibrate.rows`); per family and per categorical
variant (GEMM format, KV-cache bytes) a sub-model is fitted: the smooth η of :mod:`.logpoly`, then, where the rows
can carry it (cross-validated for small samples), the residual trees and lattice of :mod:`.lattice`.

Kernels (target tier): when the measurements name the vLLM kernel that ran (``kernel`` column) and a
variant ran several (H100 block-scaled fp8: FlashInfer / DeepGEMM / CUTLASS; H100 bf16 attention: FA3 / FA4
at head_dim 512; L40S fp8 KV: FlashInfer / Triton), each kernel gets its own smooth η and residual lattice
(:class:`~kernelsight.simcore.eta.DispatchEta`), and a shallow threshold tree on the raw shape axes
(:mod:`.dispatch`), learned from the same rows, names the kernel when only the shape is known (the simulator,
shape-only files). Measured on the 25 %/75 % split of ``benchmarks/kernel_accuracy.py``: own smooth η per kernel
beat a shared smooth η with per-kernel lattices (H100 GEMM 5.0 vs 5.2 %, decode 3.9 vs 4.0 %).

A prior (the GPU's cross-generation calibration) fills in what the tables do not measure (:func:`fit_calibration`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from kernelsight.calibrate.fit.comm import fit_comm
from kernelsight.calibrate.fit.dispatch import fit_dispatch_rule
from kernelsight.calibrate.fit.lattice import add_residual_grid
from kernelsight.calibrate.fit.logpoly import (
    ETA_HI,
    ETA_LO,
    RIDGE,
    basis_name,
    device_constants,
    fit_logpoly,
    fit_spill_center,
)
from kernelsight.calibrate.rows import (
    KERNEL_FAMILIES,
    SWITCH_INDEX,
    Columns,
    KernelRows,
    kernel_rows,
    roofline_rows_s,
    rows_time_s,
    take_rows,
)
from kernelsight.simcore.calibration import Calibration, default_calibration
from kernelsight.simcore.comm import CommModel
from kernelsight.simcore.eta import DispatchEta, EtaModel, LogPolyEta, SwitchEta
from kernelsight.simcore.eta_basis import RESIDUAL_COORDS, basis_matrix
from kernelsight.simcore.hardware import HardwareSpec


# ------------------------------------------------------------------------------------------------
# one sub-model: smooth η and its residual stages, at a complexity its rows can carry
# ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class SubFit:
    """Result of fitting one (family, variant): the model and its training-set diagnostics."""

    model: LogPolyEta
    n_rows: int
    train_mape: float
    eta_max_seen: float
    cv_mape: float = math.inf  # held-out MAPE of the chosen complexity (small samples only; inf: not measured)


def fit_submodel(
    family: str,
    variant: str,
    rows: KernelRows,
    roof_s: np.ndarray,
    lat_s: np.ndarray,
    hw: HardwareSpec,
    *,
    residual_grid: bool = False,
    grid_rounds: int = 1,
    spill_center: float | None = None,
) -> SubFit:
    """Fit η (+ overhead) of one family variant on one GPU (``spill_center`` given: decode's L2 step not searched)."""
    dev = device_constants(family, variant, hw)
    if basis_name(family) == "attn_decode":
        dev["l2_spill_center"] = (
            fit_spill_center(rows.features, dev, roof_s, lat_s) if spill_center is None else spill_center
        )
    z = basis_matrix(basis_name(family), rows.features, dev)
    level, cv_mape = FULL_COMPLEXITY if residual_grid else SMOOTH_COMPLEXITY, math.inf
    if len(z) < SELECT_MAX_ROWS:
        levels = COMPLEXITY_LEVELS if residual_grid else tuple(c for c in COMPLEXITY_LEVELS if not c.trees)
        level, cv_mape = choose_complexity(family, rows.features, dev, z, roof_s, lat_s, levels)
    model = _fit_at_level(family, dev, z, roof_s, lat_s, rows.features, level, grid_rounds)
    eta, ovh_rows = model.from_basis(z, rows.features)
    pred = roof_s / eta + ovh_rows
    return SubFit(model, len(z), float(np.mean(np.abs(pred - lat_s) / lat_s)), float(eta.max()), cv_mape)


@dataclass(frozen=True)
class Complexity:
    """How much a sub-model may bend to its rows: the smooth fit's ridge and which residual stages it gets."""

    ridge: float
    trees: bool
    lattice: bool


#: The model every sweep of at least SELECT_MAX_ROWS rows gets: smooth η, boosted trees, then the lattice.
FULL_COMPLEXITY = Complexity(RIDGE, True, True)
#: ... and without the residual stages (``residual_grid=False``).
SMOOTH_COMPLEXITY = Complexity(RIDGE, False, False)
#: Candidates for smaller samples, simplest first. No lattice: its knots sit at every measured value of 6 axes, so
#: it costs by the grid, not the rows (~1 s a fit even on 50 rows), and a sample this small leaves most cells empty.
COMPLEXITY_LEVELS = (
    Complexity(1e-1, False, False),
    Complexity(RIDGE, False, False),
    Complexity(RIDGE, True, False),
)
#: Sub-models with fewer rows pick their complexity by cross-validation (a handful of rows cannot pin a quadratic
#: in 5–8 log-features plus boosted trees and a lattice: fitted on 100 rows, they interpolate the rows exactly and
#: miss unseen shapes by 10–100×). From a few hundred rows on, the full model is the better on the A100 and L40S
#: (held-out error of 100, 300 and 1000-row samples of their GEMM, prefill and decode tables).
SELECT_MAX_ROWS = 500
SELECT_FOLDS = 5


def _fit_at_level(family: str, dev: dict[str, float], z: np.ndarray, roof_s: np.ndarray, lat_s: np.ndarray,
                  features: np.ndarray, level: Complexity, grid_rounds: int = 1) -> LogPolyEta:
    beta, ovh, center, scale = fit_logpoly(z, roof_s, lat_s, ridge=level.ridge)
    model = LogPolyEta(
        basis_name(family),
        dev,
        tuple(center.tolist()),
        tuple(scale.tolist()),
        tuple(beta.tolist()),
        ETA_LO,
        ETA_HI,
        ovh,
        zlo=tuple(z.min(axis=0).tolist()),
        zhi=tuple(z.max(axis=0).tolist()),
    )
    if level.trees or level.lattice:
        model = add_residual_grid(model, family, z, roof_s, lat_s, rounds=grid_rounds, features=features,
                                  residual_trees=level.trees, lattice=level.lattice)
    return model


def choose_complexity(family: str, features: np.ndarray, dev: dict[str, float], z: np.ndarray, roof_s: np.ndarray,
                      lat_s: np.ndarray, levels: tuple[Complexity, ...] = COMPLEXITY_LEVELS
                      ) -> tuple[Complexity, float]:
    """The level of ``levels`` with the least MAPE on held-out rows (deterministic k-fold), and that MAPE (inf when
    there are too few rows to hold any out: then the simplest)."""
    n = len(z)
    if n < 2 * SELECT_FOLDS:
        return levels[0], math.inf
    fold = np.random.default_rng(0).permutation(n) % SELECT_FOLDS
    best, best_err = levels[-1], math.inf
    for level in levels:
        ape = np.empty(n)
        for k in range(SELECT_FOLDS):
            tr, te = fold != k, fold == k
            m = _fit_at_level(family, dev, z[tr], roof_s[tr], lat_s[tr], features[tr], level)
            e, o = m.from_basis(z[te], features[te])
            ape[te] = np.abs((roof_s[te] / e + o) / lat_s[te] - 1.0)
        err = float(ape.mean())
        if err < best_err:
            best, best_err = level, err
    return best, best_err


# ------------------------------------------------------------------------------------------------
# whole-GPU calibration
# ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class FitReport:
    """Per (family, variant): rows used and training MAPE."""

    entries: dict[str, dict[str, float]] = field(default_factory=dict)


#: A kernel gets its own η model only with at least this many training rows; rarer kernels are left to the
#: dispatch rule (their shapes are priced by the kernel it names).
MIN_KERNEL_ROWS = 40


def _fit_variant(
    family: str,
    variant: str,
    rows: KernelRows,
    roof_s: np.ndarray,
    lat_s: np.ndarray,
    hw: HardwareSpec,
    residual_grid: bool,
    prior: tuple[EtaModel, float] | None = None,
) -> tuple[EtaModel, float, dict[str, dict[str, float]]]:
    """One variant's model: a LogPolyEta, or a DispatchEta over the kernels that ran (``kernel`` column); or
    ``prior`` = (the cross-generation model of the variant, its MAPE on these rows) if that does better."""
    names: list[str] = []
    if rows.kernel is not None:
        uniq, counts = np.unique(rows.kernel, return_counts=True)
        names = [str(k) for k, c in zip(uniq, counts, strict=True) if c >= MIN_KERNEL_ROWS]
    report: dict[str, dict[str, float]] = {}

    def entry(f: SubFit) -> dict[str, float]:
        return {"rows": float(f.n_rows), "train_mape": f.train_mape, "overhead_us": (f.model.overhead_s or 0.0) * 1e6}

    pooled = fit_submodel(family, variant, rows, roof_s, lat_s, hw, residual_grid=residual_grid and len(names) < 2)
    if len(names) < 2:
        report[f"{family}[{variant}]"] = entry(pooled)
        return _or_prior(pooled.model, pooled.cv_mape, pooled.eta_max_seen, report, prior)
    report[f"{family}[{variant}/pooled smooth]"] = entry(pooled)  # for transfer only: all kernels, no lattice
    assert rows.kernel is not None
    models: dict[str, EtaModel] = {}
    counts_by: dict[str, int] = {}
    cv_by: dict[str, float] = {}
    eta_max = 0.0
    for name in names:
        sel = rows.kernel == name
        sub = take_rows(rows, sel)
        # each kernel gets its own smooth η and lattice. Tried: the variant's pooled smooth η with a per-kernel
        # lattice only: H100 gemm / decode / prefill 5.23 / 4.03 / 5.86% vs 4.98 / 3.89 / 5.84% (target tier).
        # The L2 step is the GPU's cache capacity, not the kernel's: reuse the pooled fit's position.
        f = fit_submodel(family, variant, sub, roof_s[sel], lat_s[sel], hw, residual_grid=residual_grid,
                         spill_center=pooled.model.device.get("l2_spill_center"))
        models[name] = f.model
        counts_by[name] = f.n_rows
        cv_by[name] = f.cv_mape
        eta_max = max(eta_max, f.eta_max_seen)
        report[f"{family}[{variant}/{name}]"] = entry(f)
    keep = np.isin(rows.kernel, names)
    basis = basis_name(family)
    rule = fit_dispatch_rule(RESIDUAL_COORDS[basis](rows.features[keep]), rows.kernel[keep])
    default = max(names, key=lambda k: (counts_by[k], k))
    cv = sum(cv_by[k] * counts_by[k] for k in names) / sum(counts_by.values())
    return _or_prior(DispatchEta(basis, rule, models, default, pooled.model), cv, max(eta_max, pooled.eta_max_seen),
                     report, prior)


def _or_prior(model: EtaModel, cv_mape: float, eta_max: float, report: dict[str, dict[str, float]],
              prior: tuple[EtaModel, float] | None) -> tuple[EtaModel, float, dict[str, dict[str, float]]]:
    """The fitted model, or the prior's (``(model, MAPE on these rows)``) where it predicts the measured rows
    better than the fit predicts rows it did not see (only measured for small samples: see SELECT_MAX_ROWS)."""
    if prior is None or not prior[1] < cv_mape:
        return model, eta_max, report
    for e in report.values():
        e["prior_mape"] = prior[1]
    key = next(iter(report))
    report[key]["uses_prior"] = 1.0
    return prior[0], eta_max, report


def fit_family(
    family: str, cols: Columns, hw: HardwareSpec, *, residual_grid: bool = False, prior: Calibration | None = None
) -> tuple[EtaModel, float, dict[str, dict[str, float]]]:
    """η model of one family on one GPU: a SwitchEta over its variants (each a DispatchEta over the kernels that
    ran when the ``kernel`` column names several). Returns (model, η max, report).

    ``prior`` (a cross-generation calibration of this GPU): a variant measured at fewer than SELECT_MAX_ROWS rows
    takes the prior's model instead when that predicts its rows better than the fit predicts held-out rows, and a
    variant the prior has but the rows lack is the prior's.
    """
    rows = kernel_rows(family, cols)
    lat_s = np.asarray(cols["latency_us"], dtype=float) * 1e-6
    ok = np.isfinite(lat_s) & (lat_s > 0)
    roof = roofline_rows_s(rows, hw)
    models: dict[str, EtaModel] = {}
    report: dict[str, dict[str, float]] = {}
    eta_max = 0.0
    counts: dict[str, int] = {}
    prior_model = prior.eta.get(family) if prior is not None else None
    prior_t = rows_time_s(prior, family, rows, roof, hw) if prior is not None and prior_model is not None else None
    for v in np.unique(rows.variant[ok]):
        sel = ok & (rows.variant == v)
        alt = None
        if (prior_t is not None and isinstance(prior_model, SwitchEta) and str(v) in prior_model.models
                and sel.sum() < SELECT_MAX_ROWS):
            alt = (prior_model.models[str(v)], float(np.mean(np.abs(prior_t[sel] / lat_s[sel] - 1.0))))
        model, emax, rep = _fit_variant(family, str(v), take_rows(rows, sel), roof[sel], lat_s[sel], hw, residual_grid,
                                        alt)
        if alt is not None and model is alt[0]:
            emax = max(emax, prior.eta_max)  # type: ignore[union-attr]
        models[str(v)] = model
        counts[str(v)] = int(sel.sum())
        eta_max = max(eta_max, emax)
        report.update(rep)
    # Features without the categorical entry (older tuples) mean bf16 weights / bf16 KV.
    preferred = "0" if family in ("gemm", "moe_gemm") else "2"
    default = preferred if preferred in counts else max(counts, key=counts.__getitem__)
    if isinstance(prior_model, SwitchEta):
        # A variant with no rows (a GEMM format or KV dtype the sweep did not time) takes the prior's model, built
        # for that variant, rather than a measured variant's: on the shared data, H100 / L40S fp8_block GEMMs priced
        # by the GPU's own fp8 model miss by 73 / 80 %, by the cross-generation fp8_block model by 60 / 71 %.
        for key, sub in prior_model.models.items():
            if key not in models:
                models[key] = sub
                eta_max = max(eta_max, prior.eta_max)  # type: ignore[union-attr]
                report[f"{family}[{key}]"] = {"rows": 0.0, "train_mape": math.nan, "overhead_us": math.nan,
                                              "uses_prior": 1.0}
    return SwitchEta(SWITCH_INDEX[family], models, default), eta_max, report


FamilyFit = tuple[EtaModel, float, dict[str, dict[str, float]]]


def _fit_family_job(job: tuple[str, Columns], *, hw: HardwareSpec, residual_grid: bool,
                    prior: Calibration | None = None) -> FamilyFit:
    return fit_family(job[0], job[1], hw, residual_grid=residual_grid, prior=prior)


def fit_calibration(
    tables: Mapping[str, Columns],
    hw: HardwareSpec,
    *,
    residual_grid: bool = True,
    source: str = "",
    licence: str = "",
    map_fn: Callable[[Callable[[tuple[str, Columns]], FamilyFit], Iterable[tuple[str, Columns]]],
                     Iterator[FamilyFit]] = map,
    prior: Calibration | None = None,
) -> tuple[Calibration, FitReport]:
    """Target-measured calibration of one GPU from its measurement tables (family → columns).

    The kernel families are fitted independently through ``map_fn`` (an ordered map over (family, columns): the
    builtin, or a process pool's ``map`` to fit them in parallel; the same result under the same BLAS threading).

    ``prior``: the cross-generation calibration of this GPU (what it would get with no measurements). What the
    tables do not measure comes from it: kernel families with no rows (with their fixed latency and the decode
    floor), variants with no rows within a measured family (a GEMM format, a KV dtype) and collective backends
    with no rows; and small variants take its model where it predicts their rows
    better than their own fit predicts held-out rows (:func:`fit_family`).
    """
    calib = default_calibration(hw.name)
    calib.tier = "target-measured"
    calib.source, calib.licence = source, licence
    report = FitReport()
    eta_max = 0.0
    fams = [
        f for f in KERNEL_FAMILIES
        if (cols := tables.get(f)) is not None and "latency_us" in cols and len(cols["latency_us"]) > 0
    ]
    # largest family first, so a two-worker pool balances (H100: decode ≈ gemm + prefill in fit time)
    fams.sort(key=lambda f: -len(tables[f]["latency_us"]))
    job = partial(_fit_family_job, hw=hw, residual_grid=residual_grid, prior=prior)
    fitted = dict(zip(fams, map_fn(job, [(f, tables[f]) for f in fams]), strict=True))
    for fam in KERNEL_FAMILIES:
        if fam not in fitted:
            continue
        model, emax, rep = fitted[fam]
        calib.eta[fam] = model
        eta_max = max(eta_max, emax)
        report.entries.update(rep)
        if fam == "gemm":
            bf16 = model.models.get("0") if isinstance(model, SwitchEta) else None
            if bf16 is not None:  # lm_head: the bf16 GEMM model on (m, n, k)
                calib.eta["lm_head"] = bf16
    calib.overhead_s.update(family_overheads(calib))
    calib.eta_max = max(eta_max, 1.0) if eta_max else calib.eta_max
    # The floor is a sanity cap on time, not a fit: let it sit below the slowest η the fitted form can express
    # (sigmoid floor ÷ the lattice's largest factor), so measured slow paths (H100 FA4 decode at head_dim 512:
    # 0.1 % of the roofline at short contexts) are not cut off. Older files keep their stored 0.02.
    calib.eta_floor = min(calib.eta_floor, ETA_LO * math.exp(-3.0))
    dec = tables.get("attn_decode")
    if dec is not None and "latency_us" in dec and len(dec["latency_us"]):
        calib.decode_cta_bytes_per_s = fit_decode_floor(dec, hw)
    comm: dict[str, CommModel] = {}
    if "comm" in tables and "latency_us" in tables["comm"]:
        comm = fit_comm(tables["comm"], hw, prior.comm if prior is not None else None)
        calib.comm.update(comm)
    if prior is not None:
        _fill_from_prior(calib, prior, fitted, comm)
    return calib, report


def _fill_from_prior(calib: Calibration, prior: Calibration, fitted: Mapping[str, FamilyFit],
                     comm: Mapping[str, CommModel]) -> None:
    """What the measurements leave out, from the prior: unmeasured kernel families (lm_head and MoE GEMMs follow
    the GEMM family; MoE layers without MoE rows take the prior's) with their fixed latency, the decode floor
    without decode rows, unmeasured backends."""
    stands_for = {"lm_head": "gemm"}
    for fam, model in prior.eta.items():
        if fam == "default" or stands_for.get(fam, fam) in fitted:
            continue
        calib.eta[fam] = model
        if fam in prior.overhead_s:
            calib.overhead_s[fam] = prior.overhead_s[fam]
        calib.eta_max = max(calib.eta_max, prior.eta_max)
    if "attn_decode" not in fitted:
        calib.decode_cta_bytes_per_s = dict(prior.decode_cta_bytes_per_s)
    for backend, model in prior.comm.items():
        if backend not in comm:
            calib.comm[backend] = model


#: Decode rows that can show the unsplit path (``simcore.eta.decode_serial_floor_s``): one query head per KV head,
#: contexts at least this long (shorter ones are launch-bound) and few CTAs (so that even together they stay under
#: the DRAM roof of any GPU: the path is then the only limit)
DECODE_FLOOR_MIN_CONTEXT = 2048.0
DECODE_FLOOR_MAX_CTAS = 16.0
#: The path's signature on those rows: time ∝ context (log-log slope at least this) and independent of the number
#: of CTAs (|slope| at most this). Measured: A100 and L40S FA2 bf16 0.97 / 0.01 and 0.96 / 0.01; H100 FA3 0.48-0.57
#: / 0.27-0.43 and L40S fp8 (FlashInfer) 0.68 / 0.49, which split the KV cache.
DECODE_FLOOR_MIN_CTX_SLOPE = 0.85
DECODE_FLOOR_MAX_CTA_SLOPE = 0.1


def fit_decode_floor(cols: Columns, hw: HardwareSpec) -> dict[str, float]:
    """Per decode variant, the streaming bandwidth of one CTA on the unsplit path (median over the rows that
    show it), or nothing when the measured kernel splits the KV cache."""
    rows = kernel_rows("attn_decode", cols)
    lat = np.asarray(cols["latency_us"], dtype=float) * 1e-6
    f = rows.features
    ctx = np.where(f[:, 6] > 0, np.minimum(f[:, 1], f[:, 6]), f[:, 1])
    ctas = f[:, 0] * f[:, 3]
    out: dict[str, float] = {}
    for v in np.unique(rows.variant):
        sel = ((rows.variant == v) & (f[:, 2] == f[:, 3]) & (ctas <= DECODE_FLOOR_MAX_CTAS)
               & (ctx >= DECODE_FLOOR_MIN_CONTEXT) & (lat > 0))
        if sel.sum() < 8:
            continue
        per_cta_bytes = ctx[sel] * 2.0 * f[sel, 4] * f[sel, 5]
        x = np.column_stack([np.ones(int(sel.sum())), np.log(per_cta_bytes), np.log(ctas[sel])])
        (_, ctx_slope, cta_slope), *_ = np.linalg.lstsq(x, np.log(lat[sel]), rcond=None)
        if ctx_slope >= DECODE_FLOOR_MIN_CTX_SLOPE and abs(cta_slope) <= DECODE_FLOOR_MAX_CTA_SLOPE:
            out[str(v)] = float(np.median(per_cta_bytes / lat[sel]))
    return out


def family_overheads(calib: Calibration) -> dict[str, float]:
    """Family-level fallback overhead = the default variant's fitted one."""
    out: dict[str, float] = {}
    for fam, model in calib.eta.items():
        if isinstance(model, SwitchEta):
            m = model.models[model.default]
            if isinstance(m, DispatchEta):  # the pooled fit's: what transfer averages, as before kernel models
                m = m.pooled if m.pooled is not None else m.models[m.default]
            if isinstance(m, LogPolyEta) and m.overhead_s is not None:
                out[fam] = m.overhead_s
    return out


__all__ = [
    "COMPLEXITY_LEVELS",
    "DECODE_FLOOR_MAX_CTAS",
    "DECODE_FLOOR_MAX_CTA_SLOPE",
    "DECODE_FLOOR_MIN_CONTEXT",
    "DECODE_FLOOR_MIN_CTX_SLOPE",
    "FULL_COMPLEXITY",
    "MIN_KERNEL_ROWS",
    "SELECT_FOLDS",
    "SELECT_MAX_ROWS",
    "SMOOTH_COMPLEXITY",
    "Complexity",
    "FamilyFit",
    "FitReport",
    "SubFit",
    "choose_complexity",
    "family_overheads",
    "fit_calibration",
    "fit_decode_floor",
    "fit_family",
    "fit_submodel",
]
