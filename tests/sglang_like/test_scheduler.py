"""Scheduler.step() with a scripted runner: batching, chunking, reuse, retraction, accounting."""

from __future__ import annotations

import random
import time

import pytest

from sglang_like.model_loader import load_tokenizer
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.scheduler import Scheduler, SchedulerConfig

from .fake_runner import VOCAB, FakeRunner, ScriptedDrafter, expected_continuation

EOS = frozenset({0, 2})


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def make(tokenizer, pool_size=512, chunk=None, max_running=8, policy="lpm",
         disable_radix=False, context=1024, max_prefill=4096):
    runner = FakeRunner(pool_size, max_running + 1, context)
    config = SchedulerConfig(
        pool_size=pool_size, context_len=context, vocab_size=VOCAB,
        max_running_requests=max_running, max_prefill_tokens=max_prefill,
        chunked_prefill_size=chunk, schedule_policy=policy,
        disable_radix_cache=disable_radix, check_accounting=True,
    )
    return Scheduler(config, runner, tokenizer, EOS), runner


def req(rid, prompt, max_new, **kw):
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw)
    return Req(rid, list(prompt), sp)


def run(sched, max_steps=5000, on_step=None):
    done = {}
    for step in range(max_steps):
        if not sched.has_work:
            break
        if on_step:
            on_step(step)
        for r in sched.step():
            if r.is_finished:
                done[r.rid] = r
    assert not sched.has_work, "scheduler did not drain"
    return done


def assert_pool_clean(sched):
    cache = sched.cache
    assert sched.running == [] and sched.waiting == []
    assert cache.tree.protected_size == 0
    assert cache.allocator.num_free_slots + cache.tree.evictable_size == cache.pool_size
    cache.tree.check_integrity()
    assert sched.flush_cache()
    assert cache.allocator.num_free_slots == cache.pool_size


def prompts_with_shared_prefix(rng, n, prefix_len, suffix_max):
    prefix = [rng.randrange(300, 1300) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(300, 1300) for _ in range(rng.randint(1, suffix_max))]
            for _ in range(n)]


@pytest.mark.parametrize("chunk", [None, 16, 64])
@pytest.mark.parametrize("disable_radix", [False, True])
@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_outputs_follow_the_script(tokenizer, chunk, disable_radix, policy):
    sched, _ = make(tokenizer, chunk=chunk, disable_radix=disable_radix, policy=policy)
    rng = random.Random(0)
    prompts = prompts_with_shared_prefix(rng, 6, 40, 30)
    for i, p in enumerate(prompts):
        sched.add_request(req(f"r{i}", p, max_new=5 + i))
    done = run(sched)
    for i, p in enumerate(prompts):
        r = done[f"r{i}"]
        assert r.output_ids == expected_continuation(p, 5 + i)
        assert r.finished_reason.type == "length"
    assert_pool_clean(sched)


def test_continuous_batching_joins_and_leaves(tokenizer):
    sched, runner = make(tokenizer)
    a = req("a", range(300, 310), max_new=6)
    sched.add_request(a)
    sched.step()  # prefill a
    sched.step()  # decode a
    b = req("b", range(400, 405), max_new=2)
    sched.add_request(b)
    sched.step()  # one mixed forward: a decodes while b prefills
    mixed = runner.batches[-1]
    assert [r.rid for r in mixed.reqs] == ["a", "b"] and mixed.extend_lens == [1, 5]
    run(sched)
    assert a.output_ids == expected_continuation(list(range(300, 310)), 6)
    assert b.output_ids == expected_continuation(list(range(400, 405)), 2)
    # b left after 2 tokens; a's last decodes ran alone
    assert [r.rid for r in runner.batches[-1].reqs] == ["a"]


def test_chunked_prefill_splits_long_prompt(tokenizer):
    sched, runner = make(tokenizer, chunk=16)
    prompt = list(range(300, 350))
    sched.add_request(req("long", prompt, max_new=3))
    run(sched)
    extend_lens = [b.extend_lens[0] for b in runner.batches]
    assert extend_lens[:4] == [16, 16, 16, 2] and extend_lens[4:] == [1, 1]
    assert runner.batches[0].sample_index == [-1]


def test_prefix_reuse_prefills_only_the_suffix(tokenizer):
    sched, runner = make(tokenizer)
    shared = list(range(500, 560))
    sched.add_request(req("first", shared + [700, 701], max_new=3))
    run(sched)
    second = req("second", shared + [900, 901, 902], max_new=3)
    sched.add_request(second)
    run(sched)
    assert second.num_cached_tokens == len(shared)
    first_batch = next(b for b in runner.batches if b.reqs[0] is second)
    assert first_batch.extend_lens == [3]
    assert second.output_ids == expected_continuation(shared + [900, 901, 902], 3)


def test_requests_sharing_a_new_prefix_wait_one_step_to_share_it(tokenizer):
    sched, runner = make(tokenizer)
    prompts = prompts_with_shared_prefix(random.Random(1), 5, 100, 5)
    for i, p in enumerate(prompts):
        sched.add_request(req(f"s{i}", p, max_new=2))
    sched.step()
    assert len(runner.batches[0].reqs) == 1  # the others would recompute the same prefix
    done = run(sched)
    cached = sorted(done[f"s{i}"].num_cached_tokens for i in range(5))
    assert cached[0] == 0 and all(c >= 100 for c in cached[1:])


def test_retraction_under_memory_pressure_keeps_outputs(tokenizer):
    sched, _ = make(tokenizer, pool_size=70, max_running=4)
    prompts = [[300 + 10 * i + j for j in range(10)] for i in range(4)]
    for i, p in enumerate(prompts):
        sched.add_request(req(f"q{i}", p, max_new=30))
    done = run(sched)
    assert sum(r.num_retractions for r in done.values()) > 0
    for i, p in enumerate(prompts):
        assert done[f"q{i}"].output_ids == expected_continuation(p, 30)
    assert_pool_clean(sched)


def test_request_that_can_never_fit_is_aborted(tokenizer):
    sched, _ = make(tokenizer, pool_size=32)
    too_long = req("too-long", range(300, 340), max_new=1)
    sched.add_request(too_long)
    grows = req("grows", range(300, 320), max_new=40)
    sched.add_request(grows)
    done = run(sched)
    assert done["too-long"].finished_reason.type == "abort"
    assert "KV pool" in done["too-long"].finished_reason.message
    assert done["grows"].finished_reason.type == "abort"
    assert "too small" in done["grows"].finished_reason.message
    assert_pool_clean(sched)


def test_prefill_only_and_input_logprob_rows(tokenizer):
    sched, runner = make(tokenizer, chunk=8)
    r = Req("lp", list(range(300, 320)), SamplingParams(max_new_tokens=0),
            return_logprob=True, logprob_start_len=0)
    sched.add_request(r)
    done = run(sched)
    assert done["lp"].finished_reason.to_dict() == {"type": "length", "length": 0}
    entries = r.logprobs.input_token
    assert [t for _, t in entries] == list(range(300, 320))
    assert entries[0][0] is None and all(lp is not None for lp, _ in entries[1:])
    assert r.output_ids == []


def test_abort_frees_everything(tokenizer):
    sched, _ = make(tokenizer)
    for i in range(4):
        sched.add_request(req(f"x{i}", range(300 + i, 340 + i), max_new=50))
    for _ in range(3):
        sched.step()
    assert sched.abort("x1") and sched.abort("x3")
    assert not sched.abort("nope")
    done = run(sched)
    assert done["x1"].finished_reason.type == "abort"
    assert done["x0"].output_ids == expected_continuation(list(range(300, 340)), 50)
    assert_pool_clean(sched)


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_pool_accounting(tokenizer, seed):
    """Tiny pool, shared prefixes, chunking, aborts: the invariant is asserted after every
    step (check_accounting), outputs match the script, and every slot comes back."""
    rng = random.Random(seed)
    pool = rng.choice([48, 64, 96, 160])
    sched, _ = make(tokenizer, pool_size=pool, chunk=rng.choice([None, 8, 24]),
                    max_running=rng.choice([2, 4, 8]), policy=rng.choice(["lpm", "fcfs"]))
    run_random_workload(sched, rng)


def run_random_workload(sched, rng):
    """Requests sharing prefixes arrive at random steps and some are aborted mid-flight;
    every one that ran to its length follows the script, and every slot comes back."""
    prompts = prompts_with_shared_prefix(rng, 10, rng.randint(0, 20), 15)
    max_news = [rng.randint(0, 25) for _ in prompts]
    pending = list(enumerate(prompts))
    aborted: set[str] = set()
    done = {}
    while pending or sched.has_work:
        if pending and rng.random() < 0.5:
            i, p = pending.pop(0)
            sched.add_request(req(f"w{i}", p, max_new=max_news[i]))
        if rng.random() < 0.08:
            live = [r.rid for r in sched.running + sched.waiting]
            if live and sched.abort(victim := rng.choice(live)):
                aborted.add(victim)
        for r in sched.step():
            if r.is_finished:
                done[r.rid] = r
    for i, p in enumerate(prompts):
        r = done[f"w{i}"]
        if r.rid in aborted or r.finished_reason.type == "abort":
            continue
        assert r.output_ids == expected_continuation(p, max_news[i])
    assert_pool_clean(sched)

@pytest.mark.parametrize("start,end", [(0, 3), (2, 6), (4, 7), (5, 6), (0, 7), (3, 3)])
def test_fill_slice_equals_slicing_fill_ids(start, end):
    r = req("s", [10, 11, 12, 13], max_new=4)
    r.output_ids = [20, 21, 22]
    assert r.fill_slice(start, end) == r.fill_ids[start:end]


# ---- speculative verify through the scheduler (scripted drafter) ------------------------------

def make_spec(tokenizer, drafter, **kw):
    sched, runner = make(tokenizer, **kw)
    sched.drafter = drafter
    sched.spec_controller.enabled = False  # verify every step: the accounting is the point
    return sched, runner


@pytest.mark.parametrize("right", [0, 1, 3, 5])
def test_verify_accepts_the_agreeing_prefix_and_frees_the_rest(tokenizer, right):
    drafter = ScriptedDrafter(depth=4, right=right)
    sched, runner = make_spec(tokenizer, drafter)
    rng = random.Random(right)
    prompts = prompts_with_shared_prefix(rng, 4, 30, 10)
    for i, p in enumerate(prompts):
        sched.add_request(req(f"r{i}", p, max_new=23))
    done = run(sched)
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].output_ids == expected_continuation(p, 23)
        # every verify commits min(right, 4) drafts + the bonus, until the budget runs out
        assert done[f"r{i}"].spec.accepted_drafts >= min(right, 4) * (
            23 // (min(right, 4) + 1) - 1)
    assert drafter.num_proposed > 0
    assert_pool_clean(sched)


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_with_speculation_keep_pool_accounting(tokenizer, seed):
    """As above with a verify tree every decode step: tree slots are allocated and the
    rejected ones freed in the same step (the invariant is checked after every step), under
    retraction in tiny pools and aborts; outputs still follow the script."""
    rng = random.Random(100 + seed)
    drafter = ScriptedDrafter(depth=rng.randint(1, 5), right=rng.randint(0, 5),
                              branch=bool(seed % 2))
    sched, _ = make_spec(tokenizer, drafter, pool_size=rng.choice([48, 64, 96, 160]),
                         chunk=rng.choice([None, 8, 24]), max_running=rng.choice([2, 4, 8]),
                         policy=rng.choice(["lpm", "fcfs"]))
    run_random_workload(sched, rng)
    assert drafter.num_proposed > 0
    assert sum(sched.spec_accept_lengths.values()) > 0


def test_controller_prices_a_step_with_its_drafting_and_the_drafts_extend(tokenizer):
    """What speculation costs is more than the verify forward: the controller prices a
    step's drafting (before the batch forms) and the drafter's extend after it on their own,
    per batch size, and the rows without them, so a drafter too slow to pay is seen to be
    (here: 20 ms to draft, 10 to extend, around a scripted forward of well under a
    millisecond)."""
    class SlowDrafter(ScriptedDrafter):
        def propose(self, reqs, max_depths, ctx):
            time.sleep(0.02)
            return super().propose(reqs, max_depths, ctx)

        def after_forward(self, batch, committed, ctx):
            time.sleep(0.01)

    sched, _ = make_spec(tokenizer, SlowDrafter(depth=2, right=2, branch=False))
    sched.add_request(req("r0", list(range(300, 310)), max_new=12))
    run(sched)
    ctl = sched.spec_controller
    assert ctl.drafting[1] >= 0.03, ctl.drafting  # one decoder: 30 ms of drafting a step
    assert all(c < 0.02 for c in ctl.cost.values()), ctl.cost  # rows priced without it
    assert_pool_clean(sched)
