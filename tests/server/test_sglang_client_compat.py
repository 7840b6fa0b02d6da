"""SGLang's own frontend client (`RuntimeEndpoint`) against our server, unchanged.

Needs `pip install --no-deps sglang` plus the few modules its import chain touches
(aiohttp, requests, orjson, psutil, pybase64, pillow, msgspec, pyzmq); where those are not
installed this file is skipped, and the same request shapes are covered by test_real_server.py.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.slow
runtime_endpoint = pytest.importorskip("sglang.lang.backend.runtime_endpoint")
sgl = pytest.importorskip("sglang")


def test_runtime_endpoint_gen_select_stream(real_server: Any) -> None:
    backend = runtime_endpoint.RuntimeEndpoint(real_server.url)
    assert backend.get_model_name().endswith(".gguf")
    assert "kv_pool" in backend.get_server_info()

    @sgl.function
    def qa(s: Any, question: str) -> None:
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=6, temperature=0, stop="\n")
        s += "\nIs that right? Reply yes or no:"
        s += sgl.select("verdict", choices=[" yes", " no"])

    state = qa.run(question="What is the capital of France?", backend=backend)
    assert isinstance(state["answer"], str)
    assert state["verdict"] in (" yes", " no")
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] <= 6 and meta["prompt_tokens"] > 0

    @sgl.function
    def story(s: Any) -> None:
        s += "Once upon a time"
        s += sgl.gen("rest", max_tokens=6, temperature=0)

    streamed = story.run(backend=backend, stream=True)
    pieces = list(streamed.text_iter("rest"))
    assert "".join(pieces) == streamed["rest"]
    plain = story.run(backend=backend)
    assert plain["rest"] == streamed["rest"]

    backend.flush_cache()
