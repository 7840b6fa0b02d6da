"""EAGLE with NGRAM's branch grafted on: the merged tree, how the controller measures each
drafter on its own nodes, and on the default model: the same tokens as without speculation,
copied spans committed, and copies drafted while the head is paused."""

from __future__ import annotations

import pytest

from sglang_like.speculative import DraftTree, SpecController, SpecState
from sglang_like.speculative.controller import _evidence_key
from sglang_like.speculative.tree import with_copies

from .spec_fakes import fake_batch, plain_step_to

# ---- the merged tree ---------------------------------------------------------------------------


def _head_chain() -> DraftTree:
    return DraftTree([5, 7, 8, 9], [-1, 0, 1, 2], probs=[1.0, 0.6, 0.3, 0.1])


def _copy_chain() -> DraftTree:
    return DraftTree([5, 7, 10, 11], [-1, 0, 1, 2], evidence=3)


def test_copies_graft_onto_the_heads_tree_most_likely_first() -> None:
    tree = with_copies(_head_chain(), _copy_chain(), [1.0, 0.9, 0.5, 0.2], 1.0)
    # 7 drafted by both (kept once, its better chance), then 10 (a copy), 8 (the head's),
    # 11 (a copy), 9 (the head's)
    assert tree.tokens == [5, 7, 10, 8, 11, 9]
    assert tree.parents == [-1, 0, 1, 1, 2, 3]
    assert tree.expected == pytest.approx([1.0, 0.9, 0.5, 0.3, 0.2, 0.1])
    assert tree.probs == pytest.approx([1.0, 0.6, 0.0, 0.3, 0.0, 0.1])  # the head's own
    assert tree.copied == [False, True, True, False, True, False]
    assert tree.evidence == 3
    # the controller's first m nodes: the m most likely, a subtree, every list cut with them
    first = tree.first(3)
    assert (first.tokens, first.parents, first.copied) == ([5, 7, 10], [-1, 0, 1],
                                                           [False, True, True])
    assert first.expected == pytest.approx([1.0, 0.9, 0.5])
    # the head's chances are scaled by its calibration (at most a whole token), and a child
    # is never priced above its parent
    scaled = with_copies(_head_chain(), _copy_chain(), [1.0, 0.9, 0.5, 0.2], 2.5)
    assert scaled.tokens == [5, 7, 8, 10, 9, 11]
    assert scaled.expected == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.25, 0.2])
    # no head tree (its drafting paused): the copies alone, none of them the head's
    alone = with_copies(None, _copy_chain(), [1.0, 0.9, 0.5, 0.2], 1.0)
    assert alone.tokens == [5, 7, 10, 11] and alone.probs == [1.0, 0.0, 0.0, 0.0]
    assert alone.copied == [False, True, True, True]


def test_a_grafted_verify_measures_each_drafter_on_its_own_nodes() -> None:
    tree = with_copies(_head_chain(), _copy_chain(), [1.0, 0.9, 0.5, 0.2], 1.0)
    ctl = SpecController()
    state = SpecState()
    key = _evidence_key(3, False)
    with pytest.raises(ValueError, match="nodes it committed"):
        ctl.record_verify(state, 4, tree)
    # the head's chain was taken (7, 8, 9): the copies' 7 at depth 1 accepted, their 10 at
    # depth 2 tried and turned down, 11 not tried
    ctl.record_verify(state, 4, tree, [0, 1, 3, 5])
    assert ctl.depth_tried[key] == pytest.approx([1.0, 1.0, 0.0])
    assert ctl.depth_accepted[key] == pytest.approx([1.0, 0.0, 0.0])
    assert state.copying  # a copied draft was accepted
    # the head: its three nodes taken of 0.6 + 0.3 + 0.1 = 1.0 predicted
    w = 0.05
    assert ctl.drafts_accepted == pytest.approx((1 - w) * 1.0 + w * 3)
    assert ctl.drafts_predicted == pytest.approx((1 - w) * 1.0 + w * 1.0)
    # the copies' chain taken (7, 10, 11): every copy depth accepted, one head node of three
    before = (ctl.drafts_accepted, ctl.drafts_predicted)
    ctl.record_verify(state, 4, tree, [0, 1, 2, 4])
    key = _evidence_key(3, True)
    assert ctl.depth_accepted[key] == pytest.approx([1.0, 1.0, 1.0])
    assert ctl.drafts_accepted == pytest.approx((1 - w) * before[0] + w * 1)
    assert ctl.drafts_predicted == pytest.approx((1 - w) * before[1] + w * 1.0)
    # a copies-only tree (no head nodes) leaves the head's calibration alone
    before = (ctl.drafts_accepted, ctl.drafts_predicted)
    alone = with_copies(None, _copy_chain(), [1.0, 0.9, 0.5, 0.2], 1.0)
    ctl.record_verify(state, 2, alone, [0, 1])
    assert (ctl.drafts_accepted, ctl.drafts_predicted) == before


def test_the_controller_takes_a_grafted_trees_prices() -> None:
    ctl = SpecController()
    ctl.record_forward(1, 0.010)
    for rows in (2, 3, 4, 5, 6):
        ctl.record_forward(rows, 0.010 + 0.0005 * (rows - 1))
    tree = with_copies(_head_chain(), _copy_chain(), [1.0, 0.9, 0.5, 0.2], 1.0)
    counts, pays = ctl.choose_nodes(1, [tree])
    # a row costs a twentieth of the step: a node is kept while its expected share of a
    # token beats the tokens per step so far (1.9 / 10.5, 2.4 / 11, 2.7 / 11.5 ms; then
    # 2.9 / 12 = 0.24, so 0.2 is kept and 0.1 is not), priced by `expected` (the copies'
    # 0.5 and 0.2 are 0.0 to the head: priced by those, 4 nodes would be kept)
    assert counts == [5] and pays


# ---- the default model -------------------------------------------------------------------------

QUANT = "int4"
# as in test_speculative.py: exact greedy equality needs every row computed by the same sums
DETERMINISTIC = dict(quantization=QUANT, enable_deterministic_inference=True)
GREEDY = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
_DOC = ("Order 5521 was placed by Dana Whitfield of 14 Elm Row, Leeds LS2 7HX, on 3 June "
        "2024: 4 lamps at 19.99 GBP each, delivered by Parcelline, tracking number "
        "PL-88213-UK.")
COPY_PROMPTS = [
    f"Here is a message:\n\n{_DOC}\n\nExtract order_id, name, address, date and tracking "
    "number as JSON.",
    "Copy this list exactly: apple, pear, plum, apple, pear, plum, fig, kiwi, lime.",
]


@pytest.fixture(scope="module")
def copy_prompts():
    from sglang_like.model_loader import load_tokenizer

    tok = load_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": p}]) for p in COPY_PROMPTS]


@pytest.fixture(scope="module")
def want(make_engine, copy_prompts):
    off = make_engine(**DETERMINISTIC)
    return [o["output_ids"] for o in off.generate(copy_prompts, GREEDY)]


def _accept(outs: list[dict]) -> float:
    meta = [o["meta_info"] for o in outs]
    return (sum(m["completion_tokens"] for m in meta) - len(meta)) / sum(
        m["spec_verify_ct"] for m in meta)


def test_eagle_with_copies_equals_spec_off_and_commits_more(make_engine, copy_prompts,
                                                            want) -> None:
    """On copy-heavy prompts the head's drafts with NGRAM's branch commit more tokens a
    verify than the head's alone, and every output is the one without speculation."""
    accept, head_forwards = {}, {}
    for branch in (False, True):
        engine = make_engine(**DETERMINISTIC, speculative_algorithm="EAGLE3",
                             speculative_auto_disable=False,
                             speculative_eagle_ngram_branch=branch)
        drafter = engine._client.core.scheduler.drafter
        before = drafter.num_forwards
        outs = [engine.generate(p, GREEDY) for p in copy_prompts]
        assert [o["output_ids"] for o in outs] == want
        accept[branch] = _accept(outs)
        verifies = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
        head_forwards[branch] = (drafter.num_forwards - before) / verifies
    print(f"\ncopy prompts, tokens per verify: head {accept[False]:.2f}, "
          f"head + NGRAM branch {accept[True]:.2f}; head forwards per verify "
          f"{head_forwards[False]:.2f} and {head_forwards[True]:.2f}")
    # measured 1.54 and 2.29 on a 2-core AMD EPYC
    assert accept[True] > accept[False] + 0.5
    # the head's extend after every forward and two draft steps a verify; where the copies
    # are sure (`eagle._COPY_SURE`) the draft steps are skipped (measured 2.96 and 2.18)
    assert head_forwards[True] < head_forwards[False] - 0.5


def test_copies_are_drafted_while_the_head_is_paused(make_engine, copy_prompts, want,
                                                     monkeypatch) -> None:
    """A request whose head drafting the controller paused still gets NGRAM's trees (the
    pause is for the head's cost): with every head paused, the head never drafts, copies are
    verified and committed, and the output is the one without speculation."""
    engine = make_engine(**DETERMINISTIC, speculative_algorithm="EAGLE3")
    monkeypatch.setattr(SpecController, "may_draft", lambda self, state, ahead=0: False)
    sched = engine._client.core.scheduler
    drafts_before = sched.drafter.num_forwards
    outs = [engine.generate(p, GREEDY) for p in copy_prompts]
    assert [o["output_ids"] for o in outs] == want
    assert sched.drafter.num_forwards == drafts_before  # no head forward: extends or drafts
    hist = engine.get_server_info()["spec_accept_lengths"]
    assert sum(v for k, v in hist.items() if k > 2) > 0, hist  # copied spans committed
    assert _accept(outs) > 1.3


def test_copies_in_a_big_batch_are_drafted_rarely_while_turned_down() -> None:
    """A batch of 8 whose heads are paused and whose grafted copies were all turned down for
    16 steps drafts copies every 8th step only (as NGRAM does), until one is kept."""
    calls = []
    sure = [False]

    class Drafter:  # EAGLE's interface: a head (paused here) and a copier
        copier = object()

        def propose(self, reqs, depths, ctx, heads=None):
            calls.append((ctx.controller.step, heads is not None))
            chance = 0.9 if sure[0] else 0.01
            return [with_copies(None, DraftTree([1, 2, 3], [-1, 0, 1], evidence=2),
                                [1.0, chance, chance], 1.0) for _ in reqs]

    ctl = SpecController()
    ctl.record_forward(8, 0.02)
    ctl.record_forward(24, 0.04)
    propose, reqs = fake_batch(Drafter(), ctl, backoff_until=10**6)  # every head paused

    for step in range(1, 49):
        plain_step_to(ctl, step)
        assert propose(reqs) == {}
    assert calls == [(s, True) for s in (*range(1, 17), 24, 32, 40, 48)]
    sure[0] = True  # now the copies are worth their rows: kept on the next drafting step
    plain_step_to(ctl, 56)
    assert len(propose(reqs)) == 8 and ctl.cheap_idle_steps == 0
    plain_step_to(ctl, 57)
    assert len(propose(reqs)) == 8 and calls[-1] == (57, True)
