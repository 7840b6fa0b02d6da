"""The EAGLE-3 training step (packed batches, the training-time-test unroll, the loop) and
the work dir's bookkeeping every stage shares (log lines, atomic saves, timings, data shards).

Conventions (the ones inference runs; see `Eagle3Head`): a conversation is tokens x_0..x_{T-1}
with target features f_p (the residual stream entering the capture layers at position p) and
soft labels s_p (the target's distribution of x_{p+1}, over the draft vocabulary).
Row p at unroll step k stands for draft position p+k (RoPE position p+k), takes input token
x_{p+k+1} and feature project(f_p) at k=0 or its own `out` of step k-1, attends to the step-0
keys of rows 0..p and to its own keys of steps 1..k, and predicts x_{p+k+2}: its target is
s_{p+k+1}. Loss = sum_k 0.8^k * soft cross-entropy (mean over valid rows).

Several conversations are packed into one row sequence; a segment id per row keeps their
attention apart and RoPE positions restart per conversation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sglang_like.speculative.eagle_head import Eagle3Config, Eagle3Head

# the data stage's settings, recorded in the work dir so that the card reports what made the
# data rather than the options of a later call
DATA_KEYS = ("seed", "shard_size", "user_max_tokens", "answer_max_tokens", "rework_frac",
             "code_frac", "doc_frac", "chat_frac")


# ---- the work dir ---------------------------------------------------------------------------
def log(msg: str) -> None:
    """A timestamped progress line of the pipeline."""
    print(f"[train_eagle {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save_atomic(obj: Any, path: str) -> None:
    """torch.save through a temporary file: an interrupted run leaves no half-written file
    for the next one to take as done."""
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def timings(work: str) -> dict[str, float]:
    """Wall seconds per stage, summed over every run in this work dir."""
    path = os.path.join(work, "timings.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return {}


def add_timing(work: str, stage: str, seconds: float) -> None:
    """Add a run's wall seconds to `stage`'s total (a resumed stage counts every run)."""
    t = timings(work)
    t[stage] = t.get(stage, 0.0) + seconds
    with open(os.path.join(work, "timings.json"), "w", encoding="utf-8") as f:
        json.dump(t, f, indent=2)


def data_config(work: str, args: argparse.Namespace) -> argparse.Namespace:
    """The data stage's settings as it recorded them (those of `args` where it did not)."""
    path = os.path.join(work, "data_config.json")
    saved = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    return argparse.Namespace(**(vars(args) | saved))


def data_shards(work: str) -> list[str]:
    """The data stage's shard files, in order."""
    ddir = os.path.join(work, "data")
    return sorted(os.path.join(ddir, f) for f in os.listdir(ddir)
                  if f.startswith("shard_") and f.endswith(".pt"))


def data_stats(work: str) -> dict[str, int]:
    """Conversations, answer and total tokens, and distinct answer tokens of the data."""
    convs = ans = tot = 0
    distinct: set[int] = set()
    for path in data_shards(work):
        for c in torch.load(path)["convs"]:
            convs += 1
            ans += len(c["ids"]) - c["prompt_len"]
            tot += len(c["ids"])
            distinct.update(c["ids"][c["prompt_len"]:])
    return {"conversations": convs, "answer_tokens": ans, "total_tokens": tot,
            "distinct_answer_tokens": len(distinct)}


# ---- the head --------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    unroll: int = 5  # K
    steps: int = 1000
    batch_tokens: int = 1024
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 0.5
    seed: int = 0
    step_decay: float = 0.8
    ckpt_every_s: float = 120.0
    bf16: bool = False  # autocast the forward to bf16 (matmuls; losses and softmax in fp32)


def build_head(config: Eagle3Config, lm_head_rows: torch.Tensor | None, d2t: torch.Tensor,
               t2d: torch.Tensor, seed: int = 0) -> Eagle3Head:
    """A fresh head (seeded init), its LM head from the target's rows of the draft vocab."""
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        if lm_head_rows is not None:
            head.lm_head.weight.copy_(lm_head_rows.float())
        for norm in (head.norm, head.midlayer.input_layernorm, head.midlayer.hidden_norm,
                     head.midlayer.post_attention_layernorm):
            norm.weight.fill_(1.0)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head


# ---- batches ------------------------------------------------------------------------------
def pack_epoch(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Conversation indices in a seeded order of this epoch, greedily packed into batches of
    at most `batch_tokens` rows (a longer conversation is a batch alone, cut to the size)."""
    order = list(range(len(lengths)))
    random.Random(seed * 7919 + epoch).shuffle(order)
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        n = min(lengths[i], batch_tokens)
        if cur and used + n > batch_tokens:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches


def make_batch(convs: list[dict], idxs: list[int], embed_table: torch.Tensor,
               batch_tokens: int) -> dict[str, torch.Tensor]:
    """Pack conversations into row tensors. loss_mask[q]: s_q is a target worth learning
    (it predicts an answer token, q >= prompt_len - 1)."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in (
        "ids", "pos", "seg", "features", "label_ids", "label_logp", "loss_mask", "top1")}
    for s, i in enumerate(idxs):
        c = convs[i]
        t = min(int(c["ids"].numel()), batch_tokens)
        parts["ids"].append(c["ids"][:t].long())
        parts["pos"].append(torch.arange(t))
        parts["seg"].append(torch.full((t,), s, dtype=torch.long))
        parts["features"].append(c["features"][:t])
        parts["label_ids"].append(c["label_ids"][:t].long())
        parts["label_logp"].append(c["label_logp"][:t].float())
        parts["loss_mask"].append(torch.arange(t) >= c["prompt_len"] - 1)
        parts["top1"].append(c["target_top1"][:t].long())
    b = {k: torch.cat(v) for k, v in parts.items()}
    b["embeds"] = embed_table[b["ids"]].float()
    return b


# ---- the unroll ---------------------------------------------------------------------------
def _shift(x: torch.Tensor, k: int, fill: float | int = 0) -> torch.Tensor:
    """Row p gets x[p + k] (rows past the end get `fill`)."""
    if k == 0:
        return x
    pad = torch.full((k, *x.shape[1:]), fill, dtype=x.dtype)
    return torch.cat([x[k:], pad])


def unroll(head: Eagle3Head, batch: dict[str, torch.Tensor], rope: Any, unroll_steps: int,
           step_decay: float = 0.8, collect: list | None = None
           ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """(weighted loss, per step (rows, head argmax == target's draft-vocab argmax, head's
    target id == target's full-vocab argmax)). `collect` receives each step's logits."""
    c = head.config
    n = batch["ids"].numel()
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    group = hq // hkv
    scale = d ** -0.5
    seg, pos = batch["seg"], batch["pos"]
    # conversations attend only within themselves: one causal block each (not an n x n
    # matrix masked to its diagonal blocks, which costs ~n / mean length times more)
    counts = torch.unique_consecutive(seg, return_counts=True)[1].tolist()
    causal = torch.ones(max(counts), max(counts), dtype=torch.bool).tril()  # [query, key]
    neg = torch.finfo(torch.float32).min
    hidden = head.project(batch["features"])
    k0 = v0 = None  # step 0's keys / values, split per conversation: [hq, m, d] each
    diag_k: list[torch.Tensor] = []  # [hq, n, d] per step >= 1 (repeated for GQA)
    diag_v: list[tuple[torch.Tensor, ...]] = []  # the same values, split per conversation
    total = torch.zeros(())
    stats = []
    for k in range(unroll_steps):
        tok_embeds = _shift(batch["embeds"], k + 1)
        q, kk, vv = head.qkv(tok_embeds, hidden)
        tables = rope.tables(pos + k)  # draft position p + k
        q, kk = tables.rotate(q), tables.rotate(kk)
        kk = kk.repeat_interleave(group, dim=1).transpose(0, 1)  # [hq, n, d]
        vv = vv.float().repeat_interleave(group, dim=1).transpose(0, 1)
        if k == 0:
            k0, v0 = kk.split(counts, dim=1), vv.split(counts, dim=1)
        else:
            diag_k.append(kk)
            diag_v.append(vv.split(counts, dim=1))
        qh = q.transpose(0, 1)  # [hq, n, d]
        # row p's own keys of steps 1..k: one score each, [hq, n, k]
        extra = (torch.cat([(qh.float() * dk.float()).sum(-1, keepdim=True) for dk in diag_k],
                           dim=-1) * scale).split(counts, dim=1) if diag_k else None
        blocks = []
        # split once (not sliced per block: a slice's backward writes a full-size zero grad)
        for i, (qb, kb, vb) in enumerate(zip(qh.split(counts, dim=1), k0, v0, strict=True)):
            m = qb.shape[1]
            scores = torch.matmul(qb, kb.transpose(1, 2)).float() * scale
            scores = scores.masked_fill(~causal[:m, :m], neg)  # [hq, m, m]
            if extra is not None:
                scores = torch.cat([scores, extra[i]], dim=-1)
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs[..., :m], vb)  # [hq, m, d]
            for j, dv in enumerate(diag_v):
                o = o + probs[..., m + j: m + j + 1] * dv[i]
            blocks.append(o)
        attn = torch.cat(blocks, dim=1)  # [hq, n, d]
        out = head.finish(attn.transpose(0, 1).reshape(n, hq * d), hidden)
        logits = head.logits(out)
        if collect is not None:
            collect.append(logits.detach())
        # targets: s_{p+k+1}, valid while p+k+1 is in the same conversation
        tgt = k + 1
        valid = (_shift(seg, tgt, -1) == seg) & _shift(batch["loss_mask"], tgt, False)
        lab_ids = _shift(batch["label_ids"], tgt)
        lab_p = torch.softmax(_shift(batch["label_logp"], tgt, -1e4), dim=-1)
        logq = torch.log_softmax(logits, dim=-1)
        ce = -(lab_p * logq.gather(1, lab_ids)).sum(-1)
        cnt = int(valid.sum())
        if cnt:
            total = total + (step_decay ** k) * ce[valid].mean()
            with torch.no_grad():
                pred = logits.argmax(-1)
                hit = int((pred == lab_ids[:, 0])[valid].sum())
                hit_full = int((head.to_target_ids(pred) == _shift(batch["top1"], tgt))[valid]
                               .sum())
        else:
            hit = hit_full = 0
        stats.append((cnt, hit, hit_full))
        hidden = out
    return total, stats


@torch.no_grad()
def evaluate(head: Eagle3Head, convs: list[dict], embed_table: torch.Tensor, rope: Any,
             unroll_steps: int, batch_tokens: int) -> list[dict[str, float]]:
    """Per unroll step: rows, top-1 accuracy vs the target's draft-vocab argmax and vs its
    full-vocab argmax."""
    lengths = [int(c["ids"].numel()) for c in convs]
    batches = pack_epoch(lengths, batch_tokens, 0, 0)
    acc = [[0, 0, 0] for _ in range(unroll_steps)]
    was = head.training
    head.eval()
    for idxs in batches:
        _, stats = unroll(head, make_batch(convs, idxs, embed_table, batch_tokens), rope,
                          unroll_steps)
        for a, s in zip(acc, stats, strict=True):
            for i in range(3):
                a[i] += s[i]
    head.train(was)
    return [{"rows": a[0], "acc": a[1] / max(a[0], 1), "acc_full_vocab": a[2] / max(a[0], 1)}
            for a in acc]


# ---- the loop ------------------------------------------------------------------------------
def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _save_ckpt(path: str, head: Eagle3Head, opt: torch.optim.Optimizer, step: int,
               cfg: TrainConfig, history: list[dict]) -> None:
    save_atomic({"step": step, "model": head.state_dict(), "optim": opt.state_dict(),
                 "config": asdict(cfg), "history": history,
                 "rng_torch": torch.get_rng_state(), "rng_py": random.getstate()}, path)


def train_loop(head: Eagle3Head, convs: list[dict], embed_table: torch.Tensor, rope: Any,
               cfg: TrainConfig, ckpt_path: str, stop_after_steps: int | None = None,
               progress: bool = False, log: Callable[[str], None] = print,
               log_every: int = 25) -> list[dict]:
    """Train `head` in place for cfg.steps optimizer steps, resuming from `ckpt_path` when it
    exists (weights, AdamW state, step, RNG). `stop_after_steps` ends this call early (as an
    interruption would, with a checkpoint). Returns the history ({step, loss, lr, acc...})."""
    head.train()
    params = [p for n, p in head.named_parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    step, history = 0, []
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, weights_only=False)
        head.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        step, history = ck["step"], ck["history"]
        torch.set_rng_state(ck["rng_torch"])
        random.setstate(ck["rng_py"])
        log(f"resumed from {ckpt_path} at step {step}")
    lengths = [int(c["ids"].numel()) for c in convs]
    epoch_cache: dict[int, list[list[int]]] = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step", smoothing=0.1)
    last_ckpt = time.perf_counter()
    run_steps = 0
    while step < cfg.steps:
        if stop_after_steps is not None and run_steps >= stop_after_steps:
            break
        # the batch of this step is a pure function of (seed, step): resumable
        nb = len(epoch_cache.setdefault(0, pack_epoch(lengths, cfg.batch_tokens, cfg.seed, 0)))
        epoch, b = divmod(step, nb)
        if epoch not in epoch_cache:
            epoch_cache[epoch] = pack_epoch(lengths, cfg.batch_tokens, cfg.seed, epoch)
        batch = make_batch(convs, epoch_cache[epoch][b], embed_table, cfg.batch_tokens)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss, stats = unroll(head, batch, rope, cfg.unroll, cfg.step_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        step += 1
        run_steps += 1
        rec = {"step": step, "loss": float(loss.detach()), "lr": lr_at(step - 1, cfg),
               "acc": [h / max(n, 1) for n, h, _ in stats]}
        history.append(rec)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc'][0]:.2f}")
        if step % log_every == 0:
            log(f"step {step}/{cfg.steps} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                f"acc {' '.join(f'{a:.2f}' for a in rec['acc'])}")
        if time.perf_counter() - last_ckpt > cfg.ckpt_every_s:
            _save_ckpt(ckpt_path, head, opt, step, cfg, history)
            last_ckpt = time.perf_counter()
    _save_ckpt(ckpt_path, head, opt, step, cfg, history)
    if bar is not None:
        bar.close()
    return history


def load_capture(paths: list[str]) -> list[dict]:
    """The captured conversations of these files, in order."""
    convs = []
    for p in paths:
        convs.extend(torch.load(p)["convs"])
    return convs
