"""GET /v1/models: the served model, then each loaded LoRA adapter as a model of its own
(vLLM's cards: the adapter's name as id, its folder as root, the base model as parent)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.server.errors import json_response
from sglang_like.server.lora_api import list_adapters
from sglang_like.server.openai import format as fmt
from sglang_like.server.openapi import json_content, operation
from sglang_like.server.state import get_state

router = APIRouter(prefix="/v1")


@router.get("/models", openapi_extra=operation(
    ok=json_content({"$ref": "#/components/schemas/ModelList"})
))
async def list_models(request: Request) -> Response:
    state = get_state(request)
    created = fmt.now()
    cards = [_card(state.served_model_name, created, state.model_path, None,
                   state.context_length)]
    for adapter in await list_adapters(state):
        cards.append(_card(adapter["name"], created, adapter["path"], state.served_model_name,
                           state.context_length))
    return json_response({"object": "list", "data": cards})


def _card(name: str, created: int, root: str, parent: str | None,
          context_length: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "sglang_like",
            "root": root, "parent": parent, "max_model_len": context_length}
