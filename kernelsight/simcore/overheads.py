"""The fixed costs around a step's kernels: the engine core's CPU time per step and the CUDA-graph launch cost.

Both are properties of vLLM and the host (the launch cost also of the GPU's driver path), not of a kernel: a
:class:`~kernelsight.simcore.calibration.Calibration` carries one of each, the step model adds what of them the GPU
does not hide.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostModel:
    """CPU time of one engine step in vLLM V1's engine core (schedule, prepare inputs, sample, process
    outputs): ``cpu_s = base_s + per_seq_s · num_seqs + per_token_s · num_tokens``.

    Without async scheduling the GPU waits for it every step; with async scheduling (vLLM's default in
    0.33) the next step is prepared while the GPU runs, so only ``max(cpu_s − gpu_s, 0) + async_exposed_s``
    shows. It is a property of vLLM and the host CPU, not of the GPU. Defaults: base and per-sequence costs
    fitted on the closed-loop H100 runs of shared/data/e2e/aic_silicon_vllm_h100.csv (vLLM 0.12, run
    without async scheduling; ``benchmarks/fit_host.py``), the exposed remainder on the RTX 4090 trace run
    (vLLM 0.19, async).
    """

    base_s: float = 0.00135
    per_seq_s: float = 6.3e-5
    per_token_s: float = 2.0e-8
    async_exposed_s: float = 0.0001

    def cpu_s(self, num_seqs: int, num_tokens: int) -> float:
        return self.base_s + self.per_seq_s * num_seqs + self.per_token_s * num_tokens

    def exposed_s(self, cpu_s: float, gpu_s: float, async_scheduling: bool) -> float:
        if not async_scheduling:
            return cpu_s
        return max(cpu_s - gpu_s, 0.0) + self.async_exposed_s

    def to_dict(self) -> dict[str, float]:
        return {"base_s": self.base_s, "per_seq_s": self.per_seq_s, "per_token_s": self.per_token_s,
                "async_exposed_s": self.async_exposed_s}


@dataclass(frozen=True, slots=True)
class LaunchModel:
    """Launch costs by CUDA-graph mode (a property of vLLM + the GPU's driver path).

    full graph (decode-only, padded to a capture size): one graph launch per step;
    piecewise (mixed batches up to the largest capture size): one piece per layer plus attention
    launched eagerly; eager (larger batches): every kernel launched from the CPU.
    """

    full_graph_step_s: float = 2.0e-5
    piecewise_per_layer_s: float = 6.0e-6
    eager_per_kernel_s: float = 3.0e-6

    def to_dict(self) -> dict[str, float]:
        return {
            "full_graph_step_s": self.full_graph_step_s,
            "piecewise_per_layer_s": self.piecewise_per_layer_s,
            "eager_per_kernel_s": self.eager_per_kernel_s,
        }


__all__ = ["HostModel", "LaunchModel"]
