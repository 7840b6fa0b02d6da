"""DRY and XTC (llama.cpp's samplers): the penalty and the exclusion against plain references
written here, the parameters' checks, and DRY under speculative decoding on the real model."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sglang_like.layers import sampler as sampler_mod
from sglang_like.layers.dry import BreakerTable, VocabIndex, resolve_breaker
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.scheduler.spec_verify import takes_argmax

# a toy vocabulary: 5 is "\n" and 6 holds ":" (breakers alone); "<end>" is split over tokens,
# as "<e" + "nd>" (7, 8) or " <" + "e" + "nd>" (9, 4, 8)
VOCAB = (b"a", b"b", b"c", b"d", b"e", b"\n", b"x:", b"<e", b"nd>", b" <", b"n", b"d>")
BREAKERS = ["\n", ":", "<end>"]
BREAKER_SEQS = [(5,), (6,), (7, 8), (9, 4, 8)]
V = len(VOCAB)


class ToyTokenizer:
    token_bytes = VOCAB

    def encode(self, text: str) -> list[int]:
        """Greedy longest match over VOCAB."""
        data, out = text.encode(), []
        while data:
            tok = max((t for t, b in enumerate(VOCAB) if data.startswith(b)),
                      key=lambda t: len(VOCAB[t]))
            out.append(tok)
            data = data[len(VOCAB[tok]):]
        return out


def reference_dry(context: list[int], mult: float, base: float, allowed: int, last_n: int,
                  breaker_seqs: list[tuple[int, ...]]) -> dict[int, float]:
    """llama.cpp's DRY written plainly: token -> penalty."""
    w = context[-last_n:] if last_n > 0 else list(context)
    n = len(w)
    if n <= allowed:
        return {}
    limit = n  # tokens after the latest complete breaker
    for pos in range(n - 1, -1, -1):
        fits = [len(s) for s in breaker_seqs if tuple(w[pos : pos + len(s)]) == s]
        if fits:
            limit = n - pos - max(fits)
            break
    if limit < allowed:
        return {}
    longest: dict[int, int] = {}
    for j in range(n - 1):
        k = 0
        while k <= j and w[j - k] == w[n - 1 - k]:
            k += 1
        k = min(k, limit)
        if k >= allowed:
            longest[w[j + 1]] = max(longest.get(w[j + 1], 0), k)
    singles = {s[0] for s in breaker_seqs if len(s) == 1}
    out = {}
    for tok, k in longest.items():
        if tok in singles:
            continue
        exponent = k - allowed
        if base > 1.000001:
            exponent = min(exponent, int(88.7228391 / math.log(base)))
        out[tok] = min(mult * base**exponent, 1e30)
    return out


def _dry_penalties(context: list[int], split: int | None = None, **params) -> dict[int, float]:
    """What the sampler subtracts from a zero logits row of a request whose prompt is
    context[:split] and output the rest (greedy, so nothing else touches the row)."""
    sp = SamplingParams.from_dict({"temperature": 0.0, "dry_multiplier": 0.8,
                                   "dry_sequence_breakers": BREAKERS, **params})
    split = len(context) // 2 if split is None else split
    req = Req("r", context[:split], sp)
    req.output_ids = context[split:]
    logits = torch.zeros(1, V)
    sampler_mod.Sampler(frozenset({0}), V, ToyTokenizer()).sample(logits, [req])
    return {t: -float(v) for t, v in enumerate(logits[0].tolist()) if v != 0.0}


def test_breaker_table_from_the_vocabulary() -> None:
    vocab = VocabIndex(ToyTokenizer())
    table = BreakerTable([resolve_breaker(b, vocab) for b in BREAKERS], V)
    assert {t: table.tails(t) for t in range(V) if table.tails(t)} == {
        5: ((),), 6: ((),), 7: ((8,),), 9: ((4, 8),)}
    assert table.is_single.nonzero()[0].tolist() == [5, 6]
    assert table.is_head.nonzero()[0].tolist() == [5, 6, 7, 9]


def test_vocab_index_lookups_are_the_plain_scans() -> None:
    rng = random.Random(3)
    pieces = tuple(bytes(rng.choice(b"ab\x00\xff") for _ in range(rng.randint(0, 5)))
                   for _ in range(300))
    vocab = VocabIndex(type("T", (), {"token_bytes": pieces, "encode": None})())
    for length in (1, 2, 3):
        for _ in range(40):
            probe = bytes(rng.choice(b"ab\x00\xff") for _ in range(length))
            assert sorted(vocab.ending_with(probe)) == [
                t for t, p in enumerate(pieces) if p.endswith(probe)]
            assert vocab.containing(probe).tolist() == [
                t for t, p in enumerate(pieces) if probe in p]


def test_the_token_extending_a_repeat_gets_the_exponential_penalty() -> None:
    # "1 2 3 1 2 3 1 2": the repeat "1 2 3 1 2" (5 tokens) goes on with 3; nothing else
    got = _dry_penalties([1, 2, 3, 1, 2, 3, 1, 2], dry_allowed_length=2)
    assert got == pytest.approx({3: 0.8 * 1.75**3})
    # allowed_length: a repeat of 2 is allowed at 3, penalized (base ** 0) at 2 and 1
    assert _dry_penalties([0, 1, 2, 3, 0, 1], dry_allowed_length=3) == {}
    assert _dry_penalties([0, 1, 2, 3, 0, 1], dry_allowed_length=2) == pytest.approx({2: 0.8})
    assert _dry_penalties([0, 1, 2, 3, 0, 1], dry_allowed_length=1) == pytest.approx(
        {2: 0.8 * 1.75})
    # dry_base and dry_multiplier
    assert _dry_penalties([1, 2, 3, 1, 2], dry_allowed_length=1, dry_base=3.0,
                          dry_multiplier=2.0) == pytest.approx({3: 2.0 * 3.0})


def test_sequence_breakers_stop_the_match() -> None:
    ctx = [0, 5, 1, 2, 3, 0, 5, 1, 2]  # "a \n b c d a \n b c"
    # without breakers the repeat "a \n b c" (4) continues with d
    assert _dry_penalties(ctx, dry_sequence_breakers=[]) == pytest.approx({3: 0.8 * 1.75**2})
    # with "\n" a repeat cannot reach past it: only "b c" (2) counts
    assert _dry_penalties(ctx) == pytest.approx({3: 0.8})
    # ending on a breaker: no penalty at all; a breaker token itself is never penalized
    assert _dry_penalties([0, 1, 2, 0, 1, 2, 5]) == {}
    assert _dry_penalties([0, 1, 5, 0, 1]) == {}
    # the multi-token breaker "<end>" (as 7 8) counts only when complete
    assert _dry_penalties([0, 1, 2, 7, 8, 0, 1, 2, 7, 8, 0, 1]) == pytest.approx({2: 0.8})
    assert _dry_penalties([0, 1, 2, 7, 0, 1, 2, 7, 0, 1]) == pytest.approx(
        {2: 0.8 * 1.75**4})


def test_dry_matches_the_reference_on_random_contexts() -> None:
    rng = random.Random(0)
    for trial in range(400):
        n = rng.randint(1, 90)
        # few distinct tokens (many repeats) and, now and then, a breaker piece
        context = [rng.choice([0, 1, 2, 3]) if rng.random() > 0.08 else rng.randint(4, 11)
                   for _ in range(n)]
        params = {"dry_allowed_length": rng.choice([1, 2, 3, 5]),
                  "dry_base": rng.choice([1.0, 1.75, 3.0]),
                  "dry_penalty_last_n": rng.choice([-1, 7, 40])}
        want = reference_dry(context, 0.8, params["dry_base"], params["dry_allowed_length"],
                             params["dry_penalty_last_n"], BREAKER_SEQS)
        got = _dry_penalties(context, split=rng.randint(0, n), **params)
        assert got == pytest.approx(want, rel=1e-5), (trial, context, params)


def test_long_repeats_and_the_exponent_clamp() -> None:
    context = [1, 2, 3] * 120  # repeats longer than the blocks the match is extended by
    for base, allowed in ((1.75, 2), (1.01, 4), (3.0, 50)):
        want = reference_dry(context, 0.8, base, allowed, -1, BREAKER_SEQS)
        got = _dry_penalties(context, dry_base=base, dry_allowed_length=allowed)
        assert list(got) == [1] and got == pytest.approx(want, rel=1e-5)
    assert _dry_penalties(context)[1] == pytest.approx(1e30)  # kept finite


def test_dry_off_and_on() -> None:
    assert not SamplingParams(dry_multiplier=0.8, dry_penalty_last_n=0).has_penalties
    assert not SamplingParams().has_penalties
    assert SamplingParams(dry_multiplier=0.8).has_penalties
    assert _dry_penalties([1, 2, 3, 1, 2], dry_multiplier=0.0) == {}
    # a DRY row never takes the speculative / argmax-only shortcut
    req = Req("r", [1, 2], SamplingParams(temperature=0.0, dry_multiplier=0.8))
    req.output_ids = [3]
    assert not takes_argmax(req)
    req.sampling_params = SamplingParams(temperature=0.0)
    assert takes_argmax(req)


def test_greedy_rows_move_off_the_repeat_and_other_rows_are_untouched() -> None:
    logits = torch.zeros(2, V)
    logits[:, 3] = 1.0  # the repeat's continuation is the argmax of both rows
    plain = Req("p", [0, 1, 2, 3, 0, 1, 2], SamplingParams(temperature=0.0))
    dry = Req("d", [0, 1, 2, 3, 0, 1, 2], SamplingParams(temperature=0.0, dry_multiplier=2.0,
                                                           dry_sequence_breakers=[]))
    out = sampler_mod.Sampler(frozenset({11}), V, ToyTokenizer()).sample(logits, [plain, dry])
    assert out.next_token_ids[0] == 3 and out.next_token_ids[1] != 3
    assert logits[0].tolist() == [0.0, 0.0, 0.0, 1.0] + [0.0] * (V - 4)


def _bitmask(allowed: list[int]) -> torch.Tensor:
    return torch.tensor([[sum(1 << t for t in allowed)]], dtype=torch.int32)


def test_grammar_masked_rows() -> None:
    """The grammar's mask comes after the penalties: a token DRY penalizes beyond any logit
    is still taken when it is the only one allowed; XTC chooses among the allowed only."""
    sampler = sampler_mod.Sampler(frozenset({11}), V, ToyTokenizer())
    req = Req("g", [1, 2, 3] * 80 + [1, 2], SamplingParams(temperature=0.0, dry_multiplier=5.0,
                                                           dry_sequence_breakers=[]))
    req.grammar = object()  # only read as "has a grammar"
    logits = torch.zeros(1, V)
    assert sampler.sample(logits, [req], _bitmask([3])).next_token_ids == [3]
    assert float(logits[0, 3]) == pytest.approx(-1e30)  # 5 * 1.75 ** 158 is no float32
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4)])
    xtc = _xtc_req(0, xtc_probability=1.0, xtc_threshold=0.1)
    # every allowed token holds 0.1 or more of the allowed mass: only the least likely stays
    for allowed, want in (([0, 1, 2], 2), ([0, 1], 1), ([1, 2], 2), ([0, 2], 2)):
        logits = torch.log(probs).clone()
        assert sampler.sample(logits, [xtc], _bitmask(allowed)).next_token_ids == [want]


# ---- XTC --------------------------------------------------------------------------------
def reference_xtc(probs: list[float], threshold: float) -> list[float]:
    """Drop every token holding at least `threshold` of the mass but the least likely of
    them, when two or more do."""
    total = sum(probs)
    above = [i for i, p in enumerate(probs) if p > 0 and p / total >= threshold]
    if len(above) < 2:
        return list(probs)
    spared = min(above, key=lambda i: probs[i])
    return [0.0 if i in above and i != spared else p for i, p in enumerate(probs)]


@pytest.mark.parametrize(("probs", "threshold", "kept"), [
    ([0.4, 0.3, 0.2, 0.1], 0.25, [0.0, 0.3, 0.2, 0.1]),
    ([0.4, 0.3, 0.2, 0.1], 0.35, [0.4, 0.3, 0.2, 0.1]),  # one above: nothing removed
    ([0.4, 0.3, 0.2, 0.1], 0.1, [0.0, 0.0, 0.0, 0.1]),
    ([4.0, 0.0, 3.0, 2.0], 0.3, [0.0, 0.0, 3.0, 2.0]),  # shares of the row's mass
    ([0.6, 0.0, 0.0, 0.4], 0.0, [0.0, 0.0, 0.0, 0.4]),  # a zero is no candidate
])
def test_xtc_exclusion(probs: list[float], threshold: float, kept: list[float]) -> None:
    assert reference_xtc(probs, threshold) == kept
    got = sampler_mod._exclude_top_choices(torch.tensor([probs]), torch.tensor([threshold]))
    assert got[0].tolist() == pytest.approx(kept)


def _xtc_req(seed: int, **params) -> Req:
    req = Req("x", [1], SamplingParams.from_dict({"seed": seed, **params}))
    req.generator = torch.Generator().manual_seed(seed)
    return req


def _reference_draw(row: torch.Tensor, seed: int, xtc_probability: float, threshold: float,
                    top_k: int) -> tuple[int, bool]:
    """(token, whether XTC removed any): the request's generator gives XTC's chance, then
    the draw's uniform; top-k keeps the k most likely (drawn in rank order), no cut draws
    over the ids in order."""
    g = torch.Generator().manual_seed(seed)
    chance, u = float(torch.rand(1, generator=g)), float(torch.rand(1, generator=g))
    probs = row.tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])[:top_k] if top_k > 0 \
        else list(range(len(probs)))
    weights = [probs[i] for i in order]
    if chance <= xtc_probability:
        weights = reference_xtc(weights, threshold)
    acted = weights != [probs[i] for i in order]
    total, acc = sum(weights), 0.0
    for w, tok in zip(weights, order, strict=True):
        acc += w
        if w > 0 and u * total < acc:
            return tok, acted
    return max(tok for w, tok in zip(weights, order, strict=True) if w > 0), acted


@pytest.mark.parametrize("top_k", [-1, 5])
@pytest.mark.parametrize("xtc_probability", [1.0, 0.5])
def test_xtc_draws_equal_the_reference_and_a_seed_reproduces(top_k: int,
                                                             xtc_probability: float) -> None:
    g = torch.Generator().manual_seed(1)
    sharpness = torch.tensor([1.0, 2.0, 3.0, 6.0, 15.0, 30.0]).unsqueeze(1)  # flat to peaked
    probs = torch.softmax(torch.randn(6, 40, generator=g) * sharpness, dim=-1)
    params = {"xtc_probability": xtc_probability, "xtc_threshold": 0.1, "top_k": top_k}
    acted = []
    for seed in range(40):
        reqs = [_xtc_req(seed * 10 + i, **params) for i in range(len(probs))]
        got = sampler_mod._sample(probs.clone(), reqs, sampler_mod._xtc_thresholds(reqs))
        for i, tok in enumerate(got):
            want, did = _reference_draw(probs[i], seed * 10 + i, xtc_probability, 0.1, top_k)
            assert tok == want, (seed, i)
            acted.append(did)
    # the rows exercise both ways: XTC acting, and not (one above threshold, or the chance)
    assert any(acted) and not all(acted)
    # the same seeds draw the same tokens, with other rows around them or not
    sampler = sampler_mod.Sampler(frozenset({0}), 40)
    alone = [sampler.sample(torch.log(probs[i : i + 1]).clone(), [_xtc_req(7, **params)])
             .next_token_ids[0] for i in range(len(probs))]
    batch = sampler.sample(torch.log(probs).clone(), [_xtc_req(7, **params) for _ in probs])
    assert batch.next_token_ids == alone


# ---- checks -------------------------------------------------------------------------------
@pytest.mark.parametrize(("params", "message"), [
    ({"dry_multiplier": -0.1}, r"dry_multiplier must be in \[0.0, 100.0\]"),
    ({"dry_base": 0.5}, r"dry_base must be in \[1.0, 100.0\]"),
    ({"dry_allowed_length": 0}, "dry_allowed_length must be in"),
    ({"dry_allowed_length": 2.5}, "dry_allowed_length must be an integer"),
    ({"dry_penalty_last_n": -2}, r"dry_penalty_last_n must be in \[-1, "),
    ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers must be a list of strings"),
    ({"dry_sequence_breakers": [""]}, "1 to 40 characters"),
    ({"dry_sequence_breakers": ["x" * 41]}, "1 to 40 characters"),
    ({"dry_sequence_breakers": ["a"] * 17}, "at most 16 dry_sequence_breakers"),
    ({"dry_sequence_breakers": ["\ud800"]}, "valid Unicode text"),
    ({"xtc_probability": 1.5}, r"xtc_probability must be in \[0.0, 1.0\]"),
    ({"xtc_threshold": -0.1}, r"xtc_threshold must be in \[0.0, 1.0\]"),
    ({"xtc_probability": 0.5, "temperature": 0.0}, "xtc_probability needs sampling"),
    ({"xtc_probability": 0.5, "top_k": 1}, "xtc_probability needs sampling"),
])
def test_out_of_range_values_are_refused(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(params)


def test_defaults_and_round_trip() -> None:
    sp = SamplingParams()
    assert (sp.dry_multiplier, sp.dry_base, sp.dry_allowed_length, sp.dry_penalty_last_n,
            sp.xtc_probability, sp.xtc_threshold) == (0.0, 1.75, 2, -1, 0.0, 0.1)
    assert sp.dry_breakers == ("\n", ":", '"', "*")
    params = {"dry_multiplier": 0.8, "dry_sequence_breakers": ["\n\n"], "xtc_probability": 0.5}
    again = SamplingParams.from_dict(SamplingParams.from_dict(params).to_dict())
    assert again.dry_breakers == ("\n\n",) and again.xtc_probability == 0.5


# ---- the real model ----------------------------------------------------------------------
@pytest.mark.slow
def test_dry_under_speculative_decoding_is_plain_decoding(make_engine) -> None:
    """A verify's walk samples every node through the sampler with the tokens committed so
    far, so DRY penalizes exactly as in plain decoding: the same greedy tokens. Here the
    output copies the sentence (the n-gram drafter proposes it) until DRY cuts the copy."""
    prompt = ("Sentence: the quick brown fox jumps over the lazy dog and runs far away into "
              "the woods.\nRepeat the sentence: the quick")
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True,
              "dry_multiplier": 0.8, "dry_allowed_length": 4}
    plain = make_engine(enable_deterministic_inference=True, max_total_tokens=2048)
    want = plain.generate(prompt, params)["output_ids"]
    copying = plain.generate(prompt, {**params, "dry_multiplier": 0.0})["output_ids"]
    assert want[:4] == copying[:4] and want != copying  # DRY acts mid-copy
    plain.shutdown()
    spec = make_engine(enable_deterministic_inference=True, max_total_tokens=2048,
                       speculative_algorithm="NGRAM", speculative_auto_disable=False)
    got = spec.generate(prompt, params)
    assert got["output_ids"] == want
    assert got["meta_info"]["spec_verify_ct"] < len(want)  # drafts were accepted
