"""Where a P/D request's time to first token goes: five consecutive stages, read from the prefill and the decode
engine's own records of the request (``simcore.request.Request`` timestamps), so they add up to the client's TTFT.

- ``prefill_queue``: sent → first scheduled on the prefill engine (its queue, and the rest of a step in flight)
- ``prefill``: → the prefill's last step ends (its chunks, with whatever shares those steps)
- ``kv_ready``: the proxy hands it to a decode engine → the pulled KV is in place (the decode engine starts the pull
  at its next step, once it has free blocks; then the pull itself)
- ``step_after_pull``: → first scheduled on the decode engine (the step the pull ended in runs to its end, as vLLM's
  scheduler learns of finished receives only after a step)
- ``first_decode_step``: → the step that computes the last prompt token and samples the first token ends

A long p99 TTFT with a short pull is then plainly the prefill side's queue, or plainly not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kernelsight.simcore.request import Request

STAGES = ("prefill_queue", "prefill", "kv_ready", "step_after_pull", "first_decode_step")
#: Columns of the printed stage table (``simulator.pd.ttft_stages``).
STAGE_COLUMNS = ("stage", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "slowest_1%_mean_ms")


@dataclass(slots=True)
class TTFTStages:
    """Per request (``request_ids[i]``) the seconds spent in each of :data:`STAGES`."""

    request_ids: list[str]
    seconds: dict[str, np.ndarray]

    def total_s(self) -> np.ndarray:
        return sum((self.seconds[s] for s in STAGES), np.zeros(len(self.request_ids)))

    def summary(self) -> dict:
        """Per stage: mean and percentiles in ms, and its mean over the slowest 1% of requests by TTFT (what the
        p99 is made of)."""
        n = len(self.request_ids)
        if n == 0:
            return {"requests": 0, "stages": []}
        slow = np.argsort(self.total_s())[-max(1, n // 100):]
        rows = []
        for s in (*STAGES, "ttft"):
            v = 1e3 * (self.total_s() if s == "ttft" else self.seconds[s])
            p50, p90, p99 = np.percentile(v, [50, 90, 99])
            rows.append({"stage": s, "mean_ms": round(float(v.mean()), 3), "p50_ms": round(float(p50), 3),
                         "p90_ms": round(float(p90), 3), "p99_ms": round(float(p99), 3),
                         "slowest_1%_mean_ms": round(float(v[slow].mean()), 3)})
        return {"requests": n, "stages": rows}


def ttft_stages(pairs: Iterable[tuple[Request, Request]]) -> TTFTStages:
    """The stages of each (prefill-side, decode-side) pair of one request that pulled its KV and has a first token."""
    ids: list[str] = []
    cols: list[tuple[float, ...]] = []
    for p, d in pairs:
        if d.kv_ready_s is None or d.first_token_s is None or p.first_token_s is None:
            continue          # no pull (a prefill that ended on EOS), or not answered (aborted)
        assert p.first_scheduled_s is not None and d.first_scheduled_s is not None
        ids.append(p.request_id)
        cols.append((p.first_scheduled_s - p.arrival_s, p.first_token_s - p.first_scheduled_s,
                     d.kv_ready_s - d.arrival_s, d.first_scheduled_s - d.kv_ready_s,
                     d.first_token_s - d.first_scheduled_s))
    arr = np.asarray(cols, dtype=np.float64).reshape(len(cols), len(STAGES))
    return TTFTStages(ids, {s: arr[:, i] for i, s in enumerate(STAGES)})
