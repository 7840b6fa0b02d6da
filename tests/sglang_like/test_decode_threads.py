"""`--decode-threads`: the native step's forwards run on fewer threads when other processes take
cores (sglang_like.utils.decode_threads), with the same bits as on all of them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import sglang_like
from sglang_like.engine import Engine
from sglang_like.utils.decode_threads import (
    DecodeThreads,
    _busy_ticks,
    parse_decode_threads,
)

PROMPTS = [f"Story number {i}: once upon a time" for i in range(6)] + ["Hi", "The sea is"]
SHIPPED_ADAPTER = os.path.join(os.path.dirname(sglang_like.__file__), "lora", "adapters",
                               "smollm2-135m-json-answer")


# ---- the policy, on /proc/stat texts written here --------------------------------------------
def _stat(busy: dict[int, int], idle: int = 1000) -> str:
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]  # the total line: not read
    for cpu, ticks in busy.items():  # user nice system idle iowait irq softirq steal
        lines.append(f"cpu{cpu} {ticks} 0 0 {idle} 7 0 0 0 0 0")
    return "\n".join(lines + ["intr 12345", "ctxt 6789"])


def test_busy_ticks_sum_the_allowed_cores_less_idle_and_iowait() -> None:
    text = "cpu0 10 1 2 500 9 3 4 5 0 0\ncpu1 20 0 0 500 0 0 0 0 0 0\ncpu2 99 0 0 0 0 0 0 0 0 0"
    assert _busy_ticks({0, 1}, text) == (10 + 1 + 2 + 3 + 4 + 5) + 20
    assert _busy_ticks({0, 3}, text) is None  # a core not listed: no reading


def test_auto_follows_the_cores_other_processes_use() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    now, mine, busy = [0.0], [0.0], [0]

    def stat() -> str:
        return _stat({0: busy[0], 1: 0})

    dt = DecodeThreads(2, read_stat=stat, clock=lambda: now[0], cpu_clock=lambda: mine[0])
    dt._cpus = {0, 1}

    def window(others_cores: float, ours_cores: float) -> int:
        now[0] += 1.0
        mine[0] += ours_cores
        busy[0] += int(round((others_cores + ours_cores) * hz))
        return dt.for_forward(True)

    assert dt.for_forward(True) == 2  # the first reading: nothing to compare yet
    assert window(0.0, 2.0) == 2
    # smoothed: 0.5 of a core (1.5 left: two threads still), then 0.75 (1.25 left: one)
    assert [window(1.0, 1.0) for _ in range(2)] == [2, 1]
    assert dt.info()["decode"] == 1 and dt.info()["other_processes_cores"] > 0.7
    assert dt.for_forward(False) == 2  # prefill keeps every thread
    assert [window(0.0, 1.0) for _ in range(2)] == [2, 2]  # 0.37 of a core, then 0.19
    # within a window nothing is read again
    reads = []
    dt._read_stat = lambda: reads.append(1) or stat()
    dt.for_forward(True)
    assert reads == []


def test_fixed_counts_and_refusals() -> None:
    assert parse_decode_threads("auto") is None and parse_decode_threads("3") == 3
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(ValueError, match="decode_threads must be auto or a positive"):
            parse_decode_threads(bad)
    assert DecodeThreads.build("4", 4) is None  # nothing would ever change
    fixed = DecodeThreads.build("1", 2)
    assert fixed is not None and fixed.for_forward(True) == 1 and fixed.for_forward(False) == 2
    assert DecodeThreads.build("auto", 1) is None
    torch.set_num_threads(2)
    with pytest.raises(ValueError, match="decode_threads"):
        Engine(decode_threads="zero", engine_in_process=True)


# ---- the same bits on one thread as on two ----------------------------------------------------
def _threads_seen(engine: Any) -> list[tuple[bool, int]]:
    dt = engine.runner.decode_threads
    seen: list[tuple[bool, int]] = []
    original = dt.for_forward

    def spy(native: bool) -> int:
        seen.append((native, original(native)))
        return seen[-1][1]

    dt.for_forward = spy
    return seen


def _run(engine: Any, lora: bool) -> list[tuple[str, list[float], int]]:
    # with an adapter: every other request through it, so a batch mixes rows with and without
    extra = {"lora_path": ["json" if i % 2 else None for i in range(len(PROMPTS))]} if lora \
        else {}
    out = engine.generate(PROMPTS, {"max_new_tokens": 12, "temperature": 0,
                                    "ignore_eos": True}, return_logprob=True, **extra)
    return [(o["text"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]],
             o["meta_info"].get("spec_verify_ct", 0)) for o in out]


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [
    {},  # the default model's int4 kernels
    {"quantization": "int8"},
    {"kv_cache_dtype": "int8"},
    {"speculative_algorithm": "NGRAM"},  # verify forwards through the native masked rows
    {"enable_deterministic_inference": True},  # every forward native, prefill included
    {"lora_paths": [f"json={SHIPPED_ADAPTER}"]},  # the adapter's rows in the native step
], ids=["int4", "int8", "int8-kv", "ngram-verify", "deterministic", "lora"])
def test_one_thread_gives_the_bits_of_two(make_engine, knobs) -> None:
    if os.cpu_count() < 2:
        pytest.skip("one core: there is no second thread to drop")
    torch.set_num_threads(2)
    results = {}
    for spec in ("2", "1"):
        engine = make_engine(decode_threads=spec, **knobs)
        if spec == "1":
            seen = _threads_seen(engine)
        results[spec] = _run(engine, "lora_paths" in knobs)
        engine.shutdown()
    native = [n for is_native, n in seen if is_native]
    assert native and set(native) == {1}, seen
    assert (False, 2) in seen  # the prefill kept both threads (native or not)
    if "speculative_algorithm" in knobs:
        assert sum(verifies for *_, verifies in results["1"]) > 0
    assert results["1"] == results["2"]


# ---- a real process beside the engine ---------------------------------------------------------
@pytest.mark.slow
def test_a_busy_process_beside_the_engine_takes_a_decode_thread(make_engine) -> None:
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("one core: there is no second thread to drop")
    torch.set_num_threads(cpus)
    engine = make_engine()
    assert engine.get_server_info()["cpu_threads"]["mode"] == "auto"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 60
        info = engine.get_server_info()["cpu_threads"]
        while info["decode"] == cpus and time.monotonic() < deadline:
            engine.generate("Tell me about the sea.", {"max_new_tokens": 48,
                                                       "temperature": 0, "ignore_eos": True})
            info = engine.get_server_info()["cpu_threads"]
    finally:
        busy.kill()
        busy.wait()
    assert info["decode"] < cpus and info["prefill"] == cpus, info
    assert info["other_processes_cores"] >= 0.5, info


def test_the_server_flag_takes_auto_or_a_count(capsys: pytest.CaptureFixture) -> None:
    from sglang_like.launch_server import build_parser

    parser = build_parser()
    assert parser.parse_args([]).decode_threads == "auto"
    assert parser.parse_args(["--decode-threads", "1"]).decode_threads == "1"
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--decode-threads", "two"])
    assert exit_.value.code == 2
    assert "decode_threads must be auto or a positive integer" in capsys.readouterr().err
