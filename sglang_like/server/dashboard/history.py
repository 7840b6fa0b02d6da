"""The dashboard's time series: one engine `get_stats` per second on a thread of the HTTP
process, turned into per-interval rates and kept for ten minutes.

One sampler serves every viewer (the page and scripts read its buffer), so the engine answers
one small RPC per second however many tabs are open. A sample is plain JSON:

    t                wall-clock seconds (time.time(), rounded to ms; strictly increasing)
    free / evictable / in_use / total     KV slots: free, cached by the tree and unlocked,
                     held by requests (their own slots and the tree nodes they lock)
    running, queued  requests
    hit_rate         cached / prompt tokens of the requests admitted in this interval (None
                     when none was); hit_rate_total the same since start
    tokens_per_s     generated tokens per second in this interval
    evicted_per_s    tokens evicted from the tree per second
    accept_length    tokens per verify pass of speculative decoding in this interval (None
                     when there was none)
    nodes            radix tree nodes
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0
HISTORY_S = 600.0


class StatsHistory:
    def __init__(self, engine: Any, interval_s: float = INTERVAL_S,
                 history_s: float = HISTORY_S) -> None:
        self._engine = engine
        self.interval_s = interval_s
        self._samples: deque[dict[str, Any]] = deque(maxlen=int(history_s / interval_s) + 1)
        self._prev: dict[str, Any] | None = None
        self._latest: dict[str, Any] | None = None  # the engine's last raw answer
        self._lock = threading.Lock()  # guards the buffer for readers
        self._sampling = threading.Lock()  # one sample at a time (`_prev` is per sample)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # why the last sample failed, if it did

    @property
    def supported(self) -> bool:
        return callable(getattr(self._engine, "get_stats", None))

    # ---- the sampler thread ---------------------------------------------------------------
    def start(self) -> None:
        """Start sampling (idempotent; a no-op for an engine without `get_stats`)."""
        with self._lock:
            if self._thread is not None or not self.supported:
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="sglang-like-dashboard",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self.sample()
            next_t += self.interval_s
            delay = next_t - time.monotonic()
            if delay < 0:  # a slow answer (a long prefill step): skip, do not catch up
                next_t, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    def sample(self) -> dict[str, Any] | None:
        """Ask the engine once and append a sample; None (and `error` set) if it failed.
        Samples are taken one at a time (the thread's, or a route's before the first)."""
        with self._sampling:
            try:
                raw = self._engine.get_stats()
            except Exception as exc:  # noqa: BLE001 - a dead or busy engine: say so, go on
                self.error = f"{type(exc).__name__}: {exc}"
                logger.debug("dashboard sample failed", exc_info=True)
                return None
            self.error = None
            row = self._row(raw, time.time())
            with self._lock:
                self._latest = raw
                self._samples.append(row)
            return row

    def _row(self, raw: dict[str, Any], now: float) -> dict[str, Any]:
        pool = raw["kv_pool"]
        prev, self._prev = self._prev, {**raw, "wall": now}
        last_t = self._samples[-1]["t"] if self._samples else 0.0
        row: dict[str, Any] = {
            "t": max(round(now, 3), round(last_t + 0.001, 3)),  # strictly increasing: `since`
            "free": pool["free_slots"],
            "evictable": pool["evictable_slots"],
            "in_use": pool["used_slots"],
            "total": pool["total_slots"],
            "running": raw["num_running_reqs"],
            "queued": raw["num_queued_reqs"],
            "hit_rate_total": _ratio(raw["num_cached_prompt_tokens"], raw["num_prompt_tokens"]),
            "hit_rate": None,
            "tokens_per_s": 0.0,
            "evicted_per_s": 0.0,
            "accept_length": None,
            "nodes": raw["num_tree_nodes"],
        }
        if prev is not None:
            dt = max(raw["t"] - prev["t"], 1e-6)
            row["hit_rate"] = _ratio(
                raw["num_cached_prompt_tokens"] - prev["num_cached_prompt_tokens"],
                raw["num_prompt_tokens"] - prev["num_prompt_tokens"])
            row["tokens_per_s"] = max(raw["num_generated_tokens"]
                                      - prev["num_generated_tokens"], 0) / dt
            row["evicted_per_s"] = max(raw["evicted_tokens"] - prev["evicted_tokens"], 0) / dt
            row["accept_length"] = _accept_length(prev["spec_accept_lengths"],
                                                  raw["spec_accept_lengths"])
        return row

    # ---- readers --------------------------------------------------------------------------
    def since(self, t: float) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self._samples if s["t"] > t]

    @property
    def latest_raw(self) -> dict[str, Any] | None:
        with self._lock:
            return self._latest


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _accept_length(before: dict[str, int], after: dict[str, int]) -> float | None:
    """Mean committed tokens per verify pass between two histograms {k: passes}."""
    passes = tokens = 0
    for k, count in after.items():
        n = count - before.get(k, 0)
        passes += n
        tokens += int(k) * n
    return tokens / passes if passes > 0 else None
