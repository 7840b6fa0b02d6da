"""The sharding plan of tensor parallelism: which heads and MLP columns each rank keeps, and
the checkpoint slices that give a rank exactly its shard.

Attention splits by KV-head groups (each query head stays with its KV head), the MLP's
intermediate dim by chunks of `MLP_CHUNK` columns; shares are uneven when the counts do not
divide (SmolLM2-135M at TP=2: KV heads 2 + 1, query heads 6 + 3). Per rank:

    qkv_proj, gate_up_proj   column-parallel: its rows of q/k/v (gate/up)
    o_proj, down_proj        row-parallel: its input columns; partial sums all-reduced
    embedding, norms, head   replicated (only rank 0 computes the logits)

A mixture of experts splits every expert's intermediate dim (and the shared expert's) the
same way; the routers are replicated, so every rank picks the same experts, and the layer
all-reduces the sum of its experts' partial outputs once.

A LoRA adapter's pairs are cut like their base linears (`shard_lora`): a column-parallel
linear keeps its B rows (A whole), a row-parallel one its A columns (B whole), so its delta
joins the partial sum before the all-reduce and is counted once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sglang_like.config import ModelConfig
from sglang_like.layers.lora import LoraLinearWeights
from sglang_like.layers.quantization import GGUFBlockWeight, WeightSource

# Intermediate columns move between ranks in chunks of 64: GGUF 32-blocks and the int4 group
# sizes (32, 64) then divide every rank's share of down_proj's input.
MLP_CHUNK = 64


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `tp_size` keeps: heads [q_head_start, + num_heads) with their KV
    heads [kv_head_start, + num_kv_heads), intermediate columns [inter_start, +
    intermediate_size)."""

    rank: int
    tp_size: int
    head_dim: int
    q_head_start: int
    num_heads: int
    kv_head_start: int
    num_kv_heads: int
    inter_start: int
    intermediate_size: int
    # a mixture of experts: every expert's intermediate columns [moe_inter_start, +
    # moe_intermediate_size), the shared expert's [shared_inter_start, + ...] (0: none)
    moe_inter_start: int = 0
    moe_intermediate_size: int = 0
    shared_inter_start: int = 0
    shared_intermediate_size: int = 0

    @property
    def is_first(self) -> bool:
        """Rank 0: it adds the row-parallel biases and computes the logits."""
        return self.rank == 0


def _split(total: int, parts: int) -> list[int]:
    """`total` as `parts` shares that differ by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """ValueError unless `config` can be split over `tp_size` ranks."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1; got {tp_size}")
    if tp_size > config.num_key_value_heads:
        raise ValueError(f"tp_size {tp_size} exceeds the model's {config.num_key_value_heads} KV "
                         "heads (tensor parallelism splits by KV-head groups)")
    for name, size in _mlp_widths(config).items():
        if size % MLP_CHUNK or size // MLP_CHUNK < tp_size:
            raise ValueError(f"{name} {size} cannot be split into {tp_size} shares of "
                             f"{MLP_CHUNK}-column chunks")


def _mlp_widths(config: ModelConfig) -> dict[str, int]:
    """The intermediate widths the model's MLPs split (a dense one where a layer is dense)."""
    layers = range(config.num_hidden_layers)
    widths = {}
    if not all(config.layer_is_moe(i) for i in layers):
        widths["intermediate_size"] = config.intermediate_size
    if config.num_experts:
        widths["moe_intermediate_size"] = config.moe_intermediate_size
    if config.shared_expert_intermediate_size:
        widths["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    return widths


def _share(size: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(start, width) of rank `rank`'s chunks of an intermediate dim of `size` columns."""
    if size % MLP_CHUNK:  # unused by the model (e.g. a sparse model's dense width)
        return 0, size
    shares = _split(size // MLP_CHUNK, tp_size)
    return sum(shares[:rank]) * MLP_CHUNK, shares[rank] * MLP_CHUNK


def make_shard_plan(config: ModelConfig, tp_size: int, rank: int) -> ShardPlan:
    """Rank `rank`'s share of `config` (see the module docstring)."""
    check_tp_size(config, tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside 0..{tp_size - 1}")
    group = config.num_attention_heads // config.num_key_value_heads  # query heads per KV head
    kv_shares = _split(config.num_key_value_heads, tp_size)
    kv_start = sum(kv_shares[:rank])
    inter = _share(config.intermediate_size, tp_size, rank)
    moe = _share(config.moe_intermediate_size, tp_size, rank) if config.num_experts else (0, 0)
    shared = _share(config.shared_expert_intermediate_size, tp_size, rank)
    return ShardPlan(
        rank=rank, tp_size=tp_size, head_dim=config.head_dim,
        q_head_start=kv_start * group, num_heads=kv_shares[rank] * group,
        kv_head_start=kv_start, num_kv_heads=kv_shares[rank],
        inter_start=inter[0], intermediate_size=inter[1],
        moe_inter_start=moe[0], moe_intermediate_size=moe[1],
        shared_inter_start=shared[0], shared_intermediate_size=shared[1],
    )


def slice_rows(source: WeightSource, start: int, stop: int) -> WeightSource:
    """Rows [start, stop) of a dense or packed [out, in] matrix (or a 1-D bias)."""
    if isinstance(source, GGUFBlockWeight):
        return source.slice_rows(start, stop)
    return source[start:stop].contiguous()


def slice_cols(source: WeightSource, start: int, stop: int) -> WeightSource:
    """Columns [start, stop) of a dense or packed [out, in] matrix."""
    if isinstance(source, GGUFBlockWeight):
        return source.slice_cols(start, stop)
    return source[:, start:stop].contiguous()


def shard_weights(weights: dict[str, WeightSource], config: ModelConfig,
                  plan: ShardPlan) -> dict[str, WeightSource]:
    """The checkpoint as rank `plan.rank` loads it: every transformer-block matrix (and bias)
    cut to its shard, the rest as it is; a row-parallel bias only on rank 0 (the all-reduce
    would add it once per rank)."""
    hd = plan.head_dim
    q = (plan.q_head_start * hd, (plan.q_head_start + plan.num_heads) * hd)
    kv = (plan.kv_head_start * hd, (plan.kv_head_start + plan.num_kv_heads) * hd)
    widths = {"dense": (plan.inter_start, plan.intermediate_size),
              "experts": (plan.moe_inter_start, plan.moe_intermediate_size),
              "shared_expert": (plan.shared_inter_start, plan.shared_intermediate_size)}
    out: dict[str, WeightSource] = {}
    for name, source in weights.items():
        if not name.startswith("model.layers."):
            out[name] = source
            continue
        module, _, kind = name.rpartition(".")
        proj = module.rpartition(".")[2]
        mlp = ("experts" if ".mlp.experts." in name
               else "shared_expert" if ".mlp.shared_expert." in name else "dense")
        start, width = widths[mlp]
        inter = (start, start + width)
        rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": inter, "up_proj": inter}
        cols = {"o_proj": q, "down_proj": inter}
        if proj in rows:
            out[name] = slice_rows(source, *rows[proj])
        elif proj in cols and kind == "weight":
            out[name] = slice_cols(source, *cols[proj])
        elif proj in cols:  # a row-parallel bias
            if plan.is_first:
                out[name] = source
        else:
            out[name] = source  # norms (q/k norms are per head_dim: replicated)
    return out


def shard_lora(weights: dict[str, LoraLinearWeights], config: ModelConfig,
               plan: ShardPlan) -> dict[str, LoraLinearWeights]:
    """An adapter's pairs (`lora.LoraAdapter.weights`, keyed by linear module path) as rank
    `plan.rank` applies them. A fused B stacks its partitions' rows (q | k | v, gate | up),
    so the rank's rows are taken from each partition, in the order its base linear has them.

        qkv_proj, gate_up_proj   B: the rank's output rows        A: whole
        o_proj, down_proj        A: the rank's input columns      B: whole

    A row-parallel rank then adds B (A_r x_r), its share of B (A x): the all-reduce sums the
    shares with the base partial sums, so the delta is counted once."""
    hd = plan.head_dim
    num_q, num_kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    q = (plan.q_head_start * hd, (plan.q_head_start + plan.num_heads) * hd)
    kv = (plan.kv_head_start * hd, (plan.kv_head_start + plan.num_kv_heads) * hd)
    inter = (plan.inter_start, plan.inter_start + plan.intermediate_size)
    size = config.intermediate_size

    def after(span: tuple[int, int], offset: int) -> tuple[int, int]:
        return span[0] + offset, span[1] + offset

    rows = {"self_attn.qkv_proj": (q, after(kv, num_q), after(kv, num_q + num_kv)),
            "mlp.gate_up_proj": (inter, after(inter, size))}
    cols = {"self_attn.o_proj": q, "mlp.down_proj": inter}
    out: dict[str, LoraLinearWeights] = {}
    for key, w in weights.items():
        linear = key.split(".", 3)[3]  # model.layers.N.<linear>
        if linear in rows:
            b = torch.cat([w.b[start:stop] for start, stop in rows[linear]]).contiguous()
            out[key] = LoraLinearWeights(w.a, b)
        elif linear in cols:
            start, stop = cols[linear]
            out[key] = LoraLinearWeights(w.a[:, start:stop].contiguous(), w.b)
        else:
            raise ValueError(f"LoRA weights of {key!r}: no tensor-parallel split for it")
    return out


class TPShard(NamedTuple):
    """What a sharded model needs: its plan and the all-reduce (sum, in place) that joins the
    partial outputs of its row-parallel linears."""

    plan: ShardPlan
    all_reduce: Callable[[torch.Tensor], torch.Tensor]
