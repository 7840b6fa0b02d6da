"""Train the EAGLE-3 draft head of the default model from the default model alone.

    python -m training.train_eagle [--work-dir DIR] [--out DIR] ...

Stages, each checkpointed under the work dir so that re-running the command resumes:

1. data     (`train_eagle_data`) Magpie-style self-prompting through `sglang_like.Engine`:
            the ChatML template up to `<|im_start|>user\\n` samples a user turn, the normal
            chat template then answers it (half greedy, half temperature 0.7); copy-heavy
            tasks over the shard's own answers. Shards of token ids.
2. vocab    the `draft_vocab_size` most frequent answer tokens (+ EOS ids) -> d2t / t2d.
3. capture  teacher forcing through the serving path (`forward_features`, int4 as served):
            fp16 EAGLE-3 features and the top-k of the target's log-probabilities over the
            draft vocabulary per position (soft labels). One file per data shard.
4. train    (`train_eagle_run`, the step in `train_eagle_core`) training-time-test unroll,
            AdamW + warmup/cosine, checkpoint with optimizer and RNG state every few minutes.
5. export   (`train_eagle_run`) `Eagle3Head.save` into --out plus a README card; reloaded
            to check.

This module holds stages 2 and 3 and the command line.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections import Counter
from typing import Any

import torch

from sglang_like.speculative import DEFAULT_HEAD
from training.train_eagle_core import add_timing, data_shards, log, save_atomic
from training.train_eagle_data import stage_data
from training.train_eagle_run import stage_export, stage_train

DEFAULT_WORK_DIR = os.path.expanduser("~/.cache/sglang_like/eagle3-train")
STAGES = ("data", "vocab", "capture", "train", "export")


# ---- 2. draft vocabulary -----------------------------------------------------------------------
def build_draft_vocab(answer_ids: list[list[int]], vocab_size: int, draft_vocab_size: int,
                      always: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft], t2d bool [vocab]): the most frequent tokens (ties by id) plus
    `always`; draft ids are sorted by target id and target = d + d2t[d]."""
    counts = Counter(t for ids in answer_ids for t in ids)
    chosen = [t for t in sorted(always) if 0 <= t < vocab_size][:draft_vocab_size]
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= draft_vocab_size:
            break
        if t not in always:
            chosen.append(t)
    # pad with the lowest unused ids when the data has fewer distinct tokens
    used = set(chosen)
    t = 0
    while len(chosen) < draft_vocab_size:
        if t not in used:
            chosen.append(t)
        t += 1
    target = torch.tensor(sorted(chosen), dtype=torch.long)
    d2t = target - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target] = True
    return d2t, t2d


def stage_vocab(args: argparse.Namespace, work: str) -> None:
    path = os.path.join(work, "vocab.pt")
    if os.path.isfile(path):
        log("vocab: present, skipped")
        return
    t0 = time.perf_counter()
    first = torch.load(data_shards(work)[0])
    # the target's vocab size and its stop ids (eos, <|im_end|>) as the data stage saw them
    vocab_size, eos = first.get("vocab_size", 49152), set(first.get("stop_ids", (0, 2)))
    answers = [c["ids"][c["prompt_len"]:] for p in data_shards(work)
               for c in torch.load(p)["convs"]]
    if args.init_head:
        # a continued head keeps its draft vocabulary (its LM head's rows are those tokens)
        from sglang_like.speculative.eagle_head import load_eagle3_head

        init = load_eagle3_head(args.init_head)
        d2t, t2d = init.d2t.clone(), init.t2d.clone()
        if t2d.numel() != vocab_size:
            raise ValueError(f"--init-head {args.init_head!r} has a vocab of {t2d.numel()}; "
                             f"the data's target has {vocab_size}")
    else:
        d2t, t2d = build_draft_vocab(answers, vocab_size, args.draft_vocab_size, eos)
    total = sum(len(a) for a in answers)
    covered = sum(int(t2d[torch.tensor(a)].sum()) for a in answers if a)
    save_atomic({"d2t": d2t, "t2d": t2d, "coverage": covered / max(total, 1)}, path)
    add_timing(work, "vocab", time.perf_counter() - t0)
    log(f"vocab: {args.draft_vocab_size} draft tokens cover {covered / max(total, 1):.2%} "
         f"of {total} answer tokens")


# ---- 3. capture --------------------------------------------------------------------------------
def stage_capture(args: argparse.Namespace, work: str) -> None:
    from tqdm import tqdm

    from sglang_like.config import ServerArgs
    from sglang_like.engine_core.setup import build_engine_parts

    cdir = os.path.join(work, "capture")
    os.makedirs(cdir, exist_ok=True)
    shards = data_shards(work)
    todo = [p for p in shards if not os.path.isfile(os.path.join(cdir, os.path.basename(p)))]
    if not todo:
        log("capture: all shards present, skipped")
        return
    t0 = time.perf_counter()
    vocab = torch.load(os.path.join(work, "vocab.pt"))
    t2d = vocab["t2d"]
    draft_to_target = torch.nonzero(t2d).squeeze(1)  # draft id d -> target id (sorted)
    pack = max(args.capture_tokens, max(len(c["ids"]) for p in todo
                                        for c in torch.load(p)["convs"]))
    parts = build_engine_parts(ServerArgs(max_total_tokens=pack + 8))
    runner = parts.runner
    model = runner.model
    aux = tuple(model.default_aux_layers())
    rows: list[int] = []
    ntok = sum(len(c["ids"]) for p in todo for c in torch.load(p)["convs"])
    bar = tqdm(total=ntok, desc="capture", unit="tok", smoothing=0.05)

    def forward(group: list[dict]) -> list[dict]:
        out = capture_group(runner, aux, draft_to_target, args.label_topk, group, rows)
        bar.update(sum(len(c["ids"]) for c in group))
        return out

    with torch.no_grad():  # not inference_mode: the CPU attention plan cache reads ._version
        for path in todo:
            out: list[dict] = []
            group: list[dict] = []
            for c in torch.load(path)["convs"]:
                if group and sum(len(g["ids"]) for g in group) + len(c["ids"]) > pack:
                    out += forward(group)
                    group = []
                group.append(c)
            if group:
                out += forward(group)
            save_atomic({"convs": out, "aux_layers": list(aux)},
                         os.path.join(cdir, os.path.basename(path)))
    bar.close()
    dt = time.perf_counter() - t0
    add_timing(work, "capture", dt)
    log(f"capture: {dt:.0f}s wall ({ntok} tokens)")


def capture_group(runner: Any, aux: tuple[int, ...], draft_to_target: torch.Tensor,
                  label_topk: int, group: list[dict], rows: list[int]) -> list[dict]:
    """Teacher-force `group` (conversations {"ids", "prompt_len"}) in one prefill: per
    conversation its fp16 features, the top-`label_topk` target log-probabilities over the
    draft vocabulary and the full-vocabulary argmax. Several conversations go in one forward
    so that it is 256+ rows (the bf16 GEMM where the CPU has one, as served prefill runs);
    `rows` caches req_to_token rows between calls. Slots from 1 on are overwritten."""
    from sglang_like.forward_batch import ForwardBatch

    pool = runner.req_to_token_pool
    while len(rows) < len(group):
        rows.append(pool.alloc())
    ids = [torch.tensor(c["ids"], dtype=torch.long) for c in group]
    lens = [int(t.numel()) for t in ids]
    slot0 = 1
    for r, n in zip(rows, lens, strict=False):
        pool.req_to_token[r, :n] = torch.arange(slot0, slot0 + n, dtype=torch.int32)
        slot0 += n
    total = slot0 - 1
    fb = ForwardBatch(
        input_ids=torch.cat(ids), positions=torch.cat([torch.arange(n) for n in lens]),
        out_slots=torch.arange(1, total + 1), req_pool_indices=torch.tensor(rows[: len(group)]),
        prefix_lens=torch.zeros(len(group), dtype=torch.long), extend_lens=torch.tensor(lens),
        logits_indices=torch.arange(total), req_to_token=pool.req_to_token, is_decode=False)
    logits, feats = runner.model.forward_features(fb, runner.kv_pool, aux)
    logp = torch.log_softmax(logits.float(), dim=-1)[:, draft_to_target]
    vals, idx = logp.topk(label_topk, dim=-1)
    top1 = logits.argmax(-1).to(torch.int32)
    out, start = [], 0
    for c, t, n in zip(group, ids, lens, strict=True):
        sl = slice(start, start + n)
        out.append({"ids": t.to(torch.int32), "prompt_len": c["prompt_len"],
                    "features": feats[sl].to(torch.float16),
                    "label_ids": idx[sl].to(torch.int16), "label_logp": vals[sl].half(),
                    "target_top1": top1[sl]})
        start += n
    return out


# ---- CLI -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m training.train_eagle",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", default=DEFAULT_WORK_DIR)
    ap.add_argument("--out", default=DEFAULT_HEAD,
                    help="the head's folder (default: the shipped head's, replaced)")
    ap.add_argument("--stop-after", choices=STAGES, default="export")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads for capture and training (default: every core)")
    ap.add_argument("--init-head", default=None,
                    help="continue training this head folder (its weights and draft "
                         "vocabulary) on this work dir's data, instead of a fresh head")
    g = ap.add_argument_group("data")
    g.add_argument("--num-shards", type=int, default=8)
    g.add_argument("--shard-size", type=int, default=64, help="conversations per shard")
    g.add_argument("--user-max-tokens", type=int, default=64)
    g.add_argument("--answer-max-tokens", type=int, default=256)
    g.add_argument("--rework-frac", type=float, default=0.25,
                   help="copy-heavy conversations per shard, as a fraction of --shard-size")
    g.add_argument("--code-frac", type=float, default=0.0,
                   help="code tasks over the standard library's source per shard, as a "
                        "fraction of --shard-size")
    g.add_argument("--doc-frac", type=float, default=0.0,
                   help="extraction tasks over synthetic documents per shard, as a fraction "
                        "of --shard-size")
    g.add_argument("--chat-frac", type=float, default=0.0,
                   help="per shard, this fraction of --shard-size more: everyday questions "
                        "as people type them (train_eagle_prompts.chat_task), answered greedily")
    g.add_argument("--gen-budget-min", type=float, default=0.0,
                   help="start no new data shard after this many minutes (0: no limit)")
    g = ap.add_argument_group("vocab / capture")
    g.add_argument("--draft-vocab-size", type=int, default=8192)
    g.add_argument("--label-topk", type=int, default=32)
    g.add_argument("--capture-tokens", type=int, default=2048,
                   help="tokens per capture forward (several conversations packed)")
    g = ap.add_argument_group("train")
    g.add_argument("--unroll", type=int, default=5, help="training-time-test steps K")
    g.add_argument("--steps", type=int, default=1000)
    g.add_argument("--batch-tokens", type=int, default=1024)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup", type=int, default=50)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip", type=float, default=0.5)
    g.add_argument("--train-dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: bf16 autocast where the CPU has bf16 matrix hardware")
    g.add_argument("--ckpt-every-s", type=float, default=120.0)
    g.add_argument("--heldout", type=float, default=0.05)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    work = os.path.abspath(os.path.expanduser(args.work_dir))
    os.makedirs(work, exist_ok=True)
    stages = (stage_data, stage_vocab, stage_capture, stage_train, stage_export)
    for stage in stages[: STAGES.index(args.stop_after) + 1]:
        stage(args, work)


if __name__ == "__main__":
    main()
