"""The vLLM engine flags shared by ``serve`` and ``simulate`` (``bench`` reads none), and the one way from them to a
resolved :class:`~kernelsight.simcore.engine_config.EngineConfig`: flags → :class:`EngineArgs` → profiles loaded →
vLLM's defaults filled in by simcore.

``EngineArgs`` itself is defined in ``simcore/engine_config.py``: simcore resolves it and imports nothing outside
itself, so the dataclass lives there and this module maps command lines onto it.
"""

from __future__ import annotations

import argparse

from kernelsight import profiles
from kernelsight.argtypes import (
    fraction,
    json_object,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from kernelsight.simcore.engine_config import EngineArgs, EngineConfig, resolve_engine_config
from kernelsight.simcore.expert_parallel import (
    ALL2ALL_BACKENDS,
    DEFAULT_ALL2ALL_BACKEND,
)
from kernelsight.simcore.hardware import NODE_TOPOLOGIES, HardwareSpec
from kernelsight.simcore.kv_offload import BACKENDS as KV_OFFLOADING_BACKENDS
from kernelsight.simcore.kv_transfer import LINK_KINDS, KVLink, kv_link
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.moe_routing import DEFAULT_EXPERT_ROUTING

__all__ = ["DEFAULT_HARDWARE", "DEFAULT_MODEL", "EngineArgs", "add_engine_args", "create_engine_config",
           "engine_args_from"]

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B"
DEFAULT_HARDWARE = "h100"
#: vLLM's --prefix-caching-hash-algo choices (CacheConfig.prefix_caching_hash_algo)
PREFIX_CACHING_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by ``serve`` and ``simulate``, named as ``vllm serve`` names them."""
    g = p.add_argument_group("engine (as vllm serve)")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="bundled HF id (see `kernelsight profiles`), a local directory with config.json, or an "
                        "id in the local HF cache (default: %(default)s)")
    g.add_argument("--hardware", default=DEFAULT_HARDWARE,
                   help="GPU profile name or alias, or a hardware JSON file (default: %(default)s)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, help="TP degree (default: 1)")
    g.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="max sequences per step (default: vLLM's for the GPU: 1024 on ≥70 GiB, else 256)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="token budget per step (default: vLLM's for the GPU: 8192 on H100/H200, 2048 on "
                        "A100/L40S/..., 16384 on ≥160 GiB)")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="fraction of device memory vLLM may use (default: 0.9)")
    g.add_argument("--block-size", type=int, choices=(1, 8, 16, 32, 64, 128), default=16,
                   help="KV-cache block size in tokens (default: 16)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="automatic prefix caching (default: on)")
    g.add_argument("--prefix-caching-hash-algo", choices=PREFIX_CACHING_HASH_ALGOS, default="sha256",
                   help="block hash that KV events carry (serve --kv-events-config); the simulation keys its "
                        "prefix cache with a faster hash of the same content (default: sha256)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="chunked prefill (default: on)")
    g.add_argument("--quantization", "-q", choices=("fp8", "modelopt_fp4", "mxfp4"), default=None,
                   help="weight quantization: fp8 = W8A8, modelopt_fp4 = NVFP4 W4A4 linear layers, mxfp4 = "
                        "gpt-oss's MXFP4 MoE experts (default: none, or what the model config says)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), default="auto",
                   help="KV-cache element type (default: auto = model dtype)")
    g.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "half"), default="auto",
                   help="activation/weight dtype (default: auto = the config's torch_dtype)")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="waiting-queue order (default: fcfs)")
    g.add_argument("--num-gpu-blocks-override", type=positive_int, default=None,
                   help="use this many KV blocks instead of sizing them from memory")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--max-cudagraph-capture-size", type=positive_int, default=None,
                   help="largest CUDA-graph batch size (default: min(2·max_num_seqs, 512))")
    g.add_argument("--long-prefill-token-threshold", type=non_negative_int, default=0,
                   help="cap on one request's prefill chunk per step (default: 0 = off)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="prepare the next step while the GPU runs (default: on, as in vLLM 0.33; off "
                        "reproduces older releases)")
    g.add_argument("--calibration", default=None,
                   help="calibration JSON (default: the bundled table for the GPU)")
    add_vllm_version_arg(g)
    g.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                   help="N engines (each --tensor-parallel-size GPUs) behind one front end that routes each "
                        "request to the least loaded (4·waiting + running) as vLLM's DP coordinator; a MoE "
                        "model's ranks step together (default: 1)")
    g.add_argument("--data-parallel-rank", "-dpn", type=non_negative_int, default=None,
                   help="serve only this rank of the group (one rank per process, metrics engine=\"RANK\"; "
                        "default: every rank)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="split a MoE model's experts over the DP×TP ranks instead of tensor-slicing them; the "
                        "ranks' MoE layers then exchange tokens every step (--all2all-backend)")
    g.add_argument("--all2all-backend", choices=ALL2ALL_BACKENDS, default=DEFAULT_ALL2ALL_BACKEND,
                   help="expert-parallel dispatch/combine: allgather_reducescatter (vLLM's default) or naive "
                        "gather every rank's tokens; the others exchange each token with its top-k experts' "
                        "ranks (all-to-all) (default: %(default)s)")
    add_topology_args(g)
    g.add_argument("--expert-routing", default=DEFAULT_EXPERT_ROUTING, metavar="DIST",
                   help="simulator: how tokens pick experts — balanced, power_law_1.01, power_law_1.2 (or "
                        "power_law_<a>, a > 1): sets the experts a batch touches and how loaded the busiest "
                        "expert-parallel rank is (default: %(default)s)")
    g.add_argument("--expert-load-imbalance", type=float, default=None,
                   help="simulator: override the busiest expert-parallel rank's routed tokens over the mean; its "
                        "expert GEMMs set the group's pace (default: derived from --expert-routing per batch; "
                        "1 = uniform)")
    g.add_argument("--speculative-config", type=speculative_config_json, default=None, metavar="JSON",
                   help="speculative decoding, as vLLM's SpeculativeConfig: method ngram / eagle / eagle3 / mtp / "
                        "draft_model, num_speculative_tokens, model (draft model or EAGLE head), "
                        "draft_tensor_parallel_size, prompt_lookup_max/min; rejection_sample_method 'synthetic' with "
                        "synthetic_acceptance_rates or synthetic_acceptance_length sets the acceptance (default: a "
                        "per-method default, see docs/serving.md)")
    g.add_argument("--speculative-acceptance-rates", type=acceptance_rates, default=None, metavar="R1,R2,...",
                   help="simulator: per-position acceptance rates of the drafts (one per speculative token, "
                        "non-increasing; vLLM's accepted_tokens_per_pos / num_drafts), overriding the default")
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="Size of the KV cache offloading buffer in GiB. When TP > 1, this is the total buffer size "
                        "summed across all TP ranks. By default, this is set to None, which means no KV offloading "
                        "is enabled. When set, vLLM will enable KV cache offloading to CPU using the "
                        "kv_offloading_backend (copies priced over the GPU's PCIe link)")
    g.add_argument("--kv-offloading-backend", choices=KV_OFFLOADING_BACKENDS, default="native",
                   help="The backend to use for KV cache offloading. Supported backends include 'native' (vLLM "
                        "native CPU offloading), 'lmcache'. KV offloading is only activated when kv_offloading_size "
                        "is set. (default: native)")
    g.add_argument("--seed", type=int, default=0, help="seed for everything random (default: 0)")


def add_vllm_version_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup, default_help: str = "") -> None:
    """``--vllm-version``: a calibration belongs to a GPU and a software stack; this picks the stack."""
    p.add_argument("--vllm-version", default=None, metavar="X.Y.Z",
                   help="the vLLM release to price: the GPU's bundled calibration timed under it (else the newest "
                        "timed under an older release, else the oldest; the report says so) "
                        f"(default: {default_help or 'the newest bundled'}; `kernelsight profiles` lists them)")


def add_topology_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """How the TP group's all-reduces run: vLLM's ``--disable-custom-all-reduce`` and the node's links."""
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="as vLLM's: every tensor-parallel all-reduce on NCCL (or symmetric memory where the GPU "
                        "has it) instead of vLLM's custom all-reduce")
    p.add_argument("--node-topology", choices=NODE_TOPOLOGIES, default=None,
                   help="simulator: how the GPUs of a node are linked — nvlink (fully connected), pcie (with CUDA "
                        "peer-to-peer: vLLM's custom all-reduce runs at TP 2, NCCL above), pcie-no-p2p (NCCL only: "
                        "GeForce boards, many VMs) (default: the GPU profile's, e.g. nvlink for h100, pcie for "
                        "rtx-pro-6000 and l40s, pcie-no-p2p for rtx-4090)")


def speculative_config_json(text: str) -> dict:
    """argparse type of ``--speculative-config JSON``: a JSON object (its fields are checked when the engine
    config is resolved, as vLLM's SpeculativeConfig checks them)."""
    return json_object(text)


def acceptance_rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The EngineArgs of parsed engine flags (as added by :func:`add_engine_args`)."""
    return EngineArgs(
        model=ns.model, hardware=ns.hardware, tensor_parallel_size=ns.tensor_parallel_size,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        max_model_len=ns.max_model_len, gpu_memory_utilization=ns.gpu_memory_utilization,
        block_size=ns.block_size, enable_prefix_caching=ns.enable_prefix_caching,
        enable_chunked_prefill=ns.enable_chunked_prefill, quantization=ns.quantization,
        kv_cache_dtype=ns.kv_cache_dtype, dtype=ns.dtype, seed=ns.seed, scheduling_policy=ns.scheduling_policy,
        num_gpu_blocks_override=ns.num_gpu_blocks_override, enforce_eager=ns.enforce_eager,
        max_cudagraph_capture_size=ns.max_cudagraph_capture_size,
        long_prefill_token_threshold=ns.long_prefill_token_threshold, async_scheduling=ns.async_scheduling,
        calibration=ns.calibration, vllm_version=ns.vllm_version, data_parallel_size=ns.data_parallel_size,
        data_parallel_rank=ns.data_parallel_rank, enable_expert_parallel=ns.enable_expert_parallel,
        all2all_backend=ns.all2all_backend, expert_routing=ns.expert_routing,
        expert_load_imbalance=ns.expert_load_imbalance,
        disable_custom_all_reduce=ns.disable_custom_all_reduce, node_topology=ns.node_topology,
        speculative_config=ns.speculative_config, speculative_acceptance_rates=ns.speculative_acceptance_rates,
        kv_offloading_size_gib=ns.kv_offloading_size, kv_offloading_backend=ns.kv_offloading_backend)


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Load model, hardware and calibration profiles and resolve vLLM's defaults.

    Raises ValueError subclasses with a one-line explanation on any bad argument.
    """
    model = profiles.load_model(args.model)
    hw = profiles.load_hardware(args.hardware)
    calib = profiles.load_calibration(hw.name, args.calibration, vllm_version=args.vllm_version)
    return resolve_engine_config(args, model, hw, calib, draft_model_spec(args))


def add_kv_link_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The link a P/D decode instance pulls prompt KV over (serve and simulate; ``simcore/kv_transfer.py``)."""
    p.add_argument("--kv-transfer-link", choices=LINK_KINDS, default=None,
                   help="the link a decode instance pulls prompt KV over (default: nvlink where the GPU has it, "
                        "else pcie; infiniband, roce, tcp: nominal per-GPU NIC rates)")
    p.add_argument("--kv-transfer-bandwidth-gbps", type=positive_float, default=None, metavar="GBPS",
                   help="override the link's bandwidth per GPU, one direction (Gb/s)")
    p.add_argument("--kv-transfer-latency-us", type=non_negative_float, default=None, metavar="US",
                   help="override the link's per-pull latency (µs)")


def kv_link_from(ns: argparse.Namespace, hw: HardwareSpec) -> KVLink:
    """The link of ``add_kv_link_args``'s flags on ``hw`` (ValueError: e.g. nvlink on a GPU without it)."""
    lat = ns.kv_transfer_latency_us
    return kv_link(hw, ns.kv_transfer_link, bandwidth_gbps=ns.kv_transfer_bandwidth_gbps,
                   latency_s=None if lat is None else lat * 1e-6)


def draft_model_spec(args: EngineArgs) -> ModelSpec | None:
    """A speculative config's draft model (method draft_model, vLLM's default when only ``model`` is given) from the
    bundled profiles; EAGLE heads and MTP layers are derived from the target in simcore."""
    sc = args.speculative_config
    if not isinstance(sc, dict) or not isinstance(sc.get("model"), str):
        return None
    if sc.get("method", "draft_model") != "draft_model" or sc["model"] in ("ngram", "[ngram]"):
        return None
    return profiles.load_model(sc["model"])
