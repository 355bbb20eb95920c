"""The search space: engine choices (GPU, TP, DP/EP, batch limits, weight and KV formats) × deployments of them.

A :class:`Deployment` is one engine choice run either as ``replicas`` copies behind a round-robin router
(``loadgen.fastforward.run_replicas``) or as a prefill/decode split ``XPyD`` (``loadgen.pd_fastforward.run_pd``).

Data parallelism is searched for MoE models only. There ``--data-parallel-size N`` is not N replicas: the ranks'
MoE layers form one group (experts split over the N·TP GPUs, tensor-sliced or, with ``--enable-expert-parallel``,
whole experts per GPU), so the ranks step in lockstep and the weights per GPU shrink. For a dense model the N ranks
are independent engines; all that differs from N replicas is the router (vLLM's coordinator sends a request to
the least-loaded rank, the replicas' router round robin), which is not worth doubling the search for: dense DP is
searched as replicas. A replica of a DP group is the whole group (TP × DP GPUs).

Speculative decoding is a dimension when asked for (``--speculative-config 'none;{...}'``): each engine choice runs
with each config, kept as its canonical JSON (sorted keys) so that a choice stays hashable and its label and cache
key name it.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EngineChoice", "Deployment", "SearchSpace", "DEFAULT_GPUS", "pd_label", "canonical_spec", "spec_label"]

#: GPUs searched when --gpus is not given: the datacenter GPUs with a bundled example price.
DEFAULT_GPUS = ("a100-sxm", "h100-sxm", "h200-sxm", "b200-sxm", "l40s", "mi300x")


def pd_label(pd: tuple[int, int]) -> str:
    """(2, 3) → ``2P3D``, as ``kernelsight simulate --pd`` takes it."""
    return f"{pd[0]}P{pd[1]}D"


def canonical_spec(config: dict[str, Any] | None) -> str | None:
    """A ``--speculative-config`` object as the JSON a choice holds (None: no speculation)."""
    return None if config is None else json.dumps(config, sort_keys=True, separators=(",", ":"))


def spec_label(spec: str | None) -> str:
    """``spec ngram k3``, ``spec mtp k1``: the method and draft count of a choice's speculative config."""
    if spec is None:
        return ""
    c = json.loads(spec)
    method = c.get("method") or ("draft_model" if c.get("model") else "?")
    return f"spec {method} k{c.get('num_speculative_tokens', 1)}"


@dataclass(frozen=True, slots=True, order=True)
class EngineChoice:
    """One engine configuration (the flags of ``vllm serve`` the planner varies); None = vLLM's default."""

    hardware: str
    tensor_parallel_size: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    speculative_config: str | None = None     # canonical JSON (canonical_spec); None: no speculative decoding

    @property
    def gpus_per_engine(self) -> int:
        """GPUs of one engine (a DP group counts as one engine of TP × DP GPUs)."""
        return self.tensor_parallel_size * self.data_parallel_size

    def label(self) -> str:
        parts = [f"{self.hardware} TP{self.tensor_parallel_size}"]
        if self.data_parallel_size > 1:
            parts.append(f"DP{self.data_parallel_size}" + ("+EP" if self.enable_expert_parallel else ""))
        elif self.enable_expert_parallel:
            parts[0] += "+EP"
        if self.quantization:
            parts.append(f"w{self.quantization}")
        if self.kv_cache_dtype != "auto":
            parts.append(f"kv {self.kv_cache_dtype}")
        if self.max_num_seqs is not None:
            parts.append(f"seqs {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None:
            parts.append(f"mbt {self.max_num_batched_tokens}")
        if self.speculative_config is not None:
            parts.append(spec_label(self.speculative_config))
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True, order=True)
class Deployment:
    engine: EngineChoice
    replicas: int = 1
    pd: tuple[int, int] | None = None      # (prefill, decode) engines of a P/D split; replicas is 1 then

    @property
    def num_gpus(self) -> int:
        if self.pd is not None:
            return self.engine.gpus_per_engine * (self.pd[0] + self.pd[1])
        return self.engine.gpus_per_engine * self.replicas

    def label(self) -> str:
        if self.pd is not None:
            return f"{pd_label(self.pd)} {self.engine.label()}"
        return f"{self.replicas}× {self.engine.label()}"

    def as_dict(self) -> dict[str, Any]:
        return {**self.engine.as_dict(), "replicas": self.replicas,
                "pd": pd_label(self.pd) if self.pd else None, "num_gpus": self.num_gpus}


@dataclass(slots=True)
class SearchSpace:
    gpus: tuple[str, ...] = DEFAULT_GPUS
    tensor_parallel_sizes: tuple[int, ...] = (1, 2, 4, 8)
    replicas: tuple[int, ...] = tuple(range(1, 9))
    max_num_seqs: tuple[int | None, ...] = (None,)
    max_num_batched_tokens: tuple[int | None, ...] = (None,)
    quantizations: tuple[str | None, ...] = (None, "fp8")
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    #: data-parallel sizes (MoE models; a dense model's DP is its replicas, see the module doc)
    data_parallel_sizes: tuple[int, ...] = (1,)
    #: expert parallelism off / on (MoE models over more than one GPU: DP > 1, or TP > 1 at one DP rank)
    expert_parallel: tuple[bool, ...] = (False,)
    #: speculative configs to try, as canonical JSON (None: without speculative decoding)
    speculative_configs: tuple[str | None, ...] = (None,)
    #: P/D splits XPyD with X + Y ≤ pd_max engines (0: none); single-rank engines only, as ``simulate --pd``
    pd_max: int = 0
    #: the link a split's decode engines pull KV over: (kind, Gb/s, µs) as ``--kv-transfer-*`` (None: the GPU
    #: profile's default link, NVLink where the GPU has it, else PCIe)
    kv_link: tuple[str | None, float | None, float | None] | None = None
    max_gpus: int = 64
    extra: dict[str, Any] = field(default_factory=dict)

    def engine_choices(self, moe: bool = False) -> list[EngineChoice]:
        dps = self.data_parallel_sizes if moe else (1,)
        parallel = sorted({(dp, ep) for dp in dps for ep in self.expert_parallel} if moe else {(1, False)})
        return [EngineChoice(hw, tp, seqs, mbt, q, kv, dp, ep, spec)
                for hw, tp, seqs, mbt, q, kv, (dp, ep), spec in itertools.product(
                    self.gpus, self.tensor_parallel_sizes, self.max_num_seqs, self.max_num_batched_tokens,
                    self.quantizations, self.kv_cache_dtypes, parallel, self.speculative_configs)
                if not ep or dp * tp > 1]           # EP on one GPU is the same engine as without

    def pd_splits(self) -> list[tuple[int, int]]:
        """Every XPyD with X, Y ≥ 1 and X + Y ≤ pd_max, fewest engines first."""
        return sorted(((x, n - x) for n in range(2, self.pd_max + 1) for x in range(1, n)),
                      key=lambda s: (s[0] + s[1], s))

    def deployments_of(self, choice: EngineChoice) -> int:
        """Points an engine choice contributes: its replica counts, and its P/D splits when it is one rank."""
        return len(self.replicas) + (len(self.pd_splits()) if choice.data_parallel_size == 1 else 0)

    def size(self, moe: bool = False) -> int:
        return sum(self.deployments_of(c) for c in self.engine_choices(moe))
