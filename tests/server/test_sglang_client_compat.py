"""SGLang's own frontend client (`RuntimeEndpoint`) against our server, unchanged.

The test set-up installs `sglang` with --no-deps (its runtime would pull a CUDA torch) and the
few modules its frontend's import chain touches (the `test` extra of pyproject.toml).
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.slow
import sglang as sgl  # noqa: E402
from sglang.lang.backend import runtime_endpoint  # noqa: E402


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
