"""The serving shapes side by side, one run: the engine on a thread of the HTTP process (the
shape before the engine had a process of its own), the two-process server, and the real
sglang-router in front of two replicas.

    python -m sglang_like.bench_router                       # the in-process shape from this tree
    git worktree add /tmp/sgl-prev <commit-before>           # or: the commit before, as it was
    python -m sglang_like.bench_router --baseline-repo /tmp/sgl-prev

Each setup is started on loopback, driven by `bench_serving`'s OpenAI client (/v1/completions,
streaming) with the shared-prefix workload at each `--concurrency`, and stopped. Also printed:
the offline engine's batch-1 TPOT (the target for one stream through a server) and the router's
per-request overhead (median latency of one-token requests through the router minus straight
to one of its replicas, measured back to back).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from sglang_like.bench_serving_peers import _drive, _stop, _wait_healthy
from sglang_like.launch_router import free_port


def _server_cmd(port: int, args: argparse.Namespace, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "sglang_like.launch_server", "--port", str(port),
           "--log-level", "warning", *extra]
    return cmd + (["--model-path", args.model_path] if args.model_path else [])


def _run(name: str, cmd: list[str], url: str, args: argparse.Namespace,
         env: dict[str, str] | None = None, router: bool = False) -> list[tuple[str, Any]]:
    print(f"== {name}: {' '.join(cmd[1:4])} ...", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if router else subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if router else subprocess.DEVNULL,
                            text=True, env=env, start_new_session=True)
    try:
        workers = _wait_router(proc) if router else []
        _wait_healthy(url, proc, 300)
        rows: list[tuple[str, Any]] = [(name, s) for s in _drive(url, args)]
        if router:
            rows.append(("overhead", _router_overhead(url, workers[0], args.overhead_requests)))
        return rows
    finally:
        _stop(proc)


def _wait_router(proc: subprocess.Popen) -> list[str]:
    """launch_router's replica URLs, from the line it prints once the router serves."""
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"listening on \S+ in front of \d+ replica\(s\): (.+)$", line)
        if match:
            import threading

            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return match.group(1).split()
    raise RuntimeError(f"launch_router exited with {proc.wait()} before serving")


def _latencies(url: str, n: int) -> list[float]:
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    out = []
    with httpx.Client(timeout=60) as client:
        client.post(url + "/generate", json=body).raise_for_status()  # warm the connection
        for _ in range(n):
            t0 = time.perf_counter()
            client.post(url + "/generate", json=body).raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


def _router_overhead(router_url: str, worker_url: str, n: int) -> dict[str, float]:
    """Median e2e latency of one-token requests: through the router and straight to a worker,
    alternated in rounds so both see the same machine."""
    via, direct = [], []
    for _ in range(4):
        via += _latencies(router_url, n // 4)
        direct += _latencies(worker_url, n // 4)
    return {"router_ms": statistics.median(via) * 1e3, "direct_ms": statistics.median(direct) * 1e3}


def _offline_tpot_ms(args: argparse.Namespace) -> float:
    from sglang_like.bench_offline import _decode_tok_s
    from sglang_like.engine import Engine

    engine = Engine(model_path=args.model_path, engine_in_process=True)
    try:
        engine.generate("Warm up.", {"max_new_tokens": 8})
        return 1e3 / _decode_tok_s(engine, 1, args.output_len)
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--baseline-repo", default=None,
                    help="a checkout of the commit before the engine process (its server is "
                         "the baseline); default: this tree with --engine-in-process")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 32])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefix-words", type=int, default=700,
                    help="shared system prompt length in words (~900 tokens at 700)")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--overhead-requests", type=int, default=40)
    ap.add_argument("--skip-router", action="store_true")
    args = ap.parse_args(argv)

    rows: list[tuple[str, Any]] = []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if args.baseline_repo:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(args.baseline_repo)}
        rows += _run("one process (before)", _server_cmd(port, args), url, args, env=env)
    else:
        rows += _run("one process", _server_cmd(port, args, "--engine-in-process"), url, args)
    rows += _run("two processes", _server_cmd(port, args), url, args)
    if not args.skip_router:
        cmd = [sys.executable, "-m", "sglang_like.launch_router", "--dp-size", "2",
               "--port", str(port), "--log-level", "warning"]
        cmd += ["--model-path", args.model_path] if args.model_path else []
        rows += _run("router + 2 replicas", cmd, url, args, router=True)
    offline = _offline_tpot_ms(args)

    print(f"\nshared-prefix workload (~{args.prefix_words} words shared), {args.output_len} "
          "tokens each, OpenAI /v1/completions streaming, same client for every setup")
    print(f"{'setup':<22}{'conc':>5}{'ok':>8}{'TTFT p50':>10}{'TPOT p50':>10}{'ITL p99':>9}"
          f"{'out tok/s':>11}{'hit':>7}")
    for name, s in rows:
        if name == "overhead":
            continue
        ok = f"{s['num_ok']}/{s['num_requests']}"
        print(f"{name:<22}{s['concurrency']:>5}{ok:>8}{s['ttft_p50_ms']:>10.1f}"
              f"{s['tpot_p50_ms']:>10.1f}{s['itl_p99_ms']:>9.1f}"
              f"{s['output_token_throughput']:>11.1f}{s['cache_hit_rate']:>7.0%}")
    print(f"offline engine (in-process) batch-1 TPOT: {offline:.1f} ms")
    for name, s in rows:
        if name != "overhead" and s["concurrency"] == 1:
            print(f"  {name}: one stream TPOT {s['tpot_p50_ms'] / offline - 1:+.0%} vs offline")
    for name, s in rows:
        if name == "overhead":
            print(f"router overhead per request: {s['router_ms'] - s['direct_ms']:+.1f} ms "
                  f"(one-token /generate: {s['router_ms']:.1f} ms via the router, "
                  f"{s['direct_ms']:.1f} ms direct, medians of {args.overhead_requests})")


if __name__ == "__main__":
    main()
