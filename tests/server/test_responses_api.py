"""OpenAI's Responses API (/v1/responses) through the official `openai` client, unchanged,
against the real server on the default model at temperature 0: whole, streamed and cut answers
agree and count tokens as the tokenizer does, instructions, a json_schema format, a tool call
round trip and streamed calls, previous_response_id from the kept responses (GET, DELETE,
store: false, 404s), the 400s for what the server does not serve; reasoning items on a server
with --reasoning-parser; the store's LRU as a unit."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from sglang_like.model_loader import load_tokenizer
from sglang_like.server.openai.response_events import _Output
from sglang_like.server.openai.response_store import KeptResponse, ResponseStore

ASK = "What is the capital of France?"
TERSE = "You are terse."
WEATHER = {"type": "function", "name": "get_weather", "strict": True,
           "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
# One earlier call -> result -> answer: the 135M default model follows the pattern (it rarely
# calls a tool from the instructions alone)
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"type": "function_call", "call_id": "call_0", "name": "get_weather",
     "arguments": json.dumps({"city": "Paris"})},
    {"type": "function_call_output", "call_id": "call_0", "output": "18 C, sunny"},
    {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
    {"role": "user", "content": "What is the weather in Rome?"},
]
TEXT_EVENTS_HEAD = ["response.created", "response.in_progress", "response.output_item.added",
                    "response.content_part.added"]
TEXT_EVENTS_TAIL = ["response.output_text.done", "response.content_part.done",
                    "response.output_item.done"]


@pytest.fixture(scope="module")
def client(real_server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer()


def _prompt_len(tokenizer: Any, messages: list[dict[str, Any]]) -> int:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return len(tokenizer.encode(prompt))


def _raw_events(client: openai.OpenAI, **kwargs: Any) -> list[Any]:
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


@pytest.mark.slow
def test_text_whole_streamed_and_cut(client: openai.OpenAI, tokenizer: Any) -> None:
    kwargs: dict[str, Any] = {"model": "default", "input": ASK, "instructions": TERSE,
                              "temperature": 0, "max_output_tokens": 48}
    # the first run caches the prompt: the runs compared below take the same path (greedy
    # output may differ between a cold and a cached prefix; README, --enable-deterministic)
    client.responses.create(**kwargs)
    whole = client.responses.create(**kwargs)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "completed" and whole.incomplete_details is None
    assert whole.model == "SmolLM2-135M-Instruct" and whole.instructions == TERSE
    assert [(o.type, o.role, o.status) for o in whole.output] == [
        ("message", "assistant", "completed")]
    text = whole.output_text
    assert text and whole.output[0].content[0].type == "output_text"
    prompt_len = _prompt_len(tokenizer, [{"role": "system", "content": TERSE},
                                         {"role": "user", "content": ASK}])
    assert whole.usage.input_tokens == prompt_len
    # the answer's tokens and the end-of-turn token the model stopped on
    assert whole.usage.output_tokens == len(tokenizer.encode(text)) + 1
    assert whole.usage.total_tokens == prompt_len + whole.usage.output_tokens

    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    num_deltas = kinds.count("response.output_text.delta")
    assert num_deltas > 0 and kinds == [*TEXT_EVENTS_HEAD, *["response.output_text.delta"]
                                        * num_deltas, *TEXT_EVENTS_TAIL, "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens

    cut = client.responses.create(**{**kwargs, "max_output_tokens": 3})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and text.startswith(cut.output_text)
    assert cut.output[0].status == "incomplete"
    events = _raw_events(client, **{**kwargs, "max_output_tokens": 3})
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == cut.output_text


class Capital(BaseModel):
    capital: str = Field(max_length=20)


@pytest.mark.slow
def test_json_schema_format(client: openai.OpenAI) -> None:
    # the SDK's structured-output helper sends text.format json_schema with Capital's strict
    # schema, and parses the answer into Capital
    answer = client.responses.parse(model="default", input=ASK, temperature=0,
                                    max_output_tokens=32, text_format=Capital)
    assert answer.status == "completed" and answer.text.format.type == "json_schema"
    assert answer.text.format.name == "Capital"
    jsonschema.validate(json.loads(answer.output_text), answer.text.format.schema_)
    assert isinstance(answer.output_parsed, Capital) and answer.output_parsed.capital


def _calls(response: Any) -> list[tuple[str, dict]]:
    calls = [o for o in response.output if o.type == "function_call"]
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.slow
def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Rome?"}]
    kwargs: dict[str, Any] = {"model": "default", "tools": [WEATHER], "temperature": 0}
    # a named function's arguments stream as they are generated
    with client.responses.stream(input=ask, tool_choice={"type": "function",
                                                         "name": "get_weather"},
                                 max_output_tokens=48, **kwargs) as stream:
        events = list(stream)
        first = stream.get_final_response()
    assert first.status == "completed" and first.output_text == ""
    (name, args), = _calls(first)
    call = first.output[-1]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done[0].arguments == call.arguments
    assert [e.type for e in events][-2:] == ["response.output_item.done", "response.completed"]

    # the SDK's output items go back as they came, then the tool's result
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, cloudy"}
    final = client.responses.create(input=[*ask, *first.output, result], tool_choice="none",
                                    max_output_tokens=16, **kwargs)
    assert [o.type for o in final.output] == ["message"] and final.output_text
    # the prompt is the chat route's for the same turns
    chat = client.chat.completions.create(
        model="default", max_tokens=1, tools=[{"type": "function", "function": {
            k: WEATHER[k] for k in ("name", "description", "parameters")}}], tool_choice="none",
        messages=[*ask, {"role": "assistant", "tool_calls": [{
            "id": call.call_id, "type": "function", "function": {
                "name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "21 C, cloudy"}])
    assert final.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.slow
def test_streamed_auto_call_equals_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "default", "input": HISTORY, "tools": [WEATHER],
                              "temperature": 0, "max_output_tokens": 48}
    client.responses.create(**kwargs)  # caches the prompt (see the first test)
    whole = client.responses.create(**kwargs)
    assert _calls(whole) == [("get_weather", {"city": "Rome"})]
    with client.responses.stream(**kwargs) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert _calls(final) == _calls(whole) and final.tool_choice == "auto"
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done",
                         "response.output_item.done", "response.completed"]


@pytest.mark.slow
def test_previous_response_id(client: openai.OpenAI, tokenizer: Any, real_server: Any) -> None:
    kwargs: dict[str, Any] = {"model": "default", "temperature": 0, "max_output_tokens": 12}
    first = client.responses.create(input="My name is Ada.", instructions=TERSE, **kwargs)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id,
                                     metadata={"turn": "2"}, **kwargs)
    assert second.previous_response_id == first.id and second.metadata == {"turn": "2"}
    # the kept turn and the new input; the first response's instructions are not carried
    assert second.usage.input_tokens == _prompt_len(tokenizer, [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()

    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(input="Hi", previous_response_id=second.id, **kwargs)
    assert caught.value.body["param"] == "previous_response_id"
    unkept = client.responses.create(input="Hi", store=False, **{**kwargs,
                                                                "max_output_tokens": 2})
    assert unkept.store is False
    for response_id in (unkept.id, "resp_unknown"):
        r = httpx.get(f"{real_server.url}/v1/responses/{response_id}")
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        assert httpx.delete(f"{real_server.url}/v1/responses/{response_id}").status_code == 404


@pytest.mark.slow
@pytest.mark.parametrize("extra,needle", [
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "low"}}, "not supported by this server: reasoning"),
    ({"top_logprobs": 2}, "not supported by this server: top_logprobs"),
    ({"tools": [{"type": "web_search"}]}, "built-in tool"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "https://x/y.png"}]}]},
     "reads text only"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]},
     "no function_call item"),
    ({"tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, "strict"),
    ({"max_output_tokens": 100_000}, "context length"),
], ids=["background", "include", "truncation", "reasoning", "top-logprobs", "web-search",
        "image", "item-reference", "orphan-output", "strict-under-format", "max-tokens"])
def test_unserved_fields_are_400(client: openai.OpenAI, extra: dict, needle: str) -> None:
    kwargs: dict[str, Any] = {"model": "default", "input": "Hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError, match=needle) as caught:
        client.responses.create(**kwargs)
    assert caught.value.body["type"] == "BadRequestError"


@pytest.fixture(scope="module")
def thinking_client(module_server_launcher: Any) -> openai.OpenAI:
    # deepseek-r1: the answer starts inside the think block; the budget closes it after 4
    # tokens, so even the default model gives reasoning, then an answer
    server = module_server_launcher("--reasoning-parser", "deepseek-r1", "--reasoning-budget",
                                    "4", "--max-running-requests", "4")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_reasoning_items(thinking_client: openai.OpenAI, tokenizer: Any) -> None:
    kwargs: dict[str, Any] = {"model": "default", "input": "What is two plus two?",
                              "temperature": 0, "max_output_tokens": 16}
    thinking_client.responses.create(**kwargs)  # caches the prompt (see the first test)
    whole = thinking_client.responses.create(**kwargs)
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    reasoning = whole.output[0].content[0].text
    assert reasoning and whole.output[0].content[0].type == "reasoning_text"
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= 4  # the budget
    events = _raw_events(thinking_client, **kwargs)
    kinds = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == (
        reasoning)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        whole.output_text)
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    assert events[-1].response.status == whole.status

    # continued: the reasoning item goes to the template as reasoning_content, which the
    # default model's ChatML does not show
    after = thinking_client.responses.create(**{**kwargs, "input": "And three plus three?",
                                                "max_output_tokens": 2},
                                             previous_response_id=whole.id)
    assert after.usage.input_tokens == _prompt_len(tokenizer, [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": whole.output_text},
        {"role": "user", "content": "And three plus three?"}])


def _kept(owner: str | None, num_chars: int) -> KeptResponse:
    return KeptResponse(owner, {}, (), num_chars)


def test_store_drops_the_least_recently_used() -> None:
    store = ResponseStore(max_responses=2, max_chars=100)
    store.put("a", _kept(None, 10))
    store.put("b", _kept(None, 10))
    assert store.get(None, "a") is not None  # a is now the most recently used
    store.put("c", _kept(None, 10))
    assert store.get(None, "b") is None and len(store) == 2
    assert store.get("tenant", "a") is None  # another tenant's response is not found
    store.put("d", _kept(None, 85))  # two at most: a (least recently used) goes
    assert [store.get(None, k) is not None for k in "acd"] == [False, True, True]
    store.put("e", _kept(None, 20))  # c goes for the count, then d for the characters
    assert [store.get(None, k) is not None for k in "cde"] == [False, False, True]
    assert store.num_chars == 20 and len(store) == 1
    assert store.delete(None, "e") and not store.delete(None, "e")
    assert store.num_chars == 0 and len(store) == 0


def _event_data(event: str) -> dict[str, Any]:
    kind, data = event.strip().split("\n")
    body = json.loads(data.removeprefix("data: "))
    assert kind == f"event: {body['type']}"
    return body


def test_a_late_failure_ends_the_stream_with_error_and_failed() -> None:
    """What sse_response sends when the answer fails after its first event (an engine abort
    mid-stream cannot be caused on purpose against the real server)."""
    out = _Output({"id": "resp_1", "object": "response", "status": "in_progress", "output": []})
    events = [*out.start(), *out.text("Hi")]
    events += [e for e in out.failed(500, "internal error: boom").split("\n\n") if e]
    bodies = [_event_data(e) for e in events]
    assert [b["sequence_number"] for b in bodies] == list(range(len(bodies)))
    assert [b["type"] for b in bodies][-2:] == ["error", "response.failed"]
    assert bodies[-2]["code"] == "server_error" and bodies[-2]["message"] == "internal error: boom"
    failed = bodies[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == "Hi"
