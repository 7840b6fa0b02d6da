"""LoRA adapters on other families, against PEFT on transformers (issue #50).

Phi-3's checkpoints fuse q/k/v and gate/up (a PEFT adapter then targets `qkv_proj` and
`gate_up_proj`, one A per fused module) and Phi-4-mini's partial rotary reorders q/k rows at
load: an adapter's B must get the same splits and reorders (lora.adapter sends it through the
family's adapt_hf_weights). Gemma 2 (sandwich norms, soft-caps) and OLMo 2 (q/k norms over
all heads; rsLoRA here) use the plain names. Per family: a seeded random PEFT adapter, our
fp32 prefill logits within 1e-4 of PeftModel's, and greedy output equal to its generate."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks.tiny_families import FAMILIES, PROMPTS, build_folder

from .test_hf_archs import _hf_greedy, _our_prefill_logits, tokenizer_json  # noqa: F401
from .test_model_families import _engine

peft = pytest.importorskip("peft")

CASES = {"phi3-longrope-partial": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
         "gemma2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj"],
         "olmo2": ["q_proj", "v_proj", "down_proj"]}
_BY_NAME = {f.name: f for f in FAMILIES}


@pytest.fixture(scope="module", params=sorted(CASES))
def built(request, tmp_path_factory, tokenizer_json):  # noqa: F811
    family = _BY_NAME[request.param]
    folder = tmp_path_factory.mktemp(family.name)
    hf_model = build_folder(family, folder, tokenizer_json)
    torch.manual_seed(7)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=CASES[request.param],
                             init_lora_weights=False, use_rslora=request.param == "olmo2")
    peft_model = peft.get_peft_model(hf_model, config).eval()
    with torch.no_grad():  # PEFT's random init is small beside these weights: make it count
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    adapter = folder / "adapter"
    peft_model.save_pretrained(str(adapter))
    engine = _engine(str(folder), quantization="none", lora_paths=[f"t={adapter}"])
    yield peft_model, engine
    engine.shutdown()


def test_family_adapter_equals_peft(built: Any) -> None:
    peft_model, engine = built
    for prompt in PROMPTS[:3]:
        ids = engine.tokenizer.encode(prompt)
        with torch.inference_mode():
            want = peft_model(torch.tensor([ids])).logits[0].float()
            base = peft_model.get_base_model()
            with peft_model.disable_adapter():
                plain = base(torch.tensor([ids])).logits[0].float()
        assert (want - plain).abs().max() > 1e-2  # the adapter changes the logits
        got = _prefill_with_adapter(engine, ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        out = engine.generate(input_ids=ids, sampling_params={
            "temperature": 0, "max_new_tokens": 16, "ignore_eos": True}, lora_path="t")
        assert out["output_ids"] == _hf_greedy(peft_model, ids, 16)


def _prefill_with_adapter(engine: Any, ids: list[int]) -> torch.Tensor:
    """All-position logits of `ids` with adapter "t" on every row (an idle engine)."""
    from sglang_like.layers.lora import LoraBatch

    model = engine.runner.model
    weights = engine.scheduler.loras.get("t").adapter.weights
    lora = LoraBatch.build([weights], [len(ids)])
    forward = model.forward

    def with_lora(fb: Any, pool: Any) -> torch.Tensor:
        fb.lora = lora
        return forward(fb, pool)

    model.forward = with_lora
    try:
        return _our_prefill_logits(engine, ids)
    finally:
        del model.forward
