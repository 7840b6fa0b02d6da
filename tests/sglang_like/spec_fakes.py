"""A scheduler's face as `propose_trees` sees it, for the controller's batch tests: a batch
of decoding requests, a drafter, and the plain steps the scheduler would have recorded."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sglang_like.speculative import SpecController, SpecState


def fake_batch(drafter: Any, ctl: SpecController, size: int = 8, **state: Any
               ) -> tuple[SimpleNamespace, list[SimpleNamespace]]:
    """(sched, reqs): `size` requests decoding (SpecState(**state) each) and `drafter`."""
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(max_new_tokens=100), output_ids=[1],
                            seq_len=10, is_decoding=True, spec=SpecState(**state))
            for _ in range(size)]
    sched = SimpleNamespace(drafter=drafter, spec_controller=ctl,
                            config=SimpleNamespace(context_len=1000),
                            cache=SimpleNamespace(num_available_slots=1000))
    return sched, reqs


def plain_step_to(ctl: SpecController, step: int, rows: int = 8, seconds: float = 0.02) -> None:
    """Stand at `step`, the plain step of `rows` rows just recorded (as the scheduler does
    after every forward)."""
    ctl.step = step - 1
    ctl.record_forward(rows, seconds)
