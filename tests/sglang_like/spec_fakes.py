"""Speculation tests' helpers: the speculative step as the scheduler runs it (a batch of
decoding requests, a drafter, its context, and the plain steps the scheduler would have
recorded), a random EAGLE-3 head, a tiny target whose drafts get accepted, and the weights the
real-model tests pin."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
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


def markov_llama(folder: Path) -> str:
    """A tiny random llama (hidden 64, 2 layers, the default tokenizer) saved to `folder`,
    whose attention outputs are zero: its next token depends on the last one only, a Markov
    chain over tokens, so a prompt holding the likely walks from a token gets n-gram drafts
    accepted (needs transformers)."""
    import transformers

    from sglang_like.model_loader import load_tokenizer

    tok = load_tokenizer()
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}))
    torch.manual_seed(7)
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


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
