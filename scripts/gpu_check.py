"""The device check: kernels, greedy equality, throughput and speculative verify cost on one
CUDA GPU, each in a section of its own, one table per section and a JSON file of everything.

    python scripts/gpu_check.py                          # on a CUDA machine; < 8 minutes
    python scripts/gpu_check.py --out /tmp/check.json --accept-lengths 1.5,2,2.5,3
    python scripts/gpu_check.py --sections kernels,verify
    python scripts/gpu_check.py --cpu-smoke              # every section on CPU, < 1 minute

No model wheel, no hub, no tokenizer: each model is the runtime's own (ModelRunner and the
Llama model code) with seeded random weights of a given shape, driven with token ids.

Sections, each in a child process with its own time limit (--time-scale multiplies them); one
that raises, fails one of its checks or runs past its limit is reported failed, and the next
one runs:

- kernels: every public kernel of sglang_like_kernels (store_kv, decode, extend, tree verify,
  masked attention, token bitmask; store_kv and the attention kernels also over int8 and
  fp8_e4m3 pools, with their scales) against the torch reference: the error, the Triton time,
  a torch time (SDPA on K/V already gathered dense, or the torch reference) and the memory
  floor (bytes the kernel must move / measured copy bandwidth).
- greedy: the device path (Triton kernels, fp32) and the CPU fp32 path (torch references)
  give the same greedy tokens for two ragged requests, on the default model's shape
  (SmolLM2-135M) and on two of the 32 layers of a Llama-3-8B's shape.
- throughput: decode tok/s at batch 1 / 8 / 32 and prefill tok/s in bf16 on SmolLM2-135M's
  and Llama-3-8B's shapes, beside the bandwidth floor (weight + KV bytes a step reads / copy
  bandwidth) and the compute floor (FLOPs / measured bf16 GEMM rate).
- verify: a verify forward of 1, 2, 4, 8, 16 rows (a draft chain) against a one-row decode
  on both shapes, after 1k and 32k cached tokens (there the verify's prefix is split over
  programs), and the speed-up accept_len * t_decode / t_verify(rows) that predicts at
  each of --accept-lengths (drafting not counted; "-" where accept_len > rows).
- sampling: the device sampler (sglang_like.layers.device_sampler) against the host sampler:
  greedy tokens equal, one device-to-host sync per sample (torch's CUDA sync debug mode),
  seeded draws that pass a chi-square test, its time beside copy + host sampler, and a
  verify's tree drawn ahead (each node's row as drawn later; seeded sampled output with
  speculation equal to without, one sync a verify step) (scripts/gpu_check_sampling.py). It
  is what `--device-sampling auto` (on for CUDA) rests on.

--cpu-smoke runs every section on CPU at tiny shapes, the Triton launchers under the
interpreter (TRITON_INTERPRET=1, SGLANG_LIKE_KERNELS=triton), the torch references as the
comparison path; its timings are printed but mean nothing. It ends `N/N sections ok`.

Output: the tables, then `N/M sections ok`; the JSON (--out, default
bench_results/gpu_check.json) holds each section's ok, error, seconds, table and figures.
The exit status is 0 only if every section is ok.

Needs torch and triton, and what the runtime's model code imports: numpy, gguf (the
quantization layer imports it even for dense weights) and tokenizers (sglang_like.model_loader,
for expected_weight_shapes); no safetensors, transformers or model files. This checkout's
kernels/ and root go first on sys.path, so no install is needed. The GPU image this project
is lent lacks gguf, a pure-Python wheel: download it here, carry the folder, install it there:

    python3 -m pip download --no-deps gguf==0.19.0 -d .whl
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 scripts/gpu_check.py

Isolation: children are forked in --cpu-smoke (cheap: the parent imported everything) and
spawned afresh on CUDA (a CUDA context cannot be forked, and a kernel fault poisons only its
own process); --isolation overrides. For the tests, GPU_CHECK_INJECT=SECTION makes that
section raise at its start, and GPU_CHECK_INJECT=SECTION:hang makes it sleep past its limit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SECTION_NAMES = ("kernels", "greedy", "throughput", "verify", "sampling", "graphs")
# seconds per section, caps that sum to 10 minutes with the probe: each is several times what
# the section was estimated to need on an H100 (compiles included)
LIMITS_CUDA = {"probe": 30.0, "kernels": 120.0, "greedy": 100.0, "throughput": 120.0,
               "verify": 90.0, "sampling": 75.0, "graphs": 60.0}
LIMITS_SMOKE = {"probe": 30.0, "kernels": 60.0, "greedy": 60.0, "throughput": 60.0,
                "verify": 60.0, "sampling": 90.0, "graphs": 60.0}
INJECT_ENV = "GPU_CHECK_INJECT"
KERNEL_TOL = 2e-2  # max error relative to the reference's largest magnitude (bf16 dots)
# the same, between the fp32 paths' logits: both sum in fp32 (seen: 2e-7 on CPU)
GREEDY_LOGIT_TOL = 1e-3
# the tree size the graphs section captures a verify of (a chain: the kernel's mask is a buffer)
GRAPH_VERIFY_NODES = 4


# ---- shapes ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A Llama-family decoder's shape (the runtime's ModelConfig fields that matter here)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    tied: bool
    rope_theta: float

    def with_layers(self, layers: int) -> Shape:
        return dataclasses.replace(self, name=f"{self.name} ({layers} of {self.layers} layers)",
                                   layers=layers)


SMOLLM2_135M = Shape("smollm2-135m", 576, 30, 9, 3, 64, 1536, 49152, True, 100000.0)
LLAMA3_8B = Shape("llama3-8b", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0)
# --cpu-smoke: the same families of head layout (GQA 3 tied; GQA 4 untied), tiny
SMOLLM2_TINY = Shape("smollm2-135m tiny", 96, 2, 6, 2, 16, 192, 256, True, 100000.0)
LLAMA3_TINY = Shape("llama3-8b tiny", 128, 2, 4, 1, 32, 256, 320, False, 500000.0)


@dataclass(frozen=True)
class Plan:
    """The sizes each section runs at: realistic on CUDA, tiny in --cpu-smoke."""

    equality_shapes: tuple[Shape, ...]
    equality_prompts: tuple[int, int]
    equality_new: int
    bench_shapes: tuple[Shape, ...]
    decode_batches: tuple[int, ...]
    decode_context: int
    prefill_tokens: int
    verify_contexts: tuple[int, ...]
    verify_rows: tuple[int, ...] = (1, 2, 4, 8, 16)


# verify at 32k too: a batch-1 verify's prefix is split over programs there, as decode's is
PLAN_CUDA = Plan((SMOLLM2_135M, LLAMA3_8B.with_layers(2)), (45, 70), 24,
                 (SMOLLM2_135M, LLAMA3_8B), (1, 8, 32), 1024, 2048, (1024, 32768))
PLAN_SMOKE = Plan((SMOLLM2_TINY, LLAMA3_TINY), (7, 12), 4,
                  (SMOLLM2_TINY, LLAMA3_TINY), (1, 2), 16, 16, (16,))


# ---- command line and environment ------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="every section on CPU, Triton under the interpreter, tiny shapes")
    p.add_argument("--out", default=str(ROOT / "bench_results" / "gpu_check.json"),
                   help="JSON file of every section's results (default: %(default)s)")
    p.add_argument("--accept-lengths", default="1.5,2.0,2.5,3.0",
                   help="acceptance lengths the verify section predicts speed-ups at")
    p.add_argument("--sections", default=",".join(SECTION_NAMES),
                   help=f"comma-separated subset of {', '.join(SECTION_NAMES)}")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every section's time limit (a slower machine)")
    p.add_argument("--time-limit", action="append", default=[], metavar="SECTION=SECONDS",
                   help="one section's time limit (after --time-scale); repeatable")
    p.add_argument("--isolation", choices=("fork", "spawn"), default=None,
                   help="how sections get their process (default: fork in --cpu-smoke, "
                        "spawn on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    # a spawned child runs one section and writes its result here (not for users)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a spawned child repeats
    args.accept = [float(a) for a in args.accept_lengths.split(",") if a.strip()]
    args.section_list = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.section_list) - set(SECTION_NAMES))
    if unknown or not args.section_list:
        p.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTION_NAMES)}")
    args.limits = {}
    for item in args.time_limit:
        name, _, seconds = item.partition("=")
        if name not in SECTION_NAMES or not seconds:
            p.error(f"--time-limit {item!r}: expected SECTION=SECONDS")
        args.limits[name] = float(seconds)
    if args.isolation is None:
        args.isolation = "fork" if args.cpu_smoke else "spawn"
    return args


def set_environment(smoke: bool) -> None:
    """Before triton or sglang_like_kernels is imported: the interpreter flag is read when a
    kernel is decorated and the backend switch when the package is imported."""
    for path in (ROOT, ROOT / "kernels"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["SGLANG_LIKE_KERNELS"] = "triton"
    else:
        # the device path picks Triton by the tensors' device; each model path below also
        # forces its backend (kernel_backend)
        os.environ["SGLANG_LIKE_KERNELS"] = "auto"


# ---- what a section returns ------------------------------------------------------------------
@dataclass
class Report:
    """One section's table, its figures for the JSON, and the checks that failed."""

    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


class Context:
    """What every section reads: the mode, the device, the plan, and a timer."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.smoke = args.cpu_smoke
        self.device = torch.device("cpu" if self.smoke else "cuda")
        self.plan = PLAN_SMOKE if self.smoke else PLAN_CUDA
        self.seed = args.seed
        torch.manual_seed(self.seed)

    def bench(self, fn: Callable[[], object]) -> float:
        """Milliseconds per call: the median of triton's do_bench on CUDA; one timed call on
        CPU (the interpreter is slow and smoke timings mean nothing anyway)."""
        if self.smoke:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median"))

    def run_and_time(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """(fn(), ms per call): on CPU the one call timed (an interpreted kernel is not run a
        second time for a figure that means nothing); on CUDA `bench` after it."""
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1e3
        return out, (ms if self.smoke else self.bench(fn))

    def log(self, msg: str) -> None:
        """Progress of a long section (CUDA only): a hung section shows where it stopped."""
        if not self.smoke:
            print(f"    .. {msg}", flush=True)

    def free(self) -> None:
        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def copy_bandwidth(ctx: Context) -> float:
    """Achieved copy bandwidth, bytes per ms (read + write counted)."""
    import torch

    n = (1 << 22) if ctx.smoke else (1 << 28)
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    return 2 * n / ctx.bench(lambda: dst.copy_(src))


def gemm_rate(ctx: Context) -> float:
    """Achieved bf16 matrix-product rate, FLOPs per ms."""
    import torch

    n = 128 if ctx.smoke else 8192
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return 2 * n**3 / ctx.bench(lambda: a @ b)


def rel_err(out: Any, want: Any) -> float:
    """Max |out - want| over want's largest magnitude (infinite where their infs differ)."""
    import torch

    finite = torch.isfinite(want)
    if not torch.equal(torch.isinf(out), torch.isinf(want)) or out.isnan().any():
        return math.inf
    if not finite.any():
        return 0.0
    diff = (out.float() - want.float())[finite].abs().max()
    scale = want.float()[finite].abs().max().clamp_min(1e-12)
    return float(diff / scale)


@contextlib.contextmanager
def kernel_backend(mode: str) -> Iterator[None]:
    """Force sglang_like_kernels' backend ("triton" or "reference") for the model code inside:
    in --cpu-smoke both paths run on CPU tensors, so the device cannot pick it. The switch is
    read at each call (sglang_like_kernels._backend), as tests/kernels/test_model_triton.py
    relies on too."""
    import sglang_like_kernels

    old = sglang_like_kernels._MODE
    sglang_like_kernels._MODE = mode
    try:
        yield
    finally:
        sglang_like_kernels._MODE = old


# ---- section: kernels ------------------------------------------------------------------------
KV_DTYPES = ("bf16", "int8", "fp8_e4m3")


class Pool:
    """A KV pool with each request's slots scattered randomly over it: bf16 rows, or a
    quantized pool's codes and scales (kv_quant) of random rows."""

    def __init__(self, ctx: Context, lens: list[int], hkv: int, d: int, max_context: int,
                 kv: str) -> None:
        import torch

        from sglang_like_kernels import kv_quant

        dev = ctx.device
        num_slots = sum(lens) + 1
        k = torch.randn(num_slots, hkv, d, device=dev)
        v = torch.randn_like(k)
        self.scales: dict[str, Any] = {}
        if kv == "bf16":
            self.k, self.v = k.bfloat16(), v.bfloat16()
            self.k_dense, self.v_dense = self.k, self.v
            per_head = 2 * d
        else:
            dtype = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv]
            (self.k, ks), (self.v, vs) = kv_quant.quantize(k, dtype), kv_quant.quantize(v, dtype)
            self.scales = {"k_scale": ks, "v_scale": vs}
            # SDPA's baseline reads the rows the codes hold, as a bf16 cache would
            self.k_dense = kv_quant.dequantize(self.k, ks).bfloat16()
            self.v_dense = kv_quant.dequantize(self.v, vs).bfloat16()
            per_head = d + 4
        self.table = torch.zeros(len(lens), max_context, dtype=torch.int32, device=dev)
        perm = torch.randperm(num_slots - 1, device=dev).int() + 1
        start = 0
        for i, n in enumerate(lens):
            self.table[i, :n] = perm[start : start + n]
            start += n
        self.rows = torch.arange(len(lens), device=dev)
        self.kv_bytes = 2 * sum(lens) * hkv * per_head + sum(lens) * 4

    def dense(self, lens: list[int]) -> tuple[Any, Any]:
        """K, V gathered to [B, Hkv, max_len, D] (zero padded) for the SDPA baseline."""
        slots = self.table[:, : max(lens)].long()
        return self.k_dense[slots].transpose(1, 2), self.v_dense[slots].transpose(1, 2)


class KernelRows:
    """The kernels table: rows in the existing columns, figures, and failed checks."""

    COLUMNS = ["kernel", "shape", "rel err", "triton ms", "torch ms", "floor ms",
               "floor/triton"]

    def __init__(self, ctx: Context, bandwidth: float) -> None:
        self.ctx, self.bw = ctx, bandwidth
        self.report = Report(self.COLUMNS)

    def add(self, name: str, shape: str, err: float, t_triton: float, t_torch: float | None,
            nbytes: int) -> None:
        floor = nbytes / self.bw
        self.report.rows.append([
            name, shape, f"{err:.1e}", f"{t_triton:.3f}",
            f"{t_torch:.3f}" if t_torch is not None else "-", f"{floor:.3f}",
            f"{100 * floor / t_triton:.0f}%" if t_triton > 0 else "-"])  # fmt: skip
        ok = err <= KERNEL_TOL
        self.report.figures.setdefault("rows", []).append({
            "kernel": name, "shape": shape, "rel_err": err if math.isfinite(err) else None,
            "tol": KERNEL_TOL, "triton_ms": t_triton, "torch_ms": t_torch, "floor_ms": floor,
            "bytes": nbytes, "ok": ok})  # fmt: skip
        if not ok:
            self.report.failures.append(f"{name} {shape}: rel err {err:.1e} > {KERNEL_TOL}")
        self.ctx.log(f"{name} {shape}: err {err:.1e}, {t_triton:.3f} ms")


def _sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _label(name: str, kv: str) -> str:
    return name if kv == "bf16" else f"{name} [{kv}]"


def check_decode(out: KernelRows, batch: int, mean_len: int, hq: int, hkv: int, d: int,
                 kv: str = "bf16") -> None:
    import torch
    import torch.nn.functional as F

    from sglang_like_kernels import reference, triton_ops

    ctx = out.ctx
    gen = torch.Generator().manual_seed(batch * mean_len)
    lens = torch.randint(max(mean_len // 2, 1), 3 * mean_len // 2 + 1, (batch,),
                         generator=gen).tolist()
    pool = Pool(ctx, lens, hkv, d, max(lens) + 64, kv)
    q = torch.randn(batch, hq, d, device=ctx.device, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, device=ctx.device)
    args = (q, pool.k, pool.v, pool.table, pool.rows, seq_lens, 1 / math.sqrt(d))
    got, t = ctx.run_and_time(lambda: triton_ops.decode_attention(*args, **pool.scales))
    err = rel_err(got, reference.decode_attention(*args, **pool.scales))
    k, v = pool.dense(lens)
    mask = (torch.arange(max(lens), device=ctx.device)[None, :] < seq_lens[:, None])
    mask = mask[:, None, None, :]
    qd = q[:, :, None, :]
    t_sdpa = ctx.bench(lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask,
                                                              enable_gqa=True))  # fmt: skip
    out.add(_label("decode", kv), f"B{batch} L~{mean_len} {hq}/{hkv}x{d}", err, t, t_sdpa,
            pool.kv_bytes + 2 * q.numel() * 2)


def check_extend(out: KernelRows, batch: int, prefix: int, extend: int, hq: int, hkv: int,
                 d: int, kv: str = "bf16") -> None:
    import torch
    import torch.nn.functional as F

    from sglang_like_kernels import reference, triton_ops

    ctx, dev = out.ctx, out.ctx.device
    lens = [prefix + extend] * batch
    pool = Pool(ctx, lens, hkv, d, prefix + extend, kv)
    q = torch.randn(batch * extend, hq, d, device=dev, dtype=torch.bfloat16)
    prefix_lens = torch.full((batch,), prefix, device=dev)
    extend_lens = torch.full((batch,), extend, device=dev)
    args = (q, pool.k, pool.v, pool.table, pool.rows, prefix_lens, extend_lens, 1 / math.sqrt(d))
    got, t = ctx.run_and_time(lambda: triton_ops.extend_attention(*args, **pool.scales))
    err = rel_err(got, reference.extend_attention(*args, **pool.scales))
    k, v = pool.dense(lens)
    qd = q.view(batch, extend, hq, d).transpose(1, 2)
    pos = torch.arange(prefix + extend, device=dev)
    mask = pos[None, :] <= (prefix + torch.arange(extend, device=dev))[:, None]
    t_sdpa = ctx.bench(lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask,
                                                              enable_gqa=True))  # fmt: skip
    out.add(_label("extend", kv), f"B{batch} P{prefix}+E{extend} {hq}/{hkv}x{d}", err, t,
            t_sdpa, pool.kv_bytes + 2 * q.numel() * 2)


def _two_branch_tree(n: int, device: Any) -> Any:
    """A draft tree of n nodes: a chain from node 0, and a second branch off node 0."""
    import torch

    tree = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))
    tree[n // 2 :, 1 : n // 2] = False
    return tree


def check_tree(out: KernelRows, batch: int, prefix: int, num_draft: int, hq: int, hkv: int,
               d: int, kv: str = "bf16") -> None:
    import torch
    import torch.nn.functional as F

    from sglang_like_kernels import reference, triton_ops

    ctx, dev = out.ctx, out.ctx.device
    lens = [prefix + num_draft] * batch
    pool = Pool(ctx, lens, hkv, d, prefix + num_draft, kv)
    q = torch.randn(batch * num_draft, hq, d, device=dev, dtype=torch.bfloat16)
    tree = _two_branch_tree(num_draft, dev)
    tree_mask = tree.expand(batch, -1, -1).contiguous()
    prefix_lens = torch.full((batch,), prefix, device=dev)
    args = (q, pool.k, pool.v, pool.table, pool.rows, prefix_lens, tree_mask, 1 / math.sqrt(d))
    got, t = ctx.run_and_time(lambda: triton_ops.tree_verify_attention(*args, **pool.scales))
    err = rel_err(got, reference.tree_verify_attention(*args, **pool.scales))
    k, v = pool.dense(lens)
    qd = q.view(batch, num_draft, hq, d).transpose(1, 2)
    mask = torch.cat([torch.ones(num_draft, prefix, dtype=torch.bool, device=dev), tree], 1)
    t_sdpa = ctx.bench(lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask,
                                                              enable_gqa=True))  # fmt: skip
    out.add(_label("tree_verify", kv), f"B{batch} P{prefix} N{num_draft} {hq}/{hkv}x{d}", err,
            t, t_sdpa, pool.kv_bytes + 2 * q.numel() * 2)


def check_masked(out: KernelRows, prefixes: tuple[int, int, int], sizes: tuple[int, int, int],
                 hq: int, hkv: int, d: int) -> None:
    """masked_attention over a ragged batch (a tree, a causal extend and another tree: the
    Triton masked kernel on CUDA, in one launch) against the torch reference of it."""
    import torch

    import sglang_like_kernels
    from sglang_like_kernels import reference

    ctx, dev = out.ctx, out.ctx.device
    lens = [p + n for p, n in zip(prefixes, sizes, strict=True)]
    pool = Pool(ctx, lens, hkv, d, max(lens), "bf16")
    q = torch.randn(sum(sizes), hq, d, device=dev, dtype=torch.bfloat16)
    scale = 1 / math.sqrt(d)
    masks = [_two_branch_tree(sizes[0], dev),
             torch.tril(torch.ones(sizes[1], sizes[1], dtype=torch.bool, device=dev)),
             _two_branch_tree(sizes[2], dev)]
    prefix_lens = torch.tensor(prefixes, device=dev)

    def masked() -> Any:
        return sglang_like_kernels.masked_attention(q, pool.k, pool.v, pool.table, pool.rows,
                                                    prefix_lens, masks, scale)

    def torch_reference() -> Any:
        return reference.masked_attention(q, pool.k, pool.v, pool.table, pool.rows,
                                          prefix_lens, masks, scale)

    (got, t_triton), (want, t_torch) = ctx.run_and_time(masked), ctx.run_and_time(torch_reference)
    err = rel_err(got, want)
    shape = f"T{sizes[0]}@{prefixes[0]} E{sizes[1]}@{prefixes[1]} T{sizes[2]}@{prefixes[2]} " \
            f"{hq}/{hkv}x{d}"
    out.add("masked (ragged)", shape, err, t_triton, t_torch, pool.kv_bytes + 2 * q.numel() * 2)


def check_store(out: KernelRows, num_tokens: int, hkv: int, d: int, kv: str = "bf16") -> None:
    import torch

    from sglang_like_kernels import kv_quant, reference, triton_ops

    ctx, dev = out.ctx, out.ctx.device
    dtype = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv]
    pools = [torch.zeros(4 * num_tokens, hkv, d, device=dev, dtype=dtype) for _ in range(4)]
    quant = kv != "bf16"
    scales = ([torch.zeros(4 * num_tokens, hkv, device=dev) for _ in range(4)] if quant
              else [None] * 4)
    slots = torch.randperm(4 * num_tokens - 1, device=dev)[:num_tokens] + 1
    k = torch.randn(num_tokens, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def store(mod: Any, i: int) -> Callable[[], None]:
        return lambda: mod.store_kv(pools[i], pools[i + 1], slots, k, v, scales[i],
                                    scales[i + 1])

    (_, t), (_, t_torch) = ctx.run_and_time(store(triton_ops, 0)), ctx.run_and_time(
        store(reference, 2))
    same = all(torch.equal(kv_quant.as_bytes(pools[a]), kv_quant.as_bytes(pools[b]))
               for a, b in ((0, 2), (1, 3)))
    same = same and (not quant or all(torch.equal(scales[a], scales[b]) for a, b in ((0, 2),
                                                                                     (1, 3))))
    err = 0.0 if same else math.inf  # a copy (quantized: the reference's own codes)
    written = num_tokens * hkv * (d * pools[0].element_size() + (4 if quant else 0))
    out.add(_label("store_kv (vs index_copy_)", kv), f"T{num_tokens} {hkv}x{d}", err, t,
            t_torch, 2 * k.numel() * 2 + 2 * written)


def check_bitmask(out: KernelRows, batch: int, vocab: int) -> None:
    import torch

    from sglang_like_kernels import reference, triton_ops

    ctx, dev = out.ctx, out.ctx.device
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, device=dev)
    logits = torch.randn(batch, vocab, device=dev)
    want = logits.clone()
    reference.apply_token_bitmask_(want, bitmask)
    got = logits.clone()
    triton_ops.apply_token_bitmask_(got, bitmask)
    err = 0.0 if torch.equal(got, want) else math.inf
    t = ctx.bench(lambda: triton_ops.apply_token_bitmask_(logits.clone(), bitmask))
    t_clone = ctx.bench(lambda: logits.clone())
    t_torch = ctx.bench(lambda: reference.apply_token_bitmask_(logits.clone(), bitmask))
    out.add("bitmask (vs torch ref)", f"B{batch} V{vocab}", err, max(t - t_clone, 0.0),
            max(t_torch - t_clone, 0.0), logits.numel() * 4 * 2 + bitmask.numel() * 4)


def section_kernels(ctx: Context) -> Report:
    bw = copy_bandwidth(ctx)
    out = KernelRows(ctx, bw)
    out.report.figures["copy_bandwidth_GBps"] = bw / 1e6
    if ctx.smoke:
        check_decode(out, 3, 24, 4, 2, 32)
        check_extend(out, 2, 8, 8, 4, 2, 32)
        check_tree(out, 2, 10, 4, 4, 2, 32)
        check_tree(out, 1, 600, 4, 4, 2, 32)  # a table wide enough for 2 prefix splits
        check_store(out, 16, 2, 32)
        check_bitmask(out, 2, 100)
        check_masked(out, (10, 6, 14), (4, 5, 3), 4, 2, 32)
        for kv in KV_DTYPES[1:]:
            check_decode(out, 2, 20, 4, 2, 32, kv)
            check_extend(out, 1, 6, 6, 4, 2, 32, kv)
            check_tree(out, 1, 9, 4, 4, 2, 32, kv)
            check_store(out, 8, 2, 32, kv)
    else:
        # the rows the script always had: the models' shapes, long context, verify, bitmask
        check_decode(out, 64, 1100, 9, 3, 64)  # SmolLM2-135M shape
        check_decode(out, 32, 4096, 32, 8, 128)  # Llama-3-8B shape
        check_decode(out, 8, 32768, 32, 8, 128)  # long context: the split matters
        check_extend(out, 4, 1024, 1024, 32, 8, 128)
        check_extend(out, 16, 0, 512, 9, 3, 64)
        check_tree(out, 16, 2000, 16, 32, 8, 128)
        check_tree(out, 1, 32768, 16, 32, 8, 128)  # long context, batch 1: the prefix split
        check_store(out, 4096, 8, 128)
        check_bitmask(out, 64, 128256)
        check_masked(out, (1500, 800, 3000), (8, 64, 4), 32, 8, 128)
        check_masked(out, (32768, 800, 16384), (8, 64, 4), 32, 8, 128)
        for kv in KV_DTYPES[1:]:
            check_decode(out, 32, 4096, 32, 8, 128, kv)
            check_extend(out, 4, 1024, 1024, 32, 8, 128, kv)
            check_tree(out, 16, 2000, 16, 32, 8, 128, kv)
            check_store(out, 4096, 8, 128, kv)
    out.report.notes += [
        f"measured copy bandwidth: {bw / 1e6:.3g} GB/s; rel err: max |triton - reference| / "
        f"max |reference| (pass <= {KERNEL_TOL})",
        "torch ms: SDPA on K/V pre-gathered dense (attention rows, bf16 for quantized pools), "
        "else the torch reference; masked: triton = the Triton kernels per request"]
    return out.report


# ---- models with random weights ---------------------------------------------------------------
def model_config(shape: Shape) -> Any:
    from sglang_like.config import ModelConfig

    return ModelConfig(
        architecture="llama", vocab_size=shape.vocab, hidden_size=shape.hidden,
        intermediate_size=shape.inter, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, rms_norm_eps=1e-5, rope_theta=shape.rope_theta,
        max_position_embeddings=8192, tie_word_embeddings=shape.tied,
    )  # fmt: skip


def random_weights(config: Any, seed: int, device: Any, dtype: Any) -> dict[str, Any]:
    """Hugging Face-named weights made on `device`: N(0, 1/fan_in) matrices, norms near 1,
    N(0, 1) embeddings (as tests/kernels/cases_model.py makes them), from one seed."""
    import torch

    from sglang_like.model_loader import expected_weight_shapes

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    weights = {}
    for name, shape in sorted(expected_weight_shapes(config).items()):
        x = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        if name.endswith("norm.weight"):
            x = 1 + 0.1 * x
        elif len(shape) == 2 and "embed" not in name:
            x /= math.sqrt(shape[1])
        weights[name] = x
    return weights


class Model:
    """The runtime's ModelRunner over random weights, with every request row's slots laid out
    in advance (row r, position p -> slot 1 + r * context + p), driven with ForwardBatches
    built here from token ids: no scheduler, no tokenizer."""

    def __init__(self, shape: Shape, weights: dict[str, Any], device: Any, dtype: Any,
                 rows: int, context: int) -> None:
        import torch

        from sglang_like.model_runner import ModelRunner

        self.shape, self.device, self.context = shape, device, context
        self.config = model_config(shape)
        self.runner = ModelRunner(self.config, weights, dtype=dtype, device=device,
                                  num_kv_slots=rows * context, context_len=context,
                                  max_running_requests=rows)
        table = self.runner.req_to_token_pool.req_to_token
        table[:rows] = (1 + torch.arange(rows * context, device=device)).view(rows, context)

    def batch(self, rows: list[int], prefixes: list[int], ids: list[list[int]],
              tree: Any = None) -> Any:
        """A forward of len(ids[i]) new tokens of row rows[i] after prefixes[i] cached ones;
        logits of each request's last row, or of every row for a verify (`tree`: bool [B, N,
        N])."""
        import torch

        from sglang_like.forward_batch import ForwardBatch

        dev, c = self.device, self.context
        ext = [len(x) for x in ids]
        positions = [p for pre, n in zip(prefixes, ext, strict=True) for p in range(pre, pre + n)]
        slots = [1 + r * c + p for r, pre, n in zip(rows, prefixes, ext, strict=True)
                 for p in range(pre, pre + n)]
        ends = torch.tensor(ext).cumsum(0)
        logits_rows = list(range(sum(ext))) if tree is not None else (ends - 1).tolist()

        def t(x: list[int]) -> Any:
            return torch.tensor(x, dtype=torch.long, device=dev)

        return ForwardBatch(
            input_ids=t([i for x in ids for i in x]), positions=t(positions), out_slots=t(slots),
            req_pool_indices=t(rows), prefix_lens=t(prefixes), extend_lens=t(ext),
            logits_indices=t(logits_rows), req_to_token=self.runner.req_to_token_pool.req_to_token,
            tree_mask=tree, is_decode=tree is None and all(n == 1 for n in ext),
        )  # fmt: skip

    def forward(self, fb: Any) -> Any:
        """float32 logits [len(fb.logits_indices), vocab] on the model's device."""
        return self.runner.model(fb, self.runner.kv_pool)

    def fill_kv(self) -> None:
        """Random K/V everywhere (a timed step then reads real numbers, not torch.empty's)."""
        pool = self.runner.kv_pool
        for buf in (*pool.k_buffers, *pool.v_buffers):
            buf.normal_()

    def weight_bytes_per_step(self) -> int:
        """Weight bytes one decode step reads: every matrix, the LM head included, but of an
        untied embedding only the rows gathered (counted as none)."""
        model = self.runner.model
        total = model.decode_bytes()
        if not self.shape.tied:
            w = model.model.embed_tokens.weight
            total -= w.numel() * w.element_size()
        return total

    def matmul_params(self) -> tuple[int, int]:
        """(weights of the decoder layers' matrices, weights of the LM head)."""
        layers = sum(b.numel() for name, b in self.runner.model.model.layers.named_buffers()
                     if name.endswith("weight"))
        return layers, self.shape.vocab * self.shape.hidden


def _random_ids(gen: Any, vocab: int, n: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (n,), generator=gen).tolist()


# ---- section: greedy equality -----------------------------------------------------------------
def greedy(model: Model, mode: str, prompts: list[list[int]], new: int
           ) -> tuple[list[list[int]], list[Any]]:
    """Greedy tokens of the prompts prefilled together in rows 0.., then decoded together;
    with each forward's logits (CPU float32)."""
    with kernel_backend(mode):
        rows = list(range(len(prompts)))
        logits = model.forward(model.batch(rows, [0] * len(prompts), prompts)).float().cpu()
        seen = [logits]
        tokens = [[int(t)] for t in logits.argmax(-1)]
        for step in range(new - 1):
            fb = model.batch(rows, [len(p) + step for p in prompts], [[t[-1]] for t in tokens])
            logits = model.forward(fb).float().cpu()
            seen.append(logits)
            for t, nxt in zip(tokens, logits.argmax(-1).tolist(), strict=True):
                t.append(nxt)
    return tokens, seen


def compare_greedy(got: list[list[int]], want: list[list[int]], got_logits: list[Any],
                   want_logits: list[Any]) -> dict[str, Any]:
    """The device path's tokens against the reference's. Logits are compared up to the first
    step where a token differs (past it the contexts differ), and must agree within
    GREEDY_LOGIT_TOL. A token difference is a near-tie, not a failure, when the reference's
    logits of the two tokens are closer than twice the paths' largest logit difference at that
    step: random weights make such ties rare, but fp32 sums in another order can flip one."""
    steps = len(want_logits)
    first = next((i for i in range(steps)
                  if any(g[i] != w[i] for g, w in zip(got, want, strict=True))), None)
    upto = steps if first is None else first + 1
    diff = max(rel_err(g, w) for g, w in zip(got_logits[:upto], want_logits[:upto],
                                             strict=True))
    out: dict[str, Any] = {"first_diff_step": first,
                           "max_rel_logit_diff": diff if math.isfinite(diff) else None}
    if not math.isfinite(diff):
        return {**out, "ok": False, "verdict": "NO (non-finite logits)"}
    if diff > GREEDY_LOGIT_TOL:
        return {**out, "ok": False, "verdict": f"NO (logits {diff:.1e} apart)"}
    if first is None:
        return {**out, "ok": True, "verdict": "yes"}
    g_l, w_l = got_logits[first], want_logits[first]
    noise = float((g_l - w_l).abs().max())
    margins = [float(w_l[r, w[first]] - w_l[r, g[first]])
               for r, (g, w) in enumerate(zip(got, want, strict=True)) if g[first] != w[first]]
    out["tie_margin"], out["logit_noise"] = max(margins), noise
    if max(margins) <= 2 * noise:
        return {**out, "ok": True, "verdict": f"tie@{first}"}
    return {**out, "ok": False, "verdict": "NO"}


def section_greedy(ctx: Context) -> Report:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 paths stay fp32
    torch.set_float32_matmul_precision("highest")
    plan = ctx.plan
    report = Report(["shape", "prompts", "new", "tokens equal", "first diff",
                     "max rel logit diff"])
    report.figures["models"] = []
    cpu = torch.device("cpu")
    for shape in plan.equality_shapes:
        ctx.log(f"greedy: {shape.name}")
        gen = torch.Generator().manual_seed(ctx.seed)
        prompts = [_random_ids(gen, shape.vocab, n) for n in plan.equality_prompts]
        context = max(plan.equality_prompts) + plan.equality_new + 1
        weights = random_weights(model_config(shape), ctx.seed, ctx.device, torch.float32)
        device_model = Model(shape, weights, ctx.device, torch.float32, len(prompts), context)
        if ctx.smoke:  # one CPU model serves both paths (each writes every slot it reads)
            ref_model = device_model
        else:
            weights = {n: w.cpu() for n, w in weights.items()}
            ref_model = Model(shape, weights, cpu, torch.float32, len(prompts), context)
        del weights
        got, got_logits = greedy(device_model, "triton", prompts, plan.equality_new)
        want, want_logits = greedy(ref_model, "reference", prompts, plan.equality_new)
        del device_model, ref_model
        ctx.free()
        verdict = compare_greedy(got, want, got_logits, want_logits)
        report.rows.append([shape.name, "/".join(map(str, plan.equality_prompts)),
                            str(plan.equality_new), verdict["verdict"],
                            "-" if verdict["first_diff_step"] is None
                            else f"step {verdict['first_diff_step']}",
                            _sci(verdict["max_rel_logit_diff"])])
        report.figures["models"].append({
            "shape": shape.name, "prompt_lens": list(plan.equality_prompts),
            "new_tokens": plan.equality_new, **verdict,
            "device_tokens": got, "reference_tokens": want})  # fmt: skip
        if not verdict["ok"]:
            report.failures.append(f"{shape.name}: {verdict['verdict']}")
    where = "CPU, Triton interpreter" if ctx.smoke else "CUDA, Triton kernels"
    report.notes += [f"device path: fp32 weights and KV, {where}; reference path: the same "
                        f"model on CPU, fp32, torch references; two requests of ragged "
                        f"prompts prefilled together, then decoded together"]
    if any(m["verdict"].startswith("tie") for m in report.figures["models"]):
        report.notes.append("tie@k: the paths chose different tokens at step k where the "
                            "reference's two logits were closer than twice the paths' "
                            "difference (not a failure; the contexts part there)")
    return report


# ---- section: throughput ------------------------------------------------------------------------
def bench_model(ctx: Context, model: Model, fb: Any) -> float:
    """ms per forward of a ready ForwardBatch (its building is not timed); its logits must be
    finite."""
    import torch

    logits, ms = ctx.run_and_time(lambda: model.forward(fb))
    if not bool(torch.isfinite(logits).all()):
        raise AssertionError(f"{model.shape.name}: non-finite logits")
    return ms


def build_bench_model(ctx: Context, shape: Shape, rows: int, context: int) -> Model:
    """A bf16 model of `shape` (weights made on the device: an 8B model in seconds)."""
    import torch

    weights = random_weights(model_config(shape), ctx.seed, ctx.device, torch.bfloat16)
    model = Model(shape, weights, ctx.device, torch.bfloat16, rows, context)
    del weights
    ctx.free()
    model.fill_kv()
    return model


def section_throughput(ctx: Context) -> Report:
    import torch

    from sglang_like.mem_pool import KVPool

    plan = ctx.plan
    bw, rate = copy_bandwidth(ctx), gemm_rate(ctx)
    report = Report(["shape", "step", "ms", "tok/s", "bw floor ms", "compute floor ms",
                     "floor/ms"])
    report.figures.update({"copy_bandwidth_GBps": bw / 1e6, "gemm_TFLOPs": rate / 1e9,
                           "rows": []})
    context = max(plan.decode_context, plan.prefill_tokens)
    gen = torch.Generator().manual_seed(ctx.seed)
    for shape in plan.bench_shapes:
        ctx.log(f"throughput: building {shape.name}")
        model = build_bench_model(ctx, shape, max(plan.decode_batches), context)
        weights = model.weight_bytes_per_step()
        layer_params, head_params = model.matmul_params()
        kv_token = KVPool.bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim,
                                          torch.bfloat16)
        attn_unit = 2 * shape.layers * shape.heads * shape.head_dim  # q.k and p.v per key
        with kernel_backend("triton"):
            steps = []
            length = plan.decode_context
            for b in plan.decode_batches:
                fb = model.batch(list(range(b)), [length - 1] * b,
                                 [_random_ids(gen, shape.vocab, 1) for _ in range(b)])
                nbytes = weights + b * length * kv_token
                flops = 2 * b * (layer_params + head_params) + b * length * attn_unit
                steps.append((f"decode B{b} ctx {length}", b, fb, nbytes, flops))
            t = plan.prefill_tokens
            fb = model.batch([0], [0], [_random_ids(gen, shape.vocab, t)])
            nbytes = weights + t * kv_token
            flops = 2 * t * layer_params + 2 * head_params + t * (t + 1) // 2 * attn_unit
            steps.append((f"prefill 1x{t}", t, fb, nbytes, flops))
            for label, tokens, fb, nbytes, flops in steps:
                ms = bench_model(ctx, model, fb)
                bw_floor, compute_floor = nbytes / bw, flops / rate
                floor = max(bw_floor, compute_floor)
                report.rows.append([shape.name, label, f"{ms:.3f}", f"{tokens / ms * 1e3:.0f}",
                                    f"{bw_floor:.3f}", f"{compute_floor:.3f}",
                                    f"{100 * floor / ms:.0f}%"])
                report.figures["rows"].append({
                    "shape": shape.name, "step": label, "tokens": tokens, "ms": ms,
                    "tok_s": tokens / ms * 1e3, "bytes": nbytes, "flops": flops,
                    "bw_floor_ms": bw_floor, "compute_floor_ms": compute_floor})  # fmt: skip
                ctx.log(f"{shape.name} {label}: {ms:.3f} ms")
        del model
        ctx.free()
    report.notes += [
        f"bf16 weights and KV; measured copy bandwidth {bw / 1e6:.3g} GB/s, bf16 GEMM "
        f"{rate / 1e9:.3g} TFLOP/s; bw floor: (weights a step reads + KV read or written) / "
        "bandwidth; compute floor: matmul + attention FLOPs / GEMM rate; floor/ms: the larger "
        "floor over the measured step",
        "one forward of a prebuilt batch, eager PyTorch (no CUDA graphs); decode: every request "
        "at the same context; prefill: one request from an empty cache"]
    return report


# ---- section: speculative verify cost -----------------------------------------------------------
def section_verify(ctx: Context) -> Report:
    import torch

    plan, accept = ctx.plan, ctx.args.accept
    report = Report(["shape", "forward", "ms", "x decode",
                     *[f"speed-up @{a:g}" for a in accept]])
    report.figures.update({"accept_lengths": accept, "shapes": []})
    gen = torch.Generator().manual_seed(ctx.seed)
    for shape in plan.bench_shapes:
        ctx.log(f"verify: building {shape.name}")
        model = build_bench_model(ctx, shape, 1,
                                  max(plan.verify_contexts) + max(plan.verify_rows) + 1)
        with kernel_backend("triton"):
            for length in plan.verify_contexts:
                report.figures["shapes"].append(
                    _verify_at(ctx, model, report, gen, shape, length))
        del model
        ctx.free()
    report.notes.append("speed-up = accept_len * t_decode / t_verify(rows), batch 1, bf16, "
                        "drafting not counted; '-': accept_len above the rows verified")
    return report


def _verify_at(ctx: Context, model: Model, report: Report, gen: Any, shape: Shape,
               length: int) -> dict[str, Any]:
    """A one-row decode and verifies of plan.verify_rows rows after `length` cached tokens:
    their rows in the report, and their figures."""
    import torch

    accept = ctx.args.accept
    t_decode = bench_model(ctx, model, model.batch([0], [length],
                                                   [_random_ids(gen, shape.vocab, 1)]))
    report.rows.append([shape.name, f"decode 1 row, ctx {length}", f"{t_decode:.3f}",
                        "1.00", *["" for _ in accept]])
    fig: dict[str, Any] = {"shape": shape.name, "context": length, "decode_ms": t_decode,
                           "verify": []}
    for n in ctx.plan.verify_rows:
        chain = torch.tril(torch.ones(1, n, n, dtype=torch.bool, device=ctx.device))
        fb = model.batch([0], [length], [_random_ids(gen, shape.vocab, n)], tree=chain)
        t = bench_model(ctx, model, fb)
        # a verify of n rows (the root and n - 1 drafts) yields at most n tokens
        ups = {a: a * t_decode / t for a in accept if a <= n}
        report.rows.append([shape.name, f"verify {n} rows", f"{t:.3f}",
                            f"{t / t_decode:.2f}",
                            *[f"{ups[a]:.2f}x" if a in ups else "-" for a in accept]])
        fig["verify"].append({"rows": n, "ms": t, "ratio": t / t_decode,
                              "speedup": {str(a): u for a, u in ups.items()}})
        ctx.log(f"{shape.name} ctx {length} verify {n}: {t:.3f} ms")
    return fig


# ---- section: CUDA graphs ----------------------------------------------------------------------
def section_graphs(ctx: Context) -> Report:
    """The decode forward and a speculative verify of GRAPH_VERIFY_NODES nodes replayed as
    CUDA graphs (`--enable-cuda-graph`, sglang_like.model_executor.cuda_graph) against the
    eager forward on the same batches: the capture of every bucket, the logits of each batch
    size, and ms per step both ways (the replay's input copies included)."""
    import torch

    from sglang_like.model_executor.cuda_graph import CudaGraphs, EagerGraphs

    plan = ctx.plan
    report = Report(["shape", "step", "eager ms", "graph ms", "speed-up", "max rel logit diff"])
    report.figures["rows"] = []
    gen = torch.Generator().manual_seed(ctx.seed)
    shape = plan.bench_shapes[0]
    biggest, length = max(plan.decode_batches), plan.decode_context
    nodes = GRAPH_VERIFY_NODES
    ctx.log(f"graphs: building {shape.name}")
    model = build_bench_model(ctx, shape, biggest, length + nodes + 4)
    with kernel_backend("triton"):
        t0 = time.perf_counter()
        model.runner.capture_graphs(biggest, EagerGraphs() if ctx.smoke else CudaGraphs(),
                                    verify_tokens=nodes)
        capture_s = time.perf_counter() - t0
        decode, verify = model.runner.graphs
        ctx.log(f"graphs: captured {decode.buckets} x (decode, verify) in {capture_s:.1f} s")
        # b - 1 requests pad to the bucket of b: both kinds measured
        sizes = sorted({r for b in plan.decode_batches for r in (b, max(1, b - 1))})
        chain = torch.ones(nodes, nodes, dtype=torch.bool, device=ctx.device).tril()
        steps = [(f"decode B{n}", n, None, 1) for n in sizes]
        steps += [(f"verify B{n} x {nodes}", n, chain.expand(n, nodes, nodes).contiguous(),
                   nodes) for n in sizes if n <= 8]
        for label, n, tree, per in steps:
            fb = model.batch(list(range(n)), [length - per] * n,
                             [_random_ids(gen, shape.vocab, per) for _ in range(n)], tree=tree)
            graphs = decode if tree is None else verify
            assert graphs.takes(fb)
            want, t_eager = ctx.run_and_time(lambda fb=fb, m=model: m.forward(fb))
            got, t_graph = ctx.run_and_time(lambda fb=fb, g=graphs: g.run(fb)[0])
            err = rel_err(got.float().cpu(), want.float().cpu())
            report.rows.append([shape.name, label, f"{t_eager:.3f}", f"{t_graph:.3f}",
                                f"{t_eager / t_graph:.2f}x", _sci(err)])
            report.figures["rows"].append({"shape": shape.name, "step": label, "batch": n,
                                           "nodes": per, "eager_ms": t_eager,
                                           "graph_ms": t_graph, "max_rel_logit_diff": err})
            if not err <= KERNEL_TOL:
                report.failures.append(f"{label}: logits {err:.1e} from eager")
    report.figures.update({"buckets": decode.buckets, "capture_s": capture_s})
    del model
    ctx.free()
    how = ("EagerGraphs (a replay runs the forward again; no GPU)" if ctx.smoke
           else "torch.cuda.CUDAGraph")
    report.notes += [f"bf16 after {length} tokens; buckets {decode.buckets} captured for "
                     f"decode and a {nodes}-node verify in {capture_s:.1f} s with {how}; "
                     "b - 1 requests replay the bucket of b with a padding request"]
    return report


def section_sampling(ctx: Context) -> Report:
    """The device sampler against the host sampler (scripts/gpu_check_sampling.py says what)."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check_sampling import run_sampling_checks

    report = Report(["check", "shape", "value", "note"])
    run_sampling_checks(ctx, report)
    return report


SECTIONS: dict[str, Callable[[Context], Report]] = {
    "kernels": section_kernels, "greedy": section_greedy, "throughput": section_throughput,
    "verify": section_verify, "sampling": section_sampling, "graphs": section_graphs,
}


def probe(ctx_args: argparse.Namespace) -> dict[str, Any]:
    """The machine, from inside a child (the parent never touches CUDA, so it can fork)."""
    import torch
    import triton

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "triton": triton.__version__, "cuda": torch.cuda.is_available()}
    if ctx_args.cpu_smoke:
        info["device"] = f"CPU ({platform.machine()}, {os.cpu_count()} cores), Triton interpreter"
    elif info["cuda"]:
        info["device"] = torch.cuda.get_device_name()
    return info


# ---- running each section in a child process ---------------------------------------------------
def run_in_child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Body of a child: the section's report (or probe's info) as a JSON-able dict."""
    inject = os.environ.get(INJECT_ENV, "")
    if inject in (name, f"{name}:hang"):
        if inject.endswith(":hang"):
            time.sleep(1e6)
        raise RuntimeError(f"failure injected by {INJECT_ENV}={inject}")
    if name == "probe":
        return {"ok": True, "info": probe(args)}
    report = SECTIONS[name](Context(args))
    return {"ok": not report.failures, "error": "; ".join(report.failures) or None,
            **dataclasses.asdict(report)}


def child_main(name: str, args: argparse.Namespace, result_path: str) -> int:
    try:
        result = run_in_child(name, args)
    except BaseException as exc:  # reported by the parent; the next section still runs
        hint = (" (a package the runtime imports; the docstring, --help, says how to carry "
                "one to a machine without it)" if isinstance(exc, ModuleNotFoundError) else "")
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}{hint}",
                  "traceback": traceback.format_exc()[-4000:]}
    Path(result_path).write_text(json.dumps(result, default=str))
    return 0


def run_section(name: str, args: argparse.Namespace, limit: float) -> dict[str, Any]:
    """Run one section in a child under `limit` seconds; its result, or why there is none."""
    fd, result_path = tempfile.mkstemp(prefix=f"gpu_check_{name}_", suffix=".json")
    os.close(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.monotonic()
    if args.isolation == "fork":
        pid = os.fork()
        if pid == 0:  # the child: never returns into the parent's loop
            code = 1
            try:
                code = child_main(name, args, result_path)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

        def poll() -> int | None:
            done, status = os.waitpid(pid, os.WNOHANG)
            return os.waitstatus_to_exitcode(status) if done else None

        def kill() -> None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--child", name,
               "--child-result", result_path]
        proc = subprocess.Popen(cmd)

        def poll() -> int | None:
            return proc.poll()

        def kill() -> None:
            proc.kill()
            proc.wait()

    code = None
    while code is None:
        if time.monotonic() - t0 > limit:
            kill()
            break
        time.sleep(0.02)
        code = poll()
    seconds = time.monotonic() - t0
    try:
        text = Path(result_path).read_text()
    finally:
        os.unlink(result_path)
    if code is None:
        result = {"ok": False, "error": f"ran past its time limit of {limit:.0f} s (killed)"}
    elif not text:
        result = {"ok": False, "error": f"the child process ended with status {code} and "
                                        "no result (a crash?)"}
    else:
        result = json.loads(text)
    return {"name": name, "ok": bool(result.pop("ok")), "seconds": round(seconds, 2),
            "limit_s": limit, **result}


def print_table(result: dict[str, Any], smoke: bool) -> None:
    status = "ok" if result["ok"] else "FAILED"
    when = " (--cpu-smoke: CPU, Triton interpreter, tiny shapes; timings meaningless)" \
        if smoke else ""
    print(f"\n== {result['name']}: {status} in {result['seconds']:.1f} s "
          f"(limit {result['limit_s']:.0f} s){when}")
    columns, rows = result.get("columns"), result.get("rows") or []
    if columns:
        table = [columns, *rows]
        widths = [max(len(str(r[i])) for r in table) for i in range(len(columns))]
        for r in table:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for note in result.get("notes") or []:
        print(f"  {note}")
    if not result["ok"]:
        print(f"  error: {result.get('error')}")
        if result.get("traceback"):
            print("  " + result["traceback"].rstrip().replace("\n", "\n  "))
    sys.stdout.flush()


def preimport() -> None:
    """Before forking: children start with these loaded. Touches no CUDA (a forked child could
    not initialize it); an import error shows up in the children that need the module."""
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401
        import triton  # noqa: F401

        import sglang_like_kernels  # noqa: F401
        from sglang_like_kernels import kv_quant, reference, triton_ops  # noqa: F401
    with contextlib.suppress(ImportError):
        import sglang_like.model_loader.loaded  # noqa: F401
        import sglang_like.model_runner  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_environment(args.cpu_smoke)
    if args.child is not None:  # a spawned child
        return child_main(args.child, args, args.child_result)
    limits = LIMITS_SMOKE if args.cpu_smoke else LIMITS_CUDA
    limits = {k: v * args.time_scale for k, v in limits.items()} | args.limits
    if args.isolation == "fork":
        preimport()
    t0 = time.monotonic()
    info = run_section("probe", args, limits["probe"])
    if not info["ok"]:
        print(f"gpu_check: could not read the machine: {info.get('error')}", file=sys.stderr)
        print(info.get("traceback", ""), file=sys.stderr)
        return 2
    machine = info["info"]
    if not args.cpu_smoke and not machine["cuda"]:
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
              "run with --cpu-smoke to check every section on CPU", file=sys.stderr)
        return 2
    print(f"device: {machine['device']}; python {machine['python']}, torch {machine['torch']}, "
          f"triton {machine['triton']}")
    results = []
    for name in args.section_list:
        result = run_section(name, args, limits[name])
        print_table(result, args.cpu_smoke)
        results.append(result)
    passed = sum(r["ok"] for r in results)
    summary = f"{passed}/{len(results)} sections ok"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "mode": "cpu-smoke" if args.cpu_smoke else "cuda", "machine": machine,
        "accept_lengths": args.accept, "seconds": round(time.monotonic() - t0, 2),
        "sections": results, "summary": summary,
    }, indent=1, default=str) + "\n")  # fmt: skip
    print(f"\nresults: {out}; total {time.monotonic() - t0:.0f} s")
    print(summary)
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
