"""Price a measured run's own work with the step model, tick by tick: where is the simulated step missing time?

The replay (``validate.py``) compounds every error through the scheduler: a step 8% too fast drains the queue
early, and TTFT errors grow to 25%. This instead prices exactly the work the measured run did in each tick of its
timeseries — its decode steps at the measured batch size and contexts, its prompt tokens as prefill chunks beside
them — and divides by the tick's length. On a tick where the GPU was never idle the answer should be 1.0; 0.9 says
the step model is 10% fast *for that kind of work*. Grouped by tick kind (decode-only or mixed, small or large
batch) and split by least squares into a decode part and a prefill part, it tells a missing per-step or
per-decode cost from a missing per-prefill-token one, on any run in the shared e2e schema.

What a run records is coarse, so the work of a tick is reconstructed, and the approximations are:

* the requests' clock and the timeseries' clock share their origin at the first request's queue time, up to an
  offset (``clock_offset_s``) found by matching the timeseries' running and waiting counts with the requests' own:
  a scraper reads the counters a fraction of a tick off the tick's label (0.1 s early on the shared PRO 6000 run),
  and where the batch drains fast, at a run's end, that fraction decides how many requests a tick's tokens came from;
* a request decodes from its first to its last token, and its context grows linearly in between;
* decode steps in a tick = generated tokens ÷ time-averaged decoding requests (every step yields one token per
  decoding request);
* a tick's prompt tokens run as chunks of the mean prompt length of the requests whose first token falls in the
  tick (vLLM schedules a waiting prompt whole when the token budget allows), at most the budget the decodes leave,
  each chunk priced as its marginal cost beside the tick's decode batch (nothing cached: prefix hits are ignored);
* a tick counts as busy when decoding requests cover all of it (with async scheduling the GPU then never idles);
* the longest contexts a step model asks for (``decode_top_k``) are those of the requests decoding at mid-tick.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelsight.simcore.kernels import BatchShape, PrefillChunk
from kernelsight.simcore.step_model import StepModel

__all__ = ["TickWork", "clock_offset_s", "decode_step_rows", "tick_work", "price_ticks", "summarize_pricing",
           "price_run_work"]

#: Batch-size groups as fractions of ``max_num_seqs``: (label, lower bound inclusive, upper bound exclusive).
#: How many of the longest contexts a tick keeps (the step model takes the first ``decode_top_k``).
TOP_CONTEXTS = 128

BATCH_GROUPS = (("batch < 25% of max_num_seqs", 0.0, 0.25), ("batch 25-75%", 0.25, 0.75),
                ("batch >= 75%", 0.75, float("inf")))


@dataclass(frozen=True, slots=True)
class TickWork:
    """The work one measured tick did, as far as the run records it."""
    t_end_s: float              # end of the tick, seconds from the run start
    tick_s: float
    decoding: float             # time-averaged number of requests between their first and last token
    mean_context_tokens: float  # their mean context (prompt + tokens generated so far), time-weighted
    gen_tokens: float
    prompt_tokens: float
    chunk_tokens: int           # prefill chunk size the prompt tokens are priced at
    busy: bool                  # decoding requests cover the whole tick
    top_contexts: tuple[int, ...] = ()   # the longest contexts of the requests decoding at mid-tick, longest first


def _covered(intervals: list[tuple[float, float]], a: float, b: float) -> bool:
    """Whether the union of ``intervals`` covers [a, b]."""
    reach = a
    for lo, hi in sorted(intervals):
        if lo > reach:
            return False
        reach = max(reach, hi)
        if reach >= b:
            return True
    return reach >= b


#: Offsets tried, as fractions of a tick on either side of zero.
OFFSET_STEPS = 100


def clock_offset_s(requests: Sequence[Any], timeseries: Mapping[str, np.ndarray], tick_s: float) -> float:
    """Seconds to add to a tick's label to put it on the requests' clock (origin: the first queue time).

    The offset within one tick either way that best matches the timeseries' ``running`` (and ``waiting``) gauges
    with the requests' own counts at that instant: running from (first) scheduling to the last token, waiting from
    queueing to scheduling (a request without ``scheduled_s`` counts as running from its first token). Preempted
    requests make neither count exact; the best match still places the ticks. 0 without a ``running`` column."""
    running = timeseries.get("running")
    if not requests or running is None or not len(running):
        return 0.0
    t0 = min(r.queued_s for r in requests)
    sched = np.sort([(r.scheduled_s if r.scheduled_s is not None else r.first_token_s) - t0 for r in requests])
    last = np.sort([r.last_token_s - t0 for r in requests])
    queued = np.sort([r.queued_s - t0 for r in requests])
    waiting = timeseries.get("waiting")
    t = np.asarray(timeseries["t"], dtype=float)
    best, best_err = 0.0, math.inf
    for i in range(-OFFSET_STEPS, OFFSET_STEPS + 1):
        delta = tick_s * i / OFFSET_STEPS
        x = t + delta
        n_sched = np.searchsorted(sched, x, side="right")
        err = float(np.abs(n_sched - np.searchsorted(last, x, side="right") - running).sum())
        if waiting is not None:
            err += float(np.abs(np.searchsorted(queued, x, side="right") - n_sched - waiting).sum())
        if err < best_err - 1e-9 or (abs(err - best_err) <= 1e-9 and abs(delta) < abs(best)):
            best, best_err = delta, err
    return best


def tick_work(requests: Sequence[Any], timeseries: Mapping[str, np.ndarray], tick_s: float,
              max_num_batched_tokens: int, offset_s: float = 0.0) -> list[TickWork]:
    """Each tick's decode batch, contexts, generated and prompt tokens (``requests``: ``validate.MeasuredRequest``;
    ``offset_s``: :func:`clock_offset_s`)."""
    if not requests:
        return []
    t0 = min(r.queued_s for r in requests) + offset_s
    first = np.array([r.first_token_s for r in requests])
    last = np.array([r.last_token_s for r in requests])
    inp = np.array([r.input_toks for r in requests], dtype=float)
    out = np.array([r.output_toks for r in requests], dtype=float)
    gen = timeseries.get("gen_throughput")
    prompt = timeseries.get("prompt_throughput")
    if gen is None:
        return []
    ticks = []
    for i, t_end in enumerate(timeseries["t"]):
        a, b = t0 + float(t_end) - tick_s, t0 + float(t_end)
        lo, hi = np.maximum(first, a), np.minimum(last, b)
        sel = hi > lo
        w = (hi[sel] - lo[sel]) / tick_s
        span = np.maximum(last[sel] - first[sel], 1e-12)
        frac = np.clip((0.5 * (lo[sel] + hi[sel]) - first[sel]) / span, 0.0, 1.0)
        ctx = inp[sel] + frac * out[sel]
        decoding = float(w.sum())
        mean_ctx = float((w * ctx).sum() / decoding) if decoding > 0 else 0.0
        p_tokens = float(prompt[i]) * tick_s if prompt is not None else 0.0
        started = (first > a) & (first <= b)      # ticks are (a, b]: t is the end of each
        chunk = float(inp[started].mean()) if started.any() else p_tokens
        room = max(1, max_num_batched_tokens - round(decoding))
        chunk_tokens = int(min(max(chunk, 1.0), room))
        busy = _covered(list(zip(first[sel].tolist(), last[sel].tolist(), strict=True)), a, b)
        mid = 0.5 * (a + b)
        alive = (first <= mid) & (last > mid)
        ctx_mid = inp[alive] + np.clip((mid - first[alive]) / np.maximum(last[alive] - first[alive], 1e-12),
                                       0.0, 1.0) * out[alive]
        top = tuple(int(round(c)) for c in np.sort(ctx_mid)[::-1][:TOP_CONTEXTS])
        ticks.append(TickWork(float(t_end), tick_s, decoding, mean_ctx, float(gen[i]) * tick_s, p_tokens,
                              chunk_tokens, busy, top))
    return ticks


def price_ticks(ticks: Sequence[TickWork], step_model: StepModel) -> list[dict[str, Any]]:
    """Per tick: seconds the step model gives its decode steps and its prefill chunks, and their sum ÷ tick."""
    rows = []
    for w in ticks:
        n = round(w.decoding)
        decode_s = prefill_s = 0.0
        steps = 0.0
        graph_batch = None
        top = w.top_contexts[:getattr(step_model, "decode_top_k", 0)]
        if n >= 1 and w.gen_tokens > 0:
            steps = w.gen_tokens / w.decoding
            ctx_total = int(round(n * w.mean_context_tokens))
            decode = BatchShape((), n, ctx_total, decode_context_top=top)
            t_dec = step_model.step_time_s(decode)
            decode_s = steps * t_dec
            graph_batch = step_model.graph_mode(decode)[1]
        else:
            t_dec, ctx_total = 0.0, 0
        if w.prompt_tokens > 0:
            mixed = BatchShape((PrefillChunk(w.chunk_tokens, 0, True),), n, ctx_total, decode_context_top=top)
            prefill_s = w.prompt_tokens / w.chunk_tokens * (step_model.step_time_s(mixed) - t_dec)
        rows.append({"t_end_s": w.t_end_s, "busy": w.busy, "decoding": round(w.decoding, 2), "graph_batch": graph_batch,
                     "mean_context_tokens": round(w.mean_context_tokens, 1), "gen_tokens": w.gen_tokens,
                     "prompt_tokens": w.prompt_tokens, "decode_steps": round(steps, 2),
                     "decode_priced_s": round(decode_s, 6), "prefill_priced_s": round(prefill_s, 6),
                     "priced_per_s": round((decode_s + prefill_s) / w.tick_s, 4)})
    return rows


def _group(label: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    r = np.array([x["priced_per_s"] for x in rows])
    return {"ticks": label, "count": len(rows),
            "mean": round(float(r.mean()), 4) if len(r) else None,
            "median": round(float(np.median(r)), 4) if len(r) else None,
            "std": round(float(r.std()), 4) if len(r) else None}


def summarize_pricing(rows: Sequence[dict[str, Any]], max_num_seqs: int, tick_s: float) -> dict[str, Any]:
    """Busy ticks grouped (all, decode-only, mixed, by batch size), and the least-squares split
    ``tick_s ≈ a · decode_priced_s + b · prefill_priced_s``: a, b > 1 say that part is priced too fast."""
    busy = [r for r in rows if r["busy"] and r["decode_steps"] > 0]
    groups = [_group("busy, all", busy), _group("busy, decode only", [r for r in busy if r["prompt_tokens"] == 0]),
              _group("busy, with prefill", [r for r in busy if r["prompt_tokens"] > 0])]
    for label, lo, hi in BATCH_GROUPS:
        groups.append(_group(f"busy, {label}", [r for r in busy if lo <= r["decoding"] / max_num_seqs < hi]))
    split = None
    if len(busy) >= 3 and sum(r["prefill_priced_s"] > 0 for r in busy) >= 2:
        x = np.array([[r["decode_priced_s"], r["prefill_priced_s"]] for r in busy])
        y = np.full(len(busy), tick_s)
        (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
        resid = y - x @ np.array([a, b])
        split = {"decode_scale": round(float(a), 4), "prefill_scale": round(float(b), 4),
                 "rms_residual_s": round(float(np.sqrt(np.mean(resid ** 2))), 4), "ticks": len(busy)}
    return {"groups": groups, "split": split}


def decode_step_rows(rows: Sequence[dict[str, Any]], tick_s: float) -> list[dict[str, Any]]:
    """Busy decode-only ticks as one decode step each: measured vs priced step time by batch size and context.

    A tick without prompt tokens ran ``decode_steps`` steps of its batch, so its step took tick ÷ steps; laid out
    by batch size this shows how the step grows with the batch (weights read once, KV cache per sequence), which
    a single ratio hides. ``graph_batch``: the rows a decode step of that batch runs (its CUDA graph's padded batch:
    the GEMMs' m), beside which an error that follows the GEMMs' m rather than the KV bytes shows."""
    out = []
    for r in rows:
        if r["busy"] and r["prompt_tokens"] == 0 and r["decode_steps"] > 0:
            measured = tick_s / r["decode_steps"]
            priced = r["decode_priced_s"] / r["decode_steps"]
            out.append({"t_end_s": r["t_end_s"], "batch": r["decoding"], "graph_batch": r.get("graph_batch"),
                        "mean_context": r["mean_context_tokens"],
                        "measured_step_ms": round(1e3 * measured, 3), "priced_step_ms": round(1e3 * priced, 3),
                        "priced_over_measured": round(priced / measured, 4)})
    return sorted(out, key=lambda x: x["batch"])


def price_run_work(requests: Sequence[Any], timeseries: Mapping[str, np.ndarray], tick_s: float,
                   step_model: StepModel, max_num_seqs: int, max_num_batched_tokens: int) -> dict[str, Any]:
    """The whole analysis: per-tick rows, their summary, the decode-only steps by batch, JSON-ready."""
    offset_s = clock_offset_s(requests, timeseries, tick_s)
    rows = price_ticks(tick_work(requests, timeseries, tick_s, max_num_batched_tokens, offset_s), step_model)
    return {"clock_offset_s": round(offset_s, 4), "ticks": rows, **summarize_pricing(rows, max_num_seqs, tick_s),
            "decode_steps": decode_step_rows(rows, tick_s)}
