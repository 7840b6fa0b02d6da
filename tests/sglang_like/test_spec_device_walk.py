"""A verify's walk with the device sampler on (CPU tensors), Scheduler.step() on a scripted
model whose rows are real distributions: a seeded sampled request outputs the same tokens
(and logprobs) with speculation as without, whatever its penalties, bias, min_new_tokens or
seed, because every tree node is drawn ahead as the request would draw it there; grammar, DRY
and XTC requests walk node by node beside them, and match as well.

The drafter drafts each request's own output from a run without speculation (with a wrong
sibling first at every depth), so a verify accepts deep paths exactly when the walk draws
what plain decoding drew: acceptance itself shows that drawing ahead is exact."""

from __future__ import annotations

import pytest
import torch

from sglang_like.model_loader import load_tokenizer
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.scheduler import Scheduler, SchedulerConfig
from sglang_like.speculative.tree import DraftTree

from .fake_runner import VOCAB, FakeRunner

EOS = frozenset({0, 2})
CANDIDATES = list(range(300, 312))  # where a row's mass is: tokens repeat, penalties bite


class SoftRunner(FakeRunner):
    """The scripted runner's rows turned into distributions: each row's logits over
    CANDIDATES (and EOS) are seeded by the scripted token, a hash of the row's sequence, so a
    verify's node row is exactly the plain decode's row at the same sequence."""

    def forward(self, batch, to_host: bool = True) -> torch.Tensor:
        hashes = super().forward(batch).argmax(dim=-1).tolist()
        logits = torch.full((len(hashes), VOCAB), -20.0)
        for k, h in enumerate(hashes):
            gen = torch.Generator().manual_seed(h)
            logits[k, CANDIDATES] = torch.randn(len(CANDIDATES), generator=gen) * 1.5
            logits[k, 2] = -0.5
        return logits


class OracleDrafter:
    """Drafts each request's output from `script` (rid -> the tokens it output without
    speculation) past what it has output: the first `right` drafts follow it, the rest go
    wrong, with a wrong sibling before the right child at every depth."""

    def __init__(self, script: dict[str, list[int]], depth: int, right: int) -> None:
        self.script, self.depth, self.right = script, depth, right
        self.num_draft_tokens = 1 + 2 * depth

    def propose(self, reqs, max_depths, ctx):
        trees = []
        for req, cap in zip(reqs, max_depths, strict=True):
            ahead = self.script[req.rid][len(req.output_ids):]
            tokens, parents, node = [req.fill_ids[-1]], [-1], 0
            for d in range(min(self.depth, cap, len(ahead))):
                true = ahead[d]
                wrong = CANDIDATES[(CANDIDATES.index(true) + 1) % len(CANDIDATES)] if (
                    true in CANDIDATES) else CANDIDATES[0]
                tokens.append(wrong)
                parents.append(node)
                tokens.append(true if d < self.right else wrong + 1)
                parents.append(node)
                node = len(tokens) - 1
            trees.append(DraftTree(tokens, parents))
        return trees


class AlternatingGrammar:
    """A grammar whose mask depends on what it accepted: candidates of even id, then odd,
    then even... (a node's mask needs the matcher advanced along its path)."""

    def __init__(self) -> None:
        self.num_accepted = 0

    def _allowed(self) -> list[int]:
        return [t for t in CANDIDATES if t % 2 == self.num_accepted % 2]

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = torch.zeros(bitmask.shape[1], dtype=torch.int64)
        for t in self._allowed():
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    def accept_token(self, token: int) -> bool:
        if token not in self._allowed():
            return False
        self.num_accepted += 1
        return True

    def is_terminated(self) -> bool:
        return False


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


SAMPLED = [  # (params, logprobs): every rule the device sampler applies
    (dict(temperature=0.9, top_k=5, repetition_penalty=1.3, seed=1), False),
    (dict(temperature=0.9, top_k=5, repetition_penalty=1.3, seed=11), False),  # n > 1
    (dict(top_p=0.9, frequency_penalty=0.6, presence_penalty=0.4,
          logit_bias={"303": 1.5, "305": -3.0}, seed=2), True),
    (dict(min_p=0.1, min_new_tokens=12, stop_token_ids=[307], seed=3), False),
    (dict(temperature=1.2, seed=4), True),
    (dict(temperature=0.0, presence_penalty=0.8), True),  # greedy, not a plain argmax
    (dict(temperature=0.0), False),
]
HOST_WALKED = [  # walked node by node: a grammar's mask, DRY and XTC on the host sampler
    (dict(temperature=0.8, seed=5, grammar=True), True),
    (dict(temperature=0.0, grammar=True), False),
    (dict(temperature=0.7, dry_multiplier=0.8, dry_allowed_length=1, seed=6), False),
    (dict(temperature=0.0, dry_multiplier=0.8, dry_allowed_length=1), False),
    (dict(temperature=1.0, xtc_probability=0.6, xtc_threshold=0.05, seed=7), True),
]


def _make(tokenizer, drafter=None) -> Scheduler:
    runner = SoftRunner(1024, 17, 256)
    config = SchedulerConfig(pool_size=1024, context_len=256, vocab_size=VOCAB,
                             max_running_requests=16, chunked_prefill_size=None,
                             check_accounting=True, device_sampling=True,
                             enable_jump_forward=False, speculative_auto_disable=False)
    return Scheduler(config, runner, tokenizer, EOS, drafter)


def _run(sched: Scheduler, cases: list[tuple[dict, bool]]) -> dict[str, Req]:
    for i, (params, logprobs) in enumerate(cases):
        params = dict(params)
        grammar = params.pop("grammar", False)
        req = Req(f"r{i}", [300 + i % 3, 301, 302 + i % 5, 300],
                  SamplingParams(max_new_tokens=24, **params), return_logprob=logprobs,
                  top_logprobs_num=2 if logprobs else 0)
        if grammar:
            req.grammar = AlternatingGrammar()
        sched.add_request(req)
    done = {}
    for _ in range(200):
        for r in sched.step():
            if r.is_finished:
                done[r.rid] = r
        if not sched.has_work:
            break
    assert len(done) == len(cases)
    return done


def _assert_same(got: dict[str, Req], want: dict[str, Req]) -> None:
    for rid, w in want.items():
        g = got[rid]
        assert g.output_ids == w.output_ids, (rid, w.sampling_params)
        assert g.finished_reason.to_dict() == w.finished_reason.to_dict(), rid
        assert [t for _, t in g.logprobs.output_token] == [t for _, t in w.logprobs.output_token]
        for (a, _), (b, _) in zip(g.logprobs.output_token, w.logprobs.output_token, strict=True):
            assert a == pytest.approx(b, abs=1e-6)
        assert [[t for _, t in top] for top in g.logprobs.output_top] == [
            [t for _, t in top] for top in w.logprobs.output_top]


@pytest.mark.parametrize(("depth", "right"), [(4, 4), (3, 1)])
def test_sampled_requests_output_what_they_output_without_speculation(tokenizer, depth, right,
                                                                      monkeypatch) -> None:
    want = _run(_make(tokenizer), SAMPLED)
    assert any(len(r.output_ids) < 24 for r in want.values())  # EOS / stop tokens end some
    script = {rid: r.output_ids for rid, r in want.items()}
    sched = _make(tokenizer, OracleDrafter(script, depth, right))
    ahead = sched.device_sampler.sample_ahead
    num_ahead = []
    monkeypatch.setattr(sched.device_sampler, "sample_ahead",
                        lambda *a: num_ahead.append(1) or ahead(*a))
    monkeypatch.setattr(sched.sampler, "sample", None)  # nothing walks on the host sampler
    got = _run(sched, SAMPLED)
    _assert_same(got, want)
    assert num_ahead
    # deep paths were accepted: the nodes drew what plain decoding drew there
    assert max(sched.spec_accept_lengths) == right + 1
    sampled = [got[f"r{i}"] for i, (p, _) in enumerate(SAMPLED) if "seed" in p]
    assert all(r.spec.accepted_drafts > 0 for r in sampled)


def test_a_mixed_verify_walks_some_requests_on_the_host(tokenizer, monkeypatch) -> None:
    """Grammar, DRY and XTC requests walk node by node, the others are drawn ahead, in the
    same verifies; every request outputs what it does without speculation (the scheduler
    samples DRY / XTC apart from the rest in plain decoding too, so nobody's draws depend on
    who shares the step)."""
    cases = SAMPLED[:4] + HOST_WALKED
    want = _run(_make(tokenizer), cases)
    script = {rid: r.output_ids for rid, r in want.items()}
    sched = _make(tokenizer, OracleDrafter(script, 3, 3))
    host = sched.sampler.sample
    host_rows = []
    monkeypatch.setattr(sched.sampler, "sample",
                        lambda logits, reqs, bitmask=None: host_rows.append(len(reqs))
                        or host(logits, reqs, bitmask))
    got = _run(sched, cases)
    _assert_same(got, want)
    assert host_rows and max(host_rows) <= 3  # DRY and XTC rows only
    assert all(r.spec.accepted_drafts > 0 for r in got.values())
    alternating = [got[f"r{i}"].output_ids for i, (p, _) in enumerate(cases) if "grammar" in p]
    assert all(t % 2 == k % 2 for ids in alternating for k, t in enumerate(ids))
