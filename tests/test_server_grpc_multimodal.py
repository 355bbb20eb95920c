"""gRPC Generate with a gateway's preprocessed images (``mm_inputs``) against a served Qwen2.5-VL: the items reach the
engine with their placeholders, grid and hash, the encoder runs (the first token comes later than for the same ids
without the image, by at least the encoder's pass), a repeated image hits the encoder cache, and malformed inputs get
INVALID_ARGUMENT with nothing reaching the engine."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi")
grpc = pytest.importorskip("grpc")
pytest.importorskip("smg_grpc_proto")

from conftest import EngineSpy  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2 as pb  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc  # noqa: E402

from kernelsight.server.wire.grpc.runner import GrpcServerThread  # noqa: E402
from kernelsight.simcore.multimodal import MultimodalItem  # noqa: E402

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
VISION_START, IMAGE_PAD, VISION_END = 151652, 151655, 151653
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def srv():
    with GrpcServerThread(["--model", MODEL, "--hardware", "h100", "--max-model-len", "4096", "--time-scale", "20",
                           "--record-timings", "--seed", "0", "--no-enable-prefix-caching"]) as s:
        s.items = []
        add = s.bridge.engine.add_request

        def recording(request_id, prompt, *args, **kwargs):
            s.items.append(tuple(kwargs.get("mm_items", ())))
            return add(request_id, prompt, *args, **kwargs)

        s.bridge.engine = EngineSpy(s.bridge.engine, recording)
        yield s


@pytest.fixture(scope="module")
def stub(srv):
    with grpc.insecure_channel(srv.grpc_target) as ch:
        yield pb_grpc.VllmEngineStub(ch)


def _ids(grid_h: int, grid_w: int) -> tuple[list[int], int, int]:
    n = grid_h * grid_w // 4
    ids = [1000 + i for i in range(20)] + [VISION_START] + [IMAGE_PAD] * n + [VISION_END] + [2000, 2001]
    return ids, 21, n


def _mm(offset: int, length: int, grid: tuple[int, int, int] | None, h: str | None = "img-a") -> pb.MultimodalInputs:
    tensors = {}
    if grid is not None:
        tensors["image_grid_thw"] = pb.TensorData(shape=[1, 3], dtype="int64",
                                                  inline=np.array([grid], dtype=np.int64).tobytes())
    return pb.MultimodalInputs(mm_placeholders=[pb.PlaceholderRange(offset=offset, length=length)],
                               mm_hashes=[h] if h else [], model_specific_tensors=tensors,
                               pixel_values=pb.TensorData(shape=[4], dtype="float32", inline=b"\0" * 16))


def _generate(stub, rid: str, ids: list[int], mm: pb.MultimodalInputs | None) -> pb.GenerateComplete:
    req = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), stream=False,
                             sampling_params=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    if mm is not None:
        req.mm_inputs.CopyFrom(mm)
    msgs = list(stub.Generate(req, timeout=TIMEOUT_S))
    return msgs[-1].complete


def _ttft_s(srv, rid: str) -> float:
    rec = srv.bridge.timings[rid]
    return rec["token_times_s"][0] - rec["arrival_s"]


def test_an_image_reaches_the_engine_and_its_encoder_runs(srv, stub):
    ids, offset, n = _ids(64, 64)                     # 896x896: a 64x64 patch grid, 1,024 tokens
    with_image = _generate(stub, "img", ids, _mm(offset, n, (1, 64, 64)))
    assert with_image.prompt_tokens == len(ids)
    assert srv.items[-1] == (MultimodalItem("image", offset, n, (4096,), "img-a", (1, 64, 64)),)
    _generate(stub, "txt", ids, None)
    assert srv.items[-1] == ()
    encoder_s = srv.call(lambda: srv.bridge.engine.step_model.encoder_pass_s(
        (MultimodalItem("image", offset, n, (4096,), "x", (1, 64, 64)),)))
    # both on an idle engine: the image's request waits for its encoder pass in its first step
    assert _ttft_s(srv, "img") - _ttft_s(srv, "txt") >= 0.99 * encoder_s > 0


def test_without_a_grid_the_patches_follow_the_placeholders(srv, stub):
    ids, offset, n = _ids(32, 32)
    _generate(stub, "nogrid", ids, _mm(offset, n, None, h="img-b"))
    (item,) = srv.items[-1]
    assert item.num_patches == 4 * n and item.grid_thw == (1, 0, 0) and item.mm_hash == "img-b"


def test_a_repeated_image_hits_the_encoder_cache(srv, stub):
    ids, offset, n = _ids(32, 32)
    cache = srv.bridge.engine.scheduler.encoder_cache
    before = srv.call(lambda: (cache.num_computed, cache.num_hits))
    _generate(stub, "rep1", ids, _mm(offset, n, (1, 32, 32), h="same-image"))
    _generate(stub, "rep2", [7] + ids[1:], _mm(offset, n, (1, 32, 32), h="same-image"))
    after = srv.call(lambda: (cache.num_computed, cache.num_hits))
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


@pytest.mark.parametrize(("mm", "fragment"), [
    (_mm(21, 256, (1, 64, 64), h=None).__class__(mm_placeholders=[]), "without mm_placeholders"),
    (_mm(21, 10_000, (1, 32, 32)), "past the prompt"),
    (_mm(21, 256, None, h=None).__class__(
        mm_placeholders=[pb.PlaceholderRange(offset=21, length=256)], mm_hashes=["a", "b"]), "mm_hashes for 1"),
])
def test_malformed_mm_inputs_are_invalid_argument_and_reach_nothing(srv, stub, mm, fragment):
    ids, _, _ = _ids(32, 32)
    before = len(srv.items)
    req = pb.GenerateRequest(request_id="bad", tokenized=pb.TokenizedInput(input_ids=ids), stream=False,
                             sampling_params=pb.SamplingParams(max_tokens=2))
    req.mm_inputs.CopyFrom(mm)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in info.value.details()
    assert len(srv.items) == before
