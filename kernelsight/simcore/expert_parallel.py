"""Expert parallelism across data-parallel ranks: the MoE expert GEMMs of one rank of the group and the
dispatch/combine collectives that move tokens to and from their experts' ranks.

vLLM (``--data-parallel-size N --enable-expert-parallel``) splits the routed experts over the N·TP ranks; the
ranks' MoE layers form one group, so every rank runs every forward pass together with the others, its token rows
padded to the largest rank's count (an idle rank runs a dummy batch). ``--all2all-backend`` picks how tokens
reach their experts:

* ``allgather_reducescatter`` (vLLM's default) and ``naive``: every rank gathers all ranks' hidden states
  (dispatch) and reduce-scatters (or, naive, all-reduces) the expert outputs back (combine); the message is the
  whole group's rows × hidden.
* the all-to-all kernels (DeepEP, pplx, MoRI, NIXL-EP, FlashInfer): each token travels only to the ranks of its
  top-k experts (once per rank) and back; the message is rows × (ranks a token reaches) × hidden per rank.

Costs come from the calibration's collective curves (measured ``all_gather`` / ``reduce_scatter`` /
``all_to_all`` rows where the comm tables have them) and are never below bus bytes / link bandwidth
(:mod:`kernelsight.simcore.comm`).
"""

from __future__ import annotations

from collections.abc import Mapping

from kernelsight.simcore import kernels as K
from kernelsight.simcore.comm import CommModel, collective_s
from kernelsight.simcore.hardware import HardwareSpec
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.moe_routing import DEFAULT_EXPERT_ROUTING
from kernelsight.simcore.precision import Precision

#: vLLM's ``--all2all-backend`` choices (vllm/config/parallel.py ``All2AllBackend``) and its default.
ALL2ALL_BACKENDS: tuple[str, ...] = (
    "naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "mori", "nixl_ep",
    "allgather_reducescatter", "flashinfer_all2allv", "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided",
)
DEFAULT_ALL2ALL_BACKEND = "allgather_reducescatter"
_GATHER_BACKENDS = ("allgather_reducescatter", "naive")



def dispatch_combine_messages(backend: str, model: ModelSpec, rows_per_rank: int, ep_size: int,
                              precision: Precision) -> tuple[tuple[str, float], tuple[str, float]]:
    """((op, message bytes) of the dispatch, (op, message bytes) of the combine) of one MoE layer, when every
    rank of ``ep_size`` has ``rows_per_rank`` (padded) token rows. Message bytes follow ``collective_s``'s
    convention: the full gathered / reduced / exchanged buffer."""
    row_bytes = model.hidden_size * precision.act_bytes
    if backend in _GATHER_BACKENDS:
        gathered = float(rows_per_rank * ep_size * row_bytes)
        return ("all_gather", gathered), ("all_reduce" if backend == "naive" else "reduce_scatter", gathered)
    # an all-to-all kernel sends a token's row once to each rank holding one of its top-k experts (and back):
    # ep·(1 − (1 − 1/ep)^k) ranks on average under uniform routing; comm_bus_factor takes out the local share
    ranks_per_token = ep_size * (1.0 - (1.0 - 1.0 / ep_size) ** model.experts_per_token)
    exchanged = float(rows_per_rank * ranks_per_token * row_bytes)
    return ("all_to_all", exchanged), ("all_to_all", exchanged)


def all2all_s(backend: str, model: ModelSpec, rows_per_rank: int, ep_size: int, hw: HardwareSpec,
              comm: Mapping[str, CommModel], precision: Precision) -> float:
    """Seconds of one step's dispatch + combine over every MoE layer, exchanged among ``ep_size`` GPUs (the DP
    ranks: with TP the ranks of one TP column exchange in parallel with the other columns)."""
    if ep_size <= 1 or not model.is_moe:
        return 0.0
    (op_d, msg_d), (op_c, msg_c) = dispatch_combine_messages(backend, model, rows_per_rank, ep_size, precision)
    dtype = "bf16"   # activations travel in the model dtype (vLLM's default backends do not quantize them)
    per_layer = (collective_s(op_d, msg_d, ep_size, hw, comm, "nccl", dtype)
                 + collective_s(op_c, msg_c, ep_size, hw, comm, "nccl", dtype))
    return per_layer * model.num_moe_layers


def ep_moe_kernels(model: ModelSpec, group_rows: int, ep_size: int, precision: Precision,
                   load_imbalance: float | None = None, routing: str = DEFAULT_EXPERT_ROUTING) -> list[K.Kernel]:
    """The MoE kernels of the busiest rank of an EP group of ``ep_size`` GPUs (DP × TP) whose data-parallel ranks
    together run ``group_rows`` (padded) distinct rows: each GPU holds whole experts, ``num_experts / ep_size`` of
    them. How much more than the mean share of the routed tokens the busiest gets, and how many of its experts
    they touch, follow from the ``routing`` distribution (``moe_routing.routing_load``: the default
    ``--expert-load-imbalance``); a given ``load_imbalance`` overrides the share."""
    n_moe = model.num_moe_layers if model.is_moe else 0
    if not n_moe:
        return []
    return K.moe_kernels(model, group_rows, 1, precision, n_moe, ep_size, load_imbalance, routing)


__all__ = ["ALL2ALL_BACKENDS", "DEFAULT_ALL2ALL_BACKEND", "all2all_s",
           "dispatch_combine_messages", "ep_moe_kernels"]
