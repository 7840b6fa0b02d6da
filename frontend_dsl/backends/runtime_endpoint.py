"""RuntimeEndpoint: the SGLang-native HTTP API of a running server (/generate, /get_model_info)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from typing import Any

import httpx

from frontend_dsl.backends.base import NativeBackend
from frontend_dsl.chat_template import chatml_template, template_from_jinja


class RuntimeEndpoint(NativeBackend):
    """A backend that posts to `base_url` (e.g. "http://127.0.0.1:30000").

    The chat template is the one the server reports in GET /get_model_info; ChatML only when the
    server reports none.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 chat_template: str | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, transport=transport,
                                    timeout=httpx.Timeout(timeout, connect=10.0))
        self.model_info: dict[str, Any] = self._get("/get_model_info")
        source = chat_template if chat_template is not None else self.model_info.get(
            "chat_template")
        try:
            self.chat_template = template_from_jinja(
                source, self.model_info.get("bos_token") or "",
                self.model_info.get("eos_token") or "")
        except ValueError as e:
            warnings.warn(f"cannot derive roles from the server's chat template ({e}); "
                          "using ChatML", stacklevel=2)
            self.chat_template = chatml_template()

    def get_model_name(self) -> str:
        return str(self.model_info.get("model_path", ""))

    def _get(self, path: str) -> dict[str, Any]:
        res = self._client.get(path)
        _check(res)
        return res.json()

    def _request(self, body: dict[str, Any]) -> Any:
        res = self._client.post("/generate", json=body)
        _check(res)
        return res.json()

    def _request_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Server chunks carry cumulative text; hand out only what is new."""
        with self._client.stream("POST", "/generate", json=body) as res:
            if res.status_code != 200:
                res.read()
                _check(res)
            pos = 0
            for line in res.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(f"server error while streaming: {chunk['error']}")
                text = chunk.get("text", "")
                yield {**chunk, "text": text[pos:]}
                pos = len(text)

    def flush_cache(self) -> bool:
        res = self._client.post("/flush_cache")
        _check(res)
        return True

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def shutdown(self) -> None:
        self._client.close()


def _check(res: httpx.Response) -> None:
    if res.status_code == 200:
        return
    try:
        detail: Any = res.json()
        if isinstance(detail, dict):
            detail = detail.get("error", detail.get("detail", detail))
            if isinstance(detail, dict):
                detail = detail.get("message", detail)
    except ValueError:
        detail = res.text
    if res.status_code == 400:
        raise ValueError(f"server rejected the request: {detail}")
    raise RuntimeError(f"server returned HTTP {res.status_code}: {detail}")
