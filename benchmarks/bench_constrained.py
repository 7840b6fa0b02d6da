"""Constrained-decoding benchmark: mask cost per step, jump-forward speedup, compile times.

    python -m benchmarks.bench_constrained                   # both backends, default model
    python -m benchmarks.bench_constrained --backends xgrammar --repeats 3

Prints one table. Mask cost is what the scheduler pays per step for a batch of constrained
requests (fill the packed bitmask from every grammar + apply it to the logits), against one
unconstrained decode step of the same batch size on the same engine. Jump-forward throughput
is greedy generation through the Engine on a schema whose keys are long and fixed, with
jump-forward on vs off (a fresh engine each). Compile times are first compiles (no cache).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

import sglang_like_kernels
from benchmarks.common import best_of_s

LONG_KEYS_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "customer_full_name_as_printed_on_card": {"type": "string", "maxLength": 16},
        "customer_membership_level_in_program": {"enum": ["platinum", "gold", "silver"]},
        "customer_has_active_premium_subscription": {"type": "boolean"},
        "preferred_contact_method_for_notices": {"enum": ["email", "telephone", "letter"]},
    },
}
LONG_KEYS_SCHEMA["required"] = list(LONG_KEYS_SCHEMA["properties"])
LONG_KEYS_PROMPT = "Describe a customer record as JSON. Reply with JSON only."

_NAME = {"type": "string", "maxLength": 16}
COMPILE_SPECS: dict[str, tuple[str, str]] = {
    "regex int": ("regex", r"[-+]?[0-9]+"),
    "regex ipv4": ("regex", r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"),
    "regex date": ("regex", r"\d{4}-\d{2}-\d{2}"),
    "json person": (
        "json",
        json.dumps(
            {
                "type": "object",
                "required": ["name", "age"],
                "properties": {
                    "name": _NAME,
                    "age": {"type": "integer"},
                    "ok": {"type": "boolean"},
                },
            }
        ),
    ),
    "json nested": (
        "json",
        json.dumps(
            {
                "type": "object",
                "required": ["name", "address"],
                "properties": {
                    "name": _NAME,
                    "address": {
                        "type": "object",
                        "required": ["city"],
                        "properties": {"city": _NAME},
                    },
                },
            }
        ),
    ),
    "json array": (
        "json",
        json.dumps(
            {
                "type": "object",
                "required": ["tags"],
                "properties": {
                    "tags": {"type": "array", "items": _NAME, "minItems": 2, "maxItems": 3}
                },
            }
        ),
    ),
    "json enum": (
        "json",
        json.dumps(
            {
                "type": "object",
                "required": ["c"],
                "properties": {"c": {"enum": ["red", "blue"]}},
            }
        ),
    ),
    "json string pattern": (
        "json",
        json.dumps(
            {
                "type": "object",
                "required": ["zip"],
                "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            }
        ),
    ),
    "json long keys": ("json", json.dumps(LONG_KEYS_SCHEMA)),
}


# ---- decode step ---------------------------------------------------------------------------
def decode_step_s(engine: Any, batch: int, repeats: int) -> float:
    """One unconstrained decode step of `batch` requests: the slope of generate time in steps."""
    prompts = [f"Write a long story about robot number {i}." for i in range(batch)]

    def run(num_steps: int) -> Callable[[], Any]:
        params = {"max_new_tokens": num_steps, "temperature": 0, "ignore_eos": True}
        return lambda: engine.generate(prompts, params)

    run(2)()  # warm up and cache the prompts
    short, long = 4, 36
    return (best_of_s(run(long), repeats) - best_of_s(run(short), repeats)) / (long - short)


# ---- mask cost -----------------------------------------------------------------------------
def grammar_states(engine: Any, token_ids: list[int], batch: int, shift: int) -> list[Any]:
    """`batch` grammars of the long-keys schema, spread over the states along `token_ids`."""
    backend = engine.grammar_backend
    states = []
    for i in range(batch):
        grammar = backend.compile("json", json.dumps(LONG_KEYS_SCHEMA))
        depth = (i * 7 + 3 * shift) % max(len(token_ids) - 1, 1)
        assert grammar.accept_tokens(token_ids[:depth]), "the reference output must conform"
        states.append(grammar)
    return states


def mask_cost_s(engine: Any, token_ids: list[int], batch: int, repeats: int) -> float:
    """Fill the batch bitmask (the scheduler's own function) + apply it to [batch, V] logits,
    averaged over grammar states along a real output."""
    fill = engine.scheduler.outputs.grammar_bitmask
    vocab = engine.model_config.vocab_size
    logits = torch.randn(batch, vocab, device=engine.device)
    total, count = 0.0, 0
    for shift in range(repeats * 4):
        grammars = grammar_states(engine, token_ids, batch, shift)
        reqs = [SimpleNamespace(grammar=g) for g in grammars]

        def step(reqs: list[Any] = reqs) -> None:
            bitmask = fill(reqs)
            sglang_like_kernels.apply_token_bitmask_(logits, bitmask.to(logits.device))
            if logits.is_cuda:
                torch.cuda.synchronize()

        step()
        total += best_of_s(step, 3)
        count += 1
    return total / count


# ---- jump-forward throughput ---------------------------------------------------------------
def jump_forward_run(engine: Any, batch: int, repeats: int) -> dict[str, float]:
    prompt = engine.apply_chat_template([{"role": "user", "content": LONG_KEYS_PROMPT}])
    params = {"json_schema": json.dumps(LONG_KEYS_SCHEMA), "max_new_tokens": 160, "temperature": 0}
    outs: list[dict] = []

    def run() -> None:
        outs[:] = engine.generate([prompt] * batch, params)

    run()  # warm up: compile, cache the prompt
    steps_before = engine.scheduler.num_forward_steps
    seconds = best_of_s(run, repeats)
    steps = (engine.scheduler.num_forward_steps - steps_before) / repeats
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    chars = sum(len(o["text"]) for o in outs)
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs), outs[0]
    return {
        "s": seconds,
        "tok_s": tokens / seconds,
        "char_s": chars / seconds,
        "tokens": tokens / batch,
        "chars": chars / batch,
        "steps": steps,
        "ids": outs[0]["output_ids"],
    }


# ---- compile -------------------------------------------------------------------------------
def compile_times_ms(engine: Any) -> dict[str, float | str]:
    """First compile of each spec on a fresh GrammarBackend (no cache), or why it is refused."""
    from constrained import GrammarBackend, InvalidGrammar

    shared = engine.grammar_backend
    backend = GrammarBackend(shared.tokenizer_info, shared.backend)
    times: dict[str, float | str] = {}
    try:
        for name, (kind, spec) in COMPILE_SPECS.items():
            t0 = time.perf_counter()
            result = backend.compile(kind, spec)
            ms = (time.perf_counter() - t0) * 1e3
            times[name] = "refused" if isinstance(result, InvalidGrammar) else ms
    finally:
        backend.shutdown()
    return times


# ---- main ----------------------------------------------------------------------------------
def _progress(message: str) -> None:
    print(f"[bench_constrained {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr)


def bench_backend(
    backend: str,
    args: argparse.Namespace,
    step_s: dict[int, float],
) -> dict[str, Any]:
    from sglang_like import Engine

    row: dict[str, Any] = {}
    for enabled in (False, True):
        _progress(f"{backend}: jump-forward {'on' if enabled else 'off'}")
        engine = Engine(  # in this process: the benchmark reads the scheduler's counters
            grammar_backend=backend, max_total_tokens=16384, enable_jump_forward=enabled,
            engine_in_process=True,
        )
        try:
            if not step_s:
                for batch in args.batches:
                    step_s[batch] = decode_step_s(engine, batch, args.repeats)
            for batch in (1, args.jf_batch):
                row[("jf", enabled, batch)] = jump_forward_run(engine, batch, args.repeats)
            if not enabled:
                ids = row[("jf", False, 1)]["ids"]
                for batch in args.batches:
                    row[("mask", batch)] = mask_cost_s(engine, ids, batch, args.repeats)
                row["compile"] = compile_times_ms(engine)
        finally:
            engine.shutdown()
    return row


def print_table(
    backends: list[str], rows: dict[str, dict], step_s: dict[int, float], args: argparse.Namespace
) -> None:
    lines: list[tuple[str, list[str], str]] = []
    for batch in args.batches:
        step = step_s[batch] * 1e3
        lines.append((f"decode step, batch {batch} (ms)", [f"{step:.1f}"] * len(backends), ""))
        masks = [rows[b][("mask", batch)] * 1e3 for b in backends]
        lines.append((f"mask fill+apply, batch {batch} (ms)", [f"{m:.2f}" for m in masks], ""))
        lines.append(
            (f"mask / step, batch {batch}", [f"{m / step:.1%}" for m in masks], "target <= 10%")
        )
    for batch in (1, args.jf_batch):
        for enabled in (False, True):
            runs = [rows[b][("jf", enabled, batch)] for b in backends]
            tag = "on " if enabled else "off"
            lines.append(
                (
                    f"jump-forward {tag}, batch {batch}: tok/s",
                    [f"{r['tok_s']:.1f}" for r in runs],
                    f"tokens/req {', '.join(str(round(r['tokens'])) for r in runs)}",
                )
            )
            lines.append(
                (
                    f"jump-forward {tag}, batch {batch}: chars/s",
                    [f"{r['char_s']:.1f}" for r in runs],
                    f"forward steps/run {', '.join(str(round(r['steps'])) for r in runs)}; "
                    f"chars/req {', '.join(str(round(r['chars'])) for r in runs)}",
                )
            )
        speed = [
            rows[b][("jf", False, batch)]["s"] / rows[b][("jf", True, batch)]["s"] for b in backends
        ]
        lines.append(
            (
                f"jump-forward speedup, batch {batch} (time)",
                [f"{s:.2f}x" for s in speed],
                "target >= 1.5x",
            )
        )
    for name in COMPILE_SPECS:
        cells = []
        for b in backends:
            ms = rows[b]["compile"][name]
            cells.append(ms if isinstance(ms, str) else f"{ms:.1f}")
        lines.append((f"compile {name} (ms)", cells, ""))
    width = max(len(label) for label, _, _ in lines) + 2
    print(f"{'metric':{width}}" + "".join(f"{b:>12}" for b in backends) + "   note")
    print("-" * (width + 12 * len(backends) + 20))
    for label, cells, note in lines:
        print(f"{label:{width}}" + "".join(f"{c:>12}" for c in cells) + f"   {note}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_constrained", description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "outlines"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--jf-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    step_s: dict[int, float] = {}
    rows = {b: bench_backend(b, args, step_s) for b in args.backends}
    print_table(args.backends, rows, step_s, args)


if __name__ == "__main__":
    main()
