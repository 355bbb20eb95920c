"""Images over HTTP against a served Qwen2.5-VL-7B: the openai SDK's image message, the Anthropic base64 image block
(the anthropic SDK, and raw HTTP in its exact shape), Responses input_image, /tokenize, the
refusals with vLLM's bodies (nothing reaching the engine), and a text-only model's refusal."""

from __future__ import annotations

import base64
import io
import os

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from conftest import EngineSpy  # noqa: E402
from PIL import Image  # noqa: E402

from kernelsight.server.runner import ServerThread  # noqa: E402

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
ARGS = ["--model", MODEL, "--hardware", "h100", "--max-model-len", "8192", "--time-scale", "20",
        "--limit-mm-per-prompt", '{"image": 2}', "--seed", "3"]
TEXT = [{"type": "text", "text": "What is in the picture?"}]


def _png(w: int, h: int, color=(200, 10, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def _url(w: int, h: int, **kw) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(w, h, **kw)).decode()


def _image_part(w: int, h: int) -> dict:
    return {"type": "image_url", "image_url": {"url": _url(w, h)}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    (media / "a.png").write_bytes(_png(896, 448))
    with ServerThread([*ARGS, "--allowed-local-media-path", str(media)]) as s:
        s.media_dir = media
        s.added = []          # every request that reached the engine
        s.added_prompts = []
        engine = s.bridge.engine
        add = engine.add_request

        def counting(request_id, prompt, *args, **kwargs):
            s.added.append(request_id)
            s.added_prompts.append((list(prompt), tuple(kwargs.get("mm_items", ()))))
            return add(request_id, prompt, *args, **kwargs)

        s.bridge.engine = EngineSpy(engine, counting)
        yield s


@pytest.fixture()
def c(srv):
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        yield client


def _engine_requests(srv) -> int:
    return len(srv.added)


def _text_only_tokens(c) -> int:
    r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "What is in the picture?"}]})
    return r.json()["usage"]["prompt_tokens"]


def test_openai_sdk_image_message_counts_the_processor_tokens(srv, c):
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    base = _text_only_tokens(c)
    got = {}
    for side in (448, 896):
        r = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(side, side)}}, *TEXT]}])
        got[side] = r.usage.prompt_tokens - base
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    # the image's tokens plus <|vision_start|> and <|vision_end|>: 448 -> 256, 896 -> 1024
    assert got == {448: 256 + 2, 896: 1024 + 2}
    stream = client.chat.completions.create(model=MODEL, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(448, 448)}}, *TEXT]}])
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[-1].prompt_tokens == base + 258 and usage[-1].completion_tokens == 3
    tok = c.post("/tokenize", json={"model": MODEL, "messages": [
        {"role": "user", "content": [_image_part(448, 448), *TEXT]}]}).json()
    assert tok["count"] == base + 258 and tok["tokens"].count(151655) == 256


def test_request_mm_processor_kwargs_override_the_served_ones(c):
    msgs = [{"role": "user", "content": [_image_part(896, 896), *TEXT]}]
    full = c.post("/tokenize", json={"model": MODEL, "messages": msgs}).json()["count"]
    # max_pixels 200704 (256 merged patches): 896x896 scales by sqrt(802816/200704) = 2 to 448x448 -> 256 tokens
    small = c.post("/tokenize", json={"model": MODEL, "messages": msgs,
                                      "mm_processor_kwargs": {"max_pixels": 200704}}).json()["count"]
    assert full - small == 1024 - 256
    bad = c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 1,
                                               "mm_processor_kwargs": {"crop": True}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mm_processor_kwargs"


def test_the_anthropic_sdk_sends_a_base64_image_block(srv, c):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=srv.base_url, api_key="x")
    data = base64.b64encode(_png(448, 448)).decode()
    msg = client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "What is in the picture?"}]}])
    chat = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [_image_part(448, 448), *TEXT]}]}).json()
    # the image's 256 placeholders (+ its start/end tokens) are in the SDK request's input tokens, as in chat's
    assert msg.usage.input_tokens == chat["usage"]["prompt_tokens"] > 258
    assert msg.usage.output_tokens == 3 and msg.content[0].type == "text"


def test_anthropic_base64_image_block(c):
    data = base64.b64encode(_png(448, 448)).decode()
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "What is in the picture?"}]}]}
    m = c.post("/v1/messages", json=body)
    assert m.status_code == 200, m.text
    chat = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [_image_part(448, 448), *TEXT]}]}).json()
    assert m.json()["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    counted = c.post("/v1/messages/count_tokens", json={k: v for k, v in body.items() if k != "max_tokens"}).json()
    assert counted["input_tokens"] == chat["usage"]["prompt_tokens"]
    # a url source is fetched as an image_url part: here one vLLM refuses to fetch
    url_block = {"type": "image", "source": {"type": "url", "url": "ftp://example.com/a.png"}}
    bad = c.post("/v1/messages", json={**body, "messages": [{"role": "user", "content": [url_block]}]})
    assert bad.status_code == 400 and "HTTP, data or file URL" in bad.text


def test_responses_input_image_and_file_url(srv, c):
    r = c.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 2, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is in the picture?"},
                                     {"type": "input_image", "image_url": _url(448, 448)}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == _text_only_tokens(c) + 258
    # a file under --allowed-local-media-path: 896x448 -> grid 32x64 -> 512 tokens
    f = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": (srv.media_dir / "a.png").as_uri()}}, *TEXT]}]})
    assert f.status_code == 200, f.text
    assert f.json()["usage"]["prompt_tokens"] == _text_only_tokens(c) + 514


@pytest.mark.parametrize("content,message,param", [
    ([_image_part(64, 64)] * 3 + TEXT, "At most 2 image(s) may be provided in one prompt.", "image"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}, *TEXT],
     "Failed to load image: cannot identify image file (UnidentifiedImageError)", "image"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;utf8,abc"}}, *TEXT],
     "Only base64 data URLs are supported for now.", None),
    ([{"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}}, *TEXT],
     "The URL must be either a HTTP, data or file URL.", None),
    ([{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}, *TEXT],
     None, None),     # outside --allowed-local-media-path: vLLM's subpath message (the path varies)
])
def test_refusals_have_vllms_body_and_never_reach_the_engine(srv, c, content, message, param):
    before = _engine_requests(srv)
    r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": content}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param
    if message is not None:
        assert err["message"] == message
    else:
        assert err["message"].startswith("The file path /etc/hostname must be a subpath of "
                                         "`--allowed-local-media-path ")
    assert _engine_requests(srv) == before


def test_unreachable_url_is_refused_within_the_fetch_timeout(srv, c):
    before = _engine_requests(srv)
    r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}},
                                     *TEXT]}]})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("Failed to fetch image from http://127.0.0.1:9/x.png")
    assert _engine_requests(srv) == before


def test_same_image_hits_the_mm_cache(srv, c):
    def scrape() -> tuple[float, float]:
        vals = {}
        for line in c.get("/metrics").text.splitlines():
            if line.startswith(("vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total")):
                vals[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
        return vals["vllm:mm_cache_queries_total"], vals["vllm:mm_cache_hits_total"]

    q0, h0 = scrape()
    part = _image_part(320, 240)
    for _ in range(2):
        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": [part, *TEXT]}]})
        assert r.status_code == 200
    q1, h1 = scrape()
    assert (q1 - q0, h1 - h0) == (2, 1)


def test_images_reach_the_engine_as_items(srv, c):
    n = len(srv.added)
    r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [_image_part(448, 448), *TEXT, _image_part(56, 56)]}]})
    assert r.status_code == 200 and len(srv.added) == n + 1
    prompt, items = srv.added_prompts[-1]
    assert len(prompt) == r.json()["usage"]["prompt_tokens"]
    assert [(i.num_tokens, i.encoder_seq_lens, i.grid_thw) for i in items] == [
        (256, (1024,), (1, 32, 32)), (4, (16,), (1, 4, 4))]
    for i in items:      # each range is the image's pads, between <|vision_start|> and <|vision_end|>
        assert set(prompt[i.offset:i.end]) == {151655}
        assert prompt[i.offset - 1] == 151652 and prompt[i.end] == 151653
    assert items[0].mm_hash != items[1].mm_hash and len(items[0].mm_hash) == 64


def test_qwen3_vl_counts_32px_merged_patches_with_its_own_template():
    with ServerThread(["--model", "Qwen/Qwen3-VL-30B-A3B-Instruct", "--max-model-len", "8192"]) as s:
        with httpx.Client(base_url=s.base_url, timeout=30) as c:
            tok = c.post("/tokenize", json={"messages": [{"role": "user", "content": [*TEXT, _image_part(448, 448)]}]})
            text = c.post("/tokenize", json={"messages": [{"role": "user", "content": TEXT}]})
            # 448 / 32 = 14 merged patches a side: 196 pads, inline after the text with start and end
            assert tok.json()["count"] == text.json()["count"] + 196 + 2
            ids = tok.json()["tokens"]
            assert ids.count(151655) == 196 and ids[ids.index(151655) - 1] == 151652


def test_text_only_model_refuses_an_image():
    with ServerThread(["--model", "Qwen/Qwen3-8B", "--max-model-len", "4096", "--served-model-name", "qwen3"]) as s:
        with httpx.Client(base_url=s.base_url, timeout=30) as c:
            r = c.post("/v1/chat/completions", json={"model": "qwen3", "max_tokens": 2, "messages": [
                {"role": "user", "content": [_image_part(64, 64), *TEXT]}]})
            assert r.status_code == 400
            assert r.json()["error"] == {"message": "qwen3 is not a multimodal model", "type": "BadRequestError",
                                         "param": None, "code": 400}
            assert s.call(lambda: s.bridge.engine.num_waiting + s.bridge.engine.num_running) == 0


@pytest.mark.skipif(os.environ.get("CI_NO_NETWORK_BIND") == "1", reason="binds a local HTTP server")
def test_http_image_url_is_fetched(srv, c):
    import http.server
    import threading

    body = _png(448, 448)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/cat.png"
        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, *TEXT]}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == _text_only_tokens(c) + 258
    finally:
        httpd.shutdown()


@pytest.mark.parametrize("argv,expected", [
    (["--allowed-local-media-path", "/nonexistent/media"],
     "Invalid `--allowed-local-media-path`: The path /nonexistent/media does not exist."),
    (["--limit-mm-per-prompt", "image=2"], "--limit-mm-per-prompt takes JSON"),
    (["--mm-processor-kwargs", '{"num_crops": 4}'], "unsupported mm_processor_kwargs"),
])
def test_serve_refuses_bad_multimodal_flags_in_one_line(capsys, argv, expected):
    from conftest import cli_one_line_error

    line = cli_one_line_error(capsys, ["serve", "--model", MODEL, "--port", "0", *argv])
    assert expected in line
