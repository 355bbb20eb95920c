"""GPU specs: the datasheet numbers the roofline needs, loaded from bundled profiles."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One GPU model (per device), as on its datasheet.

    FLOP/s are dense tensor-core peaks (no sparsity). ``None`` means the chip has no such unit.
    """

    name: str                      # canonical id, e.g. "h100-sxm"
    display_name: str              # e.g. "NVIDIA H100 SXM5 80GB"
    vendor: str                    # "nvidia" | "amd"
    bf16_flops_per_s: float
    fp16_flops_per_s: float
    fp8_flops_per_s: float | None
    int8_ops_per_s: float | None
    fp4_flops_per_s: float | None
    mem_bytes_per_s: float         # HBM/GDDR bandwidth (datasheet; kernels see usable_mem_bytes_per_s)
    mem_capacity_bytes: int        # usable device memory as the driver reports it
    num_sms: int                   # SMs (NVIDIA) or CUs (AMD)
    l2_bytes: int
    boost_clock_hz: float
    intra_node_bytes_per_s: float  # NVLink / xGMI / PCIe per GPU, one direction
    pcie_bytes_per_s: float
    gpus_per_node: int
    compute_capability: str        # "9.0", "8.9", "gfx942" ...
    aliases: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)  # field name -> where the number came from
    # Share of DRAM that inline ECC takes (GDDR parts with ECC on: the check bits live in ordinary DRAM, so
    # they cost that share of capacity and every access moves them too; HBM keeps them side-band: 0)
    ecc_dram_fraction: float = 0.0
    # Whether GPUs of a node can read each other's memory over PCIe/NVLink (CUDA P2P): vLLM's custom all-reduce
    # needs it. NVIDIA disables it on GeForce cards (RTX 4090), where vLLM's P2P check fails and NCCL runs.
    peer_to_peer: bool = True
    # Board power limit (W): with SMs × boost clock it bounds the clock a dense tensor load holds
    # (sustained_clock_share); None: assumed to hold its boost clock
    tdp_w: float | None = None

    def peak_flops_per_s(self, dtype: str) -> float:
        """Tensor-core peak for a compute dtype; fp8/int8/fp4 fall back to bf16 when absent."""
        peak = {
            "bf16": self.bf16_flops_per_s,
            "fp16": self.fp16_flops_per_s,
            "fp8": self.fp8_flops_per_s,
            "int8": self.int8_ops_per_s,
            "fp4": self.fp4_flops_per_s,
        }[dtype]
        return peak if peak else self.bf16_flops_per_s

    @property
    def usable_mem_bytes_per_s(self) -> float:
        """DRAM bandwidth left for data: inline ECC moves its check bits through the same DRAM."""
        return self.mem_bytes_per_s * (1.0 - self.ecc_dram_fraction)

    @property
    def machine_balance_flops_per_byte(self) -> float:
        return self.bf16_flops_per_s / self.usable_mem_bytes_per_s


_REQUIRED_FIELDS: tuple[str, ...] = (
    "name", "display_name", "vendor", "bf16_flops_per_s", "fp16_flops_per_s", "mem_bytes_per_s",
    "mem_capacity_bytes", "num_sms", "l2_bytes", "boost_clock_hz", "intra_node_bytes_per_s",
    "pcie_bytes_per_s", "gpus_per_node", "compute_capability",
)
# Peaks a chip may lack (e.g. no FP8 tensor cores on Ampere): null/absent -> None.
_OPTIONAL_PEAKS: tuple[str, ...] = ("fp8_flops_per_s", "int8_ops_per_s", "fp4_flops_per_s")
_FLOAT_FIELDS: tuple[str, ...] = (
    "bf16_flops_per_s", "fp16_flops_per_s", "mem_bytes_per_s", "boost_clock_hz",
    "intra_node_bytes_per_s", "pcie_bytes_per_s",
)
_INT_FIELDS: tuple[str, ...] = ("mem_capacity_bytes", "num_sms", "l2_bytes", "gpus_per_node")
_ALLOWED_KEYS = frozenset(
    _REQUIRED_FIELDS + _OPTIONAL_PEAKS + ("aliases", "sources", "ecc_dram_fraction", "peer_to_peer", "tdp_w"))

#: Board watts a dense bf16 tensor-core load draws per SM per GHz of clock. A GPU whose power limit is below
#: SMs × boost GHz × this cannot hold its boost clock on such a load. From the shared tables' best bf16 GEMMs: the
#: L40S (350 W, 142 SMs, 2.52 GHz: 0.98 W per SM-GHz) reaches 285 of its 362 TFLOP/s (79%), where the A100 (2.63),
#: H100 SXM (2.68) and RTX PRO 6000 (1.31) reach 95-98% — so the L40S holds ~0.82 of its clock (79% ÷ the others'
#: ~96%), which puts the constant at 0.98 / 0.82 = 1.19; the PRO 6000 bounds it from above (≤ 1.31).
DENSE_TENSOR_W_PER_SM_GHZ = 1.19


def sustained_clock_share(hw: HardwareSpec) -> float:
    """Share of its boost clock ``hw`` holds under a dense tensor-core load: 1 unless its power limit is below what
    its SMs draw at the boost clock (power taken as linear in clock: a floor on the share, not a fit)."""
    if not hw.tdp_w or hw.vendor != "nvidia":     # the constant is an NVIDIA SM's; a CU is another unit
        return 1.0
    return min(1.0, hw.tdp_w / (hw.num_sms * hw.boost_clock_hz * 1e-9 * DENSE_TENSOR_W_PER_SM_GHZ))


def _positive_number(d: dict, key: str) -> float:
    value = d[key]
    # bool is an int subclass: reject it explicitly so `true` in a JSON never passes as 1.
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"hardware spec field {key!r} must be a positive number, got {value!r}")
    return value


#: ``--node-topology``: how the GPUs of one node reach each other. ``nvlink``: fully connected by NVLink/xGMI;
#: ``pcie``: over PCIe with CUDA peer-to-peer (vLLM's custom all-reduce runs at TP 2); ``pcie-no-p2p``: over PCIe
#: without it (GeForce boards, many VMs): vLLM's P2P check fails and NCCL runs every all-reduce.
NODE_TOPOLOGIES: tuple[str, ...] = ("nvlink", "pcie", "pcie-no-p2p")


def has_fast_interconnect(hw: HardwareSpec) -> bool:
    """NVLink/xGMI-class links: well above the PCIe bandwidth (the GPUs of a node are then fully connected)."""
    return hw.intra_node_bytes_per_s > 1.5 * hw.pcie_bytes_per_s


def node_topology(hw: HardwareSpec) -> str:
    """The profile's topology (:data:`NODE_TOPOLOGIES`)."""
    return "nvlink" if has_fast_interconnect(hw) else "pcie" if hw.peer_to_peer else "pcie-no-p2p"


def with_node_topology(hw: HardwareSpec, topology: str | None) -> HardwareSpec:
    """``hw`` in a node of another topology: a PCIe node's GPUs reach each other at the PCIe bandwidth, with or
    without peer-to-peer. NVLink needs its bandwidth, which only a profile can give (ValueError otherwise)."""
    if topology is None or topology == node_topology(hw):
        return hw
    if topology not in NODE_TOPOLOGIES:
        raise ValueError(f"node topology must be one of {', '.join(NODE_TOPOLOGIES)}, got {topology!r}")
    if topology == "nvlink":
        raise ValueError(f"{hw.name}'s profile records no NVLink (GPU-to-GPU {hw.intra_node_bytes_per_s / 1e9:g} GB/s, "
                         "its PCIe): pass a hardware JSON with the link's intra_node_bytes_per_s to price one")
    return replace(hw, intra_node_bytes_per_s=hw.pcie_bytes_per_s, peer_to_peer=topology == "pcie")


def hardware_spec_from_dict(d: dict) -> HardwareSpec:
    """Build a HardwareSpec from a profile dict (the bundled JSON schema). Pure: no I/O.

    Keys starting with ``_`` are comments and ignored; any other unknown key is an error, so a typo
    in a user-supplied profile (e.g. ``bf16_flops``) cannot silently leave a field at a wrong value.
    """
    missing = [k for k in _REQUIRED_FIELDS if k not in d or d[k] is None]
    if missing:
        raise ValueError(f"hardware spec {d.get('name', '?')!r} is missing required fields: {missing}")
    unknown = sorted(k for k in d if k not in _ALLOWED_KEYS and not k.startswith("_"))
    if unknown:
        raise ValueError(f"hardware spec {d['name']!r} has unknown fields: {unknown}")

    kwargs: dict = {k: str(d[k]) for k in ("name", "display_name", "vendor", "compute_capability")}
    for key in _FLOAT_FIELDS:
        kwargs[key] = float(_positive_number(d, key))
    for key in _INT_FIELDS:
        value = _positive_number(d, key)
        if value != int(value):
            raise ValueError(f"hardware spec field {key!r} must be an integer, got {value!r}")
        kwargs[key] = int(value)
    for key in _OPTIONAL_PEAKS:
        kwargs[key] = float(_positive_number(d, key)) if d.get(key) is not None else None

    ecc = d.get("ecc_dram_fraction", 0.0)
    if isinstance(ecc, bool) or not isinstance(ecc, int | float) or not 0.0 <= ecc < 0.5:
        raise ValueError(f"hardware spec {d['name']!r}: 'ecc_dram_fraction' must be in [0, 0.5), got {ecc!r}")
    kwargs["ecc_dram_fraction"] = float(ecc)

    tdp = d.get("tdp_w")
    kwargs["tdp_w"] = float(_positive_number(d, "tdp_w")) if tdp is not None else None

    p2p = d.get("peer_to_peer", True)
    if not isinstance(p2p, bool):
        raise ValueError(f"hardware spec {d['name']!r}: 'peer_to_peer' must be true or false, got {p2p!r}")
    kwargs["peer_to_peer"] = p2p

    aliases = d.get("aliases", ())
    sources = d.get("sources", {})
    if isinstance(aliases, str) or not all(isinstance(a, str) for a in aliases):
        raise ValueError(f"hardware spec {d['name']!r}: 'aliases' must be a list of strings")
    if not isinstance(sources, dict):
        raise ValueError(f"hardware spec {d['name']!r}: 'sources' must be a dict field -> source")
    kwargs["aliases"] = tuple(aliases)
    kwargs["sources"] = {str(k): str(v) for k, v in sources.items()}
    return HardwareSpec(**kwargs)
