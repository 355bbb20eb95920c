"""A small prefix-aware router in front of kernelsight (or vLLM) replicas, driven by their KV-cache events.

    python examples/prefix_router.py --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 ... \
        --port 8080 --policy prefix            # or --policy round-robin, to compare

It finds each replica's KV-event stream at ``GET /kv_event_sources`` (serve the replicas with ``--kv-events-config``)
and keeps the blocks each replica holds: on the GPU, and in a KV-offloading tier in host memory when the replicas
offload (``--kv-offloading-size``). It sends each completions or chat request to the replica holding the longest
prefix of its prompt; ties go to the longest prefix on the GPU, then the fewest requests in flight, then turns.

The router keys blocks by its own chain of the events' token ids, so it needs neither vLLM's block hash nor
PYTHONHASHSEED. The first replica's ``/tokenize`` turns chat bodies and text prompts into ids. ``GET /router/stats``
counts where requests went and the prefix blocks each matched. ``examples/router_compare.sh`` runs it against
round-robin; docs/router-testing.md ("A prefix-aware router on KV events") has its numbers.

Needs aiohttp, pyzmq and msgpack (``pip install -e '.[server,loadgen]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

ROOT = 0x5EED         # the chain's start: the parent of a prompt's first block
UNKNOWN = -1          # the parent of a block whose parent the router never saw: never matches a prompt's chain
# the fields of vLLM <= 0.11's positional events, by type
_ARRAY_FIELDS = {"BlockStored": ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                 "medium"),
                 "BlockRemoved": ("type", "block_hashes", "medium"), "AllBlocksCleared": ("type",)}


def chain_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The router's key of each full block of ``token_ids``: a hash of the parent's key and the block's ids (Python
    hashes tuples of ints the same in every process)."""
    keys = []
    for i in range(len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        keys.append(parent)
    return keys


@dataclass
class ReplicaIndex:
    """The blocks one replica holds, from its KV events: in its GPU prefix cache, and in a KV-offloading tier in host
    memory (``--kv-offloading-size``: events with medium "CPU", by hash only, of blocks the GPU announced first)."""

    url: str
    blocks: set[int] = field(default_factory=set)           # on the GPU
    cpu_blocks: set[int] = field(default_factory=set)       # in the CPU tier
    key_of: dict[Any, int] = field(default_factory=dict)     # vLLM's block hash -> the router's key (while held)
    block_size: int = 16
    in_flight: int = 0
    routed: int = 0
    matched_blocks: int = 0
    next_seq: int | None = None          # the sequence number expected next (None: nothing received yet)
    missed_batches: int = 0

    def apply(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, list):             # vLLM <= 0.11's positional arrays
                ev = dict(zip(_ARRAY_FIELDS[ev[0]], ev, strict=False))
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                self.blocks.clear()
                self.cpu_blocks.clear()
                self.key_of.clear()
                continue
            if ev.get("group_idx", 0) != 0:
                continue                         # a hybrid model's sliding-window group: full attention decides
            cpu = ev.get("medium") == "CPU"
            if kind == "BlockStored" and cpu:
                # the offloading connector names blocks by the GPU's hash only: the key is the one the GPU's event
                # gave (the tier stores a block right after the GPU computed it)
                self.cpu_blocks.update(k for h in ev["block_hashes"] if (k := self.key_of.get(h)) is not None)
            elif kind == "BlockStored":
                bs = ev["block_size"]
                self.block_size = bs
                parent_hash = ev.get("parent_block_hash")
                parent = ROOT if parent_hash is None else self.key_of.get(parent_hash, UNKNOWN)
                tokens = ev["token_ids"]
                for j, h in enumerate(ev["block_hashes"]):
                    parent = hash((parent, tuple(tokens[j * bs:(j + 1) * bs])))
                    self.key_of[h] = parent
                    self.blocks.add(parent)
            elif kind == "BlockRemoved":
                tier, other = (self.cpu_blocks, self.blocks) if cpu else (self.blocks, self.cpu_blocks)
                for h in ev["block_hashes"]:
                    key = self.key_of.get(h)
                    if key is None:
                        continue
                    tier.discard(key)
                    if key not in other:         # in neither tier now: forget the hash
                        del self.key_of[h]

    def prefix_blocks(self, keys: Sequence[int]) -> tuple[int, int]:
        """The leading blocks of ``keys`` this replica holds in either tier, and how many of them are on the GPU."""
        n = gpu = 0
        all_gpu = True
        for k in keys:
            if k not in self.blocks:
                if k not in self.cpu_blocks:
                    break
                all_gpu = False
            n += 1
            gpu += all_gpu
        return n, gpu


class Router:
    def __init__(self, replicas: Sequence[str], policy: str) -> None:
        if policy not in ("prefix", "round-robin"):
            raise ValueError(f"unknown policy {policy!r}")
        self.replicas = [ReplicaIndex(u.rstrip("/")) for u in replicas]
        self.policy = policy
        self._turn = itertools.count()
        self._zmq = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task] = []
        self.http: aiohttp.ClientSession | None = None

    # -- KV events ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=6 * 3600))
        if self.policy != "prefix":
            return
        for rep in self.replicas:
            async with self.http.get(rep.url + "/kv_event_sources") as r:
                sources = await r.json() if r.status == 200 else []
            if not sources:
                raise RuntimeError(f"{rep.url} publishes no KV events: serve it with --kv-events-config")
            for src in sources:
                sub = self._zmq.socket(zmq.SUB)
                sub.connect(src["endpoint"])
                sub.setsockopt(zmq.SUBSCRIBE, (src.get("topic") or "").encode())
                self._tasks.append(asyncio.create_task(self._listen(rep, sub)))

    async def _listen(self, rep: ReplicaIndex, sub: Any) -> None:
        while True:
            _topic, seq, payload = await sub.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if rep.next_seq is not None and n > rep.next_seq:
                # dropped at the high-water mark: those blocks stay unknown (vLLM's replay socket could fetch them)
                rep.missed_batches += n - rep.next_seq
            rep.next_seq = n + 1
            batch = msgpack.unpackb(payload, strict_map_key=False)
            rep.apply(batch["events"] if isinstance(batch, dict) else batch[1])

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.http is not None:
            await self.http.close()
        self._zmq.destroy(linger=0)

    # -- routing ------------------------------------------------------------------------------------
    async def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids: as sent (completions with ids), else from the first replica's /tokenize."""
        if path.endswith("/completions") and "messages" not in body:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
            req = {"model": body.get("model"), "prompt": prompt if isinstance(prompt, str) else ""}
        else:
            req = {"model": body.get("model"), "messages": body.get("messages", []), "add_generation_prompt": True}
        assert self.http is not None
        async with self.http.post(self.replicas[0].url + "/tokenize", json=req) as r:
            return (await r.json()).get("tokens") if r.status == 200 else None

    def pick(self, ids: list[int] | None) -> tuple[ReplicaIndex, int]:
        turn = next(self._turn)
        n = len(self.replicas)
        if self.policy == "round-robin" or not ids:
            return self.replicas[turn % n], 0
        keys = chain_keys(ids, self.replicas[0].block_size)
        # the longest prefix held (a CPU block loads over PCIe, far sooner than it is computed), then the longest on
        # the GPU, then the fewest in flight, then turns
        scored = [(*rep.prefix_blocks(keys), -rep.in_flight, -((i - turn) % n), rep)
                  for i, rep in enumerate(self.replicas)]
        best = max(scored, key=lambda s: s[:4])
        return best[4], best[0]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        ids = await self.prompt_ids(request.path, body) if self.policy == "prefix" else None
        rep, matched = self.pick(ids)
        rep.routed += 1
        rep.matched_blocks += matched
        rep.in_flight += 1
        assert self.http is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization",
                                                                             "x-request-id")}
        try:
            async with self.http.post(rep.url + request.path, data=raw, headers=headers) as up:
                out = web.StreamResponse(status=up.status, headers={
                    "content-type": up.headers.get("content-type", "application/json")})
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        finally:
            rep.in_flight -= 1

    async def models(self, request: web.Request) -> web.Response:
        assert self.http is not None
        async with self.http.get(self.replicas[0].url + "/v1/models") as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"policy": self.policy, "replicas": [
            {"url": r.url, "routed": r.routed, "matched_blocks": r.matched_blocks, "gpu_blocks": len(r.blocks),
             "cpu_blocks": len(r.cpu_blocks), "missed_batches": r.missed_batches} for r in self.replicas]})


def build_app(replicas: Sequence[str], policy: str) -> web.Application:
    router = Router(replicas, policy)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", router.handle)
    app.router.add_post("/v1/chat/completions", router.handle)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/router/stats", router.stats)

    async def lifecycle(_app: web.Application):
        await router.start()
        yield
        await router.close()

    app.cleanup_ctx.append(lifecycle)
    app["router"] = router
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replica", action="append", required=True, help="a replica's base URL (repeat per replica)")
    p.add_argument("--policy", choices=("prefix", "round-robin"), default="prefix")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    ns = p.parse_args()
    web.run_app(build_app(ns.replica, ns.policy), host=ns.host, port=ns.port, print=None)


if __name__ == "__main__":
    main()
