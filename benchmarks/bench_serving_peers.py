"""Our server, llama.cpp's llama-server and vLLM-CPU under the same load, one after the other.

    python -m benchmarks.bench_serving_peers \\
        --llama-cpp-bin ~/.cache/peers/llama.cpp-0.3.36/build/bin \\
        --vllm-python ~/.cache/peers/vllm-venv/bin/python \\
        --vllm-model ~/.cache/peers/smollm2-135m-instruct-hf

(../shared/peers/llama-cpp.sh builds the first, ../shared/peers/vllm-cpu.sh prints the other
two.) vLLM runs as ../shared/peers/vllm-cpu.sh says its users run it on CPU: the default model as a
Hugging Face folder in bf16, both cores (OMP_NUM_THREADS), 4 GiB of KV cache, its defaults
otherwise (prefix caching on); its start-up (torch.compile) takes minutes and is not timed.

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
import os
from collections.abc import Callable
from typing import Any

from benchmarks.common import (
    CRASH_CODES,
    ServerDied,
    add_served_workload_args,
    drive_served,
    launch_server_cmd,
    llama_binary,
    offline_tpot_ms,
    running_server,
)


def _serve_and_drive(cmd: list[str], port: int, args: argparse.Namespace,
                     also: Callable[[str], Any] | None = None, **server: Any
                     ) -> tuple[list[dict], Any]:
    """(the concurrency runs, what `also(url)` returned, called while the server is up);
    `server`: running_server's env / timeout_s."""
    with running_server(cmd, port, **server) as url:
        runs = [drive_served(url, args, concurrency) for concurrency in args.concurrency]
        return runs, (also(url) if also is not None else None)


def _ours(quantization: str, stream_interval: int, port: int, args: argparse.Namespace
          ) -> tuple[list[dict[str, Any]], list[tuple[float, float]]]:
    """(the concurrency runs, [(server TPOT p50, offline TPOT) ms per round])."""
    cmd = launch_server_cmd(port, "--quantization", quantization,
                            "--stream-interval", str(stream_interval),
                            model_path=args.model_path)
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
            served = drive_served(url, args, 1)["tpot_p50_ms"]
            pairs.append((served, offline_tpot_ms(engine, args)))
        return pairs
    finally:
        engine.shutdown()


def _llama(port: int, args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool]:
    """(its results, whether it ran with weight repacking off)."""
    from sglang_like.model_loader import default_model_path

    binary = llama_binary(args.llama_cpp_bin, "llama-server")
    slots = max(args.concurrency)
    # as its users run it for concurrent clients: one slot per client, each with room for the
    # shared prompt and the answer; its own defaults otherwise (prompt cache on)
    cmd = [binary, "-m", args.model_path or default_model_path(), "--port", str(port),
           "-t", str(args.threads), "-np", str(slots), "-c", str(slots * 2048)]
    try:
        return _serve_and_drive(cmd, port, args)[0], False
    except ServerDied as exc:
        if exc.returncode not in CRASH_CODES:
            raise
    # its AMX weight repacking dies on some CPUs (see common.CRASH_CODES): as bench_offline does,
    # run it again with repacking off, and say so in the table
    return _serve_and_drive(cmd + ["--no-repack"], port, args)[0], True


def _vllm(port: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
           "--model", args.vllm_model, "--served-model-name", "default", "--dtype", "bfloat16",
           "--max-model-len", "4096", "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": "4",
           "HF_HUB_OFFLINE": "1"}
    return _serve_and_drive(cmd, port, args, env=env, timeout_s=900.0)[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_serving_peers", description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                    help="folder with llama-server (omit to run ours only)")
    ap.add_argument("--vllm-python", default=None,
                    help="the python of a venv with vllm-cpu (omit to leave vLLM out)")
    ap.add_argument("--vllm-model", default=None,
                    help="the default model as a Hugging Face folder, for vLLM")
    ap.add_argument("--quantizations", default="auto", help="comma list, e.g. auto,none")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 32])
    add_served_workload_args(ap)
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
    if args.vllm_python:
        if not args.vllm_model:
            raise SystemExit("--vllm-python needs --vllm-model (vllm-cpu.sh prints both)")
        rows.extend(("vLLM-CPU (bf16)", s) for s in _vllm(args.port + 2, args))

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
