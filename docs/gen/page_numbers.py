"""Numbers the pages quote from a run of their own example or a shipped file, between markers the tests check.

A page holds ``<!-- BEGIN numbers:NAME ... -->`` ... ``<!-- END numbers:NAME -->``. ``tests/test_docs.py`` renders
each block — from the output of the page's own example (``RENDER``) or from a file the project ships (``STATIC``:
the error bands of ``kernelsight/profiles/accuracy.json``) — and fails when the page differs.

    python docs/gen/page_numbers.py          # re-run the examples and rewrite the blocks in README.md and docs/
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1]
ROOT = DOCS.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))   # reference.py beside it


def plan_answer(plan: dict[str, Any]) -> str:
    """The planning example's search and answer, from its ``--result-json``."""
    s = plan["search"]
    by_id = {p["key"]: p for p in plan["points"]}
    reasons = sorted(s["pruned_by_reason"].items(), key=lambda kv: -kv[1])
    n_at_rate = len(plan["points"])     # every point simulated at the requested rate (cut short or not)
    n_curve = s["simulated"] - n_at_rate  # the curves' other loads
    lines = ["| pruned because | points |", "|---|---|"] + [f"| {r} | {n} |" for r, n in reasons]
    head = (f"{s['space_points']} points: {n_at_rate} simulated at {plan['request_rate']:g} req/s "
            f"({s['stopped_early']} of them cut short once they provably failed), {n_curve} more for the "
            f"latency-vs-load curves, {s['pruned']} pruned.")
    front = ["| Pareto front | GPUs | $/Mtok | goodput (req/s) | p99 TTFT (ms) | p99 TPOT (ms) | SLO |",
             "|---|---|---|---|---|---|---|"]
    for key in plan["front"]:
        p = by_id[key]
        front.append(f"| {p['label']} | {p['num_gpus']} | {p['usd_per_mtok']:.3f} | {p['goodput_rps']:.2f} | "
                     f"{p['p99_ttft_ms']:,.0f} | {p['p99_tpot_ms']:.1f} | {'meets' if p['meets_slo'] else 'fails'} |")
    c = plan["chosen"]
    answer = (f"The answer: **{c['label']}** (p99 TTFT {c['p99_ttft_ms']:,.0f} ms, p99 TPOT {c['p99_tpot_ms']:.1f} "
              f"ms).")
    return "\n".join([head, "", *lines, "", *front, "", answer])


def accuracy_bands() -> str:
    from reference import band_rows

    return "\n".join(band_rows())


def accuracy_runs() -> str:
    from reference import accuracy_rows

    return "\n".join(accuracy_rows())


#: README command 1's main job, and the lines of its report the README quotes (the rest: the whole report).
QUICKSTART = ["simulate", "--num-prompts", "500", "--request-rate", "20"]
QUICKSTART_LINES = ("kernelsight simulate:", "  expected error", "  KV cache:", "=====", "Successful requests",
                    "Benchmark duration", "Request throughput", "Output token throughput", "Mean TTFT", "P99 TTFT",
                    "Mean TPOT", "P99 TPOT", "Mean E2EL", "P99 E2EL")


def quickstart() -> str:
    """What README command 1 prints, abridged (the wall-time line left out: it is the machine's)."""
    import contextlib
    import io

    from kernelsight.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(QUICKSTART) == 0
    lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith(QUICKSTART_LINES)]
    return "\n".join(["```text", *lines[:-1], "...", "```"])


#: Blocks rendered from an example's output: name → (render, the page whose example writes it, the output file).
RENDER: dict[str, tuple[Callable[[dict[str, Any]], str], str, str]] = {
    "plan-answer": (plan_answer, "planning.md", "plan.json")}
#: Blocks rendered from a file the project ships: name → render. They may sit on any page (README.md included).
STATIC: dict[str, Callable[[], str]] = {"accuracy-bands": accuracy_bands, "accuracy-runs": accuracy_runs,
                                        "quickstart": quickstart}
BLOCK = re.compile(r"(<!-- BEGIN numbers:(?P<name>[\w-]+)[^>]*-->\n)(?P<body>.*?)(<!-- END numbers:(?P=name) -->)",
                   re.S)


def blocks(text: str) -> dict[str, str]:
    """The numbers blocks of a page: name → body."""
    return {m["name"]: m["body"].rstrip("\n") for m in BLOCK.finditer(text)}


def replace_block(text: str, name: str, body: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + body + "\n" + m.group(4) if m["name"] == name else m.group(0), text)


def main() -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    from docs_blocks import PAGES, run_block, runnable_blocks

    for page in PAGES:
        text = page.read_text()
        for name in blocks(text).keys() & STATIC.keys():
            text = replace_block(text, name, STATIC[name]())
            print(f"{page.relative_to(ROOT)}: numbers:{name} rewritten")
        page.write_text(text)
    for name, (render, page, output) in RENDER.items():
        path = DOCS / page
        with tempfile.TemporaryDirectory() as tmp:
            for block in runnable_blocks(path):
                run_block(block, Path(tmp), check=True)
            body = render(json.loads((Path(tmp) / output).read_text()))
        path.write_text(replace_block(path.read_text(), name, body))
        print(f"{page}: numbers:{name} rewritten from {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
