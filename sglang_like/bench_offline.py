"""Offline benchmark: single-stream decode and a shared-prefix batch, ours beside HF generate.

    python -m sglang_like.bench_offline                 # the issue's workload (takes minutes)
    python -m sglang_like.bench_offline --num-requests 16 --prefix-len 500 --new-tokens 32

Both sides run the same dequantized weights in float32 on the same machine, in one run.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

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


def bench_single_stream(engine: Any, new_tokens: int) -> dict[str, float]:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    engine.generate("Warm up the engine.", {"max_new_tokens": 4})
    t0 = time.perf_counter()
    first = None
    n = 0
    for chunk in engine.generate("Tell me a story about a robot.", params, stream=True):
        if first is None:
            first = time.perf_counter()
        n = chunk["meta_info"]["completion_tokens"]
    end = time.perf_counter()
    return {"ttft_s": first - t0, "decode_tok_s": (n - 1) / max(end - first, 1e-9)}


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
    state = {k: v for k, v in engine.runner.model.state_dict().items()}
    model.load_state_dict(state, strict=False)
    if c.tie_word_embeddings:
        model.tie_weights()
    return model


def bench_hf_single_stream(model: Any, engine: Any, new_tokens: int) -> float:
    ids = torch.tensor([engine.tokenizer.encode("Tell me a story about a robot.")])
    pad = sorted(engine.eos_token_ids)[0]
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=pad)
        t0 = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=pad)
    return new_tokens / (time.perf_counter() - t0)


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--single-new-tokens", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)

    from sglang_like.engine import Engine

    engine = Engine(model_path=args.model_path)
    prompts = make_prompts(engine.tokenizer, args.num_requests, args.prefix_len)
    single = bench_single_stream(engine, args.single_new_tokens)
    print(f"single stream: {single}", flush=True)
    ours = bench_ours(engine, prompts, args.new_tokens)
    print(f"ours: {ours}", flush=True)
    hf = None
    if not args.skip_hf:
        model = build_hf_model(engine)
        hf = bench_hf(model, engine, prompts, args.new_tokens, args.hf_batch_size)
        hf["single_tok_s"] = bench_hf_single_stream(model, engine, args.single_new_tokens)
    print(f"hf: {hf}", flush=True)
    engine.shutdown()

    print(f"\nthreads={torch.get_num_threads()}  requests={args.num_requests}  "
          f"shared prefix={args.prefix_len} tokens  new tokens={args.new_tokens}")
    print(f"{'workload':<34}{'ours':>14}{'HF generate':>14}{'ratio':>8}")
    hf_single = f"{hf['single_tok_s']:>14.1f}" if hf else f"{'skipped':>14}"
    single_ratio = f"{single['decode_tok_s'] / hf['single_tok_s']:>7.2f}x" if hf else ""
    print(f"{'single-stream decode (tok/s)':<34}{single['decode_tok_s']:>14.1f}{hf_single}"
          f"{single_ratio}")
    hf_tps = f"{hf['tok_s']:>14.1f}" if hf else f"{'skipped':>14}"
    ratio = f"{ours['tok_s'] / hf['tok_s']:>7.2f}x" if hf else ""
    print(f"{'shared-prefix batch (tok/s)':<34}{ours['tok_s']:>14.1f}{hf_tps}{ratio}")
    hf_s = f"{hf['seconds']:>14.1f}" if hf else f"{'':>14}"
    print(f"{'shared-prefix batch (seconds)':<34}{ours['seconds']:>14.1f}{hf_s}")
    print(f"{'cache hit rate (prompt tokens)':<34}{ours['cache_hit_rate']:>14.1%}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "single": single, "ours": ours, "hf": hf}, f, indent=2)


if __name__ == "__main__":
    main()
