"""The prefill worker of a PD pair: wait for the decode side, run the prompt, stream its KV.

A request that carries `bootstrap_room` waits here until the decode worker has registered
the room (the slots it allocated for the prompt, in its pool). It then runs as an ordinary
request that stops after its first token; while its forward runs, each layer's K/V for the
request's new positions is written into the decode worker's slots by a sender thread as soon
as that layer has stored it (`on_layer`), so the transfer of layer i overlaps the compute of
layers i+1... The step waits for the last writes before it ends (the slots stay the
request's until then), and the first token follows in a Done message.

Everything that ends a room without a Done (a failed write, an abort, a timeout, a bad
registration) sends Failed, so the decode side never waits for nothing.

Only peers holding the cluster's secret are heard (channel.py). A room belongs to the peer
that registered it first: another peer's Register or Cancel for it is ignored. At most
`MAX_REGISTRATIONS` registrations wait for their request at once.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sglang_like.disaggregation.messages as m
from sglang_like.disaggregation.channel import Channel
from sglang_like.disaggregation.transfer import MooncakeKVTransfer, slot_runs
from sglang_like.req import FinishReason, Req

if TYPE_CHECKING:
    from sglang_like.schedule_batch import ScheduleBatch
    from sglang_like.scheduler.plugins import DisaggContext

logger = logging.getLogger(__name__)

_RECENT = 64  # transfer records kept for get_server_info (benchmarks, tests)
MAX_REGISTRATIONS = 4096  # registered rooms whose request has not come yet


@dataclasses.dataclass
class PrefillRoom:
    """One request's transfer, on the prefill side."""

    room: int
    peer: bytes  # the decode worker's channel identity
    reg: m.Register
    sent_upto: int  # prompt positions below this are written (or were cached there)
    num_bytes: int = 0
    error: str | None = None
    done_sent: bool = False
    t_registered: float = 0.0
    write_seconds: float = 0.0  # inside the transfer engine's writes
    layer_computed: list[float] = dataclasses.field(default_factory=list)
    layer_sent: list[float] = dataclasses.field(default_factory=list)


class _Sender:
    """The thread that performs the writes a forward's layer hook queues, in order."""

    def __init__(self, kv: MooncakeKVTransfer) -> None:
        self.kv = kv
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="sglang-like-pd-sender", daemon=True).start()

    def put(self, layer: int, work: list[tuple[PrefillRoom, list[tuple[int, int, int]]]]) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._jobs.put((layer, work))

    def wait(self) -> None:
        self._idle.wait()

    def _run(self) -> None:
        while True:
            layer, work = self._jobs.get()
            for room, runs in work:
                if room.error is not None:
                    continue
                t0 = time.perf_counter()
                try:
                    room.num_bytes += self.kv.write_layer(room.reg.layout, layer, runs)
                except Exception as exc:  # noqa: BLE001 - fails this room, not the worker
                    room.error = f"KV transfer to the decode worker failed: {exc}"
                now = time.perf_counter()
                room.write_seconds += now - t0
                room.layer_sent.append(now)
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()


class PrefillManager:
    """Owned by the scheduler (its `disagg`, a `scheduler.plugins.DisaggHooks`); every method
    but the channel's runs on the loop thread."""

    mode = "prefill"

    def __init__(self, kv: MooncakeKVTransfer, req_to_token_pool: Any, host: str,
                 bootstrap_port: int, timeout_s: float, wake: Any, *,
                 secret: bytes, loras: Any = None) -> None:
        self.kv = kv
        self.loras = loras  # the scheduler's LoraRegistry (None: LoRA off), read on the loop
        self.req_to_token_pool = req_to_token_pool
        self.timeout_s = timeout_s
        self._wake = wake
        self._lock = threading.Lock()
        self._registrations: dict[int, tuple[bytes, m.Register, float]] = {}
        self._cancels: list[tuple[bytes, int]] = []
        # rooms whose request one side turned away (400): room -> (why, when); the other
        # half of it ends at once when it comes (or is here)
        self._refused: dict[int, tuple[str, float]] = {}
        self._room_peers: dict[int, bytes] = {}  # room -> the peer that registered it
        self._news = False
        self._waiting: dict[int, tuple[Req, float]] = {}  # room -> (req, deadline)
        self._first_deadline = float("inf")  # of _waiting (an early one only wakes the loop)
        self._active: dict[int, tuple[Req, PrefillRoom]] = {}
        self._sender = _Sender(kv)
        self.recent: deque[dict[str, Any]] = deque(maxlen=_RECENT)
        self.num_transfers = self.num_failed = self.bytes_sent = 0
        self.write_seconds = 0.0  # summed over transfers: bytes_sent / it is the write rate
        self.bootstrap_port = bootstrap_port
        self.channel = Channel("pd-bootstrap", self._on_message, on_tick=self._tick,
                               bind=f"tcp://{host}:{bootstrap_port}", secret=secret,
                               send_dir=m.TO_DECODE, recv_dir=m.TO_PREFILL)

    # ---- the channel's thread ------------------------------------------------------------
    def _on_message(self, peer: bytes, data: bytes) -> None:
        msg = m.decode_to_prefill(data)
        if isinstance(msg, m.Ping):
            self.channel.send(peer, m.encode(m.Pong(msg.seq, self.kv.kv_dtype)))
            return
        with self._lock:
            owner = self._room_peers.get(msg.room)
            if owner is not None and owner != peer:
                return  # another peer's room: not this one's to register or cancel
            if isinstance(msg, m.Register):
                if owner is not None:
                    return  # registered already
                if len(self._registrations) >= MAX_REGISTRATIONS:
                    self.channel.send(peer, m.encode(m.Failed(
                        msg.room, f"{MAX_REGISTRATIONS} registrations wait here already")))
                    return
                self._room_peers[msg.room] = peer
                self._registrations[msg.room] = (peer, msg, time.perf_counter())
            elif isinstance(msg, m.Cancel):
                if owner is None:
                    return  # nothing of that peer's to cancel
                self._cancels.append((peer, msg.room))
            elif isinstance(msg, m.Refuse):
                self._note_refused(msg.room,
                                   f"the decode worker refused the request: {msg.message}")
            self._news = True
        self._wake()

    def _note_refused(self, room: int, why: str) -> None:
        """(Under the lock.) Remember a refused room, a bounded number of them."""
        if len(self._refused) >= MAX_REGISTRATIONS:
            del self._refused[next(iter(self._refused))]
        self._refused[room] = (why, time.perf_counter())

    def refuse(self, rooms: list[tuple[str, int, int]], message: str) -> None:
        """This worker turned away a PD request (a 400 at its door): the decode side's
        registration of its room is answered with that, not left to time out."""
        with self._lock:
            for _, _, room in rooms:
                self._note_refused(room, message)  # the decode side says who refused
            self._news = True
        self._wake()

    def _forget_room(self, room: int) -> None:
        with self._lock:
            self._room_peers.pop(room, None)

    def _tick(self) -> None:
        now = time.perf_counter()
        with self._lock:
            # the loop thread owns _waiting; it publishes the first deadline for this check
            late = self._first_deadline < now
            stale = [r for r, (_, _, t) in self._registrations.items()
                     if now - t > self.timeout_s and r not in self._waiting
                     and r not in self._active]
            for room in stale:  # registered for a request that never came here
                peer, _, _ = self._registrations.pop(room)
                self._room_peers.pop(room, None)
                self.channel.send(peer, m.encode(m.Failed(
                    room, f"the prefill worker got no request for bootstrap room {room} "
                          f"within {self.timeout_s:g} s")))
            for room, (_, t) in list(self._refused.items()):
                if now - t > self.timeout_s:  # its other half would have come by now
                    del self._refused[room]
            if late:
                self._news = True
        if late:
            self._wake()

    # ---- the scheduler's calls -----------------------------------------------------------
    @property
    def has_news(self) -> bool:
        return self._news

    def add(self, req: Req) -> None:
        """A request of a PD pair: it waits for its room's registration."""
        room = req.bootstrap[2]
        with self._lock:
            refused = self._refused.get(room)
        if refused is not None:
            req.finish(FinishReason("abort", status_code=400, message=refused[0]))
            return
        if room in self._waiting or room in self._active:
            req.finish(FinishReason("abort", status_code=400, message=(
                f"bootstrap room {room} is already in use on this prefill worker")))
            return
        # the prefill worker's answer ends at the first token; the decode worker goes on
        req.sampling_params = dataclasses.replace(req.sampling_params, max_new_tokens=1)
        deadline = time.perf_counter() + self.timeout_s
        self._waiting[room] = (req, deadline)
        self._first_deadline = min(self._first_deadline, deadline)
        with self._lock:
            self._news = True

    def poll(self, ctx: DisaggContext, touched: list[Req]) -> None:
        """Admit registered requests, apply cancels and deadlines, report rooms that ended."""
        with self._lock:
            self._news = False
            cancels, self._cancels = self._cancels, []
            ready = [r for r in self._waiting
                     if r in self._registrations and r not in self._refused]
            regs = {r: self._registrations.pop(r) for r in ready}
            # a registered room this worker cannot serve: its request was refused at this
            # worker's door (or will be: an adapter not loaded here), so the decode side
            # hears it now rather than after the timeout
            unservable: dict[int, tuple[bytes, str]] = {}
            for room, (peer, reg, _) in list(self._registrations.items()):
                why = self._adapter_problem(reg.lora_name) or (
                    self._refused[room][0] if room in self._refused else None)
                if why is not None:
                    unservable[room] = (peer, why)
                    del self._registrations[room]
                    self._room_peers.pop(room, None)
            refused = {r: self._refused[r][0] for r in self._waiting if r in self._refused}
        for room, why in refused.items():
            req, _ = self._waiting.pop(room)
            req.finish(FinishReason("abort", status_code=400, message=why))
            touched.append(req)
        for room, (peer, why) in unservable.items():
            self.channel.send(peer, m.encode(m.Failed(room, why, status_code=400)))
        now = time.perf_counter()
        for room, (peer, reg, t_reg) in regs.items():
            req, _ = self._waiting.pop(room)
            problem = self.kv.check_peer(reg.layout)
            status = None
            if problem is None and reg.lora_name != req.lora_name:
                problem = (f"the decode worker serves this request with LoRA adapter "
                           f"{reg.lora_name!r}, this prefill worker with {req.lora_name!r}")
                status = 400
            if problem is None and reg.prompt_len != req.prompt_len:
                problem = (f"the decode worker tokenized the prompt to {reg.prompt_len} "
                           f"tokens, this worker to {req.prompt_len} (different tokenizers?)")
            if problem is None and reg.start + len(reg.slots) != reg.prompt_len:
                problem = "the registration does not cover the prompt"
            if problem is not None:
                self._forget_room(room)
                self.channel.send(peer, m.encode(m.Failed(room, problem, status_code=status)))
                req.finish(FinishReason("abort", message=f"disaggregation: {problem}",
                                        status_code=status))
                touched.append(req)
                continue
            state = PrefillRoom(room, peer, reg, sent_upto=reg.start, t_registered=t_reg)
            req.pd = state
            self._active[room] = (req, state)
            ctx.enqueue(req)
        for room, (req, deadline) in list(self._waiting.items()):
            if deadline < now:
                del self._waiting[room]
                req.finish(FinishReason("abort", message=(
                    f"no decode worker registered bootstrap room {room} within "
                    f"{self.timeout_s:g} s")))
                touched.append(req)
        for peer, room in cancels:
            with self._lock:
                self._registrations.pop(room, None)
            self._forget_room(room)
            entry = self._waiting.pop(room, None)
            if entry is not None:
                entry[0].finish(FinishReason("abort", message="the decode worker cancelled"))
                touched.append(entry[0])
            elif room in self._active:
                req, _ = self._active.pop(room)
                ctx.abort(req.rid)  # no write is in flight between steps
            self.channel.send(peer, m.encode(m.Cancelled(room)))
        self._first_deadline = min((d for _, d in self._waiting.values()), default=float("inf"))
        self.report_ended()

    def _adapter_problem(self, name: str | None) -> str | None:
        """Why a room served with LoRA adapter `name` cannot be prefilled here (None: it can)."""
        if name is None:
            return None
        where = f"the prefill worker with bootstrap port {self.bootstrap_port}"
        if self.loras is None:
            return f"LoRA adapter {name!r} is not loaded on {where}: LoRA is not enabled there"
        if name not in self.loras:
            return (f"LoRA adapter {name!r} is not loaded on {where} (loaded: "
                    f"{', '.join(self.loras.names()) or 'none'}); a PD request's adapter must be "
                    "loaded on both workers")
        return None

    def before_forward(self, batch: ScheduleBatch) -> Callable[[int], None] | None:
        """The layer hook for this batch (None when no request of it sends KV)."""
        work: list[tuple[PrefillRoom, list[tuple[int, int, int]]]] = []
        for req, n, tree in zip(batch.reqs, batch.extend_lens, batch.trees, strict=True):
            state = req.pd
            if not isinstance(state, PrefillRoom) or tree is not None or state.error:
                continue
            end = min(req.kv_len + n, req.prompt_len)
            if end <= state.sent_upto:
                continue
            src = self.req_to_token_pool.read(req.req_pool_idx, state.sent_upto, end)
            dst = state.reg.slots[state.sent_upto - state.reg.start : end - state.reg.start]
            work.append((state, slot_runs(src, dst)))
            state.sent_upto = end
        if not work:
            return None

        def on_layer(layer: int) -> None:
            now = time.perf_counter()
            for state, _ in work:
                state.layer_computed.append(now)
            self._sender.put(layer, work)

        return on_layer

    def after_forward(self) -> None:
        """The step's writes are done before its requests can free their slots."""
        self._sender.wait()

    def after_process(self, batch: ScheduleBatch) -> None:
        """Send Done (the first token) for each request of `batch` that has it."""
        for req in batch.reqs:
            state = req.pd
            if isinstance(state, PrefillRoom) and req.output_ids and not state.done_sent:
                if state.error is not None:
                    continue  # reported (and the request ended) by report_ended
                token = req.output_ids[0]
                logprob = top = None
                if req.return_logprob and req.logprobs.output_token:
                    logprob = req.logprobs.output_token[0][0]
                    top = req.logprobs.output_top[0] or None
                state.done_sent = True
                self.channel.send(state.peer, m.encode(m.Done(
                    state.room, token, logprob, top, state.num_bytes,
                    prefill_cached_tokens=req.num_cached_tokens)))
        self.report_ended()

    def abort(self, rid: str, ctx: DisaggContext) -> Req | None:
        for room, (req, _) in list(self._waiting.items()):
            if req.rid == rid:
                del self._waiting[room]
                req.finish(FinishReason("abort", message="aborted"))
                return req
        return None  # a registered request is in the scheduler's queues

    def abort_all(self, message: str, ctx: DisaggContext) -> list[Req]:
        reqs = [req for req, _ in self._waiting.values()]
        self._waiting.clear()
        for req in reqs:
            req.finish(FinishReason("abort", message=message))
        for _, state in self._active.values():
            state.error = state.error or message
        return reqs

    def report_ended(self) -> None:
        """Forget rooms whose request ended; Failed to the decode side for those without a
        Done (aborted, a write failed, the request failed). Also called by the scheduler right
        after a failed step, which may be the last step for a while: the decode side (and the
        router's client behind it) would otherwise wait for its transfer timeout."""
        for room, (req, state) in list(self._active.items()):
            if state.error is not None and not req.is_finished:
                req.finish(FinishReason("abort", message=state.error))
            if not req.is_finished:
                continue
            del self._active[room]
            self._forget_room(room)
            if not state.done_sent:
                reason = req.finished_reason
                message = state.error or (reason.message if reason else None) or "ended"
                self.channel.send(state.peer, m.encode(m.Failed(room, message)))
                self.num_failed += 1
                continue
            self._record(state)

    def _record(self, state: PrefillRoom) -> None:
        self.num_transfers += 1
        self.bytes_sent += state.num_bytes
        self.write_seconds += state.write_seconds
        self.recent.append({
            "room": state.room, "bytes": state.num_bytes,
            "tokens": state.reg.prompt_len - state.reg.start,
            "write_seconds": state.write_seconds,
            "registered_at": state.t_registered,
            "layer_computed": state.layer_computed, "layer_sent": state.layer_sent,
        })

    @property
    def num_inflight(self) -> int:
        return len(self._waiting) + len(self._active)

    def held_slots(self) -> list[int]:
        return []

    def held_reqs(self) -> list[Req]:
        return []

    def info(self) -> dict[str, Any]:
        return {"mode": self.mode, "bootstrap_port": self.bootstrap_port,
                "session": self.kv.session, "num_inflight": self.num_inflight,
                "num_transfers": self.num_transfers, "num_failed": self.num_failed,
                "bytes_sent": self.bytes_sent, "write_seconds": self.write_seconds,
                "num_rejected": self.channel.num_rejected,
                "recent_transfers": list(self.recent)}

    def close(self) -> None:
        self.channel.close()

