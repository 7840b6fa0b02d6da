"""Prefill/decode disaggregation routes: a worker's role, switched at run time.

`POST /switch_disaggregation_mode {"mode": "prefill" | "decode" | "null", "bootstrap_port":
P, "drain_timeout": S}` waits (up to S seconds) until the worker has no transfer of its
current role in flight, then switches without reloading the model. Take the worker out of
the router first (sglang_like.disaggregation.switch_role does both).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from sglang_like.config import DISAGGREGATION_MODES
from sglang_like.server.errors import ApiError, json_response, read_json_body
from sglang_like.server.openapi import json_content, operation
from sglang_like.server.protocol import SwitchModeRequest, parse_model
from sglang_like.server.state import get_state

router = APIRouter()


@router.post("/switch_disaggregation_mode", openapi_extra=operation(
    body=SwitchModeRequest, ok=json_content({"type": "object"}), errors=(400, 401, 403, 409),
))
async def switch_disaggregation_mode(request: Request) -> Response:
    state = get_state(request)
    if not state.server_args.enable_disaggregation_mode_switch:
        # a switch registers the whole KV pool with the transfer engine and binds a port:
        # only a worker started for it (behind a private network) may be switched
        raise ApiError(403, "this worker was not started with "
                            "--enable-disaggregation-mode-switch")
    body = parse_model(SwitchModeRequest, await read_json_body(request))
    if body.mode not in DISAGGREGATION_MODES:
        raise ApiError(400, f"mode must be one of {', '.join(DISAGGREGATION_MODES)}", "mode")
    switch = getattr(state.engine, "switch_disaggregation_mode", None)
    if switch is None:
        raise ApiError(400, "this engine cannot change its disaggregation mode")
    try:
        result: dict[str, Any] = await run_in_threadpool(
            switch, body.mode, body.bootstrap_port, float(body.drain_timeout))
    except (ValueError, RuntimeError) as exc:  # e.g. the bootstrap port is taken
        raise ApiError(400, f"could not switch: {exc}") from None
    if not result.get("switched"):
        raise ApiError(409, f"transfers still in flight after {body.drain_timeout:g} s: "
                            f"{result.get('num_inflight')}; retry")
    return json_response(result)
