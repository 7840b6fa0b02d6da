"""Tensor parallelism on the default model, real processes (gloo-free: the CPU ranks all-reduce
through shared memory; the gloo process group is checked in test_tp_sharding): TP=2 greedy
equals TP=1, the engine's features work at TP=2, and a dead rank ends requests, not hangs."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import jsonschema
import psutil
import pytest
import zmq

from sglang_like.engine import Engine

from .prompts import PROMPTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _torch_int4_kernel() -> Any:
    """TP's equalities are asserted on torch's int4 kernel (bf16 activations), which the
    bounds below were measured for. This project's x16 kernel rounds activations to int8 per
    32 columns, which turns the ranks' reordered sums (torch layer path, partial sums
    all-reduced) against TP=1's native path into code flips: TP=2 then parted from TP=1 at a
    0.18-nat gap, and once took TP=1's third token at a 0.10 gap. The x16 kernel's accuracy
    is checked against fp32 in test_native_decode.py and test_quantization.py."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_LIKE_INT4_KERNEL", "torch")  # read at load, by every rank
        yield

NEW_TOKENS = 32
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
# A first difference between TP=1 and TP=2 must sit where TP=1's top two tokens were this close
# (in nats). fp32 ("none"): the ranks only add the same products in another order (~1e-6).
# "auto" (int4 here): each rank's partial sum leaves its int4 matmul rounded to bf16 before the
# all-reduce, against one rounding of the whole sum at TP=1: a bf16 step of logits ~16 is 0.06.
TIE_NATS = {"none": 1e-3, "auto": 0.15}


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


@pytest.fixture(scope="module", params=["none", "auto"])
def pair(request: Any, make_engine: Any) -> Any:
    """(quantization, TP=1 engine, TP=2 engine)."""
    one = make_engine(quantization=request.param)
    two = make_engine(quantization=request.param, tp_size=2)
    yield request.param, one, two
    two.shutdown()
    one.shutdown()


def test_tp2_greedy_equals_tp1(pair: Any) -> None:
    quant, one, two = pair
    prompts = PROMPTS[:8]
    want = one.generate(prompts, GREEDY, return_logprob=True, top_logprobs_num=2)
    t0 = time.perf_counter()
    got = two.generate(prompts, GREEDY)
    elapsed = time.perf_counter() - t0
    ties = []
    for k, (w, g) in enumerate(zip(want, got, strict=True)):
        assert len(g["output_ids"]) == NEW_TOKENS
        first = _first_difference(w["output_ids"], g["output_ids"])
        if first is None:
            continue
        top = w["meta_info"]["output_top_logprobs"][first]
        gap = top[0][0] - top[1][0]
        assert g["output_ids"][first] == top[1][1] and gap < TIE_NATS[quant], (k, first, gap)
        ties.append(f"prompt {k} token {first}: gap {gap:.3f}")
    print(f"\n{quant}: TP=2 equals TP=1 on {8 - len(ties)}/8 prompts {ties}; TP=2 batch of "
          f"8 x {NEW_TOKENS} tokens in {elapsed:.1f} s")


def test_server_info_shows_tp_size(pair: Any) -> None:
    _, one, two = pair
    assert two.get_server_info()["tp_size"] == 2 and one.get_server_info()["tp_size"] == 1
    # rank 0's KV pool holds its 2 of the 3 KV heads
    assert (two.get_server_info()["kv_pool"]["bytes_per_slot"] * 3
            == one.get_server_info()["kv_pool"]["bytes_per_slot"] * 2)


# ---- the engine's features at TP=2 ---------------------------------------------------------
@pytest.fixture(scope="module")
def tp2(make_engine: Any) -> Any:
    engine = make_engine(tp_size=2)
    yield engine
    engine.shutdown()


def test_rank_channels_are_private_to_this_user(tp2: Any) -> None:
    """The rendezvous store, the batch sockets and the all-reduce file are files only this
    user can open (a 0700 folder, a 0600 shared-memory file), not loopback ports any local
    user could connect to."""
    import stat

    group = tp2.runner.tp_group
    assert stat.S_IMODE(os.stat(group._dir).st_mode) == 0o700
    assert group._store_path.startswith(group._dir)
    assert all(s.getsockopt_string(zmq.LAST_ENDPOINT).startswith(f"ipc://{group._dir}/")
               for s in group._socks)
    assert not os.path.exists(group._shm_path)  # mapped by every rank, then unlinked


def test_allreduce_file_is_private_and_never_follows_a_link(tmp_path: Any) -> None:
    import stat

    from sglang_like.tp.comm import ShmAllReduce

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path = tmp_path / "allreduce"
    path.symlink_to(victim)  # planted where the group will make its file
    ShmAllReduce.create_file(str(path), 2, 4096)
    assert not path.is_symlink() and victim.read_bytes() == b"keep"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == ShmAllReduce.file_size(2, 4096)


def test_radix_hit_gives_the_same_output(tp2: Any) -> None:
    prompt = " ".join(f"Item {i} costs {3 * i} dollars." for i in range(20)) + " The total"
    cold = tp2.generate(prompt, GREEDY)
    warm = tp2.generate(prompt, GREEDY)
    assert warm["meta_info"]["cached_tokens"] > 0
    assert warm["output_ids"] == cold["output_ids"]


def test_n_samples_and_stop_string(tp2: Any) -> None:
    outs = tp2.generate("Once upon a time,", {"n": 2, "temperature": 1.0, "seed": 5,
                                              "max_new_tokens": 8})
    assert len(outs) == 2 and outs[0]["output_ids"] != outs[1]["output_ids"]
    full = tp2.generate("The quick brown fox", GREEDY)["text"]
    stop = full[10:14]
    cut = tp2.generate("The quick brown fox", {**GREEDY, "stop": [stop], "ignore_eos": False})
    assert cut["text"] == full[: full.index(stop)]
    assert cut["meta_info"]["finish_reason"]["type"] == "stop"


def test_json_schema_output_validates(tp2: Any) -> None:
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "country": {"type": "string",
                                                                 "maxLength": 12},
        "is_capital": {"type": "boolean"}},
        "required": ["city", "country", "is_capital"], "additionalProperties": False}
    out = tp2.generate("Describe Paris as JSON:", {"temperature": 0, "max_new_tokens": 64,
                                                   "json_schema": json.dumps(schema)})
    jsonschema.validate(json.loads(out["text"]), schema)
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_eagle3_greedy_equals_speculation_off(tp2: Any, make_engine: Any) -> None:
    prompts = PROMPTS[:4]
    off = tp2.generate(prompts, GREEDY, return_logprob=True, top_logprobs_num=2)
    spec = make_engine(tp_size=2, speculative_algorithm="EAGLE3",
                       speculative_auto_disable=False)
    try:
        on = spec.generate(prompts, GREEDY)
        stats = spec.get_server_info()
    finally:
        spec.shutdown()
    for k, (w, g) in enumerate(zip(off, on, strict=True)):
        first = _first_difference(w["output_ids"], g["output_ids"])
        if first is not None:  # verify and decode order their sums differently (bf16)
            top = w["meta_info"]["output_top_logprobs"][first]
            assert top[0][0] - top[1][0] < 0.1, (k, first)
    assert stats["tp_size"] == 2


# ---- a rank that dies ----------------------------------------------------------------------
LONG = {"max_new_tokens": 4000, "ignore_eos": True}


def _generate_in_thread(engine: Any, result: dict) -> threading.Thread:
    def run() -> None:
        try:
            result["out"] = engine.generate("Write a long story.", LONG)
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            result["error"] = exc
        result["t"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while engine.get_load()["num_reqs"] == 0:  # running before the kill
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    return thread


def _workers_of(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children()
            if "sglang_like.engine_core.tp_worker" in " ".join(p.cmdline())]


@pytest.mark.parametrize("in_process", [False, True])
def test_killing_rank_1_ends_the_request_with_an_error(make_engine: Any,
                                                       in_process: bool) -> None:
    engine = (make_engine(tp_size=2) if in_process
              else Engine(tp_size=2, max_total_tokens=8192))
    try:
        if in_process:  # rank 0 is this process: its other engines' workers are here too
            worker = psutil.Process(engine._client.core.runner.tp_group.procs[0].pid)
        else:
            (worker,) = _workers_of(engine.engine_pid)
        result: dict = {}
        thread = _generate_in_thread(engine, result)
        worker.kill()
        t0 = time.monotonic()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the request hung after rank 1 died"
        assert result["t"] - t0 < 5
        if "error" in result:
            message = str(result["error"])
        else:
            reason = result["out"]["meta_info"]["finish_reason"]
            assert reason["type"] == "abort"
            message = reason["message"]
        assert "tensor-parallel rank 1" in message and "exited with code -9" in message
        assert len(result.get("out", {}).get("output_ids", [])) < LONG["max_new_tokens"]
        deadline = time.monotonic() + 5  # the loop answers first, then the core exits
        while engine.check_health() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        health = engine.check_health()
        # in process: the loop's own reason; else the core process's exit (after answering)
        expected = "tensor-parallel rank 1" if in_process else "exited with code 1"
        assert health is not None and expected in health, health
    finally:
        engine.shutdown()


def test_killing_rank_0_stops_the_other_ranks() -> None:
    engine = Engine(tp_size=2, max_total_tokens=8192)
    try:
        (worker,) = _workers_of(engine.engine_pid)
        os.kill(engine.engine_pid, signal.SIGKILL)
        gone, alive = psutil.wait_procs([worker], timeout=5)
        assert worker in gone and not alive
    finally:
        engine.shutdown()


def test_tp2_over_a_gloo_group_equals_tp1(make_engine: Any, monkeypatch: Any) -> None:
    """The torch.distributed path (gloo here, NCCL on CUDA) end to end: the same greedy
    tokens as TP=1 on the exact fp32 path."""
    from sglang_like.tp.group import ALLREDUCE_ENV

    prompts = PROMPTS[:4]
    sp = {**GREEDY, "max_new_tokens": 16}
    one = make_engine(quantization="none")
    want = one.generate(prompts, sp, return_logprob=True, top_logprobs_num=2)
    one.shutdown()
    monkeypatch.setenv(ALLREDUCE_ENV, "group")  # read by rank 0 and inherited by rank 1
    two = make_engine(quantization="none", tp_size=2)
    got = two.generate(prompts, sp)
    two.shutdown()
    for w, g in zip(want, got, strict=True):
        first = _first_difference(w["output_ids"], g["output_ids"])
        if first is not None:
            top = w["meta_info"]["output_top_logprobs"][first]
            assert top[0][0] - top[1][0] < TIE_NATS["none"], (first, top)
