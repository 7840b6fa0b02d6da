"""The dashboard's routes: the page and its files, and the JSON it reads (scripts may too).

    GET  /dashboard                  the page (files from the package; no network needed)
    GET  /stats                      now, latency percentiles, and the last ten minutes
    GET  /cache_tree                 the radix tree, bounded by max_nodes, edges detokenized
    GET  /cache_tree/node/{node_id}  one node in full: its text, prefix, holders
    POST /cache_match                how much of a prompt the tree holds, without running it

Every engine call runs on a worker thread: it waits for the engine loop to finish its step,
which must not stall the event loop that streams other requests' tokens.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from radix_cache.namespace import token_namespace, untag_token
from sglang_like.server.dashboard.history import StatsHistory
from sglang_like.server.errors import ApiError, dumps, json_response, read_json_body
from sglang_like.server.openapi import json_content, operation
from sglang_like.server.protocol import CacheMatchRequest, parse_model
from sglang_like.server.state import get_state

router = APIRouter()

MAX_NODES_LIMIT = 20_000
_SNAPSHOT_TRIES = 30  # waits of at most 1 s for the engine's snapshot budget
MAX_EDGE_TOKENS = 256
_STATIC = resources.files("sglang_like.server.dashboard") / "static"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# The page loads nothing from elsewhere; the browser is told so, and refuses if it tried.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
_STATIC_FILES = frozenset(p.name for p in _STATIC.iterdir() if p.suffix in _TYPES)


def history_of(request: Request) -> StatsHistory:
    """The app's sampler, started on first use (the app's lifespan starts it at boot)."""
    history: StatsHistory = request.app.state.dashboard_history
    history.start()
    return history


def _untag(node: dict[str, Any], adapters: dict[str, str], *names: str) -> None:
    """A tenant's (or a LoRA adapter's) edges start with a namespaced token
    (radix_cache.namespace): shown as the token it stands for, with `tenant_namespace` set,
    so ids and text read as everywhere, and `lora_adapter` naming the adapter whose KV the
    branch holds (`adapters`: the engine's namespace -> adapter name)."""
    for name in names:
        ids = node.get(name)
        if ids and ids[0] < 0:
            adapter = adapters.get(str(token_namespace(ids[0])))
            node[name] = [untag_token(ids[0]), *ids[1:]]
            node["tenant_namespace"] = True
            if adapter is not None:
                node["lora_adapter"] = adapter


def _vocab_size(request: Request) -> int | None:
    config = getattr(get_state(request).engine, "model_config", None)
    return getattr(config, "vocab_size", None)


def _text(decode: Any, token_ids: list[int], vocab_size: int | None = None) -> str:
    """An edge's text; a run of one image's pad ids (past the vocabulary: an image's tokens,
    multimodal.processor) reads as one "[image ...]" mark naming its pad id and length."""
    if not token_ids:
        return ""
    if vocab_size is None or max(token_ids) < vocab_size:
        return decode(token_ids)
    parts, k = [], 0
    for i in range(1, len(token_ids) + 1):
        # a stretch ends where text meets image or one image meets another
        if i == len(token_ids) or (token_ids[i] != token_ids[i - 1] and max(
                token_ids[i], token_ids[i - 1]) >= vocab_size):
            run = token_ids[k:i]
            parts.append(f"[image {run[0] - vocab_size:x}, {len(run)} tokens]"
                         if run[0] >= vocab_size else run)
            k = i
    # text stretches between images are decoded whole (tokens merge across ids)
    out, text = [], []
    for part in parts:
        if isinstance(part, list):
            text += part
        else:
            if text:
                out.append(decode(text))
                text = []
            out.append(part)
    if text:
        out.append(decode(text))
    return "".join(out)


def _engine_method(request: Request, name: str) -> Any:
    method = getattr(get_state(request).engine, name, None)
    if method is None:
        raise ApiError(404, f"this engine does not expose {name} (no cache to show)")
    return method


def _query_number(request: Request, name: str, default: Any, kind: type, lo: float,
                  hi: float) -> Any:
    """A numeric query parameter in [lo, hi]; a 400 that says so otherwise (not a 422)."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be a number, got {raw!r}", name) from None
    if not lo <= value <= hi:
        raise ApiError(400, f"{name} must be in [{lo:g}, {hi:g}], got {raw}", name)
    return value


# ---- the page ----------------------------------------------------------------------------
_HTML = {"text/html": {"schema": {"type": "string"}}}


@router.get("/dashboard", openapi_extra=operation(ok=_HTML))
async def dashboard(request: Request) -> Response:
    history_of(request)
    return _static_file("index.html")


@router.get("/dashboard/static/{name}", openapi_extra=operation(
    ok={"text/plain": {"schema": {"type": "string"}}}, errors=(401, 404)))
async def dashboard_static(request: Request, name: str) -> Response:
    if name not in _STATIC_FILES:
        raise ApiError(404, f"no dashboard file {name!r}")
    return _static_file(name)


def _static_file(name: str) -> Response:
    path = _STATIC / name
    suffix = "." + name.rsplit(".", 1)[-1]
    return Response(path.read_bytes(), media_type=_TYPES[suffix],
                    headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache",
                             "X-Content-Type-Options": "nosniff"})


# ---- /stats -------------------------------------------------------------------------------
def _with_query(extra: dict[str, Any], *params: tuple[str, dict, str]) -> dict[str, Any]:
    """`operation(...)` plus its query parameters (read by `_query_number`, not by FastAPI,
    so a bad value is our 400, never a 422)."""
    return {**extra, "parameters": [
        {"name": name, "in": "query", "required": False, "schema": schema,
         "description": text} for name, schema, text in params]}


@router.get("/stats", openapi_extra=_with_query(
    operation(ok=json_content({"type": "object"}), errors=(400, 401, 404, 503)),
    ("since", {"type": "number", "minimum": 0, "default": 0},
     "only history samples newer than this wall-clock time (seconds since the epoch)")))
async def stats(request: Request) -> Response:
    """`since`: only samples newer than this wall-clock time (a page polls for what is new)."""
    since = _query_number(request, "since", 0.0, float, 0.0, float("inf"))
    _engine_method(request, "get_stats")
    history = history_of(request)
    latest = history.latest_raw
    if latest is None:  # the sampler has not answered yet: ask now
        await run_in_threadpool(history.sample)
        latest = history.latest_raw
    if latest is None:
        raise ApiError(503, f"the engine did not answer get_stats: {history.error}")
    state = get_state(request)
    latency = dict(latest.get("latency") or {})
    latency["itl"] = state.metrics.itl_window.summary()
    samples = history.since(since)
    return json_response({
        "model": state.served_model_name,
        "server_time": time.time(),
        "interval_s": history.interval_s,
        "error": history.error,
        "now": samples[-1] if samples else (history.since(0.0) or [None])[-1],
        "kv_pool": latest["kv_pool"],
        "counters": {k: latest[k] for k in (
            "num_prompt_tokens", "num_cached_prompt_tokens", "num_generated_tokens",
            "num_forward_steps", "evicted_tokens", "num_tree_nodes", "dashboard_busy_s")},
        "spec_accept_lengths": latest["spec_accept_lengths"],
        "latency": latency,
        "history": samples,
    })


# ---- /cache_tree --------------------------------------------------------------------------
@router.get("/cache_tree", openapi_extra=_with_query(
    operation(ok=json_content({"type": "object"}), errors=(400, 401, 404)),
    ("max_nodes", {"type": "integer", "minimum": 0, "maximum": MAX_NODES_LIMIT, "default": 500},
     "nodes to show: those with the most tokens beneath them"),
    ("edge_tokens", {"type": "integer", "minimum": 0, "maximum": MAX_EDGE_TOKENS,
                     "default": 24}, "leading token ids (and text) of each edge"),
    ("text", {"type": "boolean", "default": True}, "detokenize each edge's tokens")))
async def cache_tree(request: Request) -> Response:
    """The tree: `max_nodes` nodes with the most tokens beneath them (each says what it hides),
    each edge's first `edge_tokens` token ids and, unless `text=false`, their text."""
    max_nodes = _query_number(request, "max_nodes", 500, int, 0, MAX_NODES_LIMIT)
    edge_tokens = _query_number(request, "edge_tokens", 24, int, 0, MAX_EDGE_TOKENS)
    text = request.query_params.get("text", "true").lower() not in ("0", "false", "no")
    method = _engine_method(request, "cache_tree")
    decode = get_state(request).tokenizer.decode
    vocab = _vocab_size(request)
    # the last answer per query, as bytes: an unchanged snapshot is not expanded, detokenized
    # and serialized again (a script polling the whole tree costs the engine one tiny RPC)
    built: dict[tuple, tuple[int, bytes]] = request.app.state.dashboard_trees
    query = (max_nodes, edge_tokens, text)

    def build() -> bytes:
        from radix_cache.snapshot import expand

        known = built.get(query)
        for _ in range(_SNAPSHOT_TRIES):
            tree = method(max_nodes=max_nodes, edge_tokens=edge_tokens, rows=True,
                          known_id=known[0] if known else None)
            if "retry_after" not in tree:
                break
            # the engine's snapshot budget is spent: wait for it here, on this worker thread
            time.sleep(min(float(tree["retry_after"]), 1.0))
        else:
            raise ApiError(503, "the cache snapshot budget is spent; retry", "max_nodes")
        if tree.get("unchanged") and known is not None:
            return known[1]
        adapters = tree.pop("lora_namespaces", None) or {}
        tree = expand(tree)
        for node in tree["nodes"]:
            _untag(node, adapters, "token_ids")
        if text:
            for node in tree["nodes"]:
                node["text"] = _text(decode, node["token_ids"], vocab)
                node["text_truncated"] = node["tokens"] > len(node["token_ids"])
        body = dumps(tree).encode()
        if len(built) > 16:
            built.clear()
        built[query] = (tree["snapshot_id"], body)
        return body

    body = await run_in_threadpool(build)
    return Response(body, media_type="application/json")


@router.get("/cache_tree/node/{node_id}", openapi_extra=operation(
    ok=json_content({"type": "object"}), errors=(401, 404)))
async def cache_node(request: Request, node_id: str) -> Response:
    try:
        node_id = int(node_id)
    except ValueError:
        raise ApiError(404, f"no node {node_id!r} in the cache (ids are integers)") from None
    method = _engine_method(request, "cache_node")
    decode = get_state(request).tokenizer.decode
    vocab = _vocab_size(request)

    def build() -> dict[str, Any] | None:
        node = method(node_id)
        if node is not None:
            _untag(node, node.pop("lora_namespaces", None) or {}, "token_ids",
                   "prefix_token_ids")
            node["text"] = _text(decode, node["token_ids"], vocab)
            node["prefix_text"] = _text(decode, node["prefix_token_ids"], vocab)
        return node

    node = await run_in_threadpool(build)
    if node is None:
        raise ApiError(404, f"no node {node_id} in the cache (evicted, or never there)")
    return json_response(node)


# ---- /cache_match -------------------------------------------------------------------------
@router.post("/cache_match", openapi_extra=operation(
    body=CacheMatchRequest, ok=json_content({"type": "object"}), errors=(400, 401, 404)))
async def cache_match(request: Request) -> Response:
    body = parse_model(CacheMatchRequest, await read_json_body(request))
    method = _engine_method(request, "cache_match")
    tokenizer = get_state(request).tokenizer

    def build() -> dict[str, Any]:
        if body.input_ids is not None:
            ids = body.input_ids
            vocab = tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise ApiError(400, f"input_ids must be integers in [0, {vocab})", "input_ids")
        else:
            prompt = body.text
            if body.messages is not None:
                if not getattr(tokenizer, "chat_template", None):
                    raise ApiError(400, "this model has no chat template; send text")
                prompt = tokenizer.apply_chat_template(
                    [m.model_dump() for m in body.messages], add_generation_prompt=True)
            ids = list(tokenizer.encode(prompt))
        view = method(ids)
        matched = view["matched_tokens"]
        view["matched_text"] = tokenizer.decode(ids[:matched]) if matched else ""
        view["rest_text"] = tokenizer.decode(ids[matched:]) if matched < len(ids) else ""
        return view

    return json_response(await run_in_threadpool(build))
