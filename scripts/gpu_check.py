"""Check and time every Triton kernel on a CUDA machine; print one table.

For each kernel at a realistic size: max error vs the torch reference (relative to the
reference's largest magnitude), Triton time, torch scaled_dot_product_attention time on the
same work with K/V already gathered dense (attention kernels only), and the memory floor
(bytes the kernel must move / measured copy bandwidth). Then, if the runtime is importable,
end-to-end greedy decode throughput of the default model. Runs in well under 5 minutes.

    python scripts/gpu_check.py
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device here; this script only runs on a GPU machine.")

import triton  # noqa: E402
import triton.testing  # noqa: E402

from sglang_like_kernels import reference, triton_ops  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
ROWS: list[tuple[str, ...]] = []


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds per call."""
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def copy_bandwidth() -> float:
    """Achieved device-to-device copy bandwidth, bytes per ms (read + write)."""
    src = torch.empty(1 << 28, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.numel() / bench(lambda: dst.copy_(src))


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    finite = torch.isfinite(want)
    diff = (out.float() - want.float())[finite].abs().max()
    same_inf = torch.equal(torch.isinf(out), torch.isinf(want))
    scale = want.float()[finite].abs().max().clamp_min(1e-12)
    return float(diff / scale) if same_inf else math.inf


def row(name: str, shape: str, err: float, t_triton: float, t_sdpa: float | None, nbytes: int,
        bandwidth: float) -> None:  # fmt: skip
    floor = nbytes / bandwidth
    sdpa = f"{t_sdpa:.3f}" if t_sdpa is not None else "-"
    ROWS.append((name, shape, f"{err:.1e}", f"{t_triton:.3f}", sdpa, f"{floor:.3f}",
                 f"{100 * floor / t_triton:.0f}%"))  # fmt: skip


class Pool:
    """bf16 pools with each request's slots scattered randomly over the pool."""

    def __init__(self, lens: list[int], num_kv_heads: int, head_dim: int, max_context: int):
        num_slots = sum(lens) + 1
        self.k = torch.randn(num_slots, num_kv_heads, head_dim, device=DEV, dtype=BF16)
        self.v = torch.randn_like(self.k)
        self.table = torch.zeros(len(lens), max_context, dtype=torch.int32, device=DEV)
        perm = torch.randperm(num_slots - 1, device=DEV).int() + 1
        start = 0
        for i, n in enumerate(lens):
            self.table[i, :n] = perm[start : start + n]
            start += n
        self.rows = torch.arange(len(lens), device=DEV)
        self.kv_bytes = 2 * sum(lens) * num_kv_heads * head_dim * 2 + sum(lens) * 4

    def dense(self, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V gathered to [B, Hkv, max_len, D] (zero padded) for the SDPA baseline."""
        max_len = max(lens)
        slots = self.table[:, :max_len].long()
        return self.k[slots].transpose(1, 2), self.v[slots].transpose(1, 2)


def check_decode(batch: int, mean_len: int, hq: int, hkv: int, d: int, bw: float) -> None:
    gen = torch.Generator().manual_seed(0)
    lens = (torch.randint(mean_len // 2, 3 * mean_len // 2, (batch,), generator=gen)).tolist()
    pool = Pool(lens, hkv, d, max(lens) + 64)
    q = torch.randn(batch, hq, d, device=DEV, dtype=BF16)
    seq_lens = torch.tensor(lens, device=DEV)
    args = (q, pool.k, pool.v, pool.table, pool.rows, seq_lens, 1 / math.sqrt(d))
    err = rel_err(triton_ops.decode_attention(*args), reference.decode_attention(*args))
    t = bench(lambda: triton_ops.decode_attention(*args))
    k, v = pool.dense(lens)
    mask = (torch.arange(max(lens), device=DEV)[None, :] < seq_lens[:, None])[:, None, None, :]
    qd = q[:, :, None, :]
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask,
                                                          enable_gqa=True))  # fmt: skip
    nbytes = pool.kv_bytes + 2 * q.numel() * 2
    row("decode", f"B{batch} L~{mean_len} {hq}/{hkv}x{d}", err, t, t_sdpa, nbytes, bw)


def check_extend(batch: int, prefix: int, extend: int, hq: int, hkv: int, d: int, bw: float):
    lens = [prefix + extend] * batch
    pool = Pool(lens, hkv, d, prefix + extend)
    q = torch.randn(batch * extend, hq, d, device=DEV, dtype=BF16)
    prefix_lens = torch.full((batch,), prefix, device=DEV)
    extend_lens = torch.full((batch,), extend, device=DEV)
    args = (q, pool.k, pool.v, pool.table, pool.rows, prefix_lens, extend_lens, 1 / math.sqrt(d))
    err = rel_err(triton_ops.extend_attention(*args), reference.extend_attention(*args))
    t = bench(lambda: triton_ops.extend_attention(*args))
    k, v = pool.dense(lens)
    qd = q.view(batch, extend, hq, d).transpose(1, 2)
    pos = torch.arange(prefix + extend, device=DEV)
    mask = pos[None, :] <= (prefix + torch.arange(extend, device=DEV))[:, None]
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask,
                                                          enable_gqa=True))  # fmt: skip
    nbytes = pool.kv_bytes + 2 * q.numel() * 2
    row("extend", f"B{batch} P{prefix}+E{extend} {hq}/{hkv}x{d}", err, t, t_sdpa, nbytes, bw)


def check_tree(batch: int, prefix: int, num_draft: int, hq: int, hkv: int, d: int, bw: float):
    lens = [prefix + num_draft] * batch
    pool = Pool(lens, hkv, d, prefix + num_draft)
    q = torch.randn(batch * num_draft, hq, d, device=DEV, dtype=BF16)
    tree = torch.tril(torch.ones(num_draft, num_draft, dtype=torch.bool, device=DEV))
    tree[num_draft // 2 :, 1 : num_draft // 2] = False  # a second branch off node 0
    tree_mask = tree.expand(batch, -1, -1).contiguous()
    prefix_lens = torch.full((batch,), prefix, device=DEV)
    args = (q, pool.k, pool.v, pool.table, pool.rows, prefix_lens, tree_mask, 1 / math.sqrt(d))
    err = rel_err(triton_ops.tree_verify_attention(*args), reference.tree_verify_attention(*args))
    t = bench(lambda: triton_ops.tree_verify_attention(*args))
    k, v = pool.dense(lens)
    qd = q.view(batch, num_draft, hq, d).transpose(1, 2)
    mask = torch.cat([torch.ones(num_draft, prefix, dtype=torch.bool, device=DEV), tree], 1)
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask,
                                                          enable_gqa=True))  # fmt: skip
    nbytes = pool.kv_bytes + 2 * q.numel() * 2
    row("tree_verify", f"B{batch} P{prefix} N{num_draft} {hq}/{hkv}x{d}", err, t, t_sdpa,
        nbytes, bw)  # fmt: skip


def check_store(num_tokens: int, hkv: int, d: int, bw: float) -> None:
    pool_k = torch.zeros(4 * num_tokens, hkv, d, device=DEV, dtype=BF16)
    pool_v = torch.zeros_like(pool_k)
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    slots = torch.randperm(4 * num_tokens - 1, device=DEV)[:num_tokens] + 1
    k = torch.randn(num_tokens, hkv, d, device=DEV, dtype=BF16)
    v = torch.randn_like(k)
    triton_ops.store_kv(pool_k, pool_v, slots, k, v)
    reference.store_kv(ref_k, ref_v, slots, k, v)
    err = max(rel_err(pool_k, ref_k), rel_err(pool_v, ref_v))
    t = bench(lambda: triton_ops.store_kv(pool_k, pool_v, slots, k, v))
    t_torch = bench(lambda: reference.store_kv(pool_k, pool_v, slots, k, v))
    row("store_kv (vs index_copy_)", f"T{num_tokens} {hkv}x{d}", err, t, t_torch,
        4 * k.numel() * 2, bw)  # fmt: skip


def check_bitmask(batch: int, vocab: int, bw: float) -> None:
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, device=DEV)
    logits = torch.randn(batch, vocab, device=DEV)
    want = logits.clone()
    reference.apply_token_bitmask_(want, bitmask)
    out = logits.clone()
    triton_ops.apply_token_bitmask_(out, bitmask)
    err = 0.0 if torch.equal(out, want) else math.inf
    t = bench(lambda: triton_ops.apply_token_bitmask_(logits.clone(), bitmask))
    t_clone = bench(lambda: logits.clone())
    t_torch = bench(lambda: reference.apply_token_bitmask_(logits.clone(), bitmask))
    row("bitmask (vs torch ref)", f"B{batch} V{vocab}", err, t - t_clone, t_torch - t_clone,
        logits.numel() * 4 * 2 + bitmask.numel() * 4, bw)  # fmt: skip


def end_to_end() -> str:
    """Greedy decode throughput of the default model, or why it was skipped."""
    try:
        from sglang_like import Engine
    except ImportError as exc:
        return f"end-to-end: skipped (sglang_like.Engine not importable: {exc})"
    try:
        engine = Engine(device="cuda")
    except Exception as exc:  # report it; the kernel table above still stands
        return f"end-to-end: skipped (Engine failed to start: {exc!r})"
    try:
        params = {"temperature": 0.0, "max_new_tokens": 256, "ignore_eos": True}
        prompts = [f"Write a long story about the number {i}." for i in range(64)]
        engine.generate(prompts[:2], {**params, "max_new_tokens": 8})  # warm up
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        return f"end-to-end: 64 requests x 256 new tokens: {tokens / wall:.0f} tok/s ({wall:.1f} s)"
    finally:
        engine.shutdown()


def main() -> None:
    t0 = time.perf_counter()
    print(f"device: {torch.cuda.get_device_name()}, triton {triton.__version__}")
    bw = copy_bandwidth()
    print(f"measured copy bandwidth: {bw / 1e6:.0f} GB/s")
    check_decode(64, 1100, 9, 3, 64, bw)  # SmolLM2-135M shape
    check_decode(32, 4096, 32, 8, 128, bw)  # Llama-3-8B shape
    check_decode(8, 32768, 32, 8, 128, bw)  # long context: the split matters
    check_extend(4, 1024, 1024, 32, 8, 128, bw)
    check_extend(16, 0, 512, 9, 3, 64, bw)
    check_tree(16, 2000, 16, 32, 8, 128, bw)
    check_store(4096, 8, 128, bw)
    check_bitmask(64, 128256, bw)
    header = ("kernel", "shape", "rel err", "triton ms", "torch ms", "floor ms", "floor/triton")
    widths = [max(len(r[i]) for r in [header, *ROWS]) for i in range(len(header))]
    for r in [header, *ROWS]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print("torch ms: SDPA on K/V pre-gathered dense (attention rows), else the torch reference")
    bad = [r[0] for r in ROWS if float(r[2]) > 2e-2]
    print(end_to_end())
    print(f"total {time.perf_counter() - t0:.0f} s")
    if bad:
        sys.exit(f"gpu_check: FAILED accuracy for {bad}")


if __name__ == "__main__":
    main()
