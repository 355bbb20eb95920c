"""Every bundled model on H100, H200, B200 and MI300X: decode TPOT at batch 1 / 32 / 256 and prefill tokens/s,
each beside its physical bound.

Per GPU, a model runs at the smallest tensor-parallel size (1, 2, 4, 8) whose weights and one max-length request
(max_model_len 4096) fit, as ``vllm serve`` would need. TPOT is the simulated time of one decode-only step with
every sequence at a 2,048-token context; prefill tokens/s is 4,096 / the time of one step that prefills a
4,096-token prompt from scratch. The bound beside each is the same step's kernels at their roofline (peak
FLOP/s or memory bandwidth, whichever binds, with wave quantization; no η, no fixed latencies, launch, host or
collectives): no implementation on that GPU can beat it with this decomposition. A model the kernel model
cannot price (NVFP4) is listed with the reason. Public figures: none are quoted (the column is left
empty rather than filled with numbers we cannot cite for these exact shapes).
Writes benchmarks/results/model_table.json.
Usage: python benchmarks/model_table.py [--hardware h100,h200,b200,mi300x] [--models ID,...]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import steal_s, write_result  # noqa: E402

from kernelsight import profiles  # noqa: E402
from kernelsight.engine_args import create_engine_config  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.simcore.engine_config import EngineArgs, build_step_model  # noqa: E402
from kernelsight.simcore.kernels import BatchShape, PrefillChunk, decompose_step  # noqa: E402
from kernelsight.simcore.roofline import kernel_roofline_s  # noqa: E402

BATCHES = (1, 32, 256)
CONTEXT_TOKENS = 2048
PREFILL_TOKENS = 4096
TP_CHOICES = (1, 2, 4, 8)


def fitting_config(model: str, hardware: str):
    """(config, None) at the smallest TP that fits, or (None, why not)."""
    why = ""
    for tp in TP_CHOICES:
        try:
            return create_engine_config(EngineArgs(model=model, hardware=hardware, tensor_parallel_size=tp,
                                                   max_model_len=4096, max_num_seqs=256)), ""
        except ValueError as exc:
            why = str(exc).splitlines()[0]
            if "memory" not in why.lower() and "Model weights" not in why and "KV cache" not in why:
                return None, why          # not a size problem: more GPUs will not help
    return None, f"does not fit on {TP_CHOICES[-1]} GPUs"


def kv_fits(cfg, batch: int, context: int) -> bool:
    """Whether ``batch`` sequences of ``context`` tokens fit the KV cache (a hybrid model's sliding-window group
    holds only the window's blocks)."""
    bs = cfg.scheduler.block_size
    per_seq = math.ceil((context + 1) / bs)
    if cfg.model.is_hybrid_attention:
        per_seq += math.ceil(cfg.model.sliding_window / bs) + 1
    return batch <= cfg.scheduler.max_num_seqs and batch * per_seq <= cfg.num_gpu_blocks


def step_and_bound_s(sm, cfg, batch: BatchShape) -> tuple[float, float]:
    tp = cfg.args.tensor_parallel_size
    _, padded = sm.graph_mode(batch)
    bound = sum(kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, cfg.hardware) * k.count
                for k in decompose_step(cfg.model, batch, tp, cfg.precision, padded))
    return sm.step_time_s(batch), bound


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hardware", default="h100,h200,b200,mi300x")
    ap.add_argument("--models", default=",".join(profiles.list_models()))
    ns = ap.parse_args()
    t0, steal0 = time.perf_counter(), steal_s()
    rows, out = [], []
    for model in ns.models.split(","):
        for hw in ns.hardware.split(","):
            cfg, why = fitting_config(model, hw)
            if cfg is None:
                note = why.replace(f"model {model!r}: ", "").split("; supported architectures")[0]
                rows.append([model, hw, "-", "", "", "", "", "", note[:110]])
                out.append({"model": model, "hardware": hw, "supported": False, "why": why})
                continue
            sm = build_step_model(cfg)
            rec = {"model": model, "hardware": hw, "supported": True, "tp": cfg.args.tensor_parallel_size,
                   "tier": cfg.calibration.tier, "tpot_ms": {}, "tpot_bound_ms": {}, "public": None}
            cells = []
            for b in BATCHES:
                if not kv_fits(cfg, b, CONTEXT_TOKENS):
                    cells.append("KV full")
                    continue
                t, bound = step_and_bound_s(sm, cfg, BatchShape((), b, b * CONTEXT_TOKENS))
                rec["tpot_ms"][b], rec["tpot_bound_ms"][b] = t * 1e3, bound * 1e3
                cells.append(f"{t * 1e3:.2f} ({bound * 1e3:.2f})")
            t, bound = step_and_bound_s(sm, cfg, BatchShape((PrefillChunk(PREFILL_TOKENS, 0, True),)))
            rec["prefill_tok_s"], rec["prefill_bound_tok_s"] = PREFILL_TOKENS / t, PREFILL_TOKENS / bound
            rows.append([model, hw, str(cfg.args.tensor_parallel_size), *cells,
                         f"{PREFILL_TOKENS / t:,.0f} ({PREFILL_TOKENS / bound:,.0f})", "", ""])
            out.append(rec)
    headers = ["model", "GPU", "TP", *(f"TPOT b={b} ms (bound)" for b in BATCHES), "prefill tok/s (bound)",
               "public", "note"]
    print(format_table([dict(zip(headers, r, strict=True)) for r in rows], headers))
    wall, steal = time.perf_counter() - t0, steal_s() - steal0
    print(f"\nwall {wall:.1f} s, steal {steal:.2f} s (CPU time taken by other guests during the run)")
    path = write_result("model_table", {"context_tokens": CONTEXT_TOKENS, "prefill_tokens": PREFILL_TOKENS,
                                        "rows": out, "wall_s": wall, "steal_s": steal})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
