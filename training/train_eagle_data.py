"""Stage 1 of `train_eagle`: the training conversations, written by the engine itself.

Magpie-style self-prompting (the chat template up to the user turn samples a question, the
template then answers it), plus copy-heavy conversations over the shard's own answers, plus
(`--code-frac`, `--doc-frac`) code and extraction tasks over text the model did not write
(`train_eagle_prompts`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

from training.train_eagle_core import DATA_KEYS, add_timing, log, save_atomic

# Openers that start some self-prompted user turns, so that tasks the model rarely asks itself
# about (code, structured output) are in the data too; "" leaves the turn to the model.
USER_OPENERS = ("", "", "", "", "", "Write a Python function", "Can you write code",
                "Extract", "Give me a JSON", "List", "Rewrite", "Summarize", "Translate",
                "Explain how")
# Tasks over a text the model wrote before: they teach the head to copy from the context, as
# extraction and editing prompts make the target do.
REWORK_TASKS = (
    "Rewrite the text above as a bulleted list.",
    "Repeat the text above word for word, then add one more sentence.",
    "Extract the key facts of the text above as a JSON object.",
    "Summarize the text above in two sentences.",
    "Rewrite the text above in a more formal tone.",
    "Correct any mistakes in the text above and show the whole corrected text.",
    "Turn the text above into a numbered list of steps or points.",
    "Write three questions a reader could answer from the text above, with their answers.",
)


def _finish_convs(tok: Any, prompts: list[str], answers: list[dict], stop_ids: set[int],
                  im_end: int | None) -> list[dict]:
    convs = []
    for p, a in zip(prompts, answers, strict=True):
        out = list(a["output_ids"])
        while out and out[-1] in stop_ids:
            out.pop()
        fr = a["meta_info"]["finish_reason"] or {}
        if fr.get("type") != "length" and im_end is not None:
            out.append(im_end)  # the turn ends as the template would close it
        if not out:
            continue
        prompt_ids = tok.encode(p)
        convs.append({"ids": prompt_ids + out, "prompt_len": len(prompt_ids),
                      "answer": a["text"]})
    return convs


def _answer_params(args: argparse.Namespace, seeds: list[int]) -> list[dict]:
    """Half greedy, half temperature 0.7 / top_p 0.95 (by the seed's parity)."""
    return [({"temperature": 0.0} if sd % 2 == 0 else
             {"temperature": 0.7, "top_p": 0.95, "seed": sd})
            | {"max_new_tokens": args.answer_max_tokens} for sd in seeds]


def _magpie_shard(eng: Any, tok: Any, user_prefix: str, stop_ids: set[int],
                  im_end: int | None, args: argparse.Namespace, base: int) -> list[dict]:
    """`args.shard_size` self-prompted conversations: the template up to the user turn
    (plus, for some, an opener) samples a question, the chat template answers it."""
    n = args.shard_size
    rng = random.Random(base)
    openers = [rng.choice(USER_OPENERS) for _ in range(n)]
    users = eng.generate(
        prompt=[user_prefix + o for o in openers],
        sampling_params=[{"temperature": 1.0, "top_p": 0.95, "seed": base + i,
                          "max_new_tokens": args.user_max_tokens,
                          "stop": ["<|im_end|>"]} for i in range(n)])
    msgs = [(o + u["text"]).strip() for o, u in zip(openers, users, strict=True)]
    keep = [i for i, m in enumerate(msgs) if m]
    prompts = [eng.apply_chat_template([{"role": "user", "content": msgs[i]}]) for i in keep]
    answers = eng.generate(prompt=prompts,
                           sampling_params=_answer_params(args, [base + i for i in keep]))
    return _finish_convs(tok, prompts, answers, stop_ids, im_end)


def _task_shard(eng: Any, tok: Any, stop_ids: set[int], im_end: int | None,
                args: argparse.Namespace, base: int) -> list[dict]:
    """Code tasks over the standard library's source, extraction tasks over synthetic
    documents and everyday questions (`train_eagle_prompts`), `args.code_frac`,
    `args.doc_frac` and `args.chat_frac` of a shard, answered greedily."""
    from training.train_eagle_prompts import chat_task, code_task, extraction_task

    rng = random.Random(base + 2)
    chat_frac = getattr(args, "chat_frac", 0.0)
    users = ([code_task(rng) for _ in range(round(args.shard_size * args.code_frac))]
             + [extraction_task(rng) for _ in range(round(args.shard_size * args.doc_frac))]
             + [chat_task(rng) for _ in range(round(args.shard_size * chat_frac))])
    if not users:
        return []
    prompts = [eng.apply_chat_template([{"role": "user", "content": u}]) for u in users]
    # greedy: how such prompts are mostly run (extraction, code), and the engine's fastest
    # path (no sampling over the vocabulary at every step)
    answers = eng.generate(prompt=prompts, sampling_params={
        "temperature": 0.0, "max_new_tokens": args.answer_max_tokens})
    return _finish_convs(tok, prompts, answers, stop_ids, im_end)


def _rework_shard(eng: Any, tok: Any, convs: list[dict], stop_ids: set[int],
                  im_end: int | None, args: argparse.Namespace, base: int) -> list[dict]:
    """Copy-heavy conversations: an answer of this shard given back as the document of a
    task from REWORK_TASKS."""
    rng = random.Random(base + 1)
    docs = [c["answer"].strip() for c in convs if len(c["answer"].strip()) > 200]
    rng.shuffle(docs)
    docs = docs[: round(args.shard_size * args.rework_frac)]
    prompts = [eng.apply_chat_template(
        [{"role": "user", "content": f"{d}\n\n{rng.choice(REWORK_TASKS)}"}]) for d in docs]
    if not prompts:
        return []
    answers = eng.generate(prompt=prompts, sampling_params=_answer_params(
        args, [base + 500_000 + i for i in range(len(prompts))]))
    return _finish_convs(tok, prompts, answers, stop_ids, im_end)


def stage_data(args: argparse.Namespace, work: str) -> None:
    from tqdm import tqdm

    import sglang_like

    ddir = os.path.join(work, "data")
    os.makedirs(ddir, exist_ok=True)
    todo = [s for s in range(args.num_shards)
            if not os.path.isfile(os.path.join(ddir, f"shard_{s:04d}.pt"))]
    if not todo:
        log("data: all shards present, skipped")
        return
    t_start = time.perf_counter()
    cfg_path = os.path.join(work, "data_config.json")
    if not os.path.isfile(cfg_path):  # the card reports what made the data, not a later call
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump({k: getattr(args, k) for k in DATA_KEYS}, f, indent=2)
    eng = sglang_like.Engine()
    try:
        tok = eng.tokenizer
        im_end = tok.token_to_id("<|im_end|>")
        stop_ids = set(eng.eos_token_ids) | ({im_end} if im_end is not None else set())
        probe = eng.apply_chat_template([{"role": "user", "content": "\x00"}])
        user_prefix = probe[: probe.index("\x00")]  # ... <|im_start|>user\n
        bar = tqdm(todo, desc="data shards", unit="shard")
        for s in bar:
            if args.gen_budget_min and time.perf_counter() - t_start > args.gen_budget_min * 60:
                log(f"data: time budget of {args.gen_budget_min} min spent; "
                     f"stopping before shard {s}")
                break
            base = args.seed * 1_000_003 + s * args.shard_size
            convs = _magpie_shard(eng, tok, user_prefix, stop_ids, im_end, args, base)
            if args.rework_frac > 0:
                convs += _rework_shard(eng, tok, convs, stop_ids, im_end, args, base)
            convs += _task_shard(eng, tok, stop_ids, im_end, args, base)
            save_atomic({"convs": convs, "vocab_size": eng.model_config.vocab_size,
                          "stop_ids": sorted(stop_ids)},
                         os.path.join(ddir, f"shard_{s:04d}.pt"))
            ntok = sum(len(c["ids"]) - c["prompt_len"] for c in convs)
            bar.set_postfix(convs=len(convs), answer_tokens=ntok)
    finally:
        eng.shutdown()
    dt = time.perf_counter() - t_start
    add_timing(work, "data", dt)
    log(f"data: {dt:.0f}s wall")
