"""GGUF reading: metadata as a plain dict, tensors dequantized to torch with Hugging Face names."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import gguf
import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are made: reading metadata needs none
    import torch

    from sglang_like.layers.quantization.gguf_blocks import GGUFBlockWeight

# llama.cpp per-block tensor names -> Hugging Face names (suffix .weight / .bias kept). A fused
# attn_qkv (Phi-3) keeps its fused name here; the loader splits it into q/k/v.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # on attention's output (Gemma 2/3, OLMo 2)
    "ffn_norm": "post_attention_layernorm",  # before the MLP; see _block_name for sandwiches
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, the shared expert and its gate (Qwen2-MoE); the
    # experts' merged [experts, out, in] tensors are split by `_expert_tensors`
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
# Architectures whose ffn_up is gate and up stacked (gate rows first: llama.cpp's fused SwiGLU
# gates with the first half, as Phi-3's gate_up_proj.chunk(2) does); the loader splits it.
_FUSED_GATE_UP = frozenset({"phi3"})
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp stores that are no weight of the HF checkpoint: RoPE frequency factors
# (Llama 3's rope_freqs, Phi-3's longrope factors), which the loader reads into the config.
_IGNORED = {"rope_freqs", "rope_factors_long", "rope_factors_short"}
# Architectures whose converter (LlamaModel.permute) interleaved each Q/K head's RoPE halves for
# llama.cpp's "normal" RoPE; the others (Qwen, Gemma, Phi-3, OLMo 2) rotate halves as HF does.
PERMUTED_QK_ARCHS = frozenset({"llama", "mistral", "granite", "smollm3"})
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


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file: raw bytes as uint8 [rows, bytes per row], shape [out, in]."""

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile(NamedTuple):
    """A parsed GGUF file: metadata as Python values and its tensors (memory-mapped)."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


# GGUF value type id -> struct format of one scalar (8 = string, 9 = array are handled apart).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                   11: "q", 12: "d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class _Cursor:
    """Little-endian reads from a buffer, advancing an offset (struct-based, no per-item numpy)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        value = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return value

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            return self.array()
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"bad GGUF value type {vtype} at byte {self.pos}")
        return self.scalar(_SCALAR_FORMATS[vtype])

    def array(self) -> list[Any]:
        etype, count = self.scalar("I"), self.scalar("Q")
        if etype in _NUMPY_DTYPES:  # numbers: one vectorized read
            dtype = np.dtype(_NUMPY_DTYPES[etype]).newbyteorder("<")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return values.tolist()
        return [self.value(etype) for _ in range(count)]


def read_gguf(path: str) -> GGUFFile:
    """Parse a GGUF (v2/v3, little-endian) file's header; tensor data stays memory-mapped."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(mm[:4]) != b"GGUF":
        raise ValueError(f"{path!r} is not a GGUF file")
    cur.pos = 4
    version = cur.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} unsupported (big-endian or too old?)")
    num_tensors, num_kv = cur.scalar("Q"), cur.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
        code = cur.scalar("I")
        try:
            qtype = gguf.GGMLQuantizationType(code)
        except ValueError:
            raise ValueError(f"{path!r}: tensor {name!r} has an unknown GGML type {code} (a "
                             "newer llama.cpp's? this gguf-py knows "
                             f"{len(gguf.GGMLQuantizationType)} types)") from None
        infos.append((name, qtype, dims, cur.scalar("Q")))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, qtype, dims, offset in infos:
        if qtype not in gguf.GGML_QUANT_SIZES:
            raise ValueError(f"{path!r}: tensor {name!r} is of type {qtype.name}, which has no "
                             "block size here")
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if dims[0] % block_size:
            raise ValueError(f"{path!r}: tensor {name!r} ({qtype.name}) has rows of {dims[0]} "
                             f"values, not a multiple of its {block_size}-value blocks")
        row_bytes = dims[0] // block_size * type_size
        num_rows = int(np.prod(dims[1:], dtype=np.int64))
        start = data_start + offset
        if start + num_rows * row_bytes > mm.size:
            raise ValueError(f"{path!r} is truncated or corrupt: tensor {name!r} "
                             f"({qtype.name} {list(reversed(dims))}) needs bytes up to "
                             f"{start + num_rows * row_bytes}, the file has {mm.size}")
        data = mm[start : start + num_rows * row_bytes].reshape(num_rows, row_bytes)
        tensors.append(GGUFTensor(name, qtype, tuple(reversed(dims)), data))
    return GGUFFile(metadata, tensors)


def hf_tensor_name(gguf_name: str, arch: str | None = None, sandwich: bool = False
                   ) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name; None for tensors HF does not keep.

    `sandwich`: the tensor's layer has a norm on attention's output (post_attention_norm), so
    its ffn_norm is Gemma 2/3's pre_feedforward_layernorm rather than the norm before the MLP
    that Llama calls post_attention_layernorm. `arch` names fused tensors (Phi-3's ffn_up)."""
    if (m := _BLOCK_RE.match(gguf_name)) is not None:
        layer, part, kind = m.groups()
        if part not in _BLOCK_NAMES:
            raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
        name = _BLOCK_NAMES[part]
        if part == "ffn_norm" and sandwich:
            name = "pre_feedforward_layernorm"
        elif part == "ffn_up" and arch in _FUSED_GATE_UP:
            name = "mlp.gate_up_proj"
        return f"model.layers.{layer}.{name}.{kind}"
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


def dequantize_tensor(tensor: GGUFTensor) -> np.ndarray:
    """One tensor as a float32 numpy array in [out, in] (row-major HF) layout."""
    if tensor.qtype in _INT_TYPES:
        raise ValueError(f"integer GGUF tensor {tensor.name!r} ({tensor.qtype.name}) is no weight")
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.qtype)
    except NotImplementedError as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r}: {exc}") from exc
    return np.asarray(array, dtype=np.float32).reshape(tensor.shape)


def _packed(tensor: GGUFTensor, heads: int | None) -> GGUFBlockWeight:
    import torch

    from sglang_like.layers.quantization.gguf_blocks import GGUFBlockWeight

    weight = GGUFBlockWeight(tensor.qtype.name, tensor.shape, tensor.data)
    if heads is None:
        return weight
    order = unpermute_qk(torch.arange(tensor.shape[0])[:, None], heads)[:, 0]
    return weight.take_rows(order)


def iter_hf_tensors(
    tensors: list[GGUFTensor], *, arch: str, num_heads: int, num_kv_heads: int,
    dtype: torch.dtype, keep_packed: bool = False,
) -> Iterator[tuple[str, torch.Tensor | GGUFBlockWeight]]:
    """Yield (hf_name, tensor) for every tensor of the file, dequantized and un-permuted.

    With `keep_packed`, matrices of `PACKED_QTYPES` come as `GGUFBlockWeight` (their blocks,
    rows un-permuted) for a quantized model to repack; nothing of them is dequantized here.
    """
    from sglang_like.layers.quantization.gguf_blocks import PACKED_QTYPES

    permuted = arch in PERMUTED_QK_ARCHS
    sandwiched = {m.group(1) for t in tensors
                  if (m := _BLOCK_RE.match(t.name)) and m.group(2) == "post_attention_norm"}
    for tensor, name in _named(tensors, arch, sandwiched):
        heads = None
        if permuted and ".self_attn.q_proj." in name:
            heads = num_heads
        elif permuted and ".self_attn.k_proj." in name:
            heads = num_kv_heads
        if keep_packed and tensor.qtype.name in PACKED_QTYPES and len(tensor.shape) == 2:
            yield name, _packed(tensor, heads)
            continue
        yield name, _dense(tensor, heads, dtype)


def _named(tensors: list[GGUFTensor], arch: str, sandwiched: set[str]
           ) -> Iterator[tuple[GGUFTensor, str]]:
    """(tensor, its Hugging Face name) of every tensor HF keeps, a merged expert tensor as
    one [out, in] tensor per expert (views of the file's rows)."""
    for tensor in tensors:
        m = _BLOCK_RE.match(tensor.name)
        if m is not None and m.group(2) in _EXPERT_NAMES:
            yield from _expert_tensors(tensor, m.group(1), _EXPERT_NAMES[m.group(2)])
            continue
        name = hf_tensor_name(tensor.name, arch, m is not None and m.group(1) in sandwiched)
        if name is None:
            continue
        if name.endswith("shared_expert_gate.weight") and len(tensor.shape) == 1:
            tensor = tensor._replace(shape=(1, tensor.shape[0]))  # [hidden] -> HF's [1, hidden]
        yield tensor, name


def _expert_tensors(tensor: GGUFTensor, layer: str, proj: str
                    ) -> Iterator[tuple[GGUFTensor, str]]:
    """A merged [experts, out, in] tensor (ffn_*_exps) as each expert's [out, in] tensor."""
    if len(tensor.shape) != 3:
        raise ValueError(f"GGUF tensor {tensor.name!r} has shape {list(tensor.shape)}; "
                         "merged experts are [experts, out, in]")
    experts, rows, cols = tensor.shape
    for j in range(experts):
        part = tensor._replace(shape=(rows, cols), data=tensor.data[j * rows:(j + 1) * rows])
        yield part, f"model.layers.{layer}.mlp.experts.{j}.{proj}.weight"


def _dense(tensor: GGUFTensor, heads: int | None, dtype: torch.dtype) -> torch.Tensor:
    import torch

    array = dequantize_tensor(tensor)
    if not array.flags.writeable:
        array = array.copy()  # F32 tensors come back as views of the read-only memmap
    value = torch.from_numpy(array)
    if heads is not None:
        value = unpermute_qk(value, heads)
    return value.to(dtype)


def read_float_tensor(tensors: list[GGUFTensor], name: str) -> list[float] | None:
    """A small float tensor of the file (e.g. rope_factors_long.weight) as a list; None when
    the file has none of that name."""
    for tensor in tensors:
        if tensor.name == name:
            return dequantize_tensor(tensor).reshape(-1).astype(float).tolist()
    return None
