"""Model loader: the default GGUF vs transformers, tiny GGUF files, tiny HF folders."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as Backend
from tokenizers import pre_tokenizers as pt

from sglang_like.model_loader import (
    default_model_path,
    expected_weight_shapes,
    load_model,
    load_tokenizer,
)
from sglang_like.model_loader.gguf_file import read_gguf
from sglang_like.tokenizer import bytes_to_unicode

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smollm():
    return load_model()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("architecture", "llama"),
        ("num_hidden_layers", 30),
        ("hidden_size", 576),
        ("intermediate_size", 1536),
        ("num_attention_heads", 9),
        ("num_key_value_heads", 3),
        ("head_dim", 64),
        ("vocab_size", 49152),
        ("tie_word_embeddings", True),
        ("rope_theta", 100000.0),
        ("attention_bias", False),
        ("qk_norm", False),
    ],
)
def test_default_config(smollm, field: str, value: object) -> None:
    assert getattr(smollm.config, field) == value


def test_default_weights_names_shapes(smollm) -> None:
    shapes = expected_weight_shapes(smollm.config)
    assert set(smollm.weights) == set(shapes)
    assert "lm_head.weight" not in smollm.weights
    for name, tensor in smollm.weights.items():
        assert tuple(tensor.shape) == shapes[name] and tensor.dtype == torch.float32, name
    assert set(smollm.config.eos_token_ids) == set(smollm.tokenizer.eos_token_ids)


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),
        ("blk.29.attn_q.weight", "model.layers.29.self_attn.q_proj.weight"),
        ("blk.29.attn_k.weight", "model.layers.29.self_attn.k_proj.weight"),
        ("blk.7.attn_v.weight", "model.layers.7.self_attn.v_proj.weight"),
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ],
)
def test_default_weights_equal_transformers_gguf_conversion(
    smollm, gguf_name: str, hf_name: str
) -> None:
    # transformers' GGUF loading = gguf dequantize + LlamaTensorProcessor's reverse permutation.
    utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    tensors = {t.name: t for t in read_gguf(default_model_path()).tensors}
    t = tensors[gguf_name]
    raw = gguf.quants.dequantize(t.data, t.qtype).reshape(t.shape)
    heads = {"num_attention_heads": 9, "num_key_value_heads": 3}
    expected = utils.LlamaTensorProcessor(config=heads).process(raw, gguf_name).weights
    assert torch.equal(smollm.weights[hf_name], torch.from_numpy(np.array(expected)))


# ---- tiny GGUF files written with gguf.GGUFWriter --------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    byte_chars = [bytes_to_unicode()[b] for b in range(256)]
    tokens = SPECIALS + byte_chars + ["Ġt", "he"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, ["Ġ t", "h e"], types


def _llama_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (rotate-half rows -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


# (gguf name suffix, hf name suffix, qtype) of every block tensor in the tiny files.
BLOCK = [
    ("attn_q.weight", "self_attn.q_proj.weight", Q.Q4_0),
    ("attn_k.weight", "self_attn.k_proj.weight", Q.Q8_0),
    ("attn_v.weight", "self_attn.v_proj.weight", Q.F16),
    ("attn_output.weight", "self_attn.o_proj.weight", Q.Q8_0),
    ("ffn_gate.weight", "mlp.gate_proj.weight", Q.BF16),
    ("ffn_up.weight", "mlp.up_proj.weight", Q.Q4_1),
    ("ffn_down.weight", "mlp.down_proj.weight", Q.Q5_0),
    ("attn_norm.weight", "input_layernorm.weight", Q.F32),
    ("ffn_norm.weight", "post_attention_layernorm.weight", Q.F32),
]
# Largest error of each type relative to the tensor's max |w| (a quantization step or so);
# a wrong Q/K row order would give errors of order 1.
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 0.07, Q.Q4_0: 0.13,
             Q.Q4_1: 0.08}


def _write_tiny_gguf(path: str, arch: str) -> dict[str, tuple[np.ndarray, Q]]:
    """A 2-layer model of `arch`; returns hf_name -> (original float weight, qtype)."""
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim, hidden, inter = 4, 2, 32 if arch == "qwen3" else 16, 64, 96
    tokens, merges, types = _tiny_vocab()
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(5e5)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(0)
    w.add_bos_token_id(1)
    w.add_chat_template(CHATML)
    shapes = {
        "attn_q.weight": (heads * head_dim, hidden),
        "attn_k.weight": (kv_heads * head_dim, hidden),
        "attn_v.weight": (kv_heads * head_dim, hidden),
        "attn_output.weight": (hidden, heads * head_dim),
        "ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden),
        "ffn_down.weight": (hidden, inter), "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
    }
    entries = [(f"blk.{i}.{g}", f"model.layers.{i}.{h}", shapes[g], q)
               for i in range(2) for g, h, q in BLOCK]
    entries += [("token_embd.weight", "model.embed_tokens.weight", (len(tokens), hidden), Q.Q8_0),
                ("output_norm.weight", "model.norm.weight", (hidden,), Q.F32)]
    if arch == "llama":
        entries.append(("output.weight", "lm_head.weight", (len(tokens), hidden), Q.F16))
    if arch == "qwen2":
        for i in range(2):
            entries += [(f"blk.{i}.attn_{p}.bias", f"model.layers.{i}.self_attn.{p}_proj.bias",
                         (rows,), Q.F32) for p, rows in (("q", 64), ("k", 32), ("v", 32))]
    if arch == "qwen3":
        for i in range(2):
            entries += [
                (f"blk.{i}.attn_{p}_norm.weight", f"model.layers.{i}.self_attn.{p}_norm.weight",
                 (head_dim,), Q.F32) for p in ("q", "k")
            ]
    originals = {}
    for gguf_name, hf_name, shape, qtype in entries:
        value = rng.standard_normal(shape).astype(np.float32)
        originals[hf_name] = (value, qtype)
        stored = value
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            stored = _llama_permute(value, heads if ".attn_q." in gguf_name else kv_heads)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(gguf_name, stored.astype(np.float16 if qtype == Q.F16 else np.float32))
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return originals


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_loads_and_dequantizes(tmp_path, arch: str) -> None:
    path = str(tmp_path / f"tiny-{arch}.gguf")
    originals = _write_tiny_gguf(path, arch)
    model = load_model(path)
    cfg = model.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == (arch, 2, 64)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.head_dim == (32 if arch == "qwen3" else 16)
    assert (cfg.tie_word_embeddings, cfg.attention_bias, cfg.qk_norm) == (
        arch != "llama", arch == "qwen2", arch == "qwen3"
    )
    assert cfg.rope_theta == 5e5 and cfg.vocab_size == len(_tiny_vocab()[0])
    assert set(model.weights) == set(originals) == set(expected_weight_shapes(cfg))
    for name, (value, qtype) in originals.items():
        loaded = model.weights[name].numpy()
        assert loaded.shape == value.shape, name
        if qtype == Q.F16:
            np.testing.assert_array_equal(loaded, value.astype(np.float16).astype(np.float32))
        else:
            err = np.abs(loaded - value).max() / np.abs(value).max()
            assert err <= TOLERANCE[qtype], (name, qtype.name, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiny_gguf_dtype(tmp_path, dtype: torch.dtype) -> None:
    path = str(tmp_path / "tiny.gguf")
    originals = _write_tiny_gguf(path, "llama")
    model = load_model(path, dtype=dtype)
    assert all(t.dtype == dtype for t in model.weights.values())
    as_f32 = load_model(path).weights
    for name in originals:
        assert torch.equal(model.weights[name], as_f32[name].to(dtype)), name


def test_tiny_gguf_tokenizer(tmp_path) -> None:
    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(path, "qwen2")
    tok = load_tokenizer(path)
    text = "<|im_start|>the top 42 héllo<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids) == text
    assert tok.token_to_id("Ġt") in ids and tok.token_to_id("he") in ids  # merges applied
    assert tok.eos_token_ids == {0, 2}  # eos + ChatML turn end
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )


def test_bad_paths(tmp_path) -> None:
    with pytest.raises(ValueError):
        load_model(str(tmp_path))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF"):
        load_model(str(bad))


# ---- tiny Hugging Face folders ---------------------------------------------------------------


def _write_tokenizer(folder: str) -> None:
    tokens, merges, _ = _tiny_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=[tuple(m.split()) for m in merges]))
    backend.pre_tokenizer = pt.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>"}, f)


HF_CASES = [
    ("llama", {"tie_word_embeddings": False}, None),
    ("mistral", {"tie_word_embeddings": False}, "40KB"),
    ("qwen2", {"tie_word_embeddings": True}, None),
    ("qwen3", {"tie_word_embeddings": True, "head_dim": 32}, "40KB"),
]


@pytest.mark.parametrize(("model_type", "extra", "shard_size"), HF_CASES)
def test_hf_folder_loads(tmp_path, model_type: str, extra: dict, shard_size: str | None) -> None:
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.AutoConfig.for_model(
        model_type, vocab_size=261, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=0, bos_token_id=1, **extra,
    )
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    save = {"max_shard_size": shard_size} if shard_size else {}
    hf_model.save_pretrained(tmp_path, **save)
    _write_tokenizer(str(tmp_path))
    if shard_size:
        assert os.path.exists(tmp_path / "model.safetensors.index.json")

    model = load_model(str(tmp_path))
    cfg = model.config
    assert cfg.architecture == model_type
    assert cfg.tie_word_embeddings == extra["tie_word_embeddings"]
    assert cfg.head_dim == extra.get("head_dim", 16) and cfg.vocab_size == 261
    assert cfg.attention_bias == (model_type == "qwen2") and cfg.qk_norm == (model_type == "qwen3")
    assert cfg.rope_theta == hf_model.config.to_dict().get(
        "rope_theta", (hf_model.config.to_dict().get("rope_parameters") or {}).get("rope_theta")
    )
    state = hf_model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    assert set(model.weights) == set(state)
    for name, tensor in state.items():
        assert torch.equal(model.weights[name], tensor), name
    assert {0, 2} <= set(cfg.eos_token_ids)  # config eos + the ChatML turn end
    tok = model.tokenizer
    assert tok.encode("<|im_start|> the") == [1, tok.token_to_id("Ġt"), tok.token_to_id("he")]


def test_hf_folder_unsupported(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _write_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported"):
        load_model(str(tmp_path))
