"""The EAGLE-3 head's inference forward on the CPU fast path: quantized linears, native ops.

The head is one decoder layer plus fc and a draft-vocabulary LM head: about 10M weights,
40 MB in float32, which a batch-1 draft step streamed three times per verify cycle (1.8 ms
a forward on a 2-core machine, more than a quarter of the target's whole decode step). Here
its linears take the target's own linear methods (int4 / int8 codes, a sixth to a quarter of
the bytes), fused as the target's are (q/k/v, gate/up), and its norms, RoPE + KV store +
attention and silu*mul run through sglang_like_kernels.cpu like the target's native decode
path, so a head forward costs a few hundred microseconds.

The drafted tokens only choose what the target verifies (acceptance is decided by the
target's own logits), so the head's rounding changes how often drafts are accepted, never
an output: bench_speculative measures the acceptance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_like.layers.native_decode import AttnRows
from sglang_like.layers.quantization import QuantConfig, QuantLinear
from sglang_like.layers.quantization.q4_native import Q4X16Method
from sglang_like.speculative.eagle_head import Eagle3Head
from sglang_like_kernels.cpu import ops

Linear = Callable[[torch.Tensor], torch.Tensor]


class NativeEagleHead:
    """`Eagle3Head`'s math over the draft KV pool with `quant`'s linear methods."""

    def __init__(self, head: Eagle3Head, quant: QuantConfig, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> None:
        """Packs the head's weights for `quant`'s CPU methods (this path runs on CPU only)."""
        c = head.config
        layer, attn = head.midlayer, head.midlayer.self_attn
        self.hidden_size = c.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = (c.num_attention_heads,
                                                            c.num_key_value_heads, c.head_dim)
        self.sm_scale = c.head_dim ** -0.5
        self.eps = c.rms_norm_eps
        self.cos, self.sin = cos_table, sin_table
        self._modules: list[QuantLinear] = []  # they own the packed buffers the closures use
        self.fc, self.fc_in = self._linear(quant, {"fc": head.fc.weight})
        self.qkv, self.qkv_in = self._linear(quant, {"q_proj": attn.q_proj.weight,
                                                     "k_proj": attn.k_proj.weight,
                                                     "v_proj": attn.v_proj.weight})
        self.o_proj, self.o_in = self._linear(quant, {"o_proj": attn.o_proj.weight})
        mlp = layer.mlp
        self.gate_up, self.gate_up_in = self._linear(quant, {"gate_proj": mlp.gate_proj.weight,
                                                             "up_proj": mlp.up_proj.weight})
        self.down, self.down_in = self._linear(quant, {"down_proj": mlp.down_proj.weight})
        self.lm_head, self.lm_in = self._linear(quant, {"lm_head": head.lm_head.weight})
        self.w_input = layer.input_layernorm.weight.detach().float().contiguous()
        self.w_hidden = layer.hidden_norm.weight.detach().float().contiguous()
        self.w_post = layer.post_attention_layernorm.weight.detach().float().contiguous()
        self.w_norm = head.norm.weight.detach().float().contiguous()
        self.intermediate_size = c.intermediate_size
        self.draft_vocab = c.draft_vocab_size
        # every linear x16-packed int4 without bias (and a head size the attention kernel
        # takes): the whole forward is one call (`run`, eagle_head.c; the second table without
        # fc, for the head's own outputs); else the single ops of `forward` and `logits`
        self.fused_ptrs: tuple[torch.Tensor, torch.Tensor] | None = None
        if (all(isinstance(m.method, Q4X16Method) and m.bias is None for m in self._modules)
                and self.head_dim % 8 == 0 and self.num_heads % self.num_kv_heads == 0):
            ptrs = torch.tensor([m.x16.data_ptr() for m in self._modules]
                                + [w.data_ptr() for w in (self.w_input, self.w_hidden,
                                                          self.w_post, self.w_norm)],
                                dtype=torch.int64)
            own = ptrs.clone()
            own[0] = 0
            self.fused_ptrs = ptrs, own

    def _linear(self, quant: QuantConfig, parts: dict[str, torch.Tensor]
                ) -> tuple[Linear, torch.dtype]:
        weights = {f"{name}.weight": w.detach().float() for name, w in parts.items()}
        rows = [w.shape[0] for w in weights.values()]
        in_features = next(iter(weights.values())).shape[1]
        lin = QuantLinear(quant.linear_method(in_features, sum(rows)), in_features, rows,
                          list(parts))
        lin.load_weights(weights, "", torch.device("cpu"))
        self._modules.append(lin)
        return lin.method.decode_fn(lin), lin.method.input_dtype

    def weight_bytes(self) -> int:
        return sum(m.method.weight_bytes(m) for m in self._modules)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, 3H] -> [T, H] float32; the head's own outputs pass through."""
        if features.shape[-1] == self.hidden_size:
            return features.float().contiguous()
        return self.fc(features.to(self.fc_in).contiguous()).float()

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                out_slots: torch.Tensor, attn: AttnRows, k_pool: torch.Tensor,
                v_pool: torch.Tensor) -> torch.Tensor:
        """The layer's output [T, H] float32 (pre-norm: the next step's feature) for inputs
        `embeds` float32 [T, H] and `hidden` = `project(features)`; each row's K/V stored
        at its out slot before any row attends."""
        x = torch.cat([ops.rmsnorm(embeds.float().contiguous(), self.w_input, self.eps,
                                   self.qkv_in),
                       ops.rmsnorm(hidden, self.w_hidden, self.eps, self.qkv_in)], dim=-1)
        table, rows, seq_lens = attn.table, attn.rows, attn.seq_lens
        a = ops.decode_attention_rope(self.qkv(x), self.num_heads, self.num_kv_heads,
                                      self.head_dim, self.cos, self.sin, positions, k_pool,
                                      v_pool, out_slots, table, rows, seq_lens, self.sm_scale,
                                      self.o_in)
        r, h = ops.add_rmsnorm(hidden, self.o_proj(a), self.w_post, self.eps, self.gate_up_in)
        down = self.down(ops.silu_mul(self.gate_up(h), self.down_in))
        return r + down.float()

    def run(self, embeds: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
            features: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
            attn: AttnRows, k_pool: torch.Tensor, v_pool: torch.Tensor,
            logit_rows: torch.Tensor, d2t: torch.Tensor, topk: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` over `project(features)`, then the top-k of the draft distribution at
        its rows `logit_rows`, in one native call (`fused_ptrs` must be set): (out [T, H],
        target ids [R, topk], log-probs [R, topk]). `embeds` as `ops.eagle_head_x16`'s: the
        rows' embeddings, or the target's int8 embedding (codes, scale) and the token ids."""
        assert self.fused_ptrs is not None
        # the head's own outputs (a draft step's input) skip fc
        ptrs = self.fused_ptrs[features.shape[-1] == self.hidden_size]
        table, rows, seq_lens = attn.table, attn.rows, attn.seq_lens
        return ops.eagle_head_x16(
            embeds, features.float().contiguous(), ptrs, self.eps, self.cos, self.sin,
            positions, out_slots, k_pool, v_pool, table, rows, seq_lens, self.num_heads,
            self.num_kv_heads, self.head_dim, self.intermediate_size, self.draft_vocab,
            self.sm_scale, logit_rows, d2t, topk)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H] -> draft-vocabulary logits [T, draft_vocab] float32."""
        return self.lm_head(ops.rmsnorm(out.contiguous(), self.w_norm, self.eps,
                                        self.lm_in)).float()
