"""Llama-family decoder (Llama, Mistral, Qwen2 qkv bias, Qwen3 q/k norm) over the KV pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from sglang_like.config import ModelConfig
from sglang_like.forward_batch import ForwardBatch
from sglang_like.mem_pool import KVPool
from sglang_like.models.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sm_scale = self.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        # Llama's attention_bias covers o_proj too; Qwen2 biases only q/k/v.
        o_bias = bias and config.architecture != "qwen2"
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: torch.Tensor, fb: ForwardBatch, rope: RotaryEmbedding, pool: KVPool
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k, fb.positions)
        k_pool, v_pool = pool.k_buffers[self.layer_id], pool.v_buffers[self.layer_id]
        kernels.store_kv(k_pool, v_pool, fb.out_slots, k, v)
        if fb.tree_mask is not None:
            out = kernels.tree_verify_attention(
                q, k_pool, v_pool, fb.req_to_token, fb.req_pool_indices, fb.prefix_lens,
                fb.tree_mask, self.sm_scale,
            )
        elif fb.is_decode:
            out = kernels.decode_attention(
                q, k_pool, v_pool, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                self.sm_scale,
            )
        else:
            out = kernels.extend_attention(
                q, k_pool, v_pool, fb.req_to_token, fb.req_pool_indices, fb.prefix_lens,
                fb.extend_lens, self.sm_scale,
            )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, fb: ForwardBatch, rope: RotaryEmbedding, pool: KVPool
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), fb, rope, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder-only Llama-family model whose attention reads and writes K/V by slot id.

    `forward(fb, pool)` returns float32 logits [len(fb.logits_indices), vocab_size].
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None  # set by the runner: it knows the context

    def set_rope(self, max_positions: int, device: torch.device | str) -> None:
        c = self.config
        self.rope = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling,
                                    device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        x = self.model.embed_tokens(fb.input_ids)
        for layer in self.model.layers:
            x = layer(x, fb, self.rope, pool)
        x = self.model.norm(x[fb.logits_indices])
        return F.linear(x, self.lm_head_weight).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in; a missing or mis-shaped tensor is a ValueError."""
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(weights))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        for name, param in params.items():
            src = weights[name]
            if tuple(src.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(src.to(param.dtype))
        self.requires_grad_(False)
