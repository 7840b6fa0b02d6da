"""benchmarks.random_gguf at a tiny size: the random HF folder (config, bf16 safetensors shapes
and init, the GGUF-derived tokenizer) and, where llama.cpp's source and tools are present, the
convert + quantize steps and their cache."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pytest

from benchmarks.random_gguf import RandomLlamaSpec, build_random_llama_gguf, write_random_hf_folder

TINY = RandomLlamaSpec(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                       num_kv_heads=2)
VOCAB = 49152


def _llama_cpp_bin() -> str | None:
    """$LLAMA_CPP_BIN, else ../shared/peers/llama-cpp.sh's build folder, if it has the tools."""
    env = os.environ.get("LLAMA_CPP_BIN")
    found = [env] if env else sorted(glob.glob(
        os.path.expanduser("~/.cache/peers/llama.cpp-*/build/bin")))
    for folder in found:
        if os.access(os.path.join(folder, "llama-quantize"), os.X_OK):
            return folder
    return None


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("random_llama") / "hf"
    write_random_hf_folder(str(folder), TINY, seed=0)
    return folder


def test_config_is_the_spec(tiny_folder: Path) -> None:
    config = json.loads((tiny_folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expect = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "vocab_size": VOCAB, "tie_word_embeddings": False, "dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2}
    assert {k: config[k] for k in expect} == expect


def test_safetensors_shapes_dtype_and_init(tiny_folder: Path) -> None:
    import torch
    from safetensors import safe_open

    files = sorted(tiny_folder.glob("*.safetensors"))
    tensors = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    h, kv, inter = 256, 2 * 64, 512
    layer = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
             "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
             "mlp.down_proj": (h, inter), "input_layernorm": (h,),
             "post_attention_layernorm": (h,)}
    expect = {"model.embed_tokens.weight": (VOCAB, h), "lm_head.weight": (VOCAB, h),
              "model.norm.weight": (h,)}
    expect |= {f"model.layers.{i}.{k}.weight": s for i in range(2) for k, s in layer.items()}
    assert {k: tuple(t.shape) for k, t in tensors.items()} == expect
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert sum(t.numel() for t in tensors.values()) == TINY.num_params(VOCAB)
    for name, t in tensors.items():  # transformers' init: normal(0, 0.02), unit norms
        if t.dim() == 1:
            assert torch.all(t == 1), name
        else:
            assert abs(t.float().std().item() - 0.02) < 0.002, name
    # untied and seeded: output differs from input embedding
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


@pytest.mark.parametrize("text", ["Hello, world! 12345", "<|im_start|>user\nhi<|im_end|>\n",
                                  "  spaces\tand ünïcödé ✓"])
def test_tokenizer_round_trip(tiny_folder: Path, text: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_folder / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    ids = tok.encode(text).ids
    assert max(ids) < VOCAB
    assert tok.decode(ids, skip_special_tokens=False) == text
    config = json.loads((tiny_folder / "tokenizer_config.json").read_text())
    assert tok.token_to_id(config["bos_token"]) == 1
    assert tok.token_to_id(config["eos_token"]) == 2


@pytest.mark.parametrize("kwargs", [{"hidden_size": 300}, {"intermediate_size": 1000},
                                    {"num_heads": 3}, {"num_kv_heads": 3}])
def test_spec_rejects_shapes_k_quants_cannot_take(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        RandomLlamaSpec(**kwargs)


def test_default_spec_is_about_one_billion() -> None:
    assert RandomLlamaSpec().num_params(VOCAB) == 1_013_000_192


@pytest.mark.slow  # about 10 s: the converter imports torch and transformers
def test_convert_and_quantize_cached(tmp_path: Path) -> None:
    bin_dir = _llama_cpp_bin()
    if bin_dir is None:
        pytest.skip("llama.cpp tools not built (../shared/peers/llama-cpp.sh)")
    pytest.importorskip("sentencepiece")
    gguf = pytest.importorskip("gguf")
    paths = build_random_llama_gguf(bin_dir, str(tmp_path), ("Q4_K_M",), seed=0, spec=TINY)
    path = paths["Q4_K_M"]
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    assert len(types) == 2 + 7 * TINY.num_layers
    assert set(types.values()) == {"Q4_K", "Q6_K"}  # Q4_K_M's mixture, no 32-block fallback
    pre = reader.fields["tokenizer.ggml.pre"]
    assert bytes(pre.parts[pre.data[0]]).decode() == "smollm"
    leftovers = [p.name for p in tmp_path.iterdir() if not p.name.endswith((".gguf", ".log"))]
    assert leftovers == []  # HF folder deleted, no temp names
    assert not any(p.name.endswith(".f16.gguf") for p in tmp_path.iterdir())
    mtime = os.path.getmtime(path)
    assert build_random_llama_gguf(bin_dir, str(tmp_path), ("Q4_K_M",), spec=TINY) == paths
    assert os.path.getmtime(path) == mtime  # cached: not rebuilt
