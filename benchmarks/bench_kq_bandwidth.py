"""How close the GGUF-type kernels (kquants.c) come to memory bandwidth, per type and row
count: is a decode step of that type waiting on memory or on arithmetic?

For each type gguf-py can quantize (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1; the K types run the same
4/5/6/8-bit kinds but need llama-quantize to write), a random matrix of `--weights` weights
(default: four times this CPU's L3, so nothing is read from cache) is packed as the runtime
packs it and multiplied by M rows of activations (`kq_matmul`, torch's thread count). Printed:
ms per call, the weights' bytes read per second, and integer multiply-adds per second; beside
it, the machine's read bandwidth as torch reads a float32 buffer of the same size (sum).

    python -m benchmarks.bench_kq_bandwidth [--types Q8_0,Q5_0] [--rows 1,8,32]
        [--weights N] [--repeats 10] [--out bench_results/kq_bandwidth.json]

A type whose M = 1 row reads near the machine's bandwidth cannot decode a batch of 1 much
faster by a better kernel; its batch-32 GOPS is the arithmetic its vector instructions allow.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from benchmarks.common import RESULTS_DIR
from sglang_like.layers.quantization import gguf_native
from sglang_like.layers.quantization.gguf_blocks import GGUFBlockWeight
from sglang_like_kernels import cpu as native_cpu

TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1")
K = 4096  # columns (a multiple of 256: every kind's blocks)


def l3_bytes() -> int:
    """This CPU's last-level cache (32 MB where sysfs does not say)."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text[:-1]) << (20 if text.endswith("M") else 10)
    except (OSError, ValueError):
        return 32 << 20


def _median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second torch's sum reads a float32 buffer of `nbytes`."""
    buf = torch.rand(nbytes // 4)
    return nbytes / _median_s(lambda: buf.sum(), repeats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--weights", type=int, default=None,
                   help="weights in the matrix (default: 4 x L3 bytes at 8 bits a weight)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "kq_bandwidth.json"))
    args = p.parse_args(argv)
    if not native_cpu.available():
        raise SystemExit("the native CPU kernels are not built on this machine")
    weights = args.weights or 4 * l3_bytes()
    n = max(16, weights // K // 16 * 16)
    rows = [int(r) for r in args.rows.split(",")]
    threads = torch.get_num_threads()
    bandwidth = read_bandwidth(n * K, args.repeats)
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, K, generator=gen) * 0.02).numpy()
    results = []
    for qt in tqdm(args.types.split(","), desc="types"):
        blocks = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qt))
        kind, packed = gguf_native.pack(GGUFBlockWeight(qt, (n, K), np.asarray(blocks)))
        nbytes = packed.numel() * packed.element_size()
        for m in rows:
            x = torch.randn(m, K, generator=gen)
            s = _median_s(lambda x=x, w=packed, k=kind: native_cpu.kq_matmul(x, w, k, n),
                          args.repeats)
            results.append({"type": qt, "kind": kind, "rows": m, "ms": s * 1e3,
                            "weight_bytes": nbytes, "GBps": nbytes / s / 1e9,
                            "of_bandwidth": nbytes / s / bandwidth,
                            "GOPS": 2 * m * n * K / s / 1e9})
        del packed, blocks
    print(f"\n{n} x {K} matrix, {threads} threads, ISA {native_cpu.isa()}; read bandwidth "
          f"(torch sum of {n * K / 1e6:.0f} MB float32): {bandwidth / 1e9:.1f} GB/s")
    print(f"{'type':6s} {'kind':5s} {'rows':>4s} {'ms':>8s} {'GB/s':>7s} {'of bw':>6s} "
          f"{'GOPS':>7s}")
    for r in results:
        print(f"{r['type']:6s} {r['kind']:5s} {r['rows']:4d} {r['ms']:8.3f} {r['GBps']:7.1f} "
              f"{r['of_bandwidth']:6.2f} {r['GOPS']:7.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": threads, "isa": native_cpu.isa(), "rows_n": n,
                               "cols_k": K, "read_bandwidth_GBps": bandwidth / 1e9,
                               "results": results}, indent=2) + "\n")
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
