"""Tiny seeded models of every family, saved as Hugging Face folders: what the family tests
compare with transformers and what benchmarks/check_family_peers.py puts beside llama-server.

Each is a 2-layer, hidden-64 model from transformers' own config class with the family's
settings (windows shorter than the test sequences, soft-caps, partial rotary, multipliers...),
norms and biases made random, then trained a few steps on a short text (`peak`), and saved
with the default model's tokenizer (49,152 tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch

WINDOW = 8  # shorter than every test prompt plus its continuation


class Family(NamedTuple):
    name: str
    model_type: str
    config: dict[str, Any]  # transformers config kwargs beyond the shared shape


SHARED = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              initializer_range=0.1, bos_token_id=0, eos_token_id=2)

FAMILIES = [
    Family("llama-yarn", "llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}}),
    Family("llama-dynamic", "llama", {"rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
    Family("mistral-window", "mistral", {"sliding_window": WINDOW}),
    Family("qwen2-window", "qwen2", {"sliding_window": WINDOW, "use_sliding_window": True,
                                     "max_window_layers": 1,
                                     "layer_types": ["full_attention", "sliding_attention"]}),
    Family("gemma", "gemma", {}),
    Family("gemma2", "gemma2", {"sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    Family("gemma3", "gemma3_text", {
        "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}}),
    Family("phi3-longrope-partial", "phi3", {
        "original_max_position_embeddings": 256, "max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5,
                            "short_factor": [1.0, 1.5, 2.0, 3.0],
                            "long_factor": [2.0, 4.0, 8.0, 16.0]}}),
    Family("olmo2", "olmo2", {}),
    Family("granite", "granite", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.1, "logits_scaling": 2.5}),
    Family("smollm3", "smollm3", {"no_rope_layers": [1, 0], "tie_word_embeddings": True,
                                  "pad_token_id": 0}),
]


def randomize(model: torch.nn.Module) -> None:
    """transformers inits norms to 1 (0 for Gemma's 1 + w) and biases to 0; random instead."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(param + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))


TRAIN_TEXT = (
    "The capital of France is Paris. The capital of Italy is Rome. def fibonacci(n): return n "
    "if n < 2 else fibonacci(n - 1) + fibonacci(n - 2). Rain falls soft on the roof; grey "
    "clouds drift over the hills; the river runs high. Write 3 haiku about rain, then stop. "
)


def peak(model: torch.nn.Module, ids: list[int], steps: int = 12) -> None:
    """A few steps of next-token training on some text, so that the model prefers some tokens
    the way a trained one does: a random model's top logits over a 49k vocabulary are near
    ties (the top-2 gap of ~50k Gaussians is ~0.1 of their spread), which any rounding flips,
    so its top-1 agreement would measure the vocabulary, not the quantization."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.tensor([ids])
    model.train()
    for _ in range(steps):
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build_folder(family: Family, folder: Path, tokenizer_json: tuple[str, int] | None = None
                 ) -> Any:
    """Save a seeded tiny model of `family` (briefly trained, see `_peak`) with the default
    model's tokenizer into `folder`; the transformers model, eval mode, eos off."""
    import transformers

    text, vocab_size = tokenizer_json or default_tokenizer_json()
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}))
    torch.manual_seed(1234)
    config = transformers.AutoConfig.for_model(family.model_type, vocab_size=vocab_size,
                                               **(SHARED | family.config))
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(hf_model)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    peak(hf_model, tok.encode(TRAIN_TEXT))
    hf_model.save_pretrained(folder, safe_serialization=True)
    hf_model.generation_config.eos_token_id = None  # like our ignore_eos
    return hf_model




def default_tokenizer_json() -> tuple[str, int]:
    """The default model's tokenizer as tokenizer.json text, and its vocabulary size."""
    from sglang_like.model_loader import load_tokenizer

    tok = load_tokenizer()
    return tok.backend.to_str(), tok.vocab_size
