"""Greedy output must not depend on the radix cache, chunked prefill, or the batch it ran in."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

PROMPTS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is a "
    "radix tree?<|im_end|>\n<|im_start|>assistant\n",
    "The history of the printing press begins",
    "def quicksort(xs):\n    ",
    "Rain, rain, go away,",
]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def texts(engine, prompts):
    return [o["output_ids"] for o in engine.generate(list(prompts), GREEDY)]


@pytest.fixture(scope="module")
def baseline(make_engine):
    engine = make_engine(disable_radix_cache=True, chunked_prefill_size=None)
    return [texts(engine, [p])[0] for p in PROMPTS]  # each alone, nothing cached


@pytest.mark.parametrize(
    "knobs",
    [
        {"disable_radix_cache": False, "chunked_prefill_size": None},
        {"disable_radix_cache": False, "chunked_prefill_size": 16},
        {"disable_radix_cache": False, "chunked_prefill_size": 64},
        {"disable_radix_cache": True, "chunked_prefill_size": 16},
    ],
    ids=lambda k: f"radix={not k['disable_radix_cache']},chunk={k['chunked_prefill_size']}",
)
def test_greedy_same_across_cache_and_chunking(make_engine, baseline, knobs):
    engine = make_engine(**knobs)
    first = texts(engine, PROMPTS)
    again = texts(engine, PROMPTS)  # second pass hits the radix cache when it is on
    assert first == baseline
    assert again == baseline


def test_greedy_same_alone_and_in_a_batch_of_16(make_engine, baseline):
    engine = make_engine(chunked_prefill_size=64)
    fillers = [f"Filler request number {i} talks about" for i in range(12)]
    mixed = fillers[:6] + PROMPTS + fillers[6:]
    params = [dict(GREEDY, max_new_tokens=8 + 3 * i) for i in range(6)] + [GREEDY] * 4 + [
        dict(GREEDY, max_new_tokens=40) for _ in range(6)
    ]
    outs = engine.generate(mixed, params)
    assert [o["output_ids"] for o in outs[6:10]] == baseline
