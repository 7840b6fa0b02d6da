"""Faults inside Scheduler.step() (scripted runner): the failed batch ends with a message, the
others go on, and every KV slot and row comes back; plus the scheduling defects of issue 11."""

from __future__ import annotations

import random

import pytest

from radix_cache import KVSlotAllocator, RadixCache
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.utils.fault_injection import FaultInjector, InjectedFault

from .fake_runner import ScriptedDrafter, expected_continuation
from .test_scheduler import (
    assert_pool_clean,
    make,
    make_spec,
    prompts_with_shared_prefix,
    req,
    run,
)
from .test_scheduler import tokenizer as tokenizer  # noqa: F401 - the module fixture


class _FailOnce:
    """Wraps a callable; raises on the calls whose numbers are in `fail_on` (1-based)."""

    def __init__(self, fn, fail_on):
        self.fn, self.fail_on, self.exc, self.calls = fn, set(fail_on), RuntimeError("boom"), 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_on:
            raise self.exc
        return self.fn(*args, **kwargs)


def test_forward_that_raises_ends_its_batch_and_frees_its_slots(tokenizer):
    sched, runner = make(tokenizer, pool_size=256, chunk=16)
    runner.forward = _FailOnce(runner.forward, fail_on=[3])
    prompts = [[300 + 10 * i + j for j in range(30)] for i in range(3)]
    for i, p in enumerate(prompts):
        sched.add_request(req(f"r{i}", p, max_new=12))
    done = run(sched)
    hit = [r for r in done.values() if r.finished_reason.type == "abort"]
    assert hit, "the failed forward's batch must end"
    for r in hit:
        assert r.finished_reason.message == "internal error: RuntimeError: boom"
    for r in done.values():
        if r.finished_reason.type != "abort":
            assert r.output_ids == expected_continuation(r.origin_input_ids, 12)
    assert_pool_clean(sched)
    # the scheduler goes on serving
    sched.add_request(req("after", prompts[0], max_new=5))
    assert run(sched)["after"].output_ids == expected_continuation(prompts[0], 5)
    assert_pool_clean(sched)


def test_fault_after_the_forward_loses_no_request(tokenizer):
    """A fault half-way through processing (after kv_len moved, some tokens appended): every
    request of the batch is answered and nothing it held leaks."""
    sched, _ = make(tokenizer, pool_size=256)
    sched.sampler.sample = _FailOnce(sched.sampler.sample, fail_on=[4])
    for i in range(4):
        sched.add_request(req(f"r{i}", range(300 + i, 320 + i), max_new=8))
    done = run(sched)
    assert len(done) == 4
    assert sum(r.finished_reason.type == "abort" for r in done.values()) >= 1
    assert_pool_clean(sched)


def test_fault_while_scheduling_with_an_empty_batch_cannot_spin(tokenizer):
    sched, _ = make(tokenizer)
    sched._schedule_waiting = _FailOnce(sched._schedule_waiting, fail_on=[1])
    sched.add_request(req("a", range(300, 310), max_new=4))
    touched = sched.step()
    assert [r.rid for r in touched] == ["a"]
    assert touched[0].finished_reason.message == "internal error: RuntimeError: boom"
    assert not sched.has_work
    assert_pool_clean(sched)


@pytest.mark.parametrize("path", ["sampler", "argmax"])
def test_fault_in_a_verify_walk_frees_the_tree_slots(tokenizer, path):
    """A fault inside a verify's walk, with some nodes committed and others not: the walk
    of requests asking for logprobs calls the sampler at each node; greedy ones read their
    tokens off one argmax (verify.accept_trees), the fault then in taking a token."""
    sched, _ = make_spec(tokenizer, ScriptedDrafter(depth=3, right=2), pool_size=256)
    # the 6th call is inside some verify's walk (the first three: the prompts' tokens)
    if path == "sampler":
        sched.sampler.sample = _FailOnce(sched.sampler.sample, fail_on=[6])
    else:
        sched.outputs.append_token = _FailOnce(sched.outputs.append_token, fail_on=[6])
    for i in range(3):
        r = req(f"s{i}", range(300 + i, 316 + i), max_new=20)
        r.return_logprob = path == "sampler"
        sched.add_request(r)
    done = run(sched)
    assert len(done) == 3
    assert any(r.finished_reason.type == "abort" for r in done.values())
    assert_pool_clean(sched)


@pytest.mark.parametrize("seed", range(8))
def test_random_faults_keep_every_answer_and_every_slot(tokenizer, seed):
    """Injected forward and sample faults under shared prefixes, chunking, retraction and
    aborts: every request ends, each fault is some request's abort message, outputs that
    were not cut follow the script, and the pool is whole (checked after every step)."""
    rng = random.Random(seed)
    sched, _ = make(tokenizer, pool_size=rng.choice([64, 96, 160]), chunk=rng.choice([None, 8]),
                    max_running=rng.choice([2, 4, 8]))
    faults = FaultInjector({"forward": 0.08, "sample": 0.08}, seed=seed)
    sched.faults = sched.outputs.faults = faults
    prompts = prompts_with_shared_prefix(rng, 24, rng.randint(0, 20), 15)
    max_news = [rng.randint(1, 20) for _ in prompts]
    pending = list(enumerate(prompts))
    done: dict[str, Req] = {}
    while pending or sched.has_work:
        if pending and rng.random() < 0.5:
            i, p = pending.pop(0)
            sched.add_request(req(f"w{i}", p, max_new=max_news[i]))
        if rng.random() < 0.05 and sched.running:
            sched.abort(rng.choice(sched.running).rid)
        for r in sched.step():
            if r.is_finished:
                done[r.rid] = r
    assert len(done) == len(prompts)
    messages = [r.finished_reason.message or "" for r in done.values()]
    for number in range(1, faults.num_injected + 1):
        assert any(m.endswith(f"fault #{number}") for m in messages), number
    assert faults.num_injected > 0
    for i, p in enumerate(prompts):
        r = done[f"w{i}"]
        if r.finished_reason.type != "abort":
            assert r.output_ids == expected_continuation(p, max_news[i])
    assert_pool_clean(sched)


def test_fault_injector_spec():
    inj = FaultInjector.parse("forward=0.5, sample=0, seed=3")
    assert inj.probabilities == {"forward": 0.5} and inj.enabled
    assert not FaultInjector.parse("").enabled
    with pytest.raises(ValueError, match="unknown site"):
        FaultInjector.parse("fwd=0.1")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        FaultInjector.parse("forward=2")
    with pytest.raises(ValueError, match="bad value"):
        FaultInjector.parse("forward=x")
    always = FaultInjector({"grammar": 1.0})
    with pytest.raises(InjectedFault, match="injected grammar fault #1"):
        always.maybe_fail("grammar")
    always.maybe_fail("forward")  # not a configured site: never fails
    assert always.stats() == {"total": 1, "forward": 0, "sample": 0, "grammar": 1}


# ---- defect 8: chunk sizing, retraction, admission ----------------------------------------
def test_prefill_chunk_shrinks_to_free_slots_instead_of_retracting(tokenizer):
    """A running prefill whose next budget-sized chunk does not fit takes a smaller chunk
    rather than being retracted (or retracting a decoding request)."""
    sched, _ = make(tokenizer, pool_size=96, chunk=32, max_running=4)
    a, b = list(range(300, 340)), list(range(500, 560))
    sched.add_request(req("a", a, max_new=30))
    sched.add_request(req("b", b, max_new=1))
    done = run(sched)
    assert done["a"].num_retractions == 0 and done["b"].num_retractions == 0
    assert done["a"].output_ids == expected_continuation(a, 30)
    assert done["b"].output_ids == expected_continuation(b, 1)
    assert_pool_clean(sched)


def test_admission_checks_the_whole_prompt_not_its_first_chunk(tokenizer):
    """A prompt whose first chunk fits but whose whole does not waits for room instead of
    being admitted and then forcing a running request out."""
    sched, _ = make(tokenizer, pool_size=80, chunk=8, max_running=4)
    sched.add_request(req("first", range(300, 330), max_new=20))
    sched.step()
    sched.step()
    sched.add_request(req("second", range(500, 545), max_new=2))
    done = run(sched)
    assert done["first"].num_retractions == 0 and done["second"].num_retractions == 0
    assert done["first"].output_ids == expected_continuation(list(range(300, 330)), 20)
    assert done["second"].output_ids == expected_continuation(list(range(500, 545)), 2)
    assert_pool_clean(sched)


# ---- defect 9: eviction and prefix matching cost ------------------------------------------
def test_evict_does_not_reheapify_every_leaf_per_call():
    allocator = KVSlotAllocator(4000)
    tree = RadixCache(allocator)
    for i in range(2000):
        slots = allocator.alloc(2)
        tree.insert([i, 7], slots)  # 2000 leaves of 2 tokens under the root... keyed by i
    calls = 0
    policy = tree._priority

    def counting(node):
        nonlocal calls
        calls += 1
        return policy(node)

    tree._priority = counting
    for _ in range(500):
        assert tree.evict(1) == 2
    # one heap built across calls: ~1 priority per popped leaf, not 2000 per call
    assert calls < 5000, calls
    tree.check_integrity()
    assert tree.evictable_size == 2 * 1500


def test_eviction_order_survives_touches_between_calls():
    allocator = KVSlotAllocator(100)
    tree = RadixCache(allocator)
    for i in range(5):
        tree.insert([i, 50], allocator.alloc(2))
    tree.evict(2)  # evicts [0, 50]: the oldest
    tree.match_prefix([1, 50])  # [1, 50] is now the newest
    tree.evict(2)
    assert tree.peek([2, 50])[0] == 0 and tree.peek([1, 50])[0] == 2
    tree.check_integrity()


def test_waiting_requests_do_not_inflate_hit_counts(tokenizer):
    """LFU counts one hit per admission, however many steps a request waited and was ordered."""
    sched, _ = make(tokenizer, pool_size=512, max_running=1)
    shared = list(range(300, 340))
    sched.add_request(req("seed", shared + [900], max_new=1))
    run(sched)
    node = sched.cache.tree.match_prefix(shared).last_node
    base = node.hit_count
    sched.add_request(req("long", shared + [901], max_new=25))
    for i in range(3):
        sched.add_request(req(f"w{i}", shared + [902 + i], max_new=2))
    run(sched)
    assert node.hit_count - base == 4  # one per admission (the chunks' re-locks are not hits)


def test_peek_changes_nothing():
    allocator = KVSlotAllocator(64)
    tree = RadixCache(allocator)
    tree.insert([1, 2, 3, 4], allocator.alloc(4))
    before = tree.pretty(), tree.num_nodes
    assert tree.peek([1, 2, 9]) == (2, 2)
    assert tree.pretty(), tree.num_nodes == before
    m = tree.match_prefix([1, 2, 3, 4])
    tree.inc_lock_ref(m.last_node)
    assert tree.peek([1, 2, 3, 4, 5]) == (4, 0)
    tree.dec_lock_ref(m.last_node)


def test_min_new_tokens_ignores_a_finished_grammar_in_the_sampler():
    """The sampler lets EOS through when the grammar allows nothing else (defect 5; the real
    model shows it end to end in test_engine_faults)."""
    import torch

    from sglang_like.layers.sampler import Sampler

    class _G:
        pass

    r = Req("g", [5, 6], SamplingParams(max_new_tokens=10, min_new_tokens=5, temperature=0.0))
    r.grammar = _G()
    sampler = Sampler(frozenset({5}), 64)
    logits = torch.randn(1, 64)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # only token 5 (EOS) allowed
    assert sampler.sample(logits, [r], bitmask).next_token_ids == [5]
    bitmask[0, 0] = (1 << 5) | (1 << 9)  # EOS or token 9: min_new_tokens bans EOS
    assert sampler.sample(torch.randn(1, 64), [r], bitmask).next_token_ids == [9]
