"""TTFT against image size for Qwen2.5-VL-7B-Instruct on H100 and A100 (issue 37), with the roofline bound beside
each, and the server's CPU cost per image request.

1. For each GPU and square image side (and one short video: ``--video``, 448x448, 4 s at 30 fps by default, which
   vLLM's loader cuts to 32 frames), one request (a short question after one image) on an idle simulated engine
   (``kernelsight simulate``'s fast-forward path): its prompt tokens (the processor's image tokens + the chat
   template), the simulated TTFT, and the roofline bound of the same work: the language model's prefill kernels at
   η = 1 (every kernel's compute or memory roof, wave-quantized, summed over the prefill chunks) plus the vision
   encoder pass's (``StepModel.encoder_roofline_s``). The encoder's simulated time is ``StepModel.encoder_pass_s``
   (its kernels, eager launches) for the same items.
2. A ``kernelsight serve`` subprocess answering non-streamed chat requests of one token: server CPU seconds (utime +
   stime from /proc) per request with one unique 896x896 PNG, against the same text-only request; steal time from
   /proc/stat beside it.

No public per-image-size TTFT figure for Qwen2.5-VL-7B on these GPUs was found to cite; none is copied here.

    python benchmarks/mm_ttft.py [--sides 224,448,672,896,1344,1792] [--video 448x448x120] [--cpu-requests 40]

Prints two tables and writes ``benchmarks/results/mm_ttft.json``.
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import steal_s, write_result  # noqa: E402

from kernelsight.engine_args import create_engine_config  # noqa: E402
from kernelsight.loadgen.datasets import SampleRequest  # noqa: E402
from kernelsight.loadgen.fastforward import run_fast_forward  # noqa: E402
from kernelsight.loadgen.mm_dataset import materialize_for_engine, synthetic_png  # noqa: E402
from kernelsight.loadgen.tokenizer import resolve_tokenizer  # noqa: E402
from kernelsight.multimodal import processor_for_model  # noqa: E402
from kernelsight.profiles import load_preprocessor_config, load_video_preprocessor_config  # noqa: E402
from kernelsight.simcore.engine_config import EngineArgs, build_step_model  # noqa: E402
from kernelsight.simcore.kernel_shapes import BatchShape, PrefillChunk  # noqa: E402
from kernelsight.simcore.kernels import decompose_step  # noqa: E402
from kernelsight.simcore.roofline import kernel_roofline_s  # noqa: E402

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
GPUS = ("h100", "a100")
QUESTION = "Describe this image in one sentence."


def prefill_roofline_s(config, prompt_len: int) -> float:
    """Σ kernel roofline of the prompt's prefill, in chunks of max_num_batched_tokens (η = 1, no launch/host)."""
    budget = config.scheduler.max_num_batched_tokens
    total, done = 0.0, 0
    while done < prompt_len:
        n = min(budget, prompt_len - done)
        batch = BatchShape(prefills=(PrefillChunk(n, done, done + n == prompt_len),))
        for k in decompose_step(config.model, batch, config.args.tensor_parallel_size, config.precision):
            total += k.count * kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, config.hardware)
        done += n
    return total


def ttft_rows(sides: list[int], video: tuple[int, int, int] | None = None) -> list[dict]:
    tok = resolve_tokenizer(MODEL)
    rows = []
    for gpu in GPUS:
        config = create_engine_config(EngineArgs(model=MODEL, hardware=gpu, max_model_len=16384))
        processor = processor_for_model(config.model, load_preprocessor_config(MODEL), None,
                                        load_video_preprocessor_config(MODEL))
        sm = build_step_model(config)
        for side in [0, *sides, *([video] if video else [])]:
            s = SampleRequest(None, 0, 1, prompt=QUESTION)
            if isinstance(side, tuple):          # a video: (width, height, frames) at 30 fps
                s.mm_sizes, s.mm_frames = [side[:2]], [side[2]]
            else:
                s.mm_sizes = [(side, side)] if side else []
            materialize_for_engine([s], tok, processor, config.model.name, seed=0)
            res = run_fast_forward(config, [s], [0.0], ignore_eos=True)
            rec = res.records[0]
            image_tokens = sum(i.num_tokens for i in s.mm_items)
            encoder_s = sm.encoder_pass_s(s.mm_items) if s.mm_items else 0.0
            enc_roof_s = sm.encoder_roofline_s(s.mm_items) if s.mm_items else 0.0
            lm_roof_s = prefill_roofline_s(config, s.prompt_len)
            roof_s = lm_roof_s + enc_roof_s
            label = f"video {side[0]}x{side[1]}x{side[2]}" if isinstance(side, tuple) else side
            rows.append({"gpu": gpu, "image_px": label, "image_tokens": image_tokens, "prompt_tokens": s.prompt_len,
                         "ttft_ms": round(1e3 * rec.ttft_s, 3), "encoder_ms": round(1e3 * encoder_s, 3),
                         "encoder_roofline_ms": round(1e3 * enc_roof_s, 3),
                         "lm_prefill_roofline_ms": round(1e3 * lm_roof_s, 3), "roofline_ms": round(1e3 * roof_s, 3),
                         "ttft_over_roofline": round(rec.ttft_s / roof_s, 2) if roof_s else None})
    return rows


def cpu_rows(n: int) -> dict:
    import httpx
    from _server_proc import ServerProc, cpu_s

    def body(i: int, image: bool) -> dict:
        parts = [{"type": "text", "text": QUESTION}]
        if image:
            url = "data:image/png;base64," + base64.b64encode(synthetic_png(896, 896, (7, i))).decode()
            parts.insert(0, {"type": "image_url", "image_url": {"url": url}})
        return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": parts}]}

    out = {}
    with ServerProc(["--model", MODEL, "--max-model-len", "8192", "--time-scale", "1000"]) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=60) as c:
        for kind in ("warmup", "text", "image"):
            bodies = [body(i, kind == "image") for i in range(n)]    # built before the clock starts
            cpu0, steal0, t0 = cpu_s(srv.pid), steal_s(), time.monotonic()
            for b in bodies:
                r = c.post("/v1/chat/completions", json=b)
                r.raise_for_status()
            cpu, steal, wall = cpu_s(srv.pid) - cpu0, steal_s() - steal0, time.monotonic() - t0
            if kind != "warmup":
                out[kind] = {"requests": n, "server_cpu_ms_per_request": round(1e3 * cpu / n, 3),
                             "wall_ms_per_request": round(1e3 * wall / n, 3), "steal_s": round(steal, 3),
                             "prompt_tokens": r.json()["usage"]["prompt_tokens"]}
    out["image_cost_cpu_ms"] = round(out["image"]["server_cpu_ms_per_request"]
                                     - out["text"]["server_cpu_ms_per_request"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sides", default="224,448,672,896,1344,1792", help="square image sides in pixels")
    ap.add_argument("--video", default="448x448x120", help="one video row: WIDTHxHEIGHTxFRAMES at 30 fps ('': none)")
    ap.add_argument("--cpu-requests", type=int, default=40, help="requests per kind for the CPU cost (0: skip)")
    ns = ap.parse_args()
    sides = [int(x) for x in ns.sides.split(",") if x.strip()]
    video = tuple(int(x) for x in ns.video.split("x")) if ns.video else None
    rows = ttft_rows(sides, video)
    print(f"{'gpu':<6}{'image px':>22}{'img tok':>9}{'prompt':>8}{'TTFT ms':>10}{'roofline ms':>13}{'TTFT/roof':>11}"
          f"{'encoder ms':>12}{'enc roof ms':>13}{'LM roof ms':>12}")
    for r in rows:
        print(f"{r['gpu']:<6}{r['image_px'] or 'none':>22}{r['image_tokens']:>9}{r['prompt_tokens']:>8}"
              f"{r['ttft_ms']:>10.2f}{r['roofline_ms']:>13.2f}{r['ttft_over_roofline']:>11.2f}{r['encoder_ms']:>12.2f}"
              f"{r['encoder_roofline_ms']:>13.2f}{r['lm_prefill_roofline_ms']:>12.2f}")
    cpu = cpu_rows(ns.cpu_requests) if ns.cpu_requests > 0 else None
    if cpu is not None:
        print(f"\nserver CPU per request (non-streamed chat, 1 output token, {ns.cpu_requests} each):")
        for kind in ("text", "image"):
            c = cpu[kind]
            print(f"  {kind:<6} {c['server_cpu_ms_per_request']:8.2f} ms CPU  {c['wall_ms_per_request']:8.2f} ms wall  "
                  f"prompt {c['prompt_tokens']} tokens  steal {c['steal_s']:.2f} s")
        print(f"  one 896x896 PNG costs {cpu['image_cost_cpu_ms']:.2f} ms of server CPU")
    path = write_result("mm_ttft", {"model": MODEL, "rows": rows, "server_cpu": cpu,
                                    "public_figures": "none found for per-image-size TTFT on these GPUs"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
