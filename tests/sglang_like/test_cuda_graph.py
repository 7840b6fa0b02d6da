"""CUDA graphs of the decode and verify forwards (sglang_like.model_executor.cuda_graph)
without a GPU: a tiny random llama's scheduler steps under the CUDA profile
(tests/sglang_like/cuda_profile.py), the graph API stood in for by `EagerGraphs` (each replay
runs the recorded forward again over the same buffers and copies its results into the
captured outputs).

What this can show: a capture makes no device-to-host sync and no host-to-device copy (either
would fail or be baked in under a real capture); a replayed decode gives the eager path's
tokens and logits, and its padding rows write only the pool's padding slot; buckets are picked
as documented; what cannot replay runs eagerly; the flag is refused where it cannot run. What
it cannot: the capture itself on a GPU (scripts/gpu_check.py's `graphs` section)."""

from __future__ import annotations

import pytest
import torch

from sglang_like.config import ModelConfig
from sglang_like.engine import Engine
from sglang_like.model_executor.cuda_graph import EagerGraphs, ForwardGraphs, graph_buckets
from sglang_like.model_loader import load_tokenizer
from sglang_like.model_runner import ModelRunner
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.scheduler import Scheduler, SchedulerConfig
from sglang_like.speculative.tree import DraftTree

from .cuda_profile import cuda_profile
from .tiny_llama import TINY, tiny_weights

MAX_BS = 6  # buckets 1, 2, 4, 6


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


class _Drafter:
    """Two fixed sibling drafts for every request (a tree mask that is not causal), one when
    a request has room for one token more: verify steps of 3 nodes, and of 2."""

    num_draft_tokens = 3

    def propose(self, reqs: list[Req], max_depths: list[int], ctx: object) -> list[DraftTree]:
        return [DraftTree([r.fill_ids[-1], 11, 12][:2 + (cap > 1)], [-1, 0, 0][:2 + (cap > 1)])
                for r, cap in zip(reqs, max_depths, strict=True)]


def _scheduler(tiny_llama, tokenizer, graphs: bool, drafter: object = None,
               aux_layers: tuple[int, ...] = (), verify_tokens: int | None = None
               ) -> Scheduler:
    runner = ModelRunner(TINY, tiny_llama, dtype=torch.float32, device=torch.device("cuda"),
                         num_kv_slots=256, context_len=64, max_running_requests=8)
    runner.aux_layers = aux_layers
    if graphs:
        runner.capture_graphs(MAX_BS, EagerGraphs(), verify_tokens=verify_tokens)
    config = SchedulerConfig(pool_size=256, context_len=64, vocab_size=TINY.vocab_size,
                             max_running_requests=8, chunked_prefill_size=None,
                             device_sampling=True, speculative_auto_disable=False)
    return Scheduler(config, runner, tokenizer, frozenset({0}), drafter)


PARAMS = [dict(temperature=0.0), dict(temperature=0.8, top_k=5, seed=1),
          dict(top_p=0.9, repetition_penalty=1.3, seed=2), dict(temperature=0.0, min_p=0.1),
          dict(temperature=0.7, seed=4)]


def _requests(lengths: list[int]) -> list[Req]:
    return [Req(f"r{i}", [5 + i, 17, 3, 90, 41, 7 + i][: 3 + i % 4],
                SamplingParams(max_new_tokens=n, ignore_eos=True, **PARAMS[i % len(PARAMS)]))
            for i, n in enumerate(lengths)]


def test_buckets() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    with pytest.raises(ValueError, match="at least 1"):
        graph_buckets(0)


def test_replayed_decode_is_the_eager_forward(tiny_llama, tokenizer) -> None:
    """Requests of different lengths and sampling joining and leaving, so the decode batch
    runs in buckets 1 to 6 with 0 to 1 padding rows: the same tokens as the eager path, the
    same K/V in every slot a request owns, nothing but the padding slot written beside them,
    and no sync or upload while capturing."""
    outputs, pools, replays = [], [], []
    for graphs in (False, True):
        with cuda_profile() as profile:
            sched = _scheduler(tiny_llama, tokenizer, graphs)
            if graphs:
                # the capture ran at build: rebuild under a fresh count to see it alone
                profile.reset()
                sched.runner.capture_graphs(MAX_BS, EagerGraphs())
                assert profile.syncs == [] and profile.uploads == [], (profile.syncs,
                                                                      profile.uploads)
                assert not profile.reference_calls and not profile.native_calls
            pool = sched.runner.kv_pool
            for buf in pool.k_buffers + pool.v_buffers:  # torch.empty's: the same in both
                buf.zero_()
            reqs = _requests([9, 3, 12, 5, 7])
            late = _requests([4, 6])
            for r in reqs:
                sched.add_request(r)
            sizes = []
            step = 0
            while sched.waiting or sched.running:
                if step == 3:
                    for r in late:
                        sched.add_request(r)
                profile.reset()
                sched.step()
                assert len(profile.syncs) == 1, profile.syncs  # the tokens, graphs or not
                sizes.append(len(sched.running))
                step += 1
            replays.append(sched.runner.graphs[0].num_replays if graphs else 0)
        outputs.append([r.output_ids for r in reqs + late])
        pools.append([b.as_subclass(torch.Tensor).clone() for b in pool.k_buffers + pool.v_buffers])
    assert outputs[0] == outputs[1]
    assert all(len(o) == r.sampling_params.max_new_tokens
               for o, r in zip(outputs[1], reqs + late, strict=True))
    # the same slots written, but for the padding slot 0 (a padded replay writes there and
    # nowhere else), with the same K/V to float rounding (a GEMM of 4 rows may round a row
    # otherwise than one of 3: up to 2e-6 here)
    for eager, graphed in zip(*pools, strict=True):
        assert not eager[0].any() and graphed[0].any()
        assert torch.equal(eager[1:].ne(0).any(dim=(1, 2)), graphed[1:].ne(0).any(dim=(1, 2)))
        assert torch.allclose(eager[1:], graphed[1:], atol=1e-5, rtol=0)
    assert replays[1] >= 10  # most steps were decodes (prefills run eagerly)
    assert max(sizes) == MAX_BS and min(s for s in sizes if s) == 1
    assert {3, 5} & set(sizes)  # batches that a bucket holds with padding rows


def test_logits_and_features_of_a_replay(tiny_llama, tokenizer) -> None:
    """A replay's logits equal the eager forward's to float rounding and its EAGLE-3
    features (aux_layers set before the capture) are kept as an eager forward keeps them."""
    got = []
    for graphs in (False, True):
        with cuda_profile():
            sched = _scheduler(tiny_llama, tokenizer, graphs, aux_layers=(0, 1))
            runner = sched.runner
            seen = []
            forward = runner.forward

            def recording(batch, to_host=True, forward=forward, runner=runner, seen=seen):
                logits = forward(batch, to_host=to_host)
                if batch.is_decode:
                    seen.append((logits.as_subclass(torch.Tensor).clone(),
                                 runner.last_features.as_subclass(torch.Tensor).clone()))
                return logits

            runner.forward = recording
            reqs = _requests([6, 6, 6])
            for r in reqs:
                sched.add_request(r)
            while sched.waiting or sched.running:
                sched.step()
            if graphs:
                assert runner.graphs[0].num_replays == len(seen) == 5
        got.append(seen)
    for (la, fa), (lb, fb) in zip(*got, strict=True):
        assert torch.allclose(la, lb, atol=1e-5, rtol=1e-5)
        assert fa.shape == fb.shape == (3, 2 * TINY.hidden_size)
        assert torch.allclose(fa, fb, atol=1e-5, rtol=1e-5)


def test_replayed_verify_is_the_eager_forward(tiny_llama, tokenizer) -> None:
    """With the verify of 3-node trees captured too (`_Drafter`'s, 2 drafts a request), a
    speculative run of joining requests of mixed sampling: the eager path's tokens, the same
    slots written (padding requests only slot 0), verifies of 3 nodes replayed and the
    shorter trees near max_new_tokens run eagerly, the same syncs each step either way."""
    outputs, pools, replays, syncs, logits = [], [], [], [], []
    for graphs in (False, True):
        with cuda_profile() as profile:
            sched = _scheduler(tiny_llama, tokenizer, graphs, drafter=_Drafter(),
                               verify_tokens=3)
            runner, seen = sched.runner, []
            forward = runner.forward

            def recording(batch, to_host=True, forward=forward, seen=seen):
                logits = forward(batch, to_host=to_host)
                seen.append(logits.as_subclass(torch.Tensor).clone())
                return logits

            runner.forward = recording
            logits.append(seen)
            pool = sched.runner.kv_pool
            for buf in pool.k_buffers + pool.v_buffers:
                buf.zero_()
            reqs = _requests([9, 6, 12, 7, 10])
            for r in reqs[:3]:
                sched.add_request(r)
            step, counted = 0, []
            while sched.waiting or sched.running:
                if step == 2:
                    for r in reqs[3:]:
                        sched.add_request(r)
                profile.reset()
                sched.step()
                counted.append(list(profile.syncs))
                step += 1
            syncs.append(counted)
            if graphs:
                decode, verify = sched.runner.graphs
                replays.append((decode.num_replays, verify.num_replays))
        outputs.append([r.output_ids for r in reqs])
        pools.append([b.as_subclass(torch.Tensor).clone() for b in pool.k_buffers + pool.v_buffers])
    assert outputs[0] == outputs[1] and syncs[0] == syncs[1]
    assert replays[0][1] >= 4
    # every forward's logits, every tree node's row included (the walk reads few of them)
    for a, b in zip(*logits, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    for eager, graphed in zip(*pools, strict=True):
        assert not eager[0].any() and graphed[0].any()
        assert torch.equal(eager[1:].ne(0).any(dim=(1, 2)), graphed[1:].ne(0).any(dim=(1, 2)))
        assert torch.allclose(eager[1:], graphed[1:], atol=1e-5, rtol=0)


def test_what_cannot_replay_runs_eagerly(tiny_llama, tokenizer) -> None:
    """Verify steps (trees) and batches past the largest bucket run the eager forward."""
    with cuda_profile():
        sched = _scheduler(tiny_llama, tokenizer, True, drafter=_Drafter())
        for r in _requests([5, 5]):
            sched.add_request(r)
        sched.step()  # the prefills
        sched.step()  # a verify
        assert sched.runner.graphs[0].num_replays == 0
    with cuda_profile():
        sched = _scheduler(tiny_llama, tokenizer, True)
        reqs = _requests([4] * (MAX_BS + 1))
        for r in reqs:
            sched.add_request(r)
        while sched.waiting or sched.running:
            sched.step()
        assert sched.runner.graphs[0].num_replays == 0
        assert all(len(r.output_ids) == 4 for r in reqs)


def test_the_flag_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(enable_cuda_graph=True, engine_in_process=True)
    moe = ModelConfig(architecture="qwen3_moe", vocab_size=97, hidden_size=64,
                      intermediate_size=192, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    runner = ModelRunner(moe, tiny_weights(moe), dtype=torch.float32, device=torch.device("cpu"),
                         num_kv_slots=64, context_len=64, max_running_requests=2)
    with pytest.raises(ValueError, match="MoE"):
        ForwardGraphs(runner, 2, EagerGraphs())
