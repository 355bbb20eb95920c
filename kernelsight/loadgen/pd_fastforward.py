"""Fast-forward of a prefill/decode-disaggregated deployment (``kernelsight simulate --pd 2P3D``): X prefill and Y
decode engines of one configuration behind vLLM's toy-proxy semantics, on one virtual clock.

Each request goes to a prefill engine (round robin) with ``max_tokens`` 1 and its blocks held
(``do_remote_decode``); when it finishes, the proxy sends it to a decode engine (round robin) at that instant, which
pulls the prompt's KV over the link (``simcore/kv_transfer.py``), computes the last prompt token and decodes; the
pull's end frees the prefill engine's blocks. The client's TTFT is the decode engine's first token: prefill (with
its queueing) + the pull (with any wait for decode blocks) + the first decode step. A prefill that ends on EOS
returns no parameters (vLLM frees at once): its decode engine then prefills locally, as behind vLLM's proxy.

The engines are stepped in order of their next event (the one furthest behind first, prefill engines first at a
tie); a decode engine's decode windows are cut at the earliest time a prefill engine could still hand it a request,
so no decode engine runs ahead past an arrival it has not seen yet.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelsight.loadgen.datasets import SampleRequest
from kernelsight.loadgen.fastforward import MAX_WINDOW_STEPS, FastForwardResult, _record, _Sender, offload_summary
from kernelsight.loadgen.pd_stages import ttft_stages
from kernelsight.simcore.engine import FINISHED, Engine
from kernelsight.simcore.engine_config import EngineConfig, build_engine
from kernelsight.simcore.kernels import FAMILIES
from kernelsight.simcore.kv_transfer import KVLink
from kernelsight.simcore.request import Request

_PD_RE = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)
#: Columns of the per-instance table of a P/D run (``simulator.pd_instances``).
PD_COLUMNS = ("instance", "requests", "steps", "busy_s", "preemptions", "peak_kv_%", "pulls", "mean_pull_ms",
              "mean_kv_wait_ms")


def parse_pd(text: str) -> tuple[int, int]:
    """``XPyD`` (e.g. ``1P1D``, ``2P3D``) → (X, Y), both ≥ 1."""
    m = _PD_RE.match(text.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--pd takes XPyD with X, Y >= 1 (e.g. 1P1D, 2P3D), got {text!r}")
    return int(m.group(1)), int(m.group(2))


@dataclass
class _Instance:
    role: str                        # "P" | "D"
    index: int
    engine: Engine
    ends: list[float]
    requests: int = 0
    peak_kv: float = 0.0
    kv_wait_s: float = 0.0           # decode: Σ (KV in place − arrival): the pull and any wait for blocks
    stalled: bool = False            # prefill: every block held for decode engines; waits for a pull

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    def next_event_s(self) -> float:
        if self.stalled:
            return math.inf
        e = self.engine
        if e.num_running or e.num_waiting:
            return e.now_s
        nxt = e.next_arrival_s
        return math.inf if nxt is None else max(nxt, e.now_s)

    def summary(self) -> dict[str, Any]:
        e = self.engine
        out: dict[str, Any] = {"instance": self.name, "requests": self.requests, "steps": e.stats.num_steps,
                               "busy_s": round(float(e.stats.busy_s), 4), "preemptions": e.stats.num_preemptions,
                               "peak_kv_usage": round(self.peak_kv, 5), "held_at_end": e.num_held,
                               "blocks_in_use_at_end": e.kv.pool.num_blocks - 1 - e.kv.num_free_blocks}
        if self.role == "D":
            n = e.num_pulls
            out.update(pulls=n, kv_transfer_s=round(e.pull_s_total, 6),
                       mean_pull_ms=round(1e3 * e.pull_s_total / n, 3) if n else 0.0,
                       mean_kv_wait_ms=round(1e3 * self.kv_wait_s / n, 3) if n else 0.0)
        return out


def run_pd(config: EngineConfig, samples: Sequence[SampleRequest], arrivals_s: Sequence[float], num_prefill: int,
           num_decode: int, *, link: KVLink | None = None, max_concurrency: int | None = None,
           ignore_eos: bool = True, on_finished: Callable[[int], None] | None = None) -> FastForwardResult:
    """Simulate ``samples`` sent at ``arrivals_s`` through ``num_prefill`` prefill and ``num_decode`` decode engines
    of ``config`` (KV pulled over ``link``; default: the GPU profile's) and measure every request at the client."""
    if len(samples) != len(arrivals_s):
        raise ValueError("one arrival time per sample is required")
    wall0 = time.perf_counter()
    prefill = [_Instance("P", i, build_engine(config, per_token_events=False, link=link), [])
               for i in range(num_prefill)]
    decode = [_Instance("D", i, build_engine(config, per_token_events=False, link=link), [])
              for i in range(num_decode)]
    owner: dict[str, _Instance] = {}          # request id -> the instance whose events it is in now
    arrived: dict[str, float] = {}            # request id -> its arrival at the decode engine
    # each request as the prefill and the decode engine recorded it: its TTFT by stage (pd_stages.py)
    sides: dict[str, list[Request]] = {}
    rr = {"P": 0, "D": 0}

    def pick(role: str) -> _Instance:
        group = prefill if role == "P" else decode
        inst = group[rr[role] % len(group)]
        rr[role] += 1
        inst.requests += 1
        inst.stalled = False
        return inst

    def to_prefill(rid: str, prompt: Any, max_tokens: int, *, ignore_eos: bool, arrival_s: float) -> None:
        inst = pick("P")
        owner[rid] = inst
        inst.engine.add_request(rid, prompt, 1, ignore_eos=ignore_eos, arrival_s=arrival_s, hold_kv=True)
        sides[rid] = [inst.engine.get_request(rid)]

    sender = _Sender(samples, arrivals_s, max_concurrency, to_prefill, ignore_eos)
    trackers, send = sender.trackers, sender.send
    send(0.0)
    everyone = prefill + decode
    while True:
        nxt = min(everyone, key=lambda x: (x.next_event_s(), x.role != "P"))
        until: float | None = None
        if nxt.next_event_s() == math.inf:
            stalled = [p for p in prefill if p.stalled]
            if stalled:           # no decode engine will pull: the abort timeout frees the blocks
                nxt = stalled[0]
                nxt.stalled = False
            elif not sender.pending:
                break
            else:
                send(max(x.engine.now_s for x in everyone))     # only reachable with nothing in flight
                continue
        else:
            # a decode engine runs no window past the earliest moment a prefill engine could hand it work, and a
            # prefill engine no further than the earliest moment a decode engine could free its blocks
            until = min((x.next_event_s() for x in (prefill if nxt.role == "D" else decode)), default=math.inf)
        res = nxt.engine.step(max_steps=MAX_WINDOW_STEPS, until_s=None if until == math.inf else until)
        if res is None:
            if nxt.role == "P":
                nxt.stalled = True
            continue
        nxt.ends.extend(res.step_end_s)
        nxt.peak_kv = max(nxt.peak_kv, res.kv_usage)
        if nxt.role == "P":
            for ev in res.events:
                if ev.kind == FINISHED:
                    d_req = _prefill_done(ev.request_id, ev.finish_reason, nxt.ends[ev.step_index], nxt, pick, owner,
                                          arrived, trackers, sender)
                    if d_req is not None:
                        sides[ev.request_id].append(d_req)
            continue
        for rid, ready_s in nxt.engine.take_pulled():
            nxt.kv_wait_s += ready_s - arrived.pop(rid, ready_s)
            src = owner.get(rid)
            if src is not None and src.role == "P":
                src.engine.release_held(rid, at_s=ready_s)      # NIXL's notification: the prefill side frees
                src.stalled = False
                owner[rid] = nxt
        n_before = sender.in_flight
        if sender.take_events(res.events, nxt.index) and sender.pending:
            send(res.end_s)
        if on_finished is not None and sender.in_flight < n_before:
            on_finished(n_before - sender.in_flight)

    end_s = max(x.engine.now_s for x in everyone)
    for p in prefill:             # pulls announced for after a prefill engine's last step free their blocks now
        p.engine.free_expired(end_s)
    ends = [np.asarray(d.ends) for d in decode]
    gaps = [np.diff(e) for e in ends]
    records, reasons = [], {}
    for tr in trackers.values():
        reasons[tr.finish_reason] = reasons.get(tr.finish_reason, 0) + 1
        records.append(_record(tr, ends[tr.rank], gaps[tr.rank]))
    engines = [x.engine for x in everyone]
    hits = sum(e.kv.prefix_hits_tokens for e in engines)
    queries = sum(e.kv.prefix_queries_tokens for e in engines)
    breakdown = sum((e.stats.breakdown_s for e in engines), np.zeros(len(FAMILIES)))
    duration = max((r.start_s + r.latency_s for r in records if r.success), default=0.0)
    lk = decode[0].engine.kv_transfer.link
    stages = ttft_stages((v[0], v[1]) for v in sides.values() if len(v) == 2)
    return FastForwardResult(
        records=records, duration_s=duration, wall_s=time.perf_counter() - wall0,
        num_steps=sum(e.stats.num_steps for e in engines),
        breakdown_s=dict(zip(FAMILIES, breakdown.tolist(), strict=True)),
        num_preemptions=sum(e.stats.num_preemptions for e in engines),
        prefix_cache_hit_rate=hits / queries if queries else 0.0, finish_reasons=reasons, timeline=None,
        pd={"prefill": num_prefill, "decode": num_decode,
            "link": {"kind": lk.kind, "bytes_per_s": lk.bytes_per_s, "latency_s": lk.latency_s},
            "instances": [x.summary() for x in everyone], "ttft_stages": stages.summary()},
        pd_stages=stages, kv_offload=offload_summary(engines))


def _prefill_done(rid: str, reason: str | None, at_s: float, inst: _Instance, pick: Callable[[str], _Instance],
                  owner: dict[str, _Instance], arrived: dict[str, float], trackers: dict,
                  sender: _Sender) -> Request | None:
    """The proxy's second leg: the prefill engine answered at ``at_s``; send the request to a decode engine then.
    Returns the decode engine's request (None: aborted, not sent)."""
    tr = trackers[rid]
    if reason == "abort":
        tr.finished, tr.finish_reason = True, "abort"
        sender.in_flight -= 1
        return None
    remote = inst.engine.held_block_ids(rid) is not None     # None: it ended on EOS, nothing kept, no params
    d = pick("D")
    tr.rank = d.index
    s = tr.sample
    prompt = s.token_array if s.token_array is not None else s.prompt_token_ids
    d.engine.add_request(rid, prompt, s.expected_output_len, ignore_eos=sender.ignore_eos, arrival_s=at_s,
                         remote_prefill=remote)
    if remote:
        arrived[rid] = at_s
    else:
        owner[rid] = d
    return d.engine.get_request(rid)
