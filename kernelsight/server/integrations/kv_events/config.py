"""``--kv-events-config``: vLLM's ``KVEventsConfig`` fields and defaults, its endpoint rules, and the JSON parser
argparse uses (a bad value is one line on stderr, as vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass

from kernelsight.argtypes import json_dataclass


@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (vllm/config/kv_events.py), same names and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None            # "zmq" | "null"; None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000               # batches kept for replay
    hwm: int = 100_000                       # ZeroMQ send high-water mark of the PUB socket
    max_queue_size: int = 100_000            # vLLM's publisher-thread queue; accepted, unused (sent inline)
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"Unknown event publisher '{self.publisher}'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")

    @property
    def publishes(self) -> bool:
        """Whether events go out at all (vLLM uses its null publisher otherwise)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """argparse type of ``--kv-events-config JSON``: errors become one-line argparse messages."""
    return json_dataclass(KVEventsConfig, text)


def offset_endpoint(endpoint: str | None, offset: int) -> str | None:
    """vLLM's per-rank endpoint: TCP port + offset, inproc/ipc name + ``_dp{offset}``; unchanged at offset 0."""
    if not endpoint or offset == 0:
        return endpoint
    if "inproc" in endpoint or endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{offset}"
    if "tcp" in endpoint:
        base, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit():
            return f"{base}:{int(port) + offset}"
        return endpoint
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


def endpoint_binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard host ('*' or '::') or an ipc/inproc name, else connect
    (a subscriber that binds, e.g. a router collecting many engines)."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")
            or endpoint.startswith("inproc://"))
