"""A Responses API answer's output items (reasoning, message, function_call) as they are
written, and the SSE events that write them, each with a sequence_number (the order is in
responses.py's docstring). A whole answer is written the same way, its events unsent, so a
streamed and a whole answer hold the same items.

Apart from the routes (responses.py): it knows the items and the events, not the request,
the engine or the chat path.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from sglang_like.server.errors import dumps


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """A response's output items as they are written, and the SSE events that write them
    (a whole answer is written the same way, its events unsent)."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the last item, until it is done
        self._num_events = 0

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._num_events, **fields}
        self._num_events += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n"

    def start(self) -> list[str]:
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    def reasoning(self, delta: str) -> list[str]:
        out = self._part_item("reasoning")
        return out + self._text_delta("response.reasoning_text.delta", delta)

    def text(self, delta: str) -> list[str]:
        out = self._part_item("message")
        return out + self._text_delta("response.output_text.delta", delta, logprobs=[])

    def call(self, call_id: str, name: str) -> list[str]:
        return self._begin({"id": new_id("fc"), "type": "function_call",
                            "status": "in_progress", "call_id": call_id, "name": name,
                            "arguments": ""})

    def arguments(self, delta: str) -> list[str]:
        item = self._open
        assert item is not None and item["type"] == "function_call"
        item["arguments"] += delta
        return [self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=len(self.items) - 1, delta=delta)]

    def chat_delta(self, delta: dict[str, Any]) -> list[str]:
        """The items' events for one of the chat path's deltas ({"content": text} or
        {"tool_calls": [...]}, a call's first delta carrying its id and name)."""
        out = self.text(delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                out += self.call(call["id"], function.get("name", ""))
            if function.get("arguments"):
                out += self.arguments(function["arguments"])
        return out

    def finish(self, meta: dict[str, Any], num_reasoning_tokens: int) -> list[str]:
        """Close the items (an empty message when there were none) and complete the
        response: incomplete when max_output_tokens ended it."""
        is_cut = (meta.get("finish_reason") or {}).get("type") == "length"
        status = "incomplete" if is_cut else "completed"
        out = [] if self.items else self._part_item("message")
        out += self._close(status)
        num_in, num_out = int(meta.get("prompt_tokens", 0)), int(meta.get("completion_tokens", 0))
        self.response.update(
            status=status, output=self.items,
            incomplete_details={"reason": "max_output_tokens"} if is_cut else None,
            usage={"input_tokens": num_in,
                   "input_tokens_details": {"cached_tokens": int(meta.get("cached_tokens", 0))},
                   "output_tokens": num_out,
                   "output_tokens_details": {"reasoning_tokens": min(num_reasoning_tokens,
                                                                     num_out)},
                   "total_tokens": num_in + num_out})
        kind = "response.incomplete" if is_cut else "response.completed"
        return out + [self.event(kind, response=self.response)]

    def failed(self, status_code: int, message: str) -> str:
        """The events of a failure after the stream began (sse_response's error_event)."""
        code = "server_error" if status_code >= 500 else "invalid_prompt"
        self.response.update(status="failed", output=self.items,
                             error={"code": code, "message": message})
        return (self.event("error", code=code, message=message, param=None)
                + self.event("response.failed", response=self.response))

    def _begin(self, item: dict[str, Any]) -> list[str]:
        out = self._close("completed")
        self.items.append(item)
        self._open = item
        return out + [self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=item)]

    def _part_item(self, kind: Literal["message", "reasoning"]) -> list[str]:
        """Open a message (or reasoning) item with its one text part, unless it is open."""
        if self._open is not None and self._open["type"] == kind:
            return []
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        out = self._begin(item)
        out.append(self.event("response.content_part.added", item_id=item["id"],
                              output_index=len(self.items) - 1, content_index=0, part=part))
        item["content"].append(part)
        return out

    def _text_delta(self, kind: str, delta: str, **extra: Any) -> list[str]:
        item = self._open
        assert item is not None
        item["content"][0]["text"] += delta
        return [self.event(kind, item_id=item["id"], output_index=len(self.items) - 1,
                           content_index=0, delta=delta, **extra)]

    def _close(self, status: str) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            out = [self.event("response.function_call_arguments.done", **where,
                              name=item["name"], arguments=item["arguments"])]
        else:
            part = item["content"][0]
            if item["type"] == "message":
                out = [self.event("response.output_text.done", **where, content_index=0,
                                  text=part["text"], logprobs=[])]
            else:
                out = [self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=part["text"])]
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=part))
        item["status"] = status
        return out + [self.event("response.output_item.done", output_index=where[
            "output_index"], item=item)]
