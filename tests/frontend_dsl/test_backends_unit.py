"""Backends' wire formats: RuntimeEndpoint (HTTP, mocked transport), Runtime (fake engine),
OpenAI (mocked transport), and chat-template role derivation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import frontend_dsl as sgl
from frontend_dsl.chat_template import template_from_jinja
from frontend_dsl.ir import GenParams

LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.mark.parametrize(
    ("source", "user_prefix", "assistant_suffix", "default_system_has"),
    [
        ("smol", "<|im_start|>user\n", "<|im_end|>\n", "SmolLM"),
        (LLAMA3_LIKE, "<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>", ""),
        (None, "<|im_start|>user\n", "<|im_end|>\n", ""),
    ],
)
def test_roles_derived_from_jinja(smol_template, source, user_prefix, assistant_suffix,
                                  default_system_has) -> None:
    t = template_from_jinja(smol_template if source == "smol" else source)
    assert t.prefix("user") == user_prefix
    assert t.suffix("assistant") == assistant_suffix
    assert default_system_has in t.default_system
    if not default_system_has:
        assert t.default_system == ""


def _mock_server(log: list[dict]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "m", "chat_template": LLAMA3_LIKE})
        body = json.loads(request.content)
        log.append(body)
        if body["sampling_params"].get("max_new_tokens", 1) < 0:
            return httpx.Response(400, json={"error": {"message": "bad max_new_tokens"}})
        if body.get("stream"):
            lines = [f"data: {json.dumps({'text': t, 'meta_info': {}})}\n\n"
                     for t in ("He", "Hello", "Hello world")]
            return httpx.Response(200, text="".join(lines) + "data: [DONE]\n\n")
        return httpx.Response(200, json={"text": "ok", "meta_info": {"prompt_tokens": 3}})

    return httpx.MockTransport(handler)


def test_runtime_endpoint_generate_stream_and_errors() -> None:
    log: list[dict] = []
    ep = sgl.RuntimeEndpoint("http://test", transport=_mock_server(log))
    assert ep.chat_template.prefix("user").startswith("<|start_header_id|>user")

    @sgl.function
    def prog(s):
        s += sgl.user("hi") + sgl.assistant(sgl.gen("a", max_tokens=4, temperature=0))

    state = prog.run(backend=ep)
    assert state["a"] == "ok"
    assert log[0]["sampling_params"] == {"max_new_tokens": 4, "temperature": 0,
                                         "top_p": 1.0, "top_k": -1}
    pieces = [t for t, _ in ep.generate_stream("x", GenParams(max_new_tokens=3))]
    assert pieces == ["He", "llo", " world"]  # cumulative server text -> increments
    assert log[-1]["stream"] is True
    with pytest.raises(ValueError, match="bad max_new_tokens"):
        ep.generate("x", GenParams(max_new_tokens=-1))


class _FakeTokenizer:
    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template


class _FakeEngine:
    """Same methods as sglang_like.Engine; streams incremental chunks."""

    def __init__(self, chat_template: str) -> None:
        self.tokenizer = _FakeTokenizer(chat_template)
        self.calls: list[dict[str, Any]] = []

    def generate(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        if kwargs["stream"]:
            return iter([{"text": "ab", "meta_info": {}}, {"text": "cd", "meta_info": {}}])
        return {"text": "xyz", "meta_info": {"prompt_tokens": 5}}

    def flush_cache(self) -> bool:
        return True

    def get_server_info(self) -> dict:
        return {"cache_hit_rate": 0.5}


def test_runtime_maps_bodies_to_engine_generate(smol_template) -> None:
    engine = _FakeEngine(smol_template)
    rt = sgl.Runtime(engine=engine)
    assert "SmolLM" in rt.chat_template.default_system
    text, meta = rt.generate("p", GenParams(max_new_tokens=2, return_logprob=True))
    assert (text, meta) == ("xyz", {"prompt_tokens": 5})
    call = engine.calls[0]
    assert call["prompt"] == "p" and call["sampling_params"] == {"max_new_tokens": 2}
    assert call["return_logprob"] is True and call["stream"] is False
    stream: Iterator = rt.generate_stream("p", GenParams(max_new_tokens=2))
    assert [t for t, _ in stream] == ["ab", "cd"]  # engine chunks are already increments
    assert rt.flush_cache() is True and rt.get_server_info()["cache_hit_rate"] == 0.5
    rt.shutdown()  # not owned: must not shut the shared engine down
    assert rt.engine is engine


def test_openai_backend_messages_constraints_and_select() -> None:
    log: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        log.append(body)
        if body.get("logprobs"):
            top = [{"token": "No", "logprob": -0.2}, {"token": "Yes", "logprob": -1.9}]
            return httpx.Response(200, json={"choices": [{"message": {"content": "No"},
                                  "logprobs": {"content": [{"top_logprobs": top}]}}]})
        return httpx.Response(200, json={"choices": [{"message": {"content": "{}"},
                                                      "finish_reason": "stop"}]})

    backend = sgl.OpenAI("m", base_url="http://t/v1", transport=httpx.MockTransport(handler))

    @sgl.function
    def prog(s):
        s += sgl.system("S") + sgl.user("Q")
        s += sgl.assistant(sgl.gen("j", json_schema={"type": "object"}, stop="}"))
        s += sgl.user("Sure?")
        s += sgl.assistant(sgl.select("yn", choices=["Yes", "No"]))

    state = prog.run(backend=backend)
    assert state["j"] == "{}" and state["yn"] == "No"
    assert log[0]["messages"] == [{"role": "system", "content": "S"},
                                  {"role": "user", "content": "Q"}]
    assert log[0]["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert log[0]["stop"] == "}"
    assert log[1]["messages"][-1] == {"role": "user", "content": "Sure?"}


def test_openai_backend_rejects_gen_mid_assistant_turn() -> None:
    backend = sgl.OpenAI("m", base_url="http://t/v1",
                         transport=httpx.MockTransport(lambda r: httpx.Response(500)))

    @sgl.function
    def prog(s):
        s += sgl.assistant_begin() + "partial " + sgl.gen("x")

    with pytest.raises(ValueError, match="assistant turn"):
        prog.run(backend=backend)
