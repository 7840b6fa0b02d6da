"""The device_sampling switch: resolved from ServerArgs, and on CPU tensors ("on") an engine
generates what the host sampler does for greedy requests, falls back to it for DRY / XTC, and
a seed draws the same alone and in a batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.tiny_families import Family, build_folder
from sglang_like import Engine
from sglang_like.engine_core.setup import resolve_device_sampling

PROMPTS = ["The capital of France is", "Rain falls soft on the roof", "One two three"]


@pytest.mark.parametrize(("value", "device", "want"), [
    ("auto", "cpu", False), ("auto", "cuda", True), ("on", "cpu", True), ("off", "cuda", False),
])
def test_the_switch_resolves(value: str, device: str, want: bool) -> None:
    assert resolve_device_sampling(value, torch.device(device)) is want


def test_a_bad_switch_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="device_sampling"):
        resolve_device_sampling("yes", torch.device("cpu"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    build_folder(Family("llama", "llama", {}), path)
    return path


def _engine(folder: Path, device_sampling: str) -> Engine:
    return Engine(model_path=str(folder), dtype="float32", quantization="none",
                  engine_in_process=True, max_total_tokens=1024,
                  device_sampling=device_sampling)


GREEDY = [
    {"max_new_tokens": 6, "temperature": 0.0},
    {"max_new_tokens": 6, "temperature": 0.0, "repetition_penalty": 1.5,
     "frequency_penalty": 0.5, "logit_bias": {"5": 3.0}},
    {"max_new_tokens": 6, "temperature": 0.0, "min_new_tokens": 4, "presence_penalty": 1.0},
]


def test_device_sampling_on_cpu_tensors_matches_the_host_sampler(folder: Path) -> None:
    outputs = {}
    for mode in ("off", "on"):
        engine = _engine(folder, mode)
        try:
            assert (engine.scheduler.device_sampler is not None) is (mode == "on")
            outputs[mode] = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        finally:
            engine.shutdown()
    assert outputs["on"] == outputs["off"]


def test_seeds_and_the_host_fallback_with_device_sampling_on(folder: Path) -> None:
    engine = _engine(folder, "on")
    try:
        seeded = {"max_new_tokens": 5, "temperature": 0.9, "top_p": 0.9, "seed": 7}
        alone = engine.generate(PROMPTS[0], seeded)["output_ids"]
        batch = engine.generate(PROMPTS, [seeded, {"max_new_tokens": 5, "top_k": 3, "seed": 1},
                                          {"max_new_tokens": 5, "temperature": 0.0}])
        assert batch[0]["output_ids"] == alone
        dry = {"max_new_tokens": 4, "temperature": 0.0, "dry_multiplier": 0.8}
        xtc = {"max_new_tokens": 4, "xtc_probability": 0.5, "seed": 3}
        out = engine.generate(PROMPTS[:2], [dry, xtc])  # sampled on the host: still served
        assert [o["meta_info"]["completion_tokens"] for o in out] == [4, 4]
    finally:
        engine.shutdown()
