"""DeviceSampler: logits -> next tokens where the logits live, one device-to-host copy a step.

The host `Sampler` walks rows in Python and reads tensors back as it goes (`tolist`, `bool`,
per-request generators on the CPU): on a GPU each of those is a sync, and the whole vocabulary
of every row has to come to the host first. Here a step is:

1. host: the batch's parameters and token ids (penalties, logit bias, EOS held back by
   min_new_tokens, the grammar bitmask) packed into one int64 buffer, one host-to-device copy;
2. device: penalties, logit bias, grammar bitmask (`apply_token_bitmask_`, Triton on CUDA),
   EOS blocking, temperature, min-p, top-k / top-p and the draw, with no data-dependent
   branch (every choice that depends on values is a `torch.where`);
3. one device-to-host copy of the chosen tokens (and their logprobs / top logprobs when asked).

Randomness is a counter-based hash of (the request's seed, its number of output tokens): no
generator state, so a seed draws the same tokens whatever else is in the batch, and a
retracted request redraws what it drew before. Draws are not the host sampler's (a different
uniform), but come from the same distribution; greedy rows take the same first-maximum argmax.

Since a draw depends on nothing but (seed, output index) and the request's history,
`sample_ahead` can draw rows a request reaches only later, all in one call: a verify's tree
nodes, each from its logits row as the request would draw there once the node's path is output
(the draw for that index, penalties counting the path, min_new_tokens at that index).

What it does not do on the device (DRY, XTC) `supports` turns down: the caller samples those
requests with the host `Sampler` (the scheduler the rest of their batch still here).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

import sglang_like_kernels
from sglang_like.layers.sampler import SampleOutput, inverse_cdf, keep_top
from sglang_like.req import Req
from sglang_like.utils.upload import Packer

_NEG_INF = float("-inf")
_MASK32 = 0xFFFFFFFF
# odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so the hash's
# int64 products never overflow (signed overflow is not something to lean on in torch)
_MUL_A = 0x21F0AAAD
_MUL_B = 0x735A2D97
_STEP_SALT = 0x9E3779B9
# columns of _Staged.floats and _Staged.ints
_TEMPERATURE, _TOP_P, _MIN_P, _REPETITION, _FREQUENCY, _PRESENCE = range(6)
_TOP_K, _SEED, _STEP, _IS_GREEDY, _HAS_GRAMMAR = range(5)
# _Staged's (row or request, token) index pairs, each [2, N]
_PAIRS = ("seen", "counted", "seen_ahead", "counted_ahead", "bias_at", "blocked")


class _Staged(NamedTuple):
    """The step's host-built inputs, on the device. The B rows belong to R requests: the
    tokens a request has (`seen`, `counted`) are staged once per request, not per row."""

    floats: torch.Tensor  # [B, 6] float32: temperature, top_p, min_p, rep., freq., presence
    ints: torch.Tensor  # [B, 5] int64: top_k, seed, step, is_greedy, has_grammar
    num_reqs: int  # R
    owners: torch.Tensor | None  # [B] int64: each row's request; None: row i is request i's
    seen: torch.Tensor  # [2, S] int64 (request, token): prompt and output, repetition penalty
    counted: torch.Tensor  # [2, C] int64 (request, token): output, frequency / presence
    # [2, A] int64 (row, token): what a row's request will have output past its output_ids
    # when it draws the row (a tree node's path), for each of the two kinds of penalty
    seen_ahead: torch.Tensor
    counted_ahead: torch.Tensor
    bias_at: torch.Tensor  # [2, L] int64 (row, token) of logit bias
    bias: torch.Tensor  # [L] float32
    blocked: torch.Tensor  # [2, E] int64 (row, token) held back by min_new_tokens
    bitmask: torch.Tensor | None  # [B, W] int32


class DeviceSampler:
    """Samples a batch on its logits' device; stateless apart from the EOS ids."""

    def __init__(self, eos_token_ids: frozenset[int] | set[int], vocab_size: int) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self.vocab_size = vocab_size

    @staticmethod
    def supports(reqs: list[Req]) -> bool:
        """Whether every request's sampling runs here (DRY and XTC do not: host sampler)."""
        return not any(r.sampling_params.has_dry or r.sampling_params.xtc_probability > 0.0
                       for r in reqs)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Req],
               bitmask: torch.Tensor | None = None) -> SampleOutput:
        """logits [B, V] float32 on the device (modified in place, as the host sampler's);
        bitmask int32 [B, ceil(V/32)] on the host (grammar masks, packed), or None. Costs one
        host-to-device copy and one device-to-host copy."""
        return self._sample(logits, reqs, None, None, bitmask)

    @torch.inference_mode()
    def sample_ahead(self, logits: torch.Tensor, reqs: list[Req], owners: list[int],
                     paths: list[list[int]]) -> SampleOutput:
        """Rows drawn ahead of their requests, all at once: logits [N, V] float32 on the device
        (modified in place), row i what reqs[owners[i]] samples from once it has output
        paths[i] past its output_ids (a draft tree's node: its path below the root). Each row
        gets the token `sample` would give it then: the draw for output index
        len(output_ids) + len(paths[i]), penalties counting the path's tokens, min_new_tokens
        at that index. Not for grammars (a row's mask would need the matcher advanced along
        its path). Costs one host-to-device copy and one device-to-host copy."""
        if any(r.grammar is not None for r in reqs):
            raise ValueError("a grammar's rows are masked one step at a time (use sample())")
        return self._sample(logits, reqs, owners, paths, None)

    def _sample(self, logits: torch.Tensor, reqs: list[Req], owners: list[int] | None,
                paths: list[list[int]] | None, bitmask: torch.Tensor | None) -> SampleOutput:
        """`sample` (`owners` and `paths` None: row i is reqs[i] now) or `sample_ahead`."""
        if not self.supports(reqs):
            raise ValueError("DRY and XTC are sampled on the host (check supports() first)")
        rows = reqs if owners is None else [reqs[k] for k in owners]
        staged = self._stage(reqs, owners, paths, bitmask, logits.device)
        lp = (torch.log_softmax(logits.float(), dim=-1) if any(r.return_logprob for r in reqs)
              else None)
        _penalize(logits, staged)
        if staged.bias.numel():
            logits.index_put_(tuple(staged.bias_at), staged.bias, accumulate=True)
        if staged.bitmask is not None:
            sglang_like_kernels.apply_token_bitmask_(logits, staged.bitmask)
        if staged.blocked.numel():
            _block_early_stop(logits, staged)
        ids = _choose(logits, staged, reqs)
        return _read_back(ids, lp, rows)

    def _stage(self, reqs: list[Req], owners: list[int] | None, paths: list[list[int]] | None,
               bitmask: torch.Tensor | None, device: torch.device) -> _Staged:
        """The step's inputs (columns as the _TEMPERATURE ... / _TOP_K ... constants say), on
        `device` from one copy."""
        floats: list[float] = []
        ints: list[int] = []
        bias: list[float] = []
        pairs: dict[str, tuple[list[int], list[int]]] = {name: ([], []) for name in _PAIRS}
        for k, r in enumerate(reqs):
            sp = r.sampling_params
            if sp.repetition_penalty != 1.0:
                _extend_pairs(pairs["seen"], k, set(r.fill_ids))
            if r.output_ids and (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0):
                _extend_pairs(pairs["counted"], k, r.output_ids)
        for i, k in enumerate(range(len(reqs)) if owners is None else owners):
            r = reqs[k]
            sp = r.sampling_params
            path = paths[i] if paths is not None else []
            num_out = len(r.output_ids) + len(path)
            floats += [sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty,
                       sp.frequency_penalty, sp.presence_penalty]
            seed = r.generator.initial_seed() if r.generator is not None else 0
            ints += [sp.top_k, seed, num_out, int(sp.is_greedy), int(r.grammar is not None)]
            if path and sp.repetition_penalty != 1.0:
                _extend_pairs(pairs["seen_ahead"], i, path)
            if path and (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0):
                _extend_pairs(pairs["counted_ahead"], i, path)
            token_bias = sp.token_bias
            _extend_pairs(pairs["bias_at"], i, token_bias)
            bias += token_bias.values()
            if num_out < sp.min_new_tokens:
                _extend_pairs(pairs["blocked"], i,
                              self.eos_token_ids + list(sp.stop_token_ids or []))
        return _upload(device, len(reqs), owners, floats, ints, bias, pairs, bitmask)


def _upload(device: torch.device, num_reqs: int, owners: list[int] | None,
            floats: list[float], ints: list[int], bias: list[float],
            pairs: dict[str, tuple[list[int], list[int]]], bitmask: torch.Tensor | None
            ) -> _Staged:
    pack = Packer()
    at = {"floats": pack.add(floats, is_float=True), "bias": pack.add(bias, is_float=True),
          "ints": pack.add(ints)}
    at |= {name: pack.add(part) for name, part in pairs.items()}
    if owners is not None:
        at["owners"] = pack.add(owners)
    if bitmask is not None:
        at["bitmask"] = pack.add(bitmask)
    on = pack.to(device)
    batch = len(floats) // 6
    staged_pairs = {name: on[at[name]].view(2, len(part[0])) for name, part in pairs.items()}
    return _Staged(
        floats=on[at["floats"]].view(torch.float64).view(batch, 6).float(),
        ints=on[at["ints"]].view(batch, 5), num_reqs=num_reqs,
        owners=on[at["owners"]] if owners is not None else None,
        bias=on[at["bias"]].view(torch.float64).float(),
        bitmask=None if bitmask is None
        else on[at["bitmask"]].to(torch.int32).view(bitmask.shape),
        **staged_pairs)


def _extend_pairs(pairs: tuple[list[int], list[int]], row: int, tokens: Iterable[int]
                  ) -> None:
    """Append (row, token) for each token: the [2, N] index lists a step's scatters take."""
    tokens = list(tokens)
    pairs[0].extend([row] * len(tokens))
    pairs[1].extend(tokens)


def _penalize(logits: torch.Tensor, staged: _Staged) -> None:
    """Repetition (over prompt and output), then frequency and presence (over the output), as
    the host sampler applies them, each row's output including the tokens it is drawn ahead
    of; rows without a penalty pass through unchanged (x / 1, x * 1 and x - 0 are exact)."""
    if staged.seen.numel():
        seen = _tally(logits, staged, staged.seen, staged.seen_ahead) > 0
        rep = staged.floats[:, _REPETITION:_REPETITION + 1]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalized, logits))
    if staged.counted.numel() or staged.counted_ahead.numel():
        counts = _tally(logits, staged, staged.counted, staged.counted_ahead)
        freq = staged.floats[:, _FREQUENCY:_FREQUENCY + 1]
        presence = staged.floats[:, _PRESENCE:_PRESENCE + 1]
        logits -= freq * counts + presence * (counts > 0)


def _tally(logits: torch.Tensor, staged: _Staged, held: torch.Tensor, ahead: torch.Tensor
           ) -> torch.Tensor:
    """[B, V] counts of each row's tokens: its request's `held` (request, token) pairs, then
    the row's own `ahead` (row, token) ones. Counted per request and gathered to its rows, so
    a request's history crosses once however many rows (tree nodes) it has."""
    counts = logits.new_zeros((staged.num_reqs, logits.shape[-1]))
    if held.numel():
        counts.index_put_(tuple(held), torch.ones_like(held[0], dtype=logits.dtype),
                          accumulate=True)
    if staged.owners is not None:
        counts = counts[staged.owners]
    if ahead.numel():
        counts.index_put_(tuple(ahead), torch.ones_like(ahead[0], dtype=logits.dtype),
                          accumulate=True)
    return counts


def _block_early_stop(logits: torch.Tensor, staged: _Staged) -> None:
    """min_new_tokens: EOS / stop tokens to -inf, except where a grammar allows nothing else
    (its output is complete: it may end early rather than break the grammar), decided per row
    on the device."""
    blocked = torch.zeros_like(logits, dtype=torch.bool)
    blocked[tuple(staged.blocked)] = True
    held = logits.masked_fill(blocked, _NEG_INF)
    has_grammar = staged.ints[:, _HAS_GRAMMAR].bool()
    keep = torch.isfinite(held).any(dim=-1) | ~has_grammar
    logits.copy_(torch.where(keep.unsqueeze(1), held, logits))


def _choose(logits: torch.Tensor, staged: _Staged, reqs: list[Req]) -> torch.Tensor:
    """Each row's token [B] int64 on the device: greedy rows the first maximum, the others a
    draw after temperature, min-p, top-k and top-p."""
    greedy_ids = logits.argmax(dim=-1)
    if all(r.sampling_params.is_greedy for r in reqs):
        return greedy_ids
    is_greedy = staged.ints[:, _IS_GREEDY].bool()
    temps = torch.where(is_greedy, 1.0, staged.floats[:, _TEMPERATURE]).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    if any(r.sampling_params.min_p > 0 for r in reqs):
        floor = probs.max(dim=-1, keepdim=True).values * staged.floats[:, _MIN_P:_MIN_P + 1]
        probs = torch.where(probs < floor, 0.0, probs)
    uniform = _uniform(staged.ints[:, _SEED], staged.ints[:, _STEP])
    drawn = inverse_cdf(probs, uniform)  # no cut: the CDF in id order, as the host's
    top_ks, top_ps = staged.ints[:, _TOP_K], staged.floats[:, _TOP_P]
    if any(r.sampling_params.top_k > 0 or r.sampling_params.top_p < 1.0 for r in reqs):
        # every row takes the path its own parameters pick, whatever the others ask, so a
        # seed's draws do not depend on the batch; a stable sort orders ties by id
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        pos = inverse_cdf(keep_top(sorted_p, top_ks, top_ps), uniform)
        is_cut = (top_ks > 0) | (top_ps < 1.0)
        drawn = torch.where(is_cut, order.gather(1, pos.unsqueeze(1)).squeeze(1), drawn)
    return torch.where(is_greedy, greedy_ids, drawn)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift / multiply rounds) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 15)


def _uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One float32 uniform in [0, 1) per row from (seed, step), int64 [B] each (seeds of up
    to 63 bits): a counter-based draw, the same for a row whatever the batch."""
    h = _mix32((steps & _MASK32) ^ _STEP_SALT)
    h = _mix32(h ^ ((seeds >> 32) & _MASK32))
    h = _mix32(h ^ (seeds & _MASK32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def _read_back(ids: torch.Tensor, lp: torch.Tensor | None, reqs: list[Req]) -> SampleOutput:
    """The step's one device-to-host copy: tokens, then (when asked) the chosen logprobs and
    the top logprobs, all as float64 (token ids are exact in it)."""
    batch = len(reqs)
    parts = [ids.to(torch.float64)]
    max_top = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
    if lp is not None:
        parts.append(lp.gather(1, ids.unsqueeze(1)).squeeze(1).to(torch.float64))
        if max_top > 0:
            values, top_ids = lp.topk(min(max_top, lp.shape[-1]), dim=-1)
            parts += [values.to(torch.float64).flatten(), top_ids.to(torch.float64).flatten()]
    host = torch.cat(parts).cpu().tolist()
    next_ids = [int(t) for t in host[:batch]]
    out_lp: list[float | None] = [None] * batch
    out_top: list[list[tuple[float, int]] | None] = [None] * batch
    if lp is None:
        return SampleOutput(next_ids, out_lp, out_top)
    width = min(max_top, lp.shape[-1])
    values_at, ids_at = 2 * batch, 2 * batch + batch * width
    for i, r in enumerate(reqs):
        if r.return_logprob:
            out_lp[i] = host[batch + i]
            k = min(max(r.top_logprobs_num, 0), width)
            out_top[i] = [(host[values_at + i * width + j], int(host[ids_at + i * width + j]))
                          for j in range(k)]
    return SampleOutput(next_ids, out_lp, out_top)
