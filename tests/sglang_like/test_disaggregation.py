"""Prefill/decode disaggregation between real Engines (default model, engine processes,
Mooncake over loopback), without a router: the failure paths. A decode request whose prefill
worker is not there, a transfer that never comes (timeout, cancel confirmed), a prefill
request whose decode side never registers; each ends with an error naming the cause and
leaves no KV slot held. And the pieces: slot runs, the wire messages."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from sglang_like import Engine
from sglang_like.disaggregation import messages as m
from sglang_like.disaggregation.transfer import slot_runs

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0  # the decode worker's transfer timeout
# the prefill worker's: longer, so a request it never hears of ends by the decode side's
# timeout and cancel (what test_transfer_timeout_cancels_and_frees checks), not by the prefill
# side's own report of a room nobody asked for, which raced it at equal timeouts
PREFILL_TIMEOUT_S = 2 * TIMEOUT_S
SP = {"max_new_tokens": 8, "temperature": 0.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_slot_runs_merge_where_both_sides_step_by_one() -> None:
    assert slot_runs([5, 6, 7, 9, 10], [100, 101, 102, 103, 104]) == [
        (5, 100, 3), (9, 103, 2)]
    assert slot_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert slot_runs([], []) == []
    with pytest.raises(ValueError):
        slot_runs([1], [1, 2])


def test_messages_round_trip() -> None:
    layout = m.KVLayout("127.0.0.1:1234", [1, 2], [3, 4], 768)
    for msg in (m.Register(7, layout, 3, [10, 11], 5), m.Ping(1), m.Cancel(7)):
        assert m.decode_to_prefill(m.encode(msg)) == msg
    for msg in (m.Done(7, 42, -0.5, [(-0.5, 42)], 100, 2), m.Failed(7, "x"), m.Pong(3),
                m.Cancelled(7)):
        assert m.decode_to_decode(m.encode(msg)) == msg


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Engine, Engine, int]]:
    port = _free_port()
    kw = {"max_total_tokens": 4096, "log_level": "warning"}
    prefill = Engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                     disaggregation_transfer_timeout=PREFILL_TIMEOUT_S, **kw)
    decode = Engine(disaggregation_mode="decode", disaggregation_transfer_timeout=TIMEOUT_S, **kw)
    yield prefill, decode, port
    prefill.shutdown()
    decode.shutdown()


def _assert_idle(engine: Engine) -> dict:
    info = engine.get_server_info()
    assert info["kv_pool"]["used_slots"] == 0, info["kv_pool"]
    assert info["disaggregation"]["num_inflight"] == 0, info["disaggregation"]
    return info


def _wait_quarantine_freed(engine: Engine, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.get_server_info()["disaggregation"]["num_quarantined_slots"]:
        assert time.monotonic() < deadline, "slots given up on were never freed"
        time.sleep(0.1)


def test_pair_without_router_matches_whole_request(pair: tuple[Engine, Engine, int]) -> None:
    prefill, decode, port = pair
    text = "Engines of a pair, asked directly:"
    want = prefill.generate(text, SP)
    out: dict = {}
    threads = [threading.Thread(target=lambda k=k, e=e: out.__setitem__(k, e.generate(
        text, SP, bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=11)))
        for k, e in (("p", prefill), ("d", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert out["d"]["output_ids"] == want["output_ids"]
    assert out["p"]["output_ids"] == want["output_ids"][:1]  # the prefill side stops there
    assert decode.get_server_info()["num_computed_prompt_tokens"] == 0
    _assert_idle(decode)


def test_decode_request_whose_prefill_worker_is_not_there(
        pair: tuple[Engine, Engine, int]) -> None:
    _, decode, _ = pair
    t0 = time.monotonic()
    out = decode.generate("Nobody will send this KV.", SP, bootstrap_host="127.0.0.1",
                          bootstrap_port=_free_port(), bootstrap_room=21)
    reason = out["meta_info"]["finish_reason"]
    # whichever comes first: no answer to its pings (3 s), or the transfer timeout (2 s here)
    assert reason["type"] == "abort" and ("stopped answering" in reason["message"]
                                          or "did not arrive" in reason["message"]), reason
    assert time.monotonic() - t0 < 10
    # slots given up on a timeout wait for the cancel's answer; a dead peer frees them
    _wait_quarantine_freed(decode)
    _assert_idle(decode)


def test_transfer_timeout_cancels_and_frees(pair: tuple[Engine, Engine, int]) -> None:
    prefill, decode, port = pair
    # the prefill worker is alive (it answers pings) but never gets this request
    out = decode.generate("The prefill worker never hears of this one.", SP,
                          bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=31)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "did not arrive" in reason["message"], reason
    # the slots are held until the prefill worker confirms the cancel, then freed
    _wait_quarantine_freed(decode)
    _assert_idle(decode)


def test_prefill_request_whose_decode_side_never_registers(
        pair: tuple[Engine, Engine, int]) -> None:
    prefill, _, port = pair
    t0 = time.monotonic()
    out = prefill.generate("No decode worker asks for this.", SP, bootstrap_host="127.0.0.1",
                           bootstrap_port=port, bootstrap_room=41)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "no decode worker registered" in reason["message"]
    assert PREFILL_TIMEOUT_S - 0.5 < time.monotonic() - t0 < PREFILL_TIMEOUT_S + 5
    _assert_idle(prefill)


def test_bad_bootstrap_fields_are_value_errors(pair: tuple[Engine, Engine, int]) -> None:
    _, decode, _ = pair
    with pytest.raises(ValueError, match="n > 1"):
        decode.generate("x", {**SP, "n": 2}, bootstrap_host="h", bootstrap_port=1,
                        bootstrap_room=1)
    with pytest.raises(ValueError, match="bootstrap_room"):
        decode.generate("x", SP, bootstrap_host="h", bootstrap_port=1, bootstrap_room=-1)
    with pytest.raises(ValueError, match="one entry per prompt"):
        decode.generate(["x", "y"], SP, bootstrap_host="h", bootstrap_port=1,
                        bootstrap_room=[1])
