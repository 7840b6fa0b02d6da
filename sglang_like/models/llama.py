"""The decoder-only transformer every family is built as, and the Llama family itself.

`LlamaForCausalLM` builds each layer from its `DecoderLayerDescription` (layers/decoder.py):
Llama, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norm) use it as it is, and so
do their mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral), whose sparse layers' MLP is
layers/moe.py's; the other families' files (gemma.py, phi3.py, olmo2.py, granite.py,
smollm3.py, olmoe.py) subclass it and only say how their layers differ
(`layer_description`) and how their checkpoints' tensors map onto these modules
(`adapt_hf_weights`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

import sglang_like_kernels.cpu
from sglang_like.config import ModelConfig
from sglang_like.forward_batch import ForwardBatch
from sglang_like.layers import native_decode as native
from sglang_like.layers.activation import gated
from sglang_like.layers.attention import Attention
from sglang_like.layers.decoder import DecoderLayerDescription, DecoderLayerParts
from sglang_like.layers.logits import LogitsHead
from sglang_like.layers.lora import LoraContext
from sglang_like.layers.moe import SparseMoE
from sglang_like.layers.native_decode import AttnRows, NativeDecodePlan
from sglang_like.layers.norm import RMSNorm
from sglang_like.layers.quantization import QuantConfig, QuantLinear, WeightSource
from sglang_like.layers.quantization.base import dense
from sglang_like.layers.rotary import RotaryEmbedding, RotaryTables
from sglang_like.mem_pool import KVPool
from sglang_like.tp.parallel import TPShard

__all__ = ["LlamaForCausalLM", "layer_description"]


def layer_description(config: ModelConfig, layer_id: int = 0) -> DecoderLayerDescription:
    """The Llama family's layer: Llama and Mistral as the defaults say; Qwen2 biases q/k/v
    (not o_proj); Qwen3 norms each head of q and k; Llama's `attention_bias` covers o_proj;
    a sliding layer (Mistral, Qwen2 past max_window_layers) sees its window only."""
    bias = config.attention_bias
    return DecoderLayerDescription(
        norm_eps=config.rms_norm_eps, qk_norm="head" if config.qk_norm else None,
        has_qkv_bias=bias, has_o_bias=bias and config.architecture not in _QKV_BIAS_ONLY,
        activation=config.hidden_act, sliding_window=config.layer_window(layer_id),
        attn_logit_softcap=config.attn_logit_softcap, residual_scale=config.residual_scale,
        mlp="moe" if config.layer_is_moe(layer_id) else "dense")


_MIXTRAL_MOE = re.compile(
    r"^(model\.layers\.\d+)\.block_sparse_moe\.(experts\.\d+\.)?(\w+)\.weight$")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "gate": "gate"}

# architectures whose attention_bias biases q/k/v but not o_proj (HF names and GGUF names)
_QKV_BIAS_ONLY = frozenset({"qwen2", "qwen2_moe", "qwen2moe"})


def _reduce(y: torch.Tensor, tp: TPShard | None, dtype: torch.dtype) -> torch.Tensor:
    """A row-parallel linear's partial sum joined over the ranks, in the residual's dtype."""
    return y if tp is None else tp.all_reduce(y.to(dtype).contiguous())


class LlamaAttention(nn.Module):
    """Self-attention over the KV pool; with `tp`, only this rank's KV-head groups (q/k/v
    rows column-parallel, o_proj row-parallel, its output summed over the ranks)."""

    def __init__(self, config: ModelConfig, desc: DecoderLayerDescription, layer_id: int,
                 quant: QuantConfig, tp: TPShard | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.residual_dtype = quant.dtype
        self.num_heads = tp.plan.num_heads if tp else config.num_attention_heads
        self.num_kv_heads = tp.plan.num_kv_heads if tp else config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sm_scale = (config.attention_scale if config.attention_scale is not None
                         else self.head_dim**-0.5)
        self.rope = desc.rope
        window, cap = desc.sliding_window, desc.attn_logit_softcap
        # the keywords only where used: the plain layer calls the backends as they always were
        extra = {k: v for k, v in (("window", window), ("softcap", cap)) if v is not None}
        self.attn = Attention(layer_id, self.sm_scale, **extra)
        hidden = config.hidden_size
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QuantLinear(quant.linear_method(hidden, q_rows + 2 * kv_rows), hidden,
                                    [q_rows, kv_rows, kv_rows],
                                    ["q_proj", "k_proj", "v_proj"], bias=desc.has_qkv_bias)
        # a row-parallel bias is added once, by the first rank
        o_bias = desc.has_o_bias and (tp is None or tp.plan.is_first)
        self.o_proj = QuantLinear(quant.linear_method(q_rows, hidden), q_rows, [hidden], ["o_proj"],
                                  bias=o_bias)
        self.qk_norm = desc.qk_norm
        dtype = quant.activation_dtype
        if desc.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, desc.norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, desc.norm_eps, dtype)
        elif desc.qk_norm == "full":  # over a token's whole q (k): every rank's rows at once
            if tp is not None:
                raise ValueError("a q/k norm over all heads (OLMo 2) is not tensor-parallel here")
            self.q_norm = RMSNorm(q_rows, desc.norm_eps, dtype)
            self.k_norm = RMSNorm(kv_rows, desc.norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: torch.Tensor, fb: ForwardBatch, ropes: dict[str, RotaryTables], pool: KVPool
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        num_qk = self.num_heads + self.num_kv_heads
        q_rows = self.num_heads * self.head_dim
        if self.qk_norm == "full":
            qkv = torch.cat([self.q_norm(qkv[:, :q_rows]),
                             self.k_norm(qkv[:, q_rows: num_qk * self.head_dim]),
                             qkv[:, num_qk * self.head_dim:]], dim=1)
        qk = qkv[:, : num_qk * self.head_dim].view(num_tokens, num_qk, self.head_dim)
        v = qkv[:, num_qk * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]),
                            self.k_norm(qk[:, self.num_heads :])], dim=1)
        if self.rope == "none":
            qk = qk.float()
        else:  # q and k heads in one pass, left in fp32 (the attention's math)
            qk = ropes[self.rope].rotate(qk)
        out = self.attn(qk[:, : self.num_heads], qk[:, self.num_heads :], v, fb, pool)
        out = self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
        return _reduce(out, self.tp, self.residual_dtype)


class LlamaMLP(nn.Module):
    """Gated MLP (SwiGLU, GeGLU); with `tp`, this rank's intermediate columns (gate/up
    column-parallel, down_proj row-parallel, its output summed over the ranks)."""

    def __init__(self, config: ModelConfig, desc: DecoderLayerDescription, quant: QuantConfig,
                 tp: TPShard | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        inter = tp.plan.intermediate_size if tp else config.intermediate_size
        self.tp = tp
        self.residual_dtype = quant.dtype
        self.activation = desc.activation
        self.gate_up_proj = QuantLinear(quant.linear_method(hidden, 2 * inter), hidden,
                                        [inter, inter],
                                        ["gate_proj", "up_proj"])
        self.down_proj = QuantLinear(quant.linear_method(inter, hidden), inter, [hidden],
                                     ["down_proj"])
        self.intermediate_size = inter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = gated(self.gate_up_proj(x), self.intermediate_size, self.activation)
        return _reduce(self.down_proj(h), self.tp, self.residual_dtype)


class LlamaDecoderLayer(nn.Module):
    """One layer as its description lays it out (see `DecoderLayerDescription` for the three
    norm layouts; the norms carry Hugging Face's names for their roles)."""

    def __init__(self, config: ModelConfig, desc: DecoderLayerDescription, layer_id: int,
                 quant: QuantConfig, tp: TPShard | None = None) -> None:
        super().__init__()
        act, h, eps = quant.activation_dtype, config.hidden_size, desc.norm_eps
        self.description = desc
        self.self_attn = LlamaAttention(config, desc, layer_id, quant, tp)
        if desc.mlp == "moe":
            self.mlp: nn.Module = SparseMoE(config, desc, quant, tp)
        elif desc.mlp == "dense":
            self.mlp = LlamaMLP(config, desc, quant, tp)
        else:
            raise ValueError(f"unknown MLP kind {desc.mlp!r}")
        layout = desc.norm_layout
        if layout not in ("pre", "sandwich", "post"):
            raise ValueError(f"unknown norm layout {layout!r}")
        self.residual_scale = desc.residual_scale
        # sub-layer inputs go to the matmuls (activation dtype); outputs to the residual
        if layout == "pre":
            self.input_layernorm = RMSNorm(h, eps, act)
            self.post_attention_layernorm = RMSNorm(h, eps, act)  # before the MLP
        if layout == "sandwich":
            self.input_layernorm = RMSNorm(h, eps, act)
            self.post_attention_layernorm = RMSNorm(h, eps, quant.dtype)  # attention's output
            self.pre_feedforward_layernorm = RMSNorm(h, eps, act)
            self.post_feedforward_layernorm = RMSNorm(h, eps, quant.dtype)
        if layout == "post":
            self.post_attention_layernorm = RMSNorm(h, eps, quant.dtype)
            self.post_feedforward_layernorm = RMSNorm(h, eps, quant.dtype)

    def _roles(self) -> tuple[RMSNorm | None, RMSNorm | None, RMSNorm | None, RMSNorm | None]:
        """(before attention, on its output, before the MLP, on its output)."""
        layout = self.description.norm_layout
        if layout == "pre":
            return self.input_layernorm, None, self.post_attention_layernorm, None
        if layout == "sandwich":
            return (self.input_layernorm, self.post_attention_layernorm,
                    self.pre_feedforward_layernorm, self.post_feedforward_layernorm)
        return None, self.post_attention_layernorm, None, self.post_feedforward_layernorm

    def forward(
        self, x: torch.Tensor, fb: ForwardBatch, ropes: dict[str, RotaryTables], pool: KVPool
    ) -> torch.Tensor:
        # the residual stream stays in the dense dtype; sub-layer outputs add into it
        attn_in, attn_out, mlp_in, mlp_out = self._roles()
        a = self.self_attn(attn_in(x) if attn_in is not None else x, fb, ropes, pool)
        if attn_out is not None:
            a = attn_out(a)
        x = x + a if self.residual_scale == 1.0 else x + a * self.residual_scale
        m = self.mlp(mlp_in(x) if mlp_in is not None else x)
        if mlp_out is not None:
            m = mlp_out(m)
        return x + m if self.residual_scale == 1.0 else x + m * self.residual_scale

    def parts(self) -> DecoderLayerParts:
        """This layer as the native decode step reads it."""
        a, m = self.self_attn, self.mlp
        attn_in, attn_out, mlp_in, mlp_out = self._roles()
        sparse = isinstance(m, SparseMoE)
        return DecoderLayerParts(self.description, attn_in, a.qkv_proj, a.o_proj, mlp_in,
                                 None if sparse else m.gate_up_proj,
                                 None if sparse else m.down_proj, a.num_heads, a.num_kv_heads,
                                 a.head_dim, 0 if sparse else m.intermediate_size, a.layer_id,
                                 a.sm_scale, attn_out_norm=attn_out, mlp_out_norm=mlp_out,
                                 q_norm=a.q_norm, k_norm=a.k_norm, moe=m if sparse else None)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, descriptions: list[DecoderLayerDescription],
                 quant: QuantConfig, tp: TPShard | None = None) -> None:
        super().__init__()
        embed = (quant.head_method(config.hidden_size) if config.tie_word_embeddings
                 else quant.embedding_method())
        self.embed_tokens = QuantLinear(embed, config.hidden_size, [config.vocab_size],
                                        ["embed_tokens"])
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, desc, i, quant, tp) for i, desc in enumerate(descriptions)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                            quant.head_method(config.hidden_size,
                                              embeds=config.tie_word_embeddings).input_dtype)


class LlamaForCausalLM(nn.Module):
    """Decoder-only Llama-family model whose attention reads and writes K/V by slot id.

    Every matmul goes through a `QuantLinear` whose method `quant` picks (dense, int8, int4);
    q/k/v and gate/up are fused. The embedding and a tied LM head are one matrix.
    `forward(fb, pool)` returns float32 logits [len(fb.logits_indices), vocab_size].

    With `tp` the model is one rank's shard (see sglang_like.tp.parallel): it loads the
    checkpoint `shard_weights` cut for it, its KV pool holds its KV heads, and every rank runs
    the layers (`forward_layers`) while only rank 0 goes on to the logits.
    """

    def __init__(self, config: ModelConfig, quant: QuantConfig | None = None,
                 tp: TPShard | None = None) -> None:
        super().__init__()
        quant = quant or QuantConfig("none", torch.float32)
        self.config = config
        self.quant = quant
        self.tp = tp
        self.dtype = quant.dtype  # the residual stream's
        self.model = LlamaModel(config, [self.layer_description(config, i)
                                         for i in range(config.num_hidden_layers)], quant, tp)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = QuantLinear(quant.head_method(config.hidden_size, embeds=False),
                                       config.hidden_size,
                                       [config.vocab_size], ["lm_head"])
        self.head = LogitsHead(self.model.norm, self.lm_head, config.logit_scale,
                               config.final_logit_softcap)
        # set by the runner (it knows the context): "global", and "local" where layers use it
        self.ropes: dict[str, RotaryEmbedding] = {}
        self.native_decode = self._native_decode_supported()
        self._native_plan: NativeDecodePlan | None = None  # built at the first native step
        # LoRA: every decoder linear reads the forward's adapter rows from one context, keyed
        # by its module path (what lora.adapter names an adapter's weights by)
        self.lora_ctx = LoraContext()
        for name, mod in self.model.layers.named_modules(prefix="model.layers"):
            if isinstance(mod, QuantLinear):
                mod.lora_ctx, mod.lora_key = self.lora_ctx, name

    def _native_decode_supported(self) -> bool:
        """Whether decode steps can run through the native kernels: quantized weights (the
        exact `none` path stays on torch), a float32 residual stream, one rank, layers whose
        description the native step computes, and the native library built for this CPU."""
        c = self.config
        return (self.quant.is_quantized and self.dtype == torch.float32 and self.tp is None
                and all(native.supports(layer.description) for layer in self.model.layers)
                and c.head_dim % 8 == 0
                and c.num_attention_heads % c.num_key_value_heads == 0
                and sglang_like_kernels.cpu.available())

    @staticmethod
    def layer_description(config: ModelConfig, layer_id: int) -> DecoderLayerDescription:
        """How layer `layer_id` computes; a family's file overrides it."""
        return layer_description(config, layer_id)

    @classmethod
    def adapt_hf_weights(cls, config: ModelConfig, weights: dict[str, Any]) -> None:
        """A Hugging Face checkpoint's tensors, renamed / split / folded in place into what
        these modules load (HF names, unfused, norm weights as multipliers); a family whose
        checkpoints differ overrides it. GGUF files are mapped by the GGUF loader.

        Here: Mixtral's sparse MLP is `block_sparse_moe` and an expert's matrices w1 (gate),
        w3 (up), w2 (down); renamed to the names layers/moe.py loads."""
        for name in [n for n in weights if ".block_sparse_moe." in n]:
            m = _MIXTRAL_MOE.match(name)
            if m is None or m.group(3) not in _MIXTRAL_NAMES:
                raise ValueError(f"unexpected Mixtral tensor {name!r}")
            layer, expert, part = m.groups()
            weights[f"{layer}.mlp.{expert or ''}{_MIXTRAL_NAMES[part]}.weight"] = weights.pop(name)

    @property
    def rope(self) -> RotaryEmbedding | None:
        """The model's main RoPE tables (None before `set_rope`)."""
        return self.ropes.get("global")

    def set_rope(self, max_positions: int, device: torch.device | str) -> None:
        c = self.config
        self._native_plan = None
        kinds = {layer.description.rope for layer in self.model.layers} | {"global"}
        self.ropes = {"global": RotaryEmbedding(
            c.head_dim, max_positions, c.rope_theta, c.rope_scaling, device,
            rotary_dim=c.rotary_dim, model_max_positions=c.max_position_embeddings)}
        if "local" in kinds:  # Gemma 3's sliding layers: their own base, no scaling
            self.ropes["local"] = RotaryEmbedding(c.head_dim, max_positions,
                                                  c.rope_local_theta or c.rope_theta, None,
                                                  device, rotary_dim=c.rotary_dim)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        return self.forward_features(fb, pool, ())[0]

    @torch.inference_mode()
    def forward_features(self, fb: ForwardBatch, pool: KVPool, aux_layers: tuple[int, ...]
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, features): features [T, len(aux_layers) * hidden] float32 are the residual
        stream entering each layer in `aux_layers` (SGLang's EAGLE-3 capture), for every token
        row (the id one past the last layer: the final hidden state after the norm, EAGLE-1/2's
        capture); None when `aux_layers` is empty."""
        x, features = self._layers_and_features(fb, pool, aux_layers)
        return self.head.logits(x[fb.logits_indices]), features

    @property
    def has_head_argmax(self) -> bool:
        """Whether `forward_argmax` has a path of its own (the LM head's kernel does)."""
        return self.tp is None and self.head.has_argmax

    @torch.inference_mode()
    def forward_argmax(self, fb: ForwardBatch, pool: KVPool, aux_layers: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(int64 [len(fb.logits_indices)], features as `forward_features`'): the argmax of
        each row `forward` would return (the first among equals), which the head need not
        compute in full (`has_head_argmax`)."""
        x, features = self._layers_and_features(fb, pool, aux_layers)
        return self.head.argmax(x[fb.logits_indices]), features

    def _layers_and_features(self, fb: ForwardBatch, pool: KVPool,
                             aux_layers: tuple[int, ...]
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_layers`, where the capture id one past the last layer is the final hidden
        state after the model's norm (what the LM head reads: EAGLE-1/2's feature)."""
        final = self.config.num_hidden_layers
        if final not in aux_layers:
            return self.forward_layers(fb, pool, aux_layers)
        inner = tuple(i for i in aux_layers if i != final)
        x, features = self.forward_layers(fb, pool, inner)
        h = x.shape[-1]
        parts = dict(zip(inner, features.split(h, dim=-1), strict=True)) if inner else {}
        parts[final] = self.model.norm(x).float()
        return x, torch.cat([parts[i] for i in aux_layers], dim=-1)

    @torch.inference_mode()
    def forward_layers(self, fb: ForwardBatch, pool: KVPool, aux_layers: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(residual stream after the last layer [T, hidden], aux features as in
        `forward_features`): every K/V of the batch stored, no logits (a TP rank > 0 stops
        here)."""
        embed = self.model.embed_tokens
        x = embed.method.embed(embed, fb.input_ids).to(self.dtype)
        if self.config.embedding_scale != 1.0:
            x = x * self.config.embedding_scale
        if fb.image_rows is not None:  # image embeddings are not scaled (as transformers)
            x[fb.image_rows] = fb.image_embeds.to(x.dtype)
        attn = self._native_rows(fb, pool)
        if attn is not None:
            return self._decode_layers_native(x, fb, pool, attn, aux_layers)
        if fb.lora is None:
            return self._torch_layers(x, fb, pool, aux_layers)
        self.lora_ctx.batch = fb.lora
        try:
            return self._torch_layers(x, fb, pool, aux_layers)
        finally:
            self.lora_ctx.batch = None

    def _torch_layers(self, x: torch.Tensor, fb: ForwardBatch, pool: KVPool,
                      aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        # gathered once, used by every layer
        ropes = {kind: r.tables(fb.positions) for kind, r in self.ropes.items()}
        aux: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                aux[i] = x.float()
            x = layer(x, fb, ropes, pool)
            if fb.on_layer is not None:
                fb.on_layer(i)
        features = torch.cat([aux[i] for i in aux_layers], dim=-1) if aux_layers else None
        return x, features

    def runs_native(self, fb: ForwardBatch, pool: KVPool) -> bool:
        """Whether the native step runs `fb` (see `_native_rows`): also the forwards whose
        thread count may change (utils.decode_threads), since the native step sums each
        output row on one thread whatever their number.

        By default: a decode batch of up to native.MAX_ROWS requests, or a masked one such as
        a verify of up to MAX_MASKED_ROWS query rows, so that a verify and the plain decode of
        the same requests share their float sums; and an extend batch as
        `native.extend_runs_natively` rules (on the AVX-512 build every one), whose rows read
        a cached prefix, and each block of a prompt's own rows the keys before it, together
        (the cascade). With `--enable-deterministic-inference`
        every batch, prefill chunks and mixed ones included: a token's row is then computed
        by the same per-row sums whatever batch, chunk or verify it is in, which the int4
        path's bf16 activations need for its output not to depend on the schedule."""
        if not (self.native_decode and fb.tree_mask is None
                and fb.input_ids.device.type == "cpu"
                and pool.k_buffers[0].dtype in native.POOL_DTYPES):
            return False
        every = self.quant.deterministic
        if fb.custom_masks is not None:  # two-way image rows: the torch path
            return fb.positional_masks is None and (every or
                                                    fb.num_tokens <= native.MAX_MASKED_ROWS)
        if fb.is_decode:
            return every or fb.num_tokens <= native.MAX_ROWS
        return every or native.extend_runs_natively(fb, self.config.sliding_window is not None)

    def _native_rows(self, fb: ForwardBatch, pool: KVPool) -> AttnRows | None:
        """The key rows of a batch the native path runs (`runs_native`); None: the torch
        path."""
        if not self.runs_native(fb, pool):
            return None
        if fb.custom_masks is not None:
            return native.masked_rows(fb)
        if fb.is_decode:
            return native.decode_rows(fb, shared=not self.quant.deterministic)
        return native.extend_rows(fb, shared=not self.quant.deterministic)

    def _decode_layers_native(self, x: torch.Tensor, fb: ForwardBatch, pool: KVPool,
                              attn: AttnRows, aux_layers: tuple[int, ...]
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_layers` of a decode or verify batch through the native kernels (see
        layers/native_decode): the same math as the layer modules, summed in another order."""
        if self._native_plan is None:
            tables = {kind: (r.cos_table, r.sin_table) for kind, r in self.ropes.items()}
            self._native_plan = NativeDecodePlan([layer.parts() for layer in self.model.layers],
                                                 tables)
        return self._native_plan.run(x, fb, pool, attn, aux_layers)

    def default_aux_layers(self) -> tuple[int, ...]:
        """SGLang's default EAGLE-3 capture: low, middle and high layers."""
        n = self.config.num_hidden_layers
        return (min(2, n - 1), n // 2, max(n - 3, 0))

    def load_weights(self, weights: dict[str, WeightSource], device: torch.device) -> None:
        """Build every layer's weights from Hugging Face-named sources (dense tensors or GGUF
        blocks); a missing or mis-shaped tensor is a ValueError."""
        needed = {f"{prefix}{p}.weight" for prefix, lin in self._linears()
                  for p in lin.partitions}
        needed |= {n for n, _ in self.named_parameters()}
        missing = sorted(needed - set(weights))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        self._native_plan = None  # it holds the layers' buffers
        for mod in self.modules():
            if isinstance(mod, SparseMoE):
                mod._native = None  # so does a sparse layer's native table
        for prefix, lin in self._linears():
            lin.load_weights(weights, prefix, device)
        for name, param in self.named_parameters():
            src = weights[name]
            if tuple(src.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(param.shape)}"
                )
            # norms and routers stay float32 (they compute in it); a router a GGUF file
            # quantized is dequantized
            param.data = dense(src).to(device)

    def _linears(self) -> list[tuple[str, QuantLinear]]:
        """(HF name prefix of its partitions, layer) for every linear; a tied head once."""
        return [(name.rpartition(".")[0] + "." if "." in name else "", mod)
                for name, mod in self.named_modules() if isinstance(mod, QuantLinear)]

    def weight_bytes(self) -> int:
        """Bytes every weight holds in memory (packed sizes for quantized layers)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        return total + sum(lin.method.weight_bytes(lin) for _, lin in self._linears())

    def decode_bytes(self) -> int:
        """Bytes of weights one decode step of one token reads: the bandwidth floor of a
        token (of a sparse layer's experts, the top_k a token runs)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        total += sum(lin.method.decode_bytes(lin) for _, lin in self._linears())
        for moe in self.modules():
            if isinstance(moe, SparseMoE):
                experts = sum(lin.method.decode_bytes(lin) for e in moe.experts
                              for lin in (e.gate_up_proj, e.down_proj))
                total -= experts * (moe.num_experts - moe.top_k) // moe.num_experts
        return total
