"""One run of a tiny random Llama through the real Scheduler and ModelRunner, saved to a file.

Not collected by pytest: test_model_triton.py runs it as a script, once with the torch
references and once with the Triton kernels under the interpreter, and compares the files:
    SGLANG_LIKE_KERNELS=reference|triton [TRITON_INTERPRET=1] python cases_model.py OUT.pt

Two requests share a 40-token prefix: the first prefills in chunks of 8, the second reuses the
prefix from the radix cache, then both decode together (the reference's cascade decode path).
The first asks for prompt logprobs, so every forward, prefill chunks included, returns
logits; each forward's batch and logits are recorded, and so is which kernels ran.
"""

from __future__ import annotations

import functools
import math
import os
import random
import sys
from collections import Counter
from collections.abc import Callable
from types import ModuleType

import torch

import sglang_like_kernels
from sglang_like.config import ModelConfig
from sglang_like.model_loader import expected_weight_shapes, load_tokenizer
from sglang_like.model_runner import ModelRunner
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.schedule_batch import ScheduleBatch
from sglang_like.scheduler import Scheduler, SchedulerConfig
from sglang_like_kernels import reference

CONFIG = ModelConfig(
    architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)  # fmt: skip
SHARED_PREFIX = 40  # above the reference's cascade threshold (32 shared tokens)
SUFFIXES = {"a": 5, "b": 3}
MAX_NEW = 9
CHUNK = 8
CONTEXT = 96
KERNEL_NAMES = ("store_kv", "decode_attention", "extend_attention")


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face-named weights: N(0, 1/fan_in) matrices, norms near 1, N(0, 1) embeddings."""
    gen = torch.Generator().manual_seed(seed)
    shapes = expected_weight_shapes(config)
    weights = {}
    for name, shape in sorted(shapes.items()):
        x = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            x = 1 + 0.1 * x
        elif len(shape) == 2 and "embed" not in name:
            x = x / math.sqrt(shape[1])
        weights[name] = x
    return weights


class RecordingRunner(ModelRunner):
    """The real ModelRunner that also keeps every forward's batch shape and logits."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[dict[str, object]] = []
        self.logits: list[torch.Tensor] = []

    def forward(self, batch: ScheduleBatch) -> torch.Tensor:
        logits = super().forward(batch)
        self.steps.append({
            "rids": [r.rid for r in batch.reqs],
            "prefix_lens": list(batch.prefix_lens),
            "extend_lens": list(batch.extend_lens),
            "input_ids": list(batch.input_ids),
        })  # fmt: skip
        self.logits.append(logits.clone())
        return logits


def count_calls(module: ModuleType, names: tuple[str, ...], counts: Counter) -> None:
    """Wrap module-level functions so each call is counted (they still run)."""

    def wrap(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def counted(*args: object, **kwargs: object) -> object:
            counts[f"{module.__name__}.{name}"] += 1
            return fn(*args, **kwargs)

        return counted

    for name in names:
        setattr(module, name, wrap(name, getattr(module, name)))


def prompts(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, CONFIG.vocab_size) for _ in range(SHARED_PREFIX)]
    out = {}
    for rid, n in SUFFIXES.items():
        # distinct first suffix tokens, so the radix match is exactly the shared prefix
        first = 3 + len(out)
        out[rid] = shared + [first] + [rng.randrange(3, CONFIG.vocab_size) for _ in range(n - 1)]
    return out


def run(seed: int) -> dict[str, object]:
    counts: Counter = Counter()
    count_calls(reference, (*KERNEL_NAMES, "_cascade_decode"), counts)
    if os.environ.get("SGLANG_LIKE_KERNELS") == "triton":
        assert os.environ.get("TRITON_INTERPRET") == "1", "triton on CPU needs the interpreter"
        from sglang_like_kernels import triton_ops

        count_calls(triton_ops, KERNEL_NAMES, counts)
    torch.manual_seed(seed)
    device = torch.device("cpu")
    pool_size = 256
    runner = RecordingRunner(
        CONFIG, random_weights(CONFIG, seed), dtype=torch.float32, device=device,
        num_kv_slots=pool_size, context_len=CONTEXT, max_running_requests=4,
    )  # fmt: skip
    config = SchedulerConfig(
        pool_size=pool_size, context_len=CONTEXT, vocab_size=CONFIG.vocab_size,
        max_running_requests=4, chunked_prefill_size=CHUNK, check_accounting=True,
    )  # fmt: skip
    sched = Scheduler(config, runner, load_tokenizer(), frozenset())
    reqs = {}
    for rid, prompt in prompts(seed).items():
        sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        # a's prompt logprobs make each of its prefill chunks return logits too; b takes none,
        # which would cap its radix match
        start = 0 if rid == "a" else -1
        reqs[rid] = Req(rid, prompt, sp, return_logprob=rid == "a", logprob_start_len=start)
        sched.add_request(reqs[rid])
    for _ in range(200):
        if not sched.has_work:
            break
        sched.step()
    assert not sched.has_work, "the scheduler did not drain"
    return {
        "steps": runner.steps,
        "logits": runner.logits,
        "output_ids": {rid: list(r.output_ids) for rid, r in reqs.items()},
        "cached_tokens": {rid: r.num_cached_tokens for rid, r in reqs.items()},
        "calls": dict(counts),
        "triton_imported": "sglang_like_kernels.triton_ops" in sys.modules,
        "kernels_mode": sglang_like_kernels._MODE,
    }


if __name__ == "__main__":
    torch.save(run(seed=0), sys.argv[1])
