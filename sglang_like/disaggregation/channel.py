"""The IO thread of a PD worker: owns its ZeroMQ sockets, so other threads only queue sends.

A prefill worker's channel binds a ROUTER on its bootstrap port; a decode worker's opens one
DEALER per prefill worker it talks to (at most `max_peers`; `close_peer` closes one).
Incoming messages go to `on_message(peer, data)` on this thread; `on_tick()` runs about every
`tick_s` (heartbeats, deadlines). Sends from any thread are queued and a pipe wakes the
poller, so a reply leaves at once.

Every message is sealed with the cluster's secret (messages.seal); what arrives unsealed, or
sealed with another key, or over `MAX_MESSAGE_BYTES` (ZeroMQ drops the connection), never
reaches `on_message`.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from sglang_like.disaggregation.messages import MAX_MESSAGE_BYTES, seal, unseal

logger = logging.getLogger(__name__)

MAX_PEERS = 64  # DEALER sockets a decode worker keeps open at once
_REJECT_LOG_S = 10.0  # a flood of bad messages is logged once per this many seconds


def cluster_secret(configured: str | None) -> bytes:
    """The secret the workers of a PD cluster share: the configured one, or else one kept in
    a file only this user can read, so the workers one user starts on one machine pair up
    with nothing to configure and a process of another user cannot join them. Workers on
    different machines need --disaggregation-secret-file (or its environment variable)."""
    if configured:
        return configured.encode()
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or Path.home() / ".cache")
    folder = base / "sglang_like"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / "pd_secret"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    for _ in range(50):  # another worker may have created it and not written it yet
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            if os.fstat(f.fileno()).st_mode & 0o077:
                raise RuntimeError(f"{path} is readable by other users; remove it")
            text = f.read().strip()
        if len(text) == 64:
            return text.encode()
        time.sleep(0.02)
    raise RuntimeError(f"{path} holds no PD secret; remove it")


class Channel:
    def __init__(self, name: str, on_message: Callable[[bytes, bytes], None],
                 on_tick: Callable[[], None] | None = None, tick_s: float = 0.25,
                 bind: str | None = None, *, secret: bytes, send_dir: bytes,
                 recv_dir: bytes, max_peers: int = MAX_PEERS) -> None:
        """`bind` ("tcp://host:port"): a ROUTER there (peers are its identities); else
        DEALERs made on demand (peers are "host:port" of a ROUTER). `secret` seals what is
        sent (`send_dir`) and checks what arrives (`recv_dir`)."""
        self._ctx = zmq.Context.instance()
        self._secret = secret
        self._send_dir, self._recv_dir = send_dir, recv_dir
        self.max_peers = max_peers
        self.num_rejected = 0  # messages dropped: not sealed with the secret
        self._last_reject_log = 0.0
        self._closing: queue.SimpleQueue[bytes] = queue.SimpleQueue()
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
            self._router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self._router.bind(bind)  # raises here (not on the thread) if the port is taken
        self._dealers: dict[bytes, zmq.Socket] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"sglang-like-{name}",
                                        daemon=True)
        self._thread.start()

    def send(self, peer: bytes, data: bytes) -> None:
        """Queue `data` for `peer` (a ROUTER identity, or a DEALER's "host:port")."""
        self._outbox.put((peer, seal(self._secret, self._send_dir, data)))
        self._wake()

    def close_peer(self, peer: bytes) -> None:
        """Close the DEALER to `peer` (a decode worker done with a prefill worker)."""
        self._closing.put(peer)
        self._wake()

    @property
    def num_peers(self) -> int:
        return len(self._dealers)

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
            if len(self._dealers) >= self.max_peers:
                raise zmq.ZMQError(msg=f"{self.max_peers} peers open already")
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
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
                self._close_peers(poller)
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

    def _close_peers(self, poller: zmq.Poller) -> None:
        while True:
            try:
                peer = self._closing.get_nowait()
            except queue.Empty:
                return
            sock = self._dealers.pop(peer, None)
            if sock is not None:
                poller.unregister(sock)
                sock.close(linger=0)

    def _handle(self, peer: bytes, wire: bytes) -> None:
        data = unseal(self._secret, self._recv_dir, wire)
        if data is None:
            self.num_rejected += 1
            now = time.monotonic()
            if now - self._last_reject_log > _REJECT_LOG_S:
                self._last_reject_log = now
                logger.warning("PD message from %r dropped: not sealed with this cluster's "
                               "secret (%d so far)", peer[:64], self.num_rejected)
            return
        try:
            self._on_message(peer, data)
        except Exception:  # noqa: BLE001 - one bad message must not stop the channel
            logger.exception("PD message from %r failed", peer)
