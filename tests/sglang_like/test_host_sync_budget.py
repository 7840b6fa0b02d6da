"""Host-sync budget of a step under the CUDA profile (tests/sglang_like/cuda_profile.py).

What is counted: every device-to-host sync the scheduler makes while it steps, from the
logits the runner hands back to the tokens appended (sampling, logprobs, grammar, penalties,
stop checks, the KV rows it reads back); not the fake runner's forward, which stands for the
model (its reads of req_to_token are the attention kernel's, on the device). The runner's
req_to_token lives on the "device" as the real one's does (the scheduler reads its slots back
from the pool's host copy). A verify step is held to the same budget: its sampled requests'
tree nodes are drawn at once on the device, one copy of their tokens.
"""

from __future__ import annotations

import pytest
import torch

from sglang_like.mem_pool import ReqToTokenPool
from sglang_like.model_loader import load_tokenizer
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.scheduler import Scheduler, SchedulerConfig

from .cuda_profile import CudaProfile, cuda_profile
from .fake_runner import VOCAB, FakeRunner, ScriptedDrafter

EOS = frozenset({0, 2})
STEP_BUDGET = 1  # the chosen tokens (and logprobs), one copy, prefill or decode


class DeviceFakeRunner(FakeRunner):
    """The scripted runner with its req_to_token and logits on the (profiled) device."""

    def __init__(self, profile: CudaProfile, num_slots: int, max_rows: int,
                 context_len: int) -> None:
        super().__init__(num_slots, max_rows, context_len)
        self.profile = profile
        self.req_to_token_pool = ReqToTokenPool(max_rows, context_len, "cuda")
        self.device = torch.device("cuda")
        self.to_host: list[bool] = []  # each forward's: were its logits asked for on the host?

    def forward(self, batch, to_host: bool = True) -> torch.Tensor:
        self.to_host.append(to_host)
        with self.profile.uncounted():
            logits = super().forward(batch).to("cuda")
        return logits.cpu() if to_host else logits  # the logits' copy to the host is a sync


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _requests() -> list[Req]:
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_k=5, repetition_penalty=1.2, seed=1),
        dict(top_p=0.9, frequency_penalty=0.4, presence_penalty=0.3, logit_bias={"7": -3.0},
             seed=2),
        dict(min_p=0.1, min_new_tokens=6, seed=3),
    ]
    reqs = [Req(f"r{i}", list(range(40 + i, 60 + 2 * i)),
                SamplingParams(max_new_tokens=12, **kw)) for i, kw in enumerate(kinds)]
    reqs[2].return_logprob, reqs[2].top_logprobs_num = True, 2
    return reqs


def _scheduler(profile: CudaProfile, tokenizer, drafter: object = None
               ) -> tuple[Scheduler, DeviceFakeRunner]:
    runner = DeviceFakeRunner(profile, 512, 9, 256)
    config = SchedulerConfig(pool_size=512, context_len=256, vocab_size=VOCAB,
                             max_running_requests=8, chunked_prefill_size=None,
                             device_sampling=True, speculative_auto_disable=False)
    return Scheduler(config, runner, tokenizer, EOS, drafter), runner


def test_a_decode_step_syncs_once(tokenizer) -> None:
    with cuda_profile() as profile:
        sched, runner = _scheduler(profile, tokenizer)
        reqs = _requests()
        for r in reqs:
            sched.add_request(r)
        profile.reset()
        sched.step()  # every prompt at once
        assert runner.batches[-1].batch_size == len(reqs)
        assert profile.syncs == ["cpu"] * STEP_BUDGET, profile.syncs
        for _ in range(5):
            profile.reset()
            sched.step()
            assert runner.batches[-1].is_decode
            assert profile.syncs == ["cpu"] * STEP_BUDGET, profile.syncs
    assert all(len(r.output_ids) == 6 and not r.is_finished for r in reqs)
    assert reqs[2].logprobs.output_top[-1] and len(reqs[2].logprobs.output_top[-1]) == 2


def test_a_verify_step_with_sampled_requests_syncs_once(tokenizer) -> None:
    """Every request verifies a tree (two right drafts, a wrong sibling at each depth): greedy,
    sampled with penalties, logit bias and logprobs, min_new_tokens; one copy of the drawn
    tokens a step, where the walk used to copy the whole verify's logits to the host."""
    with cuda_profile() as profile:
        sched, runner = _scheduler(profile, tokenizer, ScriptedDrafter(depth=3, right=2))
        reqs = _requests()
        for r in reqs:
            sched.add_request(r)
        sched.step()  # the prompts
        for _ in range(3):
            profile.reset()
            sched.step()
            assert runner.batches[-1].has_trees
            assert profile.syncs == ["cpu"] * STEP_BUDGET, profile.syncs
            # the copy is the drawn tokens': the logits stay, no host sampler runs
            assert runner.to_host[-1] is False and not profile.native_calls
    assert all(len(r.output_ids) == 10 for r in reqs)  # 1, then 3 tokens a verify
    assert len(reqs[2].logprobs.output_top) == 10 and len(reqs[2].logprobs.output_top[-1]) == 2


def test_input_logprobs_of_a_prefill_sync_a_few_times_not_per_token(tokenizer) -> None:
    """Prompts scored token by token (echo logprobs, lm-eval's loglikelihood): one copy of
    every row's logprob and one pair (values, ids) per distinct top count, whatever the
    prompts' lengths, where it used to be a few copies per prompt token."""
    with cuda_profile() as profile:
        sched, _ = _scheduler(profile, tokenizer)
        reqs = _requests()
        for r, top in zip(reqs, (0, 2, 3, 2), strict=True):
            r.return_logprob, r.logprob_start_len, r.top_logprobs_num = True, 0, top
            sched.add_request(r)
        profile.reset()
        sched.step()  # every prompt at once: 20 to 26 rows each
    assert sorted(profile.syncs) == ["cpu"] * STEP_BUDGET + ["tolist"] * (1 + 2 * 2), (
        profile.syncs)
    for r, top in zip(reqs, (0, 2, 3, 2), strict=True):
        record = r.logprobs
        assert len(record.input_token) == len(r.origin_input_ids)
        assert record.input_token[0][0] is None  # nothing predicts the first token
        assert all(lp <= 0 for lp, _ in record.input_token[1:])
        assert [t for _, t in record.input_token] == r.origin_input_ids
        tops = record.input_top[1:]
        assert all((row is None) if top == 0 else len(row) == top for row in tops)
        if top:  # the token's own logprob is at most the best one's
            assert all(row[0][0] >= lp for row, (lp, _) in
                       zip(tops, record.input_token[1:], strict=True))
