"""The shell blocks of README.md and docs/ that a page marks runnable, and how the tests run them.

A block is runnable when the line just before its fence is ``<!-- runnable -->``. The marker may shrink it for the
test, as the page then says: ``<!-- runnable: replace "--num-prompts 300" "--num-prompts 60" -->`` (any number of
``replace "OLD" "NEW"``; ``{port}`` in NEW is a port free when the block starts, for a block that starts a server),
and ``slow`` puts it under the ``slow`` marker.

Each block runs with ``bash -euo pipefail`` in its own process group (whatever it leaves running is killed when it
ends), in a fresh directory holding a link to ``examples/`` (so paths read as from the repository root), offline,
with its own caches. It must exit 0 and write every file it names with ``--result-json``, ``--csv``, ``--timeline``,
``--report-html`` or ``--plot``.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
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
    text: str = ""           # as the page shows it
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
        out.append(Block(page, line, body, runnable=m["marker"] is not None, text=m["body"], slow="slow" in opts,
                         replacements=reps))
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
    script = block.script.replace("{port}", str(_free_port())) if "{port}" in block.script else block.script
    argv = ["bash", "-euo", "pipefail", "-c", script]
    # output to files, not pipes: a server the block left behind would hold a pipe open past the shell's exit
    with open(workdir / ".stdout", "w+") as out, open(workdir / ".stderr", "w+") as err:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, text=True, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)     # the block's leftovers (a server started with &)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(argv, rc, out.read(), err.read())
    if check:
        done.check_returncode()
    return done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
