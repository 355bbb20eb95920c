"""KV-cache events: the simulated pool's records, vLLM's block hashes, the msgpack wire format, and the ZeroMQ
publisher seen by a real subscriber (PUB/SUB and the ROUTER replay) in front of a running server."""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import socket

import httpx
import pytest

from tests.conftest import cli_one_line_error, free_port_run

pytest.importorskip("fastapi")
zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from kernelsight.server.integrations.kv_events.config import (  # noqa: E402
    KVEventsConfig,
    endpoint_binds,
    offset_endpoint,
    parse_kv_events_config,
)
from kernelsight.server.integrations.kv_events.hashing import hash_function  # noqa: E402
from kernelsight.server.integrations.kv_events.translate import HashTranslator  # noqa: E402
from kernelsight.server.integrations.kv_events.wire import WireCleared, WireRemoved, WireStored, encode_batch  # noqa: E402
from kernelsight.simcore.kv_cache import KVCacheManager  # noqa: E402
from kernelsight.simcore.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from kernelsight.simcore.request import FinishReason, Request  # noqa: E402

BS = 16
M64 = (1 << 64) - 1


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, tuple(prompt), 4, 4, FinishReason.LENGTH, 0.0)


def _admit(kv: KVCacheManager, req: Request) -> bool:
    hits, cached = kv.get_computed_blocks(req)
    ok = kv.allocate_slots(req, req.num_tokens - cached, hits, cached)
    if ok:
        req.num_computed_tokens = req.num_tokens
    return ok


# -- vLLM's definitions, written out independently of the code under test --------------------------------------
def _vllm_sha256_chain(tokens: list[int], seed: str, extra: tuple | None = None) -> list[int]:
    def h(obj):
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    parent = h(seed)                      # NONE_HASH = hash_fn(PYTHONHASHSEED)
    out = []
    for i in range(len(tokens) // BS):
        parent = h((parent, tuple(tokens[i * BS:(i + 1) * BS]), extra))
        out.append(int.from_bytes(parent, "big") & M64)
    return out


# -- simcore ----------------------------------------------------------------------------------------------------
def test_pool_records_nothing_until_enabled():
    kv = KVCacheManager(64, BS)
    assert _admit(kv, _req("a", list(range(100, 164))))
    assert kv.pool.events is None and kv.take_events() == []


def test_store_share_evict_reset_records():
    kv = KVCacheManager(12, BS)           # 11 usable blocks
    kv.enable_events()
    p = list(range(1000, 1064))           # 4 full blocks
    a = _req("a", p + [7])
    assert _admit(kv, a)
    (st,) = kv.take_events()
    assert type(st) is BlockStored and st.parent_key is None and st.first_block_index == 0
    assert st.keys == a.block_hashes[:4] and st.token_ids == p and st.block_size == BS
    # a second request sharing 3 blocks stores only its 2 new full blocks, chained to the third shared one
    b = _req("b", p[:48] + list(range(5000, 5032)) + [9])
    assert _admit(kv, b)
    (st2,) = kv.take_events()
    assert st2.parent_key == a.block_hashes[2] and st2.first_block_index == 3
    assert st2.token_ids == list(range(5000, 5032)) and len(st2.keys) == 2
    # the pool refuses a reset while blocks are held, and records nothing
    assert not kv.reset_prefix_cache() and kv.take_events() == []
    kv.free(a)
    kv.free(b)
    # pressure: a new 10-block prompt must evict cached blocks; each eviction names a stored key
    c = _req("c", list(range(9000, 9160)) + [1])
    assert _admit(kv, c)
    evs = kv.take_events()
    removed = [k for e in evs if type(e) is BlockRemoved for k in e.keys]
    assert removed and len(removed) == len(set(removed))
    assert set(removed) <= set(st.keys) | set(st2.keys)
    assert type(evs[-1]) is BlockStored and evs[-1].parent_key is None   # evictions come before the store
    kv.free(c)
    assert kv.reset_prefix_cache()
    assert [type(e) for e in kv.take_events()] == [AllBlocksCleared]
    assert kv.get_computed_blocks(_req("d", p + [7])) == ([], 0)          # the cache is really empty


# -- vLLM's hashes ----------------------------------------------------------------------------------------------
def test_sha256_chain_matches_vllm_definition():
    tokens = list(range(128000, 128048))
    t = HashTranslator("sha256", True, seed="0")
    keys = [11, 22, 33]
    (w,) = t.translate([BlockStored(keys, None, tokens, BS, 0, None)])
    assert w.block_hashes == _vllm_sha256_chain(tokens, "0")
    assert w.parent_block_hash is None and w.extra_keys is None
    # a continuation chains from the stored parent
    more = list(range(7, 23))
    (w2,) = t.translate([BlockStored([44], 33, more, BS, 3, None)])
    assert w2.parent_block_hash == w.block_hashes[-1]
    assert w2.block_hashes == _vllm_sha256_chain(tokens + more, "0")[3:]


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash", "xxhash_cbor"])
def test_other_hash_algos_match_vllm_definition(algo):
    cbor2 = pytest.importorskip("cbor2")
    xxhash = pytest.importorskip("xxhash")
    ser = {"sha256_cbor": lambda o: cbor2.dumps(o, canonical=True),
           "xxhash": lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL),
           "xxhash_cbor": lambda o: cbor2.dumps(o, canonical=True)}[algo]
    dig = hashlib.sha256 if algo.startswith("sha") else None

    def h(o):
        return dig(ser(o)).digest() if dig else xxhash.xxh3_128_digest(ser(o))
    tokens = list(range(50, 82))
    parent = h("42")
    want = []
    for i in range(2):
        parent = h((parent, tuple(tokens[i * BS:(i + 1) * BS]), ("my-lora",)))
        want.append(int.from_bytes(parent, "big") & M64)
    (w,) = HashTranslator(algo, True, seed="42").translate(
        [BlockStored([1, 2], None, tokens, BS, 0, ("lora", "my-lora"))])
    assert w.block_hashes == want and w.lora_name == "my-lora" and w.lora_id == 1
    assert w.extra_keys == [("my-lora",), ("my-lora",)]
    assert hash_function(algo)("x") == h("x")


def test_cache_salt_enters_the_first_block_only_and_bytes_hashes():
    tokens = list(range(300, 332))
    (w,) = HashTranslator("sha256", False, seed="1").translate(
        [BlockStored([5, 6], None, tokens, BS, 0, ("cache_salt", "s"))])
    assert w.extra_keys == [("s",), None]
    assert isinstance(w.block_hashes[0], bytes) and len(w.block_hashes[0]) == 32


def test_removed_names_the_stored_hash_until_the_last_copy_goes():
    t = HashTranslator("sha256", True, seed="0")
    tokens = list(range(16))
    (s1,) = t.translate([BlockStored([9], None, tokens, BS, 0, None)])
    t.translate([BlockStored([9], None, tokens, BS, 0, None)])          # the same content cached twice
    (r1,) = t.translate([BlockRemoved([9])])
    assert len(t.translate([BlockStored([3, 4], None, tokens * 2, BS, 0, None), BlockRemoved([3, 4])])) == 3
    assert r1.block_hashes == s1.block_hashes and t.vllm_hash(9) is not None
    t.translate([BlockRemoved([9])])
    assert t.vllm_hash(9) is None and t.translate([BlockRemoved([9])]) == []
    # stored again after eviction: the same hash, remembered rather than computed again
    hashed = t.hashed
    (s2,) = t.translate([BlockStored([9], None, tokens, BS, 0, None)])
    assert s2.block_hashes == s1.block_hashes and t.hashed == hashed and t.reused == 2
    assert type(t.translate([AllBlocksCleared()])[0]) is WireCleared


# -- wire format ------------------------------------------------------------------------------------------------
def test_tagged_map_and_array_encodings():
    evs = [WireStored([1, 2], None, list(range(32)), BS, None, None, None), WireRemoved([3]), WireCleared()]
    m = msgpack.unpackb(encode_batch(1.5, evs, 0), raw=False)
    assert list(m) == ["ts", "events", "data_parallel_rank"] and m["ts"] == 1.5 and m["data_parallel_rank"] == 0
    stored, removed, cleared = m["events"]
    assert list(stored)[:8] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                "medium", "lora_name"]
    assert stored["type"] == "BlockStored" and stored["medium"] == "GPU" and "extra_keys" not in stored
    assert removed == {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}
    a = msgpack.unpackb(encode_batch(1.5, evs, 2, array_like=True), raw=False)
    assert a == [1.5, [["BlockStored", [1, 2], None, list(range(32)), BS, None, "GPU"],
                       ["BlockRemoved", [3], "GPU"], ["AllBlocksCleared"]], 2]


# -- config -----------------------------------------------------------------------------------------------------
def test_config_defaults_and_rules():
    c = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.max_queue_size, c.topic) == \
        ("zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert KVEventsConfig().publisher == "null" and not KVEventsConfig().publishes
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and offset_endpoint("inproc://x", 1) == "inproc://x_dp1"
    assert endpoint_binds("tcp://*:5557") and endpoint_binds("ipc:///tmp/k") and not endpoint_binds("tcp://host:5557")
    for bad in ("{bad", "[1]", '{"endpont": "x"}', '{"publisher": "kafka"}', '{"hwm": -1}'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_kv_events_config(bad)



def test_bad_configs_fail_at_start_with_one_line(capsys):
    err = cli_one_line_error(capsys, ["serve", "--kv-events-config", "{not json"])
    assert "--kv-events-config" in err and "invalid JSON" in err
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
        # (an HTTP port of its own: serve binds it before building the engine, and 8000 may be someone else's)
        err = cli_one_line_error(capsys, ["serve", "--num-gpu-blocks-override", "64", "--max-model-len", "512",
                                  "--host", "127.0.0.1", "--port", str(_free_port()), "--kv-events-config", cfg])
        assert f"cannot bind tcp://*:{port}" in err and "in use" in err
    finally:
        taken.close()


# -- through real sockets ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """What a router does: SUB to the stream, and fill gaps (and the start) from the replay socket."""

    def __init__(self, ctx, endpoint: str, replay: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.batches: dict[int, bytes] = {}

    def drain(self, until_seq: int | None = None, timeout_ms: int = 20000) -> None:
        """Receive live batches until none arrives for a while (or seq until_seq is in)."""
        while self.sub.poll(timeout_ms if until_seq is not None and until_seq not in self.batches else 300):
            topic, seq, payload = self.sub.recv_multipart()
            self.batches[int.from_bytes(seq, "big")] = payload

    def replay_from(self, start: int) -> dict[int, bytes]:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        out = {}
        while True:
            assert self.replay.poll(20000), "no replay answer"
            _, seq, payload = self.replay.recv_multipart()
            s = int.from_bytes(seq, "big", signed=True)
            if s == -1:
                assert payload == b""
                return out
            out[s] = payload

    def events(self) -> list[dict]:
        return [e for s in sorted(self.batches) for e in msgpack.unpackb(self.batches[s], raw=False)["events"]]


def _complete(c: httpx.Client, prompt: list[int]) -> None:
    r = c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_events_through_zmq(monkeypatch):
    from kernelsight.server.runner import ServerThread

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    pub_port, replay_port = _free_port(), _free_port()
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub_port}",
           "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv"}
    ctx = zmq.Context.instance()
    argv = ["--num-gpu-blocks-override", "24", "--max-model-len", "256", "--max-num-seqs", "2",
            "--time-scale", "50", "--served-model-name", "m", "--kv-events-config", json.dumps(cfg)]
    with ServerThread(argv) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        sub = Subscriber(ctx, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
        try:
            src = c.get("/kv_event_sources").json()
            assert src == [{"data_parallel_rank": 0, "endpoint": f"tcp://127.0.0.1:{pub_port}",
                            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv"}]
            p = list(range(1000, 1064))                        # 4 full blocks
            _complete(c, p)
            _complete(c, p[:48] + list(range(2000, 2032)))    # shares 3 blocks, adds 2
            for i in range(4):                                 # 10-block prompts: 23 usable blocks must evict
                _complete(c, list(range(10000 * (i + 1), 10000 * (i + 1) + 160)))
            sub.drain(until_seq=0)
            # whatever the subscription missed while it joined, replay returns, byte for byte
            replayed = sub.replay_from(0)
            assert sorted(replayed) == list(range(len(replayed)))           # gap-free from 0
            assert all(replayed[s] == b for s, b in sub.batches.items())
            sub.batches.update(replayed)
            evs = sub.events()
            stored = [e for e in evs if e["type"] == "BlockStored"]
            want_a = _vllm_sha256_chain(p, "0")
            want_b = _vllm_sha256_chain(p[:48] + list(range(2000, 2032)), "0")
            assert stored[0]["block_hashes"] == want_a and stored[0]["parent_block_hash"] is None
            assert stored[0]["token_ids"] == p
            assert stored[1]["block_hashes"] == want_b[3:] and stored[1]["parent_block_hash"] == want_a[2]
            all_stored = {h for e in stored for h in e["block_hashes"]}
            removed = [h for e in evs if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
            assert removed and set(removed) <= all_stored
            assert set(want_a[:3]) & set(removed)             # the shared prefix was evicted under pressure
            first = msgpack.unpackb(replayed[0], raw=False)
            assert first["data_parallel_rank"] == 0 and first["ts"] > 1.6e9
            # replay from the middle returns only the tail
            assert sorted(sub.replay_from(2)) == list(range(2, len(replayed)))
            # a reset clears everything, announced once
            assert c.post("/reset_prefix_cache").json() == {"success": True}
            n = len(replayed)
            sub.drain(until_seq=n)
            last = msgpack.unpackb(sub.batches[n], raw=False)["events"]
            assert last == [{"type": "AllBlocksCleared"}]
        finally:
            sub.sub.close(linger=0)
            sub.replay.close(linger=0)


def test_publishers_per_rank_and_replica_offsets():
    from kernelsight.engine_args import create_engine_config
    from kernelsight.server.options import ServerOptions
    from kernelsight.server.state import _kv_publishers
    from kernelsight.simcore.engine_config import EngineArgs

    config = create_engine_config(EngineArgs(num_gpu_blocks_override=64, max_model_len=512))
    base = free_port_run(4)                                 # replica 1's ranks publish on base + 2, base + 3
    cfg = parse_kv_events_config(json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{base}"}))
    opts = ServerOptions(["m"], "m", data_parallel_size=2, kv_events=cfg)
    pubs = _kv_publishers(config, opts, replica_index=1)
    try:
        assert [(p.rank, p.endpoint) for p in pubs] == [(0, f"tcp://*:{base + 2}"), (1, f"tcp://*:{base + 3}")]
    finally:
        for p in pubs:
            p.shutdown()
    # --data-parallel-rank 1: this process publishes rank 1 alone, on rank 1's port
    (one,) = _kv_publishers(config, opts, replica_index=0, ranks=range(1, 2))
    try:
        assert (one.rank, one.endpoint) == (1, f"tcp://*:{base + 1}")
    finally:
        one.shutdown()
    off = ServerOptions(["m"], "m", kv_events=parse_kv_events_config('{"enable_kv_cache_events": true, '
                                                                     '"publisher": "null"}'))
    assert _kv_publishers(config, off, 0) == []


def test_replay_keeps_the_last_buffer_steps_batches():
    from kernelsight.server.integrations.kv_events.publisher import KVEventPublisher

    port, rport = _free_port(), _free_port()
    cfg = parse_kv_events_config(json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                                             "replay_endpoint": f"tcp://*:{rport}", "buffer_steps": 2}))
    pub = KVEventPublisher(cfg)
    pub.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{rport}")
    try:
        for i in range(3):
            assert pub.publish(float(i), [BlockStored([100 + i], None, list(range(16)), BS, 0, None)])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(20000)
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            got.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)["ts"]))
        assert got == [(1, 1.0), (2, 2.0)] and pub.stats.batches == 3 and pub.stats.replays == 1
    finally:
        dealer.close(linger=0)
        pub.shutdown()


MOE_EP = ["--model", "Qwen/Qwen3-30B-A3B-Instruct-2507", "--hardware", "rtx-pro-6000", "--enable-expert-parallel"]


@pytest.mark.parametrize("model_args", [[], MOE_EP], ids=["dense", "moe-lockstep"])
def test_data_parallel_ranks_publish_apart_in_the_array_encoding(monkeypatch, model_args):
    """Each rank publishes on its own ports: a dense model's independent ranks and a MoE model's lockstep group."""
    from kernelsight.server.runner import ServerThread

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    base, rbase = free_port_run(2), free_port_run(2)          # rank 1 publishes on port + 1
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{base}", "replay_endpoint": f"tcp://*:{rbase}"}
    argv = ["--num-gpu-blocks-override", "64", "--max-model-len", "256", "--time-scale", "50", "--data-parallel-size",
            "2", "--served-model-name", "m", "--kv-events-array-like", "--kv-events-config", json.dumps(cfg),
            *model_args]
    with ServerThread(argv) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        assert (srv.state.lockstep is not None) == bool(model_args)
        src = c.get("/kv_event_sources").json()
        assert [(s["data_parallel_rank"], s["endpoint"]) for s in src] == \
            [(0, f"tcp://127.0.0.1:{base}"), (1, f"tcp://127.0.0.1:{base + 1}")]
        assert [s["replay_endpoint"] for s in src] == [f"tcp://127.0.0.1:{rbase}", f"tcp://127.0.0.1:{rbase + 1}"]
        prompt = list(range(500, 532))
        r = c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1},
                   headers={"X-data-parallel-rank": "1"})
        assert r.status_code == 200
        dealers = []
        try:
            got = []
            for s in src:
                d = zmq.Context.instance().socket(zmq.DEALER)
                dealers.append(d)
                d.connect(s["replay_endpoint"])
                d.send_multipart([b"", (0).to_bytes(8, "big")])
                batches = []
                while True:
                    assert d.poll(20000)
                    _, seq, payload = d.recv_multipart()
                    if seq == (-1).to_bytes(8, "big", signed=True):
                        break
                    batches.append(msgpack.unpackb(payload, raw=False))
                got.append(batches)
            assert got[0] == []                                   # rank 0 served nothing
            (batch,) = got[1]
            ts, events, rank = batch
            assert rank == 1 and events == [["BlockStored", _vllm_sha256_chain(prompt, "0"), None, prompt, BS, None,
                                             "GPU"]]
        finally:
            for d in dealers:
                d.close(linger=0)
