"""Tiny seeded models of every family, saved as Hugging Face folders: what the family tests
compare with transformers and what benchmarks/check_family_peers.py puts beside llama-server.

Each is a 2-layer, hidden-64 model from transformers' own config class with the family's
settings (windows shorter than the test sequences, soft-caps, partial rotary, multipliers...),
norms and biases made random, then trained a few steps on a short text (`peak`), and saved
with the default model's tokenizer (49,152 tokens).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, NamedTuple

import torch

WINDOW = 8  # shorter than every test prompt plus its continuation
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    return fibonacci(n - 1) + fibonacci(n - 2) if n > 1 else n",
    "<|im_start|>user\nWrite 3 haiku about rain.<|im_end|>\n",
]


class Family(NamedTuple):
    name: str
    model_type: str
    config: dict[str, Any]  # transformers config kwargs beyond the shared shape


SHARED = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              initializer_range=0.1, bos_token_id=0, eos_token_id=2)

MOE_FAMILIES = [
    Family("qwen3-moe", "qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 32, "norm_topk_prob": True}),
    Family("qwen2-moe", "qwen2_moe", {"num_experts": 8, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 32,
                                      "shared_expert_intermediate_size": 48,
                                      "mlp_only_layers": [1]}),
    Family("mixtral", "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    Family("olmoe", "olmoe", {"num_experts": 8, "num_experts_per_tok": 2}),
]

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
    # mixtures of experts: top-2 of 8 experts (4 for Mixtral), weights renormalized or not as
    # each family's released models do; Qwen2-MoE with its gated shared expert and a dense
    # second layer (mlp_only_layers), so that both MLP kinds sit in one model
    *MOE_FAMILIES,
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


class ConverterCase(NamedTuple):
    """A tiny family as llama.cpp's convert_hf_to_gguf.py can write it (see each comment)."""

    family: Family
    # how the converter gets the vocab: "json" (tokenizer.json as written), "spm" (a
    # tokenizer.model beside it: gemma / gemma2 read only that, and the converter's Qwen path
    # takes it before transformers' Qwen2Tokenizer, which rebuilds the tokenizer.json's
    # pre-tokenizer into one the converter does not know), or a tokenizer_class for
    # tokenizer_config.json (Phi-3's converter reads the key; Gemma 3's AutoTokenizer would
    # add Gemma's special tokens past the vocab)
    vocab: str = "json"
    # the file metadata that says the folder's window, where the converter writes none
    window_metadata: dict[str, Any] | None = None


_BY_NAME = {f.name: f for f in FAMILIES}


def _variant(name: str, new_name: str | None = None, drop: tuple[str, ...] = (),
             **config: Any) -> Family:
    base = _BY_NAME[name]
    kept = {k: v for k, v in base.config.items() if k not in drop}
    return base._replace(name=new_name or name, config=kept | config)


GEMMA3_LAYERS = 6  # one global layer in six, as llama.cpp assumes (no pattern in the file)
SMOLLM3_LAYERS = 4  # llama.cpp: every 4th layer without RoPE (hard-coded)
CONVERTER_CASES = [
    ConverterCase(_BY_NAME["llama-yarn"]),
    # Llama 3's scaling: the converter stores it as per-frequency factors (rope_freqs)
    ConverterCase(Family("llama3", "llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}})),
    ConverterCase(_BY_NAME["mistral-window"],
                  window_metadata={"llama.attention.sliding_window": ("UINT32", 8)}),
    ConverterCase(_BY_NAME["qwen2-window"], "spm", window_metadata={
        "qwen2.attention.sliding_window": ("UINT32", 8),
        "qwen2.attention.sliding_window_pattern": ("ARRAY", [False, True])}),
    ConverterCase(Family("qwen3", "qwen3", {}), "spm"),
    ConverterCase(_BY_NAME["gemma"], "spm"),
    # llama.cpp scales Gemma 2/3 scores by head_dim ** -0.5 (hidden / heads for the 27Bs),
    # which their released query_pre_attn_scalar equals; the converter does not write it
    ConverterCase(_variant("gemma2", query_pre_attn_scalar=16), "spm"),
    ConverterCase(_variant("gemma3", query_pre_attn_scalar=16, num_hidden_layers=GEMMA3_LAYERS,
                           layer_types=["sliding_attention"] * 5 + ["full_attention"]),
                  "PreTrainedTokenizerFast"),
    ConverterCase(_BY_NAME["phi3-longrope-partial"], "GPT2Tokenizer"),
    ConverterCase(_BY_NAME["olmo2"]),
    ConverterCase(_BY_NAME["granite"]),
    ConverterCase(_variant("smollm3", num_hidden_layers=SMOLLM3_LAYERS,
                           no_rope_layers=[1, 1, 1, 0])),
    # merged expert tensors (ffn_*_exps); Mixtral is written as a "llama" file. The Qwen-MoE
    # and OLMoE converters read the vocab through AutoTokenizer only (no SentencePiece path),
    # whose family tokenizers (Qwen2's, GPT-NeoX's) would rebuild the pre-tokenizer or add
    # tokens past the vocab: the plain fast tokenizer keeps the folder's
    ConverterCase(_BY_NAME["qwen3-moe"], "PreTrainedTokenizerFast"),
    # (the Qwen2-MoE converter takes no dense layer: every layer sparse here)
    ConverterCase(_variant("qwen2-moe", drop=("mlp_only_layers",)), "PreTrainedTokenizerFast"),
    ConverterCase(_BY_NAME["mixtral"]),
    ConverterCase(_BY_NAME["olmoe"], "PreTrainedTokenizerFast"),  # not GPT-NeoX's tokenizer
]


def tokenizer_model() -> bytes:
    """A tiny SentencePiece BPE model on this module's text: the converter pads its ~100
    pieces to the folder's vocab_size with unused [PAD] tokens, so the model keeps the
    folder's vocabulary (the comparisons feed both loads the same ids)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([TRAIN_TEXT] * 4 + PROMPTS * 4), model_writer=buf,
        vocab_size=100, model_type="bpe", character_coverage=1.0, unk_id=0, bos_id=1,
        eos_id=2, minloglevel=2, num_threads=1)
    return buf.getvalue()


def prepare_for_converter(folder: Path, case: ConverterCase, spm_model: bytes) -> None:
    """Give `folder` the vocab files the converter reads for `case` (see `ConverterCase`)."""
    vocab = case.vocab
    if vocab == "spm":
        (folder / "tokenizer.model").write_bytes(spm_model)
    elif vocab != "json":
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"tokenizer_class": vocab}))
