"""Speculation tests' helpers: a scheduler's face as `propose_trees` sees it (a batch of
decoding requests, a drafter, and the plain steps the scheduler would have recorded), a random
EAGLE-3 head, and the weights the real-model tests pin."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from sglang_like.speculative import SpecController, SpecState
from sglang_like.speculative.eagle_head import Eagle3Config, Eagle3Head

# The weights the real-model tests run: what `auto` picks on the default model, pinned so the
# engines with and without speculation run the same ones.
SPEC_QUANT = "int4"


def random_head(folder: str, vocab: int, hidden: int, layers: int) -> str:
    """A seeded random EAGLE-3 head for a target of `layers` layers, saved to `folder`."""
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, draft_vocab_size=vocab,
        target_hidden_size=hidden, aux_layer_ids=[0, layers // 2, layers - 1]))
    head.t2d[:] = True
    head.save(folder)
    return folder


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
