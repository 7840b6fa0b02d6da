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
    """How one decoder layer computes, beyond its shapes. Defaults are Llama's.

    Norm layouts (the modules' names are Hugging Face's, so checkpoints load by name):

        "pre"       x += attn(input_layernorm(x));  x += mlp(post_attention_layernorm(x))
        "sandwich"  x += post_attention_layernorm(attn(input_layernorm(x)))
                    x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
        "post"      x += post_attention_layernorm(attn(x));  x += post_feedforward_layernorm(mlp(x))

    ("pre": Llama, Qwen, Mistral, Phi-3, Granite; "sandwich": Gemma 2/3; "post": OLMo 2.) Each
    sub-layer's output is scaled by `residual_scale` before the add (Granite). A norm's weight is
    the multiplier it applies: Gemma's `1 + w` is folded into w at load.
    """

    norm: str = "rms"  # the kind of every norm of the layer
    norm_eps: float = 1e-5
    norm_layout: str = "pre"  # "pre" | "sandwich" | "post"
    activation: str = "silu"  # of the gated MLP: act(gate) * up; "silu" | "gelu_tanh"
    # a norm of q and k before RoPE: None; "head" over each head (Qwen3, Gemma 3); "full" over
    # all of a token's q (k) rows at once (OLMo 2)
    qk_norm: str | None = None
    has_qkv_bias: bool = False
    has_o_bias: bool = False
    # which rotary table rotates q and k: "global" (the model's rope_theta and scaling),
    # "local" (Gemma 3's sliding layers: their own base, unscaled) or "none" (SmolLM3's NoPE)
    rope: str = "global"
    # a query sees only the last `sliding_window` keys of its visible ones (itself included:
    # positions p - window < j <= p, transformers' convention); None: all of them
    sliding_window: int | None = None
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    residual_scale: float = 1.0  # sub-layer outputs are scaled by it before the add (Granite)
    # "dense": one gated MLP; "moe": a router and experts (layers/moe.py; Qwen-MoE, Mixtral,
    # OLMoE), with a shared expert where the config has one
    mlp: str = "dense"

    @property
    def has_pre_attn_norm(self) -> bool:
        return self.norm_layout != "post"


class DecoderLayerParts(NamedTuple):
    """A decoder layer's modules and shapes, as the native step reads them (this rank's).

    The norms by role; None where the layout has none (see `DecoderLayerDescription`)."""

    description: DecoderLayerDescription
    input_norm: RMSNorm | None  # before attention ("pre", "sandwich")
    qkv_proj: nn.Module  # a QuantLinear: q, k, v rows fused
    o_proj: nn.Module
    mlp_norm: RMSNorm | None  # before the MLP ("pre", "sandwich")
    gate_up_proj: nn.Module | None  # gate, up rows fused (None: a sparse layer, see `moe`)
    down_proj: nn.Module | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_id: int
    sm_scale: float
    attn_out_norm: RMSNorm | None = None  # on attention's output ("sandwich", "post")
    mlp_out_norm: RMSNorm | None = None  # on the MLP's output ("sandwich", "post")
    q_norm: RMSNorm | None = None  # per `description.qk_norm`
    k_norm: RMSNorm | None = None
    # a sparse layer's MLP (layers/moe.py's SparseMoE: router, experts, shared expert), called
    # as a whole on the MLP's input; gate_up_proj / down_proj are None then
    moe: nn.Module | None = None

    @property
    def linears(self) -> tuple[nn.Module, nn.Module, nn.Module | None, nn.Module | None]:
        """qkv, o, gate_up, down: the order of the fused step's weight table (the last two
        None for a sparse layer)."""
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj
