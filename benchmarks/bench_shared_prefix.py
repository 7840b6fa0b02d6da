"""The shared-prefix batch, ours beside HF generate on the same fp32 weights.

    python -m benchmarks.bench_shared_prefix [--num-requests 64] [--prefix-len 1000]
    python -m benchmarks.bench_offline --shared-prefix     # the same after the offline table

`--num-requests` requests share a `--prefix-len`-token preamble, each with its own short
question; ours runs them as one batch (default quantization, then fp32: the radix cache
holds the preamble once), HF generate on the very fp32 weights ours runs, in one batch.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from sglang_like.model_loader import load_model

_WORDS = (
    "system policy assistant answer question careful detail context tool result user task "
    "plan step check value reason memory cache token model batch server request output "
    "format schema field number string list object language program function call return"
).split()


def make_prompts(tokenizer: Any, num_requests: int, prefix_len: int) -> list[str]:
    """One shared ~prefix_len-token preamble, then a distinct short question per request."""
    words, text = [], ""
    i = 0
    while len(tokenizer.encode(text)) < prefix_len:
        words.append(_WORDS[(i * 7 + i // 3) % len(_WORDS)])
        i += 1
        if i % 16 == 0:
            text = " ".join(words)
    text = " ".join(words)
    ids = tokenizer.encode(text)[:prefix_len]
    prefix = tokenizer.decode(ids)
    return [f"{prefix}\nQuestion {k}: what is {k} times {k + 3}?\nAnswer:"
            for k in range(num_requests)]


def bench_ours(engine: Any, prompts: list[str], new_tokens: int) -> dict[str, float]:
    engine.flush_cache()
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    gen = sum(o["meta_info"]["completion_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    return {"seconds": dt, "gen_tokens": gen, "tok_s": gen / dt,
            "cache_hit_rate": cached / max(prompt, 1)}


def build_hf_model(engine: Any) -> Any:
    """transformers' Llama on the very weights our engine runs (no second GGUF load)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = engine.model_config
    cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, torch_dtype=torch.float32,
    )
    model = LlamaForCausalLM(cfg).eval()
    # the HF-named fp32 weights our `none` path runs (our model fuses q/k/v and gate/up)
    state = load_model(engine.server_args.model_path).weights
    model.load_state_dict(state, strict=False)
    if c.tie_word_embeddings:
        model.tie_weights()
    return model


def bench_hf(model: Any, engine: Any, prompts: list[str], new_tokens: int,
             batch_size: int) -> dict:
    tok = engine.tokenizer
    pad = sorted(engine.eos_token_ids)[0]
    gen = 0
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch_size):
        id_lists = [tok.encode(p) for p in prompts[s : s + batch_size]]
        width = max(len(x) for x in id_lists)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in id_lists])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in id_lists])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        gen += (out.shape[1] - width) * len(id_lists)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "gen_tokens": gen, "tok_s": gen / dt}


def run_shared_prefix(model_path: str | None, *, num_requests: int = 64, prefix_len: int = 1000,
                      new_tokens: int = 128, skip_hf: bool = False) -> dict[str, Any]:
    """Ours (default quantization and fp32) and HF (fp32), the same prompts, in one run."""
    from sglang_like.engine import Engine

    result: dict[str, Any] = {}
    for quantization in ("auto", "none"):
        engine = Engine(model_path=model_path, quantization=quantization)
        prompts = make_prompts(engine.tokenizer, num_requests, prefix_len)
        result[f"ours_{engine.server_args.quantization}"] = bench_ours(engine, prompts,
                                                                       new_tokens)
        if quantization == "none" and not skip_hf:
            result["hf_fp32"] = bench_hf(build_hf_model(engine), engine, prompts, new_tokens,
                                         num_requests)
        engine.shutdown()
    print(f"\nshared prefix: {num_requests} requests x {prefix_len}-token preamble, "
          f"{new_tokens} new tokens each")
    print(f"{'system':<16}{'tok/s':>10}{'seconds':>10}{'cache hit':>11}")
    for name, r in result.items():
        hit = f"{r['cache_hit_rate']:>11.1%}" if "cache_hit_rate" in r else ""
        print(f"{name:<16}{r['tok_s']:>10.1f}{r['seconds']:>10.1f}{hit}")
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_shared_prefix",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true", help="ours only")
    args = ap.parse_args(argv)
    run_shared_prefix(args.model_path, num_requests=args.num_requests,
                      prefix_len=args.prefix_len, new_tokens=args.new_tokens,
                      skip_hf=args.skip_hf)


if __name__ == "__main__":
    main()
