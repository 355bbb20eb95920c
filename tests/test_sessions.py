"""Multi-turn sessions (``--num-sessions``): the sessions drawn, how each turn's prompt grows from the last, the
session concurrency limit, and the per-turn report of ``simulate``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kernelsight.cli import build_parser, main
from kernelsight.engine_args import create_engine_config, engine_args_from
from kernelsight.loadgen.fastforward import run_fast_forward
from kernelsight.loadgen.metrics import RequestRecord
from kernelsight.loadgen.session_fastforward import _SessionSender, run_sessions
from kernelsight.loadgen.session_metrics import prefix_cache_stats, turn_stats
from kernelsight.loadgen.sessions import Session, SessionWorkload, Turn, sharegpt_sessions, synthetic_sessions
from kernelsight.loadgen.tokenizer import ByteTokenizer
from kernelsight.loadgen.workload import build_workload

TOK = ByteTokenizer()


def _ns(cmd: str, *argv: str):
    return build_parser().parse_args([cmd, *argv])


def test_synthetic_sessions_follow_the_flags_and_the_seed():
    kw = {"turns_mean": 4, "turns_stddev": 0, "delay_mean_ms": 250, "delay_stddev_ms": 0, "input_len": 50,
          "output_len": 20, "range_ratio": 0.0, "vocab_size": 128256, "prefix_len": 32}
    a = synthetic_sessions(5, seed=3, **kw)
    assert [len(s.turns) for s in a] == [4] * 5
    assert all(t.delay_s == (0.25 if k else 0.0) for s in a for k, t in enumerate(s.turns))
    assert all(t.output_len == 20 for s in a for t in s.turns)
    # the first turn carries the shared system prompt; later turns only their 50 new tokens
    assert all(len(s.turns[0].user_ids) == 82 and len(s.turns[1].user_ids) == 50 for s in a)
    assert all(np.array_equal(s.turns[0].user_ids[:32], a[0].turns[0].user_ids[:32]) for s in a)
    assert not np.array_equal(a[0].turns[0].user_ids[32:], a[1].turns[0].user_ids[32:])
    b = synthetic_sessions(5, seed=3, **kw)
    assert all(np.array_equal(x.user_ids, y.user_ids) for s, r in zip(a, b, strict=True)
               for x, y in zip(s.turns, r.turns, strict=True))
    spread = synthetic_sessions(200, seed=1, **{**kw, "turns_stddev": 2, "delay_stddev_ms": 100})
    counts = [len(s.turns) for s in spread]
    assert min(counts) >= 1 and len(set(counts)) > 3 and abs(np.mean(counts) - 4) < 0.5
    assert all(t.delay_s >= 0 for s in spread for t in s.turns)
    # a session ends before its history reaches the context
    capped = synthetic_sessions(3, seed=3, max_context=200, **kw)
    assert all(len(s.turns) == 2 for s in capped)    # 82+20 = 102, +70 = 172, +70 = 242 ≥ 200


def test_sharegpt_conversations_become_sessions(tmp_path):
    conv = [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi, how can I help?"},
            {"from": "human", "value": "tell me more"}, {"from": "gpt", "value": "sure thing"},
            {"from": "human", "value": "unanswered"}]
    data = [{"conversations": conv}, {"conversations": [{"from": "gpt", "value": "no human"}]},
            {"conversations": [{"from": "system", "value": "sys"}] + conv[:2]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    s = sharegpt_sessions(path, 10, TOK, seed=0, delay_mean_ms=1000)
    assert sorted(len(x.turns) for x in s) == [1, 2]
    two = next(x for x in s if len(x.turns) == 2)
    assert [t.user_text for t in two.turns] == ["hello there", "tell me more"]
    assert [t.output_len for t in two.turns] == [len("hi, how can I help?"), len("sure thing")]
    assert two.turns[1].delay_s == 1.0 and two.turns[0].delay_s == 0.0
    assert list(two.turns[1].user_ids) == TOK.encode("tell me more", add_special_tokens=False)


def test_session_flags_reach_the_workload_in_both_commands():
    argv = ["--num-sessions", "6", "--session-concurrency", "2", "--session-turns-mean", "3",
            "--session-turn-delay-mean", "100", "--random-input-len", "40", "--random-output-len", "10",
            "--request-rate", "3", "--seed", "5"]
    a, b = (build_workload(_ns(cmd, *argv), 32000, lambda: TOK) for cmd in ("bench", "simulate"))
    assert a.sessions is not None and a.samples == [] and a.num_requests == 18
    assert a.sessions.concurrency == 2 and a.sessions.starts_s == b.sessions.starts_s
    assert a.sessions.starts_s[-1] == pytest.approx(6 / 3)        # --request-rate schedules session starts
    assert all(np.array_equal(x.user_ids, y.user_ids) for s, r in zip(a.sessions.sessions, b.sessions.sessions,
                                                                       strict=True)
               for x, y in zip(s.turns, r.turns, strict=True))
    with pytest.raises(ValueError, match="--session-concurrency"):
        build_workload(_ns("bench", "--num-sessions", "2", "--max-concurrency", "2"), 32000, lambda: TOK)
    with pytest.raises(ValueError, match="random or sharegpt"):
        build_workload(_ns("bench", "--num-sessions", "2", "--dataset-name", "prefix-repetition"), 32000,
                       lambda: TOK)


def _config(*argv: str):
    return create_engine_config(engine_args_from(_ns("simulate", "--max-model-len", "8192", *argv)))


def _workload(n: int, turns: int, *, delay_s: float = 0.0, concurrency: int | None = None, seed: int = 0,
              input_len: int = 200, output_len: int = 40) -> SessionWorkload:
    sessions = synthetic_sessions(n, turns_mean=turns, turns_stddev=0, delay_mean_ms=1e3 * delay_s,
                                  delay_stddev_ms=0, input_len=input_len, output_len=output_len, range_ratio=0.0,
                                  vocab_size=32000, seed=seed)
    return SessionWorkload(sessions, [0.0] * n, concurrency, "synthetic")


def test_each_turn_prompt_is_the_last_prompt_and_answer_then_the_new_message():
    config = _config()
    wl = _workload(4, 3, delay_s=0.2)
    sent: dict[str, tuple[np.ndarray, list[int]]] = {}

    def make(engine):
        sender = _SessionSender(wl, engine, True, 0, config.model.vocab_size)
        add = sender.add_request        # the engine's (a compiled Engine takes no instance attributes: wrap here)

        def recording(rid, prompt, *a, **kw):
            sent[rid] = (np.asarray(prompt).copy(), list(kw["output_token_ids"]))
            return add(rid, prompt, *a, **kw)

        sender.add_request = recording
        return sender

    res = run_fast_forward(config, [], [], make_sender=make)
    assert len(res.records) == 12 and all(r.success for r in res.records)
    for i, s in enumerate(wl.sessions):
        for k in range(1, 3):
            prev_prompt, prev_answer = sent[f"ff-s{i}-t{k - 1}"]
            prompt, _ = sent[f"ff-s{i}-t{k}"]
            head = np.concatenate([prev_prompt, prev_answer])
            assert np.array_equal(prompt[:len(head)], head)
            assert np.array_equal(prompt[len(head):], s.turns[k].user_ids)
    # the think time: a turn is sent 0.2 s after its previous answer's last token
    by = {(r.session, r.turn): r for r in res.records}
    for i in range(4):
        for k in range(1, 3):
            prev = by[(i, k - 1)]
            assert by[(i, k)].start_s == pytest.approx(prev.start_s + prev.latency_s + 0.2)


def test_session_concurrency_limit_holds():
    config = _config()
    wl = _workload(10, 3, delay_s=0.5, concurrency=3)
    res, max_open = run_sessions(config, wl)
    assert max_open == 3 and len(res.records) == 30
    spans = {}
    for r in res.records:
        lo, hi = spans.get(r.session, (np.inf, -np.inf))
        spans[r.session] = (min(lo, r.start_s), max(hi, r.start_s + r.latency_s))
    events = sorted([(lo, 1) for lo, _ in spans.values()] + [(hi, -1) for _, hi in spans.values()])
    open_now = peak = 0
    for _, d in events:          # at a tie the close (-1) sorts first: a session starts as another ends
        open_now += d
        peak = max(peak, open_now)
    assert peak == 3
    # the sessions held back waited for a place: their first turn's client queue time is positive
    assert sum(1 for r in res.records if r.turn == 0 and r.queue_s > 0) == 7
    unlimited, max_open_all = run_sessions(config, _workload(10, 3, delay_s=0.5))
    assert max_open_all == 10


def test_report_hits_grow_with_the_turn(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["simulate", "--max-model-len", "8192", "--num-sessions", "8", "--session-concurrency", "4",
                 "--session-turns-mean", "4", "--session-turn-delay-mean", "300", "--random-input-len", "300",
                 "--random-output-len", "60", "--seed", "2", "--result-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "By turn:" in text and "hit_%" in text
    r = json.loads(out.read_text())
    assert r["num_prompts"] == r["completed"] == 32
    assert r["sessions"]["num_sessions"] == 8 and r["sessions"]["max_open_sessions"] == 4
    turns = r["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3, 4] and all(t["requests"] == 8 for t in turns)
    hits = [t["hit_rate"] for t in turns]
    assert hits[0] == 0.0 and all(b > a for a, b in zip(hits, hits[1:], strict=False))
    # turn k (1-based) hits the whole history but the last partial block: prompt 300k + 60(k-1), history before it
    # 300(k-1) + 60(k-1), of which the full 16-token blocks of the 360(k-1) - 1 computed tokens
    for k, t in enumerate(turns[1:], start=2):
        hist = 360 * (k - 1)
        assert t["cached_tokens"] == 8 * ((hist - 1) // 16 * 16)
        assert t["mean_prompt_tokens"] == hist + 300
    assert {"mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms"} <= set(turns[0])
    assert r["prefix_cache"]["cached_tokens"] == sum(t["cached_tokens"] for t in turns)


def test_same_seed_same_run():
    config = _config()
    a, _ = run_sessions(config, _workload(6, 3, delay_s=0.1, concurrency=2, seed=4), seed=4)
    b, _ = run_sessions(config, _workload(6, 3, delay_s=0.1, concurrency=2, seed=4), seed=4)
    assert [(r.session, r.turn, r.ttft_s, r.latency_s, r.cached_tokens) for r in a.records] == \
        [(r.session, r.turn, r.ttft_s, r.latency_s, r.cached_tokens) for r in b.records]


def test_turn_stats_are_pure_functions_of_the_records():
    recs = [RequestRecord(True, 100, 10, 0.010, [], 0.1, cached_tokens=0, session=0, turn=0),
            RequestRecord(True, 100, 10, 0.030, [], 0.1, cached_tokens=0, session=1, turn=0),
            RequestRecord(True, 300, 10, 0.005, [], 0.1, cached_tokens=192, session=0, turn=1),
            RequestRecord(False, 300, 0, 0.0, [], 0.0, cached_tokens=None, session=1, turn=1)]
    rows = turn_stats(recs)
    assert [r["requests"] for r in rows] == [2, 1]
    assert rows[0]["mean_ttft_ms"] == pytest.approx(20.0) and rows[0]["p50_ttft_ms"] == pytest.approx(20.0)
    assert rows[1]["hit_rate"] == pytest.approx(0.64)
    assert prefix_cache_stats(recs)["hit_rate"] == pytest.approx(192 / 500)
    assert prefix_cache_stats([RequestRecord(True, 5, 1, 0.0, [], 0.0)])["hit_rate"] is None


def test_sessions_refuse_what_they_do_not_run(capsys):
    assert main(["simulate", "--num-sessions", "2", "--replicas", "2"]) == 2
    assert "one engine" in capsys.readouterr().err
    wl = SessionWorkload([Session([Turn(np.arange(100, 110), 3)])], [0.0], None, "synthetic")
    res, _ = run_sessions(_config(), wl)
    assert len(res.records) == 1 and res.records[0].output_len == 3
