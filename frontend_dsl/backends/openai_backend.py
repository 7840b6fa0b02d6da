"""OpenAI: any /v1/chat/completions server (gen in an assistant turn, select by logprobs)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import httpx

from frontend_dsl.backends.base import Backend
from frontend_dsl.chat_template import chatml_template
from frontend_dsl.ir import GenParams

_CHAT_KEYS = {"max_new_tokens": "max_tokens", "stop": "stop", "temperature": "temperature",
              "top_p": "top_p", "frequency_penalty": "frequency_penalty",
              "presence_penalty": "presence_penalty", "seed": "seed"}


class OpenAI(Backend):
    """Chat-completions backend. The prompt sent is the state's messages so far (roles parsed by
    ChatML); a gen must sit at the start of an assistant turn. regex goes as an extra body field
    (`regex`), json_schema as `response_format`. select scores the choices by the first token's
    top logprobs when the server returns them, otherwise picks the choice the reply starts with.
    """

    is_chat_model = True

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, transport: httpx.BaseTransport | None = None) -> None:
        self.model = model
        base_url = base_url or os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1")
        api_key = api_key or os.environ.get("OPENAI_API_KEY", "")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers,
                                    transport=transport,
                                    timeout=httpx.Timeout(timeout, connect=10.0))
        self.chat_template = chatml_template()

    def _messages(self, prompt: str) -> list[dict[str, str]]:
        """Split ChatML text back into messages; an open assistant turn must be empty."""
        t = self.chat_template
        messages: list[dict[str, str]] = []
        rest = prompt
        while rest:
            role = next((r for r in ("system", "user", "assistant")
                         if rest.startswith(t.prefix(r))), None)
            if role is None:
                messages.append({"role": "user", "content": rest})  # text outside any role
                break
            body = rest[len(t.prefix(role)):]
            end = body.find(t.suffix(role))
            if end < 0:
                if role != "assistant" or body:
                    raise ValueError("OpenAI backend: gen must start an assistant turn")
                break
            messages.append({"role": role, "content": body[:end]})
            rest = body[end + len(t.suffix(role)):]
        return messages

    def _body(self, prompt: str, params: GenParams) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(prompt)}
        sp = params.to_sampling_params()
        for ours, theirs in _CHAT_KEYS.items():
            if sp.get(ours) is not None:
                body[theirs] = sp[ours]
        if sp.get("regex") is not None:
            body["regex"] = sp["regex"]
        if sp.get("json_schema") is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": json.loads(sp["json_schema"])}}
        return body

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        res = self._client.post("/chat/completions", json=body)
        if res.status_code != 200:
            kind = ValueError if res.status_code == 400 else RuntimeError
            raise kind(f"chat completions returned HTTP {res.status_code}: {res.text}")
        return res.json()

    def generate(self, prompt: str, params: GenParams) -> tuple[str, dict[str, Any]]:
        out = self._post(self._body(prompt, params))
        choice = out["choices"][0]
        meta = {"finish_reason": choice.get("finish_reason"), "usage": out.get("usage")}
        self.token_usage.add(out.get("usage") or {})
        return choice["message"]["content"] or "", meta

    def generate_stream(self, prompt: str, params: GenParams) -> Iterator[tuple[str, dict]]:
        body = {**self._body(prompt, params), "stream": True}
        with self._client.stream("POST", "/chat/completions", json=body) as res:
            if res.status_code != 200:
                res.read()
                raise RuntimeError(f"chat completions returned HTTP {res.status_code}")
            for line in res.iter_lines():
                payload = line[5:].strip() if line.startswith("data:") else ""
                if not payload or payload == "[DONE]":
                    continue
                delta = json.loads(payload)["choices"][0].get("delta", {})
                if delta.get("content"):
                    yield delta["content"], {}

    def select(self, prompt: str, choices: list[str], temperature: float,
               method: str) -> tuple[str, dict[str, Any]]:
        body = {"model": self.model, "messages": self._messages(prompt), "max_tokens": 1,
                "temperature": 0, "logprobs": True, "top_logprobs": 20}
        out = self._post(body)
        content = (out["choices"][0].get("logprobs") or {}).get("content") or []
        if content:
            top = {e["token"]: e["logprob"] for e in content[0].get("top_logprobs", [])}
            scores = [max((lp for tok, lp in top.items() if tok and c.startswith(tok)),
                          default=-math.inf) for c in choices]
            best = max(range(len(choices)), key=scores.__getitem__)
            return choices[best], {"first_token_logprobs": scores}
        text, _ = self.generate(prompt, GenParams(max_new_tokens=16, temperature=0.0))
        best = max(range(len(choices)), key=lambda i: _common_prefix(text, choices[i]))
        return choices[best], {"reply": text}

    def shutdown(self) -> None:
        self._client.close()


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.strip(), b.strip(), strict=False):
        if x != y:
            break
        n += 1
    return n
