"""What sglang-router 0.3.2 sends a worker, over the fake engine: its re-serialized bodies (the
extra fields it adds, `max_completion_tokens` for `max_tokens`) are accepted and mean the same
as the client's own body; /get_load and /model_info have the shapes the router reads.

The router bodies below were captured from the real router in front of this server.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

# /generate after the router: the client sent only text and sampling_params
ROUTER_GENERATE_EXTRAS = {
    "model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
    "return_hidden_states": False, "background": False, "no_logs": False,
    "return_bytes": False, "return_entropy": False,
}
# chat after the router: the client's max_tokens is now max_completion_tokens
ROUTER_CHAT_EXTRAS = {
    "logprobs": False, "stream": False, "no_stop_trim": False, "ignore_eos": False,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False,
}
ROUTER_COMPLETION_EXTRAS = {
    "stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
    "skip_special_tokens": True, "return_hidden_states": False,
}
MESSAGES = [{"role": "user", "content": "hi"}]


def _post(url: str, body: Any) -> httpx.Response:
    return httpx.post(url, json=body, timeout=30)


def _strip_ids(result: dict[str, Any]) -> dict[str, Any]:
    """A result without what differs between two runs (request ids, timings, cache hits)."""
    meta = {k: v for k, v in result["meta_info"].items()
            if k not in ("id", "e2e_latency", "queue_time", "cached_tokens")}
    return {**result, "meta_info": meta}


def test_router_generate_body_same_answer(fake_server: Any) -> None:
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}
    direct = _post(fake_server.url + "/generate", body)
    routed = _post(fake_server.url + "/generate", {**body, **ROUTER_GENERATE_EXTRAS})
    assert direct.status_code == routed.status_code == 200, routed.text
    assert _strip_ids(routed.json()) == _strip_ids(direct.json())
    first, second = fake_server.engine.calls
    assert {**first, "rid": None} == {**second, "rid": None}


def test_sampling_seed_is_seed(fake_server: Any) -> None:
    """The router drops `seed` from sampling_params but passes SGLang's `sampling_seed`."""
    url = fake_server.url + "/generate"
    for params in ({"sampling_seed": 7}, {"sampling_seed": 7, "seed": 7}):
        r = _post(url, {"text": "a", "sampling_params": {"max_new_tokens": 1, **params}})
        assert r.status_code == 200, r.text
        assert fake_server.engine.calls[-1]["sampling_params"] == {"max_new_tokens": 1,
                                                                   "seed": 7}
    r = _post(url, {"text": "a", "sampling_params": {"sampling_seed": 7, "seed": 8}})
    assert r.status_code == 400 and "sampling_seed" in r.json()["error"]["message"]
    r = _post(url, {"text": "a", "sampling_params": {"sampling_seed": "x"}})
    assert r.status_code == 400, r.text


def test_router_generate_stream_and_input_ids_batch(fake_server: Any) -> None:
    url = fake_server.url + "/generate"
    stream = {"text": "hello", "sampling_params": {"max_new_tokens": 2},
              **ROUTER_GENERATE_EXTRAS, "stream": True}
    r = _post(url, stream)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    batch = {"input_ids": [[104, 105], [106]], "sampling_params": {"max_new_tokens": 2},
             **ROUTER_GENERATE_EXTRAS}
    r = _post(url, batch)
    assert r.status_code == 200 and len(r.json()) == 2, r.text


def test_router_chat_body_honours_max_completion_tokens(fake_server: Any) -> None:
    url = fake_server.url + "/v1/chat/completions"
    direct = _post(url, {"model": "m", "messages": MESSAGES, "max_tokens": 3,
                         "temperature": 0.0})
    routed = _post(url, {"model": "m", "messages": MESSAGES, "max_completion_tokens": 3,
                         "temperature": 0.0, **ROUTER_CHAT_EXTRAS})
    assert direct.status_code == routed.status_code == 200, routed.text
    assert routed.json()["usage"]["completion_tokens"] == 3
    assert routed.json()["choices"] == direct.json()["choices"]
    direct_call, routed_call = fake_server.engine.calls
    assert routed_call["sampling_params"]["max_new_tokens"] == 3
    # the router's explicit defaults are the sampling defaults
    assert routed_call | {"rid": None} == direct_call | {"rid": None, "sampling_params": {
        **direct_call["sampling_params"], "ignore_eos": False, "skip_special_tokens": True,
        "no_stop_trim": False}}


def test_router_chat_flags_reach_sampling(fake_server: Any) -> None:
    body = {"messages": MESSAGES, "model": "unknown", "max_completion_tokens": 2,
            **ROUTER_CHAT_EXTRAS, "ignore_eos": True, "skip_special_tokens": False,
            "no_stop_trim": True}
    r = _post(fake_server.url + "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    params = fake_server.engine.calls[-1]["sampling_params"]
    assert params["ignore_eos"] is True and params["skip_special_tokens"] is False
    assert params["no_stop_trim"] is True and params["max_new_tokens"] == 2


def test_router_completion_body(fake_server: Any) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, **ROUTER_COMPLETION_EXTRAS}
    r = _post(fake_server.url + "/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


BAD_ROUTER_FIELDS = [
    ("/generate", {"text": "a", "log_metrics": "yes"}, "log_metrics"),
    ("/generate", {"text": "a", "return_hidden_states": 1}, "return_hidden_states"),
    ("/generate", {"text": "a", "model": 5}, "model"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "separate_reasoning": "no"},
     "separate_reasoning"),
]


@pytest.mark.parametrize(("path", "body", "needle"), BAD_ROUTER_FIELDS)
def test_router_fields_still_validated(fake_server: Any, path: str, body: Any,
                                       needle: str) -> None:
    r = _post(fake_server.url + path, body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_get_load_shape(fake_server_factory: Any) -> None:
    server = fake_server_factory(step_s=0.05)
    idle = httpx.get(server.url + "/get_load")
    assert idle.status_code == 200
    assert idle.json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]

    async def busy() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            gen = asyncio.create_task(client.post("/generate", json={
                "text": "abcd", "sampling_params": {"max_new_tokens": 10}}))
            await asyncio.sleep(0.2)
            load = (await client.get("/get_load")).json()
            await gen
            return load

    (load,) = asyncio.run(busy())
    assert load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0
    assert load["num_tokens"] >= 4


def test_model_info_both_spellings(fake_server: Any) -> None:
    new = httpx.get(fake_server.url + "/model_info")
    old = httpx.get(fake_server.url + "/get_model_info")
    assert new.status_code == old.status_code == 200
    assert new.json() == old.json()
    assert new.json()["model_path"] and new.json()["is_generation"] is True


def test_openapi_documents_router_routes(fake_server: Any) -> None:
    doc = httpx.get(fake_server.url + "/openapi.json").json()
    assert {"/get_load", "/model_info", "/server_info"} <= set(doc["paths"])
    generate = doc["components"]["schemas"]["GenerateRequest"]["properties"]
    assert {"log_metrics", "return_hidden_states", "model"} <= set(generate)


@pytest.mark.parametrize(("path", "extra", "name"), [
    ("/generate", {"modalities": ["audio"]}, "modalities"),
    ("/generate", {"return_hidden_states": True}, "return_hidden_states"),
    ("/generate", {"background": True}, "background"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"return_hidden_states": True}, "return_hidden_states"),
    ("/v1/completions", {"prediction": {"type": "content"}}, "prediction"),
])
def test_a_field_the_server_does_not_act_on_is_a_400_naming_it(
        fake_server: Any, path: str, extra: dict, name: str) -> None:
    """Beside what sglang-router adds (at its values, above), a field naming a feature this
    server lacks is refused, never silently dropped."""
    body = ({"text": "hi", "sampling_params": {"max_new_tokens": 1}} if path == "/generate"
            else {"model": "m", "max_tokens": 1, **(
                {"messages": MESSAGES} if "chat" in path else {"prompt": "hi"})})
    r = _post(fake_server.url + path, {**body, **extra})
    assert r.status_code == 400 and name in r.text, r.text
