"""How many threads a CPU decode step runs on: fixed (`--decode-threads N`), or following the
cores other processes leave free (`auto`).

Why: the native decode step is one OpenMP team that meets at a barrier after every layer's
pieces, and libgomp's threads spin at a barrier for milliseconds before they sleep. When
another process takes one of the team's cores, the thread left on it runs only in the
scheduler's time slices while its partner spins through its own: each barrier then costs a
slice. Measured on 2 cores with one busy process beside the engine
(docs/benchmarks.md#bench_contention): 2 threads decode at 0.3-0.4x their quiet speed (0.005x
in the chat CLI, where two more processes wake per token), one thread at 0.6-0.7x of the two's
quiet speed. So `auto` measures, about twice a second while decoding, how many cores other
processes used (/proc/stat's busy time on the cores this process may run on, less this
process's own CPU time) and runs decode steps on the cores left, between 1 and the prefill's
thread count.

Only the native step's decode and verify forwards change their thread count: it partitions
every sum by output rows, so a row's bits do not depend on how many threads computed it
(tests/sglang_like/test_decode_threads.py checks it). Prefill chunks keep torch's count,
whichever path runs them (the native step takes cold prompts and cached prefixes, and every
chunk with --enable-deterministic-inference): each of their phases is long beside a
barrier."""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

WINDOW_S = 0.5  # how often the cores are looked at while decoding
_SMOOTH = 0.5  # weight of the newest window in the smoothed count of cores others use


def parse_decode_threads(value: str) -> int | None:
    """`auto` -> None; a positive integer -> itself; else ValueError."""
    if value == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"decode_threads must be auto or a positive integer; got {value!r}")
    return n


def _busy_ticks(cpus: set[int], stat_text: str) -> int | None:
    """Busy clock ticks of `cpus` since boot from /proc/stat's per-CPU lines (all but idle and
    iowait; steal counts as busy: the hypervisor gave the core to someone else)."""
    total = 0
    seen = 0
    for line in stat_text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        try:
            cpu = int(name[3:])
        except ValueError:
            continue
        if cpu not in cpus:
            continue
        ticks = [int(f) for f in fields[:8]]
        total += sum(ticks) - ticks[3] - ticks[4]
        seen += 1
    return total if seen == len(cpus) else None


class DecodeThreads:
    """The thread count of each forward: `for_forward(native)` before it runs; with `fixed`
    set, that many for the native step's forwards; else (auto) the cores others left."""

    def __init__(self, max_threads: int, fixed: int | None = None,
                 read_stat=None, clock=time.monotonic, cpu_clock=time.process_time) -> None:
        import torch  # here: the server's HTTP process imports this module, without torch

        self._torch = torch
        self.max_threads = max_threads
        self.fixed = fixed
        self.decode = fixed if fixed is not None else max_threads
        self.others = 0.0  # cores other processes used, smoothed over the windows seen
        self._read_stat = read_stat or _read_proc_stat
        self._clock, self._cpu_clock = clock, cpu_clock
        self._cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last: tuple[float, float, int] | None = None

    @classmethod
    def build(cls, spec: str, max_threads: int) -> DecodeThreads | None:
        """The policy for `--decode-threads spec` with the engine at `max_threads`; None where
        nothing would ever change (one thread, or auto without /proc/stat)."""
        fixed = parse_decode_threads(spec)
        if fixed is not None:
            return cls(max_threads, fixed) if fixed != max_threads else None
        if max_threads < 2 or _read_proc_stat() is None:
            return None
        return cls(max_threads)

    def for_forward(self, native: bool) -> int:
        """Set torch's (and so OpenMP's) thread count for the next forward, a decode or verify
        forward of the native step if `native` (anything else: a prefill chunk, or the torch
        path); returns it."""
        if native and self.fixed is None:
            self._observe()
        n = self.decode if native else self.max_threads
        if self._torch.get_num_threads() != n:  # read, not kept: another engine may set it
            self._torch.set_num_threads(n)
        return n

    def _observe(self) -> None:
        now = self._clock()
        if self._last is not None and now - self._last[0] < WINDOW_S:
            return
        text = self._read_stat()
        busy = _busy_ticks(self._cpus, text) if text is not None else None
        mine = self._cpu_clock()
        if busy is None:
            return
        if self._last is not None:
            t0, mine0, busy0 = self._last
            wall = now - t0
            others = max(0.0, (busy - busy0) / self._hz - (mine - mine0)) / wall
            self.others = _SMOOTH * others + (1 - _SMOOTH) * self.others
            free = len(self._cpus) - self.others
            want = max(1, min(self.max_threads, int(free + 0.5)))
            if want != self.decode:
                logger.info("other processes use %.1f of %d cores: decode steps on %d "
                            "thread(s)", self.others, len(self._cpus), want)
                self.decode = want
        self._last = (now, mine, busy)

    def info(self) -> dict:
        return {"mode": "auto" if self.fixed is None else "fixed",
                "decode": self.decode, "prefill": self.max_threads,
                "other_processes_cores": round(self.others, 2)}


def _read_proc_stat() -> str | None:
    try:
        with open("/proc/stat") as f:
            return f.read()
    except OSError:
        return None
