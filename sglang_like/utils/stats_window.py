"""Latency samples over a sliding time window, summarized as percentiles (pure Python).

The engine keeps one per request latency (TTFT, TPOT, end-to-end, queue time), fed once per
finished request; the HTTP server keeps one for inter-token latency of streams. A summary
sorts at most `max_samples` numbers, when someone asks (a dashboard at 1 Hz), never per step.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

__all__ = ["RequestLatency", "SlidingWindow", "percentile"]


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, by linear interpolation (numpy's)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class SlidingWindow:
    """(time, value) samples of the last `seconds`; the oldest go first past `max_samples`."""

    def __init__(self, seconds: float = 60.0, max_samples: int = 20_000) -> None:
        if seconds <= 0 or max_samples <= 0:
            raise ValueError("a window needs seconds > 0 and max_samples > 0")
        self.seconds = seconds
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, value: float, t: float | None = None) -> None:
        self._samples.append((time.monotonic() if t is None else t, float(value)))

    def add_many(self, value: float, count: int, t: float | None = None) -> None:
        now = time.monotonic() if t is None else t
        for _ in range(count):
            self._samples.append((now, float(value)))

    def values(self, now: float | None = None) -> list[float]:
        cutoff = (time.monotonic() if now is None else now) - self.seconds
        samples = self._samples
        while samples and samples[0][0] < cutoff:
            samples.popleft()
        return [v for _, v in samples]

    def summary(self, now: float | None = None) -> dict[str, float | int] | None:
        """count, mean, p50, p90, p99 and max of the window (seconds); None when empty."""
        values = sorted(self.values(now))
        if not values:
            return None
        return {
            "count": len(values),
            "mean": sum(values) / len(values),
            "p50": percentile(values, 50),
            "p90": percentile(values, 90),
            "p99": percentile(values, 99),
            "max": values[-1],
        }


class RequestLatency:
    """Per-request latencies of finished requests, as the engine measured them.

    TTFT: arrival to first output token; TPOT: first to last token over the tokens after the
    first; e2e: arrival to finish; queue: arrival to first scheduled. Aborted requests count
    only where they got that far.
    """

    NAMES = ("ttft", "tpot", "e2e", "queue")

    # A summary sorts every sample of the window (about 10 ms for 10,000 requests a minute):
    # it is computed at most this often and answered from the last one in between.
    SUMMARY_EVERY_S = 5.0

    def __init__(self, seconds: float = 60.0) -> None:
        self.windows = {name: SlidingWindow(seconds) for name in self.NAMES}
        self._summary: tuple[float, dict[str, dict | None]] | None = None

    def observe(self, req: Any) -> None:
        """Record one finished request (a `Req`: its timestamps are time.perf_counter())."""
        now = time.monotonic()
        w = self.windows
        first, finish = req.first_token_time, req.finish_time
        if first is not None:
            w["ttft"].add(first - req.arrival_time, now)
            num_out = len(req.output_ids)
            if finish is not None and num_out > 1:
                w["tpot"].add((finish - first) / (num_out - 1), now)
        if req.first_scheduled_time is not None:
            w["queue"].add(req.first_scheduled_time - req.arrival_time, now)
        if finish is not None and req.finished_reason is not None \
                and req.finished_reason.type != "abort":
            w["e2e"].add(finish - req.arrival_time, now)

    def summary(self) -> dict[str, dict | None]:
        now = time.monotonic()
        if self._summary is not None and now - self._summary[0] < self.SUMMARY_EVERY_S:
            return self._summary[1]
        summary = {name: window.summary(now) for name, window in self.windows.items()}
        self._summary = (now, summary)
        return summary
