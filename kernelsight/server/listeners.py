"""The HTTP listening sockets of ``kernelsight serve``, bound before anything else is built.

Binding first (as vLLM binds its API socket before starting the engine) turns a taken port into one clear line at
start instead of a uvicorn traceback after the engine is built, and lets replica processes inherit sockets their
parent already holds (``replica_processes.py``)."""

from __future__ import annotations

import errno
import socket

#: uvicorn's default accept backlog
BACKLOG = 2048


def display_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening; ValueError with one line when the port is taken, the
    host cannot be resolved or the address is not this machine's."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {display_host(host)}:{port}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    # as uvicorn (and vLLM): a restart may bind while the previous server's connections sit in TIME_WAIT
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        why = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise ValueError(f"cannot listen on {display_host(host)}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


def bind_listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listeners on consecutive ports from ``port`` (one per replica); all or none."""
    socks: list[socket.socket] = []
    try:
        for i in range(count):
            socks.append(bind_listener(host, port + i))
    except ValueError:
        for s in socks:
            s.close()
        raise
    return socks
