"""The GGUF files people download, ours beside llama.cpp on the same file, one run.

    python -m benchmarks.bench_gguf_types --llama-cpp-bin ~/.cache/peers/llama.cpp-0.3.36/build/bin
    python -m benchmarks.bench_gguf_types --types Q4_K_M --skip-peer          # ours only

The default model is requantized with llama.cpp's own `llama-quantize --allow-requantize`
to each type (Q4_K_M, Q5_K_M, Q6_K, Q8_0, IQ4_NL by default; cached beside the kernels'
build). Every file then runs in a fresh process (bench_offline's worker: its RSS is its own)
with `auto` (each matrix on the kernel of its own type) and with `int8` (the path before:
dequantized and requantized per row), and llama.cpp runs `llama-bench` (batch 1, prefill)
and `llama-batched-bench` (batch 32) on the same file with as many threads as ours, its
default weight repacking on wherever it runs (figures from runs with it off, where the
default crashed, are marked '*' and named). On this 576-wide model llama-quantize's K files
fall back to Q5_0 / Q5_1 / Q8_0 for every matrix whose rows are not a multiple of 256 (all
but ffn_down), so Q5_0 / Q8_0 matter here as much as the K types.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from benchmarks.bench_offline import _peer, _run_worker, measure_bandwidth_gbs
from benchmarks.common import RESULTS_DIR, llama_binary

DEFAULT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_NL")
FORMATS = ("auto", "int8")


def quantized_file(bin_dir: str, qtype: str, out_dir: str) -> str:
    """The default model requantized to `qtype` by llama-quantize (cached by name)."""
    from sglang_like.model_loader import default_model_path

    path = os.path.join(out_dir, f"SmolLM2-135M-Instruct.{qtype}.gguf")
    if not os.path.exists(path):
        os.makedirs(out_dir, exist_ok=True)
        tmp = path + ".tmp"
        proc = subprocess.run([llama_binary(bin_dir, "llama-quantize"), "--allow-requantize",
                               default_model_path(), tmp, qtype, "2"],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-quantize {qtype} failed: {proc.stderr[-1000:]}")
        os.replace(tmp, path)
    return path


def type_mix(path: str) -> str:
    """The file's matrix types and counts, e.g. 'Q5_0 166, Q4_K 16, Q8_0 15, Q6_K 14'."""
    import collections

    import gguf

    reader = gguf.GGUFReader(path)
    counts = collections.Counter(t.tensor_type.name for t in reader.tensors
                                 if len(t.shape) == 2)
    return ", ".join(f"{k} {v}" for k, v in counts.most_common())


COLS = ("b1_tok_s", "b32_tok_s", "prefill_tok_s")
AGREE_TOKENS = 32


# text to continue (chat prompts without their template mostly end at once with EOS)
AGREE_PROMPTS = [
    "The history of the printing press begins",
    "def merge_sorted(a, b):\n",
    "Once upon a time, in a small village by the sea,",
    "The three most important things to know about volcanoes are",
    "In 1969, the first humans",
    "SELECT name, email FROM customers WHERE",
    "Photosynthesis is the process by which",
    "A good breakfast for a busy morning is",
    "The main causes of the French Revolution were",
    "import json\n\nwith open(",
    "Dear hiring manager,\n\nI am writing to",
    "List of the planets in order: Mercury,",
]


def greedy_ours(path: str, prompts: list[str], ids: list[list[int]] | None = None,
                **engine_kwargs: Any) -> dict[str, Any]:
    """(in a worker process) our greedy tokens for `prompts` (or the prompt `ids`), up to
    AGREE_TOKENS each, stopping at EOS as llama-server does."""
    from sglang_like.engine import Engine

    engine = Engine(model_path=path, engine_in_process=True,
                    **({"max_total_tokens": 16384} | engine_kwargs))
    try:
        ids = ids or [engine.tokenizer.encode(p) for p in prompts]
        outs = engine.generate(input_ids=ids, sampling_params={
            "max_new_tokens": AGREE_TOKENS, "temperature": 0})
        return {"prompts": ids, "outputs": [o["output_ids"] for o in outs],
                "eos": min(engine.tokenizer.eos_token_ids)}
    finally:
        engine.shutdown()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _llama_server_tokens(bin_dir: str, path: str, prompts: list[list[int]], eos: int,
                         extra: list[str], port: int = 30911) -> list[list[int]]:
    import urllib.request

    cmd = [llama_binary(bin_dir, "llama-server"), "-m", path, "--port", str(port), "-t",
           str(torch.get_num_threads()), "-np", "1", "-c", "4096", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become healthy")
            time.sleep(0.5)
        outs = []
        for ids in prompts:
            # no ignore_eos on either side: llama-server's masks EOS out of the logits (so its
            # greedy takes the runner-up where EOS was best), ours only keeps going
            body = {"prompt": ids, "n_predict": AGREE_TOKENS, "temperature": 0, "top_k": 1,
                    "cache_prompt": False, "return_tokens": True}
            out = _post(f"http://127.0.0.1:{port}/completion", body)
            # its tokens leave out the EOS it stopped at; ours end with it
            outs.append(out["tokens"] + ([eos] if out.get("stop_type") == "eos" else []))
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}")
        return outs
    finally:
        proc.kill()
        proc.wait()


def greedy_agreement(bin_dir: str, path: str, n: int) -> dict[str, Any]:
    """Greedy tokens equal to llama-server's (same file, same prompt ids) before the first
    difference, per prompt and on average; llama-server with its default weight repacking,
    or with --no-repack where that run crashes (named in `server`)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_gguf_types",
                           "--worker-greedy", path, "--agreement-prompts", str(n)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"greedy worker failed:\n{proc.stderr[-2000:]}")
    ours = json.loads(proc.stdout.strip().splitlines()[-1])
    server = "llama-server"
    try:
        theirs = _llama_server_tokens(bin_dir, path, ours["prompts"], ours["eos"], [])
    except RuntimeError:
        server = "llama-server --no-repack"
        theirs = _llama_server_tokens(bin_dir, path, ours["prompts"], ours["eos"],
                                      ["--no-repack"])
    equal = []
    for a, b in zip(ours["outputs"], theirs, strict=True):
        n_common = min(len(a), len(b))
        equal.append(next((i for i in range(n_common) if a[i] != b[i]), n_common))
    lengths = [len(a) for a in ours["outputs"]]
    return {"server": server, "equal_prefix": equal, "mean_equal": sum(equal) / len(equal),
            "our_lengths": lengths, "mean_length": sum(lengths) / len(lengths)}


def print_table(results: list[dict[str, Any]], gbs: float) -> None:
    print(f"\ntokens/s; threads={torch.get_num_threads()}, "
          f"ISA {torch.backends.cpu.get_cpu_capability()}; RSS and load in MB / s; floor = "
          f"read bandwidth {gbs:.1f} GB/s / the bytes one decode step of `auto` reads")
    print(f"{'file':<11}{'who':<12}{'batch 1':>9}{'batch 32':>10}{'prefill':>9}"
          f"{'RSS':>7}{'load':>7}  matrices")
    for r in results:
        rows = [(f, r[f]) for f in FORMATS if f in r]
        if r.get("llama.cpp"):
            rows.append(("llama.cpp", r["llama.cpp"]))
        for who, row in rows:
            marks = {c: "*" if "repack" in row.get("paths", {}).get(c, "") else "" for c in COLS}
            cells = "".join(f"{row.get(c, float('nan')):.0f}{marks[c]}".rjust(w)
                            for c, w in zip(COLS, (9, 10, 9), strict=True))
            load = row.get("load_s", float("nan"))
            print(f"{r['type']:<11}{who:<12}{cells}{row.get('rss_mb', float('nan')):>7.0f}"
                  f"{load:>7.1f}  {row.get('linear', '')}")
        peer = r.get("llama.cpp")
        if peer:
            ratios = "  ".join(f"{c.removesuffix('_tok_s')} {r['auto'][c] / peer[c]:.2f}x"
                               for c in COLS if peer.get(c))
            print(f"{'':<11}auto / llama.cpp: {ratios}; RSS "
                  f"{r['auto']['rss_mb'] / peer['rss_mb']:.2f}x; batch-1 floor "
                  f"{r['floor_b1_tok_s']:.0f}   [{r['mix']}]")
    paths = {p for r in results if r.get("llama.cpp")
             for p in r["llama.cpp"].get("paths", {}).values()}
    if paths:
        print("llama.cpp paths: " + "; ".join(sorted(paths))
              + " (* = repacking off, its default run having crashed on this CPU)")


def draw(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(COLS), figsize=(12, 4))
    whos = [w for w in (*FORMATS, "llama.cpp") if any(w in r for r in results)]
    width = 0.8 / len(whos)
    for ax, col in zip(axes, COLS, strict=True):
        for i, who in enumerate(whos):
            xs = [j + i * width for j in range(len(results))]
            ax.bar(xs, [r.get(who, {}).get(col, 0) for r in results], width, label=who)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(results))],
                      [r["type"] for r in results], fontsize=8)
        ax.set_title(col.removesuffix("_tok_s").replace("b", "batch ", 1)
                     if col != "prefill_tok_s" else "prefill 1k")
        ax.set_ylabel("tokens/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Default model requantized, {torch.get_num_threads()} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"chart: {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_gguf_types",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                    help="folder with llama-quantize, llama-bench and llama-batched-bench")
    ap.add_argument("--types", nargs="*", default=list(DEFAULT_TYPES))
    ap.add_argument("--agreement-prompts", type=int, default=8,
                    help="greedy prompts compared with llama-server on each file (0: none)")
    ap.add_argument("--worker-greedy", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--random-1b", action="store_true",
                    help="also a random ~1B Llama at Q4_K_M (benchmarks/random_gguf.py: random "
                    "HF folder -> convert_hf_to_gguf.py -> llama-quantize; every matrix K-quant)")
    ap.add_argument("--files", nargs="*", default=[],
                    help="GGUF files to run as they are (no requantizing), each as a path "
                    "or label=path")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--cache-dir", default=os.path.join(
        os.path.expanduser("~"), ".cache", "sglang_like", "bench_gguf"))
    ap.add_argument("--output-json", default=os.path.join(RESULTS_DIR, "gguf_types.json"))
    ap.add_argument("--plot", default=os.path.join(RESULTS_DIR, "gguf_types.png"))
    args = ap.parse_args(argv)
    if args.worker_greedy:
        print(json.dumps(greedy_ours(args.worker_greedy,
                                     AGREE_PROMPTS[:args.agreement_prompts])))
        return
    formats = [f for f in args.formats.split(",") if f]
    files = [(t, quantized_file(args.llama_cpp_bin, t, args.cache_dir)) for t in args.types
             ] if args.types and args.llama_cpp_bin else []
    if args.random_1b:
        from benchmarks.random_gguf import build_random_llama_gguf

        built = build_random_llama_gguf(args.llama_cpp_bin, args.cache_dir, qtypes=("Q4_K_M",))
        files.append(("1B Q4_K_M", built["Q4_K_M"]))
    for f in args.files:  # "label=path" or a path (labelled by its type)
        label, _, path = f.rpartition("=") if "=" in f else ("", "", f)
        files.append((label or os.path.basename(path).rsplit(".", 2)[-2], path))
    if not files:
        raise SystemExit("nothing to run: pass --llama-cpp-bin (to requantize) or --files")
    results = []
    t0 = time.perf_counter()
    gbs = measure_bandwidth_gbs()
    for qtype, path in files:
        r: dict[str, Any] = {"type": qtype, "file": path, "mix": type_mix(path)}
        passthrough = [f"--model-path={path}", f"--new-tokens={args.new_tokens}",
                       "--batch-sizes=32", "--batch-new-tokens=32",
                       f"--prefill-tokens={args.prefill_tokens}", "--depths="]
        for fmt in formats:
            r[fmt] = _run_worker(fmt, passthrough)
            print(f"{qtype} {fmt}: " + ", ".join(f"{c} {r[fmt][c]:.0f}" for c in COLS),
                  flush=True)
        if not args.skip_peer and args.llama_cpp_bin and args.agreement_prompts:
            r["agreement"] = greedy_agreement(args.llama_cpp_bin, path, args.agreement_prompts)
            a = r["agreement"]
            print(f"{qtype}: greedy tokens equal to llama-server's before the first difference "
                  f"{a['mean_equal']:.1f} on average, of {a['mean_length']:.1f} (up to "
                  f"{AGREE_TOKENS}, EOS ends one) ({a['server']})", flush=True)
        if not args.skip_peer and args.llama_cpp_bin:
            ns = argparse.Namespace(skip_peer=False, llama_cpp_bin=args.llama_cpp_bin,
                                    model_path=path, prefill_tokens=args.prefill_tokens,
                                    new_tokens=args.new_tokens, batch_sizes=[32],
                                    batch_new_tokens=32, depths=[], depth_new_tokens=0)
            r["llama.cpp"] = _peer(ns)
        r["floor_b1_tok_s"] = gbs * 1e3 / r[formats[0]]["decode_mb"] if formats else None
        results.append(r)
    print_table(results, gbs)
    print(f"(the whole run: {time.perf_counter() - t0:.0f} s)")
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=1)
    if args.plot:
        draw(results, args.plot)


if __name__ == "__main__":
    main()
