"""triton_ops.moe_align (torch only, no kernel): the (token, k) pairs of a routing grouped by
expert and padded per expert to a multiple of the GEMM's BLOCK_M, as fused_moe_gemm_kernel
reads them. Every property is checked against counts made here from the routing."""

from __future__ import annotations

import pytest
import torch

from sglang_like_kernels.triton_ops import moe_align


def _ids(tokens: int, num_experts: int, top_k: int, hot: int | None, cold: list[int],
         seed: int) -> torch.Tensor:
    """A random top-k routing: expert `hot` chosen by every token, `cold` by none."""
    scores = torch.rand(tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    if hot is not None:
        scores[:, hot] = 2.0
    scores[:, cold] = -1.0
    return torch.topk(scores, top_k, dim=-1).indices


CASES = [
    # tokens, experts, top_k, block_m, hot, cold
    (1, 64, 8, 16, None, []),
    (37, 8, 2, 16, 3, [0, 5]),
    (20, 4, 1, 16, None, [2]),
    (100, 4, 2, 64, 0, []),
    (5, 8, 8, 16, None, []),
    (64, 8, 2, 32, None, [7]),  # counts that are multiples of the block, likely
    (300, 64, 8, 16, 10, list(range(40, 64))),
    (0, 8, 2, 16, None, []),
]


@pytest.mark.parametrize("tokens,num_experts,top_k,block_m,hot,cold", CASES)
def test_moe_align_groups_every_pair_once_padded_per_expert(tokens, num_experts, top_k,
                                                            block_m, hot, cold):
    ids = _ids(tokens, num_experts, top_k, hot, cold, seed=tokens + num_experts)
    num_pairs = tokens * top_k
    sorted_ids, block_experts, num_padded = moe_align(ids, num_experts, block_m)
    assert sorted_ids.dtype == block_experts.dtype == torch.int32
    used = int(num_padded)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert used == int(padded.sum())
    # the buffers are sized for any routing of this shape, and hold nothing past the count
    assert sorted_ids.numel() % block_m == 0 and sorted_ids.numel() >= used
    assert block_experts.numel() == sorted_ids.numel() // block_m
    assert (sorted_ids[used:] == num_pairs).all()
    assert (block_experts[used // block_m:] == -1).all()
    # every pair exactly once
    real = sorted_ids[:used][sorted_ids[:used] < num_pairs].long()
    assert torch.equal(torch.sort(real).values, torch.arange(num_pairs))
    # each expert's run: its padded count, its own blocks, its pairs in pair order first
    flat = ids.reshape(-1)
    start = 0
    for expert in range(num_experts):
        n, width = int(counts[expert]), int(padded[expert])
        run = sorted_ids[start:start + width].long()
        assert torch.equal(run[:n], (flat == expert).nonzero().flatten())
        assert (run[n:] == num_pairs).all()
        blocks = block_experts[start // block_m:(start + width) // block_m]
        assert (blocks == expert).all()
        start += width
    # experts with no pair get no block; a hot expert gets one row per token
    assert set(block_experts[:used // block_m].tolist()) == set(counts.nonzero().flatten().tolist())
    if hot is not None:
        assert int(counts[hot]) == tokens
    assert not torch.isin(torch.tensor(cold, dtype=torch.long), block_experts.long()).any()


def test_moe_align_buffer_bound_is_tight():
    """The worst case fills the buffers: every pair on its own expert (each run one row and
    block_m - 1 padding), so the bound max_padded = P + min(E, P) * (block_m - 1) is met."""
    ids = torch.arange(8).reshape(1, 8)
    sorted_ids, block_experts, num_padded = moe_align(ids, 64, 16)
    assert int(num_padded) == sorted_ids.numel() == 8 * 16
    assert block_experts.tolist() == list(range(8))
