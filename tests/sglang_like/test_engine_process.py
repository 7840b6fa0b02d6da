"""The engine core in its own process (the default): the same answers as in-process, and every
caller answered when that process dies, stops, or loses its parent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import psutil
import pytest

from sglang_like.engine import Engine

from .test_engine_api import _wait_idle

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_new_tokens": 12}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colors: red,"]


@pytest.fixture(scope="module")
def proc_engine() -> Any:
    engine = Engine(max_total_tokens=16384)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def thread_engine(make_engine: Any) -> Any:
    return make_engine(max_total_tokens=16384)


def _message(out: dict) -> str | None:
    return out["meta_info"]["finish_reason"].get("message")


def test_the_core_runs_in_a_child_process(proc_engine: Any) -> None:
    pid = proc_engine.engine_pid
    assert pid is not None and pid != os.getpid()
    assert psutil.Process(pid).ppid() == os.getpid()
    assert proc_engine.get_server_info()["engine_pid"] == pid
    with pytest.raises(AttributeError, match="engine_in_process=True"):
        proc_engine.scheduler  # noqa: B018 - the scheduler is in the other process


def test_same_answers_as_in_process(proc_engine: Any, thread_engine: Any) -> None:
    kw = dict(return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)
    a = proc_engine.generate(PROMPTS, GREEDY, **kw)
    b = thread_engine.generate(PROMPTS, GREEDY, **kw)
    for x, y in zip(a, b, strict=True):
        assert x["text"] == y["text"] and x["output_ids"] == y["output_ids"]
        mx, my = x["meta_info"], y["meta_info"]
        assert [e[1:] for e in mx["output_token_logprobs"]] == [
            e[1:] for e in my["output_token_logprobs"]]
        assert all(isinstance(e[2], str) for e in mx["output_token_logprobs"])
        assert mx["output_token_logprobs"][0][0] == pytest.approx(
            my["output_token_logprobs"][0][0], abs=1e-4)
        assert [e[1] for e in mx["input_token_logprobs"]] == [
            e[1] for e in my["input_token_logprobs"]]
    # streamed: the deltas add up to the same text and ids
    chunks = list(proc_engine.generate(PROMPTS[0], GREEDY, stream=True))
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    assert "".join(c["text"] for c in chunks) == b[0]["text"]
    assert sum((c["output_ids"] for c in chunks), []) == b[0]["output_ids"]
    # n > 1 with a seed, constrained decoding
    sampled = {"temperature": 0.8, "max_new_tokens": 6, "n": 2, "seed": 7, "regex": "[a-z ]+"}
    assert ([o["output_ids"] for o in proc_engine.generate(PROMPTS[1], sampled)]
            == [o["output_ids"] for o in thread_engine.generate(PROMPTS[1], sampled)])


def _steps(engine: Any) -> int:
    return engine.get_stats()["num_forward_steps"]


def test_a_batch_call_is_scheduled_as_one_arrival(proc_engine: Any) -> None:
    """The prompts of one call reach the core in one message: one prefill step takes them
    all, then one decode step per token. Sent one by one, the loop could wake on the first
    and prefill the rest a step later, and a batch's greedy text then depended on timing."""
    prompts = [f"Item {i}: the color of the sky is" for i in range(24)]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    for _ in range(3):
        proc_engine.flush_cache()
        before = _steps(proc_engine)
        proc_engine.generate(prompts, params)
        assert _steps(proc_engine) - before == 6
    proc_engine.flush_cache()
    before = _steps(proc_engine)
    out = proc_engine.generate("Three colors:", {**params, "n": 8, "temperature": 0.8})
    assert len(out) == 8 and _steps(proc_engine) - before == 6


def test_the_loop_takes_a_call_whole_however_late_it_wakes(thread_engine: Any,
                                                           monkeypatch: Any) -> None:
    """In-process: the loop is made to run a step between any two puts into its inbox; the
    batch still arrives in one put, so its first step prefills every prompt."""
    loop = thread_engine._client.core.loop
    sched = thread_engine._client.core.scheduler
    stepped = threading.Event()
    rows: list[int] = []
    original_step, original_put = sched.step, loop._inbox.put

    def step() -> Any:
        rows.append(len(sched.waiting) + len(sched.running))
        try:
            return original_step()
        finally:
            stepped.set()

    def put(item: Any, *args: Any, **kwargs: Any) -> None:
        stepped.clear()
        original_put(item, *args, **kwargs)
        if item[0] == "add":
            assert stepped.wait(30), "the loop did not step after a request arrived"

    monkeypatch.setattr(sched, "step", step)
    monkeypatch.setattr(loop._inbox, "put", put)
    thread_engine.flush_cache()
    out = thread_engine.generate(PROMPTS * 4, {"temperature": 0, "max_new_tokens": 4})
    assert len(out) == 12 and rows[0] == 12


def test_async_generate_and_streams(proc_engine: Any) -> None:
    async def run() -> tuple[dict, str]:
        out = await proc_engine.async_generate(PROMPTS[2], GREEDY)
        it = await proc_engine.async_generate(PROMPTS[2], GREEDY, stream=True)
        return out, "".join([c["text"] async for c in it])

    out, text = asyncio.run(run())
    assert text == out["text"] and out["meta_info"]["completion_tokens"] == 12


def test_outputs_read_on_an_attached_event_loop(proc_engine: Any) -> None:
    """A server's loop reads the core's outputs itself (no thread hop per token): streams,
    RPCs made on that very loop, a blocking generate there (it hands the reading back to a
    thread rather than wait for itself), and the thread reads again after detaching."""
    expected = proc_engine.generate(PROMPTS, GREEDY)

    async def run() -> tuple[list[dict], list[str], dict, dict]:
        assert proc_engine.attach_event_loop(asyncio.get_running_loop())
        assert not proc_engine.attach_event_loop(asyncio.get_running_loop())  # once
        try:
            outs = await asyncio.gather(*[proc_engine.async_generate(p, GREEDY)
                                          for p in PROMPTS])
            texts = []
            for p in PROMPTS:
                it = await proc_engine.async_generate(p, GREEDY, stream=True)
                texts.append("".join([c["text"] async for c in it]))
            info = proc_engine.get_server_info()  # a blocking RPC on the reading loop
            blocking = proc_engine.generate(PROMPTS[0], GREEDY)
        finally:
            proc_engine.detach_event_loop()
        return outs, texts, info, blocking

    outs, texts, info, blocking = asyncio.run(run())
    assert [o["text"] for o in outs] == texts == [e["text"] for e in expected]
    assert info["engine_pid"] == proc_engine.engine_pid
    assert blocking["text"] == expected[0]["text"]
    assert proc_engine.generate(PROMPTS[1], GREEDY)["text"] == expected[1]["text"]
    assert proc_engine.get_server_info()["engine_pid"] == proc_engine.engine_pid


def test_bad_grammar_is_a_value_error_alone_and_an_abort_in_a_batch(proc_engine: Any) -> None:
    with pytest.raises(ValueError, match="regex"):
        proc_engine.generate("x", {"regex": "[0-9", "max_new_tokens": 4})
    with pytest.raises(ValueError, match="regex"):
        list(proc_engine.generate("x", {"regex": "[0-9", "max_new_tokens": 4}, stream=True))
    outs = proc_engine.generate(["x", "y"], [{"regex": "[0-9", "max_new_tokens": 4},
                                             {"regex": "[0-9]+", "max_new_tokens": 4}])
    assert outs[0]["meta_info"]["finish_reason"]["status_code"] == 400
    assert outs[1]["text"].isdigit()
    assert _wait_idle(proc_engine)["kv_pool"]["used_slots"] == 0


def test_abort_load_and_health_across_the_boundary(proc_engine: Any) -> None:
    result: dict[str, Any] = {}
    long = {"max_new_tokens": 2000, "ignore_eos": True}
    t = threading.Thread(target=lambda: result.update(
        out=proc_engine.generate(PROMPTS[0], long, rid="long-one")))
    t.start()
    deadline = time.monotonic() + 30
    while proc_engine.get_load()["num_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    load = proc_engine.get_load()
    assert load["num_reqs"] == 1 and load["num_tokens"] > 0 and load["dp_rank"] == 0
    assert proc_engine.check_health() is None
    assert not proc_engine.flush_cache()  # refused while a request runs
    proc_engine.abort("long-one")
    t.join(30)
    assert _message(result["out"]) == "aborted"
    info = _wait_idle(proc_engine)
    assert info["kv_pool"]["used_slots"] == 0 and proc_engine.num_queued_requests == 0
    assert proc_engine.flush_cache()
    assert proc_engine.get_server_info()["kv_pool"]["cached_slots"] == 0


def test_a_killed_core_answers_everyone_and_health_says_why() -> None:
    engine = Engine(max_total_tokens=8192)
    outs: list[dict] = []
    long = {"max_new_tokens": 4000, "ignore_eos": True}
    threads = [threading.Thread(target=lambda: outs.append(engine.generate("Hi", long)))
               for _ in range(3)]
    stream = engine.generate("Hello", long, stream=True)
    first = next(stream)
    assert first["meta_info"]["finish_reason"] is None
    for t in threads:
        t.start()
    time.sleep(0.5)
    os.kill(engine.engine_pid, signal.SIGKILL)
    t0 = time.monotonic()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a caller was left waiting for a dead engine"
    last = list(stream)[-1]
    assert time.monotonic() - t0 < 5
    for out in [*outs, last]:
        assert _message(out) == "internal error: the engine process exited with code -9"
    assert engine.check_health() == "the engine process exited with code -9"
    late = engine.generate("Hi", {"max_new_tokens": 2})  # answered at once, not hung
    assert _message(late).startswith("internal error: the engine process exited")
    with pytest.raises(RuntimeError, match="exited with code -9"):
        engine.get_server_info()
    engine.shutdown()


def test_shutdown_answers_in_flight_requests_and_the_process_exits() -> None:
    engine = Engine(max_total_tokens=8192)
    pid = engine.engine_pid
    outs: list[dict] = []
    t = threading.Thread(target=lambda: outs.append(
        engine.generate("Hi", {"max_new_tokens": 4000, "ignore_eos": True})))
    t.start()
    while engine.get_load()["num_reqs"] == 0:
        time.sleep(0.02)
    engine.shutdown()
    t.join(10)
    assert _message(outs[0]) == "server shutting down"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("Hi")


def test_the_core_stops_when_its_parent_dies_without_shutdown(tmp_path: Any) -> None:
    script = textwrap.dedent("""
        import os, sys
        from sglang_like.engine import Engine
        e = Engine(max_total_tokens=4096)
        print(e.engine_pid, flush=True)
        os._exit(0)  # no shutdown, no atexit
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=180, check=True)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the orphaned engine process kept running"
        time.sleep(0.1)


def test_a_load_error_is_raised_with_its_type_and_leaves_no_process(tmp_path: Any) -> None:
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(ValueError, match="neither a .gguf file"):
        Engine(model_path=str(tmp_path / "missing"))
    assert {p.pid for p in psutil.Process().children() if p.status() != "zombie"} <= before
