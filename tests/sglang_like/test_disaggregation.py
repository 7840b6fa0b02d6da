"""Prefill/decode disaggregation between real Engines (default model, engine processes,
Mooncake over loopback), without a router: the failure paths. A decode request whose prefill
worker is not there, a transfer that never comes (timeout, cancel confirmed), a prefill
request whose decode side never registers; each ends with an error naming the cause and
leaves no KV slot held. An int8 pool's codes and scales move (greedy equals one worker's,
bytes per token equal the pool's); a pair of two pool dtypes is refused by the decode side.
A LoRA adapter loaded on one worker only is a 400 naming it and the worker, at once on both
halves; loaded on both, greedy equals one worker's. And the pieces: slot runs, the wire
messages, a transfer between two real pools."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from sglang_like import Engine
from sglang_like.disaggregation import messages as m
from sglang_like.disaggregation.transfer import MooncakeKVTransfer, slot_runs
from sglang_like.lora import SHIPPED_ADAPTER
from sglang_like.mem_pool import KVPool

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
    layout = m.KVLayout("127.0.0.1:1234", [1, 2], [3, 4], 768, "bfloat16")
    quantized = m.KVLayout("127.0.0.1:1234", [1, 2], [3, 4], 384, "int8", [5, 6], [7, 8], 12)
    for msg in (m.Register(7, layout, 3, [10, 11], 5), m.Ping(1), m.Cancel(7),
                m.Register(8, quantized, 0, [1], 1, lora_name="json"), m.Refuse(9, "why")):
        assert m.decode_to_prefill(m.encode(msg)) == msg
    for msg in (m.Done(7, 42, -0.5, [(-0.5, 42)], 100, 2), m.Failed(7, "x"), m.Pong(3, "int8"),
                m.Cancelled(7), m.Failed(7, "bad", status_code=400)):
        assert m.decode_to_decode(m.encode(msg)) == msg


def test_transfer_moves_codes_and_scales_between_real_pools() -> None:
    """Two int8 pools (3 layers, 2 KV heads, head dim 8) in one process, each with its own
    Mooncake engine: writing runs of slots moves their codes and both scales, and nothing
    else; the bytes are the pool's bytes_per_slot per slot. A pool of same-sized fp8 codes
    is refused, naming both dtypes."""
    shape = dict(num_slots=16, num_layers=3, num_kv_heads=2, head_dim=8, device="cpu")
    src_pool, dst_pool = KVPool(dtype=torch.int8, **shape), KVPool(dtype=torch.int8, **shape)
    fp8_pool = KVPool(dtype=torch.float8_e4m3fn, **shape)
    gen = torch.Generator().manual_seed(0)
    for buf in (*src_pool.k_buffers, *src_pool.v_buffers):
        buf.copy_(torch.randint(-127, 128, buf.shape, generator=gen, dtype=torch.int8))
    for buf in (*src_pool.k_scales, *src_pool.v_scales, *dst_pool.k_scales,
                *dst_pool.v_scales):
        buf.copy_(torch.rand(buf.shape, generator=gen))
    for buf in (*dst_pool.k_buffers, *dst_pool.v_buffers):
        buf.zero_()
    before = [b.clone() for b in (*dst_pool.k_scales, *dst_pool.v_scales)]
    src = MooncakeKVTransfer(src_pool, "127.0.0.1")
    dst = MooncakeKVTransfer(dst_pool, "127.0.0.1")
    assert src.check_peer(dst.layout) is None
    why = src.check_peer(MooncakeKVTransfer(fp8_pool, "127.0.0.1").layout)
    assert why is not None and "float8_e4m3fn" in why and "int8" in why, why
    src_slots, dst_slots = [2, 3, 4, 9], [10, 11, 12, 5]
    runs = slot_runs(src_slots, dst_slots)
    moved = sum(src.write_layer(dst.layout, layer, runs) for layer in range(3))
    assert moved == len(src_slots) * src_pool.bytes_per_slot == src.bytes_sent
    untouched = [s for s in range(17) if s not in dst_slots]
    for layer in range(3):
        for name in ("k_buffers", "v_buffers", "k_scales", "v_scales"):
            got, want = getattr(dst_pool, name)[layer], getattr(src_pool, name)[layer]
            assert torch.equal(got[dst_slots], want[src_slots]), (layer, name)
        assert not dst_pool.k_buffers[layer][untouched].any()
        # by bits: untouched scales are what torch.empty found, which may read as NaN
        assert torch.equal(dst_pool.k_scales[layer][untouched].view(torch.uint8),
                           before[layer][untouched].view(torch.uint8))


def _start_pair(timeout_s: float = TIMEOUT_S, **kw: object) -> tuple[Engine, Engine, int]:
    port = _free_port()
    kw = {"max_total_tokens": 4096, "log_level": "warning", **kw}
    prefill = Engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                     disaggregation_transfer_timeout=2 * timeout_s, **kw)
    decode = Engine(disaggregation_mode="decode", disaggregation_transfer_timeout=timeout_s,
                    **kw)
    return prefill, decode, port


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Engine, Engine, int]]:
    # LoRA on (no adapter loaded): requests without one are served as without LoRA
    prefill, decode, port = _start_pair(enable_lora=True)
    yield prefill, decode, port
    prefill.shutdown()
    decode.shutdown()


@pytest.fixture(scope="module")
def int8_pair() -> Iterator[tuple[Engine, Engine, int]]:
    # no timeout is tested here: a generous one, since the first int8 steps of a fresh
    # engine are slow (seconds on a loaded machine) and would end a transfer at 2 s
    prefill, decode, port = _start_pair(timeout_s=60, kv_cache_dtype="int8")
    yield prefill, decode, port
    prefill.shutdown()
    decode.shutdown()


def _pd(prefill: Engine, decode: Engine, port: int, room: int, text: str,
        sampling_params: dict = SP, **kw: object) -> dict[str, dict]:
    """The same request to both workers of a pair at once, as the router sends it; each
    side's answer, or the ValueError (a 400) it raised."""
    out: dict = {}

    def run(key: str, engine: Engine) -> None:
        try:
            out[key] = engine.generate(text, sampling_params, bootstrap_host="127.0.0.1",
                                       bootstrap_port=port, bootstrap_room=room, **kw)
        except ValueError as exc:
            out[key] = exc

    threads = [threading.Thread(target=run, args=(k, e))
               for k, e in (("p", prefill), ("d", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


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
    out = _pd(prefill, decode, port, 11, text)
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


def test_int8_pool_pair_matches_one_worker_and_moves_its_bytes(
        int8_pair: tuple[Engine, Engine, int], pair: tuple[Engine, Engine, int]) -> None:
    prefill, decode, port = int8_pair
    text = "A quantized pool moves its codes and their scales:"
    want = prefill.generate(text, SP)  # served whole, on the same int8 pool
    assert prefill.flush_cache()  # the PD request below prefills the whole prompt again
    out = _pd(prefill, decode, port, 61, text)
    assert out["d"]["output_ids"] == want["output_ids"]
    info = decode.get_server_info()
    moved = info["disaggregation"]["bytes_received"]
    num_tokens = info["disaggregation"]["num_transferred_tokens"]
    assert num_tokens == want["meta_info"]["prompt_tokens"]
    int8_bytes = info["kv_pool"]["bytes_per_slot"]
    assert moved == num_tokens * int8_bytes
    assert prefill.get_server_info()["disaggregation"]["bytes_sent"] == moved
    # codes of one byte and a float32 scale per head: a little over half the bf16 pool's
    bf16_bytes = pair[1].get_server_info()["kv_pool"]["bytes_per_slot"]
    assert 0.5 * bf16_bytes < int8_bytes < 0.6 * bf16_bytes
    _assert_idle(decode)


def test_pair_of_two_kv_dtypes_is_refused_by_the_decode_side(
        int8_pair: tuple[Engine, Engine, int], pair: tuple[Engine, Engine, int]) -> None:
    bf16_prefill, _, bf16_port = pair
    _, int8_decode, _ = int8_pair
    t0 = time.monotonic()
    out = _pd(bf16_prefill, int8_decode, bf16_port, 71, "Two pools of two kinds.")
    reason = out["d"]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort", reason
    assert "bfloat16" in reason["message"] and "int8" in reason["message"], reason
    assert "--kv-cache-dtype" in reason["message"], reason
    assert time.monotonic() - t0 < 10  # at the handshake, not after a timeout
    _assert_idle(int8_decode)


def test_lora_adapter_on_one_worker_is_a_400_on_both_at_once(
        pair: tuple[Engine, Engine, int]) -> None:
    """The adapter loaded on the prefill worker only, then on the decode worker only: each
    half fails with a 400 naming the adapter and the worker that lacks it, in seconds (the
    transfer timeouts are 2 and 4 s here, and the router waits for both halves). Loaded on both,
    greedy equals one worker's with it."""
    prefill, decode, port = pair
    text = "Reply as JSON: what is the capital of Italy?"
    prefill.load_lora_adapter("json", SHIPPED_ADAPTER)
    try:
        # each message below says which way the half ended: not by a timeout
        out = _pd(prefill, decode, port, 81, text, lora_path="json")
        assert isinstance(out["d"], ValueError) and "decode worker" in str(out["d"])
        assert "'json' is not loaded" in str(out["d"])
        assert isinstance(out["p"], ValueError), out["p"]
        assert "the decode worker refused the request" in str(out["p"]), out["p"]
        assert "'json' is not loaded" in str(out["p"])

        decode.load_lora_adapter("json", SHIPPED_ADAPTER)
        # the adapter's first steps on each engine, before a 2 s transfer timeout counts
        decode.generate("Warm up:", SP, lora_path="json")
        want = prefill.generate(text, SP, lora_path="json")
        assert want["output_ids"] != prefill.generate(text, SP)["output_ids"]
        assert prefill.flush_cache()
        out = _pd(prefill, decode, port, 82, text, lora_path="json")
        assert out["d"]["output_ids"] == want["output_ids"]

        prefill.unload_lora_adapter("json")
        out = _pd(prefill, decode, port, 83, text, lora_path="json")
        assert isinstance(out["p"], ValueError) and "prefill worker" in str(out["p"])
        assert isinstance(out["d"], ValueError), out["d"]
        assert "'json' is not loaded on the prefill worker" in str(out["d"]), out["d"]
    finally:
        for engine in (prefill, decode):
            if "json" in {a["name"] for a in engine.list_lora_adapters()}:
                engine.unload_lora_adapter("json")
    _assert_idle(decode)
