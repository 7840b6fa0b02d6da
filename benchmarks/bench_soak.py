"""Soak: a real server under a hostile mix for a while, with faults injected; does it hold?

    python -m benchmarks.bench_soak                      # 15 minutes, the default model
    python -m benchmarks.bench_soak --duration-s 120     # the CI version

Starts `python -m sglang_like.launch_server` on loopback with SGLANG_LIKE_FAULT_INJECT set
(a low rate by default) and drives it with `soak_load.LoadMix`: plain, constrained, n=2 and
OpenAI requests, streams whose clients vanish at random, aborts by rid, oversized prompts,
hostile bodies, and once a burst of 10x the queue limit (429s expected). Reports requests
served, status counts, p50/p99 latency per minute (table and PNG), the server's RSS after
warm-up and at the end, and the KV pool once idle. Exits 1 when a target is missed: a 5xx
(other than the OpenAI API's answer to an injected fault), a request with no answer, a pool
not clean at the end, an unhealthy server, a burst with no 429, or RSS growth of
--max-rss-growth or more. The KV pool is reserved up front but its pages are committed as
slots are first written, so RSS also grows while the radix cache fills the pool: that part
(slots first touched x bytes per slot, from /get_server_info) is reported and not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import httpx

from benchmarks.common import (
    RESULTS_DIR,
    free_port,
    launch_server_cmd,
    percentile,
    start_server,
    stop_server,
)
from benchmarks.soak_load import LoadMix, Record, fault_numbers
from sglang_like.utils.fault_injection import ENV_VAR

DEFAULT_FAULTS = "forward=0.005,sample=0.002,grammar=0.005,seed=1"


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_soak_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """Our server with the soak's limits and SGLANG_LIKE_FAULT_INJECT set: (process, URL)."""
    port = args.port or free_port()
    cmd = launch_server_cmd(port, "--context-length", str(args.context_length),
                            "--max-running-requests", str(args.max_running_requests),
                            "--max-queued-requests", str(args.max_queued_requests),
                            *args.server_arg, log_level="error")
    return start_server(cmd, port, env={**os.environ, ENV_VAR: args.faults})


async def _wait_idle(url: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as c:
        while True:
            info = (await c.get(url + "/get_server_info")).json()
            if (info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0
                    and info["kv_pool"]["used_slots"] == 0) or time.monotonic() > deadline:
                return info
            await asyncio.sleep(0.2)


async def _soak(args: argparse.Namespace, url: str, proc: subprocess.Popen | None) -> dict:
    from tqdm import tqdm

    mix = LoadMix(url, args.context_length, seed=args.seed, deadline_s=args.request_deadline_s)
    try:
        # warm-up: the same mix and one burst, so that caches, compiled grammars and the
        # allocator's high-water mark are in place before the RSS that counts is read
        await asyncio.gather(mix.run_for(args.warmup_s, args.concurrency),
                             mix.burst(10 * args.max_queued_requests))
        warm = len(mix.records)
        info_start = await _wait_idle(url, 60)
        rss_start = _rss_mb(proc.pid) if proc else None
        t_start = time.monotonic()
        burst_at = args.duration_s / 3
        burst: list[Record] = []
        bar = tqdm(total=int(args.duration_s), desc="soak", unit="s", disable=args.no_progress)

        rss_samples: list[tuple[float, float]] = []

        async def ticker() -> None:
            while (elapsed := time.monotonic() - t_start) < args.duration_s:
                if proc is not None:
                    rss_samples.append((elapsed, _rss_mb(proc.pid)))
                bar.n = int(elapsed)
                bar.set_postfix(requests=len(mix.records) - warm, refresh=False)
                bar.refresh()
                await asyncio.sleep(1)

        async def burster() -> None:
            await asyncio.sleep(burst_at)
            burst.extend(await mix.burst(10 * args.max_queued_requests))

        await asyncio.gather(mix.run_for(args.duration_s, args.concurrency), ticker(),
                             burster())
        bar.close()
        info = await _wait_idle(url, 60)
        rss_end = _rss_mb(proc.pid) if proc else None
        async with httpx.AsyncClient(timeout=30) as c:
            health = (await c.get(url + "/health")).status_code
            fresh = (await c.post(url + "/generate", json={
                "text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 4}}))
        records = mix.records[warm:]
        for r in records:
            r.start -= t_start - mix._t0
    finally:
        await mix.aclose()
    summary = _summarize(args, records, burst, info_start, info, rss_start, rss_end, health,
                         fresh.status_code, mix)
    for b in summary["latency_per_bucket"]:  # the server's RSS at the end of each bucket
        inside = [mb for t, mb in rss_samples if t < b["start_s"] + args.bucket_s]
        b["rss_mb"] = inside[-1] if inside else None
    return summary


def _summarize(args: argparse.Namespace, records: list[Record], burst: list[Record],
               info_start: dict, info: dict, rss_start: float | None, rss_end: float | None,
               health: int, fresh_status: int, mix: LoadMix) -> dict[str, Any]:
    status = Counter(r.status for r in records)
    buckets: dict[int, list[float]] = {}
    for r in records:
        if r.status == 200 and r.finish not in (None, "dropped", "abort"):
            buckets.setdefault(int(r.start // args.bucket_s), []).append(r.latency)
    per_bucket = [{"bucket": b, "start_s": b * args.bucket_s, "num": len(v),
                   "p50_ms": 1000 * percentile(v, 50), "p99_ms": 1000 * percentile(v, 99)}
                  for b, v in sorted(buckets.items())]
    faults = info.get("injected_faults") or {}
    pool = info["kv_pool"]
    messages = [r.message or "" for r in mix.records]
    seen = set().union(*(fault_numbers(m) for m in messages))
    growth = (rss_end - rss_start) / rss_start if rss_start else None
    # The KV pool is reserved but committed lazily: pages of slots the radix cache takes for
    # the first time are not a leak (they stop once the cache fills the pool and evicts).
    new_slots = pool.get("touched_slots", 0) - info_start["kv_pool"].get("touched_slots", 0)
    kv_mb = new_slots * pool.get("bytes_per_slot", 0) / 2**20
    net_growth = (rss_end - kv_mb - rss_start) / rss_start if rss_start else None
    summary = {
        "duration_s": args.duration_s, "num_requests": len(records),
        "served_ok": sum(1 for r in records if r.status == 200 and r.finish != "abort"),
        "status_counts": {str(k): v for k, v in sorted(status.items())},
        "num_4xx": sum(v for k, v in status.items() if 400 <= k < 500 and k != 429),
        "num_429": status.get(429, 0),
        # 5xx that are not an injected fault's answer (those are counted with the aborts)
        "num_5xx": sum(1 for r in records if r.status >= 500 and not r.is_injected_fault),
        "num_no_answer": status.get(0, 0),
        "num_connection_retries": sum(r.retries for r in records),
        "no_answer_examples": [r.message for r in records if r.status == 0][:5],
        "num_5xx_examples": [f"{r.action}: {r.message}" for r in records
                             if r.status >= 500 and not r.is_injected_fault][:5],
        "num_aborted": sum(1 for r in records if r.finish == "abort" or r.is_internal_abort),
        "num_internal_error_aborts": sum(1 for r in records if r.is_internal_abort),
        "num_dropped_streams": sum(1 for r in records if r.finish == "dropped"),
        "burst": {"size": len(burst), "num_429": sum(1 for r in burst if r.status == 429),
                  "num_200": sum(1 for r in burst if r.status == 200)},
        "by_action": dict(Counter(r.action for r in records)),
        "latency_per_bucket": per_bucket, "bucket_s": args.bucket_s,
        "injected_faults": faults,
        "faults_reaching_a_caller": len(seen),
        "rss_start_mb": rss_start, "rss_end_mb": rss_end, "rss_growth": growth,
        "kv_slots_first_touched": new_slots, "kv_mb_first_touched": kv_mb,
        "rss_growth_net_of_kv_cache": net_growth,
        "pool_end": pool, "pool_clean": pool["used_slots"] == 0
        and pool["free_slots"] + pool["cached_slots"] == pool["total_slots"]
        and info["num_running_reqs"] == 0,
        "health_end": health, "fresh_request_status": fresh_status,
    }
    failures = []
    if summary["num_5xx"]:
        failures.append(f"{summary['num_5xx']} responses were 5xx")
    if summary["num_no_answer"]:
        failures.append(f"{summary['num_no_answer']} requests got no answer")
    # (not a failure here: a fault can hit only streams whose clients have already left;
    # the storm test, where every client listens, asserts that each one reaches a caller)
    if not summary["pool_clean"]:
        failures.append(f"the pool is not clean at the end: {pool}")
    if health != 200 or fresh_status != 200:
        failures.append(f"after the soak: /health {health}, a fresh request {fresh_status}")
    if net_growth is not None and net_growth >= args.max_rss_growth:
        failures.append(f"RSS grew {net_growth:.1%} beyond the KV pages the cache took "
                        f"(limit {args.max_rss_growth:.0%})")
    if not summary["burst"]["num_429"]:
        failures.append("the burst of 10x the queue limit got no 429")
    summary["failures"] = failures
    return summary


def format_table(s: dict[str, Any]) -> str:
    lines = [
        f"== soak: {s['num_requests']} requests in {s['duration_s']:.0f} s, "
        f"{s['served_ok']} served ==",
        f"statuses {s['status_counts']}  (4xx {s['num_4xx']}, 429 {s['num_429']}, "
        f"5xx {s['num_5xx']}, no answer {s['num_no_answer']}; connection resets retried "
        f"{s['num_connection_retries']})",
        f"aborted {s['num_aborted']} (internal error {s['num_internal_error_aborts']}), "
        f"dropped streams {s['num_dropped_streams']}",
        f"burst of {s['burst']['size']}: {s['burst']['num_429']} x 429, "
        f"{s['burst']['num_200']} x 200",
        f"faults injected {s['injected_faults'] or 'none'}; reached a caller: "
        f"{s['faults_reaching_a_caller']}",
        f"{'minute' if s['bucket_s'] == 60 else 'bucket':<8}{'start s':>9}{'n':>7}"
        f"{'p50 ms':>10}{'p99 ms':>10}{'RSS MB':>9}",
    ]
    for b in s["latency_per_bucket"]:
        rss = f"{b['rss_mb']:>9.0f}" if b.get("rss_mb") else f"{'-':>9}"
        lines.append(f"{b['bucket']:<8}{b['start_s']:>9.0f}{b['num']:>7}{b['p50_ms']:>10.0f}"
                     f"{b['p99_ms']:>10.0f}{rss}")
    if s["rss_start_mb"] is not None:
        net, kv_mb = s["rss_growth_net_of_kv_cache"], s["kv_mb_first_touched"]
        lines.append(f"RSS {s['rss_start_mb']:.0f} MB after warm-up -> {s['rss_end_mb']:.0f} MB "
                     f"at the end ({s['rss_growth']:+.1%}); of that, {kv_mb:.0f} MB are KV pool "
                     f"pages the radix cache took for the first time "
                     f"({s['kv_slots_first_touched']} slots): net {net:+.1%}")
    lines.append(f"pool at the end {s['pool_end']} -> {'clean' if s['pool_clean'] else 'NOT clean'}"
                 f"; /health {s['health_end']}; fresh request {s['fresh_request_status']}")
    lines.append("PASS" if not s["failures"] else "FAIL: " + "; ".join(s["failures"]))
    return "\n".join(lines)


def plot(s: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = s["latency_per_bucket"]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = [r["start_s"] / 60 for r in rows]
    ax.plot(xs, [r["p50_ms"] for r in rows], marker="o", label="p50")
    ax.plot(xs, [r["p99_ms"] for r in rows], marker="o", label="p99")
    ax.set_xlabel("minute of the soak")
    ax.set_ylabel("request latency (ms)")
    if any(r.get("rss_mb") for r in rows):
        rss_ax = ax.twinx()
        rss_ax.plot(xs, [r.get("rss_mb") for r in rows], color="gray", linestyle="--",
                    label="server RSS (MB)")
        rss_ax.set_ylabel("server RSS (MB)")
        rss_ax.legend(loc="upper right")
    ax.set_title(f"soak: {s['num_requests']} requests, {s['num_429']} x 429, "
                 f"{s['num_5xx']} x 5xx, RSS {s['rss_growth'] or 0:+.1%} "
                 f"({s['rss_growth_net_of_kv_cache'] or 0:+.1%} net of new KV cache pages)",
                 fontsize=10)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_soak",
                                description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=900.0)
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=12, help="clients looping actions")
    p.add_argument("--faults", default=DEFAULT_FAULTS, help=f"{ENV_VAR} of the server")
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--max-queued-requests", type=int, default=32)
    p.add_argument("--request-deadline-s", type=float, default=120.0)
    p.add_argument("--bucket-s", type=float, default=60.0, help="latency percentiles per bucket")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra launch_server argument (repeatable)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=RESULTS_DIR)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    proc, url = start_soak_server(args)
    try:
        summary = asyncio.run(_soak(args, url, proc))
    finally:
        stop_server(proc)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "soak.json"), "w") as f:
        json.dump(summary, f, indent=1)
    png = os.path.join(args.out_dir, "soak_latency.png")
    plot(summary, png)
    print(format_table(summary))
    print(f"wrote {args.out_dir}/soak.json and {png}")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
