"""The Responses API's kept responses (store: true): a bounded LRU in memory, one per app,
each response readable only by the tenant that made it. GET and DELETE /v1/responses/{id} and
previous_response_id reach them through `find_kept`.

Apart from the routes (responses.py): it is state with its own bounds, and is tested alone.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from sglang_like.server.auth import principal_of
from sglang_like.server.errors import ApiError

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 << 20  # the kept conversations' JSON text, summed per response


@dataclass(frozen=True)
class KeptResponse:
    owner: str | None  # the tenant that made it: no other may read it
    response: dict[str, Any]
    conversation: tuple[Any, ...]  # the items a next turn continues from (input + output)
    num_chars: int


class ResponseStore:
    """Responses kept for GET and previous_response_id. The least recently used are dropped
    once there are more than `max_responses`, or once the kept conversations pass `max_chars`
    (counted per response, so a conversation's earlier turns count again in each response
    that continues it: the memory stays under the cap)."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES,
                 max_chars: int = MAX_STORED_CHARS) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._kept: OrderedDict[str, KeptResponse] = OrderedDict()
        self.num_chars = 0

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response_id: str, kept: KeptResponse) -> None:
        self.delete(kept.owner, response_id)
        self._kept[response_id] = kept
        self.num_chars += kept.num_chars
        while len(self._kept) > self.max_responses or (
                self.num_chars > self.max_chars and len(self._kept) > 1):
            _, dropped = self._kept.popitem(last=False)
            self.num_chars -= dropped.num_chars

    def get(self, owner: str | None, response_id: str) -> KeptResponse | None:
        kept = self._kept.get(response_id)
        if kept is None or kept.owner != owner:
            return None
        self._kept.move_to_end(response_id)
        return kept

    def delete(self, owner: str | None, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        self.num_chars -= self._kept.pop(response_id).num_chars
        return True


def response_store(request: Request) -> ResponseStore:
    """The app's store, made on first use (an app serves one engine, one store)."""
    state = request.app.state
    store = getattr(state, "responses_store", None)
    if store is None:
        store = state.responses_store = ResponseStore()
    return store


def find_kept(request: Request, response_id: str, param: str | None = None) -> KeptResponse:
    """The caller's tenant's kept response `response_id`; 404 where there is none."""
    kept = response_store(request).get(principal_of(request.scope).tenant, response_id)
    if kept is None:
        raise ApiError(404, f"response {response_id!r} not found (made with store: false, "
                            "deleted, or dropped from the server's memory)", param)
    return kept
