"""The all-reduce (sum) tensor-parallel ranks run after each row-parallel linear.

Two implementations behind one call, `comm.all_reduce(x)` (in place, returns x):

- `ShmAllReduce`: ranks on one host (CPU) copy their partial sums into slots of a shared
  memory file and each adds all slots up in rank order, so every rank gets the same bits.
  Measured on this 2-core machine: gloo over loopback took 1.6-1.8 ms per [1, 576] fp32
  all-reduce (two of them per layer: 100 ms per 30-layer forward); see the TP tests for
  what the shared-memory one costs.
- `GroupAllReduce`: a torch.distributed process group (gloo on CPU, NCCL on CUDA).

A rank that waits for a peer which is gone raises `TPRankLost` instead of hanging.
"""

from __future__ import annotations

import datetime
import mmap
import os
import time
from collections.abc import Callable

import numpy as np
import torch

_LINE = 64  # one counter per cache line: ranks never write the same line
_HEADER = 4096
_CHECK_EVERY = 512  # spins between liveness checks (a few ms)
_SPIN_S = 0.002  # spin this long for a peer, then nap between checks
_NAP_S = 0.0002


class TPRankLost(BaseException):  # noqa: N818 - the name says what happened
    """A tensor-parallel peer died, or the ranks can no longer agree on the next collective.

    A BaseException on purpose: the scheduler ends only the failed batch on an `Exception`,
    but no forward can run again once a rank is gone, so the engine loop must stop (its
    dead-engine path then answers every request in flight with an error).
    """


PeerCheck = Callable[[], "str | None"]
"""Returns why a peer is gone (a message), or None while every peer lives."""


class ShmAllReduce:
    """All-reduce through a shared file of `tp_size` counters pairs and data slots.

    Round s of rank r: wait until every rank has finished reading round s-1 (`done >= s-1`),
    copy the partial into slot r, publish `arrive[r] = s`, wait for every `arrive >= s`, sum
    slots 0..N-1 into x, publish `done[r] = s`. A tensor larger than a slot goes in several
    rounds. The counters are written after the data (x86 keeps stores in order).
    """

    def __init__(self, path: str, rank: int, tp_size: int, slot_bytes: int,
                 peer_check: PeerCheck, timeout_s: float) -> None:
        self.rank, self.tp_size, self.slot_bytes = rank, tp_size, slot_bytes
        self._peer_check = peer_check
        self._timeout_s = timeout_s
        with open(path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), self.file_size(tp_size, slot_bytes))
        counters = np.frombuffer(self._mm, dtype=np.int64, count=tp_size * 2 * _LINE // 8)
        counters = counters.reshape(tp_size, 2, _LINE // 8)
        self._arrive, self._done = counters[:, 0, 0], counters[:, 1, 0]
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=_HEADER,
                                      count=tp_size * slot_bytes).view(tp_size, slot_bytes)
        self._round = 0

    @staticmethod
    def file_size(tp_size: int, slot_bytes: int) -> int:
        return _HEADER + tp_size * slot_bytes

    @classmethod
    def create_file(cls, path: str, tp_size: int, slot_bytes: int) -> None:
        """The zeroed shared file (rank 0 makes it before the others start)."""
        assert tp_size * 2 * _LINE <= _HEADER, tp_size
        # only this user may map it (it carries every rank's activations); never through a
        # link planted at the path
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:  # a crashed group's (pid reused) or a planted one: not ours
            os.unlink(path)
            fd = os.open(path, flags, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.truncate(cls.file_size(tp_size, slot_bytes))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x (contiguous) <- the sum of every rank's x, the same bits on every rank."""
        assert x.is_contiguous() and x.device.type == "cpu", (x.shape, x.device)
        flat = x.view(-1)
        per_round = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), per_round):
            self._reduce(flat[start : start + per_round])
        return x

    def _reduce(self, chunk: torch.Tensor) -> None:
        self._round += 1
        r = self._round
        self._wait(self._done, r - 1)
        nbytes = chunk.numel() * chunk.element_size()
        slots = self._data[:, :nbytes].view(chunk.dtype)  # [tp_size, n]
        slots[self.rank].copy_(chunk)
        self._arrive[self.rank] = r
        self._wait(self._arrive, r)
        torch.add(slots[0], slots[1], out=chunk)
        for other in range(2, self.tp_size):
            chunk.add_(slots[other])
        self._done[self.rank] = r

    def _wait(self, counters: np.ndarray, target: int) -> None:
        spins = 0
        deadline = None
        while counters.min() < target:
            spins += 1
            if spins % _CHECK_EVERY:
                continue
            why = self._peer_check()
            if why is not None:
                raise TPRankLost(why)
            now = time.monotonic()
            if deadline is None:
                deadline, started = now + self._timeout_s, now
            if now > deadline:
                raise TPRankLost(f"rank {self.rank}: no tensor-parallel peer reached all-reduce "
                                 f"round {target} within {self._timeout_s:g} s")
            if now - started > _SPIN_S:
                # a peer far behind: sleep, which lets go of the GIL for real (ranks on threads
                # of one process, as tests run them, starved each other under sched_yield)
                time.sleep(_NAP_S)
            else:
                os.sched_yield()

    def close(self) -> None:
        # dropped, not mmap.close(): a traceback may still hold a view of the slots, and the
        # mapping goes away with the last of them
        self._data = self._arrive = self._done = self._mm = None


class GroupAllReduce:
    """All-reduce over a torch.distributed process group (NCCL on CUDA, gloo on CPU)."""

    def __init__(self, group: object, peer_check: PeerCheck) -> None:
        self._group = group
        self._peer_check = peer_check

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        try:
            self._group.allreduce([x]).wait()
        except RuntimeError as exc:  # gloo/NCCL report a lost peer or a timeout this way
            raise TPRankLost(self._peer_check() or f"all-reduce failed: {exc}") from exc
        return x

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            try:
                # its threads must be joined before the interpreter exits (else the C++
                # runtime aborts the process at exit)
                group.shutdown()
            except Exception:  # noqa: BLE001 - a peer already gone: nothing left to close
                pass


def make_process_group(store: object, rank: int, tp_size: int, device: torch.device,
                       timeout_s: float) -> object:
    """A process group of the ranks over `store`: NCCL on CUDA, gloo over loopback else
    (built directly, not as torch.distributed's global default group, so several engines
    can live in one process)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, tp_size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, tp_size, opts)
