"""GGUF reading: metadata as a plain dict, tensors dequantized to torch with Hugging Face names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch

# llama.cpp per-block tensor names -> Hugging Face names (suffix .weight / .bias kept).
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp stores that the HF checkpoint derives on the fly (e.g. llama3 rope factors).
_IGNORED = {"rope_freqs"}
_INT_TYPES = frozenset(
    {
        gguf.GGMLQuantizationType.I8,
        gguf.GGMLQuantizationType.I16,
        gguf.GGMLQuantizationType.I32,
        gguf.GGMLQuantizationType.I64,
    }
)
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    """Every key/value field of a `gguf.GGUFReader` as Python values (strings, numbers, lists)."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = field.contents()
    return metadata


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name; None for tensors HF does not keep."""
    if (m := _BLOCK_RE.match(gguf_name)) is not None:
        layer, part, kind = m.groups()
        if part not in _BLOCK_NAMES:
            raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    if (m := _GLOBAL_RE.match(gguf_name)) is not None:
        part, kind = m.groups()
        if part in _IGNORED:
            return None
        if part in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[part]}.{kind}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves).

    The converter turned each head's rows [0..d/2) [d/2..d) into interleaved pairs; per head
    rows are laid out as (d/2, 2) and we swap back to (2, d/2). Works for weights and biases.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    rest = weight.shape[1:]
    w = weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2)
    return w.reshape(rows, *rest).contiguous()


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """One `ReaderTensor` as a float32 numpy array in [out, in] (row-major HF) layout."""
    qtype = tensor.tensor_type
    if qtype in _INT_TYPES:
        raise ValueError(f"integer GGUF tensor {tensor.name!r} ({qtype.name}) is not a weight")
    try:
        array = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r}: {exc}") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(array, dtype=np.float32).reshape(shape)


def iter_hf_tensors(
    reader: Any, *, arch: str, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for every tensor of the file, dequantized and un-permuted."""
    permuted = arch in ("llama", "mistral")
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        array = dequantize_tensor(tensor)
        if not array.flags.writeable:
            array = array.copy()  # F32 tensors come back as views of the read-only memmap
        value = torch.from_numpy(array)
        if permuted and ".self_attn.q_proj." in name:
            value = unpermute_qk(value, num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            value = unpermute_qk(value, num_kv_heads)
        yield name, value.to(dtype)
