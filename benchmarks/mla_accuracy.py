"""How well the MLA decomposition (``simcore/mla.py``) prices DeepSeek-V3's attention module on the shared tables.

Every ``mla_context`` / ``mla_generation`` row of scope ``module`` (the whole MLA attention module of one layer as vLLM
runs it: down/up projections, norms, RoPE, the latent write, attention, o_proj) is priced as the sum of the kernels
the simulator composes for it (``mla_row_kernels`` plus ``mla_prefill_kernels`` or ``mla_decode_kernels``), each from
the GPU's own bundled calibration (target-measured tier; the tables' release picks the stack), eagerly: the module
tables time eager launches. ``num_heads`` is the rank's share of 128 heads, so tp = 128 / num_heads.

Prints MAPE and the median signed error per (GPU, phase, backend, KV dtype, GEMM format) and writes
``benchmarks/results/mla_accuracy.json``.

    python benchmarks/mla_accuracy.py [--data ../shared/data/kernels]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED_DATA, write_result  # noqa: E402

from kernelsight.calibrate.evaluate import measured_gpu_dirs  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.profiles import load_calibration, load_hardware, load_model  # noqa: E402
from kernelsight.simcore.gemm_dispatch import BLOCK, DYNAMIC_GROUP, Fp8Scheme  # noqa: E402
from kernelsight.simcore.kernel_shapes import PrefillChunk  # noqa: E402
from kernelsight.simcore.mla import mla_decode_kernels, mla_prefill_kernels, mla_row_kernels  # noqa: E402
from kernelsight.simcore.precision import resolve_precision  # noqa: E402
from kernelsight.simcore.step_model import StepConfig, StepModel  # noqa: E402

MODEL = "deepseek-ai/DeepSeek-V3"
#: the tables' GEMM formats as vLLM quantizations (DeepSeek-V3's fp8 checkpoint: 128x128 weight blocks)
QUANTIZATION = {"bf16": None, "fp8_block": "fp8", "nvfp4": "modelopt_fp4"}


def module_s(sm: StepModel, phase: str, batch: int, isl: int, step: int, tp: int) -> float:
    model, prec = sm.model, sm.precision
    if phase == "context":
        ks = (mla_row_kernels(model, batch * isl, tp, prec, 1)
              + mla_prefill_kernels(model, (PrefillChunk(isl, 0, True),) * batch, tp, prec, 1))
    else:
        ks = mla_row_kernels(model, batch, tp, prec, 1) + mla_decode_kernels(model, batch, batch * (step + 1), tp,
                                                                             prec, 1)
    return sum(sm.kernel_time_s(k) for k in ks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=SHARED_DATA / "kernels")
    args = ap.parse_args(argv)
    model = load_model(MODEL)
    rows_out = []
    for folder, gpu in sorted(measured_gpu_dirs(args.data).items()):
        hw = load_hardware(gpu)
        version = folder.split("@vllm-")[1] if "@vllm-" in folder else None
        calib = load_calibration(gpu, vllm_version=version)
        models: dict[tuple, StepModel] = {}
        for phase in ("context", "generation"):
            path = args.data / folder / f"mla_{phase}.csv.gz"
            if not path.is_file():
                continue
            errs: dict[tuple, list[float]] = defaultdict(list)
            with gzip.open(path, "rt") as f:
                for r in csv.DictReader(f):
                    if r["scope"] != "module" or r["gemm_dtype"] not in QUANTIZATION or r["dtype"] != "bf16":
                        continue
                    g, kv = r["gemm_dtype"], r["kv_dtype"]
                    tp = 128 // int(r["num_heads"])
                    key = (g, kv, tp)
                    sm = models.get(key)
                    if sm is None:
                        scheme = Fp8Scheme(BLOCK, DYNAMIC_GROUP, 128, 128) if g == "fp8_block" else None
                        prec = resolve_precision("bfloat16", QUANTIZATION[g], "fp8" if kv == "fp8" else "auto", scheme,
                                                 hw.compute_capability)
                        sm = models[key] = StepModel(model, hw, calib, prec, StepConfig(tp=tp, enforce_eager=True))
                    pred = module_s(sm, phase, int(r["batch"]), int(r["isl"]), int(r["step"]), tp)
                    errs[(r["kernel"], kv, g)].append(pred / (float(r["latency_us"]) * 1e-6) - 1.0)
            for (backend, kv, g), e in sorted(errs.items()):
                a = np.array(e)
                rows_out.append({"gpu": folder, "phase": phase, "backend": backend, "kv_dtype": kv, "gemm": g,
                                 "rows": len(a), "mape_pct": round(float(100 * np.mean(np.abs(a))), 1),
                                 "median_signed_pct": round(float(100 * np.median(a)), 1)})
    print(format_table(rows_out, ["gpu", "phase", "backend", "kv_dtype", "gemm", "rows", "mape_pct",
                                  "median_signed_pct"], float_fmt=".1f"))
    write_result("mla_accuracy", {"model": MODEL, "groups": rows_out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
