"""The sampler's draw: top-k / top-p cut from candidates, exactly the whole-vocabulary rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_like.layers import sampler as sampler_mod

V = 8192


def _req(seed: int, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0):
    sp = SimpleNamespace(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p,
                         is_greedy=False)
    return SimpleNamespace(sampling_params=sp,
                           generator=torch.Generator().manual_seed(seed))


def _reference(probs: torch.Tensor, req, u: float) -> int:
    """The rule written plainly: sort the whole row, keep while rank < k and the mass ranked
    before is below top_p, draw by inverse CDF over the kept tokens in sorted order."""
    sp = req.sampling_params
    p = probs.clone()
    if sp.min_p > 0:
        p[p < p.max() * sp.min_p] = 0
    sorted_p, order = p.sort(descending=True)
    kept = []
    before = 0.0
    for rank, (w, t) in enumerate(zip(sorted_p.tolist(), order.tolist(), strict=True)):
        if sp.top_k > 0 and rank >= sp.top_k:
            break
        if before >= sp.top_p:
            break
        kept.append((w, t))
        before += w
    if sp.top_k <= 0 and sp.top_p >= 1.0:  # no cut: the CDF runs in id order
        kept = [(w, t) for t, w in enumerate(p.tolist())]
    total = sum(w for w, _ in kept)
    acc = 0.0
    for w, t in kept:
        acc += w
        if w > 0 and u * total < acc:
            return t
    return max(t for w, t in kept if w > 0)


def _rows(seed: int) -> torch.Tensor:
    """Peaked rows (64 candidates hold top_p), medium ones (1024 do), flat ones (only the
    whole vocabulary does)."""
    g = torch.Generator().manual_seed(seed)
    rank = torch.arange(1, V + 1).float()
    out = []
    for slope in (2.0, 1.5, 0.6, 0.0):
        logits = -slope * rank.log() + 0.3 * torch.randn(V, generator=g)
        out.append(torch.softmax(logits[torch.randperm(V, generator=g)], dim=-1))
    return torch.stack(out)


@pytest.mark.parametrize("params", [
    {"top_p": 0.95}, {"top_p": 0.5}, {"top_k": 40}, {"top_k": 2000},
    {"top_k": 50, "top_p": 0.9}, {"min_p": 0.05}, {"min_p": 0.01, "top_p": 0.8}, {},
])
def test_draws_equal_the_whole_vocabulary_rule(params: dict) -> None:
    probs = _rows(0)
    widths = set()
    for seed in range(12):
        reqs = [_req(seed * 10 + i, **params) for i in range(probs.shape[0])]
        us = [float(torch.rand(1, generator=torch.Generator().manual_seed(seed * 10 + i)))
              for i in range(probs.shape[0])]
        got = sampler_mod._sample(probs, reqs)
        for i, (tok, u) in enumerate(zip(got, us, strict=True)):
            assert tok == _reference(probs[i], reqs[i], u), (params, seed, i)
    if params == {"top_p": 0.95}:  # the rows need every width of the cascade
        for row in probs:
            mass = [float(row.topk(w).values.sum()) for w in (64, 1024)]
            widths.add(sum(m < 0.95 for m in mass))
        assert widths == {0, 1, 2}


def test_never_draws_a_zero_probability_token() -> None:
    probs = torch.zeros(2, V)
    probs[:, 10] = 0.25
    probs[:, 4000] = 0.75  # the rest (grammar-masked, say) is exactly zero
    for top_p in (1.0, 0.9):
        for seed in range(200):
            reqs = [_req(seed, top_p=top_p), _req(seed + 1000, top_p=top_p)]
            assert set(sampler_mod._sample(probs, reqs)) <= {10, 4000}
    # u at the top of [0, 1): float rounding must not step past the last positive entry
    assert sampler_mod.inverse_cdf(probs, torch.tensor([1.0 - 2 ** -24, 1.0])).tolist() \
        == [4000, 4000]


def test_same_seed_same_token_whatever_the_batch() -> None:
    probs = _rows(1)
    alone = [sampler_mod._sample(probs[i: i + 1], [_req(7, top_p=0.9)])[0] for i in range(4)]
    together = sampler_mod._sample(probs, [_req(7, top_p=0.9) for _ in range(4)])
    assert alone == together


def test_select_rows_views_consecutive_rows_and_copies_others() -> None:
    logits = torch.randn(6, 16)
    view = sampler_mod.select_rows(logits, [2, 3, 4])
    assert view.data_ptr() == logits[2].data_ptr() and torch.equal(view, logits[2:5])
    picked = sampler_mod.select_rows(logits, [4, 1])
    assert torch.equal(picked, logits[[4, 1]])
    picked[0] = 0.0  # a copy: the logits keep their rows
    assert not torch.equal(logits[4], picked[0])
    assert sampler_mod.select_rows(logits, []).shape == (0, 16)


def test_greedy_sampling_on_a_view_of_inference_logits() -> None:
    """The scheduler hands the sampler a view of the forward's logits (inference tensors):
    its in-place edits (min_new_tokens blocks EOS here) work there, and it picks torch's
    argmax (the native kernel on CPU)."""
    eos = 7
    logits_eos = torch.randn(5, V)
    with torch.inference_mode():
        logits = logits_eos.clone()
        logits[:, eos] = 100.0
    sp = SimpleNamespace(is_greedy=True, has_penalties=False, token_bias=None,
                         min_new_tokens=1, stop_token_ids=None)
    reqs = [SimpleNamespace(sampling_params=sp, return_logprob=False, output_ids=[],
                            grammar=None) for _ in range(3)]
    rows = sampler_mod.select_rows(logits, [1, 2, 3])
    out = sampler_mod.Sampler({eos}, V).sample(rows, reqs)
    want = logits_eos[1:4].clone()
    want[:, eos] = -float("inf")
    assert out.next_token_ids == want.argmax(dim=-1).tolist()
    assert all(t != eos for t in out.next_token_ids)
    assert logits[1, eos] == -float("inf") and logits[0, eos] == 100.0  # edited in place
