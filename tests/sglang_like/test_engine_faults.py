"""Faults and shutdown through the Engine on the default model (issue 11): every caller gets an
answer, the loop survives what it can and says so when it cannot, nothing leaks; and the
output defects of the review (stop strings in forced text, min_new_tokens with a finished
grammar, streamed vs whole ids under jump-forward, abort by a parent rid)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import sglang_like.engine_core.loop as engine_loop
from sglang_like.engine_core.io import RequestHandle
from sglang_like.req import Req
from sglang_like.sampling_params import SamplingParams
from sglang_like.utils.fault_injection import ENV_VAR

from .test_engine_api import _wait_idle

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea,"
LONG = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(make_engine: Any) -> Any:
    return make_engine(max_total_tokens=8192)


def _assert_clean(engine: Any) -> None:
    info = _wait_idle(engine)
    assert info["kv_pool"]["used_slots"] == 0 and info["num_running_reqs"] == 0
    pool = info["kv_pool"]
    assert pool["free_slots"] + pool["cached_slots"] == pool["total_slots"]


def _message(out: dict) -> str | None:
    return out["meta_info"]["finish_reason"].get("message")


# ---- faults inside the loop ---------------------------------------------------------------
def test_injected_faults_end_only_the_requests_they_hit(make_engine: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "forward=0.3,sample=0.1,grammar=0.3,seed=5")
    eng = make_engine(max_total_tokens=4096)
    try:
        params = [{"temperature": 0, "max_new_tokens": 6}] * 6 + [
            {"temperature": 0, "max_new_tokens": 8, "regex": "(yes|no|maybe) indeed"}] * 4
        outs = eng.generate([f"Question {i}: is it so?" for i in range(10)], params)
        assert len(outs) == 10
        faults = eng.scheduler.faults
        assert faults.num_injected > 0
        messages = [_message(o) or "" for o in outs]
        for m in messages:
            if m:
                assert m.startswith("internal error: InjectedFault: injected "), m
        # every fault reached some caller (by its number), until the last request ended
        seen = {int(m.rsplit("#", 1)[1]) for m in messages if "#" in m}
        assert seen and seen <= set(range(1, faults.num_injected + 1))
        for o, m in zip(outs, messages, strict=True):
            if not m:
                assert o["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        _assert_clean(eng)
        assert eng.check_health() is None
    finally:
        eng.shutdown()


def test_a_command_that_raises_answers_its_request(engine: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    original = engine.scheduler.add_request

    def add(req: Req) -> None:
        if req.rid == "bad-add":
            raise RuntimeError("add failed")
        original(req)

    monkeypatch.setattr(engine.scheduler, "add_request", add)
    out = engine.generate(PROMPT, {"max_new_tokens": 4}, rid="bad-add")
    assert _message(out) == "internal error: RuntimeError: add failed"
    ok = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4})
    assert ok["meta_info"]["finish_reason"]["type"] == "length"
    _assert_clean(engine)


def test_a_delivery_that_raises_ends_that_request_only(engine: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine_loop.build_output

    def build(req: Req, *args: Any) -> dict:
        if req.rid == "bad-out" and req.output_ids:
            raise UnicodeError("detokenizer bug")
        return real(req, *args)

    monkeypatch.setattr(engine_loop, "build_output", build)
    stream = engine.generate(PROMPT, LONG, stream=True, rid="bad-out")
    chunks = list(stream)
    assert _message(chunks[-1]) == "internal error: UnicodeError: detokenizer bug"
    other = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 3})
    assert other["meta_info"]["finish_reason"]["type"] == "length"
    _assert_clean(engine)


def test_health_reports_a_stuck_step(make_engine: Any) -> None:
    eng = make_engine(max_total_tokens=2048, watchdog_timeout=0.3)
    try:
        forward = eng.runner.forward
        slow = threading.Event()

        def slow_forward(batch: Any) -> Any:
            if slow.is_set():
                time.sleep(1.5)
            return forward(batch)

        eng.runner.forward = slow_forward
        eng.scheduler.runner = eng.runner
        assert eng.check_health() is None
        slow.set()
        done = threading.Event()
        threading.Thread(target=lambda: (eng.generate(PROMPT, {"max_new_tokens": 1}),
                                         done.set()), daemon=True).start()
        time.sleep(0.9)
        reason = eng.check_health()
        assert reason is not None and "watchdog timeout 0.3 s" in reason
        slow.clear()
        assert done.wait(20)
        assert eng.check_health() is None
    finally:
        eng.shutdown()


def test_a_dead_loop_answers_everyone_and_says_so(make_engine: Any) -> None:
    eng = make_engine(max_total_tokens=2048)
    try:
        results: list[dict] = []
        thread = threading.Thread(target=lambda: results.append(eng.generate(PROMPT, LONG)))
        thread.start()
        time.sleep(0.5)

        class Fatal(BaseException):
            pass

        def die() -> list:
            raise Fatal("the loop cannot go on")

        eng.scheduler.step = die
        thread.join(30)
        assert not thread.is_alive(), "the caller of a dead loop must get an answer"
        assert _message(results[0]) == "internal error: Fatal: the loop cannot go on"
        assert "the engine loop died" in eng.check_health()
        late = eng.generate(PROMPT, {"max_new_tokens": 2})  # after the death: answered at once
        assert _message(late) == "internal error: Fatal: the loop cannot go on"
        with pytest.raises(RuntimeError, match="Fatal"):
            eng.flush_cache()
    finally:
        eng.shutdown()


def test_shutdown_answers_every_caller(make_engine: Any) -> None:
    eng = make_engine(max_total_tokens=2048)
    results: list[dict] = []
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            results.append(eng.generate(f"{PROMPT} {i}", LONG))
        except RuntimeError as e:  # submitted after shutdown began: refused at the door
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    eng.shutdown()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a caller was left waiting by shutdown"
    assert len(results) + len(errors) == 6
    for out in results:
        assert _message(out) == "server shutting down"
    assert "not running" in eng.check_health()
    # a request that slips past the closed check after the loop stopped is answered too
    req = Req("late", [1, 2, 3], SamplingParams(max_new_tokens=2))
    handle = RequestHandle("late", False, None)
    eng._client.core.loop.submit_all([(req, handle)])
    assert _message(handle.wait_final()) == "server shutting down"


# ---- aborts ---------------------------------------------------------------------------------
def test_abort_by_parent_rid_reaches_samples_and_batch_items(engine: Any) -> None:
    outs: dict[str, Any] = {}

    def run(key: str, **kwargs: Any) -> None:
        outs[key] = engine.generate(**kwargs)

    threads = [
        threading.Thread(target=run, args=("n",), kwargs={
            "prompt": PROMPT, "sampling_params": {**LONG, "n": 3, "temperature": 0.8},
            "rid": "grp"}),
        threading.Thread(target=run, args=("batch",), kwargs={
            "prompt": [PROMPT, "Hello"], "sampling_params": LONG, "rid": "bat"}),
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)
    engine.abort("grp")
    engine.abort("bat")
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert [o["meta_info"]["id"] for o in outs["n"]] == ["grp-0", "grp-1", "grp-2"]
    assert [o["meta_info"]["id"] for o in outs["batch"]] == ["bat-0", "bat-1"]
    for o in outs["n"] + outs["batch"]:
        assert _message(o) == "aborted"
        assert o["meta_info"]["completion_tokens"] < 400
    _assert_clean(engine)


def test_abort_all(engine: Any) -> None:
    outs: list[Any] = []
    t = threading.Thread(target=lambda: outs.append(engine.generate([PROMPT, "Hi"], LONG)))
    t.start()
    time.sleep(0.8)
    engine.abort_all()
    t.join(30)
    assert [_message(o) for o in outs[0]] == ["aborted", "aborted"]
    _assert_clean(engine)


def test_derived_rid_rule() -> None:
    derived = engine_loop.is_derived_rid
    assert derived("r-0", "r") and derived("r-1-2", "r")
    assert not derived("r-x", "r") and not derived("rr-1", "r")
    assert not derived("r", "r") and not derived("r-", "r")


# ---- output defects -------------------------------------------------------------------------
def test_stop_string_inside_jump_forward_text(engine: Any) -> None:
    """The grammar forces `"name": "` after `{`; the stop string is in that forced text."""
    out = engine.generate("Give a JSON object:", {
        "temperature": 0, "max_new_tokens": 30, "stop": ["name"],
        "regex": r'\{"name": "[a-z]{1,8}"\}'})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "name"}
    assert out["text"] == '{"'


def test_min_new_tokens_with_a_finished_grammar_ends_normally(engine: Any) -> None:
    out = engine.generate("Answer yes:", {"temperature": 0, "max_new_tokens": 20,
                                          "min_new_tokens": 10, "regex": "(yes|no)"})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    assert out["text"] in ("yes", "no")


@pytest.mark.parametrize("i", range(3))
def test_streamed_and_whole_outputs_have_the_same_ids_under_jump_forward(engine: Any,
                                                                         i: int) -> None:
    schema = ('{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, '
              '"population": {"type": "integer"}, "country": {"type": "string", '
              '"maxLength": 12}}, "required": ["city", "population", "country"]}')
    prompt = ["Describe Paris as JSON:", "A city in JSON:", "Tokyo facts as JSON:"][i]
    params = {"temperature": 0, "max_new_tokens": 48, "json_schema": schema}
    whole = engine.generate(prompt, params)
    chunks = list(engine.generate(prompt, params, stream=True))
    streamed_ids = [t for c in chunks for t in c["output_ids"]]
    assert streamed_ids == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]


def test_sentencepiece_output_keeps_its_first_space() -> None:
    """A SentencePiece vocab: the first output token `▁hello` after a prompt decodes as
    " hello" (it needs the prompt as context; alone it decodes without the space)."""
    from radix_cache import KVSlotAllocator, RadixCache
    from sglang_like.mem_pool import ReqToTokenPool
    from sglang_like.model_loader.gguf_tokenizer import tokenizer_from_gguf
    from sglang_like.scheduler import SchedulerConfig
    from sglang_like.scheduler.cache_manager import KVCacheManager
    from sglang_like.scheduler.output_processor import OutputProcessor

    from .test_tokenizer import _spm_metadata

    tok = tokenizer_from_gguf(_spm_metadata())
    hello = tok.token_to_id("\u2581hello")
    assert tok.decode([hello]) == "hello"  # what the old path produced
    allocator = KVSlotAllocator(16)
    cache = KVCacheManager(allocator, RadixCache(allocator), ReqToTokenPool(2, 16, "cpu"))
    config = SchedulerConfig(pool_size=16, context_len=16, vocab_size=300)
    outputs = OutputProcessor(tok, frozenset({2}), cache, config)
    req = Req("spm", tok.encode("hello"), SamplingParams(max_new_tokens=3))
    outputs.append_token(req, hello, None, None)
    outputs.append_token(req, hello, None, None)
    assert req.text == " hello hello"


def test_jump_forward_window_does_not_depend_on_streaming(engine: Any) -> None:
    """After "j" + "kv", the regex forces `n4q"`: re-encoding two tokens back gives other ids
    than one back. A stream that had sent "j" used to get the one-back ids, the whole output
    the two-back ones; now both re-encode the same window (a stream holds back its last ids
    until no jump-forward can rewrite them)."""
    from sglang_like.engine_core.io import build_output

    tok = engine.tokenizer
    j, kv = tok.encode("j"), tok.encode("kv")
    assert tok.encode("jkv") == j + kv and len(j) == len(kv) == 1
    outputs = engine.scheduler.outputs
    cache = engine.scheduler.cache
    results = {}
    for stream in (False, True):
        req = Req(f"jf-{stream}", tok.encode("Say:"), SamplingParams(max_new_tokens=20),
                  stream=stream)
        req.grammar = engine.grammar_backend.compile("regex", '[a-z]{3}n4q"')
        # the KV state of a running request: every token but the next input computed
        req.req_pool_idx = cache.req_to_token_pool.alloc()
        cache.req_to_token_pool.write(req.req_pool_idx, 0,
                                      cache.allocator.alloc(req.prompt_len + 1))
        for token in (j[0], kv[0]):
            req.kv_len = req.seq_len
            outputs.append_token(req, token, None, None)
            if stream:  # what the loop does after each step of a streamed request
                build_output(req, tok, False, incremental=True)
        results[stream] = list(req.output_ids)
        cache.allocator.free(cache.req_to_token_pool.read(req.req_pool_idx, 0, req.kv_len))
        cache.req_to_token_pool.free(req.req_pool_idx)
    assert tok.decode(results[False]) == 'jkvn4q"'
    assert results[True] == results[False]


# ---- constraints compile on the loop's side ---------------------------------------------------
class _NeverCompiles:
    """A grammar backend whose compiles never finish."""

    def get_future(self, kind: str, spec: str) -> Any:
        from concurrent.futures import Future

        return Future()


def test_a_compiling_request_can_be_aborted_and_times_out(
        engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = engine._client.core.loop
    monkeypatch.setattr(loop, "_grammar_backend", lambda: _NeverCompiles())
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(a=engine.generate(
        "x", {"regex": "[0-9]+", "max_new_tokens": 4}, rid="compiling")))
    t.start()
    deadline = time.monotonic() + 10
    while engine.get_load()["num_waiting_reqs"] != 1:  # waiting for its grammar, not running
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.abort("compiling")
    t.join(10)
    assert _message(out["a"]) == "aborted"
    monkeypatch.setattr(engine_loop, "GRAMMAR_WAIT_S", 0.3)
    late = engine.generate("x", {"regex": "[0-9]+", "max_new_tokens": 4})
    assert _message(late) == "the constraint did not compile within 0.3 s"
    _assert_clean(engine)
