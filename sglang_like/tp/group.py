"""TPGroup: rank 0's side of a tensor-parallel group. It starts ranks 1..N-1 (one process
each, `python -m sglang_like.engine_core.tp_worker`), ships each forward's batch to them, runs the
all-reduces with them and watches that they live; `close` stops them.

Start-up: rank 0 opens a FileStore (the rendezvous of torch.distributed) and the shared
all-reduce file in a folder only its user can enter, and each worker's batch socket as an ipc
path there too (no loopback port another local user could connect to), spawns the
workers, builds its own shard while they build theirs, then waits for each worker's "ready"
key in the store (or its error, or its death). Each rank allocates its KV pool after its
weights, of rank 0's size: rank 0 puts it in the store once its own weights are placed (on
CUDA the size comes from the memory they leave), and the workers wait for it there. The
workers stop on the stop message, when rank 0's process is gone, or, on an engine thread
(`engine_in_process`), once the thread that built the group ended.

LoRA adapters reach the workers on the batch sockets, so in order with the batches: the whole
adapter when the registry installs it (`install_lora`; each worker cuts its part), a drop
once it is unloaded and no request holds it (checked at each broadcast). A batch's rows name
their adapters by the registry's `uid` of the load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import zmq

from sglang_like.config import ModelConfig, ServerArgs
from sglang_like.forward_batch import ForwardBatch
from sglang_like.tp.broadcast import encode_batch, encode_lora_drop, encode_lora_load, encode_stop
from sglang_like.tp.comm import GroupAllReduce, ShmAllReduce, TPRankLost, make_process_group
from sglang_like.tp.parallel import TPShard, make_shard_plan, shard_lora

logger = logging.getLogger(__name__)

# one all-reduce slot: 8 MiB holds a 3640-row fp32 chunk of a 576-wide model in one round
SHM_SLOT_BYTES = 8 << 20
COLLECTIVE_TIMEOUT_S = 120.0  # a peer that is alive but stuck that long ends the group
_READY_TIMEOUT_S = 900.0
_KV_SLOTS_KEY = "tp/num_kv_slots"  # rank 0's KV pool size; "0": rank 0 gave up before
_STOP_TIMEOUT_S = 10.0
_SEND_POLL_MS = 100  # how often a send that waits on a worker checks the worker lives
ALLREDUCE_ENV = "SGLANG_LIKE_TP_ALLREDUCE"  # "shm" (CPU default) | "group" (gloo / NCCL)


def threads_per_rank(tp_size: int) -> int:
    """The CPU cores each rank's torch ops get (the ranks share the machine)."""
    return max(1, len(os.sched_getaffinity(0)) // tp_size)


def allreduce_kind(device: torch.device) -> str:
    """Shared memory between CPU ranks (measured 20 us vs gloo's 1.6 ms per decode-sized
    all-reduce here); the process group on CUDA or when ALLREDUCE_ENV asks for it."""
    asked = os.environ.get(ALLREDUCE_ENV, "")
    if asked not in ("", "shm", "group"):
        raise ValueError(f"{ALLREDUCE_ENV} must be 'shm' or 'group'; got {asked!r}")
    if device.type != "cpu":
        return "group"
    return asked or "shm"


class AllReduceSlot:
    """The all-reduce a model is built with, bound to its implementation once every rank
    has joined (the process group cannot form before the workers have loaded)."""

    def __init__(self) -> None:
        self.comm: ShmAllReduce | GroupAllReduce | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(x)


class TPGroup:
    """Rank 0 of `server_args.tp_size` ranks (every "auto" of `server_args` resolved)."""

    def __init__(self, server_args: ServerArgs, config: ModelConfig, device: torch.device,
                 timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        self.tp_size = server_args.tp_size
        self.config = config
        self.plan = make_shard_plan(config, self.tp_size, 0)  # ValueError before any spawn
        # the adapters the workers hold (lora.LoadedAdapter entries) by uid, and the uid of
        # rank 0's part by its id
        self._loras: dict[int, Any] = {}
        self._lora_uids: dict[int, int] = {}
        self.device = device
        self.timeout_s = timeout_s
        self.kind = allreduce_kind(device)
        self._slot = AllReduceSlot()
        self.shard = TPShard(self.plan, self._slot.all_reduce)
        self._dir = tempfile.mkdtemp(prefix="sglang_like-tp-")
        self._store_path = os.path.join(self._dir, "store")  # mkdtemp: mode 0700
        self._store = torch.distributed.FileStore(self._store_path, self.tp_size)
        self._store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self._shm_path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else self._dir,
                                      f"sglang_like-tp-{os.getpid()}-{id(self):x}")
        if self.kind == "shm":
            ShmAllReduce.create_file(self._shm_path, self.tp_size, SHM_SLOT_BYTES)
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket] = []
        self.procs: list[subprocess.Popen] = []
        self._closed = False
        self._kv_slots_shared = False
        self._close_lock = threading.Lock()  # the engine's shutdown, the watcher, exit
        num_threads = threads_per_rank(self.tp_size)
        torch.set_num_threads(num_threads)
        try:
            for rank in range(1, self.tp_size):
                self._spawn(rank, server_args, num_threads)
        except BaseException:
            self.close()
            raise
        # at interpreter exit too (an engine thread's group may still be open then)
        self._finalizer = weakref.finalize(self, _stop_workers, list(self.procs),
                                           list(self._socks), self._slot)
        owner = threading.current_thread()
        if owner is not threading.main_thread():  # an engine thread: stop with it
            threading.Thread(target=self._close_after, args=(owner,), daemon=True,
                             name="sglang-like-tp-watch").start()

    def _spawn(self, rank: int, server_args: ServerArgs, num_threads: int) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        addr = f"ipc://{os.path.join(self._dir, f'rank{rank}.sock')}"
        sock.bind(addr)
        self._socks.append(sock)
        args_path = os.path.join(self._dir, f"rank{rank}.pkl")
        with open(args_path, "wb") as f:
            pickle.dump({
                "server_args": server_args, "rank": rank, "tp_size": self.tp_size,
                "store_path": self._store_path, "batch_addr": addr,
                "allreduce": self.kind, "shm_path": self._shm_path,
                "shm_slot_bytes": SHM_SLOT_BYTES, "timeout_s": self.timeout_s,
                "num_threads": num_threads, "parent_pid": os.getpid(),
            }, f)
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "sglang_like.engine_core.tp_worker", args_path],
            stdin=subprocess.DEVNULL, env=_child_env()))

    def share_num_kv_slots(self, num_slots: int) -> None:
        """Tell the workers the KV pool size (`wait_num_kv_slots`): every rank's pool is rank
        0's, whose scheduler hands out the slots of all of them."""
        self._store.set(_KV_SLOTS_KEY, str(num_slots).encode())
        self._kv_slots_shared = True

    def wait_ready(self) -> None:
        """Block until every worker has built its shard (RuntimeError with the worker's
        error if one failed or died), then join the all-reduce."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        pending = set(range(1, self.tp_size))
        while pending:
            for rank in sorted(pending):
                key = f"tp/ready/{rank}"
                if self._store.check([key]):
                    status = self._store.get(key).decode()
                    if status != "ok":
                        raise RuntimeError(f"tensor-parallel rank {rank} failed to start: "
                                           f"{status}")
                    pending.discard(rank)
            why = self.peer_error()
            if why is not None:
                raise RuntimeError(why)
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks {sorted(pending)} not ready after "
                                   f"{_READY_TIMEOUT_S:g} s")
            if pending:
                time.sleep(0.05)
        if self.kind == "shm":
            self._slot.comm = ShmAllReduce(self._shm_path, 0, self.tp_size, SHM_SLOT_BYTES,
                                           self.peer_error, self.timeout_s)
            os.unlink(self._shm_path)  # every rank has it mapped; nothing is left behind
        else:
            group = make_process_group(self._store, 0, self.tp_size, self.device,
                                       self.timeout_s)
            self._slot.comm = GroupAllReduce(group, self.peer_error)

    def peer_error(self) -> str | None:
        """Why a worker is gone, or None while all live."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
        return None

    def broadcast(self, fb: ForwardBatch) -> None:
        """Hand `fb` to every worker (they run the same forward on their shards)."""
        if self._closed:
            raise TPRankLost("the tensor-parallel group is closed")
        why = self.peer_error()
        if why is not None:
            raise TPRankLost(why)
        uids = None
        if fb.lora is not None:
            try:
                uids = [self._lora_uids[id(weights)] for weights, _ in fb.lora.groups]
            except KeyError:
                raise RuntimeError("a LoRA adapter not installed through the tensor-parallel "
                                   "group cannot run at tp_size > 1") from None
        self._drop_idle_loras(keep=set(uids or ()))
        self._send_all(encode_batch(fb, uids))

    @property
    def lora_uids(self) -> set[int]:
        """The adapters (registry uids) the workers hold now."""
        return set(self._loras)

    def install_lora(self, entry: Any) -> Any:
        """`lora.LoraSharding.install_lora`: rank 0's part of `entry.adapter` (a
        lora.LoraAdapter of a lora.LoadedAdapter; typed loosely, as the lora package sits
        above this one); the workers get its weights whole and cut their own parts."""
        if self._closed:
            raise TPRankLost("the tensor-parallel group is closed")
        weights = entry.adapter.weights
        part = dataclasses.replace(entry.adapter,
                                   weights=shard_lora(weights, self.config, self.plan))
        self._drop_idle_loras()
        self._send_all(encode_lora_load(entry.uid, weights))
        self._loras[entry.uid] = entry
        self._lora_uids[id(part.weights)] = entry.uid
        return part

    def _drop_idle_loras(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Free on the workers the adapters no request can run on again: unloaded (or
        evicted) and held by no request (`keep`: the ones this batch uses, whatever)."""
        for uid, entry in list(self._loras.items()):
            if not entry.is_loaded and entry.in_flight == 0 and uid not in keep:
                self._send_all(encode_lora_drop(uid))
                del self._loras[uid]
                del self._lora_uids[id(entry.adapter.weights)]

    def _send_all(self, frames: list) -> None:
        for rank, sock in enumerate(self._socks, start=1):
            self._send(rank, sock, frames)

    def _send(self, rank: int, sock: zmq.Socket, frames: list) -> None:
        """Send without blocking forever: zmq connects in the background, so a worker that
        has just started (or a loaded machine) may not take the first batch at once; wait
        for it while it lives, up to the collective timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again as exc:
                why = self.peer_error()
                if why is not None:
                    raise TPRankLost(why) from exc
                if time.monotonic() > deadline:
                    raise TPRankLost(f"tensor-parallel rank {rank} took no batch in "
                                     f"{self.timeout_s:g} s") from exc
                sock.poll(_SEND_POLL_MS, zmq.POLLOUT)

    def _close_after(self, owner: threading.Thread) -> None:
        owner.join()
        self.close()

    def close(self) -> None:
        """Stop the workers (a stop message, then a kill after a grace period)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._close()

    def _close(self) -> None:
        if not self._kv_slots_shared:
            # workers waiting for the pool size stop now, not at the stop message's timeout
            with contextlib.suppress(RuntimeError):
                self._store.set(_KV_SLOTS_KEY, b"0")
        _stop_workers(self.procs, self._socks, self._slot)
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()
        self._store = None  # its server thread ends with it, not at interpreter exit
        if os.path.exists(self._shm_path):
            os.unlink(self._shm_path)
        shutil.rmtree(self._dir, ignore_errors=True)


def wait_num_kv_slots(store: torch.distributed.Store, parent_error: Callable[[], str | None]
                      ) -> int:
    """A worker's side of `TPGroup.share_num_kv_slots`: rank 0's KV pool size, once it has
    placed its weights (RuntimeError if rank 0 gave up or is gone meanwhile)."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not store.check([_KV_SLOTS_KEY]):
        why = parent_error()
        if why is not None:
            raise RuntimeError(why)
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 did not size its KV pool in {_READY_TIMEOUT_S:g} s")
        time.sleep(0.05)
    num_slots = int(store.get(_KV_SLOTS_KEY))
    if num_slots <= 0:
        raise RuntimeError("rank 0 stopped before sizing its KV pool")
    return num_slots


def _stop_workers(procs: list[subprocess.Popen], socks: list[zmq.Socket],
                  slot: AllReduceSlot | None = None) -> None:
    for proc, sock in zip(procs, socks, strict=False):
        if proc.poll() is None:
            try:
                sock.send_multipart(encode_stop(), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                proc.kill()
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            logger.warning("tensor-parallel worker %d did not stop; killing it", proc.pid)
            proc.kill()
            proc.wait()
    if slot is not None and slot.comm is not None:
        # a gloo process group still alive when the interpreter exits aborts the process
        slot.comm.close()
        slot.comm = None


def _child_env() -> dict[str, str]:
    """The worker imports this very package, wherever it was imported from here."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env
