"""Every family's tiny model three ways: our HF-folder load, our load of the F32 GGUF that
llama.cpp's own converter writes from that folder, and llama-server on the same GGUF.

    LLAMA_CPP_BIN=~/.cache/peers/llama.cpp-0.3.36/build/bin python -m benchmarks.check_family_peers

The models are benchmarks/tiny_families.py's CONVERTER_CASES (2 layers, hidden 64, the
family's settings as far as a GGUF can say them, trained a few steps so that greedy choices
are not near-ties), cached under ~/.cache/sglang_like/tiny_families/; for Mistral and Qwen2
the converter writes no sliding window, so their files (and llama-server) run unwindowed and
are not compared with the windowed folder. Each is converted with `convert_hf_to_gguf.py --outtype
f32` (llama.cpp's source tree beside the build, as ../shared/peers/llama-cpp.sh leaves it).
Greedy decoding of the same prompt ids, 32 tokens, fp32 everywhere; the table counts the
tokens equal before the first difference (llama-server stops at EOS, so do we). A family
llama.cpp's converter or server refuses is reported with its error, not left out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.bench_gguf_types import AGREE_TOKENS, _llama_server_tokens, greedy_ours
from benchmarks.common import RESULTS_DIR
from benchmarks.random_gguf import llama_cpp_source
from benchmarks.tiny_families import (
    CONVERTER_CASES,
    ConverterCase,
    build_folder,
    prepare_for_converter,
    tokenizer_model,
)

CACHE = Path(os.path.expanduser("~")) / ".cache" / "sglang_like" / "tiny_families"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return",
           "<|im_start|>user\nWrite 3 haiku about rain.<|im_end|>\n"]


def folder_of(case: ConverterCase) -> Path:
    """The case's tiny folder with the vocab files the converter reads (built once)."""
    path = CACHE / case.family.name
    if not (path / "config.json").exists():
        tmp = CACHE / f"{case.family.name}.tmp{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        build_folder(case.family, tmp)
        prepare_for_converter(tmp, case, tokenizer_model())
        os.replace(tmp, path)
    return path


def convert_f32(src_dir: str, folder: Path) -> Path:
    out = folder / "model-f32.gguf"
    if out.exists():
        return out
    env = {**os.environ, "PYTHONPATH": os.path.join(src_dir, "gguf-py")}
    proc = subprocess.run([sys.executable, os.path.join(src_dir, "convert_hf_to_gguf.py"),
                           str(folder), "--outtype", "f32", "--outfile", str(out) + ".tmp"],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    os.replace(str(out) + ".tmp", out)
    return out


def _ours_in_worker(path: str, ids: list[list[int]] | None = None) -> dict[str, Any]:
    extra = ["--worker-ids", json.dumps(ids)] if ids else []
    proc = subprocess.run([sys.executable, "-m", "benchmarks.check_family_peers", "--worker",
                           path, *extra], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def equal_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def check(case: ConverterCase, bin_dir: str, src_dir: str) -> dict[str, Any]:
    row: dict[str, Any] = {"family": case.family.name}
    folder = folder_of(case)
    try:
        gguf = convert_f32(src_dir, folder)
    except RuntimeError as exc:
        row["error"] = f"convert_hf_to_gguf: {exc}"
        return row
    try:
        ggufs = _ours_in_worker(str(gguf))
    except RuntimeError as exc:
        row["error"] = f"our GGUF load: {exc}"
        return row
    # the same prompt ids for the folder: a converted SentencePiece vocab may split text
    # otherwise than the folder's tokenizer.json
    hf = _ours_in_worker(str(folder), ggufs["prompts"])
    if case.window_metadata is None:  # else the file has no window (the converter writes none)
        row["gguf_vs_hf"] = [equal_prefix(a, b)
                             for a, b in zip(ggufs["outputs"], hf["outputs"], strict=True)]
    row["lengths"] = [len(o) for o in ggufs["outputs"]]
    try:
        theirs = _llama_server_tokens(bin_dir, str(gguf), ggufs["prompts"], ggufs["eos"], [])
        row["server"] = "llama-server"
    except RuntimeError:
        try:
            theirs = _llama_server_tokens(bin_dir, str(gguf), ggufs["prompts"], ggufs["eos"],
                                          ["--no-repack"])
            row["server"] = "llama-server --no-repack"
        except RuntimeError as exc:
            row["error"] = f"llama-server: {exc}"
            return row
    row["ours_vs_server"] = [equal_prefix(a, b) for a, b in zip(ggufs["outputs"], theirs,
                                                                strict=True)]
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"))
    ap.add_argument("--llama-cpp-src", default=None,
                    help="folder with convert_hf_to_gguf.py (default: beside the build)")
    ap.add_argument("--families", default=",".join(c.family.name for c in CONVERTER_CASES))
    ap.add_argument("--output-json", default=os.path.join(RESULTS_DIR, "family_peers.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-ids", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        ids = json.loads(args.worker_ids) if args.worker_ids else None
        # fp32, no quantization: the comparison is of the models, not of the formats
        print(json.dumps(greedy_ours(args.worker, PROMPTS, ids, max_total_tokens=4096,
                                     quantization="none", context_length=512)))
        return
    if not args.llama_cpp_bin:
        ap.error("--llama-cpp-bin (or LLAMA_CPP_BIN): build it with ../shared/peers/llama-cpp.sh")
    from tqdm import tqdm

    src = args.llama_cpp_src or llama_cpp_source(args.llama_cpp_bin)
    wanted = args.families.split(",")
    cases = [c for c in CONVERTER_CASES if c.family.name in wanted]
    rows = [check(case, args.llama_cpp_bin, src) for case in tqdm(cases, desc="families")]
    print(f"\ngreedy tokens equal before the first difference, {len(PROMPTS)} prompts x up "
          f"to {AGREE_TOKENS} tokens, fp32 (ours: --quantization none)")
    print(f"{'family':<24}{'our GGUF = our HF':<20}{'our GGUF = llama-server':<26}note")
    for r in rows:
        total = sum(r.get("lengths", [])) or float("nan")
        a = f"{sum(r['gguf_vs_hf'])}/{total}" if "gguf_vs_hf" in r else "-"
        b = f"{sum(r['ours_vs_server'])}/{total}" if "ours_vs_server" in r else "-"
        print(f"{r['family']:<24}{a:<20}{b:<26}{r.get('error', r.get('server', ''))}")
    os.makedirs(os.path.dirname(args.output_json), exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump({"rows": rows, "argv": sys.argv[1:]}, f, indent=1)
    print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
