"""How well a block-scaled FP8 GEMM's GPU time is priced: the measured rows where the GPU, not dispatch, sets it.

The shared block-fp8 tables time vLLM's eager per-call path (a 55–300 µs host floor per kernel); only rows well above
that floor (latency > 3× the kernel's smallest) time the kernel itself. On those rows, per GPU and vLLM kernel, this
prints the MAPE of three ways to price them: the bundled calibration's own fp8_block model (fitted on every row,
floor included: what `calibrate eval` scores), the per-tensor fp8 model (what the step model used for block
checkpoints before gemm_dispatch), the per-tensor model times ``BLOCK_FP8_TIME_RATIO`` (the step model's fallback
below a kernel's floor; the ratios are medians of these same rows, so this is in-sample), and what the step model
now prices for a Qwen3-32B-FP8-style layer of that shape (the block model where it is GPU-bound, blended down to the
fallback; ``StepModel._fp8_linear_s``). Writes benchmarks/results/block_fp8_pricing.json.
Usage: python benchmarks/block_fp8_pricing.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import SHARED_DATA, write_result  # noqa: E402

from kernelsight.calibrate.fit.block_fp8 import GPU_BOUND_FACTOR, compute_bound  # noqa: E402
from kernelsight.calibrate.measurements import read_table  # noqa: E402
from kernelsight.calibrate.rows import predict_rows_s  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.profiles import load_calibration, load_hardware, load_model  # noqa: E402
from kernelsight.simcore import kernels as K  # noqa: E402
from kernelsight.simcore.gemm_dispatch import block_time_ratio  # noqa: E402
from kernelsight.simcore.precision import resolve_precision  # noqa: E402
from kernelsight.simcore.step_model import StepConfig, StepModel  # noqa: E402

GPUS = (("h100_sxm", "h100"), ("l40s", "l40s"), ("rtx_pro_6000_server", "rtx-pro-6000"))


def mape(pred: np.ndarray, real: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - real) / real) * 100.0)


def main() -> int:
    out = []
    qwen = load_model("Qwen/Qwen3-32B-FP8")
    for gpu, name in GPUS:
        hw, calib = load_hardware(name), load_calibration(load_hardware(name).name)
        precision = resolve_precision("bfloat16", "fp8", fp8_scheme=qwen.fp8_scheme,
                                      compute_capability=hw.compute_capability)
        sm = StepModel(qwen, hw, calib, precision, StepConfig())
        table = read_table(SHARED_DATA / "kernels" / gpu / "gemm.csv.gz", skipped={})
        cols = table.columns
        block = cols["dtype"] == "fp8_block"
        kern, lat = cols["kernel"].astype(str), cols["latency_us"] * 1e-6
        sub = {k: v[block] for k, v in cols.items()}
        own = predict_rows_s("gemm", sub, hw, calib)
        per_tensor = predict_rows_s("gemm", {**sub, "dtype": np.full(int(block.sum()), "fp8")}, hw, calib)
        k_b, lat_b = kern[block], lat[block]
        for kernel in np.unique(k_b):
            sel = k_b == kernel
            bound = sel & (lat_b > GPU_BOUND_FACTOR * lat_b[sel].min())
            if not bound.any():
                out.append({"gpu": gpu, "kernel": kernel, "gpu_bound_rows": 0, "block_model_mape": float("nan"),
                            "per_tensor_mape": float("nan"), "per_tensor_x_ratio_mape": float("nan"),
                            "step_model_mape": float("nan")})
                continue
            idx = np.flatnonzero(bound)
            ratio = np.array([block_time_ratio(kernel, compute_bound(int(sub["m"][i]), int(sub["n"][i]),
                                                                     int(sub["k"][i]), hw)) for i in idx])
            step = np.array([sm.kernel_time_s(K.linear_kernel("gemm", int(sub["m"][i]), int(sub["n"][i]),
                                                              int(sub["k"][i]), precision)) for i in idx])
            out.append({"gpu": gpu, "kernel": kernel, "gpu_bound_rows": len(idx),
                        "block_model_mape": mape(own[idx], lat_b[idx]),
                        "per_tensor_mape": mape(per_tensor[idx], lat_b[idx]),
                        "per_tensor_x_ratio_mape": mape(per_tensor[idx] * ratio, lat_b[idx]),
                        "step_model_mape": mape(step, lat_b[idx])})
            print(format_table([out[-1]], list(out[-1])).splitlines()[-1], flush=True)
    print(format_table(out, list(out[0])))
    path = write_result("block_fp8_pricing", {"rows": out, "gpu_bound_factor": GPU_BOUND_FACTOR})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
