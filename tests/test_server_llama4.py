"""Llama 4 Scout served offline over HTTP with its bundled tokenizer (Meta's llama4 tokenizer.model) and chat
template: an image's prompt tokens as Llama4Processor counts them, /tokenize agreeing, a text-only chat, the base
model. Counts are worked by hand from the processor's published rules (kernelsight/multimodal/llama4.py): 336-px
tiles on the best-fit canvas of at most 16 tiles, 144 <|patch|> per tile, a <|tile_x_separator|> between a row's
tiles, a <|tile_y_separator|> after each row, then <|image|> and the global tile's 144 patches when there is more
than one tile, all between <|image_start|> and <|image_end|>."""

from __future__ import annotations

import base64
import io

import httpx
import pytest

pytest.importorskip("fastapi")
from conftest import EngineSpy
from PIL import Image  # noqa: E402

from kernelsight.server.runner import ServerThread  # noqa: E402

INSTRUCT = "meta-llama/Llama-4-Scout-17B-16E-Instruct"
BASE = "meta-llama/Llama-4-Scout-17B-16E"
# 109B bf16 weights need 4 H100s (as in vLLM); a short context keeps the KV budget within them
ARGS = ["--hardware", "h100", "--tensor-parallel-size", "4", "--max-model-len", "16384", "--time-scale", "50",
        "--seed", "5"]
QUESTION = "What is in the picture?"
BOS, HEADER_START, HEADER_END, EOT = 200000, 200005, 200006, 200008
IMAGE_START, IMAGE_END, TILE_X, TILE_Y, IMAGE, PATCH = 200080, 200081, 200084, 200085, 200090, 200092


def _image_part(w: int, h: int) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (30, 160, 90)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(c: httpx.Client, content, model: str = INSTRUCT) -> dict:
    r = c.post("/v1/chat/completions", json={"model": model, "max_tokens": 2, "messages": [
        {"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def srv():
    with ServerThread(["--model", INSTRUCT, *ARGS]) as s:
        s.added_prompts = []
        engine = s.bridge.engine
        add = engine.add_request

        def recording(request_id, prompt, *args, **kwargs):
            s.added_prompts.append((list(prompt), tuple(kwargs.get("mm_items", ()))))
            return add(request_id, prompt, *args, **kwargs)

        s.bridge.engine = EngineSpy(engine, recording)
        yield s


@pytest.fixture()
def c(srv):
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        yield client


def test_text_only_chat_renders_the_llama4_template(srv, c):
    body = _chat(c, QUESTION)
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 2
    prompt, items = srv.added_prompts[-1]
    assert items == ()
    # <|begin_of_text|><|header_start|>user<|header_end|>\n\n...<|eot|><|header_start|>assistant<|header_end|>\n\n
    assert prompt[:2] == [BOS, HEADER_START] and prompt[3] == HEADER_END and EOT in prompt
    assert prompt[-4] == HEADER_START and prompt[-2] == HEADER_END
    assert body["usage"]["prompt_tokens"] == len(prompt) == 16


@pytest.mark.parametrize("w,h,rows,cols,image_tokens", [
    # 336x336 fits one tile at scale 1: no global tile, <|image_start|><|image|> 144 <|patch|> <|image_end|>
    (336, 336, 1, 1, 1 + 1 + 144 + 1),
    # 672x336 (w x h): the smallest canvas at the smallest scale >= 1 is 1 row x 2 tiles (scale 1);
    # 2 x 144 patches + 1 x-separator + 1 y-separator, then <|image|> + the global tile's 144
    (672, 336, 1, 2, 1 + (2 * 144 + 1 + 1) + 1 + 144 + 1),
    # 1000x800: 3x3 tiles (1008x1008, scale 1.008; 3 rows x 4 tiles would scale 1.26) -> 9 x 144 + 3 x 2
    # x-separators + 3 y-separators, then the global tile
    (1000, 800, 3, 3, 1 + (9 * 144 + 3 * 2 + 3) + 1 + 144 + 1),
])
def test_image_prompt_tokens_are_the_processors(srv, c, w, h, rows, cols, image_tokens):
    text = _chat(c, [{"type": "text", "text": QUESTION}])["usage"]["prompt_tokens"]
    content = [_image_part(w, h), {"type": "text", "text": QUESTION}]
    got = _chat(c, content)["usage"]["prompt_tokens"]
    assert got - text == image_tokens
    tok = c.post("/tokenize", json={"model": INSTRUCT, "messages": [{"role": "user", "content": content}]}).json()
    assert tok["count"] == got
    ids = tok["tokens"]
    start, end = ids.index(IMAGE_START), ids.index(IMAGE_END)
    assert end - start + 1 == image_tokens and ids.count(IMAGE) == 1      # the one placeholder, kept as vLLM does
    assert ids[end - 145] == IMAGE and set(ids[end - 144:end]) == {PATCH}  # the global (or only) tile last
    tiles = rows * cols
    assert ids.count(PATCH) == 144 * (tiles + (tiles > 1))
    assert (ids.count(TILE_X), ids.count(TILE_Y)) == ((rows * (cols - 1), rows) if tiles > 1 else (0, 0))
    # the image sits where the template put <|image|>: after the user header's "\n\n", before the question
    assert ids[start - 2] == HEADER_END


def test_the_engine_gets_one_encoder_sequence_per_tile(srv, c):
    body = _chat(c, [_image_part(672, 336), {"type": "text", "text": QUESTION}])
    prompt, items = srv.added_prompts[-1]
    assert len(prompt) == body["usage"]["prompt_tokens"] and len(items) == 1
    # two 336-px tiles and the global tile, 576 patches each before the 0.5 pixel shuffle
    assert items[0].encoder_seq_lens == (576, 576, 576)
    assert prompt[items[0].offset] == IMAGE_START and prompt[items[0].end - 1] == IMAGE_END


def test_the_base_model_starts_offline_and_takes_an_image():
    with ServerThread(["--model", BASE, *ARGS]) as s, httpx.Client(base_url=s.base_url, timeout=60) as c:
        text = _chat(c, QUESTION, BASE)["usage"]["prompt_tokens"]
        img = _chat(c, [_image_part(336, 336), {"type": "text", "text": QUESTION}], BASE)["usage"]["prompt_tokens"]
        # no chat template in the base checkpoint: the generic fallback writes "user: <|image|>\nWhat ...", so
        # besides the image's 147 tokens the "\n" is one more and " What" splits into " " + "What"
        assert img - text == 147 + 2
        done = c.post("/v1/completions", json={"model": BASE, "prompt": "Hello", "max_tokens": 2}).json()
        assert done["usage"]["prompt_tokens"] == 2        # <|begin_of_text|> Hello


def test_a_video_is_refused_before_the_engine(srv, c):
    """Llama 4 takes no video: vLLM's limit of 0 for the modality, and nothing reaches the engine."""
    n = len(srv.added_prompts)
    content = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
               {"type": "text", "text": "hi"}]
    r = c.post("/v1/chat/completions", json={"model": INSTRUCT, "max_tokens": 1,
                                             "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "video"
    assert "At most 0 video(s)" in r.json()["error"]["message"] and len(srv.added_prompts) == n
