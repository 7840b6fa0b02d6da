"""PEFT on transformers as the LoRA tests' reference, on the default model in fp32.

- `random_adapter`: a seeded random PEFT adapter, made by PEFT itself and saved with
  `save_pretrained`, strong enough to change greedy output, weak enough to keep it text.
- `peft_greedy` / `peft_logits`: greedy continuations and teacher-forced argmaxes of the base
  model with one adapter applied (or none).

The transformers model is loaded once (a cached function; `release()` drops it) and shared:
an adapter is injected for one call and removed after it (`unload`), so the base always stays
clean.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator, Sequence

import torch

from sglang_like.model_loader import default_model_path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Size of a random adapter's update, scaling * B A, in units of A and B as PEFT's
# init_lora_weights=False draws them (nn.Linear's default init) at scaling 1. At 1.0, greedy
# chat output parts from the base model's within 0-7 tokens on 3-4 of the tests' 4 prompts
# and stays fluent (measured; 0.25 changed one token in 20 on most prompts).
RANDOM_STRENGTH = 1.0


@functools.lru_cache(maxsize=1)
def hf_model():
    """The default GGUF in transformers, fp32, eval mode (the Q4_1 weights dequantized, as our
    quantization="none" serves them)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return model.eval()


def release() -> None:
    """Drop the cached transformers model (~0.6 GB in fp32): a test module that used it calls
    this when it ends, so that the rest of a suite run does not carry it."""
    hf_model.cache_clear()
    _cache_kwarg.cache_clear()


@functools.lru_cache(maxsize=1)
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path),
                                         gguf_file=os.path.basename(path))


def chat_ids(question: str) -> list[int]:
    """A user turn through the model's chat template (default system turn included), up to
    the assistant's turn: token ids as served (the template opens with <|im_start|>)."""
    tok = hf_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def random_adapter(path: str, rank: int, seed: int, targets: Sequence[str] = TARGETS,
                   alpha: float | None = None, use_rslora: bool = False,
                   strength: float = RANDOM_STRENGTH) -> str:
    """Save a random PEFT LoRA adapter for the default model into `path` and return `path`.

    `LoraConfig(init_lora_weights=False)` draws A and B (B is otherwise zero) from the seeded
    generator; B is then scaled so that the update has the same size whatever the rank,
    alpha and rsLoRA: scaling * B A = strength * (A and B as drawn)."""
    from peft import LoraConfig, get_peft_model

    alpha = 2 * rank if alpha is None else alpha
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                     use_rslora=use_rslora, init_lora_weights=False, lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    scaling = alpha / (rank ** 0.5 if use_rslora else rank)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(hf_model(), cfg)
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(strength / scaling)
        # no embedding layers are adapted; "auto" would look the base config up (warns offline)
        model.save_pretrained(path, safe_serialization=True, save_embedding_layers=False)
    finally:
        model.unload()  # the LoRA layers out again: hf_model() is the plain base
    return path


@contextlib.contextmanager
def _with_adapter(adapter_dir: str | None) -> Iterator[torch.nn.Module]:
    """The shared base model with `adapter_dir` applied for the block (none: the base)."""
    base = hf_model()
    if adapter_dir is None:
        yield base
        return
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    try:
        yield model
    finally:
        model.unload()


@torch.inference_mode()
def _greedy_one(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """`n` greedy tokens with a KV cache, one prompt, no padding; an end token does not stop
    it (as ignore_eos), so every list has the same length as ours."""
    kw = _cache_kwarg()
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    toks: list[int] = []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        toks.append(nxt)
        if len(toks) == n:
            break
        out = model(input_ids=torch.tensor([[nxt]]), use_cache=True, **{kw: getattr(out, kw)})
    return toks


@functools.lru_cache(maxsize=1)
def _cache_kwarg() -> str:
    """The KV cache's name in and out of forward: `cache` (transformers >= 5.2x; the old
    name warns there) or `past_key_values` (before)."""
    params = inspect.signature(type(hf_model()).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def peft_greedy(adapter_dir: str | None, prompts: Sequence[Sequence[int]],
                max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of each prompt (token ids) under PEFT with `adapter_dir`."""
    with _with_adapter(adapter_dir) as model:
        return [_greedy_one(model, list(p), max_new_tokens) for p in prompts]


@torch.inference_mode()
def peft_logits(adapter_dir: str | None, ids: Sequence[int]) -> list[int]:
    """Teacher-forced argmax at every position of `ids`: entry p predicts token p + 1."""
    with _with_adapter(adapter_dir) as model:
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0]
    return logits.argmax(-1).tolist()
