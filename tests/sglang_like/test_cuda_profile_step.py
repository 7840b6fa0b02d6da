"""Whole scheduler steps of a tiny random llama, forward included, under the CUDA profile
(tests/sglang_like/cuda_profile.py): the device-to-host syncs of each kind of step stay within
its budget, the Triton kernels are the ones launched (never the torch reference nor the native
CPU kernels on device data), and greedy output is the CPU path's.

Counted: every sync of `Scheduler.step()`, the runner's forward and sampling included, and
the Triton launchers' host code (a grid sized from a device tensor read back is a sync).
Budgets, and what the syncs beyond one are (to be removed by later work):
- decode and prefill: 1 (the chosen tokens; the KV slots the scheduler reads back come from
  the pool's host copy of req_to_token, the extend kernel's grid from the batch's
  `max_extend_len`, known on the host);
- a step where requests finish: 1 as well;
- verify, every request greedy (`spec_verify.takes_argmax`): 1, the argmax of every node;
- verify with sampled requests: 1 as well, the token of every node of every tree, drawn at
  once on the device (`DeviceSampler.sample_ahead`: a node's draw depends on its request's
  seed and output index, and its penalties on the path, all known before the walk), which
  the walk then descends through; a grammar's request is walked node by node (its matcher
  takes each token before the next mask), by the device sampler: 1 more per depth it
  reaches; DRY / XTC requests 1 more: their own rows copied to the host, where the host
  sampler walks them.

- EAGLE-3 (a random head), a step that verifies and drafts: 3, the budget below (what they
  are: the verify's argmax; the head's top-k candidates after the verify; every draft
  depth's candidates and beams at once, whatever the depth: test_spec_device_draft.py).
  The draft tree's attention runs the Triton masked kernel over masks built on the device
  (it was the torch reference and 2 reads of its masks, 5 syncs a step). Its prefill: 2
  (the token, the head's candidates).

Host-to-device copies of a decode step: 3 (the KV rows the scheduler wrote, the batch's
metadata, the sampler's parameters), whatever the batch size.
Of an EAGLE-3 verify + draft step: 8 (was 21: the head's batches a tensor each, the draft
tree's table rows a write each per request, the masks and their offsets apart).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from sglang_like.model_loader import load_tokenizer
from sglang_like.model_runner import ModelRunner
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.scheduler import Scheduler, SchedulerConfig
from sglang_like.speculative import SpecConfig
from sglang_like.speculative.eagle import EagleDrafter
from sglang_like.speculative.tree import DraftTree

from .cuda_profile import CudaProfile, cuda_profile
from .spec_fakes import random_head
from .tiny_llama import TINY

PARAMS = [dict(temperature=0.0), dict(temperature=0.8, top_k=5, seed=1),
          dict(top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.2, seed=2)]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


class _Drafter:
    """Trees of fixed tokens (a chain of two with a sibling at each depth): verifies run."""

    num_draft_tokens = 5

    def propose(self, reqs: list[Req], max_depths: list[int], ctx: object) -> list[DraftTree]:
        trees = []
        for req, cap in zip(reqs, max_depths, strict=True):
            n = 1 + 2 * min(2, cap)
            trees.append(DraftTree([req.fill_ids[-1], 11, 12, 13, 14][:n], [-1, 0, 0, 1, 2][:n]))
        return trees


def _scheduler(tiny_llama, tokenizer, device: str, drafter: object = None) -> Scheduler:
    runner = ModelRunner(TINY, tiny_llama, dtype=torch.float32, device=torch.device(device),
                         num_kv_slots=256, context_len=64, max_running_requests=8)
    config = SchedulerConfig(pool_size=256, context_len=64, vocab_size=TINY.vocab_size,
                             max_running_requests=8, chunked_prefill_size=None,
                             device_sampling=device == "cuda", speculative_auto_disable=False)
    return Scheduler(config, runner, tokenizer, frozenset({0}), drafter)


def _add(sched: Scheduler, params: list[dict]) -> list[Req]:
    reqs = [Req(f"r{i}", [5 + i, 17, 3, 90, 41], SamplingParams(max_new_tokens=8,
                                                                  ignore_eos=True, **kw))
            for i, kw in enumerate(params)]
    for r in reqs:
        sched.add_request(r)
    return reqs


def _step(sched: Scheduler, profile: CudaProfile) -> list[str]:
    profile.reset()
    sched.step()
    assert not profile.reference_calls, "the torch reference ran on device tensors"
    return list(profile.syncs)


def test_prefill_and_decode_steps_stay_within_budget(tiny_llama, tokenizer) -> None:
    with cuda_profile() as profile:
        sched = _scheduler(tiny_llama, tokenizer, "cuda")
        reqs = _add(sched, PARAMS)
        assert _step(sched, profile) == ["cpu"]
        assert profile.triton_calls["extend_attention"] == TINY.num_hidden_layers
        assert not profile.native_calls
        for _ in range(7):  # the last one finishes every request (max_new_tokens 8)
            assert _step(sched, profile) == ["cpu"]
            assert profile.triton_calls == {"store_kv": TINY.num_hidden_layers,
                                            "decode_attention": TINY.num_hidden_layers}
            assert len(profile.uploads) == 3, profile.uploads
            assert not profile.native_calls
    assert all(r.is_finished and len(r.output_ids) == 8 for r in reqs)


DRY = dict(temperature=0.0, dry_multiplier=0.8)


@pytest.mark.parametrize(("params", "logprobs", "syncs"), [
    ([dict(temperature=0.0)] * 2, False, ["tolist"]),  # the nodes' argmax, off the device
    ([dict(temperature=0.0), dict(temperature=0.7, seed=3)], False, ["cpu"]),  # their draws
    (PARAMS + [dict(temperature=0.9, min_new_tokens=6, logit_bias={"11": 2.0}, seed=4)], True,
     ["cpu"]),
    # the draws, then the DRY request's rows to the host walk
    ([dict(temperature=0.7, seed=3), DRY], False, ["cpu", "cpu"]),
])
def test_verify_steps_stay_within_budget(tiny_llama, tokenizer, params, logprobs, syncs) -> None:
    with cuda_profile() as profile:
        sched = _scheduler(tiny_llama, tokenizer, "cuda", _Drafter())
        reqs = _add(sched, params)
        reqs[-1].return_logprob, reqs[-1].top_logprobs_num = logprobs, 2 * logprobs
        _step(sched, profile)  # the prefill
        for _ in range(3):
            assert _step(sched, profile) == syncs
            assert profile.triton_calls["tree_verify_attention"] == TINY.num_hidden_layers
            # the host sampler's native argmax runs on the host copy only
            assert set(profile.native_calls) <= ({"argmax_rows"} if DRY in params else set())


class _AnyToken:
    """A grammar that allows every token: its mask still comes from the host at each node."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1

    def accept_token(self, token: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False

    def jump_forward_string(self) -> str:
        return ""


def test_a_grammar_walks_on_the_device_one_copy_per_depth(tiny_llama, tokenizer) -> None:
    with cuda_profile() as profile:
        sched = _scheduler(tiny_llama, tokenizer, "cuda", _Drafter())
        drawn, masked = _add(sched, [dict(temperature=0.7, seed=3),
                                     dict(temperature=0.8, seed=5)])
        masked.grammar = _AnyToken()
        _step(sched, profile)  # the prefill
        for _ in range(3):
            accepted = masked.spec.accepted_drafts
            syncs = _step(sched, profile)
            depths = masked.spec.accepted_drafts - accepted + 1
            assert syncs == ["cpu"] * (1 + depths)  # the drawn tree, then each depth's token
            assert profile.triton_calls["apply_token_bitmask_"] == depths
            assert not profile.native_calls


EAGLE_PREFILL_BUDGET, EAGLE_STEP_BUDGET = 2, 3
# the verify's 4 (KV rows, the batch, the sampler's parameters, the tree masks), the head's batch
# after it, and per draft depth (2 here) its batch and the tree's masks with their offsets
EAGLE_STEP_UPLOADS = 8


def test_eagle_steps_stay_within_budget(tiny_llama, tokenizer, tmp_path) -> None:
    head = random_head(str(tmp_path / "head"), TINY.vocab_size, TINY.hidden_size,
                       TINY.num_hidden_layers)
    spec = SpecConfig("EAGLE3", num_steps=2, eagle_topk=2, num_draft_tokens=4,
                      draft_model_path=head, ngram_min_window=1, ngram_max_window=4,
                      ngram_breadth=1, auto_disable=False)
    with cuda_profile() as profile:
        sched = _scheduler(tiny_llama, tokenizer, "cuda")
        sched.drafter = EagleDrafter(spec, sched.runner)
        _add(sched, [dict(temperature=0.0)] * 2)
        assert len(_step(sched, profile)) <= EAGLE_PREFILL_BUDGET, profile.syncs
        for _ in range(3):
            profile.reset()
            sched.step()
            assert profile.triton_calls["tree_verify_attention"] == TINY.num_hidden_layers
            assert len(profile.syncs) <= EAGLE_STEP_BUDGET, profile.syncs
            assert profile.triton_calls["masked_attention"] >= 1  # the draft tree's
            assert len(profile.uploads) == EAGLE_STEP_UPLOADS, profile.uploads
            assert not profile.reference_calls
            assert not profile.native_calls


@pytest.mark.parametrize("speculative", [False, True])
def test_greedy_output_under_the_profile_is_the_cpu_paths(tiny_llama, tokenizer,
                                                          speculative: bool) -> None:
    outputs = []
    for device in ("cpu", "cuda"):
        with cuda_profile() if device == "cuda" else contextlib.nullcontext():
            sched = _scheduler(tiny_llama, tokenizer, device, _Drafter() if speculative else None)
            reqs = _add(sched, [dict(temperature=0.0), dict(temperature=0.0,
                                                            presence_penalty=0.7)])
            for _ in range(6):
                sched.step()
        outputs.append([r.output_ids for r in reqs])
    assert outputs[0] == outputs[1]
