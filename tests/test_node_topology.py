"""The node's topology and vLLM's --disable-custom-all-reduce decide which all-reduce a TP group runs."""

from __future__ import annotations

import pytest

from kernelsight.engine_args import create_engine_config
from kernelsight.loadgen.vllm_run import engine_args_from_run
from kernelsight.profiles import load_calibration, load_hardware
from kernelsight.simcore import kernels as K
from kernelsight.simcore.allreduce_dispatch import CUSTOM, NCCL, allreduce_implementation
from kernelsight.simcore.comm import allreduce_implementation_s
from kernelsight.simcore.engine_config import EngineArgs, build_step_model
from kernelsight.simcore.hardware import node_topology, with_node_topology
from kernelsight.simcore.kernel_shapes import BatchShape

MSG = 64 * 5120 * 2     # a decode step's hidden states at batch 64, Qwen3-32B


@pytest.mark.parametrize(("gpu", "topology"), [("h100", "nvlink"), ("rtx-pro-6000", "pcie"), ("l40s", "pcie"),
                                               ("rtx-4090", "pcie-no-p2p")])
def test_each_profile_has_its_topology(gpu, topology):
    hw = load_hardware(gpu)
    assert node_topology(hw) == topology
    assert with_node_topology(hw, None) is hw and with_node_topology(hw, topology) is hw


def test_a_pcie_node_without_peer_to_peer_runs_nccl_at_tp2():
    pro = load_hardware("rtx-pro-6000")
    assert allreduce_implementation(pro, 2, MSG) == CUSTOM
    assert allreduce_implementation(pro, 2, MSG, custom_all_reduce=False) == NCCL
    no_p2p = with_node_topology(pro, "pcie-no-p2p")
    assert not no_p2p.peer_to_peer and allreduce_implementation(no_p2p, 2, MSG) == NCCL
    # an NVLink node taken as PCIe: its GPUs reach each other at the PCIe bandwidth, custom all-reduce only at TP 2
    h100 = with_node_topology(load_hardware("h100"), "pcie")
    assert h100.intra_node_bytes_per_s == h100.pcie_bytes_per_s and node_topology(h100) == "pcie"
    assert allreduce_implementation(h100, 2, MSG) == CUSTOM and allreduce_implementation(h100, 4, MSG) == NCCL
    with pytest.raises(ValueError, match="no NVLink"):
        with_node_topology(load_hardware("rtx-4090"), "nvlink")
    with pytest.raises(ValueError, match="must be one of"):
        with_node_topology(pro, "infiniband")


def _allreduce_s(**kw) -> tuple[float, dict]:
    cfg = create_engine_config(EngineArgs(model="Qwen/Qwen3-32B", hardware="rtx-pro-6000", tensor_parallel_size=2,
                                          max_model_len=8192, vllm_version="0.19.0", **kw))
    step = build_step_model(cfg)
    fam = step.breakdown_dict(BatchShape(num_decodes=64, decode_context_tokens=64 * 1024))
    return fam[K.ALL_REDUCE], cfg.summary()


def test_the_step_prices_the_all_reduce_vllm_runs():
    custom_s, s = _allreduce_s()
    assert s["node_topology"] == "pcie" and s["custom_all_reduce"] is True
    nccl_s, s = _allreduce_s(disable_custom_all_reduce=True)
    assert s["custom_all_reduce"] is False
    no_p2p_s, s = _allreduce_s(node_topology="pcie-no-p2p")
    assert s["node_topology"] == "pcie-no-p2p"
    calib, hw = load_calibration("rtx-pro-6000", vllm_version="0.19.0"), load_hardware("rtx-pro-6000")
    n = K.allreduces_per_step(create_engine_config(EngineArgs(model="Qwen/Qwen3-32B", max_model_len=8192)).model)
    m = 64   # a CUDA-graph size: the decode batch is not padded further
    msg = m * 5120 * 2
    assert custom_s == pytest.approx(n * allreduce_implementation_s(CUSTOM, msg, 2, hw, calib.comm))
    assert nccl_s == no_p2p_s == pytest.approx(n * allreduce_implementation_s(NCCL, msg, 2, hw, calib.comm))
    assert nccl_s != custom_s   # the measured PCIe curves differ (NCCL is the faster here)


def test_a_runs_meta_json_carries_the_flag():
    meta = {"engine_kwargs": {"model": "meta-llama/Llama-3.1-8B"},
            "resolved_config": {"parallel_config": {"disable_custom_all_reduce": True}}}
    assert engine_args_from_run(meta).disable_custom_all_reduce is True


def test_serve_and_simulate_take_the_flags():
    from kernelsight.cli import build_parser

    for cmd in (["simulate"], ["serve"]):
        ns = build_parser().parse_args([*cmd, "--disable-custom-all-reduce", "--node-topology", "pcie-no-p2p"])
        assert ns.disable_custom_all_reduce and ns.node_topology == "pcie-no-p2p"
