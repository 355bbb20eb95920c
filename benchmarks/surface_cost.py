"""Server CPU per streamed token of the converted APIs against plain chat: the Responses and Messages routes (and a
chat tool call) re-render the chat stream, and this shows what that costs.

One ``kernelsight serve`` subprocess; per route family, CONCURRENCY clients stream REQUESTS requests each; the
server's CPU time (utime + stime from /proc) over the family's run, divided by the output tokens the responses
report. Prints a table and writes benchmarks/results/surface_cost.json (with the VM's steal time beside it).

    python benchmarks/surface_cost.py [--concurrency 16] [--requests 6] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx
from _common import steal_s, write_result
from _server_proc import ServerProc, cpu_s

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "minLength": 400}}, "required": ["q"]}}}]


def bodies(max_tokens: int, i: int) -> dict[str, tuple[str, dict[str, Any]]]:
    msg = [{"role": "user", "content": f"Tell me a story number {i}."}]
    return {
        "chat": ("/v1/chat/completions", {"messages": msg, "max_tokens": max_tokens, "stream": True, "seed": i,
                                          "ignore_eos": True, "stream_options": {"include_usage": True}}),
        "chat tool call": ("/v1/chat/completions", {"messages": msg, "stream": True, "tools": TOOLS, "seed": i,
                                                    "tool_choice": "required",
                                                    "stream_options": {"include_usage": True}}),
        # neither API has ignore_eos: their lengths are the EOS draws, capped at max_tokens
        "responses": ("/v1/responses", {"input": msg[0]["content"], "max_output_tokens": max_tokens, "stream": True,
                                        "seed": i}),
        "messages": ("/v1/messages", {"messages": msg, "max_tokens": max_tokens, "stream": True}),
    }


def tokens_of(event_text: str) -> int:
    """The output tokens the stream's own usage reports (each API's final usage object)."""
    n = 0
    for event in event_text.split("\n\n"):
        data = next((ln[6:] for ln in event.split("\n") if ln.startswith("data: ")), None)
        if not data or data == "[DONE]":
            continue
        obj = json.loads(data)
        usage = obj.get("usage") or (obj.get("response") or {}).get("usage") or {}
        n = max(n, usage.get("completion_tokens", 0), usage.get("output_tokens", 0) or 0)
    return n


async def run_family(base: str, name: str, concurrency: int, requests: int, max_tokens: int) -> int:
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        async def client(k: int) -> int:
            total = 0
            for j in range(requests):
                path, body = bodies(max_tokens, k * requests + j)[name]
                r = await c.post(path, json={"model": "m", **body})
                r.raise_for_status()
                total += tokens_of(r.text)
            return total
        return sum(await asyncio.gather(*(client(k) for k in range(concurrency))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=6, help="per client")
    ap.add_argument("--max-tokens", type=int, default=128)
    ns = ap.parse_args()
    rows = []
    with ServerProc(["--served-model-name", "m", "--time-scale", "4", "--max-num-seqs", "64",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as srv:
        for name in bodies(ns.max_tokens, 0):
            asyncio.run(run_family(srv.base_url, name, 2, 1, ns.max_tokens))       # warm-up
            cpu0, steal0, t0 = cpu_s(srv.pid), steal_s(), time.monotonic()
            toks = asyncio.run(run_family(srv.base_url, name, ns.concurrency, ns.requests, ns.max_tokens))
            cpu, wall, steal = cpu_s(srv.pid) - cpu0, time.monotonic() - t0, steal_s() - steal0
            rows.append({"family": name, "output_tokens": toks, "server_cpu_s": round(cpu, 3),
                         "cpu_us_per_token": round(1e6 * cpu / max(toks, 1), 1), "wall_s": round(wall, 2),
                         "tokens_per_s": round(toks / wall, 1), "steal_s": round(steal, 2)})
    base = rows[0]["cpu_us_per_token"]
    print(f"{'family':<16}{'tokens':>8}{'server CPU µs/token':>21}{'vs chat':>9}{'tok/s':>9}{'steal s':>9}")
    for r in rows:
        r["vs_chat"] = round(r["cpu_us_per_token"] / base, 2) if base else None
        print(f"{r['family']:<16}{r['output_tokens']:>8}{r['cpu_us_per_token']:>21}{r['vs_chat']:>9}"
              f"{r['tokens_per_s']:>9}{r['steal_s']:>9}")
    path = write_result("surface_cost", {"args": vars(ns), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
