"""EAGLE-3 training: the unroll's semantics, the loss going down, resume == uninterrupted.

A tiny random-init head and random "captured" conversations; no real weights."""

from __future__ import annotations

import torch

from sglang_like.layers.rotary import RotaryEmbedding
from sglang_like.speculative.eagle_head import Eagle3Config
from training.train_eagle import build_draft_vocab
from training.train_eagle_core import (
    TrainConfig,
    build_head,
    evaluate,
    make_batch,
    train_loop,
    unroll,
)

torch.set_num_threads(1)

H, VOCAB, DRAFT = 32, 96, 48


def _config() -> Eagle3Config:
    return Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=VOCAB, draft_vocab_size=DRAFT,
                        target_hidden_size=H, rope_theta=10000.0, max_position_embeddings=256,
                        aux_layer_ids=[0, 1, 2])


def _data(n_convs: int = 12, seed: int = 0) -> tuple[list[dict], torch.Tensor, torch.Tensor,
                                                     torch.Tensor]:
    """Conversations whose labels are a learnable function (next token = a fixed map of the
    current one), features random; the draft vocab holds the even target ids."""
    g = torch.Generator().manual_seed(seed)
    d2t = torch.arange(DRAFT)  # draft d -> target 2d
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[::2] = True
    succ = torch.randperm(DRAFT, generator=g)  # draft id of the token after target id 2d
    convs = []
    for _ in range(n_convs):
        t = int(torch.randint(9, 20, (1,), generator=g))
        ids = [2 * int(torch.randint(0, DRAFT, (1,), generator=g))]
        for _ in range(t - 1):
            ids.append(2 * int(succ[ids[-1] // 2]))
        ids_t = torch.tensor(ids, dtype=torch.int32)
        nxt = succ[ids_t.long() // 2]
        others = (nxt[:, None] + torch.arange(1, 4)[None, :]) % DRAFT
        convs.append({
            "ids": ids_t, "prompt_len": 3,
            "features": torch.randn(t, 3 * H, generator=g).half(),
            "label_ids": torch.cat([nxt[:, None], others], 1).to(torch.int16),
            "label_logp": torch.tensor([-0.05, -4.0, -5.0, -6.0]).repeat(t, 1).half(),
            "target_top1": (2 * nxt).to(torch.int32),
        })
    embed_table = torch.randn(VOCAB, H, generator=g)
    return convs, embed_table, d2t, t2d


def _rope() -> RotaryEmbedding:
    return RotaryEmbedding(H // 4, 256, 10000.0, None, "cpu")


def test_draft_vocab_convention() -> None:
    d2t, t2d = build_draft_vocab([[5, 5, 5, 9, 9, 1, 7]], 12, 4, always={2})
    target = torch.arange(4) + d2t
    assert target.tolist() == [1, 2, 5, 9]  # 5, 9 most frequent; 1 beats 7 on the tie
    assert target.tolist() == sorted(target.tolist())
    assert t2d.sum() == 4 and bool(t2d[target].all())
    assert 2 in target.tolist() and 5 in target.tolist() and 9 in target.tolist()


def test_unroll_matches_step_by_step_drafting() -> None:
    """Row p at step k, computed the way inference drafts (explicit key list: step-0 keys of
    rows 0..p, then row p's own keys of steps 1..k), equals the batched unroll."""
    convs, table, d2t, t2d = _data(2)
    head = build_head(_config(), None, d2t, t2d, seed=1).eval()
    rope, K = _rope(), 3
    batch = make_batch(convs, [0, 1], table, 1024)
    got: list[torch.Tensor] = []
    with torch.no_grad():
        unroll(head, batch, rope, K, collect=got)
    c = head.config
    group = c.num_attention_heads // c.num_key_value_heads
    off = 0
    with torch.no_grad():
        for conv in convs:
            t = conv["ids"].numel()
            emb = table[conv["ids"].long()]
            f0 = head.project(conv["features"])
            # step-0 keys / values of every row
            q0, k0, v0 = head.qkv(emb[1:], f0[:-1])
            tab0 = rope.tables(torch.arange(t - 1))
            k0 = tab0.rotate(k0)
            for p in range(t - K - 1):
                keys, vals = list(k0[: p + 1]), list(v0[: p + 1].float())
                hidden = f0[p: p + 1]
                for k in range(K):
                    q, kk, vv = head.qkv(emb[p + k + 1: p + k + 2], hidden)
                    tab = rope.tables(torch.tensor([p + k]))
                    q, kk = tab.rotate(q), tab.rotate(kk)
                    if k > 0:
                        keys.append(kk[0])
                        vals.append(vv[0].float())
                    kt = torch.stack(keys).repeat_interleave(group, 1)  # [m, hq, d]
                    vt = torch.stack(vals).repeat_interleave(group, 1)
                    s = torch.einsum("hd,mhd->hm", q[0], kt) * c.head_dim ** -0.5
                    a = torch.einsum("hm,mhd->hd", s.softmax(-1), vt).reshape(1, -1)
                    out = head.finish(a, hidden)
                    torch.testing.assert_close(head.logits(out)[0], got[k][off + p],
                                               atol=1e-4, rtol=1e-4)
                    hidden = out
            off += t


def test_training_lowers_loss_and_resume_matches(tmp_path) -> None:
    convs, table, d2t, t2d = _data(12)
    cfg = TrainConfig(unroll=3, steps=24, batch_tokens=64, lr=3e-3, warmup=4, seed=0,
                      ckpt_every_s=1e9)
    rope = _rope()

    def fresh():
        return build_head(_config(), table[::2].clone(), d2t, t2d, seed=3)

    before = evaluate(fresh(), convs, table, rope, 3, 64)
    full = fresh()
    hist = train_loop(full, convs, table, rope, cfg, str(tmp_path / "a.pt"), log=lambda m: None)
    after = evaluate(full, convs, table, rope, 3, 64)
    assert len(hist) == 24
    first = sum(h["loss"] for h in hist[:4]) / 4
    last = sum(h["loss"] for h in hist[-4:]) / 4
    assert last < 0.7 * first, (first, last)
    assert after[0]["acc"] > before[0]["acc"] + 0.2, (before, after)

    # interrupted after 10 steps (checkpoint written), then resumed by a new process-like call
    part = fresh()
    ck = str(tmp_path / "b.pt")
    h1 = train_loop(part, convs, table, rope, cfg, ck, stop_after_steps=10, log=lambda m: None)
    assert len(h1) == 10
    torch.manual_seed(1234)  # a resumed run restores the RNG itself
    resumed = fresh()
    msgs: list[str] = []
    h2 = train_loop(resumed, convs, table, rope, cfg, ck, log=msgs.append)
    assert any("at step 10" in m for m in msgs)
    assert [h["step"] for h in h2] == list(range(1, 25))
    for (n, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=n)


def test_init_head_continues_from_a_saved_head(tmp_path) -> None:
    """`--init-head`: the train stage starts from a saved head's weights (measured on the
    held-out data before any step, the card's "before" column), keeps its card for the new
    one, and refuses a head whose draft vocabulary differs."""
    import argparse

    import pytest

    from sglang_like.speculative.eagle_head import load_eagle3_head
    from training.train_eagle_run import _load_init_head

    convs, table, d2t, t2d = _data(12)
    rope = _rope()
    cfg = TrainConfig(unroll=3, steps=24, batch_tokens=64, lr=3e-3, warmup=4, seed=0,
                      ckpt_every_s=1e9)
    trained = build_head(_config(), table[::2].clone(), d2t, t2d, seed=3)
    train_loop(trained, convs, table, rope, cfg, str(tmp_path / "a.pt"), log=lambda m: None)
    folder = tmp_path / "head"
    trained.save(str(folder))
    (folder / "README.md").write_text("# old head\n\n## Held-out accuracy\nold figures\n")
    saved = load_eagle3_head(str(folder))  # fp16 on disk

    work = tmp_path / "work"
    work.mkdir()
    args = argparse.Namespace(init_head=str(folder))
    s = {"config": _config(), "table": table, "rope": rope}
    fresh = build_head(_config(), table[::2].clone(), d2t, t2d, seed=5)
    untrained = evaluate(fresh, convs, table, rope, 3, 64)
    before = _load_init_head(args, str(work), fresh, convs, s, cfg)
    for (name, a), b in zip(fresh.state_dict().items(), saved.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    assert all(p.requires_grad for p in fresh.parameters())
    assert before == evaluate(saved, convs, table, rope, 3, 64)
    assert before[0]["acc"] > untrained[0]["acc"] + 0.2  # the saved head's skill
    assert "old figures" in (work / "init_head_card.md").read_text()

    other = d2t.clone()
    other[0] += 1  # another draft vocabulary
    with pytest.raises(ValueError, match="draft vocabulary"):
        _load_init_head(args, str(work), build_head(_config(), None, other, t2d), convs, s, cfg)


def _served_logits(runner, ids: torch.Tensor) -> torch.Tensor:
    from sglang_like.forward_batch import ForwardBatch

    n = ids.numel()
    row = runner.req_to_token_pool.alloc()
    runner.req_to_token_pool.req_to_token[row, :n] = torch.arange(1, n + 1, dtype=torch.int32)
    fb = ForwardBatch(input_ids=ids, positions=torch.arange(n), out_slots=torch.arange(1, n + 1),
                      req_pool_indices=torch.tensor([row]), prefix_lens=torch.tensor([0]),
                      extend_lens=torch.tensor([n]), logits_indices=torch.arange(n),
                      req_to_token=runner.req_to_token_pool.req_to_token, is_decode=False)
    return runner.model.forward_features(fb, runner.kv_pool, ())[0]


def test_packed_capture_equals_one_conversation_at_a_time() -> None:
    """The capture stage packs conversations into one prefill; each conversation's features
    and labels are what it gets alone (the real default model, served weights)."""
    from sglang_like.config import ServerArgs
    from sglang_like.engine_core.setup import build_engine_parts
    from training.train_eagle import capture_group

    parts = build_engine_parts(ServerArgs(max_total_tokens=512))
    runner = parts.runner
    tok = parts.tokenizer
    aux = tuple(runner.model.default_aux_layers())
    texts = ["The capital of France is Paris. It is known for",
             "def add(a, b):\n    return a + b\n\nprint(add(2,",
             "Three primary colors are red, blue and"]
    convs = [{"ids": tok.encode(t), "prompt_len": 2} for t in texts]
    draft_to_target = torch.arange(0, 49152, 6)
    rows: list[int] = []
    with torch.no_grad():
        together = capture_group(runner, aux, draft_to_target, 8, convs, rows)
        alone = [capture_group(runner, aux, draft_to_target, 8, [c], rows)[0]
                 for c in convs]
        # the labels are the served model's: its own logits, log-softmaxed, at the draft ids
        ids = torch.tensor(convs[0]["ids"])
        served = _served_logits(runner, ids)
    lp = torch.log_softmax(served, dim=-1)[:, draft_to_target]
    torch.testing.assert_close(alone[0]["label_logp"].float(), lp.topk(8, dim=-1).values,
                               atol=5e-2, rtol=0)
    assert (alone[0]["target_top1"] == served.argmax(-1)).float().mean() >= 0.9
    for c, a, b in zip(convs, alone, together, strict=True):
        n = len(c["ids"])
        assert a["features"].shape == b["features"].shape == (n, 3 * runner.model.config
                                                              .hidden_size)
        assert a["ids"].tolist() == b["ids"].tolist() == c["ids"]
        torch.testing.assert_close(a["features"].float(), b["features"].float(),
                                   atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(a["label_logp"].float(), b["label_logp"].float(),
                                   atol=5e-2, rtol=0)
        assert (a["target_top1"] == b["target_top1"]).float().mean() >= 0.9
        assert (a["label_ids"][:, 0] == b["label_ids"][:, 0]).float().mean() >= 0.9


def test_task_prompts_are_seeded_and_carry_their_material() -> None:
    """The task families of the data stage: the same seed gives the same turns; a code task
    holds a standard-library function or class that parses, an extraction task its document
    and the fields it asks for."""
    import ast
    import random

    from training import train_eagle_prompts as tp

    snippets = tp._stdlib_snippets()
    assert len(snippets) > 500
    for src in random.Random(0).sample(snippets, 50):
        assert isinstance(ast.parse(src).body[0], (ast.FunctionDef, ast.ClassDef))
    a, b = random.Random(5), random.Random(5)
    turns = [(tp.code_task(a), tp.extraction_task(a)) for _ in range(20)]
    assert turns == [(tp.code_task(b), tp.extraction_task(b)) for _ in range(20)]
    assert len({c for c, _ in turns}) == 20 and len({e for _, e in turns}) == 20
    for code, _ in turns:
        assert any(task in code for task in tp.CODE_TASKS)
        assert any(src in code for src in snippets)
    rng = random.Random(1)
    for _ in range(30):
        state = rng.getstate()
        turn = tp.extraction_task(rng)
        rng.setstate(state)
        doc, fields = rng.choice(tp._DOCUMENTS)(rng)
        rng.setstate(state)
        tp.extraction_task(rng)
        assert doc in turn
        asked = [f for f in fields if f in turn]
        assert len(asked) >= 2


def test_everyday_questions_are_seeded_varied_and_not_the_evaluations_prompts() -> None:
    """`chat_task`: the same seed gives the same questions, thousands of distinct ones, each
    a sentence of a question frame over a topic; none is a prompt the head is measured on
    (the speculative bench's chat workload, the shipped head's held-out test prompts)."""
    import random

    from benchmarks.common import WORKLOADS
    from tests.sglang_like.test_spec_heads import HELD_OUT
    from training import train_eagle_prompts as tp

    a, b = random.Random(3), random.Random(3)
    assert [tp.chat_task(a) for _ in range(50)] == [tp.chat_task(b) for _ in range(50)]
    rng = random.Random(0)
    asked = [tp.chat_task(rng) for _ in range(20000)]
    distinct = {q.lower() for q in asked}
    assert len(distinct) > 3000
    assert all(q.rstrip().endswith((".", "?")) for q in asked)
    frames = [f.split("{}")[0] for f, _ in tp._FRAMES] + [f.split("{}")[0] for f in
                                                           tp._PAIR_FRAMES]
    assert all(any(f.lower() in q.lower() for f in frames) for q in asked[:500])
    measured = {q.lower() for q in [*WORKLOADS["chat"], *HELD_OUT]}
    assert not distinct & measured
