"""Prefill/decode disaggregation: the time a decode instance spends pulling a prompt's KV cache from the prefill
instance (vLLM's NIXL connector reads the prefill side's blocks into its own over the link between them).

Each tensor-parallel rank pulls its own shard (its KV heads) over its own link, all ranks at once, so the time is
one rank's bytes over one link: ``latency_s + blocks × block_size × kv_bytes_per_token(rank) / bytes_per_s``.
NIXL moves whole blocks (the prefill side sends block ids), so a partly filled last block costs a full one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernelsight.simcore.hardware import HardwareSpec
from kernelsight.simcore.memory import kv_bytes_per_token
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.precision import Precision

#: Link kinds ``--kv-transfer-link`` takes.
LINK_KINDS: tuple[str, ...] = ("nvlink", "pcie", "infiniband", "roce", "tcp")

# Network links are not in the GPU profiles: nominal per-GPU line rates of the usual disaggregated deployments
# (DGX-style: one 400 Gb/s NIC per GPU for InfiniBand NDR and RoCE; one 100 GbE port for plain TCP) times the
# share of it a bulk one-sided transfer reaches, and a per-transfer latency (RDMA work request round trip; UCX's
# TCP transport pays the kernel stack). Not measured here: override with --kv-transfer-bandwidth-gbps.
_NETWORK_LINKS: dict[str, tuple[float, float, float]] = {
    # kind: (line rate bits/s, achieved share, latency s)
    "infiniband": (400e9, 0.90, 5e-6),
    "roce": (400e9, 0.85, 10e-6),
    "tcp": (100e9, 0.70, 50e-6),
}
# In-node links come from the GPU profile (its NVLink/xGMI or PCIe bandwidth per direction); a bulk peer copy
# reaches about this share of it, after a CUDA-IPC copy launch of about this latency.
_IN_NODE_SHARE = 0.80
_IN_NODE_LATENCY_S = 10e-6


@dataclass(frozen=True, slots=True)
class KVLink:
    """The link one rank's KV shard crosses between the prefill and the decode instance."""

    kind: str
    bytes_per_s: float
    latency_s: float

    def time_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


def has_nvlink(hw: HardwareSpec) -> bool:
    """A GPU whose in-node peer link is faster than its PCIe port has NVLink (or AMD's xGMI)."""
    return hw.intra_node_bytes_per_s > hw.pcie_bytes_per_s


def default_link_kind(hw: HardwareSpec) -> str:
    """P and D on GPUs of one node (what a GPU profile describes): NVLink where the GPU has it, else PCIe."""
    return "nvlink" if has_nvlink(hw) else "pcie"


def kv_link(hw: HardwareSpec, kind: str | None = None, *, bandwidth_gbps: float | None = None,
            latency_s: float | None = None) -> KVLink:
    """The link of ``kind`` (default: :func:`default_link_kind`); ``bandwidth_gbps`` (Gb/s, one direction) and
    ``latency_s`` override the model's numbers."""
    kind = kind or default_link_kind(hw)
    if kind not in LINK_KINDS:
        raise ValueError(f"unknown KV transfer link {kind!r}; choose one of {', '.join(LINK_KINDS)}")
    if kind == "nvlink":
        if not has_nvlink(hw):
            raise ValueError(f"{hw.name} has no NVLink: its peers talk over PCIe (use --kv-transfer-link pcie)")
        bw, lat = hw.intra_node_bytes_per_s * _IN_NODE_SHARE, _IN_NODE_LATENCY_S
    elif kind == "pcie":
        bw, lat = hw.pcie_bytes_per_s * _IN_NODE_SHARE, _IN_NODE_LATENCY_S
    else:
        rate_bits, share, lat = _NETWORK_LINKS[kind]
        bw = rate_bits / 8 * share
    if bandwidth_gbps is not None:
        if not bandwidth_gbps > 0:
            raise ValueError(f"KV transfer bandwidth must be > 0 Gb/s, got {bandwidth_gbps}")
        bw = bandwidth_gbps * 1e9 / 8
    if latency_s is not None:
        if latency_s < 0:
            raise ValueError(f"KV transfer latency must be >= 0, got {latency_s}")
        lat = latency_s
    return KVLink(kind, bw, lat)


@dataclass(frozen=True, slots=True)
class KVTransferModel:
    """Prices one pull of a request's KV blocks (both instances run the same model, precision and TP)."""

    link: KVLink
    block_size: int
    kv_bytes_per_token_per_rank: float

    def bytes_per_rank(self, num_blocks: int) -> float:
        return num_blocks * self.block_size * self.kv_bytes_per_token_per_rank

    def time_s(self, num_blocks: int) -> float:
        """Seconds to pull ``num_blocks`` blocks (0 blocks: nothing to read, only the completion notice's latency)."""
        return self.link.time_s(self.bytes_per_rank(num_blocks))


def kv_transfer_model(model: ModelSpec, precision: Precision, tp: int, block_size: int,
                      link: KVLink) -> KVTransferModel:
    return KVTransferModel(link, block_size, kv_bytes_per_token(model, precision, tp))
