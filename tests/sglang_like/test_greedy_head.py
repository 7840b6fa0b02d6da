"""Greedy decode batches take the LM head's argmax path where the CPU has it (AVX-512 VNNI's
x16 head: Scheduler._argmax_only -> ModelRunner.forward_greedy): the tokens are those the full
logits give, and a batch with any row that needs its logits runs the logits path."""

from __future__ import annotations

import pytest

from .prompts import PROMPTS

PARAMS = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


def _cold(engine, prompts, params, **kw):
    """Generate with the radix cache empty: each comparison's runs then schedule their
    prompts alike (a cached prompt's last token runs as a decode row, a cold batch of 256+
    prompt tokens through the prefill GEMM, whose rounding differs; see README)."""
    engine.flush_cache()
    return engine.generate(prompts, params, **kw)


@pytest.fixture(scope="module")
def engine(make_engine):
    e = make_engine()
    if not e._client.core.runner.has_greedy_forward:
        pytest.skip("this CPU's LM head has no argmax path (it needs AVX-512 VNNI, not AMX)")
    return e


@pytest.fixture
def greedy_calls(engine, monkeypatch) -> list[int]:
    """The row count of every forward_greedy call from here on."""
    runner = engine._client.core.runner
    calls: list[int] = []
    original = runner.forward_greedy

    def counted(batch):
        calls.append(len(batch.reqs))
        return original(batch)

    monkeypatch.setattr(runner, "forward_greedy", counted)
    return calls


def test_every_head_argmax_is_the_argmax_of_the_logits(engine, greedy_calls,
                                                        monkeypatch) -> None:
    """Each call of the head's argmax on the real model's hidden states picks the token
    argmax_rows picks from the same rows' logits."""
    from sglang_like.layers.quantization.q8_head import Q8HeadMethod
    from sglang_like_kernels.cpu.ops import argmax_rows

    checked: list[int] = []
    original = Q8HeadMethod.argmax

    def both(self, layer, x):
        ids = original(self, layer, x)
        assert ids.tolist() == argmax_rows(self.apply(layer, x))
        checked.append(x.shape[0])
        return ids

    monkeypatch.setattr(Q8HeadMethod, "argmax", both)
    out = _cold(engine, PROMPTS, PARAMS)  # 16 rows: the head's own kernel (from 12 rows)
    assert greedy_calls and max(greedy_calls) == 16  # the batch decoded on that path
    assert max(checked) == 16 and len(checked) >= PARAMS["max_new_tokens"] - 1
    assert all(len(o["output_ids"]) == PARAMS["max_new_tokens"] for o in out)
    n = len(greedy_calls)
    _cold(engine, PROMPTS, PARAMS, return_logprob=True)  # logprobs need the logits
    assert len(greedy_calls) == n


def test_one_row_that_needs_logits_keeps_its_batch_on_the_logits_path(engine,
                                                                     greedy_calls) -> None:
    prompts = PROMPTS[8:12]
    alone = _cold(engine, prompts, PARAMS)
    del greedy_calls[:]
    # a penalty on one request: every step of the batch it is in runs the logits path
    mixed = _cold(engine, prompts, [PARAMS] * 3 + [{**PARAMS, "frequency_penalty": 0.5}])
    assert all(rows < 4 for rows in greedy_calls)  # only after it left, if ever
    for a, b in zip(alone[:3], mixed[:3], strict=True):
        assert a["output_ids"] == b["output_ids"]


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3"])
def test_drafters_plain_decode_steps_take_it(make_engine, engine, monkeypatch,
                                             algorithm: str) -> None:
    """A drafter makes no draft at 32 rows on CPU (none pays there): those steps take the
    argmax path too, EAGLE's captured features kept, and give the tokens off gives."""
    spec = make_engine(speculative_algorithm=algorithm)
    runner = spec._client.core.runner
    calls: list[int] = []
    original = runner.forward_greedy

    def counted(batch):
        calls.append(len(batch.reqs))
        ids = original(batch)
        if runner.aux_layers:  # EAGLE: the features of this very forward
            assert runner.last_features.shape[0] == len(batch.reqs)
        return ids

    monkeypatch.setattr(runner, "forward_greedy", counted)
    prompts = PROMPTS * 2
    got = _cold(spec, prompts, PARAMS)
    assert 32 in calls
    want = _cold(engine, prompts, PARAMS)  # no drafter
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
