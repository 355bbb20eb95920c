"""Static pruning: what can be decided about a point without simulating it.

* the engine cannot be built: TP beyond a node or not dividing the heads, a format the GPU lacks, weights or one
  max-length request's KV cache not fitting in memory (``simcore.memory``'s own error, as vLLM's);
* roofline: every decode step reads the active weights once, so no step is shorter than
  ``active weight bytes per GPU / datasheet bandwidth``; a TPOT or ITL limit below that (or a TTFT limit below one
  step, an E2EL limit below its requests' decode floor) cannot be met at any load;
* speculative decoding: a step still reads the weights once and a first token still takes a step, but a request
  may gain up to ``1 + k`` tokens per step, so the TPOT and E2EL floors (and the tokens per step of the load
  bound) allow that many; the FLOP bound stands (every output token is a position the target computed);
* roofline on load: an engine makes at most ``max_num_seqs`` output tokens per step, and at most
  ``TP · peak FLOP/s / (2 · active parameters)`` tokens per second (a DP group of N ranks N times that); a
  deployment whose replicas (or a P/D split whose decode engines) together cannot produce the workload's output
  tokens at the requested rate builds an unbounded queue, so fewer than that are never simulated. Prefill work is
  left out of this bound (prefix caching may skip it), which keeps it a bound.

Memory is checked per rank by the engine's own ``simcore.memory``: a MoE model's experts are split over the
DP × TP GPUs of its group (whole experts with expert parallelism, slices without), so a MoE model that does not fit
one GPU at TP1 can fit each rank of DP2; the step floor uses that rank's weights (sound: the busiest rank reads at
least its non-expert weights and its share of the active experts).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import numpy as np

from kernelsight import profiles
from kernelsight.engine_args import draft_model_spec
from kernelsight.plan.slo import Slo
from kernelsight.plan.space import EngineChoice
from kernelsight.simcore.engine_config import EngineArgs, EngineConfig, resolve_engine_config
from kernelsight.simcore.hardware import HardwareSpec
from kernelsight.simcore.kv_transfer import KVLink, kv_link
from kernelsight.simcore.memory import InsufficientMemoryError, param_counts

__all__ = ["Bounds", "WorkloadShape", "create_engine_config", "resolve_choice", "engine_args_for", "min_replicas",
           "pd_link",
           "roofline_bounds",
           "slo_floor_violation",
           "REASON_INVALID", "REASON_MEMORY", "REASON_NO_PRICE", "REASON_ROOFLINE_SLO", "REASON_ROOFLINE_LOAD",
           "REASON_MAX_GPUS", "REASON_DOMINATED", "REASON_MONOTONE"]

REASON_NO_PRICE = "no price for the GPU in the price table"
REASON_INVALID = "engine cannot be built (TP, heads, format)"
REASON_MEMORY = "does not fit in GPU memory"
REASON_ROOFLINE_SLO = "roofline (the SLO is below the GPU's step floor)"
REASON_ROOFLINE_LOAD = "roofline (the replicas cannot produce the load's output tokens)"
REASON_MAX_GPUS = "more GPUs than --max-gpus"
REASON_DOMINATED = "dominated (costs more than a deployment that meets the SLO)"
REASON_MONOTONE = "monotone in load (decided by the same engine with fewer/more replicas or P/D engines)"


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """What the bounds need of the workload."""

    mean_output_tokens: float
    output_tokens: np.ndarray
    max_prompt_tokens: int

    @classmethod
    def of(cls, prompt_lens: list[int], output_lens: list[int]) -> WorkloadShape:
        out = np.asarray(output_lens, dtype=float)
        return cls(float(out.mean()) if out.size else 0.0, out, max(prompt_lens, default=0))


@dataclass(frozen=True, slots=True)
class Bounds:
    step_floor_s: float                 # no engine step is shorter (active weights read at datasheet bandwidth)
    max_rate_per_replica: float         # requests/s one replica (a whole DP group) can at most complete
    max_tokens_per_step: int = 1        # a request's output tokens per step at most (1 + k with speculation)


_PROFILES: dict[tuple, tuple] = {}


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """``engine_args.create_engine_config`` with the loaded profiles kept per process: a calibration table takes
    ~0.3 s to load, and a search resolves dozens of engines on the same few GPUs."""
    key = (args.model, args.hardware, args.calibration, args.vllm_version)
    if key not in _PROFILES:
        model = profiles.load_model(args.model)
        hw = profiles.load_hardware(args.hardware)
        calib = profiles.load_calibration(hw.name, args.calibration, vllm_version=args.vllm_version)
        _PROFILES[key] = (model, hw, calib)
    return resolve_engine_config(args, *_PROFILES[key], draft_model_spec(args))


def resolve_choice(choice: EngineChoice, base: EngineArgs, shape: WorkloadShape) -> tuple[EngineConfig | None, str]:
    """The engine's resolved configuration, or None and the prune reason (with the engine's own message)."""
    args = engine_args_for(choice, base)
    try:
        cfg = create_engine_config(args)
    except InsufficientMemoryError as exc:
        return None, f"{REASON_MEMORY}: {str(exc).split('. ')[0]}"
    except ValueError as exc:
        return None, f"{REASON_INVALID}: {exc}"
    if choice.quantization == "fp8" and cfg.hardware.fp8_flops_per_s is None:
        # vLLM runs fp8 checkpoints there as weight-only (Marlin) kernels, which the kernel model does not have
        return None, f"{REASON_INVALID}: {cfg.hardware.name} has no fp8 tensor cores (W8A8 fp8 not modelled)"
    if shape.max_prompt_tokens >= cfg.scheduler.max_model_len:
        return None, (f"{REASON_INVALID}: prompts of {shape.max_prompt_tokens} tokens exceed max_model_len "
                      f"{cfg.scheduler.max_model_len}")
    return cfg, ""


def pd_link(hw: HardwareSpec, spec: tuple[str | None, float | None, float | None] | None) -> KVLink:
    """The link of ``--kv-transfer-link/-bandwidth-gbps/-latency-us`` on ``hw`` (ValueError where the GPU lacks
    it, e.g. NVLink on an L40S); None: the profile's default link."""
    kind, gbps, latency_us = spec or (None, None, None)
    return kv_link(hw, kind, bandwidth_gbps=gbps, latency_s=None if latency_us is None else latency_us * 1e-6)


def engine_args_for(choice: EngineChoice, base: EngineArgs) -> EngineArgs:
    """``base`` (the flags the planner does not vary) with the choice's values."""
    return dataclasses.replace(base, hardware=choice.hardware, tensor_parallel_size=choice.tensor_parallel_size,
                               max_num_seqs=choice.max_num_seqs, max_num_batched_tokens=choice.max_num_batched_tokens,
                               quantization=choice.quantization, kv_cache_dtype=choice.kv_cache_dtype,
                               data_parallel_size=choice.data_parallel_size,
                               enable_expert_parallel=choice.enable_expert_parallel,
                               speculative_config=(json.loads(choice.speculative_config)
                                                   if choice.speculative_config is not None else None))


def _active_fraction(cfg: EngineConfig) -> float:
    """Share of the linear weights one token touches (1 for dense; routed experts only for MoE)."""
    m = cfg.model
    if not m.is_moe:
        return 1.0
    linear, _ = param_counts(m)
    idle = m.num_moe_layers * (m.num_experts - m.experts_per_token) * 3 * m.hidden_size * m.moe_intermediate_size
    return (linear - idle) / linear


def roofline_bounds(cfg: EngineConfig, shape: WorkloadShape) -> Bounds:
    hw = cfg.hardware
    tp = cfg.args.tensor_parallel_size
    dp = cfg.args.data_parallel_size
    active = _active_fraction(cfg)
    # memory.weight_bytes is one rank's (experts split over the DP ranks of a MoE group): weight_bytes × active
    # stays below the busiest rank's read, its non-expert weights plus its share of the active experts
    step_floor_s = cfg.memory.weight_bytes * active / hw.mem_bytes_per_s
    linear, other = param_counts(cfg.model)
    flops_per_token = 2.0 * (linear * active + other)
    per_step = 1 + (cfg.speculative.num_speculative_tokens if cfg.speculative is not None else 0)
    tokens_per_s = dp * min(cfg.scheduler.max_num_seqs * per_step / step_floor_s,
                            tp * hw.peak_flops_per_s(cfg.precision.gemm_compute_dtype) / flops_per_token)
    max_rate = tokens_per_s / max(shape.mean_output_tokens, 1.0)
    return Bounds(step_floor_s, max_rate, per_step)


def slo_floor_violation(bounds: Bounds, slo: Slo, shape: WorkloadShape) -> str:
    """Why no load can meet ``slo`` on this engine (empty when the floor allows it)."""
    floor_ms = bounds.step_floor_s * 1000.0
    per_step = bounds.max_tokens_per_step      # an ITL is one step's tokens (one chunk), a TPOT their share of it
    for lim in slo.limits:
        if lim.metric in ("itl", "ttft"):
            lb_ms = floor_ms
        elif lim.metric == "tpot":
            lb_ms = floor_ms / per_step
        else:    # e2el ≥ one step per output token (1 + k of them with speculation), at the statistic's percentile
            q = 50.0 if lim.stat in ("mean", "median") else float(lim.stat[1:])
            lb_ms = (floor_ms * float(np.percentile(shape.output_tokens, q)) / per_step
                     if shape.output_tokens.size else 0.0)
        if lb_ms > lim.limit_ms:
            return (f"{REASON_ROOFLINE_SLO}: {lim.name} ≥ {lb_ms:.1f} ms (active weights per GPU at datasheet "
                    f"bandwidth) > {lim.limit_ms:g}")
    return ""


def min_replicas(bounds: Bounds, request_rate: float) -> int:
    """Fewest replicas whose output-token ceiling covers the request rate."""
    if not math.isfinite(request_rate):
        return 1
    return max(1, math.ceil(request_rate / bounds.max_rate_per_replica - 1e-9))
