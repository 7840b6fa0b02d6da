"""The quantized KV cache (issue #51) on the default model: decode speed, capacity and accuracy
of each `--kv-cache-dtype` against the bf16 pool, beside llama.cpp's q8_0 KV.

    nice -n -15 python -m benchmarks.bench_kv_dtype \\
        --llama-cpp-bin ~/.cache/peers/llama.cpp-0.3.36/build/bin

Per pool dtype, each in a fresh process (`--worker`):

- batch-1 decode tokens/s after a `--depth`-token context (4,096), and batch `--batch`
  (32) decode tokens/s with `--batch-context`-token contexts (1,024; distinct prompts, so
  no request shares a cached prefix): the prompts are prefilled first (one token
  generated), then the same requests run again, a radix-cache hit whose forward is one new
  token a request followed by `--new-tokens` decode steps, which are timed;
- the pool's bytes per token (K and V, every layer, scales included) and tokens per GiB;
- the bytes a batch-1 step reads at that depth (the weights it multiplies, and K and V of
  every cached token) and their ratio to the bf16 pool's: the most a pool can gain over
  bf16 there where both steps are bound by memory bandwidth;
- teacher-forced top-1 agreement with the bf16 pool and perplexity, over the first
  `--accuracy-tokens` (3,000) tokens of a fixed English text (Python's own reference
  manual pages in `pydoc_data`), scored in one prefill through the pool: once as the model
  runs by default (int4 weights, bf16 activations), and once with float32 activations
  (`--dtype float32`), where the pool is the only difference between two runs; a float32
  pool's agreement there is the measure's floor (near-ties the bf16 pool's own rounding
  flips).

`--rounds N` repeats the speed figures N times, the dtypes alternating, and keeps each one's
best (the machine moves by 10-20% between runs).

llama.cpp (`llama-bench -d` and `llama-batched-bench`, `-fa on`, f16 and `-ctk q8_0 -ctv q8_0`
KV, 2 threads) on the same GGUF; its weight repacking off only where its default run crashes
on this CPU, as benchmarks/common.py does. Writes bench_results/kv_dtype.json and a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

from tqdm import tqdm

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "bench_results")
BASE = "auto"  # the bf16 pool every figure is compared with
ACCURACY_PAGES = ["for", "while", "if", "try", "with", "function", "class", "assignment",
                  "import", "lambda", "yield", "raise", "return", "global", "nonlocal", "assert"]


def accuracy_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in ACCURACY_PAGES)


def _filler(engine: Any, n: int, tag: str) -> list[int]:
    words = " ".join(["the quick brown fox jumps over the lazy dog"] * (n // 4 + 8))
    return engine.tokenizer.encode(f"{tag} {words}")[:n]


def _timed_decode(engine: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of `prompts`, their prefill done beforehand (see the module doc)."""
    params = {"temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts,
                           sampling_params={**params, "max_new_tokens": new_tokens + 1})
    seconds = time.perf_counter() - t0
    hits = [o["meta_info"]["cached_tokens"] for o in outs]
    if min(hits) < len(prompts[0]) - 1:
        raise RuntimeError(f"the timed run re-prefilled its prompts (cached {min(hits)})")
    return len(prompts) * new_tokens / seconds


def _accuracy(engine: Any, n: int) -> dict[str, Any]:
    """teacher-forced top-1 predictions and perplexity over the first n tokens of the text"""
    ids = engine.tokenizer.encode(accuracy_text())[:n]
    engine.flush_cache()
    meta = engine.generate(input_ids=[ids], sampling_params={"max_new_tokens": 0},
                           return_logprob=True, logprob_start_len=0,
                           top_logprobs_num=1)[0]["meta_info"]
    lps = [e[0] for e in meta["input_token_logprobs"][1:]]
    return {"top1": [t[0][1] for t in meta["input_top_logprobs"][1:]],
            "perplexity": math.exp(-sum(lps) / len(lps)), "accuracy_tokens": len(ids)}


def accuracy_worker(kv: str, args: argparse.Namespace) -> dict[str, Any]:
    """the accuracy figures with float32 activations (the pool the only difference)"""
    from sglang_like.engine import Engine

    engine = Engine(kv_cache_dtype=kv, dtype="float32", engine_in_process=True,
                    log_level="warning", max_total_tokens=args.accuracy_tokens + 512)
    out = {"kv_cache_dtype": kv, **_accuracy(engine, args.accuracy_tokens)}
    engine.shutdown()
    return out


def worker(kv: str, args: argparse.Namespace) -> dict[str, Any]:
    from sglang_like.engine import Engine

    engine = Engine(kv_cache_dtype=kv, engine_in_process=True, log_level="warning",
                    max_total_tokens=args.batch * (args.batch_context + args.new_tokens + 8)
                    + args.depth + 512)
    engine.generate("Warm up.", {"max_new_tokens": 8})
    pool = engine.runner.kv_pool
    out: dict[str, Any] = {
        "kv_cache_dtype": kv, "pool_dtype": engine.server_args.kv_cache_dtype,
        "bytes_per_token": pool.bytes_per_slot,
        "tokens_per_gib": 2**30 / pool.bytes_per_slot,
        "native_decode": bool(engine.runner.model.native_decode),
        "weight_bytes_per_step": engine.runner.model.decode_bytes(),
    }
    out[f"b1_d{args.depth}_tok_s"] = _timed_decode(
        engine, [_filler(engine, args.depth, "Context 0.")], args.new_tokens)
    prompts = [_filler(engine, args.batch_context, f"Request {i}.") for i in range(args.batch)]
    out[f"b{args.batch}_c{args.batch_context}_tok_s"] = _timed_decode(engine, prompts,
                                                                     args.new_tokens)
    if not args.no_accuracy:
        out.update(_accuracy(engine, args.accuracy_tokens))
    engine.shutdown()
    return out


def _run_worker(kv: str, args: argparse.Namespace, mode: str = "--worker",
                extra: tuple[str, ...] = ()) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_kv_dtype", mode, kv, *extra,
           f"--depth={args.depth}", f"--batch={args.batch}",
           f"--batch-context={args.batch_context}", f"--new-tokens={args.new_tokens}",
           f"--accuracy-tokens={args.accuracy_tokens}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{kv} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peer(args: argparse.Namespace) -> list[dict[str, Any]]:
    """llama.cpp's batch-1 decode after the depth and batched decode, f16 and q8_0 KV."""
    from benchmarks.common import _bench_rows, _run_tool_or_without_repack, llama_binary
    from sglang_like.model_loader import default_model_path

    model = default_model_path()
    rows = []
    for name, kv in (("llama.cpp f16 KV", ["-ctk", "f16", "-ctv", "f16"]),
                     ("llama.cpp q8_0 KV", ["-ctk", "q8_0", "-ctv", "q8_0"])):
        row: dict[str, Any] = {"kv_cache_dtype": name, "paths": {}}
        cmd = [llama_binary(args.llama_cpp_bin, "llama-bench"), "-m", model, "-t", "2",
               "-p", "0", "-n", str(args.new_tokens), "-d", str(args.depth), "-r", "2",
               "-fa", "1", *kv, "-o", "json"]
        run = _run_tool_or_without_repack(cmd, ["--repack", "0"], 1800)
        for r in _bench_rows(run):
            if r.get("n_gen", 0) > 0:
                row[f"b1_d{args.depth}_tok_s"] = float(r["avg_ts"])
        row["paths"]["b1"] = run.path
        if not args.skip_peer_batch:
            cmd = [llama_binary(args.llama_cpp_bin, "llama-batched-bench"), "-m", model,
                   "-t", "2", "-c", str(args.batch * (args.batch_context + args.new_tokens)
                                        + 256),
                   "-npp", str(args.batch_context), "-ntg", str(args.new_tokens),
                   "-npl", str(args.batch), "-fa", "on", *kv, "--output-format", "jsonl"]
            run = _run_tool_or_without_repack(cmd, ["--no-repack"], 3600)
            for line in run.out.splitlines():
                if line.strip().startswith("{"):
                    r = json.loads(line)
                    if int(r.get("pl", -1)) == args.batch and "speed_tg" in r:
                        row[f"b{args.batch}_c{args.batch_context}_tok_s"] = float(
                            r["speed_tg"])
            row["paths"]["batch"] = run.path
        rows.append(row)
    return rows


def _step_reads_mb(row: dict[str, Any], depth: int) -> float | None:
    """MB one batch-1 decode step reads after `depth` tokens: the weights it multiplies and
    the K and V of every cached token. Where both pools are bandwidth-bound, one's speed over
    the other's is at most the inverse ratio of these ("bound vs bf16")."""
    if "weight_bytes_per_step" not in row or "bytes_per_token" not in row:
        return None
    return (row["weight_bytes_per_step"] + row["bytes_per_token"] * depth) / 1e6


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    b1, bn = f"b1_d{args.depth}_tok_s", f"b{args.batch}_c{args.batch_context}_tok_s"
    base = next(r for r in rows if r["kv_cache_dtype"] == BASE)
    head = (f"| KV | pool | bytes/token | tokens/GiB | b1 @{args.depth} tok/s | vs bf16 | "
            f"b1 step reads MB | bound vs bf16 | "
            f"b{args.batch} x {args.batch_context} tok/s | vs bf16 | top-1 vs bf16 | "
            f"perplexity (vs bf16) | fp32 act.: top-1 vs bf16 | fp32 act.: perplexity |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    f32_base = base.get("fp32_activations", {}).get("perplexity")
    for r in rows:
        def cell(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]:.1f}" if key in r else "-"

        def ratio(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key] / base[key]:.2f}x" if key in r and key in base else "-"

        acc = (f"{r['agreement']:.2%}" if "agreement" in r else "-")
        ppl = (f"{r['perplexity']:.4f} ({r['perplexity'] / base['perplexity'] - 1:+.2%})"
               if "perplexity" in r else "-")
        size = f"{r['bytes_per_token']:,}" if "bytes_per_token" in r else "-"
        per_gib = f"{r['tokens_per_gib']:,.0f}" if "tokens_per_gib" in r else "-"
        reads, base_reads = _step_reads_mb(r, args.depth), _step_reads_mb(base, args.depth)
        bound = f"{base_reads / reads:.2f}x" if reads and base_reads else "-"
        reads_cell = f"{reads:.1f}" if reads else "-"
        f32 = r.get("fp32_activations", {})
        acc32 = f"{f32['agreement']:.2%}" if "agreement" in f32 else "-"
        ppl32 = (f"{f32['perplexity']:.4f} ({f32['perplexity'] / f32_base - 1:+.2%})"
                 if "perplexity" in f32 and f32_base else "-")
        lines.append(f"| {r['kv_cache_dtype']} | {r.get('pool_dtype', '-')} | {size} | "
                     f"{per_gib} | {cell(b1)} | {ratio(b1)} | {reads_cell} | {bound} | "
                     f"{cell(bn)} | {ratio(bn)} | "
                     f"{acc} | {ppl} | {acc32} | {ppl32} |")
    return "\n".join(lines)


def draw(rows: list[dict[str, Any]], args: argparse.Namespace, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b1, bn = f"b1_d{args.depth}_tok_s", f"b{args.batch}_c{args.batch_context}_tok_s"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], b1, f"batch 1 after {args.depth:,} tokens"),
                           (axes[1], bn, f"batch {args.batch}, {args.batch_context:,}-token "
                                         "contexts")):
        names = [r["kv_cache_dtype"] for r in rows if key in r]
        vals = [r[key] for r in rows if key in r]
        colors = ["tab:gray" if n.startswith("llama.cpp") else "tab:blue" for n in names]
        ax.barh(names, vals, color=colors)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.0f}", va="center")
        ax.set_title(f"decode tok/s, {title}")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--accuracy-worker")
    ap.add_argument("--no-accuracy", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kv-dtypes", default="auto,int8,fp8_e4m3,fp8_e5m2")
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batch-context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--accuracy-tokens", type=int, default=3000)
    ap.add_argument("--llama-cpp-bin", default="")
    ap.add_argument("--skip-peer-batch", action="store_true",
                    help="llama.cpp's batch-1 figure only (its batched prefill is long)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "kv_dtype.json"))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    if args.accuracy_worker:
        print(json.dumps(accuracy_worker(args.accuracy_worker, args)))
        return
    import torch

    kvs = [k for k in args.kv_dtypes.split(",") if k]
    if BASE not in kvs:
        kvs.insert(0, BASE)
    rows = []
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    speed_keys = (f"b1_d{args.depth}_tok_s", f"b{args.batch}_c{args.batch_context}_tok_s")

    def save_partial() -> None:  # what a run cut short still leaves
        with open(args.out + ".partial", "w") as f:
            json.dump(rows, f)

    for rnd in tqdm(range(args.rounds), desc="rounds"):
        for i, kv in enumerate(kvs):
            got = _run_worker(kv, args, extra=("--no-accuracy",) if rnd else ())
            if rnd == 0:
                rows.append({**got, "rounds": {k: [got[k]] for k in speed_keys}})
            else:
                for k in speed_keys:
                    rows[i]["rounds"][k].append(got[k])
                    rows[i][k] = max(rows[i][k], got[k])
            print(f"{kv} round {rnd + 1}: "
                  f"{json.dumps({k: v for k, v in got.items() if k != 'top1'})}",
                  file=sys.stderr, flush=True)
            save_partial()
    # float32 activations: the bf16 pool, the float32 pool (the floor), each quantized pool
    f32 = {kv: _run_worker(kv, args, "--accuracy-worker")
           for kv in ["bfloat16", "float32", *[k for k in kvs if k != BASE]]}
    f32_base = f32["bfloat16"]["top1"]
    for kv, r in f32.items():
        r["agreement"] = sum(a == b for a, b in zip(r.pop("top1"), f32_base, strict=True)
                             ) / len(f32_base)
        row = next((x for x in rows if x["kv_cache_dtype"] == (BASE if kv == "bfloat16"
                                                                  else kv)), None)
        if row is None:
            row = {"kv_cache_dtype": f"{kv} (fp32 activations only)"}
            rows.append(row)
        row["fp32_activations"] = r
    save_partial()
    base = rows[0]["top1"]
    for r in rows:
        if "top1" in r:
            top1 = r.pop("top1")
            r["agreement"] = sum(a == b for a, b in zip(top1, base, strict=True)) / len(base)
    if args.llama_cpp_bin:
        rows += peer(args)
    print(table(rows, args))
    meta = {"threads": torch.get_num_threads(), "depth": args.depth, "batch": args.batch,
            "batch_context": args.batch_context, "new_tokens": args.new_tokens,
            "accuracy_tokens": args.accuracy_tokens, "rounds": args.rounds,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip()}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    os.remove(args.out + ".partial")  # the whole run is in args.out now
    draw(rows, args, args.out.removesuffix(".json") + ".png")


if __name__ == "__main__":
    main()
