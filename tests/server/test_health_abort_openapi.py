"""Over the fake engine: /health reports the engine's check_health, /abort_request takes SGLang's
body (rid or abort_all), and /openapi.json documents the routes with the models' schemas."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import jsonschema
import pytest

from sglang_like.server.json_schemas import SAMPLING_RANGES
from sglang_like.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)


def test_health_tells_the_engines_reason(fake_server: Any) -> None:
    url = fake_server.url + "/health"
    assert httpx.get(url).status_code == 200
    reason = "a scheduler step has run for 312 s (watchdog timeout 300 s)"
    fake_server.engine.health_reason = reason
    r = httpx.get(url)
    assert r.status_code == 503
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["message"] == reason and error["code"] == 503
    assert error["type"] == "ServiceUnavailableError"
    fake_server.engine.health_reason = None
    assert httpx.get(url).status_code == 200


def test_health_when_the_check_itself_fails(fake_server: Any) -> None:
    def broken() -> str | None:
        raise RuntimeError("lock poisoned")

    fake_server.engine.check_health = broken
    r = httpx.get(fake_server.url + "/health")
    assert r.status_code == 503 and "lock poisoned" in r.json()["error"]["message"]


def test_health_of_an_engine_without_check_health(fake_server_factory: Any) -> None:
    server = fake_server_factory()
    server.engine.check_health = None  # getattr finds no callable: treated as healthy
    assert httpx.get(server.url + "/health").status_code == 200


ABORT_BODIES = [
    ({"rid": "r1"}, 200, {"r1"}, 0),
    ({"rid": "r1", "abort_all": False}, 200, {"r1"}, 0),
    ({"rid": "", "abort_all": True}, 200, set(), 1),
    ({"abort_all": True}, 200, set(), 1),
    ({}, 400, set(), 0),
    ({"rid": ""}, 400, set(), 0),
    ({"rid": None, "abort_all": False}, 400, set(), 0),
    ({"rid": 5}, 400, set(), 0),
    ({"abort_all": "yes"}, 400, set(), 0),
    ([{"rid": "r1"}], 400, set(), 0),
]


@pytest.mark.parametrize(("body", "status", "aborted", "num_abort_all"), ABORT_BODIES)
def test_abort_request_bodies(
    fake_server: Any, body: Any, status: int, aborted: set[str], num_abort_all: int
) -> None:
    r = httpx.post(fake_server.url + "/abort_request", json=body)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["message"]
    assert fake_server.engine.aborted == aborted
    assert fake_server.engine.num_abort_all == num_abort_all


def test_abort_all_on_an_engine_without_it(fake_server: Any) -> None:
    fake_server.engine.abort_all = None
    r = httpx.post(fake_server.url + "/abort_request", json={"abort_all": True})
    assert r.status_code == 400 and "rid" in r.json()["error"]["message"]


BODIES = [
    ("/generate", GenerateRequest),
    ("/v1/completions", CompletionRequest),
    ("/v1/chat/completions", ChatCompletionRequest),
    ("/abort_request", AbortRequest),
]


def test_openapi_document(fake_server: Any) -> None:
    r = httpx.get(fake_server.url + "/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    for path, model in BODIES:
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model.__name__}"
        want = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in want.pop("$defs", {}).items():
            assert schemas[name] == sub
        assert schemas[model.__name__] == want
        assert {"200", "400"} <= set(op["responses"])
    for path in ("/health", "/get_model_info", "/get_server_info", "/v1/models", "/metrics"):
        assert "get" in doc["paths"][path], path
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
    assert "text/event-stream" in doc["paths"]["/generate"]["post"]["responses"]["200"]["content"]
    _assert_refs_resolve(doc, doc)


def test_openapi_needs_the_api_key_like_other_routes(fake_server_factory: Any) -> None:
    server = fake_server_factory(api_key="k")
    assert httpx.get(server.url + "/openapi.json").status_code == 401
    r = httpx.get(server.url + "/openapi.json", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and "/generate" in r.json()["paths"]


def test_openapi_sampling_params_schema_matches_validation() -> None:
    """The documented sampling_params are what clean_sampling_params accepts: known keys only,
    null allowed for each."""
    from sglang_like.sampling_params import SamplingParams
    from sglang_like.server.protocol import clean_sampling_params

    schema = GenerateRequest.model_json_schema()["properties"]["sampling_params"]["anyOf"][0]
    assert schema["additionalProperties"] is False
    for name in SamplingParams.__dataclass_fields__:
        assert name in schema["properties"], name
        clean_sampling_params({name: None})


NOT_NUMBERS = [("temperature", True), ("min_p", False), ("top_p", "0.5"),
               ("presence_penalty", "1"), ("frequency_penalty", [0]), ("repetition_penalty", {})]


@pytest.mark.parametrize(("field", "value"), NOT_NUMBERS)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openai_numbers_are_strict(fake_server: Any, path: str, field: str, value: Any) -> None:
    """Found by the schemathesis fuzz: pydantic's lax float took `false` as min_p 0.0."""
    body = {"prompt": "a"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "a"}]}
    r = httpx.post(fake_server.url + path, json={**body, field: value, "max_tokens": 1})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    r = httpx.post(fake_server.url + path, json={**body, "temperature": 0, "max_tokens": 1})
    assert r.status_code == 200, r.text  # an int is still a number


def _candidates(bounds: dict[str, Any]) -> list[Any]:
    values: list[Any] = [0, 1, -1, 0.5, 2.5, True, "1", None]
    for key, bound in bounds.items():
        if key in ("minimum", "maximum", "exclusiveMinimum"):
            values += [bound, bound - 1, bound + 1, bound - 1e-3, bound + 1e-3]
        elif key == "anyOf":
            values += [v for sub in bound for v in _candidates(sub)]
        elif key == "const":
            values += [bound, bound - 1, bound + 1]
    # JSON Schema counts 3.0 as an integer; the checks want an integer literal (3)
    return [v for v in values if not (isinstance(v, float) and v.is_integer())]


@pytest.mark.parametrize("name", sorted(SAMPLING_RANGES))
def test_documented_sampling_ranges_are_the_checks(name: str) -> None:
    """At and around each documented bound, the schema and SamplingParams agree."""
    from sglang_like.sampling_params import SamplingParams

    schema = GenerateRequest.model_json_schema()["properties"]["sampling_params"]["anyOf"][0]
    validator = jsonschema.Draft202012Validator(schema)
    base = {"max_new_tokens": 1 << 20} if name == "min_new_tokens" else {}
    for value in _candidates(SAMPLING_RANGES[name]):
        params = {**base, name: value}
        try:
            SamplingParams.from_dict(params)
            accepted = True
        except ValueError:
            accepted = False
        assert validator.is_valid(params) == accepted, (params, accepted)


def _assert_refs_resolve(node: Any, doc: dict) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            target: Any = doc
            for part in ref.removeprefix("#/").split("/"):
                target = target[part]
        for value in node.values():
            _assert_refs_resolve(value, doc)
    elif isinstance(node, list):
        for value in node:
            _assert_refs_resolve(value, doc)


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
def test_stream_whose_client_leaves_before_its_first_token_is_aborted_at_once(
    fake_server_factory: Any, path: str
) -> None:
    """A queued stream (its first chunk not yet made) is aborted when its client goes, not
    when a batch slot frees and it has been prefilled for nobody."""
    server = fake_server_factory(step_s=0.05, max_running_requests=1)
    engine = server.engine
    body: dict[str, Any] = (
        {"text": "b", "rid": "queued", "sampling_params": {"max_new_tokens": 5}}
        if path == "/generate" else
        {"messages": [{"role": "user", "content": "b"}], "max_tokens": 5})

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            busy = asyncio.ensure_future(client.post(server.url + "/generate", json={
                "text": "a", "sampling_params": {"max_new_tokens": 100}}))  # holds the slot 5 s
            await asyncio.sleep(0.2)

            async def read() -> None:
                async with client.stream("POST", server.url + path,
                                         json={**body, "stream": True}) as r:
                    await r.aread()

            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(read(), 0.3)
            assert engine.num_queued_requests == 1 or engine.aborted
            deadline = time.monotonic() + 1.0
            while engine.num_queued_requests and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert engine.num_queued_requests == 0, "the queued stream was not aborted"
            assert not busy.done()
            if path == "/generate":
                assert "queued" in engine.aborted
            busy.cancel()

    asyncio.run(main())
