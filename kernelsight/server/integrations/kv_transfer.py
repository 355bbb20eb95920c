"""Prefill/decode disaggregation in ``serve``: vLLM's ``--kv-transfer-config`` and its NIXL connector's request
protocol (``kv_transfer_params``), on the engine's held blocks and KV pulls (``simcore/kv_transfer.py``).

* A prefill instance gets ``{"do_remote_decode": true}`` (the proxy sends ``max_tokens`` 1): the request prefills,
  keeps its blocks at its length finish, and its response carries the parameters a decode instance needs
  (``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
  ``remote_port``, ``tp_size``), as ``NixlConnectorScheduler.request_finished`` builds them.
* A decode instance gets those parameters: it allocates the prompt's blocks, pulls the KV it lacks over the
  modelled link (no compute), computes the last prompt token and decodes.
* The pull's completion (or the decode request's abort) frees the prefill side's blocks: NIXL's notification is
  modelled as an HTTP POST to ``/kernelsight/kv_transfer/notify`` on the prefill server, whose own HTTP host and
  port are the ``remote_host``/``remote_port`` it hands out (the "side channel"; ``VLLM_NIXL_SIDE_CHANNEL_HOST``
  overrides the host). Unpulled blocks are freed after ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` simulated seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from kernelsight.argtypes import json_dataclass
from kernelsight.simcore.engine import NIXL_ABORT_REQUEST_TIMEOUT_S, Engine

log = logging.getLogger("kernelsight.server")

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
#: Connectors vLLM 0.33's KVConnectorFactory registers. All of them are accepted; the request protocol simulated is
#: the NIXL connector's (the pull-based P/D connectors, Mooncake and MoRIIO, use the same parameter names).
KNOWN_CONNECTORS = ("NixlConnector", "P2pNcclConnector", "LMCacheConnectorV1", "LMCacheMPConnector",
                    "ExampleConnector", "SharedStorageConnector", "MultiConnector", "MooncakeConnector",
                    "MoRIIOConnector", "OffloadingConnector", "DecodeBenchConnector")
NOTIFY_PATH = "/kernelsight/kv_transfer/notify"
_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass
class KVTransferConfig:
    """vLLM's ``KVTransferConfig`` (vllm/config/kv_transfer.py): same names and defaults."""

    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str | None = "cuda"
    kv_buffer_size: float = 1e9
    kv_role: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"Unsupported kv_role: {self.kv_role}. Supported roles are {KV_ROLES}")
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError(f"Please specify kv_role when kv_connector is set, supported roles are {KV_ROLES}")
        if self.kv_connector is not None and self.kv_connector not in KNOWN_CONNECTORS:
            # vLLM would import kv_connector_module_path; there is no such code to run here
            raise ValueError(f"Unsupported connector type: {self.kv_connector}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None


def parse_kv_transfer_config(text: str) -> KVTransferConfig:
    """argparse type of ``--kv-transfer-config JSON``: errors become one-line argparse messages."""
    return json_dataclass(KVTransferConfig, text)


def abort_timeout_s() -> float:
    """vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT (seconds; here simulated seconds)."""
    raw = os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT")
    return float(raw) if raw else NIXL_ABORT_REQUEST_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class PullSource:
    """Where a decode request's KV lives: the prefill server to notify once it is pulled."""

    host: str
    port: int
    engine_id: str
    request_id: str


@dataclass(frozen=True, slots=True)
class TransferRole:
    """What one request's ``kv_transfer_params`` ask of this instance."""

    hold_kv: bool = False                 # prefill side (do_remote_decode)
    source: PullSource | None = None      # decode side (do_remote_prefill with the prefill side's parameters)


NO_TRANSFER = TransferRole()


def transfer_role(params: Any, single_sequence: bool) -> TransferRole:
    """The request's role from its ``kv_transfer_params`` (the NIXL connector's reading of them)."""
    if not isinstance(params, dict) or not single_sequence:
        return NO_TRANSFER
    if params.get("do_remote_prefill"):
        if params.get("remote_block_ids") is not None and all(params.get(k) is not None for k in _REMOTE_KEYS):
            try:
                source = PullSource(str(params["remote_host"]), int(params["remote_port"]),
                                    str(params["remote_engine_id"]), str(params["remote_request_id"]))
            except (TypeError, ValueError):
                source = None
            if source is not None:
                return TransferRole(source=source)
        log.warning("Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", params)
        return NO_TRANSFER
    if params.get("do_remote_decode"):
        return TransferRole(hold_kv=True)
    return NO_TRANSFER


class KVTransferAgent:
    """One engine's side of the connector: the pulls it must announce to prefill servers, and its engine id."""

    def __init__(self, config: KVTransferConfig, engine: Engine, rank: int, tp_size: int) -> None:
        self.config = config
        # vLLM gives each DP rank its own engine id
        self.engine_id = config.engine_id if rank == 0 else f"{config.engine_id}_dp{rank}"
        self.engine = engine
        self.tp_size = tp_size
        engine.abort_timeout_s = abort_timeout_s()
        self._sources: dict[str, PullSource] = {}
        self._tasks: set[asyncio.Task] = set()
        self.notify_failures = 0

    def expect_pull(self, seq_id: str, source: PullSource) -> None:
        self._sources[seq_id] = source

    def announce_pulls(self) -> None:
        """After a step (or an abort): tell each prefill server whose KV was pulled (or is no longer wanted)."""
        for seq_id, _ in self.engine.take_pulled():
            src = self._sources.pop(seq_id, None)
            if src is not None:
                task = asyncio.get_running_loop().create_task(self._notify(src))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _notify(self, src: PullSource) -> None:
        body = {"remote_engine_id": src.engine_id, "remote_request_id": src.request_id}
        try:
            status = await post_json(src.host, src.port, NOTIFY_PATH, body)
        except (TimeoutError, OSError) as exc:
            status = f"{type(exc).__name__}: {exc}"
        if status != 200:
            self.notify_failures += 1
            log.warning("KV transfer: notifying %s:%s of pulled request %s failed (%s); it frees the blocks after "
                        "its abort timeout", src.host, src.port, src.request_id, status)

    def response_params(self, seq_id: str, host: str, port: int) -> dict[str, Any] | None:
        """The prefill side's ``kv_transfer_params`` for a finished request that kept its blocks (None when it did
        not: an abort, a stop before max_tokens, or blocks already freed)."""
        blocks = self.engine.held_block_ids(seq_id)
        if blocks is None:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [blocks],
                "remote_engine_id": self.engine_id, "remote_request_id": seq_id,
                "remote_host": os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or host, "remote_port": port,
                "tp_size": self.tp_size}

    def release(self, request_id: str) -> bool:
        """A decode side pulled ``request_id``'s blocks: free them now."""
        return self.engine.release_held(request_id)


async def post_json(host: str, port: int, path: str, body: dict, timeout_s: float = 10.0) -> int:
    """A minimal HTTP/1.1 POST (the server has no HTTP client dependency); returns the status code."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout_s)
        parts = status_line.split()
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1
    finally:
        writer.close()
