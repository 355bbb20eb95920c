"""The search space: engine choices (GPU, TP, batch limits, weight and KV formats) × replica counts.

A :class:`Deployment` is one engine choice run as ``replicas`` independent engines behind a round-robin router
(``loadgen.fastforward.run_replicas``): data parallelism and replicas are the same thing to the simulator, which has
no shared front end. Expert parallelism is not modelled (MoE experts are sharded with TP), so it is not searched.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EngineChoice", "Deployment", "SearchSpace", "DEFAULT_GPUS"]

#: GPUs searched when --gpus is not given: the datacenter GPUs with a bundled example price.
DEFAULT_GPUS = ("a100-sxm", "h100-sxm", "h200-sxm", "b200-sxm", "l40s", "mi300x")


@dataclass(frozen=True, slots=True, order=True)
class EngineChoice:
    """One engine configuration (the flags of ``vllm serve`` the planner varies); None = vLLM's default."""

    hardware: str
    tensor_parallel_size: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"

    def label(self) -> str:
        parts = [f"{self.hardware} TP{self.tensor_parallel_size}"]
        if self.quantization:
            parts.append(f"w{self.quantization}")
        if self.kv_cache_dtype != "auto":
            parts.append(f"kv {self.kv_cache_dtype}")
        if self.max_num_seqs is not None:
            parts.append(f"seqs {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None:
            parts.append(f"mbt {self.max_num_batched_tokens}")
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True, order=True)
class Deployment:
    engine: EngineChoice
    replicas: int

    @property
    def num_gpus(self) -> int:
        return self.engine.tensor_parallel_size * self.replicas

    def label(self) -> str:
        return f"{self.replicas}× {self.engine.label()}"

    def as_dict(self) -> dict[str, Any]:
        return {**self.engine.as_dict(), "replicas": self.replicas, "num_gpus": self.num_gpus}


@dataclass(slots=True)
class SearchSpace:
    gpus: tuple[str, ...] = DEFAULT_GPUS
    tensor_parallel_sizes: tuple[int, ...] = (1, 2, 4, 8)
    replicas: tuple[int, ...] = tuple(range(1, 9))
    max_num_seqs: tuple[int | None, ...] = (None,)
    max_num_batched_tokens: tuple[int | None, ...] = (None,)
    quantizations: tuple[str | None, ...] = (None, "fp8")
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    max_gpus: int = 64
    extra: dict[str, Any] = field(default_factory=dict)

    def engine_choices(self) -> list[EngineChoice]:
        return [EngineChoice(hw, tp, seqs, mbt, q, kv) for hw, tp, seqs, mbt, q, kv in itertools.product(
            self.gpus, self.tensor_parallel_sizes, self.max_num_seqs, self.max_num_batched_tokens,
            self.quantizations, self.kv_cache_dtypes)]

    def size(self) -> int:
        return len(self.engine_choices()) * len(self.replicas)
