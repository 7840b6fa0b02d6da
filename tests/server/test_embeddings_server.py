"""/v1/embeddings and /encode on the real server (the default model, embeddings on demand
beside generation) with the official openai client: base64 (its default) and float vectors
equal /encode's, token-id input, usage; unserved options are 400s naming them."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import openai
import pytest

TEXTS = ["The capital of France is", "def fibonacci(n):"]


def test_openai_embeddings_equal_encode_and_are_unit_vectors(real_server: Any) -> None:
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="none")
    native = httpx.post(real_server.url + "/encode", json={"text": TEXTS}, timeout=60).json()
    assert len(native) == 2
    default = client.embeddings.create(model="x", input=TEXTS)  # the client asks for base64
    floats = client.embeddings.create(model="x", input=TEXTS, encoding_format="float")
    for k in range(2):
        want = np.array(native[k]["embedding"], dtype=np.float32)
        assert want.shape == (576,) and abs(np.linalg.norm(want) - 1) < 1e-4
        # the same computation (both find the prompt cached but its last token) decoded from
        # base64 and from JSON floats
        np.testing.assert_allclose(default.data[k].embedding, floats.data[k].embedding,
                                   atol=1e-7)
        # /encode's came from a whole prefill; the int4 model's bf16 activations round a
        # one-row extend differently (--enable-deterministic-inference would make it equal)
        assert float(np.dot(floats.data[k].embedding, want)) > 0.999
    assert not np.allclose(default.data[0].embedding, default.data[1].embedding)
    assert floats.usage.prompt_tokens == sum(n["meta_info"]["prompt_tokens"] for n in native)
    ids = httpx.post(real_server.url + "/tokenize", json={"prompt": TEXTS[0]},
                     timeout=30).json()["tokens"]
    by_ids = client.embeddings.create(model="x", input=ids, encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, floats.data[0].embedding, atol=1e-6)


@pytest.mark.parametrize(("body", "message"), [
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "user": "me"}, "user"),
    ({"input": []}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_unserved_embedding_options_are_400(real_server: Any, body: dict, message: str
                                            ) -> None:
    r = httpx.post(real_server.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400 and message in r.text, r.text
