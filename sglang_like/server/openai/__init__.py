"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings
(and SGLang's /encode beside it)."""

from __future__ import annotations

from fastapi import APIRouter

from sglang_like.server.openai import chat, completions, embeddings, models

router = APIRouter()
for _module in (models, completions, chat, embeddings):
    router.include_router(_module.router)
