"""What the benchmarks share: server processes (start, health, stop), the served
shared-prefix workload, decode-rate and timing helpers, percentiles, the speculative
workloads, and llama.cpp's bench tools as a peer."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any, NamedTuple

import httpx

from sglang_like.bench_serving import build_parser, percentile, run_benchmark
from sglang_like.launch_router import free_port

__all__ = [
    "CRASH_CODES", "DECODE_PROMPT", "REPO_ROOT", "RESULTS_DIR", "WORKLOADS", "ServerDied",
    "ToolRun", "add_served_workload_args", "best_of_s", "decode_tok_s", "drive_served",
    "free_port", "launch_server_cmd", "llama_batched_bench", "llama_bench", "llama_bench_depths",
    "llama_binary", "offline_tpot_ms", "percentile", "popen_router", "router_worker_urls",
    "running_server", "served_prompt", "server_url", "start_server", "stop_server",
    "stream_decode_seconds", "wait_healthy",
]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# results land in the repository's folder whatever the working directory
RESULTS_DIR = os.path.join(REPO_ROOT, "bench_results")


# ---- server processes ----------------------------------------------------------------------
def server_url(port: int) -> str:
    """The loopback URL of a server listening on `port`."""
    return f"http://127.0.0.1:{port}"


def launch_server_cmd(port: int, *extra: str, model_path: str | None = None,
                      log_level: str = "warning") -> list[str]:
    """The command line of our server on loopback `port`, `extra` options appended."""
    cmd = [sys.executable, "-m", "sglang_like.launch_server", "--port", str(port),
           "--log-level", log_level, *extra]
    return cmd + (["--model-path", model_path] if model_path else [])


class ServerDied(RuntimeError):
    """The server process exited before it answered /health."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"server exited with {returncode} before it was healthy")
        self.returncode = returncode


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    """Poll `url`/health until it answers 200; ServerDied if `proc` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerDied(proc.returncode)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f}s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server's graceful shutdown), SIGKILL after 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_server(cmd: list[str], port: int, *, env: dict[str, str] | None = None,
                 timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """Start `cmd` (a server on `port`, its output dropped) and wait until it is healthy;
    (the process, its URL). A server that does not come up is stopped."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = server_url(port)
    try:
        wait_healthy(url, proc, timeout_s)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url


@contextlib.contextmanager
def running_server(cmd: list[str], port: int, *, env: dict[str, str] | None = None,
                   timeout_s: float = 300.0) -> Iterator[str]:
    """`start_server` for the duration of a `with`; yields the URL."""
    proc, url = start_server(cmd, port, env=env, timeout_s=timeout_s)
    try:
        yield url
    finally:
        stop_server(proc)


def popen_router(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a `launch_router` command with its output piped, for `router_worker_urls`; in a
    session of its own, so that the signal `stop_server` sends reaches only the launcher,
    which stops its children itself."""
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _drain(stream: IO[str]) -> None:
    for _ in stream:
        pass


def router_worker_urls(proc: subprocess.Popen, timeout_s: float = 300.0) -> list[str]:
    """The worker URLs `launch_router` prints once its router serves (in PD mode: prefill
    then decode). Its later output is read and dropped on a thread: a full pipe would stall
    it."""
    out = proc.stdout
    assert out is not None
    deadline = time.monotonic() + timeout_s
    for line in out:
        if line.startswith("sglang_like: sglang-router"):
            threading.Thread(target=_drain, args=(out,), daemon=True).start()
            return line.rsplit(": ", 1)[1].split()
        if time.monotonic() > deadline:
            raise RuntimeError(f"launch_router did not serve within {timeout_s:.0f}s")
    raise RuntimeError(f"launch_router exited with {proc.wait()} before serving")


# ---- the served shared-prefix workload (bench_serving_peers, bench_router) -----------------
def add_served_workload_args(parser: argparse.ArgumentParser) -> None:
    """The options `drive_served`, `served_prompt` and `offline_tpot_ms` read."""
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefix-words", type=int, default=700,
                        help="shared system prompt length in words (~900 tokens at 700)")
    parser.add_argument("--min-prompts", type=int, default=8)


def drive_served(url: str, args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    """`bench_serving`'s OpenAI client (/v1/completions, streaming) on the shared-prefix
    workload at `concurrency` against the server at `url`: its summary dict."""
    num = max(args.min_prompts, 2 * concurrency)
    bench_args = build_parser().parse_args([
        "--base-url", url, "--backend", "openai", "--workload", "shared-prefix",
        "--num-prompts", str(num), "--concurrency", str(concurrency),
        "--output-len", str(args.output_len), "--prefix-words", str(args.prefix_words),
        "--ignore-eos", "--disable-tqdm", "--seed", "0",
    ])
    # one warm-up request so that no server pays first-call costs inside the measurement
    warm = build_parser().parse_args(["--base-url", url, "--backend", "openai",
                                      "--num-prompts", "1", "--concurrency", "1",
                                      "--output-len", "4", "--disable-tqdm",
                                      "--workload", "random", "--seed", "99"])
    asyncio.run(run_benchmark(warm))
    return asyncio.run(run_benchmark(bench_args))


def served_prompt(args: argparse.Namespace, i: int = 0) -> str:
    """The i-th prompt of the served shared-prefix workload (as `drive_served` sends it)."""
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


# ---- timing an engine ----------------------------------------------------------------------
DECODE_PROMPT = "Tell me a story about a robot who learns to paint."


def best_of_s(fn: Callable[[], Any], repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `fn`."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def decode_tok_s(engine: Any, batch: int, new_tokens: int) -> float:
    """Decode tokens/s of `batch` greedy streams: a full run less a prefill-only run (+1
    token), the radix cache emptied before each so that both prefill the same."""
    prompts = [f"{DECODE_PROMPT} Chapter {i}." for i in range(batch)]
    params = {"temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    t0 = time.perf_counter()
    engine.generate(prompts, {**params, "max_new_tokens": 1})
    prefill = time.perf_counter() - t0
    engine.flush_cache()
    t0 = time.perf_counter()
    engine.generate(prompts, {**params, "max_new_tokens": new_tokens + 1})
    total = time.perf_counter() - t0
    return batch * new_tokens / max(total - prefill, 1e-9)


def stream_decode_seconds(engine: Any, sampling_params: dict, **request: Any
                          ) -> tuple[dict[str, Any], float]:
    """One streamed request (`request`: prompt= or input_ids=): (its last chunk, the
    seconds after the chunk with its first token), so that the prefill is left out."""
    t0 = time.perf_counter()
    first = None
    last: dict[str, Any] = {}
    for chunk in engine.generate(sampling_params=sampling_params, stream=True, **request):
        if first is None and chunk["output_ids"]:
            first = time.perf_counter()
        last = chunk
    return last, time.perf_counter() - (first or t0)


# ---- the speculative benchmarks' prompts (bench_speculative, bench_spec_ceiling,
# bench_head_learning_curve) -----------------------------------------------------------------
_DOC = (
    "Invoice INV-2291 was issued on 14 March 2024 by Northwind Traders, 1200 Harbor Road, "
    "Seattle, WA 98101, to Contoso Ltd, 55 King Street, Manchester M2 4LQ, United Kingdom. "
    "The order contained 12 units of the Model X20 barcode scanner at 89.50 USD each and 3 "
    "units of the Dock S4 charging cradle at 45.00 USD each. Shipping was 25.00 USD and tax "
    "was 108.40 USD, for a total of 1342.40 USD. Payment is due within 30 days to account "
    "number 4417-2209-8831 at First Harbor Bank. Contact: Maria Lopez, maria.lopez@northwind"
    ".example, phone +1 206 555 0143."
)
_CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    total = total + total * tax_rate
    return round(total, 2)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
# open chat, and two copy-heavy families: fields of a given document as JSON, edits of code
WORKLOADS: dict[str, list[str]] = {
    "chat": [
        "What are three good habits for staying healthy?",
        "Explain how a bicycle works to a child.",
        "Why is the sky blue?",
        "Give me some tips for a job interview.",
        "What is the difference between weather and climate?",
        "Describe a nice day at the beach.",
        "How do plants make their food?",
        "What should I pack for a weekend hiking trip?",
    ],
    "extraction": [
        f"Here is a document:\n\n{_DOC}\n\nExtract these fields as JSON: {fields}."
        for fields in (
            "invoice_number, date, seller, buyer, total",
            "seller, seller_address, buyer, buyer_address",
            "items (name, quantity, unit_price), shipping, tax, total",
            "contact_name, contact_email, contact_phone, account_number, bank",
        )
    ],
    "code": [
        f"Here is some Python code:\n\n{_CODE}\n{task}"
        for task in (
            "Rewrite it with type hints on every function. Show the whole code.",
            "Rename the variable `total` to `amount` everywhere. Show the whole code.",
            "Add a docstring to each function. Show the whole code.",
            "Rewrite `cheapest` to use the built-in min(). Show the whole code.",
        )
    ],
}


# ---- llama.cpp as a peer -------------------------------------------------------------------
# Build its tools with `../shared/peers/llama-cpp.sh` (it prints the folder that holds the
# binaries) and pass that folder as `--llama-cpp-bin`.

# A CPU build's weight repacking for AMX died on an illegal instruction in its AMX matmul on
# an Intel Xeon VM here (SIGILL, then SIGSEGV: the VM's AMX tiles are not usable) for multi-row
# matmuls (prefill, long contexts, batches), while batch-1 decode runs with it. So each figure
# is its own run: repacking on (llama.cpp's default) wherever that runs, off only for the
# figures whose default run dies of one of these, and each figure says which path it took.
CRASH_CODES = (-4, -11, 132, 139)


class ToolRun(NamedTuple):
    """One llama.cpp tool run: its stdout, its peak RSS, and the path it took: the command
    line's tool name, plus the no-repack flag where the default (repacking) run crashed."""

    out: str
    rss_mb: float
    path: str


def llama_binary(bin_dir: str, name: str) -> str:
    """The path of llama.cpp's tool `name` in `bin_dir`; ValueError if it is not there."""
    path = os.path.join(os.path.expanduser(bin_dir), name)
    if not os.access(path, os.X_OK):
        raise ValueError(f"{path} is not an executable (build it with ../shared/peers/"
                         "llama-cpp.sh and pass the folder it prints)")
    return path


def _peak_rss_mb(pid: int) -> float | None:
    """A running process's peak RSS so far (VmHWM) in MB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _run_tool(cmd: list[str], timeout_s: float) -> tuple[str, float]:
    """(stdout, this child's own peak RSS in MB); stderr (its logs) is dropped. The peak is
    the child's VmHWM read while it runs: wait4's ru_maxrss also counts the memory map the
    child replaced at exec, this process's own (a benchmark that built a 1B model has a 2 GB
    peak, which every tool it started then reported); ru_maxrss only where /proc is not."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        deadline = time.monotonic() + timeout_s
        peak = None
        while True:
            seen = _peak_rss_mb(proc.pid)
            if seen is not None:
                peak = seen if peak is None else max(peak, seen)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{os.path.basename(cmd[0])} ran past {timeout_s:.0f}s")
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{os.path.basename(cmd[0])} failed ({proc.returncode}): "
                               f"{err.read()[-500:].decode(errors='replace')}")
        return out.read().decode(), peak if peak is not None else usage.ru_maxrss / 1024


def _run_tool_or_without_repack(cmd: list[str], no_repack: list[str], timeout_s: float
                                ) -> ToolRun:
    """`cmd` as llama.cpp runs by default (weight repacking on); again with `no_repack`
    added only where that run died of a crash (CRASH_CODES)."""
    tool = os.path.basename(cmd[0])
    try:
        out, rss_mb = _run_tool(cmd, timeout_s)
        return ToolRun(out, rss_mb, tool)
    except RuntimeError as exc:
        if not any(f"failed ({code})" in str(exc) for code in CRASH_CODES):
            raise
    out, rss_mb = _run_tool(cmd + no_repack, timeout_s)
    return ToolRun(out, rss_mb, " ".join([tool, *no_repack]))


def _bench_rows(run: ToolRun) -> list[dict[str, Any]]:
    return json.loads(run.out)


def llama_bench(bin_dir: str, model: str, threads: int, n_prompt: int, n_gen: int,
                repetitions: int = 3, timeout_s: float = 900) -> dict[str, Any]:
    """`llama-bench` prefill (pp) and batch-1 decode (tg) tokens/s, each its own run as its
    users run it (weight repacking off only where that run crashes on this CPU): the speeds,
    the larger peak RSS, and `paths`: the llama.cpp path each figure came from."""
    base = [llama_binary(bin_dir, "llama-bench"), "-m", model, "-t", str(threads),
            "-r", str(repetitions), "-o", "json"]
    t0 = time.perf_counter()
    result: dict[str, Any] = {"rss_mb": 0.0, "paths": {}}
    for key, p, n in (("b1_tok_s", 0, n_gen), ("prefill_tok_s", n_prompt, 0)):
        run = _run_tool_or_without_repack(base + ["-p", str(p), "-n", str(n)], ["--repack", "0"],
                                          timeout_s)
        for row in _bench_rows(run):
            if row.get("n_prompt", 0) == p and row.get("n_gen", 0) == n:
                result[key] = float(row["avg_ts"])
        result["paths"][key] = run.path
        result["rss_mb"] = max(result["rss_mb"], run.rss_mb)
    result["wall_s"] = time.perf_counter() - t0
    return result


def llama_bench_depths(bin_dir: str, model: str, threads: int, depths: list[int], n_gen: int,
                       repetitions: int = 2, timeout_s: float = 900) -> dict[str, Any]:
    """`llama-bench -d`: batch-1 decode tokens/s after a context of each depth, as
    {"d<depth>_tok_s": ...}, each depth its own run, and `paths` (as `llama_bench`)."""
    result: dict[str, Any] = {"paths": {}}
    for depth in depths:
        cmd = [llama_binary(bin_dir, "llama-bench"), "-m", model, "-t", str(threads), "-p", "0",
               "-n", str(n_gen), "-d", str(depth), "-r", str(repetitions), "-o", "json"]
        run = _run_tool_or_without_repack(cmd, ["--repack", "0"], timeout_s)
        for row in _bench_rows(run):
            if row.get("n_gen", 0) > 0 and int(row.get("n_depth", depth)) == depth:
                result[f"d{depth}_tok_s"] = float(row["avg_ts"])
                result["paths"][f"d{depth}_tok_s"] = run.path
    return result


def llama_batched_bench(bin_dir: str, model: str, threads: int, batch_sizes: list[int],
                        n_prompt: int, n_gen: int, timeout_s: float = 1800,
                        extra: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """`llama-batched-bench` decode tokens/s (S_TG) per number of parallel sequences, as
    {"b<batch>_tok_s": ...}, each batch size its own run, and `paths` (as `llama_bench`);
    `extra` options appended (e.g. `--lora FILE`)."""
    result: dict[str, Any] = {"paths": {}}
    for batch in batch_sizes:
        cmd = [llama_binary(bin_dir, "llama-batched-bench"), "-m", model, "-t", str(threads),
               "-c", str(batch * (n_prompt + n_gen) + 256), "-npp", str(n_prompt),
               "-ntg", str(n_gen), "-npl", str(batch), "--output-format", "jsonl", *extra]
        run = _run_tool_or_without_repack(cmd, ["--no-repack"], timeout_s)
        for line in run.out.splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if int(row.get("pl", -1)) == batch and "speed_tg" in row:
                result[f"b{batch}_tok_s"] = float(row["speed_tg"])
                result["paths"][f"b{batch}_tok_s"] = run.path
    return result
