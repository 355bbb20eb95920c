"""``examples/prefix_router.py`` in process, at small scale: 4 replicas publishing KV events, the router in front,
``kernelsight bench`` sending multi-turn sessions through it. The prefix-aware policy keeps each session where its
history is cached; round-robin scatters the turns, so its later turns miss."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import sys
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("aiohttp")
pytest.importorskip("zmq")

from kernelsight.cli import main  # noqa: E402
from kernelsight.server.runner import ServerThread  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "prefix_router.py"


def _load_router():
    spec = importlib.util.spec_from_file_location("prefix_router", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod         # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _router(mod, replicas: list[str], policy: str):
    """The router's aiohttp app on its own loop in a thread; yields its base URL and the Router."""
    from aiohttp import web

    app = mod.build_app(replicas, policy)
    ready, stop = threading.Event(), None
    box: dict = {}

    def run() -> None:
        nonlocal stop
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["port"] = site._server.sockets[0].getsockname()[1]
        stop = asyncio.Event()
        box["loop"], box["stop"] = loop, stop
        ready.set()
        loop.run_until_complete(stop.wait())
        loop.run_until_complete(runner.cleanup())
        loop.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{box['port']}", app["router"]
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        t.join(10)


WORKLOAD = ["--num-sessions", "10", "--session-concurrency", "5", "--session-turns-mean", "3",
            "--session-turn-delay-mean", "150", "--session-turn-delay-stddev", "100", "--random-input-len", "256",
            "--random-output-len", "16", "--endpoint", "/v1/completions", "--time-scale", "4"]


def test_prefix_router_beats_round_robin(tmp_path):
    mod = _load_router()
    results = {}
    with ExitStack() as stack:
        urls = []
        for _ in range(4):
            cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{_free_port()}", "topic": "kv"})
            srv = stack.enter_context(ServerThread(["--max-model-len", "4096", "--time-scale", "4",
                                                    "--enable-prompt-tokens-details", "--kv-events-config", cfg]))
            urls.append(srv.base_url)
        for policy in ("round-robin", "prefix"):
            # the same replicas for both: a different seed per policy, so no run meets the other's prompts
            out = tmp_path / f"{policy}.json"
            with _router(mod, urls, policy) as (base, router):
                assert main(["bench", "--base-url", base, *WORKLOAD, "--seed", "1" if policy == "prefix" else "2",
                             "--result-json", str(out)]) == 0
                stats = [(r.routed, r.matched_blocks) for r in router.replicas]
            results[policy] = (json.loads(out.read_text()), stats)
    rr, pr = results["round-robin"][0], results["prefix"][0]
    assert rr["completed"] == pr["completed"] == 30
    rr_hits = [t["hit_rate"] for t in rr["turns"]]
    pr_hits = [t["hit_rate"] for t in pr["turns"]]
    # the prefix router sends turns 2 and 3 to the replica holding their history
    assert pr_hits[1] > 0.4 and pr_hits[2] > 0.55
    assert pr["prefix_cache"]["hit_rate"] > rr["prefix_cache"]["hit_rate"] + 0.15, (rr_hits, pr_hits)
    assert sum(m for _, m in results["prefix"][1]) > 0 and all(n > 0 for n, _ in results["prefix"][1])


def test_the_index_follows_both_tiers():
    mod = _load_router()
    rep = mod.ReplicaIndex("http://r")
    prompt = list(range(100, 148))                          # 3 blocks of 16
    keys = mod.chain_keys(prompt, 16)
    rep.apply([{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
                "token_ids": prompt[:32], "block_size": 16, "medium": "GPU"},
               {"type": "BlockStored", "block_hashes": [13], "parent_block_hash": 12,
                "token_ids": prompt[32:], "block_size": 16, "medium": "GPU"}])
    assert rep.prefix_blocks(keys) == (3, 3)
    # offloaded (by hash only), then evicted from the GPU: still held, in the CPU tier
    rep.apply([{"type": "BlockStored", "block_hashes": [11, 12, 13], "parent_block_hash": None, "token_ids": [],
                "block_size": 16, "medium": "CPU"},
               {"type": "BlockRemoved", "block_hashes": [12, 13], "medium": "GPU"}])
    assert rep.prefix_blocks(keys) == (3, 1)
    rep.apply([{"type": "BlockRemoved", "block_hashes": [12], "medium": "CPU"}])
    assert rep.prefix_blocks(keys) == (1, 1) and 12 not in rep.key_of      # in neither tier: forgotten
    # another prompt shares nothing; vLLM <= 0.11's positional arrays read the same
    assert rep.prefix_blocks(mod.chain_keys(list(range(500, 548)), 16)) == (0, 0)
    rep.apply([["BlockRemoved", [11], "GPU"], ["AllBlocksCleared"]])
    assert rep.prefix_blocks(keys) == (0, 0) and not rep.key_of
