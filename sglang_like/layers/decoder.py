"""What a decoder layer is, as data: its description (how the family differs) and its parts.

A model family declares each layer as a `DecoderLayerDescription` (the norm kind, the
activation, q/k norm, biases, sliding window, soft-caps, ...), the way llama.cpp's graph
builders read one set of hyper-parameters. The native decode step (`layers.native_decode`)
reads descriptions and `DecoderLayerParts`, never a family's module internals, so any
architecture built from the standard layers gets the one-call step wherever the C kernels
implement what its description says (`native_decode.supports`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from torch import nn

    from sglang_like.layers.norm import RMSNorm


@dataclass(frozen=True)
class DecoderLayerDescription:
    """How one decoder layer computes, beyond its shapes. Defaults are Llama's."""

    norm: str = "rms"  # the kind of the input / post-attention norms
    norm_eps: float = 1e-5
    activation: str = "silu"  # of the gated MLP: act(gate) * up
    has_qk_norm: bool = False  # a norm over each head of q and k before RoPE (Qwen3)
    has_qkv_bias: bool = False
    has_o_bias: bool = False
    has_rope: bool = True  # False: a layer without position rotation (SmolLM3's NoPE layers)
    sliding_window: int | None = None  # keys older than this many positions are not seen
    attn_logit_softcap: float | None = None  # tanh soft-cap of the attention scores
    has_post_norms: bool = False  # norms on the sub-layers' outputs (sandwich norms)


class DecoderLayerParts(NamedTuple):
    """A decoder layer's modules and shapes, as the native step reads them (this rank's)."""

    description: DecoderLayerDescription
    input_norm: RMSNorm
    qkv_proj: nn.Module  # a QuantLinear: q, k, v rows fused
    o_proj: nn.Module
    post_attention_norm: RMSNorm
    gate_up_proj: nn.Module  # gate, up rows fused
    down_proj: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_id: int
    sm_scale: float

    @property
    def linears(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """qkv, o, gate_up, down: the order of the fused step's weight table."""
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj
