"""Engine arguments as vLLM takes them, resolved into a complete configuration (defaults as vLLM's)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kernelsight.simcore.calibration import Calibration, stack_note
from kernelsight.simcore.dp_group import (
    DPGroup,
    GroupMoESpecStepModel,
    GroupMoEStepModel,
    LockstepSpecStepModel,
    LockstepStepModel,
    MoEGroupTiming,
)
from kernelsight.simcore.engine import Engine
from kernelsight.simcore.expert_parallel import (
    ALL2ALL_BACKENDS,
    DEFAULT_ALL2ALL_BACKEND,
)
from kernelsight.simcore.gemm_dispatch import block_shape_error
from kernelsight.simcore.hardware import HardwareSpec, node_topology, with_node_topology
from kernelsight.simcore.hybrid_kv_cache import HybridKVCacheManager, hybrid_layout
from kernelsight.simcore.kv_cache import KVCacheManager
from kernelsight.simcore.kv_offload import KVOffload, OffloadConfig, resolve_offload
from kernelsight.simcore.kv_transfer import KVLink, kv_link, kv_transfer_model
from kernelsight.simcore.memory import MemoryPlan, kv_bytes_per_token, plan_memory, weight_bytes_per_rank
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.moe_routing import DEFAULT_EXPERT_ROUTING, power_law_alpha
from kernelsight.simcore.mtp import MTPStepModel
from kernelsight.simcore.precision import Precision, resolve_precision
from kernelsight.simcore.scheduler import FCFS, PRIORITY, SchedulerConfig
from kernelsight.simcore.spec_decode import (
    DRAFT_MODEL,
    MTP,
    NGRAM,
    SpecDecoder,
    SpeculativeConfig,
    resolve_speculative_config,
)
from kernelsight.simcore.spec_decode_step import EAGLE3_DRAFT_VOCAB, SpecStepModel, mtp_layers, one_layer_draft
from kernelsight.simcore.step_model import StepConfig, StepModel, default_cudagraph_capture_sizes

GIB = 1024**3
VALID_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)


@dataclass(slots=True)
class EngineArgs:
    """The subset of ``vllm serve`` engine flags the simulator honours (None = vLLM's default)."""

    model: str = "meta-llama/Llama-3.1-8B"
    hardware: str = "h100"
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    scheduling_policy: str = FCFS
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False
    max_cudagraph_capture_size: int | None = None
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = True        # vLLM 0.33 default; older releases scheduled synchronously
    calibration: str | None = None       # path to a calibration JSON (default: the bundled one)
    vllm_version: str | None = None      # the vLLM release priced: picks the GPU's bundled calibration of that stack
    disable_custom_all_reduce: bool = False   # vLLM's flag: every TP all-reduce on NCCL (or symmetric memory)
    node_topology: str | None = None     # how a node's GPUs are linked (hardware.NODE_TOPOLOGIES; None: the profile's)
    data_parallel_size: int = 1          # engines (each TP GPUs) behind one front end
    data_parallel_rank: int | None = None   # serve one rank of the group in this process (None: all)
    enable_expert_parallel: bool = False    # MoE experts split over the DP×TP ranks, which then step together
    all2all_backend: str = DEFAULT_ALL2ALL_BACKEND
    expert_routing: str = DEFAULT_EXPERT_ROUTING   # how tokens pick experts (moe_routing): balanced | power_law_<a>
    expert_load_imbalance: float | None = None   # busiest EP rank's routed tokens / mean (None: from the routing)
    speculative_config: dict[str, Any] | None = None   # vLLM's --speculative-config, as its JSON object
    speculative_acceptance_rates: tuple[float, ...] | None = None   # per-position override (kernelsight's flag)
    # KV offloading to host memory (vLLM's --kv-offloading-size, GiB over all TP ranks; None: off) and its backend;
    # the block size and offload_prompt_only of an OffloadingConnector's kv_connector_extra_config (None: defaults)
    kv_offloading_size_gib: float | None = None
    kv_offloading_backend: str = "native"
    kv_offloading_block_size: int | None = None
    kv_offloading_prompt_only: bool = True


@dataclass(slots=True)
class EngineConfig:
    """Everything resolved: what the engine runs with, reported in results as ``config``."""

    args: EngineArgs
    model: ModelSpec
    hardware: HardwareSpec
    calibration: Calibration
    precision: Precision
    scheduler: SchedulerConfig
    memory: MemoryPlan
    cudagraph_capture_sizes: tuple[int, ...] = field(default_factory=tuple)
    speculative: SpeculativeConfig | None = None
    draft_model: ModelSpec | None = None      # what the drafter runs (None: n-gram, no GPU draft)
    offload: OffloadConfig | None = None      # KV offloading's CPU tier (None: off)

    @property
    def num_gpu_blocks(self) -> int:
        return self.memory.num_gpu_blocks

    def summary(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "model": self.model.name, "hardware": self.hardware.name,
            "tensor_parallel_size": self.args.tensor_parallel_size,
            "dtype": self.precision.act_dtype,
            "quantization": self.args.quantization or self.model.quantization or self.model.expert_quantization,
            "fp8_scheme": self.precision.fp8_scheme.label if self.precision.fp8_scheme else None,
            "kv_cache_dtype": self.precision.kv_dtype,
            "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
            "max_model_len": s.max_model_len, "block_size": s.block_size,
            "enable_prefix_caching": s.enable_prefix_caching, "enable_chunked_prefill": s.enable_chunked_prefill,
            "scheduling_policy": s.policy, "gpu_memory_utilization": self.args.gpu_memory_utilization,
            "num_gpu_blocks": self.memory.num_gpu_blocks,
            # vLLM reports a hybrid model's KV tokens per group (each of its 2 groups holds a block per token page)
            "kv_cache_tokens": self.memory.num_gpu_blocks // (2 if self.model.is_hybrid_attention else 1)
            * s.block_size,
            "max_concurrency": round(self.memory.max_concurrency(s.max_model_len, s.block_size), 2),
            "weight_bytes_per_gpu": int(self.memory.weight_bytes),
            "enforce_eager": self.args.enforce_eager, "async_scheduling": self.args.async_scheduling,
            "max_cudagraph_capture_size": self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0,
            "calibration_tier": self.calibration.tier, "seed": self.args.seed,
            **self.stack_summary(),
            **({"node_topology": node_topology(self.hardware),
                "custom_all_reduce": not self.args.disable_custom_all_reduce}
               if self.args.tensor_parallel_size > 1 else {}),
            **self.parallel_summary(),
            **({"speculative_config": self.speculative.summary()} if self.speculative else {}),
            **(self.offload.summary() if self.offload else {}),
        }

    def stack_summary(self) -> dict[str, Any]:
        """The vLLM release the calibration's kernels were timed under, the release asked for (``--vllm-version``)
        and, where they differ, the line that says so (:func:`~kernelsight.simcore.calibration.stack_note`)."""
        out: dict[str, Any] = {"calibration_vllm": self.calibration.software.get("vllm", "")}
        if self.args.vllm_version:
            out["vllm_version"] = self.args.vllm_version
            note = stack_note(self.calibration, self.args.vllm_version)
            if note:
                out["calibration_note"] = note
        return out

    @staticmethod
    def calibration_label(summary: dict[str, Any]) -> str:
        """``target-measured, vLLM 0.19.0``: a :meth:`summary`'s calibration tier and the release its kernels were
        timed under (a run's report names both)."""
        timed = summary.get("calibration_vllm")
        return summary["calibration_tier"] + (f", vLLM {timed}" if timed else "")

    @property
    def tp_expert_parallel_size(self) -> int:
        """GPUs the experts are split over within one data-parallel rank: its TP group under
        ``--enable-expert-parallel`` with one DP rank (vLLM's ``FusedMoEParallelConfig``: ep_size = TP, the experts'
        TP = 1); 1 otherwise (TP-sharded experts, or EP across DP ranks, which the DP group prices)."""
        a = self.args
        if a.enable_expert_parallel and self.model.is_moe and a.data_parallel_size == 1 \
                and a.tensor_parallel_size > 1:
            return a.tensor_parallel_size
        return 1

    @property
    def expert_parallel(self) -> bool:
        """Expert parallelism in force: asked for, on a MoE model, across more than one data-parallel rank."""
        return self.args.enable_expert_parallel and self.model.is_moe and self.args.data_parallel_size > 1

    def parallel_summary(self) -> dict[str, Any]:
        """Data/expert-parallel settings, reported only when there is more than one rank (keeps DP=1 reports as
        they were)."""
        a = self.args
        if a.data_parallel_size == 1 and not a.enable_expert_parallel:
            return {}
        out: dict[str, Any] = {"data_parallel_size": a.data_parallel_size,
                               "enable_expert_parallel": a.enable_expert_parallel}
        if self.expert_parallel:
            out.update(all2all_backend=a.all2all_backend, expert_routing=a.expert_routing,
                       expert_load_imbalance=a.expert_load_imbalance)
        return out

    def args_dict(self) -> dict[str, Any]:
        return asdict(self.args)


def default_batch_limits(hw: HardwareSpec) -> tuple[int, int]:
    """vLLM's API-server defaults (max_num_batched_tokens, max_num_seqs) by device memory."""
    mem_gib = hw.mem_capacity_bytes / GIB
    if mem_gib >= 160:
        return 16384, 1024
    if mem_gib >= 70 and not hw.name.lower().startswith("a100"):
        return 8192, 1024
    return 2048, 256


def resolve_speculative(args: EngineArgs, model: ModelSpec, draft_model: ModelSpec | None = None
                        ) -> tuple[SpeculativeConfig | None, ModelSpec | None]:
    """The speculative config and the model its drafter runs: the given draft model (method draft_model), one
    decoder layer of the target's shape (EAGLE heads), the target's MTP layers, or none (n-gram)."""
    if args.speculative_config is None:
        if args.speculative_acceptance_rates is not None:
            raise ValueError("--speculative-acceptance-rates needs --speculative-config")
        return None, None
    spec = resolve_speculative_config(args.speculative_config, args.tensor_parallel_size, mtp_layers(model),
                                      args.speculative_acceptance_rates)
    if spec.method == NGRAM:
        return spec, None
    if spec.method == DRAFT_MODEL:
        if draft_model is None:
            raise ValueError(f"speculative draft model {spec.model!r}: no model spec given")
        if draft_model.vocab_size != model.vocab_size:
            raise ValueError(f"the draft model {spec.model!r} has vocab_size {draft_model.vocab_size}, the target "
                             f"{model.vocab_size}: speculative decoding needs the same vocabulary")
        return spec, draft_model
    # an EAGLE head is one decoder layer; so is each MTP module, one per draft pass (k > its modules reuses them)
    return spec, one_layer_draft(model, 1, EAGLE3_DRAFT_VOCAB if spec.method == "eagle3" else None)


def resolve_engine_config(args: EngineArgs, model: ModelSpec, hw: HardwareSpec,
                          calib: Calibration, draft_model: ModelSpec | None = None) -> EngineConfig:
    """Validate the arguments and fill vLLM's defaults. Raises ValueError with vLLM-style messages.

    ``draft_model``: the spec of a speculative config's draft model (method ``draft_model``)."""
    hw = with_node_topology(hw, args.node_topology)
    spec, draft = resolve_speculative(args, model, draft_model)
    tp = args.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be ≥ 1, got {tp}")
    if tp > hw.gpus_per_node:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {hw.gpus_per_node} GPUs of one {hw.name} node")
    if model.num_attention_heads % tp:
        raise ValueError(f"Total number of attention heads ({model.num_attention_heads}) must be divisible by "
                         f"tensor parallel size ({tp}).")
    if args.block_size not in VALID_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {VALID_BLOCK_SIZES}, got {args.block_size}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.scheduling_policy not in (FCFS, PRIORITY):
        raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {args.scheduling_policy!r}")
    dp = args.data_parallel_size
    if dp < 1:
        raise ValueError(f"data_parallel_size must be ≥ 1, got {dp}")
    if args.data_parallel_rank is not None and not 0 <= args.data_parallel_rank < dp:
        raise ValueError(f"data_parallel_rank must be in [0, {dp}), got {args.data_parallel_rank}")
    if args.all2all_backend not in ALL2ALL_BACKENDS:
        raise ValueError(f"all2all_backend must be one of {', '.join(ALL2ALL_BACKENDS)}, got {args.all2all_backend!r}")
    power_law_alpha(args.expert_routing)   # raises on an unknown distribution
    if args.expert_load_imbalance is not None and not args.expert_load_imbalance >= 1.0:
        raise ValueError(f"expert_load_imbalance must be ≥ 1 (busiest rank / mean), got {args.expert_load_imbalance}")
    if args.enable_expert_parallel and tp * dp > hw.gpus_per_node:
        raise ValueError(f"expert parallelism over data_parallel_size×tensor_parallel_size={dp * tp} GPUs exceeds "
                         f"the {hw.gpus_per_node} GPUs of one {hw.name} node (multi-node EP is not modelled)")
    quant = args.quantization or model.quantization
    if quant == "fp8":
        error = block_shape_error(     # MLA's projections are not split by heads × head_dim: its check is left out
            model.fp8_scheme, q_heads=0 if model.mla else model.num_attention_heads,
            kv_heads=model.num_kv_heads, head_dim=model.head_dim,
            intermediate=model.intermediate_size if model.num_layers > model.num_moe_layers else 0,
            moe_intermediate=model.moe_intermediate_size if model.is_moe else 0, tp=tp,
            moe_tp=1 if args.enable_expert_parallel and dp * tp > 1 else tp * dp)
        if error:
            raise ValueError(error)
    if quant == "mxfp4" and not model.is_moe:
        raise ValueError(f"quantization 'mxfp4': vLLM's MXFP4 method quantizes MoE experts only (gpt-oss's "
                         f"checkpoints); {model.name} has no experts")
    # an fp8 checkpoint keeps its own scale types under --quantization fp8 too (vLLM reads them from its config)
    # --kv-cache-dtype auto is the checkpoint's KV quantization when it has one (vLLM resolve_kv_cache_dtype_string)
    kv_cache_dtype = model.kv_cache_dtype if args.kv_cache_dtype == "auto" and model.kv_cache_dtype else \
        args.kv_cache_dtype
    precision = resolve_precision(args.dtype if args.dtype != "auto" else model.torch_dtype, quant,
                                  kv_cache_dtype, fp8_scheme=model.fp8_scheme,
                                  compute_capability=hw.compute_capability)

    max_model_len = args.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise ValueError(f"User-specified max_model_len ({max_model_len}) is greater than the derived "
                         f"max_model_len (max_position_embeddings={model.max_position_embeddings} in the model's "
                         "config.json).")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be ≥ 2, got {max_model_len}")
    default_tokens, default_seqs = default_batch_limits(hw)
    max_num_seqs = args.max_num_seqs or default_seqs
    if args.max_num_batched_tokens is not None:
        max_tokens = args.max_num_batched_tokens
    elif args.enable_chunked_prefill:
        max_tokens = default_tokens
    else:
        max_tokens = max(max_model_len, default_tokens)
    if max_num_seqs < 1 or max_tokens < 1:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be ≥ 1")
    if not args.enable_chunked_prefill and max_tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({max_tokens}) is smaller than max_model_len ({max_model_len}). "
                         "This effectively limits the maximum sequence length to max_num_batched_tokens and makes "
                         "vLLM reject longer sequences. Please increase max_num_batched_tokens or decrease "
                         "max_model_len.")
    max_tokens = min(max_tokens, max_num_seqs * max_model_len)
    max_num_seqs = min(max_num_seqs, max_tokens)

    memory = plan_memory(model, hw, precision, tp=tp, block_size=args.block_size,
                         gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=max_model_len,
                         max_num_batched_tokens=max_tokens, max_num_seqs=max_num_seqs,
                         num_gpu_blocks_override=args.num_gpu_blocks_override,
                         # a MoE model's experts are split over the DP ranks with or without EP (vLLM
                         # tensor-slices them over DP×TP when EP is off)
                         ep_data_parallel=dp if model.is_moe else 1,
                         **_draft_memory(spec, draft, model, precision, dp if model.is_moe else 1))
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                            max_model_len=max_model_len, block_size=args.block_size,
                            enable_prefix_caching=args.enable_prefix_caching,
                            enable_chunked_prefill=args.enable_chunked_prefill, policy=args.scheduling_policy,
                            long_prefill_token_threshold=args.long_prefill_token_threshold)
    if args.enforce_eager:
        capture: tuple[int, ...] = ()
    elif spec is not None:
        capture = spec_decode_capture_sizes(max_num_seqs, args.max_cudagraph_capture_size,
                                            1 + spec.num_speculative_tokens)
    else:
        capture = default_cudagraph_capture_sizes(max_num_seqs, args.max_cudagraph_capture_size)
    offload = resolve_offload(args.kv_offloading_size_gib, args.kv_offloading_backend, args.block_size,
                              kv_bytes_per_token(model, precision, tp), tp, args.kv_offloading_block_size,
                              args.kv_offloading_prompt_only)
    if offload is not None and model.is_hybrid_attention:
        raise ValueError(f"KV offloading (--kv-offloading-size) of {model.name}'s sliding-window + full attention "
                         "layers is not modelled (vLLM's native connector needs --disable-hybrid-kv-cache-manager "
                         "for them)")
    return EngineConfig(args, model, hw, calib, precision, sched, memory, capture, spec, draft, offload)


def spec_decode_capture_sizes(max_num_seqs: int, max_capture_size: int | None, decode_query_len: int
                              ) -> tuple[int, ...]:
    """vLLM's CUDA-graph sizes under speculative decoding: the default maximum becomes
    min(2 · max_num_seqs · (1 + k), 512), and every size is rounded up to a multiple of 1 + k so that uniform
    verify batches replay a full graph (adjust_cudagraph_sizes_for_spec_decode)."""
    cap = max_capture_size if max_capture_size is not None else min(2 * max_num_seqs * decode_query_len, 512)
    sizes = default_cudagraph_capture_sizes(max_num_seqs, cap)
    q = decode_query_len
    return tuple(sorted({-(-s // q) * q for s in sizes}))


def _draft_memory(spec: SpeculativeConfig | None, draft: ModelSpec | None, target: ModelSpec,
                  precision: Precision, ep_data_parallel: int = 1) -> dict[str, float]:
    """The drafter's weights and KV per token on one GPU (its layers share the target's block table, as vLLM's
    KV-cache groups do). An EAGLE head / MTP module shares the target's embedding and LM head: only its layers,
    and for an MTP module its own input norms and projection (:func:`mtp_module_extra_bytes`). A MoE draft layer's
    experts are split over a data-parallel group's ranks as the target's are (``ep_data_parallel``)."""
    if spec is None or draft is None:
        return {}
    tp = spec.draft_tensor_parallel_size
    weights = weight_bytes_per_rank(draft, precision, tp, ep_data_parallel)
    kv = kv_bytes_per_token(draft, precision, tp)
    if spec.method != DRAFT_MODEL:
        weights -= weight_bytes_per_rank(replace(draft, num_layers=0, num_moe_layers=0), precision, tp)
        modules = max(mtp_layers(target), 1) if spec.method == MTP else 1
        if spec.method == MTP:
            weights += mtp_module_extra_bytes(target)
        weights, kv = weights * modules, kv * modules
    return {"draft_weight_bytes": weights, "draft_kv_bytes_per_token": kv}


#: Bytes per parameter of the MTP module's own weights: vLLM's deepseek_mtp builds them in the model dtype
#: (bf16) outside the quantization config (eh_proj is a plain nn.Linear, the norms RMSNorms).
_MTP_EXTRA_BYTES_PER_PARAM = 2.0


def mtp_module_extra_bytes(target: ModelSpec) -> float:
    """Weights one GPU holds for one MTP module beyond its decoder layer: ``enorm``, ``hnorm`` and the shared
    head's ``norm`` (h each) and ``eh_proj`` (2h → h, no bias), all replicated on every TP rank and never
    quantized (vLLM's deepseek_mtp; the shared head's LM head is the target's)."""
    h = target.hidden_size
    return (3 * h + 2 * h * h) * _MTP_EXTRA_BYTES_PER_PARAM


#: The step model of a rank that drafts and verifies, by the one it would have without speculation.
_SPEC_STEP_MODELS: dict[type[StepModel], type[StepModel]] = {
    StepModel: SpecStepModel, LockstepStepModel: LockstepSpecStepModel, GroupMoEStepModel: GroupMoESpecStepModel}


def build_step_model(cfg: EngineConfig, cls: type[StepModel] = StepModel, **kwargs: Any) -> StepModel:
    if cfg.speculative is not None and cls in _SPEC_STEP_MODELS:
        cls = _SPEC_STEP_MODELS[cls]
        plain = () if cfg.args.enforce_eager else default_cudagraph_capture_sizes(cfg.scheduler.max_num_seqs,
                                                                                 cfg.args.max_cudagraph_capture_size)
        baseline = StepModel(cfg.model, cfg.hardware, cfg.calibration, cfg.precision,
                             StepConfig(tp=cfg.args.tensor_parallel_size, cudagraph_capture_sizes=plain,
                                        enforce_eager=cfg.args.enforce_eager,
                                        async_scheduling=cfg.args.async_scheduling,
                                        max_model_len=cfg.scheduler.max_model_len,
                                        custom_all_reduce=not cfg.args.disable_custom_all_reduce,
                                        expert_routing=cfg.args.expert_routing,
                                        moe_ep_size=cfg.tp_expert_parallel_size,
                                        expert_load_imbalance=cfg.args.expert_load_imbalance))
        kwargs.update(spec=cfg.speculative, drafter=_drafter(cfg), baseline=baseline)
    return cls(cfg.model, cfg.hardware, cfg.calibration, cfg.precision,
               StepConfig(tp=cfg.args.tensor_parallel_size, cudagraph_capture_sizes=cfg.cudagraph_capture_sizes,
                          enforce_eager=cfg.args.enforce_eager, async_scheduling=cfg.args.async_scheduling,
                          max_model_len=cfg.scheduler.max_model_len,
                          custom_all_reduce=not cfg.args.disable_custom_all_reduce,
                          expert_routing=cfg.args.expert_routing, moe_ep_size=cfg.tp_expert_parallel_size,
                          expert_load_imbalance=cfg.args.expert_load_imbalance),
               **kwargs)


def _drafter(cfg: EngineConfig) -> StepModel | None:
    """The draft's own step model (same GPU, calibration and precision; its own TP and CUDA graphs)."""
    if cfg.draft_model is None:
        return None
    # an MTP module is more than the decoder layer an EAGLE head is: its input norms and eh_proj come on top
    cls = MTPStepModel if cfg.speculative.method == MTP else StepModel
    return cls(cfg.draft_model, cfg.hardware, cfg.calibration, cfg.precision,
                     StepConfig(tp=cfg.speculative.draft_tensor_parallel_size,
                                cudagraph_capture_sizes=cfg.cudagraph_capture_sizes,
                                enforce_eager=cfg.args.enforce_eager, async_scheduling=cfg.args.async_scheduling,
                                max_model_len=cfg.scheduler.max_model_len,
                                custom_all_reduce=not cfg.args.disable_custom_all_reduce,
                                expert_routing=cfg.args.expert_routing))


def spec_decoder(cfg: EngineConfig) -> SpecDecoder | None:
    return SpecDecoder(cfg.speculative, cfg.args.seed) if cfg.speculative is not None else None


def moe_group_timing(cfg: EngineConfig) -> MoEGroupTiming | None:
    """The MoE group of a data-parallel MoE configuration (None: dense model or one rank)."""
    a = cfg.args
    if not (cfg.model.is_moe and a.data_parallel_size > 1):
        return None
    tp = a.tensor_parallel_size
    return MoEGroupTiming(cfg.expert_parallel, a.data_parallel_size * tp, tp, a.all2all_backend,
                          a.expert_load_imbalance, a.expert_routing)


def kv_cache_manager(cfg: EngineConfig) -> KVCacheManager | None:
    """The KV manager a model needs beyond the plain one: vLLM's hybrid allocator for sliding + full layers."""
    if not cfg.model.is_hybrid_attention:
        return None
    return HybridKVCacheManager(cfg.memory.num_gpu_blocks, cfg.scheduler.block_size,
                                hybrid_layout(cfg.model).sliding_window, cfg.scheduler.enable_prefix_caching)


def build_engine(cfg: EngineConfig, per_token_events: bool = True, link: KVLink | None = None) -> Engine:
    """The one place a single engine is built from a resolved configuration (serve, simulate and tests alike;
    a data-parallel group's engines: :func:`build_dp_group`).

    ``per_token_events``: report every decoded token (the server streams them); fast-forward needs only first
    tokens and finishes. ``link``: what a P/D decode side pulls prompt KV over (default: the GPU profile's, see
    ``simcore/kv_transfer.py``)."""
    moe = moe_group_timing(cfg)    # one rank of a MoE group alone (--data-parallel-rank): the group's MoE cost
    sm = build_step_model(cfg) if moe is None else build_step_model(cfg, GroupMoEStepModel, moe=moe)
    eng = Engine(cfg.scheduler, cfg.memory.num_gpu_blocks, sm, seed=cfg.args.seed,
                 per_token_events=per_token_events, kv_cache=kv_cache_manager(cfg),
                 spec_decoder=spec_decoder(cfg))
    eng.kv_transfer = kv_transfer_model(cfg.model, cfg.precision, cfg.args.tensor_parallel_size,
                                        cfg.scheduler.block_size, link or kv_link(cfg.hardware))
    attach_offload(eng, cfg)
    return eng


def attach_offload(eng: Engine, cfg: EngineConfig) -> None:
    """KV offloading: the engine's own CPU tier, its copies priced over the GPU's PCIe link (each DP rank is an
    engine with its own tier of the configured size, as each vLLM engine has its own connector)."""
    if cfg.offload is not None:
        eng.enable_offload(KVOffload(cfg.offload, kv_link(cfg.hardware, "pcie"), cfg.scheduler.block_size,
                                     cfg.scheduler.max_num_seqs))


def build_dp_group(cfg: EngineConfig, per_token_events: bool = True) -> DPGroup:
    """The ``data_parallel_size`` engines of a configuration behind vLLM's router (every rank alike, as vLLM
    starts them: same config and seed). A MoE model's ranks step in lockstep (see ``simcore/dp_group.py``)."""
    moe = moe_group_timing(cfg)
    engines = [Engine(cfg.scheduler, cfg.memory.num_gpu_blocks,
                      build_step_model(cfg, StepModel if moe is None else LockstepStepModel), seed=cfg.args.seed,
                      per_token_events=per_token_events, kv_cache=kv_cache_manager(cfg),
                      spec_decoder=spec_decoder(cfg))
               for _ in range(cfg.args.data_parallel_size)]
    for eng in engines:     # what a P/D decode side pulls prompt KV over, as build_engine's
        eng.kv_transfer = kv_transfer_model(cfg.model, cfg.precision, cfg.args.tensor_parallel_size,
                                            cfg.scheduler.block_size, kv_link(cfg.hardware))
        attach_offload(eng, cfg)
    return DPGroup(engines, moe)
