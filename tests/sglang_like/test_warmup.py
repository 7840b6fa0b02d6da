"""The start-up warmup (engine_core.warmup), forced on CPU with skip_server_warmup=False on a
tiny seeded llama: it runs through the scheduler (a verify under speculation) and leaves no
trace: every KV slot and request row free, the radix cache empty, no request or step counted,
the configured speculation controller back, and the same output as an engine without it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sglang_like.engine_core.warmup as warmup_mod
from benchmarks.tiny_families import Family, build_folder
from sglang_like import Engine
from sglang_like.engine_core.setup import resolve_skip_server_warmup
from sglang_like.launch_server import build_parser, server_args_from
from sglang_like.model_runner import ModelRunner

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
PARAMS = [{"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
          {"max_new_tokens": 12, "temperature": 0.8, "top_k": 20, "seed": 3,
           "ignore_eos": True}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    build_folder(Family("llama", "llama", {}), path)
    return str(path)


def _engine(folder: str, **kw: Any) -> Engine:
    return Engine(model_path=folder, quantization="none", engine_in_process=True,
                  max_total_tokens=2048, log_level="warning", **kw)


@pytest.fixture(scope="module")
def plain(folder: str) -> Engine:
    return _engine(folder)


def _outputs(engine: Engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(PROMPTS * 2, PARAMS * 2)]


def _warm(folder: str, monkeypatch: pytest.MonkeyPatch, **kw: Any
          ) -> tuple[Engine, list[warmup_mod.WarmupResult], list[bool]]:
    """An engine started with the warmup, what it ran, and whether each batch it ran (its
    own and any before the engine is returned) held a draft tree."""
    runs: list[warmup_mod.WarmupResult] = []
    trees: list[bool] = []
    real_warm_up, real_batch = warmup_mod.warm_up, ModelRunner.build_forward_batch

    def warm_up(scheduler: Any) -> warmup_mod.WarmupResult:
        runs.append(real_warm_up(scheduler))
        return runs[-1]

    def build_forward_batch(self: ModelRunner, batch: Any) -> Any:
        trees.append(batch.has_trees)
        return real_batch(self, batch)

    monkeypatch.setattr(warmup_mod, "warm_up", warm_up)
    monkeypatch.setattr(ModelRunner, "build_forward_batch", build_forward_batch)
    engine = _engine(folder, skip_server_warmup=False, **kw)
    monkeypatch.undo()
    return engine, runs, trees


def _assert_no_trace(engine: Engine) -> None:
    info = engine.get_server_info()
    pool = info["kv_pool"]
    assert pool["free_slots"] == pool["total_slots"] == 2048
    assert pool["cached_slots"] == pool["used_slots"] == 0
    assert engine.scheduler.cache.tree.num_nodes == 0  # nothing under the root
    rows = engine.runner.req_to_token_pool
    assert rows.num_free_rows == engine.server_args.max_running_requests + 1
    for key in ("num_running_reqs", "num_queued_reqs", "num_prompt_tokens",
                "num_cached_prompt_tokens", "num_generated_tokens", "num_forward_steps",
                "num_computed_prompt_tokens"):
        assert info[key] == 0, key
    assert info["spec_accept_lengths"] == {}
    assert info["cache_hit_rate"] == 0


def test_cpu_skips_the_warmup_unless_asked(plain: Engine) -> None:
    assert plain.server_args.skip_server_warmup is True
    assert resolve_skip_server_warmup(None, torch.device("cpu")) is True
    assert resolve_skip_server_warmup(None, torch.device("cuda")) is False
    assert resolve_skip_server_warmup(True, torch.device("cuda")) is True
    assert resolve_skip_server_warmup(False, torch.device("cpu")) is False


def test_cli_flag() -> None:
    assert server_args_from(build_parser().parse_args([])).skip_server_warmup is None
    assert server_args_from(build_parser().parse_args(
        ["--skip-server-warmup"])).skip_server_warmup is True


def test_warmup_leaves_no_trace(folder: str, plain: Engine,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    engine, runs, trees = _warm(folder, monkeypatch)
    try:
        assert engine.server_args.skip_server_warmup is False
        # prefills in one step, then the decode steps (the greedy request's alone at the end)
        assert len(runs) == 1 and runs[0].num_forward_steps == len(trees) >= 8
        _assert_no_trace(engine)
        assert _outputs(engine) == _outputs(plain)
    finally:
        engine.shutdown()


def test_warmup_verifies_under_speculation(folder: str, plain: Engine,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    engine, runs, trees = _warm(folder, monkeypatch, speculative_algorithm="NGRAM")
    try:
        assert len(runs) == 1 and any(trees), trees
        _assert_no_trace(engine)
        controller = engine.scheduler.spec_controller
        assert controller.enabled and controller.step == 0  # the configured one, fresh
        # greedy: token for token (a sampled request is the same only in distribution)
        assert _outputs(engine)[::2] == _outputs(plain)[::2]
    finally:
        engine.shutdown()
