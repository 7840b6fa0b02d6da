"""Greedy output must not depend on the radix cache, chunked prefill, or the batch it ran in.

On the exact fp32 path (`quantization="none"`) outputs are equal token for token. On the
default path (int4 weights, bf16 activations) a different kernel order (chunked vs whole
prefill, decode vs extend attention) can flip one bf16 rounding, which moves logits by a few
hundredths: there outputs must be equal or first differ at a near-tie of the baseline, a step
whose top-2 logprob gap is under TIE_NATS.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

# Decode and prefill of the same tokens differ by up to 0.04 nats under bf16 activations
# (measured on the default model, test_engine_api); a gap under 2.5x that is a tie.
TIE_NATS = 0.1

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


@pytest.fixture(scope="module", params=["none", "auto"])
def quantization(request):
    return request.param


@pytest.fixture(scope="module")
def baseline(make_engine, quantization):
    """Each prompt alone, nothing cached: (output ids, top-2 logprob gap at each step)."""
    engine = make_engine(disable_radix_cache=True, chunked_prefill_size=None,
                         quantization=quantization)
    runs = [engine.generate(p, GREEDY, return_logprob=True, top_logprobs_num=2)
            for p in PROMPTS]
    gaps = [[top[0][0] - top[1][0] for top in r["meta_info"]["output_top_logprobs"]]
            for r in runs]
    return [r["output_ids"] for r in runs], gaps


def assert_same(outputs, baseline, quantization):
    ids, gaps = baseline
    if quantization == "none":
        assert outputs == ids
        return
    for got, want, gap in zip(outputs, ids, gaps, strict=True):
        diverge = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b),
                       None)
        assert diverge is None or gap[diverge] < TIE_NATS, (diverge, gap[diverge], got, want)


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
def test_greedy_same_across_cache_and_chunking(make_engine, baseline, quantization, knobs):
    engine = make_engine(quantization=quantization, **knobs)
    first = texts(engine, PROMPTS)
    again = texts(engine, PROMPTS)  # second pass hits the radix cache when it is on
    assert_same(first, baseline, quantization)
    assert_same(again, baseline, quantization)


def test_greedy_same_alone_and_in_a_batch_of_16(make_engine, baseline, quantization):
    engine = make_engine(chunked_prefill_size=64, quantization=quantization)
    fillers = [f"Filler request number {i} talks about" for i in range(12)]
    mixed = fillers[:6] + PROMPTS + fillers[6:]
    params = [dict(GREEDY, max_new_tokens=8 + 3 * i) for i in range(6)] + [GREEDY] * 4 + [
        dict(GREEDY, max_new_tokens=40) for _ in range(6)
    ]
    outs = engine.generate(mixed, params)
    assert_same([o["output_ids"] for o in outs[6:10]], baseline, quantization)
