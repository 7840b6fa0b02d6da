"""Embeddings (Engine.encode): the final hidden states (after the model's norm) pooled and
L2-normalized equal transformers' on a tiny seeded model (fp32), for "last" and "mean" pooling,
batched, with a cached prefix and through 4-token prefill chunks; --is-embedding refuses to
generate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.tiny_families import Family, build_folder
from sglang_like import Engine

PROMPTS = ["The capital of France is", "The capital of France is Paris, and of Italy",
           "Rain falls soft on the roof"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, build_folder(Family("llama", "llama", {}), folder)


def _want(model: Any, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
    vec = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vec, dim=0)


@pytest.mark.parametrize("chunk", [None, 4])
def test_encode_equals_transformers_hidden_states(tiny: tuple[Path, Any], chunk: Any) -> None:
    folder, model = tiny
    engine = Engine(model_path=str(folder), dtype="float32", quantization="none",
                    engine_in_process=True, max_total_tokens=2048,
                    chunked_prefill_size=chunk)
    try:
        for pooling in ("last", "mean"):
            # twice: the second pass finds every prompt's prefix cached (mean pooling then
            # recomputes it: each row's hidden state is read)
            for _ in range(2):
                got = engine.encode(PROMPTS, pooling=pooling)
                assert len(got) == len(PROMPTS)
                for prompt, item in zip(PROMPTS, got, strict=True):
                    ids = engine.tokenizer.encode(prompt)
                    assert item["meta_info"]["prompt_tokens"] == len(ids)
                    vec = torch.tensor(item["embedding"])
                    assert abs(vec.norm().item() - 1) < 1e-5
                    torch.testing.assert_close(vec, _want(model, ids, pooling), atol=1e-4,
                                               rtol=0)
        one = engine.encode(input_ids=engine.tokenizer.encode(PROMPTS[0]))
        assert one["embedding"] == engine.encode(PROMPTS[0])["embedding"]
        with pytest.raises(ValueError, match="pooling must be one of"):
            engine.encode(PROMPTS[0], pooling="cls")
        # an embedding request generates nothing, and generation goes on beside it
        assert engine.generate(PROMPTS[0], {"max_new_tokens": 3})["meta_info"][
            "completion_tokens"] == 3
    finally:
        engine.shutdown()


def test_an_embedding_server_refuses_to_generate(tiny: tuple[Path, Any]) -> None:
    engine = Engine(model_path=str(tiny[0]), dtype="float32", quantization="none",
                    engine_in_process=True, max_total_tokens=1024, is_embedding=True)
    try:
        with pytest.raises(ValueError, match="serves embeddings"):
            engine.generate(PROMPTS[0], {"max_new_tokens": 2})
        assert len(engine.encode(PROMPTS[0])["embedding"]) == engine.model_config.hidden_size
    finally:
        engine.shutdown()
