"""Videos and image embeddings for the Qwen-VL models: token counts derived by hand from the published processor code
(vLLM's OpenCV loader, HF's Qwen2VL/Qwen3VL video processors), video_url parts over HTTP (openai SDK), refusals
with vLLM's bodies, image_embeds read without unpickling, random-mm with video buckets in bench and simulate."""

from __future__ import annotations

import base64
import io
import json
import pickle
import sys
import types
import zipfile
from collections import OrderedDict

import pytest
from conftest import EngineSpy

from kernelsight.multimodal import VideoInfo, loader_frames, processor_for_model
from kernelsight.multimodal.qwen_video import VideoSizeError
from kernelsight.multimodal.torch_payload import TensorRecord, UnsafePayloadError, read_torch_payload
from kernelsight.profiles import load_model, load_preprocessor_config, load_video_preprocessor_config

Q25 = "Qwen/Qwen2.5-VL-7B-Instruct"
Q3 = "Qwen/Qwen3-VL-30B-A3B-Instruct"


def _proc(model: str, kwargs=None):
    return processor_for_model(load_model(model), load_preprocessor_config(model), kwargs,
                               load_video_preprocessor_config(model))


def _fake_encode(text: str) -> list[int]:
    return [7] * len(text)          # one id per character: the timestamp text's length shows in the count


# -- the loader's frame selection ------------------------------------------------------------------------------

def test_loader_keeps_at_most_32_frames_spread_by_linspace():
    v = loader_frames(VideoInfo(total_frames=300, fps=30.0, width_px=640, height_px=480))
    # np.linspace(0, 299, 32) truncated: 0, 9.64 -> 9, ..., 299
    assert v.num_frames == 32 and v.frame_indices[:3] == (0, 9, 19) and v.frame_indices[-1] == 299
    assert not v.do_sample_frames
    short = loader_frames(VideoInfo(total_frames=20, fps=10.0, width_px=64, height_px=64))
    assert short.frame_indices == tuple(range(20)) and short.do_sample_frames
    # media_io_kwargs fps 1 caps at floor(2.0 s x 1) = 2 frames; num_frames -1 lifts the 32 cap
    assert loader_frames(VideoInfo(20, 10.0, 64, 64), -1, 1).frame_indices == (0, 19)
    assert loader_frames(VideoInfo(300, 30.0, 64, 64), -1).num_frames == 300


# -- token counts by hand ------------------------------------------------------------------------------------

def test_qwen25_vl_video_tokens_by_hand():
    p = _proc(Q25)
    # 10 s of 640x480 at 30 fps: the loader keeps 32 frames; no resampling in Qwen2VLVideoProcessor; each frame
    # smart-resized with the image config's pixels: 480/28 = 17.1 -> 476, 640/28 = 22.9 -> 644: 34 x 46 patches;
    # 32 frames / temporal patch 2 = 16; tokens 16 x 34 x 46 / 4 = 6256
    lay = p.video_layout(loader_frames(VideoInfo(300, 30.0, 640, 480)), _fake_encode)
    assert lay.grid_thw == (16, 34, 46) and lay.num_tokens == 6256
    assert set(lay.replacement) == {151656} and lay.encoder_seq_lens == (34 * 46,) * 16
    # 5 frames of 224x224: padded to 6 with the last frame: 3 temporal patches of 16 x 16 patches: 3 x 64 tokens
    lay = p.video_layout(loader_frames(VideoInfo(5, 25.0, 224, 224)), _fake_encode)
    assert lay.grid_thw == (3, 16, 16) and lay.num_tokens == 192
    # max_pixels as mm_processor_kwargs: 640x480 in 200704 px: beta = sqrt(307200/200704) = 1.237;
    # floor(480/1.237/28) = 13 -> 364, floor(640/1.237/28) = 18 -> 504: 26 x 36 patches
    lay = _proc(Q25, {"max_pixels": 200704}).video_layout(loader_frames(VideoInfo(4, 4.0, 640, 480)), _fake_encode)
    assert lay.grid_thw == (2, 26, 36) and lay.num_tokens == 2 * 26 * 36 // 4


def test_qwen3_vl_samples_at_2_fps_and_writes_timestamps():
    p = _proc(Q3)
    # 2 s at 10 fps = 20 frames: the loader keeps all (do_sample_frames), the processor samples
    # int(20 / 10 x 2) = 4 (min_frames 4) at linspace(0, 19, 4).round() = 0, 6, 13, 19;
    # groups (0, 6) and (13, 19): (0 + 0.6) / 2 = 0.3 s and (1.3 + 1.9) / 2 = 1.6 s;
    # 4 x 480 x 640 is inside the budget: 30 x 40 patches, 300 tokens a group
    lay = p.video_layout(loader_frames(VideoInfo(20, 10.0, 640, 480)), _fake_encode)
    assert lay.grid_thw == (2, 30, 40) and lay.replaces_around
    per_group = [7] * len("<0.3 seconds>") + [151652] + [151656] * 300 + [151653]
    assert list(lay.replacement) == per_group + [7] * len("<1.6 seconds>") + [151652] + [151656] * 300 + [151653]
    # fps as mm_processor_kwargs: int(20 / 10 x 4) = 8 frames, 4 groups
    assert _proc(Q3, {"fps": 4}).video_layout(loader_frames(VideoInfo(20, 10.0, 640, 480)),
                                              _fake_encode).grid_thw[0] == 4


def test_qwen3_vl_long_video_shares_one_pixel_budget():
    # 60 s of 1920x1080 at 30 fps: the loader keeps 32 frames (not all: no resampling); 32 x 1088 x 1920 > 25165824:
    # beta = sqrt(32 x 1080 x 1920 / 25165824) = 1.6238; floor(1080/1.6238/32) = 20 -> 640, floor(1920/1.6238/32)
    # = 36 -> 1152: 40 x 72 patches, 720 tokens a group, 16 groups
    lay = _proc(Q3).video_layout(loader_frames(VideoInfo(1800, 30.0, 1920, 1080)), _fake_encode)
    assert lay.grid_thw == (16, 40, 72)
    assert lay.replacement.count(151656) == 16 * 720


def test_qwen3_vl_refuses_a_one_frame_video():
    with pytest.raises(VideoSizeError, match="t:1 must be larger than temporal_factor:2"):
        _proc(Q3).video_layout(loader_frames(VideoInfo(1, 30.0, 64, 64)), _fake_encode)


# -- torch.save payloads without unpickling ------------------------------------------------------------------

@pytest.fixture()
def fake_torch(monkeypatch):
    """Modules named as torch's so that pickle writes the globals torch.save writes (no torch needed)."""
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):  # never called by the reader
        raise AssertionError("called")

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    for name in ("FloatStorage", "BFloat16Storage", "LongStorage"):
        setattr(torch, name, type(name, (), {"__module__": "torch", "__qualname__": name}))
    torch._utils = utils
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch._utils", utils)
    return torch


def torch_save(fake, shape: tuple[int, ...], storage: str = "FloatStorage", values: list[int] | None = None) -> bytes:
    """A torch.save zip of one contiguous tensor, in the layout torch writes."""
    class T:
        def __reduce__(self):
            stride = tuple(int(__import__("math").prod(shape[i + 1:])) for i in range(len(shape)))
            return (sys.modules["torch._utils"]._rebuild_tensor_v2,
                    (S(), 0, shape, stride, False, OrderedDict()))

    class S:
        pass

    class P(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, S):
                return ("storage", getattr(fake, storage), "0", "cpu", 1)
            return None

    buf = io.BytesIO()
    P(buf, protocol=2).dump(T())
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/data/0", b"".join(v.to_bytes(8, "little", signed=True) for v in values or [0]))
        z.writestr("archive/version", "3\n")
    return out.getvalue()


def test_torch_payload_shapes_and_int_values(fake_torch):
    p = read_torch_payload(torch_save(fake_torch, (256, 3584), "BFloat16Storage"))
    assert isinstance(p.obj, TensorRecord) and p.obj.shape == (256, 3584) and p.obj.dtype == "bfloat16"
    g = read_torch_payload(torch_save(fake_torch, (1, 3), "LongStorage", [1, 32, 32]))
    assert g.int_values(g.obj) == [1, 32, 32]


def test_torch_payload_refuses_code():
    class Evil:
        def __reduce__(self):
            import os
            return (os.system, ("true",))

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(Evil(), protocol=2))
    with pytest.raises(UnsafePayloadError, match="names posix.system|names os.system|names nt.system"):
        read_torch_payload(out.getvalue())
    with pytest.raises(UnsafePayloadError, match="not a torch.save zip"):
        read_torch_payload(b"not a zip")


# -- over HTTP -----------------------------------------------------------------------------------------------

pytest.importorskip("fastapi")
pytest.importorskip("av")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from kernelsight.loadgen.mm_dataset import synthetic_mp4  # noqa: E402
from kernelsight.server.runner import ServerThread  # noqa: E402

TEXT = [{"type": "text", "text": "What happens in the video?"}]


def _video_part(w: int, h: int, frames: int, key=(0,), fps: float = 30.0) -> dict:
    data = base64.b64encode(synthetic_mp4(w, h, frames, key, fps)).decode()
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + data}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    media = tmp_path_factory.mktemp("videos")
    (media / "clip.mp4").write_bytes(synthetic_mp4(320, 224, 8, (5,)))
    with ServerThread(["--model", Q25, "--hardware", "h100", "--max-model-len", "16384", "--time-scale", "20",
                       "--limit-mm-per-prompt", '{"image": 2, "video": 1}', "--enable-mm-embeds", "--seed", "3",
                       "--allowed-local-media-path", str(media)]) as s:
        s.media_dir = media
        s.added = []
        add = s.bridge.engine.add_request

        def counting(request_id, prompt, *args, **kwargs):
            s.added.append((list(prompt), tuple(kwargs.get("mm_items", ()))))
            return add(request_id, prompt, *args, **kwargs)

        s.bridge.engine = EngineSpy(s.bridge.engine, counting)
        yield s


@pytest.fixture()
def c(srv):
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        yield client


def _text_only(c) -> int:
    return c.post("/tokenize", json={"messages": [{"role": "user", "content": TEXT}]}).json()["count"]


def test_openai_sdk_video_message_counts_the_processor_tokens(srv, c):
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=Q25, max_tokens=2, messages=[
        {"role": "user", "content": [_video_part(320, 224, 8), *TEXT]}])
    # 8 frames of 320x224 (all kept): 4 temporal patches of 16 x 22 patches (224/28 = 8, 320/28 = 11.4 -> 11):
    # 4 x 352 / 4 = 352 pads, with the template's <|vision_start|> and <|vision_end|> around them
    assert r.usage.prompt_tokens == _text_only(c) + 352 + 2
    prompt, items = srv.added[-1]
    (item,) = items
    assert (item.modality, item.num_tokens, item.grid_thw, item.encoder_seq_lens) == ("video", 352, (4, 16, 22),
                                                                                       (352,) * 4)
    assert set(prompt[item.offset:item.end]) == {151656} and prompt[item.offset - 1] == 151652
    tok = c.post("/tokenize", json={"messages": [{"role": "user", "content": [_video_part(320, 224, 8), *TEXT]}]})
    assert tok.json()["count"] == r.usage.prompt_tokens


def test_file_url_video_under_the_allowed_path(srv, c):
    part = {"type": "video_url", "video_url": {"url": (srv.media_dir / "clip.mp4").as_uri()}}
    r = c.post("/tokenize", json={"messages": [{"role": "user", "content": [part, *TEXT]}]})
    assert r.status_code == 200 and r.json()["count"] == _text_only(c) + 352 + 2


def test_media_io_kwargs_num_frames_caps_the_loader():
    with ServerThread(["--model", Q25, "--max-model-len", "16384", "--media-io-kwargs",
                       '{"video": {"num_frames": 4}}']) as s, httpx.Client(base_url=s.base_url, timeout=60) as c:
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": [_video_part(224, 224, 12), *TEXT]}]})
        # 12 frames, 4 kept: 2 temporal patches of 8 x 8 merged tokens
        assert r.json()["count"] == _text_only(c) + 2 * 64 + 2


@pytest.mark.parametrize("content,message,param", [
    ([_video_part(64, 64, 2, (1,)), _video_part(64, 64, 2, (2,)), *TEXT],
     "At most 1 video(s) may be provided in one prompt.", "video"),
    ([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,bm90IGEgdmlkZW8="}}, *TEXT],
     "Failed to load video: Could not open video stream (InvalidDataError)", "video"),
    ([{"type": "video_url", "video_url": {"url": "http://127.0.0.1:9/v.mp4"}}, *TEXT], None, None),
    ([{"type": "video_embeds", "video_embeds": "x"}, *TEXT], "You must set `--enable-mm-embeds` to input "
                                                           "`video_embeds`", "video_embeds"),
])
def test_video_refusals_have_vllms_body_and_never_reach_the_engine(srv, c, content, message, param):
    before = len(srv.added)
    r = c.post("/v1/chat/completions", json={"model": Q25, "max_tokens": 2, "messages": [
        {"role": "user", "content": content}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param
    if message is None:
        assert err["message"].startswith("Failed to fetch video from http://127.0.0.1:9/v.mp4")
    else:
        assert err["message"] == message
    assert len(srv.added) == before


def test_image_embeds_are_their_rows_and_run_no_encoder(srv, c, fake_torch):
    emb = base64.b64encode(torch_save(fake_torch, (64, 3584), "BFloat16Storage")).decode()
    grid = base64.b64encode(torch_save(fake_torch, (1, 3), "LongStorage", [1, 16, 16])).decode()
    part = {"type": "image_embeds", "image_embeds": {"image_embeds": emb, "image_grid_thw": grid}}
    r = c.post("/v1/chat/completions", json={"model": Q25, "max_tokens": 2, "messages": [
        {"role": "user", "content": [part, *TEXT]}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == _text_only(c) + 64 + 2
    (item,) = srv.added[-1][1]
    assert item.num_tokens == 64 and item.encoder_seq_lens == () and item.num_patches == 0
    bad = base64.b64encode(torch_save(fake_torch, (63, 3584))).decode()
    r = c.post("/v1/chat/completions", json={"model": Q25, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_embeds", "image_embeds": {"image_embeds": bad, "image_grid_thw": grid}}, *TEXT]}]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "image_embeds has 63 rows but image_grid_thw [1, 16, 16] gives 64 tokens"


def test_image_embeds_and_video_refused_where_vllm_refuses_them():
    with ServerThread(["--model", "meta-llama/Llama-4-Scout-17B-16E", "--max-model-len", "8192", "--hardware", "b200",
                       "--tensor-parallel-size", "4",
                       "--served-model-name", "l4"]) as s, httpx.Client(base_url=s.base_url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": "l4", "max_tokens": 2, "messages": [{"role": "user",
                   "content": [{"type": "image_embeds", "image_embeds": "eA=="}, *TEXT]}]})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "You must set `--enable-mm-embeds` to input `image_embeds`", "type": "BadRequestError",
            "param": "image_embeds", "code": 400}
        r = c.post("/v1/chat/completions", json={"model": "l4", "max_tokens": 2, "messages": [{"role": "user",
                   "content": [_video_part(64, 64, 2), *TEXT]}]})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "At most 0 video(s) may be provided in one prompt."


def test_qwen3_vl_video_over_http_has_timestamps():
    with ServerThread(["--model", Q3, "--max-model-len", "16384"]) as s, \
            httpx.Client(base_url=s.base_url, timeout=60) as c:
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": [_video_part(640, 480, 20, fps=10),
                                                                                *TEXT]}]})
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        stamps = [c.post("/tokenize", json={"prompt": f"<{t} seconds>", "add_special_tokens": False}).json()["tokens"]
                  for t in ("0.3", "1.6")]
        group = [151652] + [151656] * 300 + [151653]
        want = stamps[0] + group + stamps[1] + group
        start = ids.index(stamps[0][0])
        assert ids[start:start + len(want)] == want
        # the template's <|vision_start|><|video_pad|><|vision_end|> is wholly replaced
        assert r.json()["count"] == _text_only(c) + len(want)


# -- random-mm with video buckets ----------------------------------------------------------------------------

pytest.importorskip("aiohttp")
from kernelsight.cli import main  # noqa: E402

ENGINE = ["--model", Q25, "--hardware", "h100", "--max-model-len", "16384"]
WORKLOAD = ["--dataset-name", "random-mm", "--num-prompts", "10", "--request-rate", "4", "--random-input-len", "200",
            "--random-output-len", "8", "--random-mm-base-items-per-request", "2",
            "--random-mm-bucket-config", "{(224, 320, 1): 0.5, (224, 320, 8): 0.5}",
            "--random-mm-limit-mm-per-prompt", '{"image": 2, "video": 1}', "--seed", "9"]


def test_random_mm_video_buckets_same_prompts_in_bench_and_simulate(tmp_path):
    sim_json, sim2_json, bench_json = tmp_path / "sim.json", tmp_path / "sim2.json", tmp_path / "bench.json"
    assert main(["simulate", *ENGINE, *WORKLOAD, "--save-detailed", "--result-json", str(sim_json)]) == 0
    assert main(["simulate", *ENGINE, *WORKLOAD, "--save-detailed", "--result-json", str(sim2_json)]) == 0
    with ServerThread([*ENGINE, "--time-scale", "1"]) as srv:
        assert main(["bench", "--base-url", srv.base_url, "--endpoint", "/v1/chat/completions", *WORKLOAD,
                     "--save-detailed", "--result-json", str(bench_json)]) == 0
    sim, sim2, bench = (json.loads(p.read_text()) for p in (sim_json, sim2_json, bench_json))
    assert bench["completed"] == sim["completed"] == 10 and bench["failed"] == 0
    assert bench["input_lens"] == sim["input_lens"]
    # some requests carried a video (8 frames of 224x320: 4 x 8 x 11 = 352 tokens), some did not
    assert max(sim["input_lens"]) > 200 + 352 and min(sim["input_lens"]) < 200 + 352 + 88
    assert (sim["input_lens"], sim["ttfts"]) == (sim2["input_lens"], sim2["ttfts"])


def test_synthetic_videos_are_deterministic_and_distinct():
    from kernelsight.multimodal import video_info

    a, b = synthetic_mp4(320, 224, 8, (1, 0, 0)), synthetic_mp4(320, 224, 8, (1, 0, 1))
    assert a == synthetic_mp4(320, 224, 8, (1, 0, 0)) and a != b
    assert video_info(a) == VideoInfo(total_frames=8, fps=30.0, width_px=320, height_px=224)
