"""A mixture-of-experts MLP: a router picks each token's experts, the chosen experts' gated MLPs
run over their tokens, and their outputs, scaled by the router's weights, are summed.

The experts are ordinary `QuantLinear`s (`mlp.experts.{j}.gate_up_proj` / `down_proj`, named as
Hugging Face names their partitions), so every packed format the dense MLP runs on (int4, the
GGUF kinds, int8, dense) runs them too. A step routes its T tokens once and groups the
T * top_k (token, expert) pairs by expert; each expert that got any token then runs once over
all of its rows: its weights are read once per step whatever the batch, and an expert nobody
chose costs nothing. The router itself stays float32 (its top-k choice is the layer's most
rounding-sensitive decision; it is E x hidden, small beside one expert).

Where the experts are x16 int4 or GGUF kinds on CPU, routing and experts are one native call
(kernels/.../cpu/moe.c, `native_layer`), and inside the one-call decode step the same phases
run for the layer; elsewhere (int8, dense, CUDA) `route` and `experts_forward` below, the
latter one Triton grouped GEMM on CUDA for dense experts.

Routing (each family's config says which): softmax over the router's E logits, the top_k
largest, renormalized to sum to 1 over the chosen when `norm_topk_prob` (Qwen3-MoE's released
models, Mixtral) or left as they are (Qwen2-MoE, OLMoE). Qwen2-MoE adds a shared expert that
every token runs, its output scaled by sigmoid(shared_expert_gate(x)).

With tensor parallelism each rank keeps its share of every expert's intermediate columns (and
of the shared expert's): gate/up column-parallel, down row-parallel; the experts' partial sums
and the shared expert's are added before the layer's one all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import sglang_like_kernels.cpu
from sglang_like.layers.activation import gated
from sglang_like.layers.quantization import QuantConfig, QuantLinear
from sglang_like_kernels.cpu import ops as cpu_ops

if TYPE_CHECKING:
    from sglang_like.config import ModelConfig
    from sglang_like.layers.decoder import DecoderLayerDescription

__all__ = ["ExpertMLP", "Router", "SparseMoE", "route"]


class Router(nn.Module):
    """A float32 [out, hidden] matrix applied as x @ W.T (the router, Qwen2-MoE's shared
    expert gate): a parameter, so checkpoints load it by name like a norm."""

    def __init__(self, hidden: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.weight.T


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], expert ids int64 [T, top_k]) of router logits [T, E]:
    softmax, the top_k largest (ties: the lower expert id, as torch.topk), renormalized over
    the chosen when asked."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class ExpertMLP(nn.Module):
    """One gated MLP (an expert, or the shared expert): gate/up fused, then down."""

    def __init__(self, hidden: int, inter: int, activation: str, quant: QuantConfig) -> None:
        super().__init__()
        self.activation = activation
        self.intermediate_size = inter
        self.gate_up_proj = QuantLinear(quant.expert_method(hidden, 2 * inter), hidden,
                                        [inter, inter], ["gate_proj", "up_proj"])
        self.down_proj = QuantLinear(quant.expert_method(inter, hidden), inter, [hidden],
                                     ["down_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_up_proj(x), self.intermediate_size,
                                    self.activation))


class SparseMoE(nn.Module):
    """The MLP of a sparse layer (see the module docstring). `forward` returns the layer's
    MLP output in the residual dtype, summed over the tensor-parallel ranks."""

    def __init__(self, config: ModelConfig, desc: DecoderLayerDescription, quant: QuantConfig,
                 tp: Any = None) -> None:
        """`tp`: a model's tp.parallel.TPShard (layers sit below tp/, so it is not named)."""
        super().__init__()
        hidden = config.hidden_size
        self.tp = tp
        self.residual_dtype = quant.dtype
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts "
                             f"({self.num_experts})")
        inter = tp.plan.moe_intermediate_size if tp else config.moe_intermediate_size
        self.gate = Router(hidden, self.num_experts)
        self.experts = nn.ModuleList(ExpertMLP(hidden, inter, desc.activation, quant)
                                     for _ in range(self.num_experts))
        if config.shared_expert_intermediate_size:
            shared = (tp.plan.shared_intermediate_size if tp
                      else config.shared_expert_intermediate_size)
            self.shared_expert = ExpertMLP(hidden, shared, desc.activation, quant)
            self.shared_expert_gate = Router(hidden, 1)
        else:
            self.shared_expert = None
        self.last_routing: torch.Tensor | None = None  # ids of the last forward (tests)
        self._native: tuple | bool | None = None  # native_layer's, built at first use
        self.native = True  # False: the per-expert loop below even where moe.c could run

    def native_layer(self) -> torch.Tensor | None:
        """This layer as moe.c reads it (ops.moe_layer's int64 fields: the router and the
        experts' runs tables by address), built once; None where the native kernel cannot
        run it (an expert linear neither x16 int4 nor a GGUF kind, the native library
        absent). `load_weights` replaces the buffers it points at and so drops it (see
        `LlamaForCausalLM`)."""
        if self._native is None:
            tables = _native_tables(self)
            if tables is None:
                self._native = False
            else:
                router = self.gate.weight.detach().float().contiguous()
                shared = None
                if tables[2] is not None:  # the shared expert's gate [H] and runs
                    shared = (self.shared_expert_gate.weight.detach().float().reshape(-1)
                              .contiguous(), *(t[0] for t in tables[2]),
                              self.shared_expert.intermediate_size)
                layer = cpu_ops.moe_layer(router, *tables[:2], self.top_k,
                                          self.experts[0].intermediate_size, self.renormalize,
                                          self.experts[0].activation, shared=shared)
                self._native = (layer, router, tables, shared)  # the addresses' owners
        return self._native[0] if self._native else None

    def native_shared(self, layer: torch.Tensor | None) -> bool:
        """Whether the native layer `layer` (None: not native) adds the shared expert (moe.c
        runs it where its linears are kinds it takes; else layers/moe.py adds it in torch)."""
        return layer is not None and bool(self._native[3] is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.native_layer() if x.device.type == "cpu" and self.native else None
        if layer is not None:  # routing and experts in one call
            out, ids, _ = cpu_ops.moe_forward(x, layer)
        else:
            weights, ids = route(self.gate(x), self.top_k, self.renormalize)
            out = self.experts_forward(x, weights, ids)
        self.last_routing = ids
        if self.shared_expert is not None and not self.native_shared(layer):
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x).float()
        out = out.to(self.residual_dtype)
        return out if self.tp is None else self.tp.all_reduce(out.contiguous())

    def experts_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                        ) -> torch.Tensor:
        """sum over k of weights[t, k] * expert[ids[t, k]](x[t]), float32 [T, hidden]: each
        chosen expert runs once over all its rows (the pairs sorted by expert, stably, so a
        token's rows come in token order)."""
        fused = self._fused_experts_forward(x, weights, ids) if x.is_cuda else None
        if fused is not None:
            return fused
        num_tokens = x.shape[0]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        scale = weights.reshape(-1)[order, None]
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            y = self.experts[expert](x[rows]).float() * scale[start:start + n]
            out.index_add_(0, rows, y)
            start += n
        return out

    def _fused_experts_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                               ) -> torch.Tensor | None:
        """experts_forward by the Triton fused MoE (triton_ops.fused_moe: one grouped GEMM
        over every expert for gate/up, one for down) where every expert is dense without a
        bias and no LoRA batch is on; else None (the loop runs). On first use the experts'
        weights are stacked into [E, 2I, H] / [E, H, I] and each expert's buffers become
        views of the stacks, so memory holds one copy; a reload replaces the buffers, and
        the next call stacks again."""
        from sglang_like.layers.quantization.dense import DenseMethod

        first = self.experts[0]
        lora = first.gate_up_proj.lora_ctx
        if lora is not None and lora.batch is not None:
            return None
        stacks = getattr(self, "_dense_stacks", None)
        if stacks is False:
            return None
        if stacks is None or stacks[0].data_ptr() != first.gate_up_proj.weight.data_ptr():
            linears = [lin for e in self.experts for lin in (e.gate_up_proj, e.down_proj)]
            if not all(isinstance(lin.method, DenseMethod) and lin.bias is None
                       for lin in linears):
                self._dense_stacks: tuple[torch.Tensor, torch.Tensor] | bool = False
                return None
            stacks = (torch.stack([e.gate_up_proj.weight for e in self.experts]),
                      torch.stack([e.down_proj.weight for e in self.experts]))
            for j, e in enumerate(self.experts):
                e.gate_up_proj.register_buffer("weight", stacks[0][j])
                e.down_proj.register_buffer("weight", stacks[1][j])
            self._dense_stacks = stacks
        from sglang_like_kernels import triton_ops

        return triton_ops.fused_moe(x, stacks[0], stacks[1], weights, ids, first.activation)


def _native_tables(moe: SparseMoE) -> tuple | None:
    """(gate_up runs, down runs) int64 [E, DECODE_STEP_RUNS, 3] of every expert, then the
    same pair [1, DECODE_STEP_RUNS, 3] for the shared expert (None without one or where
    moe.c cannot run it), or None where an expert's linear is not a kind moe.c runs."""
    from sglang_like.layers.native_decode import fused_runs  # the fused step's own reading

    if not sglang_like_kernels.cpu.available():
        return None

    def runs_of(experts) -> list[torch.Tensor] | None:
        pair = []
        for which in ("gate_up_proj", "down_proj"):
            table = torch.zeros(len(experts), cpu_ops.DECODE_STEP_RUNS, 3, dtype=torch.int64)
            for j, expert in enumerate(experts):
                lin = getattr(expert, which)
                runs = None if lin.bias is not None else fused_runs(lin)
                if runs is None or any(p.device.type != "cpu" for _, p, _ in runs):
                    return None
                for r, (kind, packed, rows) in enumerate(runs):
                    table[j, r] = torch.tensor([kind, packed.data_ptr(), rows])
            pair.append(table)
        return pair

    tables = runs_of(moe.experts)
    if tables is None:
        return None
    # a shared expert whose width the kernels do not take (not a multiple of 32) stays in torch
    shared = runs_of([moe.shared_expert]) if moe.shared_expert is not None else None
    return tables[0], tables[1], shared
