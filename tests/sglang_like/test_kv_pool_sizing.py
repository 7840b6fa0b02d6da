"""The KV pool's size (engine_core.setup): on CUDA SGLang's meaning of --mem-fraction-static
(weights and pool together take that share of the GPU's total memory, the pool sized once the
weights are placed), read through a fake device-memory reader; --max-total-tokens overrides;
off CUDA the host's available memory, as before; tensor-parallel workers take rank 0's size."""

from __future__ import annotations

import functools

import pytest
import torch

import sglang_like.engine_core.setup as setup_mod
import sglang_like.model_runner as runner_mod
from sglang_like.config import ModelConfig, ServerArgs
from sglang_like.mem_pool import KVPool
from sglang_like.model_loader.loaded import expected_weight_shapes
from sglang_like.tp.group import wait_num_kv_slots

GIB = 1 << 30
CUDA = torch.device("cuda")  # a name only: nothing here touches a GPU
TINY = ModelConfig("llama", 97, 64, 192, 2, 6, 3, 16, max_position_embeddings=64)


class FakeMemory:
    """Stands for `setup.device_memory`: (free, total) as given, and the calls it answered."""

    def __init__(self, free: int, total: int, events: list[str] | None = None) -> None:
        self.free, self.total = free, total
        self.events = events if events is not None else []

    def __call__(self, device: torch.device) -> tuple[int, int]:
        self.events.append("read")
        return self.free, self.total


@pytest.mark.parametrize("total, used, fraction, per_token, want", [
    # an 8B model (16 GiB of bf16 weights, 0.5 GiB of CUDA context) on an 80 GiB GPU at
    # SGLang's 0.85: 68 GiB for both, 51.5 GiB of them for the pool
    (80 * GIB, 16.5 * GIB, 0.85, 131072, int(51.5 * GIB) // 131072),
    # another process holding 20 GiB of the same GPU counts as in use too
    (80 * GIB, 36.5 * GIB, 0.85, 131072, int(31.5 * GIB) // 131072),
    (24 * GIB, 4 * GIB, 0.5, 65536, 8 * GIB // 65536),
    (1000, 500, 1.0, 10, 50),
])
def test_cuda_pool_is_the_fraction_of_total_memory_less_what_is_used(
        monkeypatch: pytest.MonkeyPatch, total: int, used: float, fraction: float,
        per_token: int, want: int) -> None:
    monkeypatch.setattr(setup_mod, "device_memory", FakeMemory(int(total - used), total))
    got = setup_mod.cuda_pool_slots(per_token, device=CUDA, fraction=fraction, context_len=16)
    assert got == want


@pytest.mark.parametrize("used, context_len", [
    (70 * GIB, 8),  # the weights alone take more than 0.85 of the GPU: nothing is left
    (68 * GIB, 8),  # exactly nothing left
    (68 * GIB - 100 * 131072, 128),  # room for 100 tokens, not one context of 128
])
def test_cuda_pool_too_small_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, used: int,
                                               context_len: int) -> None:
    monkeypatch.setattr(setup_mod, "device_memory", FakeMemory(80 * GIB - used, 80 * GIB))
    with pytest.raises(ValueError) as err:
        setup_mod.cuda_pool_slots(131072, device=CUDA, fraction=0.85, context_len=context_len)
    message = str(err.value)
    for part in ("--mem-fraction-static 0.85", "80.00 GiB", f"{used / GIB:.2f} GiB are in use",
                 f"one context ({context_len} tokens)", "--max-total-tokens"):
        assert part in message, (part, message)


def _args(**kw: object) -> ServerArgs:
    """ServerArgs as build_engine_parts hands them on (fraction and context resolved)."""
    kw.setdefault("context_length", 64)
    return ServerArgs(**kw)


def test_max_total_tokens_overrides_and_nothing_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = FakeMemory(0, 80 * GIB)  # a read would fail: no room at all
    monkeypatch.setattr(setup_mod, "device_memory", reader)
    sa = _args(max_total_tokens=4096, mem_fraction_static=0.85)
    assert setup_mod.pool_slots(sa, TINY, torch.bfloat16, CUDA) == 4096
    assert reader.events == []


def test_cuda_sizing_waits_for_the_weights_cpu_sizing_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reader = FakeMemory(40 * GIB, 80 * GIB)
    monkeypatch.setattr(setup_mod, "device_memory", reader)
    late = setup_mod.pool_slots(_args(mem_fraction_static=0.75), TINY, torch.bfloat16, CUDA)
    assert callable(late) and reader.events == []  # nothing read before the model is built
    assert late(1024) == 20 * GIB // 1024  # 0.75 of 80 GiB, less 40 in use
    assert reader.events == ["read"]
    # elsewhere: sized at once from the host's memory, exactly as before the change
    cpu = setup_mod.pool_slots(_args(mem_fraction_static=0.25), TINY, torch.float32,
                               torch.device("cpu"))
    assert cpu == setup_mod._auto_pool_size(TINY, torch.float32, 0.25)
    assert reader.events == ["read"]


@pytest.mark.parametrize("given, device, want", [
    (None, "cuda", 0.85), (None, "cpu", 0.25), (0.5, "cuda", 0.5), (0.9, "cpu", 0.9),
    (1.0, "cuda", 1.0),
])
def test_mem_fraction_default_by_device(given: float | None, device: str, want: float) -> None:
    assert setup_mod.resolve_mem_fraction(given, torch.device(device)) == want


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_mem_fraction_out_of_range_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="mem_fraction_static must be in"):
        setup_mod.resolve_mem_fraction(bad, torch.device("cuda"))


def test_runner_reads_memory_after_the_weights_and_before_the_pool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelRunner builds the model, places its weights, then sizes the pool (the reader sees
    the weights' memory in use) and allocates it: the order is recorded."""
    events: list[str] = []
    placed = runner_mod.model_class(TINY.architecture)

    class Recorded(placed):  # type: ignore[misc, valid-type]
        def load_weights(self, *args: object, **kwargs: object) -> None:
            super().load_weights(*args, **kwargs)
            events.append("weights")

    class RecordedPool(KVPool):
        def __init__(self, *args: object, **kwargs: object) -> None:
            events.append("pool")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "model_class", lambda arch: Recorded)
    monkeypatch.setattr(runner_mod, "KVPool", RecordedPool)
    per_token = KVPool.bytes_per_token(TINY.num_hidden_layers, TINY.num_key_value_heads,
                                       TINY.head_dim, torch.float32)
    # 0.5 of 1 MiB, 0.25 MiB in use: 0.25 MiB for the pool
    monkeypatch.setattr(setup_mod, "device_memory",
                        FakeMemory(3 << 18, 1 << 20, events))
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=gen) * 0.2
               for name, shape in expected_weight_shapes(TINY).items()}
    runner = runner_mod.ModelRunner(
        TINY, weights, dtype=torch.float32, device=torch.device("cpu"),
        num_kv_slots=functools.partial(setup_mod.cuda_pool_slots, device=CUDA,
                                       fraction=0.5, context_len=64),
        context_len=64, max_running_requests=4)
    assert events == ["weights", "read", "pool"]
    assert runner.kv_pool.num_slots == (1 << 18) // per_token


def test_workers_take_rank_0s_pool_size(tmp_path: object) -> None:
    """The store protocol between TPGroup.share_num_kv_slots and the workers."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)  # type: ignore[operator]
    with pytest.raises(RuntimeError, match="rank 0 is gone"):
        wait_num_kv_slots(store, lambda: "rank 0 is gone")
    store.set("tp/num_kv_slots", b"12345")
    assert wait_num_kv_slots(store, lambda: None) == 12345
    store.set("tp/num_kv_slots", b"0")  # what a group closed before sizing leaves
    with pytest.raises(RuntimeError, match="before sizing"):
        wait_num_kv_slots(store, lambda: None)


def test_cuda_pool_leaves_room_for_the_draft_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """An EAGLE drafter is built after the pool is sized: its head's weights and its own pool
    (one slot per target slot) come off the same budget first."""
    monkeypatch.setattr(setup_mod, "device_memory", FakeMemory(64 * GIB, 80 * GIB))
    # 0.85 of 80 GiB = 68 GiB, 16 in use, 1 GiB of head: 51 GiB at 131072 + 8192 a token
    got = setup_mod.cuda_pool_slots(131072, device=CUDA, fraction=0.85, context_len=16,
                                    reserve=(GIB, 8192))
    assert got == 51 * GIB // (131072 + 8192)
    with pytest.raises(ValueError, match="the draft head takes 52.00 GiB"):
        setup_mod.cuda_pool_slots(131072, device=CUDA, fraction=0.85, context_len=16,
                                  reserve=(52 * GIB, 8192))


def test_draft_head_footprint_is_what_the_drafter_places() -> None:
    """The footprint read from the head's folder (built on the meta device) is the bytes the
    loaded head (float32, no native copy) and the drafter's pool take: the shipped EAGLE-3
    head on the default model, and pool_slots hands it to the CUDA sizing, in bf16 for a
    bf16 model."""
    from sglang_like.engine import Engine
    from sglang_like.speculative import DEFAULT_HEAD
    from sglang_like.speculative.head_loader import draft_head_footprint, load_draft_head

    weights, per_token = draft_head_footprint(DEFAULT_HEAD)
    head = load_draft_head(DEFAULT_HEAD)
    assert weights == sum(t.numel() * t.element_size()
                          for t in (*head.parameters(), *head.buffers()))
    engine = Engine(speculative_algorithm="EAGLE3", max_total_tokens=2048,
                    engine_in_process=True, log_level="warning")
    try:
        assert per_token == engine.scheduler.drafter.pool.bytes_per_slot
        assert weights > 1 << 20 and per_token > 0
        spec = setup_mod.resolve_spec_config(_args(speculative_algorithm="EAGLE3"),
                                             default_model=True)
        sized = setup_mod.pool_slots(_args(mem_fraction_static=0.85), TINY, torch.bfloat16,
                                     CUDA, spec)
        assert sized.keywords["reserve"] == (weights, per_token)
        # a bf16 model's head and its pool are bf16 on CUDA (eagle.head_dtype): half of it
        low = setup_mod.pool_slots(_args(mem_fraction_static=0.85), TINY, torch.bfloat16,
                                   CUDA, spec, torch.bfloat16)
        w16, t16 = draft_head_footprint(DEFAULT_HEAD, torch.bfloat16)
        assert low.keywords["reserve"] == (w16, t16)
        assert t16 * 2 == per_token and weights * 0.45 < w16 < weights * 0.55
        plain = setup_mod.pool_slots(_args(mem_fraction_static=0.85), TINY, torch.bfloat16,
                                     CUDA, None)
        assert plain.keywords["reserve"] == (0, 0)
    finally:
        engine.shutdown()
