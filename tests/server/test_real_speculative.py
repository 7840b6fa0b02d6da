"""A real server with speculative decoding on: SGLang's switches on the command line,
spec_verify_ct in meta_info, the acceptance histogram on /metrics, the official openai client
streaming and not, and the same greedy text as without speculation (the EAGLE-3 head that
ships with the project)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

PROMPT = ("<|im_start|>user\nRepeat this line exactly: the red fox, the red fox, the red fox, "
          "the red fox.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("algo", ["EAGLE3", "EAGLE3-head", "NGRAM"])
def test_server_speculates_and_reports_it(server_launcher: Any, real_server: Any,
                                          algo: str) -> None:
    # EAGLE3-head: the head's drafts alone, without NGRAM's branch (on by default)
    branch = [] if algo != "EAGLE3-head" else ["--disable-speculative-eagle-ngram-branch"]
    algo = algo.removesuffix("-head")
    spec = server_launcher("--speculative-algorithm", algo, "--speculative-num-steps", "3",
                           "--disable-speculative-auto-disable", "--max-running-requests", "8",
                           *branch)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 32, "temperature": 0}}
    got = httpx.post(spec.url + "/generate", json=body, timeout=300).json()
    want = httpx.post(real_server.url + "/generate", json=body, timeout=300).json()
    assert got["text"] == want["text"]
    meta = got["meta_info"]
    assert 0 < meta["spec_verify_ct"] < meta["completion_tokens"], meta  # some drafts accepted
    info = httpx.get(spec.url + "/get_server_info", timeout=30).json()
    assert info["speculative_algorithm"] == algo
    assert info["speculative_eagle_ngram_branch"] is not bool(branch)
    assert sum(v for k, v in info["spec_accept_lengths"].items() if int(k) > 1) > 0
    client = openai.OpenAI(base_url=spec.url + "/v1", api_key="unused", timeout=300)
    msgs = [{"role": "user", "content": "Say the alphabet from a to j, comma separated."}]
    full = client.chat.completions.create(model="default", messages=msgs, max_tokens=40,
                                          temperature=0)
    chunks = client.chat.completions.create(model="default", messages=msgs, max_tokens=40,
                                            temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    metrics = httpx.get(spec.url + "/metrics", timeout=30).text
    count = [line for line in metrics.splitlines()
             if line.startswith("sglang_like_spec_accept_length_count")]
    assert count and float(count[0].split()[-1]) >= 1, count
    server_launcher.stop(spec)
