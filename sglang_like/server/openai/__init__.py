"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter

from sglang_like.server.openai import chat, completions, models

router = APIRouter()
for _module in (models, completions, chat):
    router.include_router(_module.router)
