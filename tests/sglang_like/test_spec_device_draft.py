"""EAGLE drafting with the beams on the device (`EagleDrafter._draft_trees_on_device`, what a
GPU runs): the same trees as the host version's depth-by-depth walk, and one sync for all of
a step's draft depths under the CUDA profile (the host version makes one a depth).

The two versions run on the same drafter state (the head's candidates after a real prefill
and steps of a tiny random llama with a random EAGLE-3 head), so any difference is theirs:
the beams picked, the dead ones (under the controller's log-prob floor) left out, the depth
caps, the masks (a wrong mask changes the head's outputs and so the next depth's tokens).
"""

from __future__ import annotations

import pytest
import torch

from sglang_like.model_executor.cuda_graph import EagerGraphs
from sglang_like.model_loader import load_tokenizer
from sglang_like.model_runner import ModelRunner
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.scheduler import Scheduler, SchedulerConfig
from sglang_like.speculative import SpecConfig
from sglang_like.speculative.eagle import EagleDrafter, _next_beams

from .cuda_profile import cuda_profile
from .spec_fakes import random_head
from .tiny_llama import TINY

NUM_STEPS, TOPK = 4, 3
_SELECT = EagleDrafter._select  # the tests wrap it to record every node drafted


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> str:
    return random_head(str(tmp_path_factory.mktemp("head")), TINY.vocab_size, TINY.hidden_size,
                       TINY.num_hidden_layers)


def _scheduler(tiny_llama, tokenizer, head: str, device: str) -> Scheduler:
    runner = ModelRunner(TINY, tiny_llama, dtype=torch.float32, device=torch.device(device),
                         num_kv_slots=512, context_len=96, max_running_requests=8)
    config = SchedulerConfig(pool_size=512, context_len=96, vocab_size=TINY.vocab_size,
                             max_running_requests=8, chunked_prefill_size=None,
                             device_sampling=device == "cuda", speculative_auto_disable=False)
    sched = Scheduler(config, runner, tokenizer, frozenset({0}))
    spec = SpecConfig("EAGLE3", num_steps=NUM_STEPS, eagle_topk=TOPK, num_draft_tokens=10,
                      draft_model_path=head, ngram_min_window=1, ngram_max_window=4,
                      ngram_breadth=1, ngram_branch=False, auto_disable=False)
    sched.drafter = EagleDrafter(spec, runner)
    return sched


def _add(sched: Scheduler, n: int) -> list[Req]:
    reqs = [Req(f"r{i}", [5 + i, 17, 3 + 2 * i, 90, 41, 7 * i + 1],
                SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.0))
            for i in range(n)]
    for r in reqs:
        sched.add_request(r)
    return reqs


def _both(sched: Scheduler, reqs: list[Req], max_depths: list[int], shallow: set[int],
          monkeypatch, min_lp: float | None = None):
    """Each version's trees and every node it drafted (token, parent, score), per request."""
    drafter, ctx = sched.drafter, sched._draft_context()
    if min_lp is not None:
        monkeypatch.setattr(ctx.controller, "min_draft_logprob", lambda: min_lp)
    nodes: list = []

    def recording(req, ns, num_nodes, max_depth):
        nodes.append([(nd.token, nd.parent, nd.score) for nd in ns])
        return _SELECT(req, ns, num_nodes, max_depth)

    monkeypatch.setattr(EagleDrafter, "_select", staticmethod(recording))
    live = [i for i, r in enumerate(reqs) if r.spec.eagle is not None]
    assert live, "no request has the head's candidates"
    free = sched.cache.allocator.num_free_slots
    host: list = [None] * len(reqs)
    drafter._draft_trees(reqs, max_depths, ctx, live, host, shallow)
    host_nodes, nodes[:] = list(nodes), []
    dev: list = [None] * len(reqs)
    drafter._draft_trees_on_device(reqs, max_depths, ctx, live, dev, shallow)
    assert sched.cache.allocator.num_free_slots == free  # every scratch slot back
    return (host, host_nodes), (dev, nodes)


def _same(host, dev) -> None:
    """The same nodes and trees; scores to float32 rounding: where the floor leaves beams
    out, the host version's head runs over fewer rows, and a CPU matmul's sums may round
    otherwise for another row count (the device version forwards the dead beams too), or
    even for the same rows in other buffers (MKL's sums follow the data's alignment: exact
    equality failed once in a full run)."""
    (host_trees, host_nodes), (dev_trees, dev_nodes) = host, dev
    assert [[n[:2] for n in ns] for ns in host_nodes] == [[n[:2] for n in ns] for ns in dev_nodes]
    for a, b in zip(host_nodes, dev_nodes, strict=True):
        assert [n[2] for n in a] == pytest.approx([n[2] for n in b], abs=1e-5)
    for a, b in zip(host_trees, dev_trees, strict=True):
        if a is None:
            assert b is None
            continue
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
        assert a.probs == pytest.approx(b.probs, rel=1e-5)


# the log-prob floor: off; between the head's depth-1 candidates here (about -3.2 to -3.7),
# so some requests forward fewer beams at depth 1 or none; between its depth-2 children
# (about -6.5 to -7.2)
@pytest.mark.parametrize("floor", [None, -3.55, -6.9])
def test_device_drafting_makes_the_host_versions_trees(tiny_llama, tokenizer, head, floor,
                                                       monkeypatch) -> None:
    sched = _scheduler(tiny_llama, tokenizer, head, "cpu")
    reqs = _add(sched, 4)
    for _ in range(3):
        sched.step()
    max_depths = [NUM_STEPS, 2, NUM_STEPS, NUM_STEPS]  # one capped (near its max tokens)
    host, dev = _both(sched, reqs, max_depths, {3}, monkeypatch, floor)
    _same(host, dev)
    sizes = [len(ns) for ns in host[1]]
    full = TOPK + TOPK * TOPK * (NUM_STEPS - 1)  # every beam of every depth forwarded
    if floor is None:
        assert sizes == [full, TOPK + TOPK * TOPK, full, TOPK]
    else:  # the floor left beams out
        assert TOPK in sizes[:3] or any(TOPK < n < full for n in sizes[:3]), sizes


def test_next_beams_leave_the_floors_dead_out() -> None:
    """Two beams: beam 1 under the floor (-2.5 < -2) has the best children, beam 0's are
    worse; then one request whose only live beam has fewer children than k."""
    scores = torch.tensor([[-1.0, -2.5]], dtype=torch.float64)
    alive = torch.tensor([[True, True]])
    ids = torch.tensor([[[10, 11], [20, 21]]])
    lps = torch.tensor([[[-3.0, -4.0], [-0.1, -0.2]]])
    pick, tokens, new_scores, new_alive = _next_beams(scores, alive, ids, lps, -2.0)
    assert pick.tolist() == [[0, 1]] and tokens.tolist() == [[10, 11]]
    assert new_scores.tolist() == [[-4.0, -5.0]] and new_alive.tolist() == [[True, True]]
    # no floor: beam 1's children are the best
    pick, tokens, new_scores, _ = _next_beams(scores, alive, ids, lps, -float("inf"))
    assert tokens.tolist() == [[20, 21]]
    assert new_scores.tolist()[0] == pytest.approx([-2.6, -2.7])
    # beam 1 dead already: its children are dead too, picked only after the live ones
    k3 = torch.tensor([[-1.0, -1.5, -9.0]], dtype=torch.float64)
    ids3 = torch.arange(9).view(1, 3, 3)
    lps3 = torch.tensor([[[-5.0, -6.0, -7.0], [-0.1, -0.2, -0.3], [-0.1, -0.1, -0.1]]])
    pick, tokens, _, new_alive = _next_beams(k3, torch.tensor([[True, False, True]]), ids3,
                                             lps3, -2.0)
    assert tokens.tolist()[0] == [0, 1, 2] and new_alive.tolist() == [[True, True, True]]
    pick, tokens, _, new_alive = _next_beams(torch.tensor([[-1.0, -3.0, -4.0]],
                                                          dtype=torch.float64),
                                             torch.tensor([[True, True, True]]),
                                             ids3, lps3, -2.0)
    assert tokens.tolist()[0] == [0, 1, 2]  # only beam 0 passes: its three children


def test_device_drafting_masks_matter(tiny_llama, tokenizer, head, monkeypatch) -> None:
    """A row that sees a sibling's key (the mask's diagonal block all True) drafts other
    tokens: the comparison above would catch masks built wrong."""
    sched = _scheduler(tiny_llama, tokenizer, head, "cpu")
    reqs = _add(sched, 2)
    for _ in range(3):
        sched.step()
    eye = torch.eye

    def all_true(n, *args, **kw):
        return torch.ones_like(eye(n, *args, **kw))

    monkeypatch.setattr(torch, "eye", all_true)
    host, dev = _both(sched, reqs, [NUM_STEPS] * 2, set(), monkeypatch)
    assert host[1][0][:TOPK] == dev[1][0][:TOPK]  # the candidates: no mask yet
    assert host[1] != dev[1]


def test_eagle_draft_depths_cost_one_sync(tiny_llama, tokenizer, head) -> None:
    """Under the CUDA profile a step that verifies and drafts NUM_STEPS - 1 = 3 depths syncs
    3 times (the verify's argmax, the head's candidates after it, the draft's depths at
    once), where the host walk made 2 + 3; its draft tree's attention is the Triton masked
    kernel's."""
    with cuda_profile() as profile:
        sched = _scheduler(tiny_llama, tokenizer, head, "cuda")
        _add(sched, 2)
        sched.step()  # the prefill
        for _ in range(3):
            profile.reset()
            sched.step()
            assert profile.triton_calls["tree_verify_attention"] == TINY.num_hidden_layers
            assert profile.triton_calls["masked_attention"] == NUM_STEPS - 1
            assert len(profile.syncs) <= 3, profile.syncs
            # the verify's 4, the head's batch after it, and per depth its batch, the table
            # rows of its slots and the masks' offsets
            assert len(profile.uploads) == 5 + 3 * (NUM_STEPS - 1), profile.uploads
            assert not profile.reference_calls
            assert not profile.native_calls


def _live_state(sched: Scheduler, n: int) -> list[Req]:
    reqs = _add(sched, n)
    for _ in range(3):
        sched.step()
    assert all(r.spec.eagle is not None for r in reqs)
    return reqs


def _draft(sched: Scheduler, reqs: list[Req], max_depths: list[int], monkeypatch) -> list:
    """The device version's trees and nodes (recorded at `_select`)."""
    nodes: list = []

    def recording(req, ns, num_nodes, max_depth):
        nodes.append([(nd.token, nd.parent, nd.score) for nd in ns])
        return _SELECT(req, ns, num_nodes, max_depth)

    monkeypatch.setattr(EagleDrafter, "_select", staticmethod(recording))
    trees: list = [None] * len(reqs)
    free = sched.cache.allocator.num_free_slots
    sched.drafter._draft_trees_on_device(reqs, max_depths, sched._draft_context(),
                                         list(range(len(reqs))), trees)
    assert sched.cache.allocator.num_free_slots == free
    return [trees, nodes]


@pytest.mark.parametrize("floor", [None, -6.9])
def test_draft_graphs_replay_the_eager_depths(tiny_llama, tokenizer, head, floor,
                                              monkeypatch) -> None:
    """The draft depths captured (EagerGraphs: a replay runs the capture's function again over
    the same buffers) for buckets of 1, 2, 4 requests: 4 requests replay bucket 4, then 3 of
    them bucket 4 with a padding request (whose K/V go to slot 0, not to the slots the 4th
    had), each drafting the trees of the eager device path. The capture makes no sync and
    one copy from the host (every bucket's mask offsets); a replay syncs once (every depth's
    candidates) and copies twice (its inputs, the table rows of its slots) where the eager
    depths copy 3 times each."""
    with cuda_profile() as profile:
        sched = _scheduler(tiny_llama, tokenizer, head, "cuda")
        reqs = _live_state(sched, 4)
        if floor is not None:
            monkeypatch.setattr(sched.spec_controller, "min_draft_logprob", lambda: floor)
        eager = [_draft(sched, reqs[:n], [NUM_STEPS] * n, monkeypatch) for n in (4, 3)]
        profile.reset()
        sched.drafter.capture_graphs(4, EagerGraphs())
        graphs = sched.drafter.graphs
        assert graphs.buckets == [1, 2, 4]
        assert profile.syncs == [] and len(profile.uploads) == 1  # the masks' offsets
        assert profile.triton_calls["masked_attention"] == 3 * (NUM_STEPS - 1)
        for n, want in zip((4, 3), eager, strict=True):
            profile.reset()
            _same(want, _draft(sched, reqs[:n], [NUM_STEPS] * n, monkeypatch))
            assert len(profile.syncs) == 1 and len(profile.uploads) == 2, profile.uploads
            assert not profile.reference_calls and not profile.native_calls
        assert graphs.num_replays == 2


def test_draft_graphs_fall_back_to_eager_depths(tiny_llama, tokenizer, head,
                                                monkeypatch) -> None:
    """A request capped short of the draft depth (near its max tokens), or more requests
    than the largest bucket, drafts eagerly: the same trees, no replay."""
    sched = _scheduler(tiny_llama, tokenizer, head, "cpu")
    reqs = _live_state(sched, 3)
    want = _draft(sched, reqs, [NUM_STEPS, 2, NUM_STEPS], monkeypatch)
    sched.drafter.capture_graphs(2, EagerGraphs())
    graphs = sched.drafter.graphs
    _same(want, _draft(sched, reqs, [NUM_STEPS, 2, NUM_STEPS], monkeypatch))
    _draft(sched, reqs, [NUM_STEPS] * 3, monkeypatch)  # 3 requests, buckets up to 2
    assert graphs.num_replays == 0
    _draft(sched, reqs[:2], [NUM_STEPS] * 2, monkeypatch)
    assert graphs.num_replays == 1


def test_greedy_output_with_draft_graphs_is_without(tiny_llama, tokenizer, head) -> None:
    """Whole scheduler steps under the CUDA profile, the target's decode / verify and the
    draft depths replayed: the same greedy tokens as no graphs, the draft graphs replayed
    every step that drafted."""
    outputs = []
    for graphs in (False, True):
        with cuda_profile():
            sched = _scheduler(tiny_llama, tokenizer, head, "cuda")
            if graphs:
                sched.runner.capture_graphs(4, EagerGraphs(), verify_tokens=10)
                sched.drafter.capture_graphs(4, EagerGraphs())
            reqs = _add(sched, 3)
            while sched.has_work:
                sched.step()
            outputs.append([r.output_ids for r in reqs])
            if graphs:
                assert sched.drafter.graphs.num_replays >= 5
    assert outputs[0] == outputs[1]


def test_the_head_runs_in_the_models_dtype_off_the_cpu(tiny_llama, tokenizer, head) -> None:
    """On "cuda" (the profile) a bf16 model's drafter holds its head's weights and its KV in
    bf16 (half the bytes its LM head reads a forward), and EAGLE steps draft (on the device),
    verify and finish the requests; on the CPU the head stays float32 (the native head packs
    from it)."""
    with cuda_profile():
        runner = ModelRunner(TINY, tiny_llama, dtype=torch.bfloat16,
                             device=torch.device("cuda"), num_kv_slots=512, context_len=96,
                             max_running_requests=8)
        config = SchedulerConfig(pool_size=512, context_len=96, vocab_size=TINY.vocab_size,
                                 max_running_requests=8, chunked_prefill_size=None,
                                 device_sampling=True, speculative_auto_disable=False)
        sched = Scheduler(config, runner, tokenizer, frozenset({0}))
        spec = SpecConfig("EAGLE3", num_steps=NUM_STEPS, eagle_topk=TOPK, num_draft_tokens=10,
                          draft_model_path=head, ngram_min_window=1, ngram_max_window=4,
                          ngram_breadth=1, ngram_branch=False, auto_disable=False)
        drafter = sched.drafter = EagleDrafter(spec, runner)
        assert drafter.dtype == torch.bfloat16
        assert drafter.pool.k_buffers[0].dtype == torch.bfloat16
        assert {p.dtype for p in drafter.head.parameters()} == {torch.bfloat16}
        reqs = _add(sched, 2)
        while sched.has_work:
            sched.step()
        assert drafter.num_forwards > 2 and all(len(r.output_ids) == 24 for r in reqs)
        assert sum(sched.spec_accept_lengths.values()) > 0  # verifies ran
    cpu = _scheduler(tiny_llama, tokenizer, head, "cpu")  # a float32 model: float32 anyway
    bf16 = ModelRunner(TINY, tiny_llama, dtype=torch.bfloat16, device=torch.device("cpu"),
                       num_kv_slots=64, context_len=32, max_running_requests=2)
    assert cpu.drafter.dtype == EagleDrafter(spec, bf16).dtype == torch.float32


def test_a_bf16_head_computes_the_float32_heads_math(head) -> None:
    """Each piece of the head's math in bf16 (what a GPU's drafter runs) against the same
    head in float32 on the same inputs: within bf16's rounding, in bf16 (logits float32)."""
    from sglang_like.speculative.head_loader import load_draft_head

    ref, low = load_draft_head(head), load_draft_head(head).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    h = TINY.hidden_size
    feats, embeds = torch.randn(5, 3 * h, generator=gen), torch.randn(5, h, generator=gen)
    attn = torch.randn(5, ref.config.num_attention_heads * ref.config.head_dim, generator=gen)

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 3e-2, float(err)

    hidden_ref, hidden_low = ref.project(feats), low.project(feats)
    assert hidden_low.dtype == torch.bfloat16
    close(hidden_low, hidden_ref)
    for got, want in zip(low.attention_inputs(embeds, hidden_ref.to(torch.bfloat16)),
                         ref.attention_inputs(embeds, hidden_ref), strict=True):
        assert got.dtype == torch.bfloat16
        close(got, want)
    out_ref = ref.finish(attn, hidden_ref)
    out_low = low.finish(attn.to(torch.bfloat16), hidden_ref.to(torch.bfloat16))
    assert out_low.dtype == torch.bfloat16
    close(out_low, out_ref)
    logits = low.logits(out_ref.to(torch.bfloat16))
    assert logits.dtype == torch.float32
    close(logits, ref.logits(out_ref))
