"""The serving shapes side by side, one run: the engine on a thread of the HTTP process (the
shape before the engine had a process of its own), the two-process server, and the real
sglang-router in front of two replicas.

    python -m benchmarks.bench_router                       # the in-process shape from this tree
    git worktree add /tmp/sgl-prev <commit-before>           # or: the commit before, as it was
    python -m benchmarks.bench_router --baseline-repo /tmp/sgl-prev

Every setup is started on loopback at once and driven by `bench_serving`'s OpenAI client
(/v1/completions, streaming, the shared-prefix workload): concurrency 1 in `--rounds` rounds
that interleave the setups and the offline engine (this machine's speed drifts by more than the
differences measured), then concurrency 32 on each. Also printed:
the offline engine's batch-1 TPOT (the target for one stream through a server) and the router's
per-request overhead (median latency of one-token requests through the router minus straight
to one of its replicas, measured back to back), and one stream read by curl in each round: on
2 cores the Python client's own CPU per token slows the engine it shares them with, curl's
does not, so the two figures bracket what a user sees.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common import (
    add_served_workload_args,
    drive_served,
    free_port,
    launch_server_cmd,
    offline_tpot_ms,
    popen_router,
    router_worker_urls,
    served_prompt,
    server_url,
    stop_server,
    wait_healthy,
)


@dataclass
class Setup:
    name: str
    cmd: list[str]
    port: int
    env: dict[str, str] | None = None
    router: bool = False
    proc: subprocess.Popen | None = None
    workers: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return server_url(self.port)

    def start(self) -> None:
        if self.router:
            self.proc = popen_router(self.cmd, env=self.env)
        else:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)

    def wait(self) -> None:
        if self.router:
            self.workers = router_worker_urls(self.proc)
        wait_healthy(self.url, self.proc, 300)


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


def _curl_tpot_ms(url: str, num_tokens: int, prompt: str) -> float:
    """One greedy stream of `num_tokens` read by curl, a client that takes almost no CPU (on 2
    cores a Python client's own work per token slows the engine it shares them with): the
    time after the first byte over the tokens after the first."""
    body = json.dumps({"model": "default", "prompt": prompt,
                       "max_tokens": num_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    out = subprocess.run(
        ["curl", "-s", "-N", "-o", "/dev/null", "-w", "%{time_starttransfer} %{time_total}",
         "-H", "Content-Type: application/json", "-d", body, url + "/v1/completions"],
        capture_output=True, text=True, check=True).stdout.split()
    first, total = map(float, out)
    return (total - first) / (num_tokens - 1) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_router", description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--baseline-repo", default=None,
                    help="a checkout of the commit before the engine process (its server is "
                         "the baseline); default: this tree with --engine-in-process")
    ap.add_argument("--rounds", type=int, default=3,
                    help="concurrency-1 runs of every setup, interleaved (medians reported)")
    add_served_workload_args(ap)
    ap.add_argument("--high-concurrency", type=int, default=32)
    ap.add_argument("--overhead-requests", type=int, default=40)
    ap.add_argument("--skip-router", action="store_true")
    args = ap.parse_args(argv)

    from sglang_like.engine import Engine

    if args.baseline_repo:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(args.baseline_repo)}
        setups = [Setup("one process (before)", [], free_port(), env=env)]
    else:
        setups = [Setup("one process", [], free_port())]
    setups[0].cmd = launch_server_cmd(
        setups[0].port, *([] if args.baseline_repo else ["--engine-in-process"]),
        model_path=args.model_path)
    two = Setup("two processes", [], free_port())
    two.cmd = launch_server_cmd(two.port, model_path=args.model_path)
    setups.append(two)
    if not args.skip_router:
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_like.launch_router", "--dp-size", "2",
               "--port", str(port), "--log-level", "warning"]
        setups.append(Setup("router + 2 replicas",
                            cmd + (["--model-path", args.model_path] if args.model_path else []),
                            port, router=True))
    # Every setup is up at once (idle ones cost nothing) so that the rounds interleave them:
    # this machine's speed drifts by more than the differences being measured.
    for s in setups:
        s.start()
    offline_engine = Engine(model_path=args.model_path, engine_in_process=True)
    try:
        for s in setups:
            s.wait()
        offline_engine.generate("Warm up.", {"max_new_tokens": 8})
        c1: dict[str, list[dict[str, Any]]] = {s.name: [] for s in setups}
        curl: dict[str, list[float]] = {s.name: [] for s in setups}
        use_curl = shutil.which("curl") is not None
        offline: list[float] = []
        for _ in tqdm(range(args.rounds), desc="concurrency-1 rounds"):
            # on the served prompts: each decode step attends over their ~900-token prefix
            offline.append(offline_tpot_ms(offline_engine, args))
            for s in setups:
                c1[s.name].append(drive_served(s.url, args, 1))
                if use_curl:
                    curl[s.name].append(_curl_tpot_ms(s.url, 2 * args.output_len,
                                                      served_prompt(args)))
        offline_engine.shutdown()
        high = {s.name: drive_served(s.url, args, args.high_concurrency)
                for s in tqdm(setups, desc=f"concurrency {args.high_concurrency}")}
        overhead = None
        if not args.skip_router:
            overhead = _router_overhead(setups[-1].url, setups[-1].workers[0],
                                        args.overhead_requests)
    finally:
        offline_engine.shutdown()
        for s in setups:
            if s.proc is not None:
                stop_server(s.proc)
    _report(args, setups, c1, high, offline, overhead, curl)


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    row = dict(runs[0])
    for key in ("ttft_p50_ms", "tpot_p50_ms", "itl_p99_ms", "output_token_throughput"):
        row[key] = statistics.median(r[key] for r in runs)
    row["num_ok"] = sum(r["num_ok"] for r in runs)
    row["num_requests"] = sum(r["num_requests"] for r in runs)
    return row


def _report(args: argparse.Namespace, setups: list[Setup], c1: dict[str, list],
            high: dict[str, dict], offline: list[float], overhead: dict | None,
            curl: dict[str, list[float]]) -> None:
    print(f"\nshared-prefix workload (~{args.prefix_words} words shared), {args.output_len} "
          "tokens each, OpenAI /v1/completions streaming, same client for every setup; "
          f"concurrency 1: medians of {args.rounds} interleaved rounds")
    print(f"{'setup':<22}{'conc':>5}{'ok':>8}{'TTFT p50':>10}{'TPOT p50':>10}{'ITL p99':>9}"
          f"{'out tok/s':>11}{'hit':>7}")
    rows = [(s.name, _median_row(c1[s.name])) for s in setups]
    rows += [(s.name, high[s.name]) for s in setups]
    for name, s in rows:
        ok = f"{s['num_ok']}/{s['num_requests']}"
        print(f"{name:<22}{s['concurrency']:>5}{ok:>8}{s['ttft_p50_ms']:>10.1f}"
              f"{s['tpot_p50_ms']:>10.1f}{s['itl_p99_ms']:>9.1f}"
              f"{s['output_token_throughput']:>11.1f}{s['cache_hit_rate']:>7.0%}")
    base = statistics.median(offline)
    print(f"offline engine (in-process) batch-1 TPOT: {base:.1f} ms (rounds: "
          f"{', '.join(f'{x:.1f}' for x in offline)})")
    for s in setups:
        tpots = [r["tpot_p50_ms"] for r in c1[s.name]]
        print(f"  {s.name}: one stream TPOT {statistics.median(tpots) / base - 1:+.0%} vs "
              f"offline (rounds: {', '.join(f'{x:.1f}' for x in tpots)})")
    for s in setups:
        if curl[s.name]:
            print(f"  {s.name}: one stream read by curl, TPOT "
                  f"{statistics.median(curl[s.name]) / base - 1:+.0%} vs offline (rounds: "
                  f"{', '.join(f'{x:.1f}' for x in curl[s.name])})")
    first = high[setups[0].name]["output_token_throughput"]
    for s in setups[1:]:
        print(f"  {s.name}: concurrency-{args.high_concurrency} throughput "
              f"{high[s.name]['output_token_throughput'] / first:.2f}x {setups[0].name}")
    if overhead is not None:
        print(f"router overhead per request: {overhead['router_ms'] - overhead['direct_ms']:+.1f}"
              f" ms (one-token /generate: {overhead['router_ms']:.1f} ms via the router, "
              f"{overhead['direct_ms']:.1f} ms direct, medians of {args.overhead_requests})")


if __name__ == "__main__":
    main()
