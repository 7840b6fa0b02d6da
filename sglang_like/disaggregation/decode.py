"""The decode worker of a PD pair: allocate the prompt's slots, have them filled, decode.

A request that carries a bootstrap room is matched against this worker's radix tree and
given slots for the rest of its prompt; the decode worker registers those slots with the
prefill worker named by `bootstrap_host:bootstrap_port` and waits. When the prefill side
reports the room Done, the prompt's KV is in the slots: the request enters the running batch
as if its prefill had just run here (the prompt goes into this worker's tree), with the
first token the prefill worker sampled, and decodes from there. No prompt token is computed
here.

Nothing is lost when the other side fails: a Failed message, a prefill worker that stops
answering pings (`PEER_DEAD_S`), or a transfer that takes longer than
`--disaggregation-transfer-timeout` ends the request with an error and frees its slots. Slots
a live prefill worker might still write (a timeout, an abort) are held until it confirms
the cancel, or is found dead.

The bootstrap host and port come with the request, so they are not trusted: a room is
registered with a peer only once it has answered a fresh nonce under the cluster's secret
(channel.py), a peer's Done / Failed / Cancelled counts only for the rooms registered with
that peer, the first token of a Done must be in the vocabulary, at most `MAX_PEERS` peers
are talked to at once, and a peer's socket is closed once nothing is in flight with it.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sglang_like.disaggregation.messages as m
from sglang_like.disaggregation.channel import MAX_PEERS, Channel
from sglang_like.disaggregation.transfer import MooncakeKVTransfer
from sglang_like.req import FinishReason, Req

if TYPE_CHECKING:
    from sglang_like.schedule_batch import ScheduleBatch
    from sglang_like.scheduler.plugins import DisaggContext

logger = logging.getLogger(__name__)

PING_S = 0.5  # how often a prefill worker with rooms in flight is pinged
PEER_DEAD_S = 3.0  # no answer for this long: the prefill worker is gone
IDLE_CLOSE_S = 30.0  # a peer with nothing in flight this long: its socket is closed
_NONCES_KEPT = 8  # a Pong may answer one of the last pings


@dataclasses.dataclass
class DecodeRoom:
    """One request's transfer, on the decode side."""

    room: int
    peer: bytes  # "host:port" of the prefill worker's bootstrap channel
    deadline: float
    slots: list[int] = dataclasses.field(default_factory=list)
    start: int = 0  # prompt positions below this came from this worker's own cache


@dataclasses.dataclass
class _Peer:
    rooms: set[int] = dataclasses.field(default_factory=set)
    last_ping: float = 0.0
    last_heard: float = 0.0  # last message of any kind from it
    verified: bool = False  # it answered a nonce of ours under the secret
    nonces: list[int] = dataclasses.field(default_factory=list)  # of the last pings
    pending: list[bytes] = dataclasses.field(default_factory=list)  # Registers to send
    idle_since: float = 0.0
    refusal: str | None = None  # why no room is registered with it (its pool's dtype)


class DecodeManager:
    """Owned by the scheduler (its `disagg`, a `scheduler.plugins.DisaggHooks`); every method
    but the channel's runs on the loop thread."""

    mode = "decode"

    def __init__(self, kv: MooncakeKVTransfer, timeout_s: float, wake: Any, *,
                 secret: bytes, vocab_size: int) -> None:
        self.kv = kv
        self.timeout_s = timeout_s
        self.vocab_size = vocab_size
        self._wake = wake
        self._lock = threading.Lock()
        self._events: list[Any] = []  # messages and ("dead", peer) / ("late", room), in order
        self._peers: dict[bytes, _Peer] = {}
        self._deadlines: dict[int, float] = {}
        self._queue: list[Req] = []  # waiting for slots
        self._transferring: dict[int, Req] = {}
        self._quarantine: dict[int, tuple[bytes, list[int]]] = {}  # slots a peer may still write
        self.num_received = self.num_failed = self.bytes_received = 0
        self.num_transferred_tokens = 0
        self.num_bad_done = 0  # Done messages refused (a first token outside the vocabulary)
        self.channel = Channel("pd-decode", self._on_message, on_tick=self._tick,
                               secret=secret, send_dir=m.TO_PREFILL, recv_dir=m.TO_DECODE)

    # ---- the channel's thread ------------------------------------------------------------
    def _on_message(self, peer: bytes, data: bytes) -> None:
        msg = m.decode_to_decode(data)
        now = time.perf_counter()
        with self._lock:
            state = self._peers.get(peer)
            if state is None:
                return  # not a peer of ours (any more)
            if isinstance(msg, m.Pong):
                if not self._on_pong(peer, state, msg, now):
                    return
            else:
                if not state.verified or msg.room not in state.rooms:
                    return  # only a room registered with this very peer is its to report on
                state.last_heard = now
                state.rooms.discard(msg.room)
                if not state.rooms:
                    state.idle_since = now
                self._deadlines.pop(msg.room, None)
                self._events.append((peer, msg))
        self._wake()

    def _on_pong(self, peer: bytes, state: _Peer, msg: m.Pong, now: float) -> bool:
        """A Pong (under the lock): the first answer to our nonce verifies the peer, and
        either sends its pending Registers or refuses it; True when the loop has news."""
        if msg.seq not in state.nonces:
            return False  # not an answer to us: a replay proves nothing
        state.last_heard = now
        if state.verified:
            return False
        state.verified = True
        if msg.kv_dtype != self.kv.kv_dtype:
            # its KV would be read as codes of another type: garbage, not an error
            state.refusal = (
                f"the prefill worker {peer.decode()} keeps its KV pool as "
                f"{msg.kv_dtype or 'unknown'}, this decode worker as {self.kv.kv_dtype}: "
                "both workers need the same --kv-cache-dtype")
            state.pending.clear()
            self._events.append(("refused", peer))
            return True
        for data_out in state.pending:
            self.channel.send(peer, data_out)
        state.pending.clear()
        return False

    def _ping(self, peer: bytes, state: _Peer, now: float) -> None:
        nonce = secrets.randbits(63)
        state.nonces = [*state.nonces[-(_NONCES_KEPT - 1):], nonce]
        state.last_ping = now
        self.channel.send(peer, m.encode(m.Ping(nonce)))

    def _tick(self) -> None:
        now = time.perf_counter()
        woke = False
        with self._lock:
            for peer, state in list(self._peers.items()):
                if not state.rooms:
                    if now - state.idle_since > IDLE_CLOSE_S:
                        del self._peers[peer]
                        self.channel.close_peer(peer)
                    continue
                if now - state.last_heard > PEER_DEAD_S:
                    self._events.append(("dead", peer))
                    del self._peers[peer]
                    self.channel.close_peer(peer)
                    for room in state.rooms:
                        self._deadlines.pop(room, None)
                    woke = True
                elif now - state.last_ping >= PING_S:
                    self._ping(peer, state, now)
            for room, deadline in list(self._deadlines.items()):
                if deadline < now:
                    del self._deadlines[room]
                    self._events.append(("late", room))
                    woke = True
        if woke:
            self._wake()

    def _watch(self, peer: bytes, room: int, deadline: float) -> None:
        with self._lock:
            state = self._peers.setdefault(peer, _Peer())
            if not state.rooms:
                # heard "now": PEER_DEAD_S of silence from here on means the worker is not
                # there (or cannot answer our nonce: it lacks the secret)
                state.last_heard = time.perf_counter()
                if not state.verified:
                    self._ping(peer, state, state.last_heard)
            state.rooms.add(room)
            self._deadlines[room] = deadline

    def _send_register(self, peer: bytes, data: bytes) -> None:
        """A Register tells where our KV pool lies: it goes to a verified peer only."""
        with self._lock:
            state = self._peers[peer]
            if state.refusal is not None:
                self._events.append(("refused", peer))  # ends the room in the next poll
            elif state.verified:
                self.channel.send(peer, data)
            else:
                state.pending.append(data)

    def _room_ended(self, peer: bytes, room: int) -> None:
        """Forget a room the peer will say no more about (we gave it up for good)."""
        with self._lock:
            state = self._peers.get(peer)
            if state is not None:
                state.rooms.discard(room)
                if not state.rooms:
                    state.idle_since = time.perf_counter()

    # ---- the scheduler's calls -----------------------------------------------------------
    @property
    def has_news(self) -> bool:
        return bool(self._events) or bool(self._queue)

    def refuse(self, rooms: list[tuple[str, int, int]], message: str) -> None:
        """This worker turned away PD requests (a 400 at its door): tell their prefill
        workers, whose halves would otherwise wait for a registration until the timeout."""
        now = time.perf_counter()
        with self._lock:
            for host, port, room in rooms:
                peer = f"{host}:{port}".encode()
                if peer not in self._peers:
                    if len(self._peers) >= MAX_PEERS:
                        continue
                    # no room: its socket closes after IDLE_CLOSE_S (the message is gone by then)
                    self._peers[peer] = _Peer(idle_since=now)
                self.channel.send(peer, m.encode(m.Refuse(room, message)))

    def add(self, req: Req) -> None:
        host, port, room = req.bootstrap
        if (room in self._transferring or room in self._quarantine
                or any(r.bootstrap[2] == room for r in self._queue)):
            req.finish(FinishReason("abort", status_code=400, message=(
                f"bootstrap room {room} is already in use on this decode worker")))
            return
        peer = f"{host}:{port}".encode()
        with self._lock:
            num_peers = len(self._peers | {r.pd.peer: None for r in self._queue})
            known = peer in self._peers or any(r.pd.peer == peer for r in self._queue)
        if not known and num_peers >= MAX_PEERS:
            req.finish(FinishReason("abort", message=(
                f"this decode worker talks to {MAX_PEERS} prefill workers already")))
            return
        req.pd = DecodeRoom(room, peer, deadline=time.perf_counter() + self.timeout_s)
        # the prefill worker reports the prompt's logprobs (the router joins them in front)
        req.logprob_start_len = -1
        self._queue.append(req)

    def poll(self, ctx: DisaggContext, touched: list[Req]) -> None:
        """Apply what the channel heard (transfers done or failed, peers lost, deadlines),
        then admit queued requests."""
        with self._lock:
            events, self._events = self._events, []
        for event in events:
            self._apply(event, ctx, touched)
        self._admit(ctx, touched)

    def _admit(self, ctx: DisaggContext, touched: list[Req]) -> None:
        """Give queued requests their slots (in arrival order) and register them."""
        cache = ctx.cache
        now = time.perf_counter()
        while self._queue:
            req = self._queue[0]
            state: DecodeRoom = req.pd
            if state.deadline < now:
                self._queue.pop(0)
                self._end(req, f"no KV slots for this request within {self.timeout_s:g} s",
                          ctx, touched)
                continue
            if (cache.req_to_token_pool.num_free_rows == 0
                    or len(ctx.running) + len(self._transferring)
                    >= ctx.max_running_requests):
                return
            match_len, unlocked = cache.peek(req.origin_input_ids, req.cache_namespace)
            reserve = 8 * (len(ctx.running) + len(self._transferring))
            if req.prompt_len - match_len + 1 + reserve > cache.num_available_slots - unlocked:
                return
            cache.match_and_lock(req, req.prompt_len)
            slots = cache.alloc_slots(req.prompt_len - req.kv_len)
            if slots is None:
                cache.release(req)
                return
            self._queue.pop(0)
            state.start, state.slots = req.kv_len, slots
            cache.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots)
            ctx.record_admission(req)
            self._transferring[state.room] = req
            self._watch(state.peer, state.room, state.deadline)
            self._send_register(state.peer, m.encode(m.Register(
                state.room, self.kv.layout, state.start, slots, req.prompt_len,
                lora_name=req.lora_name)))

    def _apply(self, event: Any, ctx: DisaggContext, touched: list[Req]) -> None:
        if event[0] == "dead":
            peer = event[1]
            for room, (owner, _) in list(self._quarantine.items()):
                if owner == peer:  # a dead worker writes nothing more
                    ctx.cache.allocator.free(self._quarantine.pop(room)[1])
            for room, req in list(self._transferring.items()):
                if req.pd.peer == peer:
                    del self._transferring[room]
                    self._fail(req, f"the prefill worker {peer.decode()} stopped answering "
                                    f"(no reply for {PEER_DEAD_S:g} s)", ctx, touched)
            return
        if event[0] == "refused":  # nothing was registered with it: nothing can be written
            peer = event[1]
            with self._lock:
                state = self._peers.get(peer)
                refusal = state.refusal if state is not None else None
            for room, req in list(self._transferring.items()):
                if req.pd.peer == peer and refusal is not None:
                    del self._transferring[room]
                    self._room_ended(peer, room)
                    self._fail(req, refusal, ctx, touched)
            return
        if event[0] == "late":
            held = self._quarantine.pop(event[1], None)
            if held is not None:  # a cancel never confirmed: reuse the slots at last
                logger.warning("bootstrap room %d: no answer to its cancel; freeing its slots",
                               event[1])
                self._room_ended(held[0], event[1])
                ctx.cache.allocator.free(held[1])
                return
            req = self._transferring.pop(event[1], None)
            if req is not None:
                self._give_up(req, f"the KV of this request did not arrive within "
                                   f"{self.timeout_s:g} s", ctx, touched)
            return
        peer, event = event
        room = event.room
        held = self._quarantine.get(room)
        if held is not None and held[0] == peer:  # the prefill side let go of a room given up
            del self._quarantine[room]
            ctx.cache.allocator.free(held[1])
            self._room_ended(peer, room)
            return
        req = self._transferring.get(room)
        if req is None or req.pd.peer != peer:
            return  # a room of another peer's: not this one's to end
        del self._transferring[room]
        self._room_ended(peer, room)
        if isinstance(event, m.Done):
            self._commit(req, event, ctx, touched)
        elif isinstance(event, m.Failed):
            how = "refused the request" if event.status_code == 400 else "failed"
            self._fail(req, f"the prefill worker {how}: {event.message}", ctx, touched,
                       status_code=event.status_code)
        else:  # Cancelled without our cancel: nothing more comes for it
            self._fail(req, "the prefill worker cancelled the transfer", ctx, touched)

    def _commit(self, req: Req, done: m.Done, ctx: DisaggContext, touched: list[Req]) -> None:
        """The prompt's KV is in place: the request continues as one that just prefilled."""
        state: DecodeRoom = req.pd
        tokens = [done.token, *(t for _, t in done.top_logprobs or ())]
        if any(not 0 <= t < self.vocab_size for t in tokens):
            # the next forward would index the embedding with it and fail everyone's batch
            self.num_bad_done += 1
            self._fail(req, f"the prefill worker sent a first token outside the vocabulary "
                            f"[0, {self.vocab_size})", ctx, touched)
            return
        req.kv_len = req.prompt_len
        self.num_received += 1
        self.bytes_received += done.num_bytes
        self.num_transferred_tokens += req.prompt_len - state.start
        req.pd = None
        ctx.join_running(req, done.token, done.logprob, done.top_logprobs, touched)

    def _fail(self, req: Req, message: str, ctx: DisaggContext, touched: list[Req],
              status_code: int | None = None) -> None:
        """End a transferring request whose slots nobody will write any more."""
        ctx.cache.allocator.free(req.pd.slots)
        self._end(req, message, ctx, touched, status_code)

    def _give_up(self, req: Req, message: str, ctx: DisaggContext, touched: list[Req]) -> None:
        """End a transferring request whose prefill worker may still write its slots: they
        are held until it confirms the cancel (or dies)."""
        state: DecodeRoom = req.pd
        self._quarantine[state.room] = (state.peer, state.slots)
        self._watch(state.peer, state.room, time.perf_counter() + self.timeout_s)
        self.channel.send(state.peer, m.encode(m.Cancel(state.room)))
        self._end(req, message, ctx, touched)

    def _end(self, req: Req, message: str, ctx: DisaggContext, touched: list[Req],
             status_code: int | None = None) -> None:
        self.num_failed += 1
        req.finish(FinishReason("abort", message=message, status_code=status_code))
        req.pd = None
        ctx.cache.release(req)
        touched.append(req)

    def abort(self, rid: str, ctx: DisaggContext) -> Req | None:
        for req in self._queue:
            if req.rid == rid:
                self._queue.remove(req)
                req.finish(FinishReason("abort", message="aborted"))
                req.pd = None
                return req
        for room, req in list(self._transferring.items()):
            if req.rid == rid:
                del self._transferring[room]
                ended: list[Req] = []
                self._give_up(req, "aborted", ctx, ended)
                return req
        return None

    def abort_all(self, message: str, ctx: DisaggContext) -> list[Req]:
        reqs: list[Req] = []
        for req in list(self._queue):
            self.abort(req.rid, ctx)
            reqs.append(req)
        for req in list(self._transferring.values()):
            self.abort(req.rid, ctx)
            reqs.append(req)
        for req in reqs:
            req.finished_reason = FinishReason("abort", message=message)
        return reqs

    # ---- the forward's hooks: nothing to do on the decode side ---------------------------
    def before_forward(self, batch: ScheduleBatch) -> Callable[[int], None] | None:
        return None

    def after_forward(self) -> None:
        pass

    def after_process(self, batch: ScheduleBatch) -> None:
        pass

    def report_ended(self) -> None:
        pass  # a batch's requests are past their transfer: the prefill side is done with them

    # ---- accounting ----------------------------------------------------------------------
    @property
    def num_inflight(self) -> int:
        return len(self._queue) + len(self._transferring)

    def held_slots(self) -> list[int]:
        """Allocated slots no request row accounts for yet: transfers and quarantine."""
        held = [s for req in self._transferring.values() for s in req.pd.slots]
        return held + [s for _, slots in self._quarantine.values() for s in slots]

    def held_reqs(self) -> list[Req]:
        """Requests holding a row (and a locked prefix) outside the running batch."""
        return list(self._transferring.values())

    def info(self) -> dict[str, Any]:
        return {"mode": self.mode, "session": self.kv.session,
                "num_inflight": self.num_inflight, "num_received": self.num_received,
                "num_failed": self.num_failed, "bytes_received": self.bytes_received,
                "num_transferred_tokens": self.num_transferred_tokens,
                "num_quarantined_slots": sum(len(s) for _, s in self._quarantine.values()),
                "num_peers": len(self._peers), "num_rejected": self.channel.num_rejected,
                "num_bad_done": self.num_bad_done}

    def close(self) -> None:
        self.channel.close()
