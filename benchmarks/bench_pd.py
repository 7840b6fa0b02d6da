"""Colocated vs prefill/decode disaggregated, on a mixed load, one run on the same machine.

    python -m benchmarks.bench_pd [--decoders 4 --long-prompts 6 --long-tokens 1200]

The load: `--decoders` streams generate `--decode-tokens` tokens each from short prompts,
while `--long-prompts` long prompts (about `--long-tokens` tokens, a few new tokens each)
arrive every `--interval` seconds. Measured per setup: the decode streams' inter-token
latency (gaps between streamed chunks; p50, p99, max) and their TTFT, the long prompts'
TTFT, and the wall time. Setups, one after the other on the same cores:

  colocated   one server (`launch_server`, all cores): long prefills share steps with the
              decodes (chunked prefill), so a decode step waits for a prompt chunk;
  PD pair     `launch_router --pd-disaggregation`: one prefill and one decode worker (the
              cores split between them) behind the real sglang-router; the prompt's KV moves
              layer by layer through the Mooncake Transfer Engine (TCP here).

Also printed: KV bytes moved per long prompt, the transfer engine's write rate (bytes over
the time spent inside its writes), and how much of each transfer was done before the
prompt's last layer was computed. A PNG plots every decode chunk's gap over time, with the
long prompts' arrivals marked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common import (
    RESULTS_DIR,
    free_port,
    launch_server_cmd,
    percentile,
    popen_router,
    router_worker_urls,
    running_server,
    server_url,
    stop_server,
)


def _long_prompt(i: int, num_tokens: int) -> str:
    # about 16 tokens a sentence; distinct from the first words so no prefix is shared
    words = " ".join(f"Record {i}-{k}: the river carries stone number {k} east."
                     for k in range(max(num_tokens // 16, 1)))
    return f"Long document {i}. {words}\nSummary:"


async def _stream(client: httpx.AsyncClient, url: str, text: str, max_new_tokens: int,
                  t_start: float) -> dict[str, Any]:
    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                "ignore_eos": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    error = None
    async with client.stream("POST", url + "/generate", json=body) as resp:
        if resp.status_code != 200:
            error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
        else:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                reason = chunk["meta_info"].get("finish_reason")
                if reason and reason.get("type") == "abort":
                    error = reason.get("message")
                stamps.append(time.perf_counter())
    return {"sent": t0 - t_start, "stamps": [s - t_start for s in stamps], "error": error,
            "ttft": (stamps[0] - t0) if stamps else None}


async def _drive(url: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.decoders + args.long_prompts + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # warm-up: one short and one long request (first-call costs off the measurement)
        await _stream(client, url, "Warm-up:", 4, time.perf_counter())
        await _stream(client, url, _long_prompt(999, args.long_tokens), 2, time.perf_counter())
        t_start = time.perf_counter()
        decoders = [asyncio.ensure_future(_stream(
            client, url, f"Stream {i}: count from one to a thousand, in words.",
            args.decode_tokens, t_start)) for i in range(args.decoders)]
        longs = []
        for i in range(args.long_prompts):
            await asyncio.sleep(args.interval if i else args.first_long_at)
            longs.append(asyncio.ensure_future(_stream(
                client, url, _long_prompt(i, args.long_tokens), args.long_new_tokens, t_start)))
        dec = await asyncio.gather(*decoders)
        lng = await asyncio.gather(*longs)
        return {"decoders": dec, "longs": lng, "wall": time.perf_counter() - t_start}


def _summary(name: str, run: dict[str, Any]) -> dict[str, Any]:
    gaps = [b - a for d in run["decoders"] for a, b in zip(d["stamps"], d["stamps"][1:],
                                                           strict=False)]
    errors = [r["error"] for r in run["decoders"] + run["longs"] if r["error"]]
    long_ttft = [r["ttft"] for r in run["longs"] if r["ttft"] is not None]
    return {
        "setup": name, "wall_s": run["wall"], "errors": len(errors),
        "itl_p50_ms": 1000 * percentile(gaps, 50), "itl_p99_ms": 1000 * percentile(gaps, 99),
        "itl_max_ms": 1000 * max(gaps, default=0.0),
        "decode_ttft_ms": 1000 * statistics.median(
            [d["ttft"] for d in run["decoders"] if d["ttft"] is not None] or [0.0]),
        "long_ttft_p50_ms": 1000 * percentile(long_ttft, 50),
        "long_ttft_max_ms": 1000 * max(long_ttft, default=0.0),
    }


def _colocated(args: argparse.Namespace, *extra: str) -> tuple[dict[str, Any], dict[str, Any]]:
    port = free_port()
    with running_server(launch_server_cmd(port, *args.server_args, *extra), port) as url:
        return asyncio.run(_drive(url, args)), {}


def _pd_pair(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_like.launch_router", "--pd-disaggregation",
           "--port", str(port), "--log-level", "warning", *args.server_args]
    proc = popen_router(cmd)
    try:
        urls = router_worker_urls(proc)
        run = asyncio.run(_drive(server_url(port), args))
        prefill = httpx.get(urls[0] + "/get_server_info", timeout=30).json()
        decode = httpx.get(urls[1] + "/get_server_info", timeout=30).json()
        return run, {"prefill": prefill["disaggregation"], "decode": decode}
    finally:
        stop_server(proc)


def _transfer_rows(stats: dict[str, Any], long_tokens_min: int) -> dict[str, Any]:
    recs = [r for r in stats["prefill"]["recent_transfers"] if r["tokens"] >= long_tokens_min]
    if not recs:
        return {}
    moved = [r["bytes"] for r in recs]
    secs = [r["write_seconds"] for r in recs]
    overlap = []
    for r in recs:
        last_compute = r["layer_computed"][-1]
        overlap.append(sum(s <= last_compute for s in r["layer_sent"]) / len(r["layer_sent"]))
    return {
        "transfers": len(recs), "tokens_per_request": statistics.median(r["tokens"] for r in recs),
        "mb_per_request": statistics.median(moved) / 1e6,
        "write_gb_s": sum(moved) / max(sum(secs), 1e-9) / 1e9,
        "layers_sent_before_last_computed": statistics.median(overlap),
        "decode_computed_prompt_tokens": stats["decode"]["num_computed_prompt_tokens"],
    }


def _plot(runs: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 3.2 * len(runs)), sharex=True)
    for ax, (name, run) in zip(axes, runs.items(), strict=True):
        for d in run["decoders"]:
            s = d["stamps"]
            ax.plot(s[1:], [1000 * (b - a) for a, b in zip(s, s[1:], strict=False)], ".",
                    ms=3)
        for r in run["longs"]:
            ax.axvline(r["sent"], color="grey", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_ylabel("decode chunk gap (ms)")
        ax.set_title(name)
    axes[-1].set_xlabel("seconds since the load began (dashed: a long prompt arrives)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_pd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=480)
    p.add_argument("--long-prompts", type=int, default=6)
    p.add_argument("--long-tokens", type=int, default=1200)
    p.add_argument("--long-new-tokens", type=int, default=8)
    p.add_argument("--first-long-at", type=float, default=1.0)
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--small-chunk", type=int, default=256,
                   help="also run the colocated server with this --chunked-prefill-size (the "
                        "knob a colocated deployment trades TTFT against ITL with); 0: skip")
    p.add_argument("--out-dir", default=RESULTS_DIR)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="options for every server (last on the line)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    stats: dict[str, Any] = {}
    setups = [("colocated (1 worker)", lambda a: _colocated(a))]
    if args.small_chunk:
        setups.append((f"colocated, --chunked-prefill-size {args.small_chunk}",
                       lambda a: _colocated(a, "--chunked-prefill-size", str(a.small_chunk))))
    setups.append(("PD pair (router + 1 prefill + 1 decode)", _pd_pair))
    for name, fn in tqdm(setups, desc="setups", unit="setup"):
        runs[name], extra = fn(args)
        if extra:
            stats = extra
    rows = [_summary(name, run) for name, run in runs.items()]
    cols = ["setup", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "decode_ttft_ms",
            "long_ttft_p50_ms", "long_ttft_max_ms", "wall_s", "errors"]
    print(f"\nmixed load: {args.decoders} streams x {args.decode_tokens} tokens, "
          f"{args.long_prompts} prompts of ~{args.long_tokens} tokens every {args.interval:g} s"
          f" ({os.cpu_count()} cores)")
    print(" | ".join(f"{c:>12}" if c != "setup" else f"{c:<44}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:<44}" if c == "setup" else
                         (f"{r[c]:>12.1f}" if isinstance(r[c], float) else f"{r[c]:>12}")
                         for c in cols))
    transfer = _transfer_rows(stats, args.long_tokens // 2) if stats else {}
    if transfer:
        print("\nKV transfer (long prompts, PD pair): " + ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in transfer.items()))
    png = os.path.join(args.out_dir, "bench_pd_itl.png")
    _plot(runs, png)
    with open(os.path.join(args.out_dir, "bench_pd.json"), "w") as f:
        json.dump({"rows": rows, "transfer": transfer, "args": vars(args)}, f, indent=1)
    print(f"wrote {png} and bench_pd.json in {args.out_dir}")


if __name__ == "__main__":
    main()
