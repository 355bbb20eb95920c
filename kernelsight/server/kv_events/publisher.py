"""The ZeroMQ publisher: a PUB socket for event batches, a ROUTER socket for replays, and a background thread
that hashes, encodes and sends, as vLLM's ``ZmqEventPublisher`` does.

The engine loop only queues each step's simulator events with the step's timestamp (``publish``): turning
internal keys into vLLM's hashes, msgpack encoding and the socket sends run on the thread. Frames are vLLM's:
``[topic, sequence (8-byte big-endian, from 0), payload]``; a replay request ``[identity, "", start_seq]`` on the
ROUTER gets every buffered batch from ``start_seq`` on as ``[identity, "", seq, payload]``, then
``[identity, "", -1 (8 bytes, signed), ""]``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass

import zmq

from kernelsight.server.kv_events.config import KVEventsConfig, endpoint_binds, offset_endpoint
from kernelsight.server.kv_events.hashing import ints_on_wire
from kernelsight.server.kv_events.translate import HashTranslator
from kernelsight.server.kv_events.wire import encode_batch
from kernelsight.simcore.kv_events import KVEvent

log = logging.getLogger("kernelsight.server")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SHUTDOWN_TIMEOUT_S = 1.0


@dataclass
class PublisherStats:
    batches: int = 0          # batches sent
    events: int = 0           # events in them
    dropped: int = 0          # batches refused because the queue was full (max_queue_size)
    replays: int = 0          # replay requests answered


class KVEventPublisher:
    """One engine's (DP rank's) publisher. Sockets are opened in the constructor, so a bad or taken endpoint
    fails the server's start with a one-line ValueError; ``start`` runs the thread."""

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
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = 0
        self._thread: threading.Thread | None = None
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
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name=f"kv-events-dp{self.rank}")
            self._thread.start()

    def publish(self, ts: float, events: list[KVEvent]) -> bool:
        """Queue one step's events (never blocks the engine loop: a full queue drops the batch, counted)."""
        if not events:
            return True
        try:
            self._queue.put_nowait((ts, events))
            return True
        except queue.Full:
            self.stats.dropped += 1
            if self.stats.dropped & (self.stats.dropped - 1) == 0:
                log.warning("kv events: publisher queue full (max_queue_size=%d): %d batches dropped",
                            self.cfg.max_queue_size, self.stats.dropped)
            return False

    def shutdown(self) -> None:
        """Send what is queued (up to a second), then close the sockets."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=SHUTDOWN_TIMEOUT_S * 2)
            self._thread = None
        self._close()

    def _close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        q, replay = self._queue, self._replay
        while True:
            if replay is not None and replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # noqa: BLE001 - a bad replay request must not stop publishing
                    log.exception("kv events: replay failed")
            try:
                item = q.get(timeout=0.1 if replay is None else 0.01)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                self._send(ts, events)
            except Exception:  # noqa: BLE001 - keep publishing; the gap shows in the sequence numbers
                log.exception("kv events: publishing a batch failed")

    def _send(self, ts: float, events: list[KVEvent]) -> None:
        wire = self.translator.translate(events)
        if not wire:
            return
        payload = encode_batch(ts, wire, self.rank, self.array_like)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.stats.batches += 1
        self.stats.events += len(wire)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: invalid replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
        self.stats.replays += 1
