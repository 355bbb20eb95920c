"""Which kernels vLLM runs per GPU, and what a cross-generation calibration borrows (named in `profiles`)."""

from __future__ import annotations

import pytest

from kernelsight.calibrate.fit.transfer import borrowed_kernels, runs_fa2_decode, similarity_weights
from kernelsight.cli import main
from kernelsight.profiles import load_hardware
from kernelsight.simcore.attention_dispatch import attention_kernel, gemm_generation, kernel_lineage


@pytest.mark.parametrize(("gpu", "attention", "gemm"), [
    ("a100", "FlashAttention-2", "mma.sync"), ("l40s", "FlashAttention-2", "mma.sync"),
    ("h100", "FlashAttention-3", "wgmma"), ("h200", "FlashAttention-3", "wgmma"),
    ("b200", "FlashInfer (TRT-LLM)", "tcgen05"), ("rtx-pro-6000", "FlashAttention-2", "mma.sync"),
    ("mi300x", "ROCm AITER/Triton", "MFMA"),
])
def test_the_kernels_vllm_runs(gpu, attention, gemm):
    hw = load_hardware(gpu)
    assert attention_kernel(hw) == attention and gemm_generation(hw) == gemm
    assert kernel_lineage(hw) == f"{attention}, {gemm} GEMMs"
    assert runs_fa2_decode(hw) == (attention == "FlashAttention-2")


def test_borrowed_kernels_are_the_transfer_weights_heaviest_first():
    h200 = load_hardware("h200")
    sources = [load_hardware(g) for g in ("a100-sxm", "h100-sxm", "l40s", "h200")]   # the target itself drops out
    borrowed = borrowed_kernels(h200, sources)
    assert [g for g, _, _ in borrowed][0] == "h100-sxm" and len(borrowed) == 3
    assert sum(w for _, w, _ in borrowed) == pytest.approx(1.0)
    weights = dict(zip(("a100-sxm", "h100-sxm", "l40s"), similarity_weights(h200, sources[:3]), strict=True))
    assert all(w == pytest.approx(weights[g]) for g, w, _ in borrowed)


def test_profiles_names_what_each_cross_generation_gpu_borrows(capsys):
    assert main(["profiles"]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.strip().startswith("b200-sxm"))
    assert "runs FlashInfer (TRT-LLM), tcgen05 GEMMs; borrows from h100-sxm" in lines[i + 1]
    assert "NVFP4 GEMMs from rtx-pro-6000" in lines[i + 1]
    # no Blackwell source: FlashInfer's kernels there from the sources that ran a portable kernel (Triton, Marlin)
    assert "MoE bf16 (flashinfer_cutlass) from h100-sxm+l40s, fp8 (flashinfer_cutlass) from l40s," in lines[i + 1]
    assert "w4a16_mxfp4 (flashinfer_trtllm) from l40s;" in lines[i + 1]
    k = next(i for i, ln in enumerate(lines) if ln.strip().startswith("h200-sxm"))
    assert "MoE bf16 (triton) from h100-sxm, fp8 (flashinfer_cutlass) from h100-sxm," in lines[k + 1]
    j = next(i for i, ln in enumerate(lines) if ln.strip().startswith("h100-sxm"))
    assert "borrows" not in lines[j + 1]     # measured: nothing borrowed
