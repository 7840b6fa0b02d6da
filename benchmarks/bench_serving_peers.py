"""Our server and llama.cpp's llama-server under the same load, one after the other, one run.

    python -m benchmarks.bench_serving_peers \\
        --llama-cpp-bin ~/.cache/peers/llama.cpp-0.3.36/build/bin      # from llama-cpp.sh

Each server is started on loopback, driven by `bench_serving`'s OpenAI client (/v1/completions,
streaming) with the shared-prefix workload at each concurrency, and stopped. Ours runs once per
`--quantizations` entry. Also measures our offline batch-1 TPOT for the same weights, so the
server's overhead over the engine shows (`--skip-offline` to leave it out): `--tpot-rounds`
rounds back to back while the server is up (a concurrency-1 run through the server, then the
same prompts decoded by an in-process engine), the median of their ratios printed, since this
machine's speed drifts between runs minutes apart by more than the overhead measured.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from benchmarks.bench_peers import CRASH_CODES
from sglang_like.bench_serving import build_parser, run_benchmark


class _ServerDied(RuntimeError):
    def __init__(self, returncode: int) -> None:
        super().__init__(f"server exited with {returncode} before it was healthy")
        self.returncode = returncode


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise _ServerDied(proc.returncode)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f}s")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _drive_one(url: str, args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    num = max(args.min_prompts, 2 * concurrency)
    bench_args = build_parser().parse_args([
        "--base-url", url, "--backend", "openai", "--workload", "shared-prefix",
        "--num-prompts", str(num), "--concurrency", str(concurrency),
        "--output-len", str(args.output_len), "--prefix-words", str(args.prefix_words),
        "--ignore-eos", "--disable-tqdm", "--seed", "0",
    ])
    # one warm-up request so neither side pays first-call costs inside the measurement
    warm = build_parser().parse_args(["--base-url", url, "--backend", "openai",
                                      "--num-prompts", "1", "--concurrency", "1",
                                      "--output-len", "4", "--disable-tqdm",
                                      "--workload", "random", "--seed", "99"])
    asyncio.run(run_benchmark(warm))
    return asyncio.run(run_benchmark(bench_args))


def _drive(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [_drive_one(url, args, concurrency) for concurrency in args.concurrency]


def _serve_and_drive(cmd: list[str], port: int, args: argparse.Namespace,
                     also: Callable[[str], Any] | None = None) -> tuple[list[dict], Any]:
    """(the concurrency runs, what `also(url)` returned, called while the server is up)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, 300)
        return _drive(url, args), (also(url) if also is not None else None)
    finally:
        _stop(proc)


def _ours(quantization: str, stream_interval: int, port: int, args: argparse.Namespace
          ) -> tuple[list[dict[str, Any]], list[tuple[float, float]]]:
    """(the concurrency runs, [(server TPOT p50, offline TPOT) ms per round])."""
    cmd = [sys.executable, "-m", "sglang_like.launch_server", "--port", str(port),
           "--quantization", quantization, "--log-level", "warning",
           "--stream-interval", str(stream_interval)]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    rounds = None if args.skip_offline else (
        lambda url: _interleaved_tpot(url, quantization, args))
    results, pairs = _serve_and_drive(cmd, port, args, rounds)
    return results, pairs or []


def _interleaved_tpot(url: str, quantization: str, args: argparse.Namespace
                      ) -> list[tuple[float, float]]:
    """Batch-1 TPOT through the server and offline, `args.tpot_rounds` rounds back to back
    (the server idles while the in-process engine runs, and the other way round)."""
    from sglang_like.engine import Engine

    engine = Engine(model_path=args.model_path, quantization=quantization, engine_in_process=True)
    try:
        engine.generate("Warm up.", {"max_new_tokens": 8})
        pairs = []
        for _ in range(args.tpot_rounds):
            served = _drive_one(url, args, 1)["tpot_p50_ms"]
            pairs.append((served, offline_tpot_ms(engine, args)))
        return pairs
    finally:
        engine.shutdown()


def _llama(port: int, args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool]:
    """(its results, whether it ran with weight repacking off)."""
    from sglang_like.model_loader import default_model_path

    binary = os.path.join(os.path.expanduser(args.llama_cpp_bin), "llama-server")
    slots = max(args.concurrency)
    # as its users run it for concurrent clients: one slot per client, each with room for the
    # shared prompt and the answer; its own defaults otherwise (prompt cache on)
    cmd = [binary, "-m", args.model_path or default_model_path(), "--port", str(port),
           "-t", str(args.threads), "-np", str(slots), "-c", str(slots * 2048)]
    try:
        return _serve_and_drive(cmd, port, args)[0], False
    except _ServerDied as exc:
        if exc.returncode not in CRASH_CODES:
            raise
    # its AMX weight repacking dies on some CPUs (see bench_peers): as bench_offline does,
    # run it again with repacking off, and say so in the table
    return _serve_and_drive(cmd + ["--no-repack"], port, args)[0], True


def served_prompt(args: argparse.Namespace, i: int = 0) -> str:
    """The i-th prompt of the served shared-prefix workload (as `_drive` sends it)."""
    from sglang_like.bench_serving import make_workload

    conv = make_workload("shared-prefix", i + 1, 0, args.prefix_words, 1)[i]
    return conv.prefix + conv.turns[0]


def offline_tpot_ms(engine: Any, args: argparse.Namespace) -> float:
    """Batch-1 decode ms/token of an in-process engine on the served workload's own prompts
    (a ~900-token shared prefix: attention over it is part of every step), median of 3."""
    params = {"temperature": 0, "ignore_eos": True}
    per_token = []
    for i in range(3):
        prompt = served_prompt(args, i)
        engine.generate(prompt, {**params, "max_new_tokens": 1})  # cached, as served
        t0 = time.perf_counter()
        engine.generate(prompt, {**params, "max_new_tokens": 1})
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.generate(prompt, {**params, "max_new_tokens": args.output_len + 1})
        per_token.append((time.perf_counter() - t0 - first) / args.output_len)
    return 1e3 * sorted(per_token)[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                    help="folder with llama-server (omit to run ours only)")
    ap.add_argument("--quantizations", default="auto", help="comma list, e.g. auto,none")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 32])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefix-words", type=int, default=700,
                    help="shared system prompt length in words (~900 tokens at 700)")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=30871)
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--tpot-rounds", type=int, default=3,
                    help="server-then-offline batch-1 TPOT rounds (the median ratio printed)")
    ap.add_argument("--stream-intervals", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1], help="our server once per --stream-interval, e.g. 1,4")
    args = ap.parse_args(argv)

    rows: list[tuple[str, dict[str, Any]]] = []
    rounds: dict[str, list[tuple[float, float]]] = {}
    for quantization in args.quantizations.split(","):
        for interval in args.stream_intervals:
            name = quantization if interval == 1 else f"{quantization}, interval {interval}"
            results, rounds[name] = _ours(quantization, interval, args.port, args)
            rows.extend((f"ours ({name})", s) for s in results)
    if args.llama_cpp_bin:
        results, no_repack = _llama(args.port + 1, args)
        name = "llama-server --no-repack" if no_repack else "llama-server"
        rows.extend((name, s) for s in results)

    print(f"\nshared-prefix workload (~{args.prefix_words} words shared), {args.output_len} "
          "tokens each, OpenAI /v1/completions streaming, same client for every server")
    width = max(18, *(len(name) + 1 for name, _ in rows))
    print(f"{'server':<{width}}{'conc':>5}{'ok':>8}{'TTFT p50':>10}{'TPOT p50':>10}{'ITL p50':>9}"
          f"{'ITL p99':>9}{'out tok/s':>11}{'hit':>7}")
    for name, s in rows:
        ok = f"{s['num_ok']}/{s['num_requests']}"
        print(f"{name:<{width}}{s['concurrency']:>5}{ok:>8}{s['ttft_p50_ms']:>10.1f}"
              f"{s['tpot_p50_ms']:>10.1f}{s['itl_p50_ms']:>9.1f}{s['itl_p99_ms']:>9.1f}"
              f"{s['output_token_throughput']:>11.1f}{s['cache_hit_rate']:>7.0%}")
    for name, pairs in rounds.items():
        if not pairs:
            continue
        ratios = sorted(server / offline for server, offline in pairs)
        listed = ", ".join(f"{server:.1f} / {offline:.1f}" for server, offline in pairs)
        print(f"ours ({name}) batch-1 TPOT, server / offline ms, {len(pairs)} rounds "
              f"back to back: {listed}; median {ratios[len(ratios) // 2] - 1:+.0%}")


if __name__ == "__main__":
    main()
