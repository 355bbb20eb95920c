"""Decode attention as a serving step streams it: each layer's KV cache comes from DRAM (the tables time one
layer's cache again and again, L2-warm below the L2 size), and on FlashAttention-2's unsplit GQA path the longest
contexts of a batch are streamed by lone CTAs at one CTA's bandwidth."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kernelsight.simcore.engine import Engine
from kernelsight.simcore.engine_config import build_step_model
from kernelsight.simcore.kernels import BatchShape, attention_decode_kernel
from kernelsight.simcore.roofline import kernel_roofline_s
from kernelsight.simcore.step_model import StepModel, fa2_num_splits
from tests.conftest import make_config

PER_TOKEN = 2 * 128 * 2          # K and V of one KV head, head_dim 128, bf16
LAYERS = 32


@pytest.fixture(scope="module")
def pro6000():
    cfg = make_config(hardware="rtx-pro-6000", max_model_len=32768)
    return cfg, build_step_model(cfg)


def fluid_s(contexts: list[int], ctas_per_seq: int, bw: float, cta_bw: float, split: int | None = None) -> float:
    """Brute force of the model: every CTA advances at min(c, B / CTAs left) until it has read its share of a
    context (the whole context, or each ``split`` tokens of it)."""
    shares = [c for c in contexts] if split is None else [
        min(split, c - i) for c in contexts for i in range(0, c, split)]
    left = sorted(c * PER_TOKEN for c in shares for _ in range(ctas_per_seq))
    t = done = 0.0
    i = 0
    while i < len(left):
        rate = min(cta_bw, bw / (len(left) - i))
        t += (left[i] - done) / rate
        done = left[i]
        while i < len(left) and left[i] <= done:
            i += 1
    return t


def test_cold_bandwidth_is_the_kernels_own_beyond_the_l2_and_below_dram(pro6000):
    cfg, sm = pro6000
    bw = sm._decode_cold_bw
    assert 0.6 * cfg.hardware.usable_mem_bytes_per_s < bw <= cfg.hardware.usable_mem_bytes_per_s
    # read off the model at 128 sequences x 2,048 tokens (1.07 GB per layer, 8x the L2): a shape the tables measure,
    # where 256 x 2,048 would be an extrapolation beyond their batches of 256 (which stop at 1,024 tokens)
    assert bw == pytest.approx(128 * 2048 * 8 * PER_TOKEN / sm._decode_eta_s(128, 128 * 2048), rel=1e-12)
    assert bw < 256 * 2048 * 8 * PER_TOKEN / sm._decode_eta_s(256, 256 * 2048)
    # far beyond the L2 the calibrated kernel is already at that bandwidth: the floor does not bind
    b, ctx = 128, 128 * 8192
    assert sm._decode_attention_s(b, ctx) == pytest.approx(sm._decode_eta_s(b, ctx) * LAYERS, rel=1e-12)
    assert sm._decode_eta_s(b, ctx) == pytest.approx(ctx * 8 * PER_TOKEN / bw, rel=0.1)


def test_an_l2_sized_kv_cache_is_read_from_dram_in_a_serving_step(pro6000):
    cfg, sm = pro6000
    # 32 sequences x 1024 tokens: 134 MB of KV per layer, the L2's size; the table times it L2-warm (~2.2 TB/s)
    b, ctx = 32, 32 * 1024
    kv_bytes = ctx * 8 * PER_TOKEN
    table_like = sm._decode_eta_s(b, ctx)
    assert kv_bytes / table_like > cfg.hardware.usable_mem_bytes_per_s       # faster than DRAM: L2-warm
    t = sm._decode_attention_s(b, ctx)
    assert t == pytest.approx(kv_bytes / sm._decode_cold_bw * LAYERS, rel=1e-12)
    assert t > table_like * LAYERS
    k = attention_decode_kernel(b, ctx, 32, 8, 128, 2.0, 2.0, LAYERS)
    assert t >= kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, cfg.hardware)


def test_the_longest_contexts_stream_alone_as_the_brute_force_fluid_says(pro6000):
    _, sm = pro6000
    bw, cta_bw = sm._decode_cold_bw, sm._decode_cta_bw
    assert cta_bw > 0 and sm.decode_top_k == int(np.ceil(bw / cta_bw / 8)) + 1
    rng = random.Random(3)
    for b in (40, 64, 128):                     # 8 KV heads x b ≥ 0.8 x 2 x 188 SMs: the unsplit path
        contexts = [rng.randint(100, 1500) for _ in range(b - 3)] + [9000, 5000, 4990]
        top = tuple(sorted(contexts, reverse=True)[:sm.decode_top_k])
        got = sm._decode_stream_s(b, sum(contexts), top, False)
        assert got == pytest.approx(fluid_s(contexts, 8, bw, cta_bw), rel=1e-9)
        assert got > sum(contexts) * 8 * PER_TOKEN / bw * 1.05      # the long ones cost more than their bytes
    # equal contexts (the tables' case): nothing beyond the bytes
    eq = [1200] * 64
    assert sm._decode_stream_s(64, sum(eq), tuple(eq[:sm.decode_top_k]), False) == pytest.approx(
        sum(eq) * 8 * PER_TOKEN / bw, rel=1e-12)
    # a mixed step's decodes never split, whatever the batch
    contexts = [800] * 20 + [6000]
    top = tuple(sorted(contexts, reverse=True)[:sm.decode_top_k])
    assert sm._decode_stream_s(21, sum(contexts), top, True) == pytest.approx(
        fluid_s(contexts, 8, bw, cta_bw), rel=1e-9)


def test_fa2_split_heuristic_matches_flash_api():
    # enough CTAs to fill 80% of the slots: no split
    assert fa2_num_splits(320, 376, 1024) == 1
    # batch 1, 8 KV heads, 1024 blocks on 188 SMs: 40 splits is the first to reach 85% of the best wave efficiency
    assert fa2_num_splits(8, 376, 1024) == 40
    # 64 blocks: 12 splits would be 11 (6 blocks each), so ineligible counts are skipped
    assert fa2_num_splits(128, 376, 64) == 5
    assert fa2_num_splits(8, 376, 1) == 1          # one block: nothing to split


def test_an_eager_small_decode_batch_splits_and_has_no_tail():
    sm = build_step_model(make_config(hardware="rtx-pro-6000", max_model_len=32768, enforce_eager=True))
    contexts = [500] * 15 + [8000]          # 16 x 8 = 128 CTAs < 300: FlashAttention-2 splits the KV cache
    top = tuple(sorted(contexts, reverse=True))
    total = sum(contexts)
    assert sm._decode_stream_s(16, total, top, False) == pytest.approx(total * 8 * PER_TOKEN / sm._decode_cold_bw)
    assert sm._decode_stream_s(16, total, top, True) > sm._decode_stream_s(16, total, top, False)


def test_a_graph_replay_keeps_the_split_size_it_was_captured_with(pro6000):
    cfg, sm = pro6000
    bw, cta_bw = sm._decode_cold_bw, sm._decode_cta_bw
    # vLLM captures at max_model_len (32,768 = 256 blocks of 128): batch 16 (128 CTAs) takes 5 splits of 52 blocks
    assert fa2_num_splits(16 * 8, 2 * cfg.hardware.num_sms, 256) == 5
    assert sm._graph_split_tokens(16) == 52 * 128 == 6656
    assert sm._graph_split_tokens(12) == sm._graph_split_tokens(16)        # padded to the captured 16
    contexts = [500] * 15 + [8000]          # the long one: a 6,656-token split and a 1,344-token one
    top = tuple(sorted(contexts, reverse=True))
    got = sm._decode_stream_s(16, sum(contexts), top, False)
    assert got == pytest.approx(fluid_s(contexts, 8, bw, cta_bw, split=6656), rel=1e-9)
    assert got > sum(contexts) * 8 * PER_TOKEN / bw * 1.5
    # batch 1: 37 splits of 7 blocks (43 would be more efficient, but 37 is the first within 85% of it), so 1,500
    # tokens are two shares per KV head, 896 and 604 tokens, each streamed by one CTA
    assert sm._graph_split_tokens(1) == 7 * 128
    one = sm._decode_stream_s(1, 1500, (1500,), False)
    assert one == pytest.approx(fluid_s([1500], 8, bw, cta_bw, split=896), rel=1e-9)
    assert one == pytest.approx(896 * PER_TOKEN / cta_bw, rel=1e-9)     # 16 CTAs never fill the bandwidth
    assert one > 3 * 1500 * 8 * PER_TOKEN / bw
    # a shorter max_model_len captures smaller splits: 4,096 tokens (32 blocks) at batch 1 take 32 splits of one block
    short = build_step_model(make_config(hardware="rtx-pro-6000", max_model_len=4096))
    assert short._graph_split_tokens(1) == 128
    assert short._decode_stream_s(1, 1500, (1500,), False) < one / 3
    # beyond the largest captured batch the step runs eagerly: the eager rule again
    eager = sm._graph_split_tokens(sm._capture[-1] + 1)
    assert eager is None


def test_step_prices_the_tail_only_from_the_batchs_own_contexts(pro6000):
    _, sm = pro6000
    contexts = [300] * 60 + [12000, 11000, 10000, 9000]
    total = sum(contexts)
    top = tuple(sorted(contexts, reverse=True)[:sm.decode_top_k])
    _, flat = sm.step(BatchShape((), 64, total))
    _, skewed = sm.step(BatchShape((), 64, total, decode_context_top=top))
    assert skewed > flat
    # a decode window carries the contexts along: each step every context grows by one
    durations, _ = sm.decode_window(64, total, 5, top)
    last = sm.step(BatchShape((), 64, total + 4 * 64, decode_context_top=tuple(c + 4 for c in top)))[1]
    assert durations[0] == pytest.approx(skewed) and durations[-1] == pytest.approx(last)


def test_gpus_without_a_measured_cta_bandwidth_keep_no_tail():
    sm = build_step_model(make_config(hardware="h100"))
    assert sm._decode_cta_bw == 0.0 and sm.decode_top_k == 0 and sm._decode_cold_bw > 0


class _Recorder:
    """A step model that records each step's longest decode contexts by step index (fixed step times)."""

    def __init__(self, inner: StepModel, top_k: int) -> None:
        self.inner, self.decode_top_k = inner, top_k
        self.engine: Engine | None = None
        self.tops: dict[int, tuple[int, ...]] = {}
        self.truth: dict[int, tuple[int, ...]] = {}

    def _record(self, top: tuple[int, ...], steps: int) -> None:
        assert self.engine is not None
        first = self.engine.scheduler.step_index
        for i in range(steps):
            self.tops[first + i] = tuple(c + i for c in top)

    def step(self, batch: BatchShape):
        assert self.engine is not None
        sched = self.engine.scheduler
        if not sched.members:           # the exact loop: every decode's context is materialized
            ctx = [r.num_computed_tokens + 1 for r in sched.running
                   if r.num_output_tokens > 0 and r.num_tokens - r.num_computed_tokens == 1]
            self.truth[sched.step_index] = tuple(sorted(ctx, reverse=True)[:self.decode_top_k])
        self._record(batch.decode_context_top, 1)
        return self.inner.step(batch)

    def decode_window(self, b: int, ctx0: int, k: int, top: tuple[int, ...] = ()):
        self._record(top, k)
        return self.inner.decode_window(b, ctx0, k, top)


def _run(use_decode_group: bool) -> _Recorder:
    cfg = make_config(hardware="rtx-pro-6000", max_num_seqs=16)
    rec = _Recorder(build_step_model(cfg), top_k=5)
    eng = Engine(cfg.scheduler, cfg.num_gpu_blocks, rec, use_decode_group=use_decode_group)  # type: ignore[arg-type]
    rec.engine = eng
    rng = random.Random(7)
    for i in range(40):
        eng.add_request(f"r{i}", [rng.randint(10, 30000) for _ in range(rng.randint(20, 900))],
                        rng.randint(5, 120), ignore_eos=True, arrival_s=0.05 * i)
    while eng.has_unfinished():
        eng.step(max_steps=64)
    return rec


def test_scheduler_gives_the_longest_decode_contexts_group_or_not():
    exact, grouped = _run(False), _run(True)
    assert exact.tops == grouped.tops
    checked = [i for i in exact.truth if exact.tops[i]]
    assert len(checked) > 100
    assert all(exact.tops[i] == exact.truth[i] for i in checked)
