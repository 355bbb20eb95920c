"""The microbenchmark sweep's shape draw and timing plumbing (no GPU: torch on CPU where importable)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from kernelsight.calibrate import sweep, sweep_attention, sweep_shapes, sweep_timing
from kernelsight.calibrate.measurements import read_table


def test_the_draw_is_fixed_by_the_seed_and_stays_inside_the_space():
    g = sweep_shapes.build_grid(num_gpus=8)
    assert g == sweep_shapes.build_grid(num_gpus=8)
    assert len(g.gemm) == 2 * sweep_shapes.SWEEP_POINTS["gemm"]
    assert len(g.attn_prefill) == sweep_shapes.SWEEP_POINTS["attn_prefill"]
    assert len(g.attn_decode) == sweep_shapes.SWEEP_POINTS["attn_decode"]
    assert set(g.attn_prefill) <= set(sweep_shapes.prefill_space())
    assert set(g.attn_decode) <= set(sweep_shapes.decode_space())
    for dt in ("bf16", "fp8"):
        assert {p for p in g.gemm if p[0] == dt} <= set(sweep_shapes.gemm_space(dt))
    other = sweep_shapes.build_grid(num_gpus=8, seed=1)
    assert other.gemm != g.gemm and len(set(other.attn_decode) & set(g.attn_decode)) < len(g.attn_decode)
    # a drawn set covers each axis of the space, not a corner of it
    assert {p[1] for p in g.gemm} == set(sweep_shapes.GEMM_M)
    assert {p[2] for p in g.gemm} == set(sweep_shapes.GEMM_NK)
    assert {(p[2], p[3]) for p in g.attn_prefill} == set(sweep_shapes.ATTN_HEADS)


def test_every_point_respects_the_memory_flop_and_token_limits():
    for _, m, n, k in sweep_shapes.gemm_space("bf16"):
        assert 2.0 * m * n * k <= sweep_shapes.MAX_POINT_FLOPS
        assert 2.0 * (m * k + n * k + m * n) <= sweep_shapes.MAX_POINT_BYTES
    for b, s, qh, kvh, hd, _, _ in sweep_shapes.prefill_space(sweep_shapes.SWEEP_WINDOWS):
        assert b * s <= sweep_shapes.MAX_PREFILL_TOKENS and qh % kvh == 0
        assert 2.0 * b * s * s * qh * hd <= sweep_shapes.MAX_POINT_FLOPS
    for b, c, _, kvh, hd, _, _ in sweep_shapes.decode_space(sweep_shapes.SWEEP_WINDOWS):
        assert 4.0 * b * (c + 1) * kvh * hd <= sweep_shapes.MAX_POINT_BYTES


def test_windows_and_formats_are_only_drawn_when_asked_for():
    plain = sweep_shapes.build_grid(gemm_dtypes=("bf16",))
    assert {p[0] for p in plain.gemm} == {"bf16"}
    assert {p[6] for p in plain.attn_prefill} == {0} and {p[6] for p in plain.attn_decode} == {0}
    windowed = sweep_shapes.build_grid(windows=sweep_shapes.SWEEP_WINDOWS)
    assert {p[6] for p in windowed.attn_prefill} == set(sweep_shapes.SWEEP_WINDOWS)
    # windows that bind and windows longer than the context (what a windowed model runs on short contexts)
    for fam in ("attn_prefill", "attn_decode"):
        slid = [p for p in getattr(windowed, fam) if p[6]]
        assert any(p[1] < p[6] for p in slid) and any(p[1] > p[6] for p in slid)
    # windows come on top: full attention keeps the very points a sweep without windows draws
    full = sweep_shapes.build_grid()
    for fam in ("attn_prefill", "attn_decode"):
        drawn = getattr(windowed, fam)
        assert [p for p in drawn if p[6] == 0] == list(getattr(full, fam))
        assert len(drawn) == len(getattr(full, fam)) + int(sweep_shapes.SWEEP_POINTS[fam] * sweep_shapes.WINDOW_SHARE)
    whole = sweep_shapes.build_grid(points={"gemm": None, "attn_prefill": None, "attn_decode": None})
    assert len(whole.attn_decode) == len(sweep_shapes.decode_space())


def test_fp8_kv_points_come_on_top_and_leave_the_bf16_draw_alone():
    windowed = sweep_shapes.build_grid(windows=sweep_shapes.SWEEP_WINDOWS)
    both = sweep_shapes.build_grid(windows=sweep_shapes.SWEEP_WINDOWS, fp8_kv=True)
    for fam in ("attn_prefill", "attn_decode"):
        drawn = getattr(both, fam)
        assert [p for p in drawn if p[5] == "bf16"] == list(getattr(windowed, fam))
        fp8 = [p for p in drawn if p[5] == "fp8"]
        assert len(fp8) == int(sweep_shapes.SWEEP_POINTS[fam] * sweep_shapes.FP8_KV_SHARE)
        assert {p[6] for p in fp8} == {0}
    assert sweep_shapes.runs_fa3("nvidia", (9, 0)) and not sweep_shapes.runs_fa3("nvidia", (8, 9))
    assert not sweep_shapes.runs_fa3("nvidia", (10, 0)) and not sweep_shapes.runs_fa3("amd", (9, 4))


def test_fp8_kv_attention_is_called_as_vllm_runs_it_on_fa3(monkeypatch):
    """A stand-in FA3: an fp8 point passes e4m3 query/keys/values, (batch, KV heads) descales and a bf16 output;
    without FlashAttention (SDPA) fp8 points are left out; the test call decides whether fp8 is timed at all."""
    torch = pytest.importorskip("torch")
    calls, said = [], []

    def fa3(**kw):
        calls.append(kw)
        return kw["q"]

    point = (3, 16, 8, 2, 64, "fp8", 0)
    rows, kernel = sweep._attention_rows(torch, [point], False, "cpu", 1, (fa3, "vllm_flash_attn_fa3"))
    assert kernel == "vllm_flash_attn_fa3" and [r[:7] for r in rows] == [point]
    kw = calls[0]
    assert kw["q"].dtype == kw["k"].dtype == kw["v"].dtype == torch.float8_e4m3fn
    assert kw["q"].shape == (3 * 16, 8, 64) and kw["k"].shape == (3, 16, 2, 64)   # paged: a block of 16 each
    assert all(kw[d].shape == (3, 2) and kw[d].dtype == torch.float32 for d in ("q_descale", "k_descale", "v_descale"))
    assert kw["out"].dtype == torch.bfloat16 and kw["out"].shape == (3 * 16, 8, 64)
    assert sweep._attention_rows(torch, [point], True, "cpu", 1, None)[0] == []   # SDPA: left out
    assert sweep_attention.flash_runs_fp8_kv(torch, (fa3, "vllm_flash_attn_fa3"), "cpu", said.append) and said == []
    # FA2: no fp8
    assert not sweep_attention.flash_runs_fp8_kv(torch, (fa3, "vllm_flash_attn_fa2"), "cpu", said.append)

    def no_fp8(**kw):
        raise RuntimeError("FlashAttention only supports fp16 and bf16 data type")

    assert not sweep_attention.flash_runs_fp8_kv(torch, (no_fp8, "vllm_flash_attn_fa3"), "cpu", said.append)
    assert len(said) == 1 and "bf16 KV cache only" in said[0]


def test_per_row_kernel_names_are_written(tmp_path):
    rows = [("bf16", 1, 64, 64, 3.0), ("fp8", 1, 64, 64, 2.5)]
    p = sweep.write_csv(tmp_path / "gemm.csv", "gemm", rows, kernel=[sweep.GEMM_KERNELS[r[0]] for r in rows])
    t = read_table(p)
    assert t["kernel"].tolist() == ["torch.nn.functional.linear", "torch._scaled_mm"]
    assert t["latency_us"].tolist() == [3.0, 2.5]


def test_sdpa_times_grouped_heads_without_windows():
    torch = pytest.importorskip("torch")
    points = [(2, 16, 8, 2, 64, "bf16", 0), (1, 64, 4, 1, 64, "bf16", 32)]
    rows, kernel = sweep._attention_rows(torch, points, False, "cpu", 1, None)
    assert kernel == "torch_sdpa"
    assert [r[:7] for r in rows] == [points[0]]   # SDPA has no sliding-window kernel: that point is left out
    assert rows[0][7] > 0
    assert sweep.gemm_formats(torch, "cpu") == ("bf16",)


def test_flash_attention_gets_varlen_batches_windows_and_its_name(monkeypatch):
    """The FlashAttention path with a stand-in module: the call the sweep makes (keyword arguments only)."""
    torch = pytest.importorskip("torch")
    calls = []

    def varlen(**kw):
        calls.append(kw)
        return kw["q"]

    monkeypatch.setitem(sys.modules, "vllm", None)   # no vLLM: the flash_attn package is next
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=varlen))
    flash = sweep_attention.flash_attn_varlen()
    assert flash is not None and flash[1] == "flash_attn"
    prefill = [(3, 16, 8, 2, 64, "bf16", 0), (2, 64, 4, 4, 128, "bf16", 32)]
    rows, kernel = sweep._attention_rows(torch, prefill, False, "cpu", 1, flash)
    assert kernel == "flash_attn" and [r[:7] for r in rows] == prefill
    first = calls[0]
    assert first["q"].shape == (3 * 16, 8, 64) and first["k"].shape == (3 * 16, 2, 64)
    assert first["cu_seqlens_q"].tolist() == [0, 16, 32, 48] and first["max_seqlen_k"] == 16
    assert first["window_size"] == (-1, -1) and first["causal"]
    windowed = next(c for c in calls if c["q"].shape[0] == 2 * 64)
    assert windowed["window_size"] == (31, 0)
    calls.clear()
    rows, _ = sweep._attention_rows(torch, [(4, 127, 8, 1, 64, "bf16", 0)], True, "cpu", 1, flash)
    dec = calls[0]
    assert dec["q"].shape == (4, 8, 64) and dec["k"].shape == (4 * 128, 1, 64)
    assert dec["cu_seqlens_k"].tolist() == [0, 128, 256, 384, 512] and dec["max_seqlen_q"] == 1
    assert np.isfinite(rows[0][7])


def test_gemm_weight_copies_cover_twice_the_l2_and_no_more():
    assert sweep.weight_copies(32 * 2**20, 0) == 1   # no L2 size known (CPU): one weight
    for weight in (2048, 1e6, 8 * 2**20, 32 * 2**20, 50 * 2**20, 3 * 2**30):
        for l2 in (40 * 2**20, 50 * 2**20, 96 * 2**20):
            n = sweep.weight_copies(weight, l2)
            # between two reads of a byte the rotation reads ≥ 2 × L2, and one copy fewer would not
            assert n * weight >= sweep.COLD_L2_FACTOR * l2 and (n == 1 or (n - 1) * weight < sweep.COLD_L2_FACTOR * l2)
            assert n * weight < 2 * sweep.COLD_L2_FACTOR * l2 or n == 1   # memory: under 4 × L2, or one weight
    assert sweep.weight_copies(3 * 2**30, 50 * 2**20) == 1   # larger than L2 many times over: runs alone


def test_each_gemm_call_reads_the_next_weight_copy_in_the_order_they_were_made(monkeypatch):
    torch = pytest.importorskip("torch")
    seen = []
    linear = torch.nn.functional.linear

    def recording_linear(x, w):
        seen.append(w.data_ptr())
        return linear(x, w)

    monkeypatch.setattr(torch.nn.functional, "linear", recording_linear)
    weight_bytes = 2 * 16 * 32   # bf16, n = 16, k = 32
    fn = sweep._gemm_fn(torch, "bf16", 4, 16, 32, "cpu", l2_bytes=2 * weight_bytes)
    for _ in range(12):
        assert fn().shape == (4, 16)
    copies = sweep.weight_copies(weight_bytes, 2 * weight_bytes)
    assert copies == 4
    assert [p - seen[0] for p in seen] == [(i % copies) * weight_bytes for i in range(12)]
    one = sweep._gemm_fn(torch, "bf16", 4, 16, 32, "cpu")   # no L2 size: the same weight every call
    seen.clear()
    one(), one()
    assert seen[0] == seen[1]
    with pytest.raises(ValueError, match="int4"):
        sweep._gemm_fn(torch, "int4", 4, 16, 32, "cpu")


def test_vllms_flash_attention_is_called_with_the_version_vllm_serves_with(monkeypatch):
    """vLLM's FlashAttention build defaults to FA2; vLLM itself runs FA3 on Hopper. The sweep asks vLLM's picker
    (else the build's support check) and records the version in the kernel name, as the shared tables do."""
    calls = []

    def varlen(**kw):
        calls.append(kw)
        return kw

    fork = types.SimpleNamespace(flash_attn_varlen_func=varlen, is_fa_version_supported=lambda v: v in (2, 3))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", fork)
    for path in sweep_attention.FA_VERSION_PICKERS:
        monkeypatch.setitem(sys.modules, path, None)   # no picker: the build's own support check decides
    fn, name = sweep_attention.flash_attn_varlen()
    assert name == "vllm_flash_attn_fa3"
    fn(q=1)
    assert calls[-1] == {"q": 1, "fa_version": 3}
    fork.is_fa_version_supported = lambda v: v == 2   # an Ampere / Ada GPU
    assert sweep_attention.flash_attn_varlen()[1] == "vllm_flash_attn_fa2"
    # vLLM's own picker wins where it can be imported (it honours vLLM's attention config)
    monkeypatch.setitem(sys.modules, sweep_attention.FA_VERSION_PICKERS[1],
                        types.SimpleNamespace(get_flash_attn_version=lambda: 3))
    assert sweep_attention.flash_attn_varlen()[1] == "vllm_flash_attn_fa3"
    # a picker that needs a vLLM config it does not have is skipped, not fatal
    monkeypatch.setitem(sys.modules, sweep_attention.FA_VERSION_PICKERS[0], types.SimpleNamespace(
        get_flash_attn_version=lambda: (_ for _ in ()).throw(RuntimeError("no current vLLM config"))))
    assert sweep_attention.flash_attn_varlen()[1] == "vllm_flash_attn_fa3"
    del fork.is_fa_version_supported   # a build that cannot tell, and no picker: called as it is, plain name
    for path in sweep_attention.FA_VERSION_PICKERS:
        monkeypatch.setitem(sys.modules, path, None)
    fn, name = sweep_attention.flash_attn_varlen()
    assert name == "vllm_flash_attn" and fn is varlen


def test_a_flash_attention_that_fails_its_test_call_gives_way_to_sdpa():
    """An importable FlashAttention whose signature or build does not fit is found out by one small call before
    the sweep, not by every attention point failing (or a TypeError ending the sweep after the GEMMs)."""
    torch = pytest.importorskip("torch")
    said = []

    def old_signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):   # no window_size
        return q

    def no_kernel_image(**kw):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    for fn in (old_signature, no_kernel_image):
        assert sweep_attention.working_flash(torch, (fn, "vllm_flash_attn"), "cpu", said.append) is None
    assert len(said) == 2 and "TypeError" in said[0] and "SDPA" in said[1]
    fine = (lambda **kw: kw["q"], "vllm_flash_attn")
    assert sweep_attention.working_flash(torch, fine, "cpu", said.append) is fine and len(said) == 2
    assert sweep_attention.working_flash(torch, None, "cpu", said.append) is None and len(said) == 2


def test_timed_calls_are_queued_behind_a_gpu_sleep(monkeypatch):
    """A stand-in torch.cuda: the order of what reaches the stream, and the mean over the timed calls."""
    log = []
    names = iter(("start", "end"))

    class Event:
        def __init__(self, enable_timing):
            self.name = next(names)

        def record(self):
            log.append(f"record {self.name}")

        def elapsed_time(self, other):
            return 0.5   # ms

    cuda = types.SimpleNamespace(Event=Event, synchronize=lambda: log.append("sync"),
                                 _sleep=lambda cycles: log.append(("sleep", cycles)))
    monkeypatch.setattr(sweep_timing, "import_torch", lambda: types.SimpleNamespace(cuda=cuda))
    latency = sweep_timing.time_us(lambda: log.append("call"), "cuda:0", warmup=3, reps=10)
    assert latency == pytest.approx(50.0)   # 0.5 ms over 10 calls
    sleep = next(i for i, x in enumerate(log) if isinstance(x, tuple))
    assert log[:4] == ["call"] * 4   # warm-up, and one more call whose CPU time sets the sleep
    assert log[sleep - 1] == "sync" and log[sleep + 1] == "record start"
    assert log[sleep + 2:] == ["call"] * 10 + ["record end", "sync"]
    assert log[sleep][1] >= sweep_timing.MIN_HEAD_START_S * sweep_timing.SLEEP_CYCLES_PER_S
    cycles_per_s = sweep_timing.SLEEP_CYCLES_PER_S
    assert sweep_timing.head_start_cycles(20e-6, 10) == int(400e-6 * cycles_per_s)   # 2 × 10 calls × 20 µs
    assert sweep_timing.head_start_cycles(1.0, 10) == int(sweep_timing.MAX_HEAD_START_S * cycles_per_s)   # capped
    for fixed_s, sleeps in ((0.0, []), (sweep_timing.COMM_HEAD_START_S, [("sleep", 3_000_000)])):   # none; collectives'
        log.clear()
        names = iter(("start", "end"))
        sweep_timing.time_us(lambda: log.append("call"), "cuda:0", warmup=1, reps=2, head_start_s=fixed_s)
        assert [x for x in log if isinstance(x, tuple)] == sleeps


def test_a_point_that_fails_is_left_out_not_fatal():
    pytest.importorskip("torch")

    def broken():
        raise RuntimeError("CUDA out of memory")

    assert sweep_timing.time_point(broken, "cpu", 1) is None
    assert sweep_timing.time_point(lambda: (lambda: None), "cpu", 1) >= 0.0


def test_collectives_count_the_whole_buffer_like_the_schema():
    """all-gather's output, reduce-scatter's input and all-to-all's send buffer are the message (as nccl-tests and
    the shared tables count it); each rank holds 1/world of it where the op splits it."""
    torch = pytest.importorskip("torch")
    seen = []

    class FakeDist:
        def all_reduce(self, x):
            seen.append(("all_reduce", x.numel()))

        def all_gather_into_tensor(self, out, inp):
            seen.append(("all_gather", out.numel(), inp.numel()))

        def reduce_scatter_tensor(self, out, inp):
            seen.append(("reduce_scatter", out.numel(), inp.numel()))

        def all_to_all_single(self, out, inp):
            seen.append(("all_to_all", out.numel(), inp.numel()))

    for op in sweep_shapes.COMM_OPS:
        sweep.collective_fn(torch, FakeDist(), op, 4096, 4, "cpu")()
    assert seen == [("all_reduce", 2048), ("all_gather", 2048, 512), ("reduce_scatter", 512, 2048),
                    ("all_to_all", 2048, 2048)]
    with pytest.raises(ValueError, match="broadcast"):
        sweep.collective_fn(torch, FakeDist(), "broadcast", 4096, 4, "cpu")
    grid = sweep_shapes.build_grid(num_gpus=4)
    assert {(op, g) for op, _, _, g, _ in grid.comm} == {(op, g) for op in sweep_shapes.COMM_OPS for g in (2, 4)}


def test_the_estimate_prices_every_point_like_predict_does(tmp_path):
    """estimate_seconds = Σ predicted latency of the grid's points × calls per point, the points going through the
    same schema columns a measurement file of them would have."""
    from kernelsight.calibrate.cli import resolve_calibration
    from kernelsight.calibrate.evaluate import predict_table_s
    from kernelsight.profiles import load_hardware

    hw = load_hardware("h100-sxm")
    calib = resolve_calibration(hw)
    grid = sweep_shapes.build_grid(num_gpus=2, points={"gemm": 30, "attn_prefill": 20, "attn_decode": 20})
    est = sweep.estimate_seconds(grid, hw, calib, calls_per_point=13, head_start_s=0.0)
    assert set(est) == {"gemm", "attn_prefill", "attn_decode", "comm"}
    for fam in est:
        p = sweep.write_csv(tmp_path / f"{fam}.csv", fam, [(*row, 1.0) for row in getattr(grid, fam)])
        # fixed for collectives
        comm_sleep_s = sweep_timing.COMM_HEAD_START_S * len(grid.comm) if fam == "comm" else 0.0
        expected = 13 * float(np.nansum(predict_table_s(read_table(p), hw, calib))) + comm_sleep_s
        assert est[fam] == pytest.approx(expected, rel=1e-9) and est[fam] > 0
        # by default: the calls every point makes, plus its head start
        sleep_s = comm_sleep_s or sweep_timing.head_start_cycles(sweep.ASSUMED_ISSUE_S, sweep_timing.TIMED_CALLS) / \
            hw.boost_clock_hz * len(getattr(grid, fam))
        assert sweep.estimate_seconds(grid, hw, calib)[fam] == pytest.approx(
            (est[fam] - comm_sleep_s) / 13 * sweep_timing.CALLS_PER_POINT + sleep_s, rel=1e-9)


def test_fp8_is_dropped_when_a_test_fp8_gemm_fails_on_the_gpu():
    """A stand-in CUDA torch (real CPU tensors): an sm_90 GPU times fp8 when a small _scaled_mm runs, and bf16 alone
    (with a line saying why) when it raises."""
    real = pytest.importorskip("torch")
    said: list[str] = []

    def fake_torch(scaled_mm):
        ns = types.SimpleNamespace(
            randn=lambda *shape, device=None, dtype=None: real.randn(*shape, dtype=dtype),
            ones=lambda *shape, device=None: real.ones(*shape), bfloat16=real.bfloat16,
            float8_e4m3fn=real.float8_e4m3fn, _scaled_mm=scaled_mm, version=types.SimpleNamespace(hip=None),
            cuda=types.SimpleNamespace(get_device_capability=lambda device: (9, 0), synchronize=lambda: None))
        return ns

    def unsupported(*args, **kwargs):
        raise RuntimeError("_scaled_mm is not supported on this device")

    assert sweep.gemm_formats(fake_torch(lambda a, b, **kw: a), "cuda:0", said.append) == ("bf16", "fp8")
    assert said == []
    assert sweep.gemm_formats(fake_torch(unsupported), "cuda:0", said.append) == ("bf16",)
    assert len(said) == 1 and "RuntimeError" in said[0] and "bf16 only" in said[0]


def test_fp8_is_timed_only_on_nvidia_gpus_with_fp8_tensor_cores():
    assert sweep_shapes.formats_for("nvidia", (9, 0)) == ("bf16", "fp8")
    assert sweep_shapes.formats_for("nvidia", (8, 9)) == ("bf16", "fp8")
    assert sweep_shapes.formats_for("nvidia", (8, 0)) == ("bf16",)       # A100: _scaled_mm would raise
    assert sweep_shapes.formats_for("amd", (9, 4)) == ("bf16",)          # MI300: e4m3fnuz, not float8_e4m3fn


def test_a_paged_block_table_deals_every_block_of_the_pool_once_in_a_shuffled_order():
    """The paged cache vLLM's FlashAttention is timed on: ceil(kv_len / block) blocks per sequence, the pool exactly
    their blocks, dealt in a shuffled order (as a served cache's are), the same for the same seed."""
    table = sweep_attention.paged_block_table(6, 100, 16, np.random.default_rng(0))
    assert table.shape == (6, 7) and table.dtype == np.int32              # 100 tokens: 6 full blocks + 4 tokens
    assert sorted(table.ravel().tolist()) == list(range(42))             # every block of the pool, once
    assert table.ravel().tolist() != list(range(42))                     # not laid out in order
    assert np.array_equal(table, sweep_attention.paged_block_table(6, 100, 16, np.random.default_rng(0)))
    assert sweep_attention.paged_block_table(1, 16, 16, np.random.default_rng(0)).shape == (1, 1)
    assert sweep_attention.paged_block_table(2, 17, 16, np.random.default_rng(0)).shape == (2, 2)
    with pytest.raises(ValueError, match="block_size >= 1"):
        sweep_attention.paged_block_table(2, 17, 0, np.random.default_rng(0))


def test_only_vllms_flash_attention_is_paged():
    """vLLM's build pages by the block size one serves with; the flash_attn package (its pages: multiples of 256
    tokens) and SDPA read a contiguous cache."""
    fa = lambda **kw: kw   # noqa: E731
    assert sweep_attention.kv_block_size((fa, "vllm_flash_attn_fa2")) == sweep_shapes.KV_BLOCK_SIZE == 16
    assert sweep_attention.kv_block_size((fa, "vllm_flash_attn_fa3"), 32) == 32
    assert sweep_attention.kv_block_size((fa, "vllm_flash_attn")) == 16
    assert sweep_attention.kv_block_size((fa, "flash_attn")) == 0 and sweep_attention.kv_block_size(None) == 0


def test_vllms_flash_attention_reads_a_paged_cache_as_vllm_calls_it():
    """The call made to vLLM's build: keys and values as (blocks, block size, KV heads, head dim), a block table and
    each sequence's length (``seqused_k``), no ``cu_seqlens_k``; decode and prefill alike."""
    torch = pytest.importorskip("torch")
    calls = []

    def varlen(**kw):
        calls.append(kw)
        return kw["q"]

    flash = (varlen, "vllm_flash_attn_fa2")
    rows, kernel = sweep._attention_rows(torch, [(4, 127, 8, 2, 64, "bf16", 0)], True, "cpu", 1, flash, 16)
    dec = calls[-1]
    assert kernel == "vllm_flash_attn_fa2" and len(rows) == 1
    assert "cu_seqlens_k" not in dec and dec["max_seqlen_q"] == 1 and dec["max_seqlen_k"] == 128
    assert dec["k"].shape == dec["v"].shape == (4 * 8, 16, 2, 64)
    assert dec["block_table"].shape == (4, 8) and sorted(dec["block_table"].ravel().tolist()) == list(range(32))
    assert dec["seqused_k"].tolist() == [128] * 4
    sweep._attention_rows(torch, [(2, 40, 4, 4, 64, "bf16", 0)], False, "cpu", 1, flash, 32)
    pre = calls[-1]
    assert pre["k"].shape == (2 * 2, 32, 4, 64) and pre["seqused_k"].tolist() == [40, 40]
    assert pre["cu_seqlens_q"].tolist() == [0, 40, 80]
