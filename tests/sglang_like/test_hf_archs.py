"""Tiny random HF folders of each supported family vs transformers; the default model in bf16."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import pytest
import torch

import sglang_like.engine_core.setup as setup_mod
from sglang_like import Engine
from sglang_like.forward_batch import ForwardBatch
from sglang_like.layers.quantization import int4_kernel
from sglang_like.model_loader import load_model, load_tokenizer
from sglang_like.model_loader.hf_loader import hf_model_config

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "<|im_start|>user\nWrite 3 haiku about rain.<|im_end|>\n",
]
NEW_TOKENS = 16
LOGITS_ATOL = 1e-4
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ ' ' + m['content'] + eos_token }}{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}"
    "{% endfor %}"
)
CHATML_TEMPLATE = (  # unlike the default model's template: no default system prompt
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # Small on purpose: most frequencies get scaled at the positions these prompts reach.
    "original_max_position_embeddings": 16,
}


class Case(NamedTuple):
    name: str
    model_type: str
    config: dict[str, Any]  # extra transformers config kwargs
    chat_template: str


CASES = [
    Case("llama", "llama", {"tie_word_embeddings": False}, LLAMA_TEMPLATE),
    Case("llama3-rope-bias", "llama",
         {"tie_word_embeddings": True, "attention_bias": True, "rope_scaling": LLAMA3_SCALING,
          "rope_theta": 500000.0}, LLAMA_TEMPLATE),
    Case("mistral-linear-rope", "mistral",
         {"tie_word_embeddings": False, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
         MISTRAL_TEMPLATE),
    Case("qwen2", "qwen2", {"tie_word_embeddings": True, "rope_theta": 1e6}, CHATML_TEMPLATE),
    Case("qwen3", "qwen3", {"tie_word_embeddings": False}, CHATML_TEMPLATE),
]


def _hf_config(case: Case, vocab_size: int, **override: Any) -> Any:
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        initializer_range=0.1, bos_token_id=0, eos_token_id=2,
    )
    kwargs |= case.config | override
    return transformers.AutoConfig.for_model(case.model_type, **kwargs)


def _randomize_defaults(model: torch.nn.Module) -> None:
    """transformers inits norms to 1 and biases to 0; make them random so they are exercised."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))


class Built(NamedTuple):
    case: Case
    path: str
    hf_model: Any
    hf_tokenizer: Any
    engine: Engine


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> tuple[str, int]:
    """The default model's tokenizer saved as tokenizer.json (real BPE, valid ids); vocab size."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok = load_tokenizer()
    tok.backend.save(str(path))
    return path.read_text(encoding="utf-8"), tok.vocab_size


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def built(request, tmp_path_factory, tokenizer_json: tuple[str, int]):
    case: Case = request.param
    folder = tmp_path_factory.mktemp(case.name)
    text, vocab_size = tokenizer_json
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": case.chat_template, "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
    }))
    torch.manual_seed(1234)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        _hf_config(case, vocab_size), dtype=torch.float32
    ).eval()
    _randomize_defaults(hf_model)
    hf_model.save_pretrained(folder, safe_serialization=True)
    hf_model.generation_config.eos_token_id = None  # like our ignore_eos
    # Not AutoTokenizer: for qwen2 folders transformers 5 rebuilds the pre-tokenizer its own way
    # instead of using tokenizer.json as written.
    hf_tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    # The conftest may have swapped in a load_model cache sized for the default model; these
    # throwaway folders go around it.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(setup_mod, "load_model", load_model)
        engine = Engine(model_path=str(folder), max_total_tokens=4096, quantization="none",
                        engine_in_process=True)
    yield Built(case, str(folder), hf_model, hf_tokenizer, engine)
    engine.shutdown()


def _our_prefill_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """All-position logits of our model for `ids`, run on a scratch row of an idle engine."""
    runner, cache, n = engine.runner, engine.scheduler.cache, len(ids)
    row = runner.req_to_token_pool.alloc()
    slots = cache.alloc_slots(n)
    assert row is not None and slots is not None
    try:
        runner.req_to_token_pool.write(row, 0, slots)
        fb = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.arange(n),
            out_slots=torch.tensor(slots), req_pool_indices=torch.tensor([row]),
            prefix_lens=torch.tensor([0]), extend_lens=torch.tensor([n]),
            logits_indices=torch.arange(n), req_to_token=runner.req_to_token_pool.req_to_token,
        )
        return runner.model(fb, runner.kv_pool)
    finally:
        cache.allocator.free(slots)
        runner.req_to_token_pool.free(row)


def _hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def _hf_greedy(model: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        )
    return out[0, len(ids):].tolist()


def test_loads_with_detected_architecture(built: Built) -> None:
    cfg, hf = built.engine.model_config, built.hf_model.config
    assert cfg.architecture == built.case.model_type
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (2, 64, 16)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.vocab_size == built.engine.tokenizer.vocab_size == hf.vocab_size
    assert cfg.tie_word_embeddings == built.case.config["tie_word_embeddings"]
    assert cfg.attention_bias == (built.case.model_type == "qwen2"
                                  or built.case.config.get("attention_bias", False))
    assert cfg.qk_norm == (built.case.model_type == "qwen3")
    scaling = built.case.config.get("rope_scaling")
    assert (cfg.rope_scaling or {}).get("rope_type") == (scaling or {}).get("rope_type")
    assert cfg.rope_theta == built.case.config.get("rope_theta", 10000.0)


def test_prefill_logits_match_transformers(built: Built) -> None:
    tok = built.engine.tokenizer
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert ids == built.hf_tokenizer.encode(prompt, add_special_tokens=False)
        got, want = _our_prefill_logits(built.engine, ids), _hf_logits(built.hf_model, ids)
        assert got.shape == want.shape == (len(ids), tok.vocab_size)
        assert (got - want).abs().max().item() < LOGITS_ATOL, prompt
        assert want.std().item() > 0.1  # logits far from flat: the comparison means something
    if "rope_scaling" in built.case.config:
        _check_scaling_matters(built)


def _check_scaling_matters(built: Built) -> None:
    """Same weights without the scaling give clearly different logits (the case can fail)."""
    unscaled = transformers.AutoModelForCausalLM.from_config(
        _hf_config(built.case, built.hf_model.config.vocab_size, rope_scaling=None),
        dtype=torch.float32,
    ).eval()
    unscaled.load_state_dict(built.hf_model.state_dict())
    ids = built.engine.tokenizer.encode(PROMPTS[2])
    got = _our_prefill_logits(built.engine, ids)
    assert (got - _hf_logits(unscaled, ids)).abs().max().item() > 100 * LOGITS_ATOL


def test_greedy_matches_transformers(built: Built) -> None:
    id_lists = [built.engine.tokenizer.encode(p) for p in PROMPTS]
    ours = built.engine.generate(
        input_ids=id_lists,
        sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    )
    for ids, out in zip(id_lists, ours, strict=True):
        theirs = _hf_greedy(built.hf_model, ids, NEW_TOKENS)
        assert len(theirs) == NEW_TOKENS
        assert out["output_ids"] == theirs
        assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_chat_uses_folder_template(built: Built) -> None:
    engine, hf_tok = built.engine, built.hf_tokenizer
    want_text = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert engine.apply_chat_template(MESSAGES) == want_text
    assert "Another one?" in want_text and "You are" not in want_text
    want_ids = engine.tokenizer.encode(want_text)
    out = engine.chat(MESSAGES, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["prompt_tokens"] == len(want_ids)
    assert out["output_ids"] == _hf_greedy(built.hf_model, want_ids, 8)


WINDOW_CASES = [  # (config.json fields, each layer's window)
    ({"model_type": "mistral", "sliding_window": 64}, [64, 64]),
    ({"model_type": "mistral", "sliding_window": 4096}, [4096, 4096]),
    ({"model_type": "mistral", "sliding_window": None}, [None, None]),
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": False}, [None, None]),
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
      "max_window_layers": 1}, [None, 64]),
    ({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True,
      "layer_types": ["full_attention", "sliding_attention"]}, [None, 64]),
    ({"model_type": "qwen3", "sliding_window": 64,
      "layer_types": ["full_attention", "full_attention"]}, [None, None]),
    ({"model_type": "gemma2", "sliding_window": 32}, [32, None]),  # no layer_types: even slide
    ({"model_type": "gemma3_text", "sliding_window": 32, "sliding_window_pattern": 2},
     [32, None]),
]


@pytest.mark.parametrize(("fields", "windows"), WINDOW_CASES)
def test_sliding_windows_per_layer(fields: dict[str, Any], windows: list) -> None:
    """Each layer's window as transformers applies it; the context is the model's whole one
    (attention computes the window, it does not cap the context)."""
    cfg = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512}
    config = hf_model_config(cfg | fields, has_lm_head=True, eos_token_ids=(), model_path="x")
    assert config.max_position_embeddings == 512
    assert [config.layer_window(i) for i in range(2)] == windows


L3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}
ROPE_CASES = [  # (config.json rope fields as transformers 4.x or 5.x write them, theta, scaling)
    ({}, 10000.0, None),
    ({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **L3}}, 5e5,
     {"rope_type": "llama3", **L3}),
    ({"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}, 1e6,
     {"type": "linear", "factor": 2.0}),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e6, None),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **L3}}, 5e5,
     {"rope_type": "llama3", **L3}),
]


@pytest.mark.parametrize(("fields", "theta", "scaling"), ROPE_CASES)
def test_rope_fields_of_both_config_formats(
    fields: dict, theta: float, scaling: dict | None
) -> None:
    cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4}
    config = hf_model_config(cfg | fields, has_lm_head=True, eos_token_ids=(), model_path="x")
    assert (config.rope_theta, config.rope_scaling) == (theta, scaling)


# ---- the default model in bfloat16 ------------------------------------------------------------


def test_default_model_bfloat16_greedy(make_engine) -> None:
    prompt, params = "The capital of France is", {"max_new_tokens": 8, "temperature": 0}
    bf16 = make_engine(dtype="bfloat16", max_total_tokens=4096)
    assert bf16.runner.kv_pool.k_buffers[0].dtype == torch.bfloat16
    # an explicit dtype means dense weights (auto quantization resolves to none)
    assert bf16.server_args.quantization == "none"
    assert bf16.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    f32 = make_engine(max_total_tokens=4096, quantization="none")
    got, want = bf16.generate(prompt, params), f32.generate(prompt, params)
    # Measured: the closest top-2 logprob gap over these 8 steps is ~0.22 in both dtypes, while
    # bf16 moves logprobs by <0.1, so exact equality is not a coin toss.
    assert got["output_ids"] == want["output_ids"], (got["text"], want["text"])
    assert got["text"] == want["text"] and "Paris" in got["text"]


# ---- the same folders quantized at load -------------------------------------------------------

# Relative L2 error of all-position prefill logits against transformers' fp32, largest
# allowed. These folders hold random Gaussian weights, 4-bit's worst case (no outliers to
# spend levels on): measured 0.020-0.028 for int8 and 0.22-0.39 for int4 over the five cases;
# a layout bug (partitions swapped, a bias or norm lost) gives errors of order 1.
QUANT_LOGITS_REL = {"int8": 0.05, "int4": 0.5}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_folder_tracks_transformers(built: Built, quantization: str) -> None:
    """Hugging Face folders quantize at load, for every architecture case (biases, q/k norms,
    tied and untied heads): the logits stay near transformers' and the linears really are
    quantized."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(setup_mod, "load_model", load_model)
        engine = Engine(model_path=built.path, max_total_tokens=4096,
                        quantization=quantization, engine_in_process=True)
    try:
        method = engine.runner.model.model.layers[0].mlp.down_proj.method
        int4 = {"x16": "Q4X16Method", "native": "Q4NativeMethod", "torch": "Int4Method"}[
            int4_kernel()]  # by this CPU (AMX or not)
        assert type(method).__name__ == {"int8": "Int8Method", "int4": int4}[quantization]
        worst = 0.0
        for prompt in PROMPTS:
            ids = engine.tokenizer.encode(prompt)
            got, want = _our_prefill_logits(engine, ids), _hf_logits(built.hf_model, ids)
            worst = max(worst, ((got - want).norm() / want.norm()).item())
        print(f"{built.case.name} {quantization}: worst relative logit error {worst:.4f}")
        assert worst < QUANT_LOGITS_REL[quantization]
    finally:
        engine.shutdown()
