"""The default model against Hugging Face transformers on the same GGUF weights (float32)."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_like.forward_batch import ForwardBatch
from sglang_like.model_loader import default_model_path

from .prompts import PROMPTS

pytestmark = pytest.mark.slow

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(quantization="none")  # the exact fp32 path


def hf_greedy(model, id_lists, pad_id):
    """Batched greedy generate with left padding: one call for all prompts."""
    width = max(len(x) for x in id_lists)
    ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in id_lists])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in id_lists])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=pad_id)
    return [row[width:].tolist() for row in out]


def until_eos(ids, eos):
    """Tokens up to and including the first end token (HF pads after it; we stop there)."""
    for k, t in enumerate(ids):
        if t in eos:
            return ids[: k + 1]
    return ids


def test_prefill_logits_match_transformers(engine, hf_model):
    runner = engine.runner
    ids = engine.tokenizer.encode(PROMPTS[2] + " " + PROMPTS[9])
    n = len(ids)
    with torch.inference_mode():
        want = hf_model(torch.tensor([ids])).logits[0].float()
    # Run our model directly on a scratch row and scratch slots of an idle engine.
    row = runner.req_to_token_pool.alloc()
    slots = engine.scheduler.cache.alloc_slots(n)
    try:
        runner.req_to_token_pool.write(row, 0, slots)
        fb = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.arange(n),
            out_slots=torch.tensor(slots), req_pool_indices=torch.tensor([row]),
            prefix_lens=torch.tensor([0]), extend_lens=torch.tensor([n]),
            logits_indices=torch.arange(n), req_to_token=runner.req_to_token_pool.req_to_token,
        )
        got = runner.model(fb, runner.kv_pool)
    finally:
        engine.scheduler.cache.allocator.free(slots)
        runner.req_to_token_pool.free(row)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-3


def test_greedy_continuations_match_transformers(engine, hf_model):
    tok = engine.tokenizer
    id_lists = [tok.encode(p) for p in PROMPTS]
    ours = engine.generate(
        input_ids=id_lists,
        sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0},
    )
    eos = engine.eos_token_ids
    theirs = hf_greedy(hf_model, id_lists, pad_id=sorted(eos)[0])
    equal = [o["output_ids"] == until_eos(t, eos) for o, t in zip(ours, theirs, strict=True)]
    assert sum(equal) >= 15, f"only {sum(equal)}/16 continuations equal: {equal}"
