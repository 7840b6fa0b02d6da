"""GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.server.errors import json_response
from sglang_like.server.openai import format as fmt
from sglang_like.server.openapi import json_content, operation
from sglang_like.server.state import get_state

router = APIRouter(prefix="/v1")


@router.get("/models", openapi_extra=operation(
    ok=json_content({"$ref": "#/components/schemas/ModelList"})
))
async def list_models(request: Request) -> Response:
    state = get_state(request)
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": fmt.now(),
        "owned_by": "sglang_like",
        "root": state.model_path,
        "max_model_len": state.context_length,
    }
    return json_response({"object": "list", "data": [card]})
