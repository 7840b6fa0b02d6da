"""Start the server, then talk to it three ways: native /generate, streaming, and the OpenAI client.

    python examples/server_client.py            # starts a server on a free port, then stops it
    python examples/server_client.py --url http://127.0.0.1:30000   # use a running server
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time

import httpx


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_like.launch_server", "--port", str(port),
         "--log-level", "warning"]
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start")


def demo(url: str) -> None:
    # 1. native API
    r = httpx.post(url + "/generate", json={
        "text": "The three primary colors are",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0},
    }, timeout=120)
    r.raise_for_status()
    out = r.json()
    print("native:", repr(out["text"]), out["meta_info"]["finish_reason"])

    # 2. native streaming (each event carries the cumulative text)
    print("stream: ", end="")
    shown = ""
    with httpx.stream("POST", url + "/generate", timeout=120, json={
        "text": "List three fruits:", "stream": True,
        "sampling_params": {"max_new_tokens": 16, "temperature": 0},
    }) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text = json.loads(line[6:])["text"]
                print(text[len(shown):], end="", flush=True)
                shown = text
    print()

    # 3. OpenAI-compatible chat, with the official client
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is 2 + 2?"}],
        max_tokens=24, temperature=0,
    )
    print("chat:", repr(chat.choices[0].message.content))
    print("usage:", chat.usage.model_dump())
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    print("kv_pool:", info["kv_pool"], "cache hit rate:", round(info["cache_hit_rate"], 3))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default=None, help="a running server; default: start one")
    args = parser.parse_args()
    if args.url:
        demo(args.url.rstrip("/"))
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = start_server(port)
    try:
        demo(f"http://127.0.0.1:{port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        print("server exited with", proc.wait(timeout=60))


if __name__ == "__main__":
    main()
