"""A mixture of experts beside llama.cpp on the same file, and beside a dense model of its
active size, one run.

    python -m benchmarks.bench_moe --llama-cpp-bin ~/.cache/peers/llama.cpp-0.3.36/build/bin

Two seeded random models are built as llama.cpp users get theirs (benchmarks/random_gguf.py:
transformers' own config class -> HF folder -> convert_hf_to_gguf.py -> llama-quantize
Q4_K_M; cached): a Qwen3-MoE-shaped model (hidden 1024, 24 layers, 48 experts of 256 columns,
top-8 renormalized: 1.07B parameters, 0.27B active per token) and a dense Llama of the same
attention and the same active MLP width (intermediate 2048 = 8 x 256: 0.26B active). Each
file runs through bench_gguf_types (ours with `auto`, in a fresh process; llama.cpp's
llama-bench at batch 1 and prefill, llama-batched-bench at batch 32, same threads), and the
MoE overhead is printed: the MoE model's batch-1 speed over the dense model's, ours and
llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks import bench_gguf_types
from benchmarks.common import RESULTS_DIR
from benchmarks.random_gguf import DEFAULT_OUT_DIR, RandomLlamaSpec, build_random_llama_gguf

MOE = RandomLlamaSpec(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=4,
                      num_experts=48, num_experts_per_tok=8, moe_intermediate_size=256)
DENSE = RandomLlamaSpec(hidden_size=1024, intermediate_size=2048, num_layers=24, num_heads=16,
                        num_kv_heads=4)
QTYPE = "Q4_K_M"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_moe",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp-bin", required=True,
                    help="folder with llama-quantize, llama-bench and llama-batched-bench")
    ap.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--output-json", default=os.path.join(RESULTS_DIR, "moe.json"))
    ap.add_argument("--plot", default=os.path.join(RESULTS_DIR, "moe.png"))
    args = ap.parse_args(argv)
    vocab = 49152
    files = {}
    for name, spec in (("moe", MOE), ("dense", DENSE)):
        files[name] = build_random_llama_gguf(args.llama_cpp_bin, args.out_dir, (QTYPE,),
                                              spec=spec)[QTYPE]
        print(f"{name}: {spec.num_params(vocab) / 1e9:.2f}B parameters, "
              f"{spec.num_params(vocab, active=True) / 1e9:.3f}B active: {files[name]}")
    bench_gguf_types.main([
        "--llama-cpp-bin", args.llama_cpp_bin, "--types", "--formats", "auto",
        "--agreement-prompts", "0", "--new-tokens", str(args.new_tokens),
        "--files", f"MoE {QTYPE}={files['moe']}", f"dense {QTYPE}={files['dense']}",
        "--output-json", args.output_json, "--plot", args.plot,
        *(["--skip-peer"] if args.skip_peer else [])])
    with open(args.output_json) as f:
        results = json.load(f)["results"]
    moe, dense = results
    print("\nMoE overhead at batch 1 (the MoE model's speed over the dense model of its "
          "active size):")
    for who in ("auto", "llama.cpp"):
        if who in moe and who in dense:
            ratio = moe[who]["b1_tok_s"] / dense[who]["b1_tok_s"]
            print(f"  {'ours' if who == 'auto' else who}: {moe[who]['b1_tok_s']:.1f} / "
                  f"{dense[who]['b1_tok_s']:.1f} tok/s = {ratio:.2f}x")
    with open(args.output_json) as f:
        doc = json.load(f)
    doc["specs"] = {"moe": MOE.__dict__, "dense": DENSE.__dict__}
    with open(args.output_json, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
