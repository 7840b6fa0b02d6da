"""Every model family beside the Llama of the same size: batch-1 and batch-32 decode.

    python -m benchmarks.bench_families                      # every family, auto and int4
    python -m benchmarks.bench_families --families gemma2,phi3 --formats auto

Each family is a random ~110M-parameter model (hidden 768, 12 layers, 12 heads / 4 KV heads,
intermediate 2048, the default model's 49,152-token vocabulary) built from transformers' own
config class with the settings its released models use (Gemma 2's soft-caps and alternating
windows, Gemma 3's q/k norms and local RoPE, Phi-4-mini's partial rotary and longrope,
SmolLM3's NoPE layers, Granite's multipliers, ...) and saved once as a Hugging Face folder
(cached under ~/.cache/sglang_like/bench_families/); speed on random weights is speed. Each
family and format runs in a fresh process: load, batch-1 decode of 128 tokens, batch-32 decode
of 32 tokens each (benchmarks.common.decode_tok_s); `--rounds N` repeats every job N times,
interleaved, and keeps each figure's median. The table gives tokens/s, each family's
ratio to the Llama in the same format and run, and whether the native decode step (one native
call a step on CPU) took the family's layers. A PNG draws the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import RESULTS_DIR, decode_tok_s

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sglang_like", "bench_families")
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=8192, bos_token_id=0, eos_token_id=2, pad_token_id=0)
# family -> (model_type, config kwargs as its released models set them)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    "mistral": ("mistral", {"sliding_window": 4096}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {"sliding_window": 4096, "query_pre_attn_scalar": 64,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": ("gemma3_text", {"sliding_window": 512, "query_pre_attn_scalar": 64}),
    "phi3": ("phi3", {"original_max_position_embeddings": 4096, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0] * 24, "long_factor": [4.0] * 24}}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                            "attention_multiplier": 0.015625, "logits_scaling": 8.0,
                            "tie_word_embeddings": True}),
    "smollm3": ("smollm3", {"tie_word_embeddings": True}),
}
FORMATS = {"auto": {"quantization": "auto"}, "int4": {"quantization": "int4"}}


def build_folder(family: str) -> str:
    """The family's random model as a Hugging Face folder (built once, then cached)."""
    path = os.path.join(CACHE, family)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers

    from sglang_like.model_loader import load_tokenizer

    model_type, extra = FAMILIES[family]
    tok = load_tokenizer()
    config = transformers.AutoConfig.for_model(model_type, vocab_size=tok.vocab_size,
                                               **(SHAPE | extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = f"{path}.tmp{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    tok.backend.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}, f)
    os.replace(tmp, path)
    return path


def worker(family: str, fmt: str, args: argparse.Namespace) -> dict[str, Any]:
    """One family in one format, in this process."""
    from sglang_like.engine import Engine

    t0 = time.perf_counter()
    engine = Engine(model_path=build_folder(family), max_total_tokens=8192,
                    engine_in_process=True, **FORMATS[fmt])
    load_s = time.perf_counter() - t0
    engine.generate("Warm up.", {"max_new_tokens": 8})
    model = engine.runner.model
    out = {"family": family, "format": fmt, "quantization": engine.server_args.quantization,
           "load_s": round(load_s, 2), "native_decode": bool(model.native_decode),
           "fused_step": bool(model.native_decode and model._native_plan is not None
                              and model._native_plan.fused is not None)}
    c = model.config
    out["params_m"] = round((c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
                             + c.num_hidden_layers * (
                                 c.hidden_size * c.head_dim * (2 * c.num_attention_heads
                                                               + 2 * c.num_key_value_heads)
                                 + 3 * c.hidden_size * c.intermediate_size)) / 1e6, 1)
    out["b1_tok_s"] = decode_tok_s(engine, 1, args.new_tokens)
    out["b32_tok_s"] = decode_tok_s(engine, 32, args.batch_new_tokens)
    engine.shutdown()
    return out


def _run_worker(family: str, fmt: str, argv: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_families", "--worker", f"{family}:{fmt}",
           *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{family} {fmt} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(rows: list[dict[str, Any]]) -> None:
    base = {r["format"]: r for r in rows if r["family"] == "llama"}
    print(f"{'family':<10} {'format':<6} {'quant':<6} {'native':<7} {'fused':<6} "
          f"{'b1 tok/s':>9} {'b32 tok/s':>10} {'b1/llama':>9} {'b32/llama':>10}")
    for r in rows:
        b = base.get(r["format"])
        r1 = r["b1_tok_s"] / b["b1_tok_s"] if b else float("nan")
        r32 = r["b32_tok_s"] / b["b32_tok_s"] if b else float("nan")
        r["b1_vs_llama"], r["b32_vs_llama"] = round(r1, 3), round(r32, 3)
        print(f"{r['family']:<10} {r['format']:<6} {r['quantization']:<6} "
              f"{str(r['native_decode']):<7} {str(r['fused_step']):<6} {r['b1_tok_s']:>9.1f} "
              f"{r['b32_tok_s']:>10.1f} {r1:>9.2f} {r32:>10.2f}")


def draw(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = sorted({r["format"] for r in rows})
    fig, axes = plt.subplots(1, len(formats), figsize=(6 * len(formats), 4), squeeze=False)
    for ax, fmt in zip(axes[0], formats, strict=True):
        sub = [r for r in rows if r["format"] == fmt]
        xs = range(len(sub))
        ax.bar([x - 0.2 for x in xs], [r["b1_vs_llama"] for r in sub], 0.4, label="batch 1")
        ax.bar([x + 0.2 for x in xs], [r["b32_vs_llama"] for r in sub], 0.4, label="batch 32")
        ax.axhline(0.85, color="grey", linestyle="--", linewidth=1, label="0.85 (15% slower)")
        ax.set_xticks(list(xs), [r["family"] for r in sub], rotation=45, ha="right")
        ax.set_ylabel("decode tok/s / same-size Llama")
        ax.set_title(f"--quantization {fmt}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every job N times, interleaved round by round; keep the median")
    ap.add_argument("--output-json", default=os.path.join(RESULTS_DIR, "families.json"))
    ap.add_argument("--plot", default=os.path.join(RESULTS_DIR, "families.png"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        family, fmt = args.worker.split(":")
        print(json.dumps(worker(family, fmt, args)))
        return
    from tqdm import tqdm

    families = args.families.split(",")
    if "llama" not in families:
        families.insert(0, "llama")  # the baseline every ratio is to
    for family in tqdm(families, desc="building folders"):
        build_folder(family)
    passthrough = ["--new-tokens", str(args.new_tokens),
                   "--batch-new-tokens", str(args.batch_new_tokens)]
    jobs = [(f, fmt) for fmt in args.formats.split(",") for f in families]
    # one job thrown away first: a fresh checkout's first process builds the native kernels
    _run_worker(families[0], args.formats.split(",")[0], passthrough)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {job: [] for job in jobs}
    for job in tqdm(jobs * args.rounds, desc="measuring"):  # round by round: drift is shared
        runs[job].append(_run_worker(*job, passthrough))
    rows = []
    for job in jobs:
        row = dict(runs[job][0])
        for key in ("b1_tok_s", "b32_tok_s"):
            row[key] = statistics.median(r[key] for r in runs[job])
            row[f"{key}_runs"] = [round(r[key], 1) for r in runs[job]]
        rows.append(row)
    print_table(rows)
    os.makedirs(os.path.dirname(args.output_json), exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump({"rows": rows, "argv": sys.argv[1:]}, f, indent=1)
    draw(rows, args.plot)
    print(f"wrote {args.output_json} and {args.plot}")


if __name__ == "__main__":
    main()
