"""The IO thread of a PD worker: owns its ZeroMQ sockets, so other threads only queue sends.

A prefill worker's channel binds a ROUTER on its bootstrap port; a decode worker's opens one
DEALER per prefill worker it talks to. Incoming messages go to `on_message(peer, data)` on
this thread; `on_tick()` runs about every `tick_s` (heartbeats, deadlines). Sends from any
thread are queued and a pipe wakes the poller, so a reply leaves at once.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)


class Channel:
    def __init__(self, name: str, on_message: Callable[[bytes, bytes], None],
                 on_tick: Callable[[], None] | None = None, tick_s: float = 0.25,
                 bind: str | None = None) -> None:
        """`bind` ("tcp://host:port"): a ROUTER there (peers are its identities); else
        DEALERs made on demand (peers are "host:port" of a ROUTER)."""
        self._ctx = zmq.Context.instance()
        self._on_message = on_message
        self._on_tick = on_tick
        self._tick_ms = int(tick_s * 1000)
        self._outbox: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe already wakes the thread
        self._router: zmq.Socket | None = None
        if bind is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises, not drops
            self._router.bind(bind)  # raises here (not on the thread) if the port is taken
        self._dealers: dict[bytes, zmq.Socket] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"sglang-like-{name}",
                                        daemon=True)
        self._thread.start()

    def send(self, peer: bytes, data: bytes) -> None:
        """Queue `data` for `peer` (a ROUTER identity, or a DEALER's "host:port")."""
        self._outbox.put((peer, data))
        self._wake()

    def close(self) -> None:
        self._stopped = True
        self._wake()
        self._thread.join(timeout=5)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full (the thread will wake anyway) or closed (it has stopped)
            pass

    # ---- the IO thread -------------------------------------------------------------------
    def _dealer(self, peer: bytes, poller: zmq.Poller) -> zmq.Socket:
        sock = self._dealers.get(peer)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{peer.decode()}")
            poller.register(sock, zmq.POLLIN)
            self._dealers[peer] = sock
        return sock

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        try:
            while not self._stopped:
                events = dict(poller.poll(self._tick_ms))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                self._flush(poller)
                if self._router is not None and self._router in events:
                    while self._router.poll(0):
                        peer, data = self._router.recv_multipart()
                        self._handle(peer, data)
                for peer, sock in list(self._dealers.items()):
                    if sock in events:
                        while sock.poll(0):
                            self._handle(peer, sock.recv())
                if self._on_tick is not None:
                    try:
                        self._on_tick()
                    except Exception:  # noqa: BLE001 - the channel outlives a bad tick
                        logger.exception("PD channel tick failed")
        finally:
            for sock in [*self._dealers.values(), self._router]:
                if sock is not None:
                    sock.close(linger=0)
            self._stopped = True
            os.close(self._wake_r)

    def _flush(self, poller: zmq.Poller) -> None:
        while True:
            try:
                peer, data = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                if self._router is not None:
                    self._router.send_multipart([peer, data])
                else:
                    self._dealer(peer, poller).send(data)
            except zmq.ZMQError as exc:  # a peer that went away: its side times out
                logger.warning("PD message to %r not sent: %s", peer, exc)

    def _handle(self, peer: bytes, data: bytes) -> None:
        try:
            self._on_message(peer, data)
        except Exception:  # noqa: BLE001 - one bad message must not stop the channel
            logger.exception("PD message from %r failed", peer)
