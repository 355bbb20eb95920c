"""How long the bundled tokenizers take to load: the first build (derive the merges, write tokenizer.json) and a
cached start (read tokenizer.json), each in a fresh process, per family; plus encode throughput on a sample.

    python benchmarks/tokenizer_load.py [--families llama3,qwen3,gpt-oss,mistral-v1]

Reports CPU steal beside the numbers (the machine is shared): /proc/stat before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _common import write_result

PROBE = """
import json, sys, time
t0 = time.perf_counter()
from kernelsight.server.model.bundled_tokenizer import load_bundled
t1 = time.perf_counter()
tok = load_bundled(sys.argv[1])
t2 = time.perf_counter()
text = open(json.__file__).read() * 4
n = len(tok.encode(text, add_special_tokens=False))
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "tokens": n, "encode_tokens_per_s": n / (t3 - t2)}))
"""


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    return sum(vals), vals[7] if len(vals) > 7 else 0      # total jiffies, steal


def _run(family: str, cache: str) -> dict[str, float]:
    env = dict(os.environ, KERNELSIGHT_CACHE_DIR=cache, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", PROBE, family], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="llama3,qwen3,gpt-oss,mistral-v1")
    ns = ap.parse_args()
    total0, steal0 = _cpu_times()
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for fam in ns.families.split(","):
            t = time.perf_counter()
            first = _run(fam, cache)
            first_wall = time.perf_counter() - t
            cached = _run(fam, cache)
            rows.append({"family": fam, "first_load_s": first["load_s"], "cached_load_s": cached["load_s"],
                         "first_process_wall_s": first_wall, "encode_tokens_per_s": cached["encode_tokens_per_s"]})
    total1, steal1 = _cpu_times()
    steal_pct = 100.0 * (steal1 - steal0) / max(1, total1 - total0)
    print(f"{'family':<12} {'first load s':>13} {'cached load s':>14} {'encode tok/s':>13}")
    for r in rows:
        print(f"{r['family']:<12} {r['first_load_s']:13.2f} {r['cached_load_s']:14.2f} "
              f"{r['encode_tokens_per_s']:13,.0f}")
    print(f"CPU steal during the run: {steal_pct:.1f} %")
    path = write_result("tokenizer_load", {"rows": rows, "steal_pct": steal_pct})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
