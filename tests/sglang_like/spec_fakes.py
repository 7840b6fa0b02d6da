"""Speculation tests' helpers: the speculative step as the scheduler runs it (a batch of
decoding requests, a drafter, its context, and the plain steps the scheduler would have
recorded), a random EAGLE-3 head, and the weights the real-model tests pin."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from sglang_like.scheduler.spec_propose import propose_trees
from sglang_like.speculative import SpecController, SpecState
from sglang_like.speculative.context import DraftContext
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


def draft_context(ctl: SpecController) -> DraftContext:
    """A drafter's context around `ctl`, without a KV pool (these drafters take no slots)."""
    return DraftContext(ctl, alloc_slots=lambda num: None, free_slots=lambda slots: None,
                        num_requests=0)


def decoding_reqs(size: int, **state: Any) -> list[SimpleNamespace]:
    """`size` requests decoding (SpecState(**state) each), as `propose_trees` reads them."""
    return [SimpleNamespace(sampling_params=SimpleNamespace(max_new_tokens=100),
                            output_ids=[1], seq_len=10, is_decoding=True, spec=SpecState(**state))
            for _ in range(size)]


def fake_batch(drafter: Any, ctl: SpecController, size: int = 8, **state: Any
               ) -> tuple[Callable[[list[Any]], dict[int, Any]], list[SimpleNamespace]]:
    """(propose, reqs): `size` requests decoding (SpecState(**state) each), and `propose(reqs)`,
    the step's trees as `propose_trees` drafts them with `drafter` (context length 1000)."""

    def propose(batch: list[Any]) -> dict[int, Any]:
        return propose_trees(drafter, draft_context(ctl), batch, context_len=1000)

    return propose, decoding_reqs(size, **state)


def plain_step_to(ctl: SpecController, step: int, rows: int = 8, seconds: float = 0.02) -> None:
    """Stand at `step`, the plain step of `rows` rows just recorded (as the scheduler does
    after every forward)."""
    ctl.step = step - 1
    ctl.record_forward(rows, seconds)
