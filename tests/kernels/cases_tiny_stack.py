"""A tiny random Llama-shaped stack gives the same output with the references and with the
Triton kernels (interpreter), through chunked prefill, batched decode and tree verify; and
its pool-based run equals a plain dense causal forward.

Not collected on its own: test_triton_kernels.py runs it with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from types import ModuleType

os.environ["TRITON_INTERPRET"] = "1"  # before sglang_like_kernels.triton_ops imports triton

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sglang_like_kernels import reference, triton_ops  # noqa: E402

NUM_LAYERS, HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, VOCAB = 2, 96, 4, 2, 24, 50
SCALE = 1 / math.sqrt(HEAD_DIM)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TinyStack:
    """Embedding, then per layer RMSNorm -> GQA attention with RoPE -> gated MLP; tied head."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)

        def w(*shape):
            return torch.randn(shape, generator=gen) / math.sqrt(shape[0])

        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen)
        self.layers = [
            {
                "wq": w(HIDDEN, NUM_Q_HEADS * HEAD_DIM),
                "wk": w(HIDDEN, NUM_KV_HEADS * HEAD_DIM),
                "wv": w(HIDDEN, NUM_KV_HEADS * HEAD_DIM),
                "wo": w(NUM_Q_HEADS * HEAD_DIM, HIDDEN),
                "up": w(HIDDEN, 2 * HIDDEN),
                "down": w(HIDDEN, HIDDEN),
            }
            for _ in range(NUM_LAYERS)
        ]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend):
        """tokens, positions [T] -> logits [T, VOCAB]; attend(layer, q, k, v) -> [T, Hq, D]."""
        h = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            x = _rms(h)
            q = _rope((x @ layer["wq"]).view(-1, NUM_Q_HEADS, HEAD_DIM), positions)
            k = _rope((x @ layer["wk"]).view(-1, NUM_KV_HEADS, HEAD_DIM), positions)
            v = (x @ layer["wv"]).view(-1, NUM_KV_HEADS, HEAD_DIM)
            h = h + attend(i, q, k, v).reshape(len(tokens), -1) @ layer["wo"]
            gate, up = (_rms(h) @ layer["up"]).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ layer["down"]
        return _rms(h) @ self.embed.T


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    half = HEAD_DIM // 2
    freqs = 1e4 ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions[:, None].float() * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class PooledRun:
    """One request batch history over a KV pool, with one kernel module doing the work."""

    def __init__(self, ops: ModuleType, stack: TinyStack) -> None:
        self.ops, self.stack = ops, stack
        shape = (200, NUM_KV_HEADS, HEAD_DIM)
        self.k_pools = [torch.zeros(shape) for _ in range(NUM_LAYERS)]
        self.v_pools = [torch.zeros(shape) for _ in range(NUM_LAYERS)]
        self.table = torch.zeros(4, 64, dtype=torch.int32)
        self.next_slot = 1  # slot 0 is padding
        self.lens = {}  # pool row -> tokens stored

    def _place(self, rows: list[int], counts: list[int]):
        """Give each row counts[i] new slots; returns (slot ids, positions, prefix lens)."""
        slots, positions, prefixes = [], [], []
        for row, count in zip(rows, counts, strict=True):
            start = self.lens.get(row, 0)
            new = list(range(self.next_slot, self.next_slot + count))
            self.next_slot += count
            self.table[row, start : start + count] = torch.tensor(new, dtype=torch.int32)
            slots += new
            positions += list(range(start, start + count))
            prefixes.append(start)
            self.lens[row] = start + count
        return torch.tensor(slots), torch.tensor(positions), torch.tensor(prefixes)

    def _run(self, tokens, slots, positions, attention) -> torch.Tensor:
        def attend(layer, q, k, v):
            self.ops.store_kv(self.k_pools[layer], self.v_pools[layer], slots, k, v)
            return attention(q, self.k_pools[layer], self.v_pools[layer])

        return self.stack.forward(tokens, positions, attend)

    def extend(self, rows: list[int], chunks: list[torch.Tensor]) -> torch.Tensor:
        counts = [len(c) for c in chunks]
        slots, positions, prefixes = self._place(rows, counts)
        row_ids, ext = torch.tensor(rows), torch.tensor(counts)

        def attention(q, k_pool, v_pool):
            return self.ops.extend_attention(
                q, k_pool, v_pool, self.table, row_ids, prefixes, ext, SCALE
            )

        return self._run(torch.cat(chunks), slots, positions, attention)

    def decode(self, rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
        slots, positions, _ = self._place(rows, [1] * len(rows))
        row_ids, seq_lens = torch.tensor(rows), positions + 1

        def attention(q, k_pool, v_pool):
            return self.ops.decode_attention(
                q, k_pool, v_pool, self.table, row_ids, seq_lens, SCALE
            )

        return self._run(tokens, slots, positions, attention)

    def verify(self, rows: list[int], drafts: torch.Tensor, tree_mask, depths) -> torch.Tensor:
        """drafts [B, N]; draft i sits at position prefix + depths[i] for RoPE."""
        num_draft = drafts.shape[1]
        slots, _, prefixes = self._place(rows, [num_draft] * len(rows))
        positions = (prefixes[:, None] + torch.tensor(depths)[None, :]).reshape(-1)
        row_ids = torch.tensor(rows)

        def attention(q, k_pool, v_pool):
            return self.ops.tree_verify_attention(
                q, k_pool, v_pool, self.table, row_ids, prefixes, tree_mask, SCALE
            )

        return self._run(drafts.reshape(-1), slots, positions, attention)


def _dense(stack: TinyStack, tokens: torch.Tensor) -> torch.Tensor:
    """Plain causal forward over a whole sequence, no pool."""

    def attend(layer, q, k, v):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            is_causal=True, scale=SCALE, enable_gqa=True,
        )  # fmt: skip
        return out.transpose(0, 1)

    return stack.forward(tokens, torch.arange(len(tokens)), attend)


def _history(ops: ModuleType, stack: TinyStack, prompts: list[torch.Tensor]):
    """Chunked prefill of request A beside B's prefill, 4 greedy decode steps, one verify."""
    run = PooledRun(ops, stack)
    a, b = prompts
    row_a, row_b = 2, 0
    logits = [run.extend([row_a, row_b], [a[:20], b])]
    logits.append(run.extend([row_a], [a[20:]]))
    last = torch.stack([logits[1][-1], logits[0][-1]]).argmax(-1)
    generated = [last]
    for _ in range(4):
        step = run.decode([row_a, row_b], last)
        logits.append(step)
        last = step.argmax(-1)
        generated.append(last)
    # Draft tree: 0 -> 1 -> 2 and 0 -> 3.
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    drafts = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(7))
    logits.append(run.verify([row_a, row_b], drafts, tree.expand(2, 4, 4), [0, 1, 2, 1]))
    return logits, torch.stack(generated, dim=1)


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_and_triton_histories_agree(seed):
    stack = TinyStack(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (37, 9)]
    ref_logits, ref_tokens = _history(reference, stack, prompts)
    tri_logits, tri_tokens = _history(triton_ops, stack, prompts)
    assert torch.equal(ref_tokens, tri_tokens)
    for ref, tri in zip(ref_logits, tri_logits, strict=True):
        torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)

    # The pooled history of each request equals one dense causal pass over its tokens.
    for i, prompt in enumerate(prompts):
        sequence = torch.cat([prompt, ref_tokens[i, :-1]])
        dense = _dense(stack, sequence)
        if i == 0:
            pooled = torch.cat([ref_logits[0][:20], ref_logits[1]])
        else:
            pooled = ref_logits[0][20:]
        steps = torch.stack([step[i] for step in ref_logits[2:6]])
        torch.testing.assert_close(torch.cat([pooled, steps]), dense, rtol=1e-4, atol=1e-4)

    # Verify: draft 2's logits equal a dense pass over prefix + its ancestors 0, 1, 2.
    drafts = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(7))
    for i, prompt in enumerate(prompts):
        prefix = torch.cat([prompt, ref_tokens[i, :-1]])
        dense = _dense(stack, torch.cat([prefix, drafts[i, :3]]))
        torch.testing.assert_close(ref_logits[6][i * 4 + 2], dense[-1], rtol=1e-4, atol=1e-4)
        dense_branch = _dense(stack, torch.cat([prefix, drafts[i, [0, 3]]]))
        torch.testing.assert_close(ref_logits[6][i * 4 + 3], dense_branch[-1], rtol=1e-4, atol=1e-4)
