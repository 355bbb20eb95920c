"""Which all-reduce implementation vLLM runs for a tensor-parallel all-reduce, as a pure function of the hardware,
the world size and the message.

vLLM's ``CudaCommunicator.all_reduce`` (vllm/distributed/device_communicators/cuda_communicator.py, V1 era) tries,
in order, and the first that accepts the tensor runs it:

1. quick all-reduce (ROCm MI300 only, and only when ``VLLM_ROCM_QUICK_REDUCE_QUANTIZATION`` is not its default
   ``NONE``) — off by default, not modelled;
2. FlashInfer all-reduce (``VLLM_ALLREDUCE_USE_FLASHINFER``, default 0) — off by default, not modelled;
3. **custom all-reduce** (``custom_all_reduce.py``): only for the TP group, world size 2, 4, 6 or 8, all GPUs in one
   node, every pair P2P-capable; with more than two GPUs only when they are fully NVLink-connected ("not supported
   on more than two PCIe-only GPUs"). ``should_custom_ar``: byte size a multiple of 16 and *strictly below*
   ``max_size`` — 8 MiB, lowered to ``CUSTOM_ALL_REDUCE_MAX_SIZES[capability][world size]`` when symmetric memory
   is enabled on the GPU (3 below);
4. **symmetric-memory all-reduce** (``symm_mem.py``, ``VLLM_ALLREDUCE_USE_SYMM_MEM``, default 1): CUDA only,
   bf16 tensors only, the device capability and the world size in ``SYMM_MEM_ALL_REDUCE_MAX_SIZES``, and the
   buffer must get a multicast address (NVSwitch NVLink; PCIe has none); ``should_use_symm_mem``: byte size a
   multiple of 4 and *at most* the table's size (multimem for the world sizes of ``_WORLD_SIZES_MULTIMEM``,
   two-shot otherwise);
5. **NCCL** through pynccl (torch.distributed only when pynccl is unavailable, never in serving).

NCCL's own symmetric-memory path (``VLLM_USE_NCCL_SYMM_MEM``) is off by default and not modelled. The choice
does not depend on CUDA graphs: under capture the custom all-reduce reduces the registered graph buffers in place,
in eager mode it first copies the input into its pre-registered buffer — the same implementation, at another
cost, which is why the price (:func:`allreduce_pricing_backend`) and not the choice takes the mode.
"""

from __future__ import annotations

from kernelsight.simcore.hardware import HardwareSpec, has_fast_interconnect

KIB = 1024
MIB = 1024 * KIB

#: implementation names (also the calibration backend names of their graph-mode curves)
CUSTOM = "custom"
SYMM_MEM = "symm_mem"
NCCL = "nccl"
NO_ALLREDUCE = "none"  # one GPU: nothing to reduce
ALLREDUCE_IMPLEMENTATIONS = (CUSTOM, SYMM_MEM, NCCL)

#: CustomAllreduce._SUPPORTED_WORLD_SIZES
CUSTOM_AR_WORLD_SIZES = (2, 4, 6, 8)
#: CustomAllreduce(max_size=8192 * 1024): messages of at least this many bytes go to the next implementation
CUSTOM_AR_MAX_BYTES = 8 * MIB
#: all_reduce_utils.CUSTOM_ALL_REDUCE_MAX_SIZES: the custom all-reduce's lower limit where symmetric memory is on
CUSTOM_AR_MAX_BYTES_WITH_SYMM_MEM: dict[str, dict[int, int]] = {
    "9.0": {2: 64 * MIB, 4: 32 * MIB, 6: MIB // 2, 8: MIB // 4},
    "10.0": {2: 2 * MIB, 4: 2 * MIB, 6: 1 * MIB, 8: 1 * MIB},
    "10.3": {2: 4 * MIB, 4: 4 * MIB, 6: 8 * MIB, 8: 4 * MIB},
}
#: all_reduce_utils.SYMM_MEM_ALL_REDUCE_MAX_SIZES: largest message (inclusive) the symmetric-memory path takes
SYMM_MEM_MAX_BYTES: dict[str, dict[int, int]] = {
    "9.0": {2: 64 * MIB, 4: 32 * MIB, 6: 64 * MIB, 8: 64 * MIB},
    "10.0": {2: 8 * MIB, 4: 32 * MIB, 6: 128 * MIB, 8: 128 * MIB},
    "10.3": {2: 4 * MIB, 4: 32 * MIB, 6: 32 * MIB, 8: 64 * MIB},
}
#: the only dtype SymmMemCommunicator reduces
SYMM_MEM_DTYPES = ("bf16", "bfloat16")


def custom_allreduce_enabled(hw: HardwareSpec, world_size: int) -> bool:
    """Whether vLLM's CustomAllreduce initialises (and stays enabled) for a TP group of ``world_size`` GPUs."""
    if world_size not in CUSTOM_AR_WORLD_SIZES or world_size > hw.gpus_per_node or not hw.peer_to_peer:
        return False
    # more than two PCIe-only GPUs: disabled (it would gain little over NCCL through the host bridge)
    return world_size == 2 or has_fast_interconnect(hw)


def symm_mem_enabled(hw: HardwareSpec, world_size: int) -> bool:
    """Whether vLLM's SymmMemCommunicator initialises for ``world_size`` GPUs: CUDA, a capability and world size
    of its table, and a multicast buffer (NVSwitch-connected NVLink; PCIe-only GPUs get no multicast address)."""
    return (hw.vendor == "nvidia" and world_size in SYMM_MEM_MAX_BYTES.get(hw.compute_capability, {})
            and world_size <= hw.gpus_per_node and has_fast_interconnect(hw))


def custom_allreduce_max_bytes(hw: HardwareSpec, world_size: int, use_symm_mem: bool = True) -> int:
    """The custom all-reduce's ``max_size`` (exclusive) on ``hw`` at ``world_size``."""
    if use_symm_mem and symm_mem_enabled(hw, world_size):
        cap = CUSTOM_AR_MAX_BYTES_WITH_SYMM_MEM.get(hw.compute_capability, {}).get(world_size)
        if cap is not None:
            return min(cap, CUSTOM_AR_MAX_BYTES)
    return CUSTOM_AR_MAX_BYTES


def allreduce_implementation(
    hw: HardwareSpec,
    world_size: int,
    message_bytes: float,
    dtype: str = "bf16",
    cuda_graph: bool = True,
    custom_all_reduce: bool = True,
    use_symm_mem: bool = True,
) -> str:
    """The implementation vLLM runs a TP all-reduce of ``message_bytes`` on (``custom``, ``symm_mem``, ``nccl``;
    ``none`` for one GPU). ``custom_all_reduce`` = not ``--disable-custom-all-reduce``; ``use_symm_mem`` =
    ``VLLM_ALLREDUCE_USE_SYMM_MEM`` (default on). ``cuda_graph`` does not change the choice (module docstring);
    it is taken so that callers state the mode they price."""
    del cuda_graph  # same dispatch in both modes; the price differs (allreduce_pricing_backend)
    if world_size <= 1:
        return NO_ALLREDUCE
    size = int(message_bytes)
    if custom_all_reduce and custom_allreduce_enabled(hw, world_size) and size % 16 == 0 \
            and size < custom_allreduce_max_bytes(hw, world_size, use_symm_mem):
        return CUSTOM
    if use_symm_mem and symm_mem_enabled(hw, world_size) and str(dtype).lower() in SYMM_MEM_DTYPES \
            and size % 4 == 0 and size <= SYMM_MEM_MAX_BYTES[hw.compute_capability][world_size]:
        return SYMM_MEM
    return NCCL


def allreduce_pricing_backend(implementation: str, cuda_graph: bool = True) -> str:
    """Calibration backend whose curve prices ``implementation`` in that mode: the implementation's name inside a
    CUDA graph, ``<name>_eager`` outside one (eager adds the launch and, for the custom all-reduce, the copy into
    its registered buffer)."""
    return implementation if cuda_graph else f"{implementation}_eager"


__all__ = [
    "ALLREDUCE_IMPLEMENTATIONS",
    "CUSTOM",
    "CUSTOM_AR_MAX_BYTES",
    "CUSTOM_AR_MAX_BYTES_WITH_SYMM_MEM",
    "CUSTOM_AR_WORLD_SIZES",
    "NCCL",
    "NO_ALLREDUCE",
    "SYMM_MEM",
    "SYMM_MEM_MAX_BYTES",
    "allreduce_implementation",
    "allreduce_pricing_backend",
    "custom_allreduce_enabled",
    "custom_allreduce_max_bytes",
    "has_fast_interconnect",
    "symm_mem_enabled",
]
