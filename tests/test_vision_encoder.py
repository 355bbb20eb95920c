"""The vision encoder in the engine: its kernels, its pricing, and its scheduling as vLLM V1 does it (the encoder
runs in the step that first schedules an item's tokens, under the encoder budget, with the encoder cache), and
images in the prefix cache's block hashes."""

from __future__ import annotations

import dataclasses

import pytest

from kernelsight.simcore import kernels as K
from kernelsight.simcore.engine import FIRST_TOKEN
from kernelsight.simcore.engine_config import build_engine
from kernelsight.simcore.kv_events import BlockStored
from kernelsight.simcore.multimodal import MultimodalItem, VisionSpec
from kernelsight.simcore.roofline import kernel_roofline_s
from kernelsight.simcore.vision_encoder import encoder_kernels, window_seq_lens
from tests.conftest import make_config

# Qwen2.5-VL-7B-Instruct's vision tower (its config.json's vision_config)
QWEN25_VL = VisionSpec(kind="qwen2_5_vl", depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420,
                       gated_mlp=True, patch_size=14, temporal_patch_size=2, merge_size=2, out_hidden_size=3584,
                       window_size_px=112, full_attention_layers=(7, 15, 23, 31))
IMAGE_PAD = 151655


def image(side_px: int, offset: int, tag: str = "a") -> MultimodalItem:
    """A square image as Qwen2.5-VL's processor expands it: (side/14)² patches, a quarter of them as tokens."""
    g = side_px // 14
    return MultimodalItem("image", offset, g * g // 4, (g * g,), f"{tag}{side_px}", (1, g, g))


def vlm_config(**kw):
    cfg = make_config(**kw)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vision=QWEN25_VL))


def prompt_with(items: list[MultimodalItem], length: int, fill: int = 1000) -> list[int]:
    ids = [fill + (i % 500) for i in range(length)]
    for it in items:
        ids[it.offset:it.end] = [IMAGE_PAD] * it.num_tokens
    return ids


def test_windows_cover_the_grid_and_full_layers_attend_everything():
    assert sum(window_seq_lens((1, 32, 32), 8)) == 1024 and set(window_seq_lens((1, 32, 32), 8)) == {64}
    assert sorted(set(window_seq_lens((2, 20, 12), 8))) == [16, 32, 64] and sum(window_seq_lens((2, 20, 12), 8)) == 480
    ks = {k.name + str(k.count): k for k in encoder_kernels(QWEN25_VL, (image(896, 0),))}
    full, windowed = ks["attention_encoder4"], ks["attention_encoder28"]
    # 4 full layers over 4096 patches, 28 windowed over 64 windows of 64: per layer 4096² against 64·64² pairs
    assert full.flops == pytest.approx(4 * 16 * 80 * 4096 ** 2)
    assert windowed.flops == pytest.approx(4 * 16 * 80 * 64 * 64 ** 2)


def test_encoder_work_grows_with_the_image_and_tp_splits_it():
    small, big = (image(448, 0),), (image(896, 0),)
    flops = lambda items, tp=1: sum(k.flops * k.count for k in encoder_kernels(QWEN25_VL, items, tp))  # noqa: E731
    # 4x the patches: GEMMs 4x, full attention 16x, windows 4x: between 4x and 5x overall
    assert 4.0 < flops(big) / flops(small) < 5.0
    assert flops(big, tp=2) == pytest.approx(flops(big) / 2, rel=0.02)


def test_every_encoder_kernel_takes_at_least_its_roofline():
    cfg = vlm_config()
    sm = build_engine(cfg).step_model
    for items in [(image(224, 0),), (image(896, 0),), (image(448, 0), image(1344, 300))]:
        total = 0.0
        for k in sm.encoder_kernels(items):
            roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, cfg.hardware) * k.count
            assert sm.kernel_time_s(k) >= roof * (1 - 1e-9), k.name
            total += roof
        assert sm.encoder_pass_s(items) >= total == pytest.approx(sm.encoder_roofline_s(items))


def _first_token_s(engine, rid: str) -> float:
    while True:
        res = engine.step()
        assert res is not None
        for ev in res.events:
            if ev.kind == FIRST_TOKEN and ev.request_id == rid:
                return res.step_end_s[ev.step_index - res.first_step_index]


def test_the_encoder_runs_once_in_the_step_that_first_schedules_the_image():
    eng = build_engine(vlm_config(max_num_batched_tokens=512, enable_prefix_caching=False))
    it = image(896, 600)                        # 1,024 tokens from 600: three 512-token chunks reach it
    eng.add_request("r", prompt_with([it], 2000), 4, mm_items=(it,))
    ran = []
    while (res := eng.step()) is not None and len(ran) < 6:
        ran.append(res.breakdown_s[K.FAMILY_INDEX[K.ENCODER]])
    # chunk 1 (0..512) does not reach the image; chunk 2 (512..1024) starts it: the encoder runs there, once
    assert ran[0] == 0.0 and ran[1] > 0.0 and ran[2:].count(0.0) == len(ran) - 2


def test_ttft_grows_with_image_size_by_the_encoder_pass():
    ttft = {}
    for side in (448, 896, 1344):
        eng = build_engine(vlm_config())
        it = image(side, 10)
        eng.add_request("r", prompt_with([it], it.end + 20), 4, mm_items=(it,))
        ttft[side] = _first_token_s(eng, "r")
    assert ttft[448] < ttft[896] < ttft[1344]
    # the same number of text tokens without an image: the difference is at least the encoder pass
    eng = build_engine(vlm_config())
    it = image(1344, 10)
    eng.add_request("t", prompt_with([], it.end + 20), 4)
    text_only = _first_token_s(eng, "t")
    assert ttft[1344] - text_only >= build_engine(vlm_config()).step_model.encoder_pass_s((it,)) * 0.99


def test_an_item_over_the_encoder_budget_waits_for_the_next_step():
    # two 1,024-token images, budget 1,536: the first request's image runs, the second request's chunk is cut
    # before its image (it prefills its text), and its encoder runs a step later
    eng = build_engine(vlm_config(max_num_batched_tokens=1536, enable_prefix_caching=False))
    a, b = image(896, 4, "a"), image(896, 100, "b")
    eng.add_request("a", prompt_with([a], a.end + 4), 2, mm_items=(a,))
    eng.add_request("b", prompt_with([b], b.end + 4), 2, mm_items=(b,))
    sched = eng.scheduler
    out = sched.schedule()
    assert out.batch.encoder_items == (a,)
    assert dict(zip([r.request_id for r in out.requests], out.num_scheduled_tokens, strict=True)) == {
        "a": a.end + 4, "b": 100 - 0}


def test_the_same_image_hits_the_encoder_cache_and_the_prefix_cache():
    eng = build_engine(vlm_config())
    it = image(896, 8, "same")
    prompt = prompt_with([it], it.end + 40)
    eng.add_request("first", prompt, 2, mm_items=(it,))
    _first_token_s(eng, "first")
    computed = eng.scheduler.encoder_cache.num_computed
    eng.add_request("second", prompt, 2, mm_items=(it,))
    second = eng._requests["second"]
    _first_token_s(eng, "second")
    assert eng.scheduler.encoder_cache.num_computed == computed == 1
    # the prefix cache holds every full block of the first prompt: the image's placeholders included
    assert second.num_cached_tokens == (len(prompt) - 1) // 16 * 16 >= it.end


def test_a_different_image_with_the_same_placeholders_is_no_prefix_hit():
    eng = build_engine(vlm_config())
    one, two = image(896, 0, "one"), image(896, 0, "two")
    prompt = prompt_with([one], one.end + 40)      # same ids for both: only the image differs
    eng.add_request("one", prompt, 50, mm_items=(one,))
    _first_token_s(eng, "one")
    eng.add_request("two", prompt, 50, mm_items=(two,))
    _first_token_s(eng, "two")
    by_id = {r.request_id: r for r in eng.scheduler.running}
    assert by_id["two"].num_cached_tokens == 0      # block 0 already holds image placeholders
    assert eng.scheduler.encoder_cache.num_computed == 2


def test_stored_blocks_carry_the_image_hash():
    eng = build_engine(vlm_config())
    eng.kv.enable_events()
    it = image(448, 20, "img")                        # tokens 20..276: blocks 1..17 of 16 hold it
    eng.add_request("r", prompt_with([it], 400), 2, mm_items=(it,))
    _first_token_s(eng, "r")
    stored = [e for e in eng.kv.take_events() if isinstance(e, BlockStored)]
    keys = [k for e in stored for k in e.mm_keys]
    assert keys[0] == () and keys[1] == ("img448",) and keys[17] == ("img448",) and keys[18] == ()


def test_a_preempted_or_finished_request_leaves_the_encoder_cache_evictable():
    eng = build_engine(vlm_config())
    it = image(448, 0, "x")
    eng.add_request("r", prompt_with([it], it.end + 8), 3, mm_items=(it,))
    while eng.step() is not None:
        pass
    cache = eng.scheduler.encoder_cache
    assert cache.num_freeable_slots == cache.cache_size and "x448" in cache.freeable


def test_items_outside_the_prompt_are_refused():
    eng = build_engine(vlm_config())
    with pytest.raises(ValueError, match="past the prompt"):
        eng.add_request("r", [1] * 100, 2, mm_items=(image(448, 0),))


def test_the_same_image_after_different_text_is_encoded_once():
    # no prefix hit (the first block differs), but the image's encoder output is still cached (freeable)
    eng = build_engine(vlm_config())
    it = image(896, 32, "shared")
    first = prompt_with([it], it.end + 40)
    second = [7] + first[1:]
    eng.add_request("first", first, 2, mm_items=(it,))
    _first_token_s(eng, "first")
    eng.add_request("second", second, 2, mm_items=(it,))
    req = eng._requests["second"]
    _first_token_s(eng, "second")
    cache = eng.scheduler.encoder_cache
    assert req.num_cached_tokens == 0 and cache.num_computed == 1 and cache.num_hits == 1


def test_the_vision_tower_takes_gpu_memory():
    # Qwen2.5-VL-7B's tower is ~0.67B parameters: ~1.3 GB of bf16 weights fewer KV blocks than the text model
    assert 0.6e9 < QWEN25_VL.num_params < 0.7e9
    text, vlm = make_config(), vlm_config()
    from kernelsight.simcore.memory import weight_bytes_per_rank
    extra = weight_bytes_per_rank(vlm.model, vlm.precision, 1) - weight_bytes_per_rank(text.model, text.precision, 1)
    assert extra == pytest.approx(2.0 * QWEN25_VL.num_params)
