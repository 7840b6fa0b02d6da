"""PD peers are authenticated (issue #49): the review's fake prefill server, named by a
request's bootstrap_host/port, answers a decode worker's registration with a Done whose first
token is 10**9. Without the cluster's secret it is never registered with (so it learns
nothing of the KV pool) and is not heard; with the secret (a buggy or compromised worker)
its token is refused. Either way the prompt does not enter the radix tree with KV nobody
computed, and a request running beside it finishes. And the pieces: sealing, a room tied to
the peer that registered it, bounded registrations, a capped and closed set of sockets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq

from sglang_like import Engine
from sglang_like.disaggregation import messages as m
from sglang_like.disaggregation.channel import cluster_secret
from sglang_like.disaggregation.decode import DecodeManager
from sglang_like.disaggregation.prefill import MAX_REGISTRATIONS, PrefillManager

SECRET = "test-cluster-secret"
SP = {"max_new_tokens": 8, "temperature": 0.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakePrefill:
    """The review's script: a ROUTER on a port that pongs every ping (claiming a pool of
    `kv_dtype`, the decode worker's) and answers every Register with Done(token=10**9),
    signed with `secret` (None: unsigned, as an outsider)."""

    def __init__(self, secret: bytes | None, kv_dtype: str) -> None:
        self.port = _free_port()
        self.secret = secret
        self.kv_dtype = kv_dtype
        self.registers: list[m.Register] = []
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://127.0.0.1:{self.port}")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _send(self, peer: bytes, msg: Any) -> None:
        data = m.encode(msg)
        if self.secret is not None:
            data = m.seal(self.secret, m.TO_DECODE, data)
        self._sock.send_multipart([peer, data])

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            peer, wire = self._sock.recv_multipart()
            data = wire[32:]  # whatever the tag: this script does not check it
            try:
                msg = m.decode_to_prefill(data)
            except msgspec.DecodeError:
                continue
            if isinstance(msg, m.Ping):
                self._send(peer, m.Pong(msg.seq, self.kv_dtype))
            elif isinstance(msg, m.Register):
                self.registers.append(msg)
                self._send(peer, m.Done(msg.room, 10**9))
                for room in range(1, 200):  # and "ends" every other room it can think of
                    self._send(peer, m.Failed(room, "poison"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)


@pytest.fixture(scope="module")
def decode() -> Iterator[Engine]:
    engine = Engine(disaggregation_mode="decode", disaggregation_transfer_timeout=2.0,
                    disaggregation_secret=SECRET, max_total_tokens=4096, log_level="warning")
    yield engine
    engine.shutdown()


def _pd_generate(engine: Engine, ids: list[int], port: int, room: int) -> dict:
    return engine.generate(input_ids=ids, sampling_params=SP, bootstrap_host="127.0.0.1",
                           bootstrap_port=port, bootstrap_room=room)


@pytest.mark.slow
@pytest.mark.parametrize("fake_secret", [None, b"a-guess", SECRET.encode()],
                         ids=["unsigned", "wrong-secret", "the-secret"])
def test_fake_prefill_neither_poisons_the_tree_nor_ends_others(
        decode: Engine, fake_secret: bytes | None) -> None:
    fake = FakePrefill(fake_secret, decode.get_server_info()["kv_cache_dtype"])
    text = f"A prompt the fake prefill worker answers for ({fake_secret!r})."
    ids = decode.tokenizer.encode(text)
    try:
        beside: dict = {}
        runner = threading.Thread(target=lambda: beside.update(
            decode.generate("A request that runs beside it:", {**SP, "max_new_tokens": 24})))
        runner.start()
        out = _pd_generate(decode, ids, fake.port, room=7001)
        runner.join(timeout=60)
    finally:
        fake.close()
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort", reason
    if fake_secret == SECRET.encode():
        assert "outside the vocabulary" in reason["message"], reason
        assert decode.get_server_info()["disaggregation"]["num_bad_done"] >= 1
    else:
        # never registered with: it did not learn where the KV pool is
        assert fake.registers == []
        assert "stopped answering" in reason["message"] or "did not arrive" in reason["message"]
        assert decode.get_server_info()["disaggregation"]["num_rejected"] > 0
    # the request beside it ran to its end, and the tree holds no KV of the fake's
    assert beside["meta_info"]["finish_reason"]["type"] == "length", beside
    # (at most the BOS token, which every prompt here starts with; the fake's prompt is 15)
    assert len(ids) > 10 and decode.cache_match(ids)["matched_tokens"] <= 1
    # the engine still serves
    assert decode.generate("Still serving?", SP)["meta_info"]["finish_reason"]["type"] in (
        "length", "stop")
    deadline = time.monotonic() + 15
    while decode.get_server_info()["disaggregation"]["num_quarantined_slots"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert decode.get_server_info()["kv_pool"]["used_slots"] == 0


# ---- the pieces (no model) ----------------------------------------------------------------
def test_seal_binds_secret_and_direction() -> None:
    data = m.encode(m.Done(3, 5))
    wire = m.seal(b"k", m.TO_DECODE, data)
    assert m.unseal(b"k", m.TO_DECODE, wire) == data
    assert m.unseal(b"other", m.TO_DECODE, wire) is None
    assert m.unseal(b"k", m.TO_PREFILL, wire) is None  # not sent back the way it came
    assert m.unseal(b"k", m.TO_DECODE, data) is None
    assert m.unseal(b"k", m.TO_DECODE, wire[:-1] + b"x") is None


def test_cluster_secret_file_is_private(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    first = cluster_secret(None)
    assert first == cluster_secret(None) and len(first) == 64
    path = tmp_path / "sglang_like" / "pd_secret"
    assert path.stat().st_mode & 0o777 == 0o600
    assert cluster_secret("given") == b"given"
    path.chmod(0o644)
    with pytest.raises(RuntimeError, match="readable by other users"):
        cluster_secret(None)


def _prefill() -> PrefillManager:
    return PrefillManager(SimpleNamespace(), None, "127.0.0.1", _free_port(), 60.0,
                          lambda: None, secret=b"k")


def _register(room: int) -> bytes:
    layout = m.KVLayout("127.0.0.1:1", [1], [2], 8, "bfloat16")
    return m.encode(m.Register(room, layout, 0, [1, 2], 2))


def test_a_room_belongs_to_the_peer_that_registered_it() -> None:
    prefill = _prefill()
    try:
        prefill._on_message(b"decode-a", _register(5))
        prefill._on_message(b"decode-b", _register(5))  # ignored: not b's room
        prefill._on_message(b"decode-b", m.encode(m.Cancel(5)))  # ignored too
        prefill._on_message(b"decode-b", m.encode(m.Cancel(6)))  # nobody's room
        assert prefill._registrations[5][0] == b"decode-a"
        assert prefill._cancels == []
        prefill._on_message(b"decode-a", m.encode(m.Cancel(5)))
        assert prefill._cancels == [(b"decode-a", 5)]
    finally:
        prefill.close()


def test_registrations_are_bounded() -> None:
    prefill = _prefill()
    sent: list[tuple[bytes, bytes]] = []
    prefill.channel.send = lambda peer, data: sent.append((peer, data))  # type: ignore
    try:
        for room in range(MAX_REGISTRATIONS + 3):
            prefill._on_message(b"decode-a", _register(room))
        assert len(prefill._registrations) == MAX_REGISTRATIONS
        failed = [m.decode_to_decode(d) for _, d in sent]
        assert len(failed) == 3 and all(isinstance(f, m.Failed) for f in failed)
    finally:
        prefill.close()


def test_decode_side_hears_only_verified_peers_about_their_own_rooms() -> None:
    layout = m.KVLayout("127.0.0.1:1", [1], [2], 8, "bfloat16")
    dm = DecodeManager(SimpleNamespace(layout=layout, kv_dtype="bfloat16"), 60.0,
                       lambda: None, secret=b"k", vocab_size=100)
    sent: list[tuple[bytes, bytes]] = []
    dm.channel.send = lambda peer, data: sent.append((peer, data))  # type: ignore
    try:
        dm._watch(b"p1:1", 11, time.perf_counter() + 60)
        dm._watch(b"p2:2", 22, time.perf_counter() + 60)
        dm._send_register(b"p1:1", b"register-11")
        # a ping with a nonce went to each; the Register waits for p1's proof
        assert [p for p, _ in sent] == [b"p1:1", b"p2:2"]
        nonce = m.decode_to_prefill(sent[0][1]).seq
        dm._on_message(b"p1:1", m.encode(m.Done(11, 5)))  # unverified: not heard
        dm._on_message(b"p1:1", m.encode(m.Pong(nonce + 1, "bfloat16")))  # not our nonce
        assert dm._events == [] and not dm._peers[b"p1:1"].verified
        dm._on_message(b"p1:1", m.encode(m.Pong(nonce, "bfloat16")))
        assert dm._peers[b"p1:1"].verified and sent[-1] == (b"p1:1", b"register-11")
        dm._on_message(b"p1:1", m.encode(m.Failed(22, "not yours")))  # p2's room
        dm._on_message(b"unknown:3", m.encode(m.Failed(11, "who?")))
        assert dm._events == []
        dm._on_message(b"p1:1", m.encode(m.Done(11, 5)))
        assert dm._events == [(b"p1:1", m.Done(11, 5))]
        # p2 never proves itself: it is found dead, and its socket closed
        closed: list[bytes] = []
        dm.channel.close_peer = closed.append  # type: ignore
        dm._peers[b"p2:2"].last_heard -= 10
        dm._tick()
        assert ("dead", b"p2:2") in dm._events
        assert closed == [b"p2:2"] and b"p2:2" not in dm._peers
    finally:
        dm.close()


def test_a_request_cannot_send_the_decode_worker_to_any_host(make_engine: Any) -> None:
    """bootstrap_host is the client's word: outside loopback, only the hosts the operator
    allowed (--disaggregation-allowed-peers) are reached; others are a 400 before anything
    is submitted."""
    from sglang_like.engine import check_bootstrap_peer

    engine = make_engine()
    with pytest.raises(ValueError, match="not an allowed prefill peer"):
        engine.generate("Hi", {"max_new_tokens": 1}, bootstrap_host="203.0.113.7",
                        bootstrap_port=8998, bootstrap_room=3)
    for host in (None, "127.0.0.1", "127.1.2.3", "::1", "localhost"):
        check_bootstrap_peer(host, ())
    check_bootstrap_peer("10.1.2.3", ("10.1.2.3",))
    for host in ("10.1.2.3", "example.org", "0.0.0.0"):
        with pytest.raises(ValueError, match="allowed prefill peer"):
            check_bootstrap_peer(host, ("10.9.9.9",))
