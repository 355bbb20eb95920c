"""The shell blocks of README.md and docs/ that a page marks runnable, and how the tests run them.

A block is runnable when the line just before its fence is ``<!-- runnable -->``. The marker may shrink it for the
test, as the page then says: ``<!-- runnable: replace "--num-prompts 300" "--num-prompts 60" -->`` (any number of
``replace "OLD" "NEW"``), and ``slow`` puts it under the ``slow`` marker. Each block runs with ``bash -euo pipefail``
in a fresh directory holding a link to ``examples/`` (so paths read as from the repository root), offline, with
its own caches, and must exit 0 and write every file it names with ``--result-json``, ``--csv``, ``--timeline``,
``--report-html`` or ``--plot``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<marker><!-- runnable(?P<opts>[^>]*)-->\n)?```(?:bash|sh|console)\n(?P<body>.*?)^```$",
                   re.M | re.S)
REPLACE = re.compile(r'replace\s+"([^"]*)"\s+"([^"]*)"')
OUTPUT_FLAGS = ("--result-json", "--csv", "--timeline", "--report-html", "--plot")
TIMEOUT_S = 600


@dataclass
class Block:
    page: Path
    line: int
    script: str              # as the test runs it (after the marker's replacements)
    runnable: bool
    slow: bool = False
    replacements: list[tuple[str, str]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def outputs(self) -> list[str]:
        """The files the block's commands are told to write."""
        words = shlex.split(re.sub(r"\\\n", " ", self.script), comments=True)
        return [words[i + 1] for i, w in enumerate(words[:-1]) if w in OUTPUT_FLAGS]


def shell_blocks(page: Path) -> list[Block]:
    """Every bash block of a page, runnable or not."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        body, opts = m["body"], m["opts"] or ""
        reps = REPLACE.findall(opts)
        for old, new in reps:
            assert old in body, f"{page}: the runnable marker replaces {old!r}, which its block does not contain"
            body = body.replace(old, new)
        line = text.count("\n", 0, m.start("body"))
        out.append(Block(page, line, body, runnable=m["marker"] is not None, slow="slow" in opts, replacements=reps))
    return out


def runnable_blocks(page: Path) -> list[Block]:
    return [b for b in shell_blocks(page) if b.runnable]


def run_block(block: Block, workdir: Path, check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run one block in ``workdir`` (created if needed), as a bare clone would run it."""
    workdir.mkdir(parents=True, exist_ok=True)
    link = workdir / "examples"
    if not link.exists():
        link.symlink_to(ROOT / "examples", target_is_directory=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "XDG_CACHE_HOME": str(workdir / ".cache"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1"}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block.script], cwd=workdir, env=env, text=True,
                          capture_output=True, timeout=TIMEOUT_S, check=check)
