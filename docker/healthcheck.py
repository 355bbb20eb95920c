#!/usr/bin/env python3
"""Container health check for ``kernelsight serve``: GET /health on every replica of the running server.

The ports come from the server's own command line (``docker run IMAGE --port 9000 --replicas 2`` stays
healthy without a new HEALTHCHECK), parsed by kernelsight's own argument parser so that every spelling it
accepts (``--port=9000``, abbreviations, ...) is understood. ``healthcheck.py URL...`` checks given URLs.
Exit 0 when every /health answers 200 within the timeout, 1 otherwise (Docker's convention).
"""

from __future__ import annotations

import os
import sys
import urllib.request

TIMEOUT_S = 4.0
ENTRY_NAMES = ("kernelsight", "kernelsight.cli")


def serve_args(cmdline: list[str]) -> list[str] | None:
    """The arguments after ``kernelsight serve`` in a process's argv, or None if it is not such a process."""
    for i, part in enumerate(cmdline[:-1]):
        if os.path.basename(part) in ENTRY_NAMES and cmdline[i + 1] == "serve":
            return cmdline[i + 2:]
    return None


def health_urls(args: list[str]) -> list[str]:
    """The /health URL of each replica that ``kernelsight serve ARGS`` binds."""
    from kernelsight.server.serve_args import serve_parser

    parser = serve_parser()
    try:
        ns = parser.parse_args(args)
    except SystemExit:          # unparsable (the server would not have started): check the defaults
        ns = parser.parse_args([])
    host = ns.host or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return [f"http://{host}:{ns.port + i}/health" for i in range(ns.replicas)]


def find_server_args(proc: str = "/proc") -> list[str] | None:
    """argv of the serve process: PID 1 in a container, else (``docker run --init``) the first one found."""
    pids = ["1"] + sorted((p for p in os.listdir(proc) if p.isdigit() and p != "1"), key=int)
    for pid in pids:
        try:
            with open(os.path.join(proc, pid, "cmdline"), "rb") as f:
                cmdline = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        args = serve_args(cmdline)
        if args is not None:
            return args
    return None


def check(urls: list[str], timeout_s: float = TIMEOUT_S) -> bool:
    ok = True
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                healthy = r.status == 200
        except Exception as exc:  # any failure (refused, timeout, HTTP error) is unhealthy
            print(f"{url}: {exc}", file=sys.stderr)
            healthy = False
        ok = ok and healthy
    return ok


def main(argv: list[str] | None = None) -> int:
    urls = list(sys.argv[1:] if argv is None else argv)
    if not urls:
        args = find_server_args()
        urls = health_urls(args if args is not None else [])
    return 0 if check(urls) else 1


if __name__ == "__main__":
    sys.exit(main())
