"""Stages 4-5 of `train_eagle`: train the head on the captured shards, export it + its card."""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import torch

from sglang_like.speculative.eagle_head import Eagle3Config, Eagle3Head, load_eagle3_head
from training.train_eagle_core import (
    TrainConfig,
    add_timing,
    build_head,
    data_config,
    data_shards,
    data_stats,
    evaluate,
    load_capture,
    log,
    save_atomic,
    timings,
    train_loop,
)


def _capture_paths(work: str) -> list[str]:
    cdir = os.path.join(work, "capture")
    return sorted(os.path.join(cdir, f) for f in os.listdir(cdir) if f.endswith(".pt"))


def _split(n: int, heldout: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(n))
    random.Random(seed + 17).shuffle(order)
    k = max(1, round(n * heldout))
    return sorted(order[k:]), sorted(order[:k])


def _embedding_and_head(draft_to_target: torch.Tensor) -> tuple[Any, torch.Tensor, dict]:
    """The target's embedding lookup (fp32, frozen) and its LM-head rows of the draft vocab
    (tied: the embedding rows), dequantized, and its config facts."""
    from sglang_like.config import ServerArgs
    from sglang_like.engine_core.setup import build_engine_parts

    parts = build_engine_parts(ServerArgs(max_total_tokens=16))
    model = parts.runner.model
    emb = model.model.embed_tokens

    def embed(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return emb.method.embed(emb, ids.long()).float()

    head_rows = embed(draft_to_target)  # tied embeddings: the LM head = embedding rows
    mc = parts.model_config
    facts = {"hidden_size": mc.hidden_size, "num_attention_heads": mc.num_attention_heads,
             "num_key_value_heads": mc.num_key_value_heads, "vocab_size": mc.vocab_size,
             "intermediate_size": mc.intermediate_size, "head_dim": mc.head_dim,
             "rope_theta": getattr(mc, "rope_theta", 10000.0),
             "rms_norm_eps": float(f"{getattr(mc, 'rms_norm_eps', 1e-5):.6g}"),  # f32 in GGUF
             "max_position_embeddings": mc.max_position_embeddings,
             "aux_layers": list(model.default_aux_layers())}
    return embed, head_rows, facts


def _setup(args: argparse.Namespace, work: str) -> dict[str, Any]:
    """Everything train and export share: vocab, embedding table, head config."""
    vocab = torch.load(os.path.join(work, "vocab.pt"))
    draft_to_target = torch.nonzero(vocab["t2d"]).squeeze(1)
    cache = os.path.join(work, "embed.pt")
    if os.path.isfile(cache):
        saved = torch.load(cache)
        table, facts = saved["table"], saved["facts"]
    else:
        embed, _, facts = _embedding_and_head(draft_to_target)
        table = embed(torch.arange(facts["vocab_size"]))
        save_atomic({"table": table, "facts": facts}, cache)
    config = Eagle3Config(
        hidden_size=facts["hidden_size"], intermediate_size=facts["intermediate_size"],
        num_attention_heads=facts["num_attention_heads"],
        num_key_value_heads=facts["num_key_value_heads"], vocab_size=facts["vocab_size"],
        draft_vocab_size=int(draft_to_target.numel()), target_hidden_size=facts["hidden_size"],
        head_dim=facts["head_dim"], rms_norm_eps=facts["rms_norm_eps"],
        rope_theta=facts["rope_theta"],
        max_position_embeddings=facts["max_position_embeddings"],
        aux_layer_ids=list(facts["aux_layers"]))
    from sglang_like.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(config.head_dim, 4096 + 16, config.rope_theta, None, "cpu")
    return {"vocab": vocab, "d2t_rows": table[draft_to_target], "table": table,
            "config": config, "rope": rope}


def _train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(unroll=args.unroll, steps=args.steps, batch_tokens=args.batch_tokens,
                       lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
                       clip=args.clip, seed=args.seed, ckpt_every_s=args.ckpt_every_s,
                       bf16=_train_bf16(args.train_dtype))


def _train_bf16(choice: str) -> bool:
    """bf16 autocast where the CPU multiplies bf16 in hardware (AMX / AVX512-BF16: several
    times fp32's speed there); fp32 elsewhere, where bf16 would be emulated and slower."""
    if choice != "auto":
        return choice == "bf16"
    from sglang_like.layers.quantization.base import prefill_gemm_dtype

    return prefill_gemm_dtype() == torch.bfloat16


def stage_train(args: argparse.Namespace, work: str) -> None:
    done = os.path.join(work, "train_done.json")
    segments: list[list[int]] = []  # [first step, last step, the schedule's total] per run
    if os.path.isfile(done):
        with open(done, encoding="utf-8") as f:
            prev = json.load(f)
        if prev["config"]["steps"] >= args.steps:
            log("train: finished before, skipped")
            return
        # a larger --steps continues from the checkpoint; the cosine is then over the new total
        segments = prev.get("segments") or [[0, prev["config"]["steps"],
                                              prev["config"]["steps"]]]
        log(f"train: extending {prev['config']['steps']} -> {args.steps} steps")
    t0 = time.perf_counter()
    s = _setup(args, work)
    convs = load_capture(_capture_paths(work))
    train_idx, held_idx = _split(len(convs), args.heldout, args.seed)
    train = [convs[i] for i in train_idx]
    held = [convs[i] for i in held_idx]
    cfg = _train_config(args)
    head = build_head(s["config"], s["d2t_rows"], s["vocab"]["d2t"], s["vocab"]["t2d"],
                      seed=args.seed)
    init_eval = None
    if args.init_head:
        init_eval = _load_init_head(args, work, head, held, s, cfg)
    ntok = sum(int(c["ids"].numel()) for c in train)
    log(f"train: {len(train)} conversations ({ntok} tokens) train, {len(held)} held out; "
         f"K={cfg.unroll}, {cfg.steps} steps of <= {cfg.batch_tokens} tokens")
    ckpt = os.path.join(work, "train_ckpt.pt")
    history = train_loop(head, train, s["table"], s["rope"], cfg, ckpt, progress=True, log=log)
    first = segments[-1][1] if segments else 0
    segments.append([first, len(history), cfg.steps])
    t_train = time.perf_counter() - t0
    add_timing(work, "train", t_train)
    t1 = time.perf_counter()
    res = evaluate(head, held, s["table"], s["rope"], cfg.unroll, cfg.batch_tokens)
    add_timing(work, "eval", time.perf_counter() - t1)
    epochs = cfg.steps * cfg.batch_tokens / max(ntok, 1)  # upper bound (batches are not full)
    with open(done, "w", encoding="utf-8") as f:
        json.dump({"heldout": res, "train_conversations": len(train), "train_tokens": ntok,
                   "heldout_conversations": len(held), "config": vars(cfg) | {},
                   "approx_epochs": epochs, "final_loss": history[-1]["loss"],
                   "segments": segments, "init_head": args.init_head,
                   "heldout_init": init_eval,
                   "first_loss": history[0]["loss"]}, f, indent=2)
    log(f"train: {t_train:.0f}s wall; held-out top-1 per step: "
         + " ".join(f"{r['acc']:.3f}" for r in res))


def _load_init_head(args: argparse.Namespace, work: str, head: Eagle3Head, held: list[dict],
                    s: dict[str, Any], cfg: TrainConfig) -> list[dict[str, float]]:
    """Start `head` from --init-head's weights (same shapes and draft vocabulary). Its card
    is kept in the work dir (the export may overwrite that folder) and its held-out
    accuracy on this data measured once, before any step: the figure the run improves on."""
    init = load_eagle3_head(args.init_head)
    if init.config != s["config"] or not torch.equal(init.d2t, head.d2t):
        raise ValueError(f"--init-head {args.init_head!r}: its config or draft vocabulary "
                         "differs from this run's")
    head.load_state_dict(init.state_dict())
    head.requires_grad_(True)
    card = os.path.join(args.init_head, "README.md")
    kept = os.path.join(work, "init_head_card.md")
    if os.path.isfile(card) and not os.path.isfile(kept):
        with open(card, encoding="utf-8") as f:
            text = f.read()
        with open(kept, "w", encoding="utf-8") as f:
            f.write(text)
    path = os.path.join(work, "heldout_init.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    res = evaluate(head, held, s["table"], s["rope"], cfg.unroll, cfg.batch_tokens)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2)
    log("train: --init-head's held-out top-1 per step before this run: "
         + " ".join(f"{r['acc']:.3f}" for r in res))
    return res


def stage_export(args: argparse.Namespace, work: str) -> None:
    t0 = time.perf_counter()
    s = _setup(args, work)
    head = Eagle3Head(s["config"])
    ck = torch.load(os.path.join(work, "train_ckpt.pt"), weights_only=False)
    head.load_state_dict(ck["model"])
    os.makedirs(args.out, exist_ok=True)
    head.save(args.out)
    back = load_eagle3_head(args.out)
    for name, want in head.state_dict().items():
        got = back.state_dict()[name]
        ref = want.half().float() if want.is_floating_point() else want
        if not torch.equal(got, ref):
            raise RuntimeError(f"export: {name} does not round-trip")
    with open(os.path.join(work, "train_done.json"), encoding="utf-8") as f:
        done = json.load(f)
    add_timing(work, "export", time.perf_counter() - t0)
    _write_card(args, work, s, done)
    log(f"export: {args.out} written and reloaded")


def _machine() -> str:
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{name}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} torch threads")


def _earlier_card(work: str, continued: bool) -> str:
    """The continued head's own card (title dropped, headings one level down), for a card
    whose head did not start from scratch; "" otherwise."""
    path = os.path.join(work, "init_head_card.md")
    if not continued or not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    body = [("#" + ln if ln.startswith("## ") else ln) for ln in lines
            if not ln.startswith("# ")]
    return ("\n## Earlier training: the head this run continued (HEAD above; its work dir "
            "was another)\n" + "\n".join(body).rstrip() + "\n")


def _task_text(args: argparse.Namespace) -> str:
    """The card's words for the task families (`train_eagle_prompts`), "" without them."""
    chat = getattr(args, "chat_frac", 0.0)
    if not args.code_frac and not args.doc_frac and not chat:
        return ""
    chat_text = (f", {chat:.0%} everyday questions as people type them (question frames over "
                 "topic lists: how-to, explanations, tips, comparisons, short writing)"
                 if chat else "")
    return (f" And {args.code_frac:.0%} code tasks over functions and classes of the Python "
            f"standard library's source, {args.doc_frac:.0%} extraction tasks over synthetic "
            "documents (invoices, letters, invitations, orders, listings)"
            f"{chat_text} (`train_eagle_prompts`), answered greedily.")


def _task_args(args: argparse.Namespace) -> str:
    chat = getattr(args, "chat_frac", 0.0)
    if not args.code_frac and not args.doc_frac and not chat:
        return ""
    return (f"--code-frac {args.code_frac} --doc-frac {args.doc_frac} "
            + (f"--chat-frac {chat} " if chat else "") + "\\\n        ")


def _write_card(args: argparse.Namespace, work: str, s: dict, done: dict) -> None:
    args = data_config(work, args)
    stats = data_stats(work)
    t = timings(work)
    cfg = done["config"]
    init = done.get("heldout_init")
    before = ([f" {r['acc']:.3f} |" for r in init] if init else [""] * len(done["heldout"]))
    rows = "\n".join(f"| {k} | {r['acc']:.3f} | {r['acc_full_vocab']:.3f} |{b} {r['rows']} |"
                      for k, (r, b) in enumerate(zip(done["heldout"], before, strict=True)))
    before_col = (" before this run (draft vocab) |", "---|") if init else ("", "")
    if init:
        vocab_text = (f"the continued head's {s['config'].draft_vocab_size} tokens (the most "
                      "frequent of its own data's answers, plus ids 0 and 2), covering "
                      f"{s['vocab']['coverage']:.2%} of this data's answer tokens")
        init_text = ("Weights and draft vocabulary continued from the head this one replaced "
                     "(its training is under *Earlier training* below).")
        distinct_text = (f"this data's answers hold {stats['distinct_answer_tokens']} "
                         "distinct tokens")
    else:
        vocab_text = (f"{s['config'].draft_vocab_size} most frequent answer tokens (plus ids "
                      "0 and 2, `<|endoftext|>` / `<|im_end|>`), covering "
                      f"{s['vocab']['coverage']:.2%} of answer tokens")
        init_text = ("LM head initialised from the target's (tied) embedding rows of the "
                     "draft vocab, norms at one.")
        distinct_text = (f"the answers hold {stats['distinct_answer_tokens']} distinct tokens; "
                         "the remaining slots are the lowest unused target ids")
    size = os.path.getsize(os.path.join(args.out, "model.safetensors")) / 1e6
    train_dtype = "bf16 autocast" if cfg.get("bf16") else "fp32"
    cont = (f"--seed {args.seed} --work-dir DIR --init-head HEAD \\\n        "
            if done.get("init_head") else "")
    cont_note = ("\nwhere HEAD is the head the command under *Earlier training* builds (in "
                 "another work dir).\n" if cont else "")
    text = f"""# SmolLM2-135M-Instruct EAGLE-3 draft head

An EAGLE-3 head (SGLang / SpecForge layout, `LlamaForCausalLMEagle3`, fp16, {size:.1f} MB) for
the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, served as int4), trained on this machine
from the default model alone by `python -m training.train_eagle`.

- Target features: residual stream entering layers {s['config'].aux_layer_ids} (3 x 576),
  captured with the serving path (`forward_features`, int4 weights as served).
- Data: {stats['conversations']} conversations generated by the engine itself, Magpie-style:
  the ChatML template up to `<|im_start|>user\\n` (after the default system prompt; for about a
  third of them followed by an opener such as "Write a Python function" or "Extract", see
  `USER_OPENERS`) samples a user turn (temperature 1, top_p 0.95, <= {args.user_max_tokens}
  tokens), then the chat template answers it (half greedy, half temperature 0.7 / top_p 0.95,
  <= {args.answer_max_tokens} tokens). Per shard of {args.shard_size}, {args.rework_frac:.0%} more
  are copy-heavy: an answer of the shard given back with a task over it (rewrite as a list,
  extract as JSON, correct it: `REWORK_TASKS`).{_task_text(args)}
  {stats['answer_tokens']} answer tokens, {stats['total_tokens']} tokens in all.
- Soft labels: top-{args.label_topk} of the target's log-probabilities over the draft vocab per
  position, renormalised over those {args.label_topk}; loss only where the label predicts an
  answer token.
- Draft vocabulary: {vocab_text}
  ({distinct_text});
  `d2t[d] = target_id - d` (target = d + d2t[d]), draft ids sorted by target id; `t2d` mask.
- Training: training-time-test unroll K = {cfg['unroll']} (loss weight 0.8^k), {cfg['steps']}
  AdamW steps (lr {cfg['lr']}, {cfg['warmup']} warmup, cosine to 5%, clip {cfg['clip']}) of
  <= {cfg['batch_tokens']} packed tokens: about {done['approx_epochs']:.1f} epochs over
  {done['train_tokens']} tokens ({done['train_conversations']} conversations). {init_text}
  Loss {done['first_loss']:.3f} -> {done['final_loss']:.3f}. Runs (first step, last step,
  schedule length): {done.get('segments')}; a run that extends the step count continues from
  the checkpoint on the cosine of the new total.

## Held-out accuracy ({done['heldout_conversations']} conversations, 5%)

Top-1 of the head at unroll step k vs the target's argmax (over the draft vocab / over the
full vocab: the second is what greedy verification accepts, one draft at a time).

| step k | acc (draft vocab) | acc (full vocab) |{before_col[0]} rows |
|---|---|---|{before_col[1]}---|
{rows}

## Wall time on this machine ({_machine()}; training in {train_dtype})

| stage | seconds |
|---|---|
""" + "\n".join(f"| {k} | {v:.0f} |" for k, v in t.items()) + f"""

## Reproduce

    python -m training.train_eagle {cont}--num-shards {len(data_shards(work))} \\
        --shard-size {args.shard_size} --user-max-tokens {args.user_max_tokens} \\
        --answer-max-tokens {args.answer_max_tokens} --rework-frac {args.rework_frac} \\
        {_task_args(args)}--draft-vocab-size {args.draft_vocab_size} \\
        --label-topk {args.label_topk} \\
        --unroll {cfg['unroll']} --steps {cfg['steps']} --lr {cfg['lr']} --warmup {cfg['warmup']} \\
        --batch-tokens {cfg['batch_tokens']} --train-dtype {args.train_dtype}
{cont_note}
Every stage checkpoints under `--work-dir` and the same command resumes where it stopped;
`--gen-budget-min` bounds the data stage's time, `--stop-after STAGE` ends after one stage.
""" + _earlier_card(work, bool(init))
    with open(os.path.join(args.out, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)
