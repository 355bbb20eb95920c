"""Image processors: token counts from the published processor rules (HF's Qwen2VLImageProcessor.smart_resize,
Llama4ImageProcessorFast's best-fit canvas and Llama4Processor's prompt split), worked by hand below; profiles; the
placeholder expansion; the engine's check of the items."""

from __future__ import annotations

import io

import pytest

from kernelsight.multimodal import expand_prompt, image_info, processor_for_model
from kernelsight.multimodal.images import UnreadableImageError
from kernelsight.multimodal.llama4 import best_fit_canvas, supported_canvases
from kernelsight.multimodal.processor import QWEN_IMAGE_PAD_ID, PlaceholderError
from kernelsight.multimodal.qwen_vl import ImageSizeError, smart_resize
from kernelsight.profiles import load_model, load_preprocessor_config
from kernelsight.simcore.multimodal import MultimodalItem

QWEN25 = "Qwen/Qwen2.5-VL-7B-Instruct"
QWEN3 = "Qwen/Qwen3-VL-30B-A3B-Instruct"
LLAMA4 = "meta-llama/Llama-4-Scout-17B-16E-Instruct"


def _proc(model: str, kwargs: dict | None = None):
    return processor_for_model(load_model(model), load_preprocessor_config(model), kwargs)


def test_vlm_profiles_parse_with_their_vision_tower():
    q = load_model(QWEN25)
    assert (q.hidden_size, q.num_layers, q.num_kv_heads, q.vocab_size) == (3584, 28, 4, 152064)
    assert q.vision is not None and q.vision.kind == "qwen2_5_vl" and q.vision.gated_mlp
    assert q.vision.full_attention_layers == (7, 15, 23, 31) and q.vision.window_size_px == 112
    q3 = load_model(QWEN3)         # nested text_config: a Qwen3-MoE language model
    assert (q3.hidden_size, q3.num_layers, q3.num_experts, q3.experts_per_token) == (2048, 48, 128, 8)
    assert q3.vision.kind == "qwen3_vl" and q3.vision.patch_size == 16 and q3.vision.num_deepstack_mergers == 3
    assert q3.architecture == "Qwen3VLMoeForConditionalGeneration"
    l4 = load_model(LLAMA4)
    assert l4.vision.kind == "llama4" and l4.vision.depth == 34 and l4.vision.merge_size == 2
    assert load_model("Qwen/Qwen3-8B").vision is None
    assert processor_for_model(load_model("Qwen/Qwen3-8B"), None) is None


@pytest.mark.parametrize("w,h,tokens", [
    (448, 448, 256),      # 448 = 16 * 28: grid 32 x 32 = 1024 patches, 2x2-merged
    (896, 896, 1024),     # grid 64 x 64
    (1024, 768, 999),     # round(768/28)=27 -> 756, round(1024/28)=37 -> 1036: grid 27*2 x 37*2 = 54 x 74
    (20, 20, 4),          # 28x28 < min_pixels 3136: beta = sqrt(3136/400) = 2.8, ceil(56/28)*28 = 56: grid 4 x 4
])
def test_qwen25_vl_token_counts(w, h, tokens):
    lay = _proc(QWEN25).layout(w, h)
    assert lay.num_tokens == tokens
    assert lay.encoder_seq_lens == (tokens * 4,)
    assert set(lay.replacement) == {QWEN_IMAGE_PAD_ID}


def test_qwen_max_pixels_scales_down_and_kwargs_override():
    # 4000 x 3000 = 12e6 px rounds to 2996 x 4004 = 11995984 <= max 12845056: kept
    assert smart_resize(3000, 4000, 28, 3136, 12845056) == (2996, 4004)
    # max_pixels 802816 (1024*28*28): beta = sqrt(12e6 / 802816) = 3.866; floor(3000/3.866/28)*28 = 756, 1008
    assert smart_resize(3000, 4000, 28, 3136, 802816) == (756, 1008)
    lay = _proc(QWEN25, {"max_pixels": 802816}).layout(4000, 3000)
    assert lay.grid_thw == (1, 54, 72) and lay.num_tokens == 54 * 72 // 4
    with pytest.raises(ImageSizeError):
        smart_resize(10, 2100, 28, 3136, 12845056)       # aspect ratio 210 > 200
    with pytest.raises(ValueError, match="unsupported mm_processor_kwargs"):
        _proc(QWEN25, {"num_crops": 4})


def test_qwen3_vl_uses_32px_merged_patches():
    p = _proc(QWEN3)
    assert p.layout(448, 448).num_tokens == 196        # 448/32 = 14 -> grid 28 x 28 -> 196
    # 100x100 = 1e4 px < shortest_edge 65536: beta = 2.56, ceil(256/32)*32 = 256 -> grid 16 x 16 -> 64
    assert p.layout(100, 100).num_tokens == 64


def test_llama4_best_fit_and_tiles():
    canvases = supported_canvases(16, 336)
    assert (336, 336) in canvases and (1344, 1344) in canvases and (336, 5376) in canvases
    # 448x448: smallest upscale is 1.5 (2x2, 2x3, 3x2, ...): the smallest of those canvases, 2x2
    assert best_fit_canvas(448, 448, canvases) == (672, 672)
    # 1500 h x 2000 w: no canvas fits, largest downscale 0.672 (3x4, 3x5, 4x4): smallest area, 3x4
    assert best_fit_canvas(1500, 2000, canvases) == (1008, 1344)
    p = _proc(LLAMA4)
    one = p.layout(336, 336)       # one tile, no global thumbnail: start + <|image|> + 144 patches + end
    assert one.num_tokens == 147 and one.encoder_seq_lens == (576,) and one.num_embeds == 144
    four = p.layout(448, 448)      # 2x2 tiles: 2 rows of (144 + sep + 144) + row ends, then the global tile
    assert four.num_tokens == 1 + 2 * (2 * 144 + 1) + 2 + 1 + 144 + 1
    assert four.encoder_seq_lens == (576,) * 5 and four.num_embeds == 5 * 144


def test_expand_prompt_places_items_in_order():
    p = _proc(QWEN25)
    a, b = p.layout(448, 448), p.layout(56, 56)        # 256 and 4 tokens
    ids = [1, 151652, QWEN_IMAGE_PAD_ID, 151653, 2, 151652, QWEN_IMAGE_PAD_ID, 151653, 3]
    out, items = expand_prompt(ids, QWEN_IMAGE_PAD_ID, [a, b], ["h1", "h2"])
    assert len(out) == len(ids) - 2 + 256 + 4
    assert [(i.offset, i.num_tokens, i.mm_hash) for i in items] == [(2, 256, "h1"), (2 + 256 + 3, 4, "h2")]
    assert out[items[1].offset - 1] == 151652 and out[items[1].end] == 151653
    with pytest.raises(PlaceholderError):
        expand_prompt(ids, QWEN_IMAGE_PAD_ID, [a], ["h1"])


def test_image_info_reads_the_header_only():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (640, 360), (10, 20, 30)).save(buf, format="PNG")
    info = image_info(buf.getvalue())
    assert (info.width_px, info.height_px, info.format) == (640, 360, "PNG")
    with pytest.raises(UnreadableImageError):
        image_info(b"not an image at all")


def test_engine_takes_mm_items_and_refuses_bad_ranges():
    from kernelsight.engine_args import create_engine_config
    from kernelsight.simcore.engine_config import EngineArgs, build_engine

    cfg = create_engine_config(EngineArgs(model=QWEN25, hardware="h100"))
    eng = build_engine(cfg)
    item = MultimodalItem("image", offset=2, num_tokens=256, encoder_seq_lens=(1024,), mm_hash="x",
                          grid_thw=(1, 32, 32))
    eng.add_request("a", list(range(300)), 4, mm_items=[item])
    with pytest.raises(ValueError, match="past the prompt"):
        eng.add_request("b", list(range(100)), 4, mm_items=[item])


def test_multimodal_flag_values_as_vllm_takes_them():
    from kernelsight.multimodal.options import parse_limit_mm_per_prompt, parse_mm_processor_kwargs

    assert parse_limit_mm_per_prompt('{"image": 4, "video": {"count": 1, "num_frames": 8}}') == {"image": 4,
                                                                                                "video": 1}
    for bad in ("image=4", "[4]", '{"image": -1}', '{"image": true}'):
        with pytest.raises(ValueError):
            parse_limit_mm_per_prompt(bad)
    assert parse_mm_processor_kwargs('{"max_pixels": 802816}') == {"max_pixels": 802816}
    with pytest.raises(ValueError):
        parse_mm_processor_kwargs("[1]")


def test_qwen_size_kwargs_and_min_over_max_are_handled():
    p = _proc(QWEN25, {"size": {"shortest_edge": 3136, "longest_edge": 200704}})
    assert p.layout(896, 896).num_tokens == 256            # capped at 200704 px = 16x16 merged patches
    with pytest.raises(ValueError, match="must not exceed"):
        _proc(QWEN25, {"min_pixels": 10**7, "max_pixels": 10**6})


def test_processor_cache_hits_and_evicts_by_bytes():
    from kernelsight.multimodal.cache import ProcessorCache

    c = ProcessorCache(capacity_bytes=100)
    assert not c.query("a", 60) and c.query("a", 60)
    assert not c.query("b", 60)          # evicts a (least recent) to fit
    assert not c.query("a", 60) and not c.query("huge", 101) and not c.query("huge", 101)
