"""The ZeroMQ publisher: a PUB socket for event batches and a ROUTER socket for replays.

Frames are vLLM's: ``[topic, sequence (8-byte big-endian, from 0), payload]``; a replay request
``[identity, "", start_seq]`` on the ROUTER gets every buffered batch from ``start_seq`` on as
``[identity, "", seq, payload]``, then ``[identity, "", -1 (8 bytes, signed), ""]``.

Where the work runs differs from vLLM on purpose. vLLM's engine core queues each step's batch to a publisher
thread, which is cheap there (the engine core is its own process). Here the engine loop shares its process and
its GIL: a publisher thread that woke for every step took the GIL from the loop each time. Measured with
``benchmarks/kv_events.py`` (2 replicas × 32 streams paced to equal throughput, a loaded 2-core VM), the server
spent +18% / +29% CPU per token with events on through such a thread, against +1% / +23% in the same two rounds
when the loop itself turns the keys into vLLM's hashes, encodes and sends (a non-blocking send: ZeroMQ's own I/O
thread writes the socket) right after the step's tokens are written; three more pairs of the latter gave +7.1%,
+1.7% and +14.4%. The replay socket is served by a background thread that sleeps in ``poll`` with the GIL
released, so it costs nothing until a subscriber asks.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kernelsight.server.integrations.kv_events.config import KVEventsConfig, endpoint_binds, offset_endpoint
from kernelsight.server.integrations.kv_events.hashing import ints_on_wire
from kernelsight.server.integrations.kv_events.translate import HashTranslator
from kernelsight.server.integrations.kv_events.wire import WireEvent, encode_batch
from kernelsight.simcore.kv_events import KVEvent

log = logging.getLogger("kernelsight.server")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_POLL_MS = 100


@dataclass
class PublisherStats:
    batches: int = 0          # batches sent
    events: int = 0           # events in them
    dropped: int = 0          # batches ZeroMQ refused (the PUB socket at its high-water mark)
    replays: int = 0          # replay requests answered


class KVEventPublisher:
    """One engine's (DP rank's) publisher. Sockets are opened in the constructor, so a bad or taken endpoint
    fails the server's start with a one-line ValueError; ``start`` runs the replay thread."""

    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: int = 0, port_offset: int = 0, *,
                 hash_algo: str = "sha256", array_like: bool = False) -> None:
        self.cfg = cfg
        self.rank = data_parallel_rank
        self.endpoint = offset_endpoint(cfg.endpoint, port_offset)
        self.replay_endpoint = offset_endpoint(cfg.replay_endpoint, port_offset)
        self.array_like = array_like
        self.translator = HashTranslator(hash_algo, ints_on_wire())
        self.stats = PublisherStats()
        self._topic = cfg.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)   # appended by the loop only
        self._seq = 0
        # in-process subscribers (the gRPC SubscribeKvEvents streams): called with (seq, ts, events) per batch
        self.listeners: list[Callable[[int, float, list[WireEvent]], None]] = []
        self._thread: threading.Thread | None = None
        self._stop = False
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(cfg.hwm)
            self._open(self._pub, self.endpoint, endpoint_binds(self.endpoint or ""))
            if self.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._open(self._replay, self.replay_endpoint, True)
        except ValueError:
            self._close()
            raise

    @staticmethod
    def _open(sock: zmq.Socket, endpoint: str | None, bind: bool) -> None:
        if not endpoint:
            raise ValueError("--kv-events-config: endpoint must not be empty")
        try:
            sock.bind(endpoint) if bind else sock.connect(endpoint)
        except zmq.ZMQError as exc:
            verb = "bind" if bind else "connect to"
            raise ValueError(f"--kv-events-config: cannot {verb} {endpoint}: {exc}") from None

    # -- the engine loop's side -----------------------------------------------------------------
    def start(self) -> None:
        if self._replay is not None and self._thread is None:
            self._thread = threading.Thread(target=self._replay_loop, daemon=True, name=f"kv-replay-dp{self.rank}")
            self._thread.start()

    def publish(self, ts: float, events: list[KVEvent]) -> bool:
        """Send one step's events as one batch (False: ZeroMQ dropped it at the high-water mark; its sequence
        number is spent, so subscribers see the gap and can replay it)."""
        wire = self.translator.translate(events)
        if not wire:
            return True
        payload = encode_batch(ts, wire, self.rank, self.array_like)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self.stats.batches += 1
        self.stats.events += len(wire)
        for listener in self.listeners:
            listener(seq, ts, wire)
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.stats.dropped += 1
            if self.stats.dropped & (self.stats.dropped - 1) == 0:
                log.warning("kv events: PUB socket at its high-water mark (hwm=%d): %d batches dropped",
                            self.cfg.hwm, self.stats.dropped)
            return False

    def shutdown(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join(timeout=2 * REPLAY_POLL_MS / 1000)
            self._thread = None
        self._close()

    def _close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -- the replay thread ----------------------------------------------------------------------
    def _replay_loop(self) -> None:
        replay = self._replay
        assert replay is not None
        while not self._stop:
            try:
                if replay.poll(REPLAY_POLL_MS):
                    self._serve_replay()
            except zmq.ZMQError:
                if self._stop:
                    return       # closed under us at shutdown
                log.exception("kv events: replay failed")
            except Exception:  # noqa: BLE001 - a bad replay request must not stop the thread
                log.exception("kv events: replay failed")

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: invalid replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        # list() copies the deque in one C call under the GIL: a consistent snapshot while the loop appends
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        # counted before the end marker goes out: a client that got it may read the count at once
        self.stats.replays += 1
        self._replay.send_multipart((client, b"", END_SEQ, b""))
