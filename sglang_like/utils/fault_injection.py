"""Injected faults for tests and drills: `SGLANG_LIKE_FAULT_INJECT="forward=0.05,seed=1"`.

Each site is a place where the runtime can fail for real (a forward that raises or runs out
of memory, a sampler bug, a grammar backend bug). When the variable is set, the scheduler
asks `maybe_fail(site)` at that point once per step (per request for `grammar`), and with the
given probability an `InjectedFault` is raised there. The runtime must then do what it does
for a real fault: end the requests it hit with `internal error: ...`, free what they held,
and go on. Every fault carries a sequence number (`#3`), so a test can check that each one
reached some caller as an abort message. Off (no cost beyond one attribute test) when unset.
"""

from __future__ import annotations

import os
import random
import threading

ENV_VAR = "SGLANG_LIKE_FAULT_INJECT"
SITES = ("forward", "sample", "grammar")


class InjectedFault(RuntimeError):
    """A fault raised on purpose by the fault injector."""


class FaultInjector:
    """Raises `InjectedFault` at named sites with fixed probabilities, from a seeded RNG."""

    def __init__(self, probabilities: dict[str, float] | None = None, seed: int = 0) -> None:
        probabilities = dict(probabilities or {})
        for site, p in probabilities.items():
            if site not in SITES:
                raise ValueError(f"{ENV_VAR}: unknown site {site!r}; sites are {', '.join(SITES)}")
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{ENV_VAR}: probability of {site!r} must be in [0, 1], got {p}")
        self.probabilities = {s: p for s, p in probabilities.items() if p > 0}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.num_injected = 0
        self.counts: dict[str, int] = dict.fromkeys(SITES, 0)

    @property
    def enabled(self) -> bool:
        return bool(self.probabilities)

    @classmethod
    def parse(cls, spec: str) -> FaultInjector:
        """`"forward=0.05,sample=0.02,grammar=0.05,seed=1"` -> an injector (ValueError if bad)."""
        probabilities: dict[str, float] = {}
        seed = 0
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{ENV_VAR}: expected site=probability, got {item!r}")
            key = key.strip()
            try:
                if key == "seed":
                    seed = int(value)
                else:
                    probabilities[key] = float(value)
            except ValueError:
                raise ValueError(f"{ENV_VAR}: bad value in {item!r}") from None
        return cls(probabilities, seed)

    @classmethod
    def from_env(cls) -> FaultInjector:
        return cls.parse(os.environ.get(ENV_VAR, ""))

    def maybe_fail(self, site: str) -> None:
        p = self.probabilities.get(site)
        if p is None:
            return
        with self._lock:
            if self._rng.random() >= p:
                return
            self.num_injected += 1
            self.counts[site] += 1
            number = self.num_injected
        raise InjectedFault(f"injected {site} fault #{number}")

    def stats(self) -> dict[str, int]:
        return {"total": self.num_injected, **self.counts}
