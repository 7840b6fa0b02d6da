"""The HTTP process stays free of torch: tokenizer, templates, validation, grammars' JSON and
the dashboard need none of it, and the model lives in the engine-core process. (torch is
about 190 MB of the HTTP process's RSS and a second of its start.)"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_importing_the_server_does_not_import_torch() -> None:
    code = ("import sys, sglang_like, sglang_like.launch_server, sglang_like.engine; "
            "from sglang_like.server import create_app; "
            "from sglang_like.engine_core.client import ProcessCoreClient; "
            "from sglang_like.model_loader import load_tokenizer; load_tokenizer(); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.slow
def test_serving_process_has_no_torch_mapped(real_server: Any) -> None:
    """After plain, constrained, tool-calling, logprob and dashboard requests, libtorch is
    mapped in the engine process only."""
    url = real_server.url
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    calls = [
        ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "regex": "[0-9]+"},
                       "return_logprob": True, "top_logprobs_num": 2}),
        ("/v1/chat/completions", {"model": "m", "max_tokens": 16, "messages": [
            {"role": "user", "content": "a number"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}),
        ("/v1/chat/completions", {"model": "m", "max_tokens": 24, "tool_choice": "required",
                                  "messages": [{"role": "user", "content": "weather?"}],
                                  "tools": [{"type": "function", "function": {
                                      "name": "weather", "parameters": schema}}]}),
        ("/cache_match", {"text": "Hi"}),
    ]
    for path, body in calls:
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, (path, r.text)
    assert httpx.get(url + "/cache_tree", timeout=60).status_code == 200
    engine_pid = httpx.get(url + "/get_server_info", timeout=60).json()["engine_pid"]
    assert engine_pid != real_server.proc.pid
    assert "libtorch_cpu" in _maps(engine_pid)
    assert "libtorch_cpu" not in _maps(real_server.proc.pid)
