"""FP8 checkpoints against their bf16 twins: decode step time and the GEMM kernel vLLM runs, per GPU.

For each GPU and model pair (Llama-3.1-8B with vLLM's online --quantization fp8, Qwen3-32B-FP8's 128x128 blocks,
NVIDIA's static per-tensor Llama-3.1-70B FP8) prints the simulated decode step (every sequence at a 2,048-token
context) and its GEMM time in fp8 and bf16 at several batch sizes, their ratio, and which vLLM kernel each
linear layer dispatches to at that batch. On a GPU with FP8 tensor cores an fp8 step slower than bf16 (ratio > 1)
is a pricing fault unless the GPU's own tables show it for that kernel. Writes benchmarks/results/fp8_dispatch.json.
Usage: python benchmarks/fp8_dispatch.py [--hardware h100,b200,...] [--batches 1,8,...]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_result  # noqa: E402

from kernelsight.engine_args import create_engine_config  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.simcore import kernels as K  # noqa: E402
from kernelsight.simcore.engine_config import EngineArgs, build_step_model  # noqa: E402
from kernelsight.simcore.kernels import BatchShape  # noqa: E402

#: (label, fp8 model, its --quantization, bf16 twin, tensor-parallel size)
PAIRS = (
    ("Llama-3.1-8B online", "meta-llama/Llama-3.1-8B", "fp8", "meta-llama/Llama-3.1-8B", 1),
    ("Qwen3-32B-FP8 block", "Qwen/Qwen3-32B-FP8", None, "Qwen/Qwen3-32B", 2),
    ("Llama-3.1-70B-FP8 tensor", "nvidia/Llama-3.1-70B-Instruct-FP8", None, "meta-llama/Llama-3.1-70B", 4),
)
CONTEXT_TOKENS = 2048


def step_model(model: str, quantization: str | None, hardware: str, tp: int):
    return build_step_model(create_engine_config(EngineArgs(model=model, quantization=quantization,
                                                            hardware=hardware, tensor_parallel_size=tp,
                                                            max_model_len=4096)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hardware", default="h100,h200,b200,gb200,l40s,rtx-pro-6000,a100")
    ap.add_argument("--batches", default="1,8,32,128,256")
    ns = ap.parse_args()
    batches = [int(b) for b in ns.batches.split(",")]
    out = []
    for hw in ns.hardware.split(","):
        for label, fp8_model, quant, bf16_model, tp in PAIRS:
            fp8, bf16 = step_model(fp8_model, quant, hw, tp), step_model(bf16_model, None, hw, tp)
            for b in batches:
                shape = BatchShape((), b, b * CONTEXT_TOKENS)
                f, g = fp8.breakdown_dict(shape), bf16.breakdown_dict(shape)
                tf, tb = fp8.step_time_s(shape), bf16.step_time_s(shape)
                m = fp8.graph_mode(shape)[1]
                impls = sorted({getattr(k, "impl", "") or "-" for k in K.row_kernels(fp8.model, m, tp, fp8.precision)
                                if k.family == K.GEMM and k.name != "lm_head"})
                out.append({"gpu": hw, "pair": label, "batch": b, "fp8_step_ms": tf * 1e3, "bf16_step_ms": tb * 1e3,
                            "step_ratio": tf / tb, "fp8_gemm_ms": f["gemm"] * 1e3, "bf16_gemm_ms": g["gemm"] * 1e3,
                            "gemm_ratio": f["gemm"] / g["gemm"],
                            "kernels": "+".join(i.replace("ScaledMMLinearKernel", "").replace("ScaledMMKernel", "")
                                                for i in impls)})
    print(format_table(out, list(out[0])))
    worst = max(out, key=lambda r: r["step_ratio"])
    print(f"largest fp8/bf16 decode step ratio: {worst['step_ratio']:.3f} ({worst['gpu']}, {worst['pair']}, "
          f"batch {worst['batch']}); fp8 steps slower than bf16: {sum(r['step_ratio'] > 1 for r in out)} of {len(out)}")
    path = write_result("fp8_dispatch", {"rows": out, "context_tokens": CONTEXT_TOKENS})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
