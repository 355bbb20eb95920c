"""Library calls behind ``kernelsight predict`` and ``kernelsight calibrate eval|fit``.

Tiers: ``roofline`` (η = 1, no fixed latency), ``cross-generation`` (transferred from other GPUs'
calibrations, :mod:`kernelsight.calibrate.fit.transfer`), ``target`` (fitted on the GPU's own measurements).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kernelsight.calibrate.fit.comm import COMM_BACKENDS, VLLM_ALLREDUCE_BACKENDS
from kernelsight.calibrate.fit.eta import FitReport, fit_calibration
from kernelsight.calibrate.fit.transfer import FP4_TRANSFER_SOURCES, cross_generation_calibration
from kernelsight.calibrate.measurements import Table, read_measurements
from kernelsight.calibrate.rows import KERNEL_FAMILIES, kernel_rows, predict_rows_s, roofline_rows_s
from kernelsight.profiles import bundled_hardware_name, load_hardware, read_calibration_file
from kernelsight.simcore.allreduce_dispatch import allreduce_implementation
from kernelsight.simcore.calibration import Calibration
from kernelsight.simcore.comm import COMM_OPS, allreduce_implementation_s
from kernelsight.simcore.eta import ConstantEta
from kernelsight.simcore.hardware import HardwareSpec

TIERS = ("roofline", "cross-generation", "target")
#: A shape is "small" when its roofline time is below this: fixed latency dominates it.
SMALL_ROOFLINE_S = 10e-6
SHARED_DATA_LICENCE = "Apache-2.0 (ai-dynamo/aiconfigurator, Copyright NVIDIA Corporation & Affiliates)"
#: The shared per-layer profiles' (``layers/``) licence.
SHARED_LAYERS_LICENCE = "MIT (casys-kaist/LLMServingSim, Copyright 2024 CASYS Lab, KAIST)"


def roofline_calibration(hw: HardwareSpec) -> Calibration:
    """η = 1 everywhere and no fixed latency: the plain roofline baseline."""
    from kernelsight.simcore.calibration import default_calibration

    c = default_calibration(hw.name)
    c.tier = "roofline"
    c.eta = {"default": ConstantEta(1.0)}
    c.overhead_s = {"default": 0.0}
    c.eta_max = 1.0
    c.source = "plain roofline (η = 1, no fixed latency)"
    return c


def bundled_calibration_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "profiles" / "calibration"


def bundled_calibrations(tier: str | None = "target-measured") -> list[Calibration]:
    """Each GPU's default calibration shipped in ``kernelsight/profiles/calibration`` (optionally of one tier); the
    files of its other software stacks (``<gpu>@vllm-<version>.json``) are not among them."""
    out = []
    for p in sorted(bundled_calibration_dir().glob("*.json")):
        if STACK_FOLDER_SEP in p.name:
            continue
        c = read_calibration_file(p)
        if tier is None or c.tier == tier:
            out.append(c)
    return out


#: The bundled target-measured GPUs the cross-generation tier transfers from. Pinned rather than "every bundled
#: target-measured file" so that adding a GPU's own table (rtx-pro-6000) does not move every other GPU's
#: cross-generation η: widening the sources is its own change, with its own accuracy check.
CROSS_GENERATION_SOURCES: tuple[str, ...] = ("a100-sxm", "h100-sxm", "l40s")


def cross_generation_for(hw: HardwareSpec, sources: Sequence[Calibration] | None = None,
                         fp4_sources: Sequence[Calibration] | None = None) -> Calibration:
    """Cross-generation calibration of ``hw`` from measured calibrations of *other* GPUs (default: the bundled
    ones of :data:`CROSS_GENERATION_SOURCES`; NVFP4 GEMMs from the bundled ones of ``FP4_TRANSFER_SOURCES``)."""
    bundled = bundled_calibrations("target-measured") if sources is None or fp4_sources is None else []
    sources = list(sources) if sources is not None else [c for c in bundled if c.hardware in CROSS_GENERATION_SOURCES]
    fp4 = list(fp4_sources) if fp4_sources is not None else [
        c for c in bundled if c.hardware in FP4_TRANSFER_SOURCES]
    pairs = [(c, load_hardware(c.hardware)) for c in sources]
    fp4_pairs = [(c, load_hardware(c.hardware)) for c in fp4 if c.hardware != hw.name]
    return cross_generation_calibration(hw, [(c, h) for c, h in pairs if h.name != hw.name], fp4_sources=fp4_pairs)


def measured_gpu_dirs(kernels_dir: str | Path, skipped: list[str] | None = None) -> dict[str, str]:
    """Sub-directories of ``kernels_dir`` holding measurement files, by folder name → bundled GPU profile name
    (folders are matched like ``--hardware``: ``h100_sxm`` is ``h100-sxm``); folders of unknown GPUs are skipped,
    their names appended to ``skipped`` when given."""
    out: dict[str, str] = {}
    for d in sorted(Path(kernels_dir).iterdir()):
        if not d.is_dir() or not any(d.glob("*.csv*")):
            continue
        name = bundled_hardware_name(d.name)
        if name is not None:
            out[d.name] = name
        elif skipped is not None:
            skipped.append(d.name)
    return out


#: A folder of the kernel-table schema named ``<GPU folder>@vllm-<version>`` holds the same GPU timed under another
#: vLLM release (a kernel library picks its kernels per release: another software stack, another calibration).
STACK_FOLDER_SEP = "@vllm-"


def other_stack_dirs(kernels_dir: str | Path) -> dict[str, tuple[str, str]]:
    """Sub-directories ``<GPU folder>@vllm-<version>`` of ``kernels_dir`` holding measurement files, by folder name →
    (bundled GPU profile name, vLLM version); :func:`measured_gpu_dirs` lists each GPU's plain folder."""
    out: dict[str, tuple[str, str]] = {}
    for d in sorted(Path(kernels_dir).iterdir()):
        gpu, sep, version = d.name.partition(STACK_FOLDER_SEP)
        if not sep or not version or not d.is_dir() or not any(d.glob("*.csv*")):
            continue
        name = bundled_hardware_name(gpu)
        if name is not None:
            out[d.name] = (name, version)
    return out


def default_fit_workers() -> int:
    """Processes for a target fit: one per CPU, at most one per kernel family."""
    return max(1, min(os.cpu_count() or 1, len(KERNEL_FAMILIES)))


def fit_target(
    tables: Mapping[str, Table],
    hw: HardwareSpec,
    source: str = "",
    licence: str = "",
    residual_grid: bool = True,
    workers: int = 0,
    prior: Calibration | None = None,
) -> tuple[Calibration, FitReport]:
    """Target-measured fit of one GPU's tables. ``workers`` = 0 fits in this process; N ≥ 1 fits the kernel
    families in N worker processes with one BLAS thread each (same calibration for every N; this process's BLAS
    threading can move the last bits of the in-process fit). ``prior``: the GPU's cross-generation calibration,
    which fills in what the tables do not measure (:func:`~kernelsight.calibrate.fit.eta.fit_calibration`)."""
    cols = {f: t.columns for f, t in tables.items()}
    kwargs = {"residual_grid": residual_grid, "source": source, "licence": licence, "prior": prior}
    if workers <= 0:
        return fit_calibration(cols, hw, **kwargs)
    with _single_threaded_blas(), ProcessPoolExecutor(workers, multiprocessing.get_context("spawn")) as pool:
        return fit_calibration(cols, hw, map_fn=pool.map, **kwargs)


#: BLAS thread-count variables a freshly started worker's numpy reads at import
_BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextmanager
def _single_threaded_blas() -> Iterator[None]:
    """Workers started inside this block run one BLAS thread each: the fit's small solves gain nothing from
    threads, and N workers × N BLAS threads on N cores made the H100 fit slower than one process (60 vs 55 s)."""
    saved = {k: os.environ.get(k) for k in _BLAS_THREAD_VARS}
    os.environ.update({k: "1" for k in _BLAS_THREAD_VARS})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def predict_table_s(table: Table, hw: HardwareSpec, calib: Calibration) -> np.ndarray:
    """Predicted seconds for every row of a measurement table (kernels or all-reduce collectives)."""
    if table.family in KERNEL_FAMILIES:
        return predict_rows_s(table.family, table.columns, hw, calib)
    if table.family == "comm":
        return predict_comm_s(table.columns, hw, calib)
    raise ValueError(f"cannot predict family {table.family!r}")


def predict_comm_s(cols: Mapping[str, np.ndarray], hw: HardwareSpec, calib: Calibration) -> np.ndarray:
    """Collective rows (all_reduce / all_gather / reduce_scatter / all_to_all) through their backend's model
    (measured curves, else its α–β line); unknown ops → NaN. Rows of vLLM's all-reduce entry point
    (``vllm_custom_graph`` / ``_eager``) are priced as the simulator prices a TP all-reduce: by the curve of the
    implementation vLLM dispatches them to on ``hw`` (custom all-reduce, symmetric memory or NCCL)."""
    out = np.full(len(cols["op"]), np.nan)
    gpus = np.asarray(cols["num_gpus"], dtype=float)
    msg = np.asarray(cols["message_bytes"], dtype=float)
    dtypes = cols["dtype"] if "dtype" in cols else np.full(len(out), "bf16")
    for i, (op, backend) in enumerate(zip(cols["op"], cols["backend"], strict=True)):
        if str(op) not in COMM_OPS:
            continue
        if str(op) == "all_reduce" and str(backend) in VLLM_ALLREDUCE_BACKENDS and "nccl" in calib.comm:
            graph = VLLM_ALLREDUCE_BACKENDS[str(backend)]
            impl = allreduce_implementation(hw, int(gpus[i]), float(msg[i]), str(dtypes[i]), graph)
            out[i] = allreduce_implementation_s(impl, float(msg[i]), int(gpus[i]), hw, calib.comm, graph,
                                                str(dtypes[i]))
            continue
        name = COMM_BACKENDS.get(str(backend), str(backend))
        model = calib.comm.get(name) or calib.comm.get("custom" if name == "custom_eager" else "nccl")
        if model is None:
            continue
        out[i] = model.time_s(str(op), float(msg[i]), int(gpus[i]), hw.intra_node_bytes_per_s, str(dtypes[i]))
    return out


def mape_table(
    tables: Mapping[str, Table],
    hw: HardwareSpec,
    calib: Calibration,
    masks: Mapping[str, np.ndarray] | None = None,
) -> dict[str, dict[str, float]]:
    """MAPE per family: all rows, small (roofline < 10 µs) and large shapes, and row counts."""
    out: dict[str, dict[str, float]] = {}
    for fam, t in tables.items():
        if not t.has_latency or len(t) == 0:
            continue
        sel = masks[fam] if masks is not None and fam in masks else np.ones(len(t), dtype=bool)
        sub = t.subset(sel)
        pred = predict_table_s(sub, hw, calib)
        meas = sub["latency_us"] * 1e-6
        ok = np.isfinite(pred) & (meas > 0)
        ape = np.abs(pred - meas) / meas
        if fam in KERNEL_FAMILIES:
            roof = roofline_rows_s(kernel_rows(fam, sub.columns), hw)
            small = roof < SMALL_ROOFLINE_S
        else:
            small = sub["message_bytes"] < 1 << 20
        out[fam] = {
            "mape": _mean(ape[ok]),
            "mape_small": _mean(ape[ok & small]),
            "mape_large": _mean(ape[ok & ~small]),
            "rows": float(ok.sum()),
        }
        labels = variant_labels(sub)
        if len(set(labels[ok].tolist())) > 1:
            out[fam]["variants"] = {
                str(v): {"mape": _mean(ape[ok & (labels == v)]), "rows": float((ok & (labels == v)).sum())}
                for v in sorted(set(labels[ok].tolist()))
            }
    return out


#: Per family, the columns that tell its variants apart (format, KV-cache dtype, collective library); the
#: ``kernel`` column (the vLLM kernel that ran) is appended when present.
VARIANT_COLUMNS = {"gemm": ("dtype",), "attn_prefill": ("kv_dtype",), "attn_decode": ("kv_dtype",),
                   "attn_encoder": ("dtype",),
                   "comm": ("backend",), "moe_gemm": ("dtype",)}


def variant_labels(table: Table) -> np.ndarray:
    """Per row, the variant it belongs to (e.g. ``fp8_block DeepGemmFp8BlockScaledMMKernel``): an error that
    sits in one kernel implementation shows apart from the family's other rows."""
    cols = [c for c in (*VARIANT_COLUMNS.get(table.family, ()), "kernel") if c in table.columns]
    if not cols:
        return np.full(len(table), "", dtype=object)
    parts = [np.asarray(table[c]).astype(str) for c in cols]
    return np.array([" ".join(p) for p in zip(*parts, strict=True)], dtype=object)


def _mean(x: np.ndarray) -> float:
    return float(np.mean(x)) if len(x) else float("nan")


def split_masks(
    tables: Mapping[str, Table], train_fraction: float, seed: int = 0
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Random per-family train/test row masks (the target tier is judged on rows it never saw)."""
    rng = np.random.default_rng(seed)
    train, test = {}, {}
    for fam, t in tables.items():
        m = rng.random(len(t)) < train_fraction
        train[fam], test[fam] = m, ~m
    return train, test


def evaluate_tiers(
    tables: Mapping[str, Table],
    hw: HardwareSpec,
    *,
    train_fraction: float = 0.25,
    seed: int = 0,
    sources: Sequence[Calibration] | None = None,
    target_calibration: Calibration | None = None,
    workers: int = 0,
) -> dict[str, dict[str, dict[str, float]]]:
    """MAPE per tier and family. The target tier fits on ``train_fraction`` of rows (``workers`` as in
    :func:`fit_target`, the cross-generation tier as its prior); all tiers are judged on the remaining rows (so the
    columns are comparable)."""
    train, test = split_masks(tables, train_fraction, seed)
    results: dict[str, dict[str, dict[str, float]]] = {}
    results["roofline"] = mape_table(tables, hw, roofline_calibration(hw), test)
    try:
        prior: Calibration | None = cross_generation_for(hw, sources)
        results["cross-generation"] = mape_table(tables, hw, prior, test)
    except ValueError:
        prior, results["cross-generation"] = None, {}
    if target_calibration is None:
        target_calibration, _ = fit_target({f: t.subset(train[f]) for f, t in tables.items()}, hw, workers=workers,
                                           prior=prior)
    results["target"] = mape_table(tables, hw, target_calibration, test)
    return results


def format_results(results: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """Side-by-side table: one row per family (all / small / large), one column group per tier."""
    tiers = [t for t in TIERS if t in results]
    fams = sorted({f for r in results.values() for f in r})
    head = f"{'family':<14}{'shapes':<8}" + "".join(f"{t:>18}" for t in tiers)
    lines = [head, "-" * len(head)]
    for fam in fams:
        for key, label in (("mape", "all"), ("mape_small", "small"), ("mape_large", "large")):
            cells = []
            for t in tiers:
                v = results[t].get(fam, {}).get(key, float("nan"))
                cells.append(f"{100 * v:>17.1f}%" if np.isfinite(v) else f"{'-':>18}")
            lines.append(f"{fam if label == 'all' else '':<14}{label:<8}" + "".join(cells))
        variants = sorted({v for t in tiers for v in results[t].get(fam, {}).get("variants", {})})
        for v in variants:   # every row of the family once more, split by variant (all shapes)
            cells = []
            for t in tiers:
                x = results[t].get(fam, {}).get("variants", {}).get(v, {}).get("mape", float("nan"))
                cells.append(f"{100 * x:>17.1f}%" if np.isfinite(x) else f"{'-':>18}")
            lines.append(f"  {v}")
            lines.append(f"{'':<14}{'':<8}" + "".join(cells))
    return "\n".join(lines)


def read_dir(path: str | Path) -> dict[str, Table]:
    return read_measurements(path)
