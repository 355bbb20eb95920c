"""How well DeepSeek-V3's MLA attention module is priced on the shared module tables (issue #36, item 3), by tier.

Every ``mla_context`` / ``mla_generation`` row of scope ``module`` (the whole MLA attention module of one layer as
vLLM runs it, eagerly: the latents' projections and norms, RoPE, the latent write, the attention op, o_proj; not the
decoder layer's input / post-attention norms) is priced as the module's other kernels
(``calibrate.mla_tables.module_other_kernels``, by the GPU stack's own bundled calibration) plus the attention op:

* before: the op composed from the dense families (``simcore.mla``: attn_prefill / attn_decode η and the bmms as
  GEMMs), what a calibration without the MLA families prices;
* target: the measured families (``mla_prefill``, ``mla_decode``) fitted on a random 25 % of the folder's fit rows
  (serving rows with 16-bit GEMMs, ``mla_tables.fit_rows``), judged on the other 75 % of every row;
* leave-one-GPU-out: the families fitted on all fit rows of the other GPUs' 0.24 folders (a release-specific folder
  is judged, never a source; never its own GPU), transferred to the held-out GPU by its spec from the sources that
  run its MLA kernel (``calibrate.fit.transfer.mla_sources``: decode by backend, prefill from all), judged on the
  same 75 %; with no such source (H100 decode: the only FLASH_ATTN_MLA / FlashMLA GPU measured) the composed pricing
  stays, as it does for such a GPU.

``num_heads`` is the rank's share of 128 heads (tp = 128 / num_heads). Rows of the backend vLLM serves with on that
GPU and KV dtype (``mla_tables.mla_serving_backend``) and the rest are reported apart. Prints MAPE and the median
signed error per (GPU stack, phase, serving or not, KV dtype, GEMM format) and writes
``benchmarks/results/mla_accuracy.json``.

    python benchmarks/mla_accuracy.py [--data ../shared/data/kernels] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED_DATA, write_result  # noqa: E402

from kernelsight.calibrate.evaluate import measured_gpu_dirs, other_stack_dirs  # noqa: E402
from kernelsight.calibrate.fit.transfer import cross_generation_calibration, mla_source_names  # noqa: E402
from kernelsight.calibrate.mla_tables import (  # noqa: E402
    MLA_TABLE_HEADS,
    MLA_TABLE_MODEL,
    MLARows,
    add_mla_families,
    fit_mla_family,
    fit_rows,
    read_folder_rows,
)
from kernelsight.calibrate.rows import MLA_FAMILIES, kernel_rows, roofline_rows_s, rows_time_s  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.profiles import load_calibration, load_hardware, load_model  # noqa: E402
from kernelsight.simcore.calibration import Calibration, default_calibration  # noqa: E402
from kernelsight.simcore.hardware import HardwareSpec  # noqa: E402
from kernelsight.simcore.kernel_shapes import PrefillChunk  # noqa: E402
from kernelsight.simcore.mla import mla_decode_kernels, mla_prefill_attention_kernel  # noqa: E402
from kernelsight.simcore.model_spec import ModelSpec  # noqa: E402
from kernelsight.simcore.precision import resolve_precision  # noqa: E402
from kernelsight.simcore.step_model import StepConfig, StepModel  # noqa: E402


def composed_op_s(rows: MLARows, model: ModelSpec, hw: HardwareSpec, calib: Calibration) -> np.ndarray:
    """The attention op of every row as the dense families compose it (``calib`` without MLA families)."""
    calib = _without_mla(calib)
    out = np.empty(len(rows.module_s))
    models: dict[tuple[str, int], StepModel] = {}
    c = rows.columns
    for i in range(len(out)):
        kv, tp, b = str(c["kv_dtype"][i]), MLA_TABLE_HEADS // int(c["num_heads"][i]), int(c["batch"][i])
        sm = models.get((kv, tp))
        if sm is None:
            prec = resolve_precision("bfloat16", None, "fp8" if kv == "fp8" else "auto", None, hw.compute_capability)
            sm = models[(kv, tp)] = StepModel(model, hw, calib, prec, StepConfig(tp=tp, enforce_eager=True))
        if rows.phase == "context":
            ks = [mla_prefill_attention_kernel(model.mla, (PrefillChunk(int(c["seq_len"][i]), 0, True),) * b,
                                               model.num_attention_heads // tp, 2.0,
                                               sm.precision.kv_bytes_per_element)]
        else:
            ks = mla_decode_kernels(model, b, b * int(c["context_len"][i]), tp, sm.precision, 1)
        out[i] = sum(sm.kernel_time_s(k) for k in ks)
    return out


def _without_mla(calib: Calibration) -> Calibration:
    """``calib`` without its MLA families (what the composed path prices by)."""
    return dataclasses.replace(calib, eta={k: v for k, v in calib.eta.items() if k not in MLA_FAMILIES},
                               overhead_s={k: v for k, v in calib.overhead_s.items() if k not in MLA_FAMILIES})


def measured_op_s(rows: MLARows, hw: HardwareSpec, calib: Calibration) -> tuple[np.ndarray, np.ndarray]:
    """(the op priced by ``calib``'s MLA family, its roofline) of every row; never below the roofline."""
    kr = kernel_rows(rows.family, rows.fit_columns())
    roof = roofline_rows_s(kr, hw)
    return np.maximum(rows_time_s(calib, rows.family, kr, roof, hw), roof), roof


def _fitted(hw: HardwareSpec, rows: dict[str, MLARows], sel: dict[str, np.ndarray] | None, residual_grid: bool,
            bundled: Calibration) -> Calibration:
    """A calibration whose only fitted families are the MLA ones, clipped as the GPU's bundled file clips η."""
    calib = default_calibration(hw.name)
    calib.tier = "target-measured"
    fits = {}
    for fam, r in rows.items():
        s = fit_rows(r) & (sel[fam] if sel is not None else True)
        fits[fam] = fit_mla_family(r, hw, s, residual_grid=residual_grid)[0]
    add_mla_families(calib, fits)
    calib.eta_max, calib.eta_floor = bundled.eta_max, bundled.eta_floor
    return calib


def _stats(err: np.ndarray) -> tuple[float, float]:
    return round(float(100 * np.mean(np.abs(err))), 1), round(float(100 * np.median(err)), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=SHARED_DATA / "kernels")
    ap.add_argument("--train-fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model = load_model(MLA_TABLE_MODEL)
    folders = {f: (gpu, None) for f, gpu in measured_gpu_dirs(args.data).items()}
    folders.update(other_stack_dirs(args.data))
    stacks: dict[str, tuple[HardwareSpec, Calibration, dict[str, MLARows]]] = {}
    for folder, (gpu, version) in sorted(folders.items()):
        hw = load_hardware(gpu)
        calib = load_calibration(gpu, vllm_version=version)
        rows = read_folder_rows(args.data / folder, model, hw, _without_mla(calib))
        if rows:
            stacks[folder] = (hw, calib, rows)
    sources = {f: _fitted(hw, rows, None, False, calib) for f, (hw, calib, rows) in stacks.items() if "@" not in f}
    table, groups = [], []
    for folder, (hw, calib, rows) in stacks.items():
        rng = np.random.default_rng(args.seed)
        train = {fam: rng.random(len(r.module_s)) < args.train_fraction for fam, r in rows.items()}
        target = _fitted(hw, rows, train, True, calib)
        src = [(sources[f], stacks[f][0]) for f in sources if stacks[f][0].name != hw.name]
        cross = cross_generation_calibration(hw, src)
        for fam, r in rows.items():
            test = ~train[fam]
            before = r.others_s + composed_op_s(r, model, hw, calib)
            tgt, roof = measured_op_s(r, hw, target)
            # no source runs the target's MLA kernel: the transfer gives no family and the composed pricing stays
            loo = r.others_s + measured_op_s(r, hw, cross)[0] if fam in cross.eta else before
            preds = {"before": before, "target": r.others_s + tgt, "loo": loo}
            c = r.columns
            for serving in (True, False):
                for kv in np.unique(c["kv_dtype"]):
                    for g in np.unique(c["gemm_dtype"]):
                        s = test & (c["serving"] == serving) & (c["kv_dtype"] == kv) & (c["gemm_dtype"] == g)
                        if not s.any():
                            continue
                        row = {"gpu": folder, "phase": r.phase, "rows": "serving" if serving else "other backend",
                               "backend": ",".join(sorted(set(c["kernel"][s].tolist()))), "kv_dtype": str(kv),
                               "gemm": str(g), "n": int(s.sum())}
                        for tier, p in preds.items():
                            row[f"{tier}_mape"], row[f"{tier}_med"] = _stats(p[s] / r.module_s[s] - 1.0)
                        table.append(row)
            fit_test = test & fit_rows(r)
            g = {"gpu": folder, "family": fam, "fit_rows_test": int(fit_test.sum()),
                 "loo_sources": mla_source_names(hw, [stacks[f][0] for f in sources], fam),
                 "min_op_over_roofline": float(np.min(tgt / roof))}
            for tier, p in preds.items():
                g[f"{tier}_mape"], g[f"{tier}_med"] = _stats(p[fit_test] / r.module_s[fit_test] - 1.0)
            groups.append(g)
    cols = ["gpu", "phase", "rows", "backend", "kv_dtype", "gemm", "n", "before_mape", "target_mape", "loo_mape",
            "before_med", "target_med", "loo_med"]
    print(format_table(table, cols, float_fmt=".1f"))
    print()
    print("fit rows (serving, 16-bit GEMMs), held-out 75 %:")
    print(format_table(groups, ["gpu", "family", "loo_sources", "fit_rows_test", "before_mape", "target_mape",
                                "loo_mape", "before_med", "target_med", "loo_med", "min_op_over_roofline"],
                       float_fmt=".2f"))
    write_result("mla_accuracy", {"model": MLA_TABLE_MODEL, "train_fraction": args.train_fraction,
                                  "seed": args.seed, "rows": table, "fit_rows": groups})
    return 0


if __name__ == "__main__":
    sys.exit(main())
