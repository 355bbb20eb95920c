"""The kernel model respects physics: no kernel beats its roofline, and the step composes sensibly."""

from __future__ import annotations

import itertools

import pytest

from kernelsight import profiles
from kernelsight.engine_args import create_engine_config
from kernelsight.simcore import kernels as K
from kernelsight.simcore.engine_config import EngineArgs, build_step_model, resolve_engine_config
from kernelsight.simcore.kernels import BatchShape, PrefillChunk
from kernelsight.simcore.memory import weight_bytes_per_rank
from kernelsight.simcore.roofline import kernel_roofline_s, roofline_s, wave_utilization

MODELS = ["meta-llama/Llama-3.1-8B", "Qwen/Qwen3-30B-A3B", "mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen3-0.6B"]
HARDWARE = ["h100", "a100", "l40s", "4090", "b200", "gb200", "b300", "mi300x"]
BATCHES = [
    BatchShape((), 1, 100),
    BatchShape((), 64, 64 * 2000),
    BatchShape((PrefillChunk(512, 0, True),), 0, 0),
    BatchShape((PrefillChunk(2048, 4096, False), PrefillChunk(17, 1024, True)), 200, 200 * 800),
]


def test_wave_quantization_penalizes_partial_waves():
    assert wave_utilization(132, 132) == 1.0
    assert wave_utilization(133, 132) == pytest.approx(264 / 133)
    assert wave_utilization(1, 132) == 132.0
    # compute-bound: one tile more than a full wave costs almost a second wave
    one = roofline_s(1e12, 1.0, 132, 1e15, 1e12, 132)
    two = roofline_s(1e12, 1.0, 133, 1e15, 1e12, 132)
    assert two > 1.9 * one


@pytest.mark.parametrize("model_id,hw_name", list(itertools.product(MODELS, HARDWARE)))
def test_every_kernel_at_least_its_roofline(model_id, hw_name):
    model = profiles.load_model(model_id)
    hw = profiles.load_hardware(hw_name)
    calib = profiles.load_calibration(hw.name)
    for tp in (1, 2, 4, 8):       # the smallest TP degree the model fits at
        try:
            cfg = resolve_engine_config(EngineArgs(model=model_id, hardware=hw_name, tensor_parallel_size=tp,
                                                   max_model_len=8192, gpu_memory_utilization=0.95),
                                        model, hw, calib)
            break
        except ValueError:
            continue
    sm = build_step_model(cfg)
    checked = 0
    for batch in BATCHES:
        for k in K.decompose_step(model, batch, tp, cfg.precision):
            bound = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, hw) * k.count
            predicted = sm.kernel_time_s(k)
            assert predicted >= bound / calib.eta_max * (1 - 1e-12), (k.name, predicted, bound)
            assert predicted > 0
            checked += 1
    assert checked > 40


def test_batch1_decode_is_weight_streaming(llama8b, h100):
    """Batch-1 decode of Llama-3.1-8B bf16 on H100 ≈ weight bytes / HBM bandwidth + fixed overheads."""
    cfg = resolve_engine_config(EngineArgs(max_model_len=8192), llama8b, h100, profiles.load_calibration("h100"))
    sm = build_step_model(cfg)
    batch = BatchShape((), 1, 512)
    br = sm.breakdown_dict(batch)
    weights_s = weight_bytes_per_rank(llama8b, cfg.precision, 1) / h100.mem_bytes_per_s
    # launch overhead = graph launch + each kernel's fixed start-up latency; host = CPU time per step
    calib = cfg.calibration
    per_kernel_s = sum(calib.kernel_overhead_s(k.family) * k.count
                       for k in K.decompose_step(llama8b, batch, 1, cfg.precision))
    overhead_s = br["launch"] + br["host"] + per_kernel_s
    step_s = sm.step_time_s(batch)
    assert weights_s > 4.5e-3                      # 16 GB at 3.35 TB/s
    assert abs(step_s - (weights_s + overhead_s)) / (weights_s + overhead_s) < 0.15
    assert step_s > weights_s                      # never faster than streaming the weights once


def test_tensor_parallel_halves_gemms_and_adds_allreduce():
    model = profiles.load_model("meta-llama/Llama-3.1-70B")
    hw = profiles.load_hardware("h100")
    calib = profiles.load_calibration("h100")
    batch = BatchShape((PrefillChunk(1024, 0, True),), 32, 32 * 1000)
    times = {}
    for tp in (2, 4):
        cfg = resolve_engine_config(EngineArgs(model="meta-llama/Llama-3.1-70B", tensor_parallel_size=tp,
                                               max_model_len=8192), model, hw, calib)
        times[tp] = build_step_model(cfg).breakdown_dict(batch)
    ratio = times[4]["gemm"] / times[2]["gemm"]
    assert 0.45 < ratio < 0.65
    assert times[2]["all_reduce"] > 0 and times[4]["all_reduce"] > 0
    assert times[4]["all_reduce"] > 0.5 * times[2]["all_reduce"]   # ring volume grows with T, not shrinks


def test_single_gpu_has_no_allreduce(llama8b, h100):
    cfg = resolve_engine_config(EngineArgs(max_model_len=8192), llama8b, h100, profiles.load_calibration("h100"))
    br = build_step_model(cfg).breakdown_dict(BatchShape((), 8, 8000))
    assert br["all_reduce"] == 0.0


def test_lm_head_runs_only_over_sampling_rows(llama8b):
    from kernelsight.simcore.precision import Precision

    prec = Precision()
    partial = BatchShape((PrefillChunk(2000, 0, False),), 0, 0)    # chunk that does not finish its prompt
    finishing = BatchShape((PrefillChunk(2000, 0, True),), 0, 0)
    names = {k.name for k in K.decompose_step(llama8b, partial, 1, prec)}
    assert "lm_head" not in names
    lm = [k for k in K.decompose_step(llama8b, finishing, 1, prec) if k.name == "lm_head"]
    assert lm and lm[0].features[0] == 1.0                         # m = one sampling row, not 2000


def test_cuda_graph_padding_of_decode_batches(llama8b, h100):
    cfg = resolve_engine_config(EngineArgs(max_model_len=8192), llama8b, h100, profiles.load_calibration("h100"))
    sm = build_step_model(cfg)
    assert sm.graph_mode(BatchShape((), 13, 1300)) == ("full", 16)
    assert sm.graph_mode(BatchShape((PrefillChunk(100, 0, True),), 13, 1300)) == ("piecewise", 120)
    assert sm.graph_mode(BatchShape((PrefillChunk(4000, 0, True),), 0, 0))[0] == "eager"
    # padded rows cost work: 13 and 16 decodes run the same padded norms/activations (the LM head runs
    # outside the graph on the sampling rows only)
    t13 = sm.breakdown_dict(BatchShape((), 13, 13 * 100))
    t16 = sm.breakdown_dict(BatchShape((), 16, 16 * 100))
    for fam in ("norm", "activation", "rope", "kv_write"):
        assert t13[fam] == pytest.approx(t16[fam])
    eager = resolve_engine_config(EngineArgs(max_model_len=8192, enforce_eager=True), llama8b, h100,
                                  profiles.load_calibration("h100"))
    assert build_step_model(eager).graph_mode(BatchShape((), 13, 1300)) == ("eager", 13)


def test_fp8_weights_speed_up_memory_bound_decode(llama8b, h100):
    calib = profiles.load_calibration("h100")
    base = resolve_engine_config(EngineArgs(max_model_len=8192), llama8b, h100, calib)
    fp8 = resolve_engine_config(EngineArgs(max_model_len=8192, quantization="fp8"), llama8b, h100, calib)
    b = BatchShape((), 1, 100)
    # half the weight bytes, but not half the time at these sizes: the measured H100 fp8/bf16 ratio at m = 1 is
    # 0.72 for 6144×4096 and 0.92 for 4096×4096 (fixed latency), ~0.5 only for GB-size weights
    assert build_step_model(fp8).breakdown_dict(b)["gemm"] < 0.75 * build_step_model(base).breakdown_dict(b)["gemm"]
    assert fp8.memory.num_gpu_blocks > base.memory.num_gpu_blocks       # smaller weights leave more KV room
    kv8 = resolve_engine_config(EngineArgs(max_model_len=8192, kv_cache_dtype="fp8"), llama8b, h100, calib)
    assert kv8.memory.num_gpu_blocks == pytest.approx(2 * base.memory.num_gpu_blocks, rel=0.01)


def test_decode_window_matches_single_steps(llama8b, h100):
    cfg = resolve_engine_config(EngineArgs(max_model_len=8192), llama8b, h100, profiles.load_calibration("h100"))
    sm = build_step_model(cfg)
    durations, total = sm.decode_window(40, 40 * 700, 16)
    singles = [sm.step_time_s(BatchShape((), 40, 40 * 700 + 40 * j)) for j in range(16)]
    assert durations[0] == pytest.approx(singles[0], rel=1e-12)
    assert durations[-1] == pytest.approx(singles[-1], rel=1e-12)
    for d, s in zip(durations, singles, strict=True):
        assert d == pytest.approx(s, rel=2e-3)
    assert total.sum() == pytest.approx(sum(durations), rel=1e-9)


@pytest.mark.parametrize("model_id", ["meta-llama/Llama-3.1-8B", "Qwen/Qwen3-30B-A3B", "mistralai/Mixtral-8x7B-v0.1"])
def test_specialised_decode_attention_equals_generic_kernel_path(model_id):
    cfg = resolve_engine_config(EngineArgs(model=model_id, tensor_parallel_size=2, max_model_len=8192),
                                profiles.load_model(model_id), profiles.load_hardware("h100"),
                                profiles.load_calibration("h100"))
    sm = build_step_model(cfg)
    m, p = cfg.model, cfg.precision
    for b, ctx in [(1, 100), (37, 37 * 1234), (256, 256 * 4000)]:
        k = K.attention_decode_kernel(b, ctx, m.num_attention_heads // 2, max(m.num_kv_heads // 2, 1), m.head_dim,
                                      p.act_bytes, p.kv_bytes_per_element, m.num_layers, m.sliding_window)
        assert sm._decode_eta_s(b, ctx) * m.num_layers == pytest.approx(sm.kernel_time_s(k), rel=1e-12)
        # a serving step adds only the floor of streaming the KV cache from DRAM (test_decode_stream.py)
        assert sm._decode_attention_s(b, ctx) == pytest.approx(
            max(sm._decode_eta_s(b, ctx), sm._decode_stream_s(b, ctx, (), False)) * m.num_layers, rel=1e-12)


def test_step_model_caches_answer_exactly_what_a_fresh_model_computes(llama8b, h100):
    """Prefill attention is memoized on the chunks' (new, cached) counts and a decode window's first step is kept
    for a shorter window from the same start: every answer must equal a fresh model's bit for bit, for batches
    that share a key's parts but not all of it (same new tokens, other cached tokens; same decodes, other
    context), and a returned breakdown must not alias the kept one."""
    cfg = resolve_engine_config(EngineArgs(max_model_len=8192), llama8b, h100, profiles.load_calibration("h100"))
    warm = build_step_model(cfg)
    batches = [BatchShape((PrefillChunk(1000, 0, True),), 30, 30 * 900),
               BatchShape((PrefillChunk(1000, 512, True),), 30, 30 * 900),
               BatchShape((PrefillChunk(1000, 0, False),), 31, 31 * 900),
               BatchShape((PrefillChunk(1000, 0, True), PrefillChunk(24, 64, True)), 30, 30 * 905)]
    for _ in range(2):
        for batch in batches:
            fresh = build_step_model(cfg)
            got, want = warm.step(batch), fresh.step(batch)
            assert got[1] == want[1] and got[0].tolist() == want[0].tolist()
    distinct = {warm.step(b)[1] for b in batches}
    assert len(distinct) == len(batches)
    for k_first, k_cut in [(64, 5), (64, 1), (5, 64)]:
        warm.decode_window(40, 40 * 700, k_first)
        durations, total = warm.decode_window(40, 40 * 700, k_cut)
        want_d, want_t = build_step_model(cfg).decode_window(40, 40 * 700, k_cut)
        assert durations == want_d and total.tolist() == want_t.tolist()
        total += 1.0                                   # the caller owns the array it got
        assert warm.decode_window(40, 40 * 700, k_cut)[1].tolist() == want_t.tolist()
    other = warm.decode_window(40, 40 * 701, 8)        # another start context: not the kept first step
    assert other[0] == build_step_model(cfg).decode_window(40, 40 * 701, 8)[0]
    assert other[0][0] != warm.decode_window(40, 40 * 700, 8)[0][0]


def test_moe_weight_traffic_counts_the_experts_a_batch_can_hit():
    # one decode token picks exactly top_k experts; many tokens approach all of them
    assert K.expected_active_experts(128, 8, 1) == pytest.approx(8.0)
    assert K.expected_active_experts(128, 8, 2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert 127.9 < K.expected_active_experts(128, 8, 1000) <= 128
    model = profiles.load_model("Qwen/Qwen3-30B-A3B")
    prec = create_engine_config(EngineArgs(model="Qwen/Qwen3-30B-A3B", hardware="h100")).precision
    experts = {k.name: k for k in K.moe_kernels(model, 1, 1, prec, 1, routing="balanced")}["moe_experts"]
    expert_bytes = model.hidden_size * 3 * model.moe_intermediate_size * prec.weight_bytes_per_param
    # a single token reads its 8 experts' weights (plus its own activations), not ~52 experts'
    assert experts.features[3] == 8
    assert 8 * expert_bytes <= experts.bytes_moved < 8.05 * expert_bytes


@pytest.mark.parametrize("hw_name", ["rtx-pro-6000", "h100-sxm", "a100-sxm", "l40s"])
def test_no_kernel_reads_more_than_the_l2_holds_faster_than_dram(hw_name):
    """η may exceed 1 where the tables time L2-warm kernels, but at most the L2's bytes can come from the L2: the
    A100's decode model extrapolated to 2.1 GB of KV per layer (its rows stop at 1.07 GB) read it at 2.1 TB/s on
    2.04 TB/s of HBM; every tier is floored at the bytes beyond the L2 over DRAM bandwidth."""
    from kernelsight.calibrate.evaluate import cross_generation_for
    from kernelsight.simcore.calibration import Calibration
    from kernelsight.simcore.step_model import StepConfig, StepModel

    hw = profiles.load_hardware(hw_name)
    cfg = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware=hw_name, max_model_len=8192))
    for calib in (profiles.load_calibration(hw_name), cross_generation_for(hw)):
        assert isinstance(calib, Calibration)
        sm = StepModel(cfg.model, hw, calib, cfg.precision, StepConfig(cudagraph_capture_sizes=(1, 8, 64)))
        for m, n, k in ((1, 128256, 4096), (8, 128256, 4096), (1, 65536, 16384), (1, 28672, 4096)):
            kern = K.gemm_kernel("lm_head", m, n, k, "bf16", 2.0, 2.0)
            floor = (kern.bytes_moved - hw.l2_bytes) / hw.usable_mem_bytes_per_s
            assert sm.kernel_time_s(kern) >= floor * (1 - 1e-12), (calib.tier, m, n, k)
        b, ctx = 64, 64 * 8192                       # 2.1 GB of KV per layer
        kern = K.attention_decode_kernel(b, ctx, 32, 8, 128, 2.0, 2.0, 1)
        floor = (kern.bytes_moved - hw.l2_bytes) / hw.usable_mem_bytes_per_s
        assert sm._decode_eta_s(b, ctx) >= floor * (1 - 1e-12)
        assert sm.kernel_time_s(kern) >= floor * (1 - 1e-12)


@pytest.mark.parametrize("model_id,gpu,eager", [("meta-llama/Llama-3.1-8B", "h100", False),
                                                ("meta-llama/Llama-3.1-8B", "l40s", True),
                                                ("Qwen/Qwen3-30B-A3B", "h100", False)])
def test_decode_window_first_step_is_the_step_bit_for_bit(model_id, gpu, eager):
    # the window prices its first step without building a batch: it must be the step's own arithmetic
    cfg = resolve_engine_config(EngineArgs(model=model_id, max_model_len=8192, enforce_eager=eager),
                                profiles.load_model(model_id), profiles.load_hardware(gpu),
                                profiles.load_calibration(gpu))
    for b, ctx in ((1, 900), (37, 37 * 1300), (200, 200 * 40)):
        durations, breakdown = build_step_model(cfg).decode_window(b, ctx, 1)
        want_b, want_t = build_step_model(cfg).step(BatchShape((), b, ctx))
        assert durations == [want_t]
        assert breakdown.tolist() == want_b.tolist()
