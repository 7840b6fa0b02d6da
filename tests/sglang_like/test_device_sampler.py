"""The device sampler: greedy as the host's argmax, draws from the right distribution, seeds
that do not depend on the batch, rows drawn ahead (a tree's nodes) as they would be drawn
later, and one device-to-host copy a step under the CUDA profile."""

from __future__ import annotations

import pytest
import torch

from sglang_like.layers.device_sampler import DeviceSampler
from sglang_like.layers.sampler import Sampler
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from tests.sglang_like.cuda_profile import cuda_profile

V = 300
EOS = 2


def _req(seed: int | None = None, output: tuple[int, ...] = (), grammar: bool = False,
         return_logprob: bool = False, top_logprobs_num: int = 0, **params: object) -> Req:
    sp = SamplingParams(**params)
    req = Req(f"r{seed}", [5, 6, 7, 5], sp, return_logprob=return_logprob,
              top_logprobs_num=top_logprobs_num)
    req.output_ids = list(output)
    if not sp.is_greedy:
        req.generator = torch.Generator().manual_seed(seed or 0)
    if grammar:
        req.grammar = object()  # only its presence is read while sampling
    return req


def _logits(batch: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _bitmask(batch: int, allowed: list[list[int]]) -> torch.Tensor:
    bits = torch.zeros(batch, (V + 31) // 32, dtype=torch.int64)
    for i, ids in enumerate(allowed):
        for t in ids:
            bits[i, t // 32] |= 1 << (t % 32)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)


GREEDY_CASES = {
    "plain": dict(temperature=0.0),
    "repetition": dict(temperature=0.0, repetition_penalty=1.7),
    "frequency_presence": dict(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.5),
    "logit_bias": dict(temperature=0.0, logit_bias={"9": 30.0, "11": -5.0}),
    "min_new_tokens": dict(temperature=0.0, min_new_tokens=5, stop_token_ids=[3]),
    "top_k_1": dict(top_k=1),
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_rows_take_the_host_argmax(case: str) -> None:
    reqs = [_req(seed=i, output=(9, 9, 4, EOS), **GREEDY_CASES[case]) for i in range(4)]
    logits = _logits(4)
    logits[:, EOS] = 50.0  # min_new_tokens must hold it back
    logits[:, 9] = logits[:, 4] = 8.0  # penalties must move the choice
    host = Sampler({EOS}, V).sample(logits.clone(), reqs)
    dev = DeviceSampler({EOS}, V).sample(logits.clone(), reqs)
    assert dev.next_token_ids == host.next_token_ids


def test_grammar_mask_and_early_stop() -> None:
    """A mask limits the choice; min_new_tokens gives way where the grammar allows only EOS."""
    reqs = [_req(seed=0, temperature=0.0, grammar=True, min_new_tokens=3),
            _req(seed=1, temperature=0.0, grammar=True, min_new_tokens=3),
            _req(seed=2, temperature=0.0, min_new_tokens=3)]
    logits = _logits(3)
    bitmask = _bitmask(3, [[17, 40, EOS], [EOS], list(range(V))])
    host = Sampler({EOS}, V).sample(logits.clone(), reqs, bitmask)
    dev = DeviceSampler({EOS}, V).sample(logits.clone(), reqs, bitmask)
    assert dev.next_token_ids == host.next_token_ids
    assert dev.next_token_ids[0] in (17, 40) and dev.next_token_ids[1] == EOS


def test_logprobs_are_the_hosts() -> None:
    reqs = [_req(seed=0, temperature=0.0, return_logprob=True, top_logprobs_num=3),
            _req(seed=1, temperature=0.8, return_logprob=True),
            _req(seed=2, temperature=0.0)]
    logits = _logits(3)
    dev = DeviceSampler({EOS}, V).sample(logits.clone(), reqs)
    lp = torch.log_softmax(logits, dim=-1)
    for i in (0, 1):
        assert dev.logprobs[i] == pytest.approx(float(lp[i, dev.next_token_ids[i]]), abs=1e-6)
    values, ids = lp[0].topk(3)
    assert [t for _, t in dev.top_logprobs[0]] == ids.tolist()
    assert [v for v, _ in dev.top_logprobs[0]] == pytest.approx(values.tolist(), abs=1e-6)
    assert dev.top_logprobs[1] == [] and dev.logprobs[2] is None and dev.top_logprobs[2] is None


def _frequencies(num_draws: int, vocab: int, **params: object) -> torch.Tensor:
    """Token counts of `num_draws` requests (seeds 0..n-1) drawing once from the same row."""
    reqs = [_req(seed=s, **params) for s in range(num_draws)]
    row = torch.linspace(2.0, -2.0, vocab)
    out = DeviceSampler({EOS}, vocab).sample(row.repeat(num_draws, 1), reqs)
    return torch.bincount(torch.tensor(out.next_token_ids), minlength=vocab).double()


def _expected(vocab: int, temperature: float, keep: int) -> torch.Tensor:
    p = torch.softmax(torch.linspace(2.0, -2.0, vocab).double() / temperature, dim=-1)
    p[keep:] = 0
    return p / p.sum()


DISTRIBUTIONS = {  # params -> (temperature, how many of the top tokens may be drawn)
    "full": (dict(temperature=0.7), 8),
    "top_k_2": (dict(temperature=1.0, top_k=2), 2),
    # p ~ 0.44, 0.25, 0.14, 0.08, ...: the mass before the 4th, 0.83, reaches 0.75
    "top_p": (dict(temperature=1.0, top_p=0.75), 3),
    "min_p": (dict(temperature=1.0, min_p=0.3), 3),  # p_i / p_0 = exp(-4i/7) >= 0.3: i <= 2
}


@pytest.mark.parametrize("case", list(DISTRIBUTIONS))
def test_draws_follow_the_distribution(case: str) -> None:
    """Chi-square over 8 tokens, 4000 seeded draws: fixed seeds, so not flaky."""
    params, keep = DISTRIBUTIONS[case]
    n, vocab = 4000, 8
    observed = _frequencies(n, vocab, **params)
    expected = _expected(vocab, params["temperature"], keep) * n
    assert observed[keep:].sum() == 0, "a token outside the kept set was drawn"
    chi2 = float(((observed[:keep] - expected[:keep]) ** 2 / expected[:keep]).sum())
    assert chi2 < 24.3, f"chi-square {chi2:.1f} (p < 0.001 at 7 degrees of freedom)"


def test_a_seed_draws_the_same_alone_and_in_a_batch() -> None:
    sampler = DeviceSampler({EOS}, V)
    logits = _logits(5, seed=3)
    mine = dict(seed=11, temperature=0.9, top_p=0.95)
    for step in range(4):
        out_ids = tuple(range(100, 100 + step))
        alone = sampler.sample(logits[2:3].clone(), [_req(output=out_ids, **mine)])
        others = [_req(seed=1, temperature=0.0), _req(seed=2, top_k=3),
                  _req(output=out_ids, **mine), _req(seed=4, temperature=1.3),
                  _req(seed=5, min_p=0.1, repetition_penalty=1.2)]
        batched = sampler.sample(logits.clone(), others)
        assert batched.next_token_ids[2] == alone.next_token_ids[0]


def test_dry_and_xtc_are_left_to_the_host() -> None:
    assert not DeviceSampler.supports([_req(seed=1, dry_multiplier=0.8)])
    assert not DeviceSampler.supports([_req(seed=1, xtc_probability=0.5)])
    assert DeviceSampler.supports([_req(seed=1, temperature=0.5)])
    with pytest.raises(ValueError):
        DeviceSampler({EOS}, V).sample(_logits(1), [_req(seed=1, dry_multiplier=0.8)])


def test_one_device_to_host_copy_under_the_cuda_profile() -> None:
    reqs = [_req(seed=0, temperature=0.0, grammar=True, min_new_tokens=4),
            _req(seed=1, temperature=0.8, top_k=5, repetition_penalty=1.3, output=(7, 8)),
            _req(seed=2, top_p=0.9, frequency_penalty=0.5, presence_penalty=0.2, output=(9,),
                 logit_bias={"4": 2.0}, return_logprob=True, top_logprobs_num=2),
            _req(seed=3, min_p=0.05, return_logprob=True)]
    host_logits = _logits(4)
    bitmask = _bitmask(4, [[1, 2, 3, 17]] + [list(range(V))] * 3)
    expected = DeviceSampler({EOS}, V).sample(host_logits.clone(), reqs, bitmask)
    with cuda_profile() as profile:
        logits = host_logits.to("cuda")
        assert logits.is_cuda
        out = DeviceSampler({EOS}, V).sample(logits, reqs, bitmask)
    assert profile.syncs == ["cpu"]
    assert profile.triton_calls == {"apply_token_bitmask_": 1}
    assert not profile.reference_calls and not profile.native_calls
    assert out == expected


AHEAD_PARAMS = [  # (seed, output so far, params, logprobs asked)
    (1, (9, 4), dict(temperature=0.9, top_k=8, repetition_penalty=1.6), False),
    (2, (4,), dict(top_p=0.9, frequency_penalty=1.5, presence_penalty=1.0,
                   logit_bias={"9": 2.0, "30": -4.0}), True),
    (3, (9, 9), dict(min_p=0.05, min_new_tokens=4, stop_token_ids=[3]), False),
    (4, (7,), dict(temperature=0.0, repetition_penalty=2.0, presence_penalty=3.0), True),
]
PATHS = [[], [9], [9, 4], [4], [4, 9, 9], [30]]  # a tree's nodes: root, then paths below


def _rows_ahead(seed: int) -> torch.Tensor:
    logits = _logits(len(AHEAD_PARAMS) * len(PATHS), seed=seed)
    logits[:, EOS] = logits[:, 3] = 9.0  # min_new_tokens must hold them back
    logits[:, 9] = logits[:, 4] = 8.0  # penalties over the path must move the choice
    return logits


@pytest.mark.parametrize("seed", range(3))
def test_rows_drawn_ahead_are_the_rows_drawn_later(seed: int) -> None:
    """Row (request, path) drawn in one `sample_ahead` call gets what `sample` gives the
    request once it has output the path: the same token, logprob and top logprobs."""
    sampler = DeviceSampler({EOS}, V)
    logits = _rows_ahead(seed)
    reqs = [_req(seed=s, output=out, return_logprob=lp, top_logprobs_num=2 * lp, **params)
            for s, out, params, lp in AHEAD_PARAMS]
    owners = [k for k in range(len(reqs)) for _ in PATHS]
    ahead = sampler.sample_ahead(logits.clone(), reqs, owners, PATHS * len(reqs))
    for i, k in enumerate(owners):
        s, out, params, lp = AHEAD_PARAMS[k]
        later = _req(seed=s, output=out + tuple(PATHS[i % len(PATHS)]), return_logprob=lp,
                     top_logprobs_num=2 * lp, **params)
        want = sampler.sample(logits[i : i + 1].clone(), [later])
        assert ahead.next_token_ids[i] == want.next_token_ids[0], (i, k)
        assert ahead.logprobs[i] == want.logprobs[0]
        assert ahead.top_logprobs[i] == want.top_logprobs[0]
    # the path moved the choice somewhere (penalties, min_new_tokens' index), or this test
    # would not tell drawing ahead from drawing at the root
    roots = [ahead.next_token_ids[k * len(PATHS)] for k in range(len(reqs))]
    assert any(ahead.next_token_ids[i] != roots[k] for i, k in enumerate(owners))


def test_drawing_ahead_refuses_grammars_and_costs_one_copy_under_the_cuda_profile() -> None:
    sampler = DeviceSampler({EOS}, V)
    with pytest.raises(ValueError, match="grammar"):
        sampler.sample_ahead(_logits(1), [_req(seed=1, grammar=True)], [0], [[]])
    reqs = [_req(seed=s, output=out, return_logprob=lp, top_logprobs_num=2 * lp, **params)
            for s, out, params, lp in AHEAD_PARAMS]
    owners = [k for k in range(len(reqs)) for _ in PATHS]
    host_logits = _rows_ahead(0)
    expected = sampler.sample_ahead(host_logits.clone(), reqs, owners, PATHS * len(reqs))
    with cuda_profile() as profile:
        out = sampler.sample_ahead(host_logits.to("cuda"), reqs, owners, PATHS * len(reqs))
    assert profile.syncs == ["cpu"]
    assert profile.uploads == ["to", "to"]  # the test's logits, then the sampler's one copy
    assert out == expected
