"""Multi-LoRA serving (issue #50) against PEFT on transformers, on the default model: real
engines, real adapters (the shipped JSON-answer one and seeded random ones made by PEFT).

- fp32 (quantization="none"): greedy output with each adapter equals PEFT's token for token;
- one call mixing the base model and three adapters equals each request run alone (and PEFT);
- the shipped adapter does its job through our engine (held-out questions answered as JSON);
- the packed int4 base (quantization="auto") with an adapter tracks fp32 PEFT teacher-forced.
"""

from __future__ import annotations

import pytest

from sglang_like.lora import SHIPPED_ADAPTER as SHIPPED
from training.train_lora import heldout_questions, parse_answer

from . import lora_reference
from .lora_reference import chat_ids, peft_greedy, peft_logits, random_adapter

pytestmark = pytest.mark.slow

NEW_TOKENS = 20
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
QUESTIONS = [
    "Write a haiku about rain.",
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Give me three tips for learning a new language.",
]
# the mixed batch's order: base model, two random adapters, the shipped one
NAMES = [None, "a", "b", "json"]


@pytest.fixture(scope="module", autouse=True)
def _release_reference():
    yield
    lora_reference.release()  # the fp32 transformers model goes with this module


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    """name -> PEFT folder: rank 4 (alpha 8) on attention and gate/up only (no down_proj),
    rank 16 with rsLoRA (scaling alpha / sqrt(r)) on all seven, and the shipped rank 8."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "a": random_adapter(str(root / "a"), rank=4, seed=1,
                            targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj")),
        "b": random_adapter(str(root / "b"), rank=16, seed=2, use_rslora=True),
        "json": SHIPPED,
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [chat_ids(q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def references(adapters, prompts) -> dict[str | None, list[list[int]]]:
    """PEFT's greedy continuations of every prompt, per adapter (None: the base model)."""
    return {name: peft_greedy(None if name is None else adapters[name], prompts, NEW_TOKENS)
            for name in NAMES}


@pytest.fixture(scope="module")
def engine(make_engine, adapters):
    """The exact fp32 path; two adapters from lora_paths, the third loaded at run time."""
    e = make_engine(quantization="none", max_total_tokens=4096, enable_lora=True,
                    max_lora_rank=16,
                    lora_paths=[f"a={adapters['a']}", f"json={adapters['json']}"])
    e.load_lora_adapter("b", adapters["b"])
    return e


def test_adapters_are_listed(engine, adapters) -> None:
    listed = {d["name"]: d for d in engine.list_lora_adapters()}
    assert set(listed) == {"a", "b", "json"}
    assert {n: listed[n]["rank"] for n in listed} == {"a": 4, "b": 16, "json": 8}
    assert listed["b"]["path"] == adapters["b"]


@pytest.mark.parametrize("name", ["a", "b", "json"])
def test_greedy_equals_peft(engine, prompts, references, name) -> None:
    got = engine.generate(input_ids=prompts, sampling_params=GREEDY,
                          lora_path=[name] * len(prompts))
    assert [g["output_ids"] for g in got] == references[name]
    # the adapter changed the output (the test would pass vacuously on a no-op)
    assert sum(r != b for r, b in zip(references[name], references[None], strict=True)) >= 2


def test_mixed_batch_equals_each_alone(engine, prompts, references) -> None:
    """One call, four requests, four different weight sets (the base among them)."""
    batch = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=NAMES)
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY, lora_path=n)
             for p, n in zip(prompts, NAMES, strict=True)]
    assert [b["output_ids"] for b in batch] == [a["output_ids"] for a in alone]
    assert [b["output_ids"] for b in batch] == [references[n][i] for i, n in enumerate(NAMES)]


def test_shipped_adapter_answers_json(engine) -> None:
    """The shipped adapter's behaviour through our engine's own chat path, on questions its
    training held out: one-line JSON objects with an "answer" key; the base model's are not."""
    held = heldout_questions()[:8]
    texts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q, _ in held]
    params = {"max_new_tokens": 32, "temperature": 0}
    with_json = engine.generate(texts, params, lora_path=["json"] * len(texts))
    base = engine.generate(texts, params)
    ok = sum(parse_answer(r["text"]) is not None for r in with_json) / len(held)
    base_ok = sum(parse_answer(r["text"]) is not None for r in base) / len(held)
    assert ok >= 0.8, [r["text"] for r in with_json]
    assert base_ok <= 0.25, [r["text"] for r in base]


QUANT_TOKENS = 48


def test_quantized_base_tracks_fp32_peft(make_engine, engine, adapters, prompts) -> None:
    """The packed int4 base (auto for the Q4_1 GGUF) with an adapter against fp32 PEFT:
    teacher-forced top-1 agreement over the adapter's own greedy continuations (from the fp32
    engine, which the tests above hold equal to PEFT's; the int4 base alone agrees 97.9% with
    fp32, README)."""
    quant = make_engine(quantization="auto", max_total_tokens=4096, enable_lora=True,
                        lora_paths=[f"json={adapters['json']}", f"b={adapters['b']}"])
    params = {"max_new_tokens": QUANT_TOKENS, "temperature": 0, "ignore_eos": True}
    per = {}
    for name in ("json", "b"):
        conts = engine.generate(input_ids=prompts, sampling_params=params,
                                lora_path=[name] * len(prompts))
        hits = 0
        for p, c in zip(prompts, conts, strict=True):
            ids = p + c["output_ids"]
            meta = quant.generate(input_ids=[ids], sampling_params={"max_new_tokens": 0},
                                  return_logprob=True, logprob_start_len=0,
                                  top_logprobs_num=1, lora_path=[name])[0]["meta_info"]
            # entry k (k >= 1) is the prediction of token k from tokens < k
            ours = [t[0][1] for t in meta["input_top_logprobs"][len(p):]]
            want = peft_logits(adapters[name], ids)[len(p) - 1:len(ids) - 1]
            assert len(ours) == len(want) == QUANT_TOKENS
            hits += sum(a == b for a, b in zip(ours, want, strict=True))
        per[name] = hits / (len(prompts) * QUANT_TOKENS)
    quant.shutdown()
    print(f"int4 base + adapter vs fp32 PEFT, teacher-forced top-1 agreement: {per}")
    assert min(per.values()) >= 0.95, per
