"""The dashboard, for real: the default model behind --api-key on loopback, Debian's Chromium
driven by Playwright with the network blocked. Requests that share a system prompt must show
up as one shared tree node with that prompt's token count, and move the hit-rate chart; the
JSON endpoints answer scripts; nothing works without the key.

A screenshot of the page is saved under $SGLANG_LIKE_TEST_ARTIFACTS (default:
test-artifacts/ in the repository) as dashboard.png.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow


CHROMIUM = "/usr/bin/chromium"
API_KEY = "dash-test-key"
SYSTEM = ("You are the concierge of the Hotel Miramar in Lisbon. Answer guests in one short, "
          "friendly sentence, and mention the rooftop bar when it fits.")
QUESTIONS = ["When is breakfast served?", "Is there parking nearby?",
             "Can I check in early?", "Where is the nearest metro?"]
ARTIFACTS = Path(os.environ.get("SGLANG_LIKE_TEST_ARTIFACTS",
                                Path(__file__).resolve().parents[2] / "test-artifacts"))
# Chromium as the probe of this machine ran it: no sandbox (root), and none of the background
# connections a closed network refuses; every host name but loopback resolves to nothing.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]


@pytest.fixture(scope="module")
def server(module_server_launcher: Any) -> Any:
    # the dashboard is the operator's: the server's one key is its admin key (from the
    # environment, as a key should come), which also serves the chats here
    server = module_server_launcher("--max-running-requests", "8", "--max-total-tokens", "8192",
                                    env={"SGLANG_LIKE_ADMIN_API_KEY": API_KEY})
    server.api_key = API_KEY
    return server


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from sglang_like.model_loader import load_tokenizer

    return load_tokenizer()


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _shared_prefix_len(tokenizer: Any) -> int:
    rows = [tokenizer.encode(tokenizer.apply_chat_template(_messages(q),
                                                           add_generation_prompt=True))
            for q in QUESTIONS]
    n = 0
    while all(len(r) > n and r[n] == rows[0][n] for r in rows):
        n += 1
    return n


def _chat(server: Any, question: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=120,
                   json={"model": "m", "messages": _messages(question), "max_tokens": 8,
                         "temperature": 0})
    assert r.status_code == 200, r.text


def _wait_for(page: Any, script: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = page.evaluate(script)
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for: {script}"
        time.sleep(0.2)


def test_page_shows_the_shared_prefix_and_the_hit_rate_moves(server, tokenizer):
    from playwright.sync_api import sync_playwright

    shared = _shared_prefix_len(tokenizer)
    assert shared > 30  # the system turn and the start of the user turn
    requests_seen: list[str] = []
    console_errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(
            viewport={"width": 1400, "height": 1600},
            http_credentials={"username": "dashboard", "password": API_KEY})
        page = context.new_page()
        page.on("request", lambda req: requests_seen.append(req.url))
        page.on("console", lambda msg: msg.type == "error" and console_errors.append(msg.text))
        page.on("pageerror", lambda exc: console_errors.append(str(exc)))
        page.goto(server.url + "/dashboard")
        _wait_for(page, "document.getElementById('status').dataset.state === 'live'")
        before = json.loads(_wait_for(
            page, "document.getElementById('chart-hit').dataset.last || ''"))
        assert before["hit_rate_total"] is None  # a fresh server: no prompt seen yet

        for question in QUESTIONS:  # the first computes the system prompt, the rest reuse it
            _chat(server, question)

        # the tree shows one node of exactly the shared length, hit by the three later requests
        # (the page polls: the node can first show up from a snapshot taken before the last
        # request's hit, so wait for the hits of every request; 30 s bound as elsewhere)
        selector = f"#tree .node[data-tokens='{shared}']"
        want = len(QUESTIONS) - 1
        _wait_for(page, f"(() => {{ const g = document.querySelector(\"{selector}\"); "
                        f"return g !== null && Number(g.dataset.hits) >= {want}; }})()")
        hits, node_state = page.evaluate(
            f"(() => {{ const g = document.querySelector(\"{selector}\"); "
            "return [Number(g.dataset.hits), g.dataset.state]; })()")
        assert hits >= len(QUESTIONS) - 1
        assert node_state in ("evictable", "locked")
        branches = page.evaluate(
            f"[...document.querySelectorAll('#tree .node')].filter(g => g.dataset.tokens !== "
            f"'{shared}' && g.dataset.state !== 'root').length")
        assert branches >= len(QUESTIONS)  # one branch per question at least

        # clicking it shows its full text and token count (paused: no re-render under the click)
        page.check("#tree-pause")
        time.sleep(0.1)
        page.click(selector)
        _wait_for(page, "document.getElementById('node-text') !== null")
        assert SYSTEM in page.inner_text("#node-text")
        assert page.inner_text("#node-detail dd[data-fact='tokens']") == str(shared)

        # the hit-rate chart moved: the rate since start is now above zero
        after = json.loads(_wait_for(
            page, "(() => { const d = JSON.parse(document.getElementById('chart-hit').dataset"
                  ".last || '{}'); return d.hit_rate_total > 0 ? JSON.stringify(d) : ''; })()"))
        assert after["hit_rate_total"] > 0
        assert int(page.get_attribute("#chart-hit", "data-points")) >= 2
        assert page.inner_text("#v-hit").endswith("%")

        # the prefix-match view finds the shared part of a new question, without running it
        page.check("input[name='match-mode'][value='chat']")
        page.fill("#match-input", json.dumps(_messages("Do you have a gym?")))
        page.click("#match-run")
        _wait_for(page, "document.getElementById('match-result').dataset.matched !== undefined")
        matched = int(page.get_attribute("#match-result", "data-matched"))
        assert matched >= shared
        assert SYSTEM in page.inner_text("#match-result mark")

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        browser.close()

    # offline: every request the page made went to this server, and nothing was refused
    assert requests_seen and all(u.startswith(server.url + "/") or u.startswith("data:")
                                 for u in requests_seen), requests_seen
    assert not console_errors, console_errors
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


def test_json_endpoints_for_scripts(server, tokenizer):
    headers = server.headers
    for question in QUESTIONS[:2]:
        _chat(server, question)
    tree = httpx.get(server.url + "/cache_tree", headers=headers).json()
    assert tree["num_nodes"] >= 3 and tree["eviction_policy"] == "lru"
    root, *nodes = tree["nodes"]
    assert root["parent"] is None and root["subtree_tokens"] == tree["total_tokens"]
    assert sum(n["tokens"] for n in nodes) == tree["total_tokens"]  # all shown, none hidden
    shared = _shared_prefix_len(tokenizer)
    top = next(n for n in nodes if n["tokens"] == shared)
    assert top["text"] == tokenizer.decode(top["token_ids"]) and top["text_truncated"]
    # max_nodes bounds the answer, and says what it left out
    small = httpx.get(server.url + "/cache_tree?max_nodes=1&edge_tokens=4",
                      headers=headers).json()
    assert small["shown_nodes"] == 1 and small["truncated"] and len(small["nodes"]) == 2
    assert len(small["nodes"][1]["token_ids"]) == 4 and small["nodes"][1]["hidden_children"] > 0
    for bad in ("max_nodes=-1", "max_nodes=abc", "edge_tokens=9999", "max_nodes=20001"):
        r = httpx.get(server.url + "/cache_tree?" + bad, headers=headers)
        assert r.status_code == 400 and "must be" in r.json()["error"]["message"], (bad, r.text)
    # one node in full
    detail = httpx.get(f"{server.url}/cache_tree/node/{top['id']}", headers=headers).json()
    assert detail["tokens"] == shared and SYSTEM in detail["text"]
    assert detail["prefix_text"] == detail["text"]  # the root's child: its prefix is itself
    for missing in ("987654321", "x"):
        r = httpx.get(f"{server.url}/cache_tree/node/{missing}", headers=headers)
        assert r.status_code == 404 and "no node" in r.json()["error"]["message"]
    # prefix match, in three forms; a hit is not counted and nothing runs
    # the engine's own counter, now (/stats gives the 1 Hz sampler's, up to a second old)
    prompt_tokens_before = httpx.get(server.url + "/get_server_info",
                                     headers=headers).json()["num_prompt_tokens"]
    ids = tokenizer.encode(tokenizer.apply_chat_template(_messages("Any vegan options?"),
                                                         add_generation_prompt=True))
    by_ids = httpx.post(server.url + "/cache_match", headers=headers,
                        json={"input_ids": ids}).json()
    by_messages = httpx.post(server.url + "/cache_match", headers=headers,
                             json={"messages": _messages("Any vegan options?")}).json()
    assert by_ids["matched_tokens"] == by_messages["matched_tokens"] >= shared
    assert by_ids["num_tokens"] == len(ids) and by_ids["path"][0]["id"] == top["id"]
    assert by_ids["reusable_tokens"] == by_ids["matched_tokens"]
    by_text = httpx.post(server.url + "/cache_match", headers=headers,
                         json={"text": "Completely unrelated text"}).json()
    assert by_text["matched_tokens"] == 0 and by_text["path"] == []
    assert by_text["rest_text"] == "Completely unrelated text"
    assert httpx.get(f"{server.url}/cache_tree/node/{top['id']}",
                     headers=headers).json()["hit_count"] == detail["hit_count"]
    prompt_tokens_after = httpx.get(server.url + "/get_server_info",
                                    headers=headers).json()["num_prompt_tokens"]
    assert prompt_tokens_after == prompt_tokens_before
    for bad in ({}, {"text": "a", "input_ids": [1]}, {"input_ids": [-1]},
                {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]}):
        r = httpx.post(server.url + "/cache_match", headers=headers, json=bad)
        assert r.status_code == 400, (bad, r.text)


def test_stats_endpoint(server):
    headers = server.headers
    _chat(server, QUESTIONS[0])
    deadline = time.monotonic() + 12  # a sample after it, and a latency summary (every 5 s)
    while True:
        time.sleep(0.5)
        stats = httpx.get(server.url + "/stats", headers=headers).json()
        if stats["latency"]["ttft"] or time.monotonic() > deadline:
            break
    pool = stats["kv_pool"]
    assert pool["total_slots"] == 8192
    assert pool["free_slots"] + pool["evictable_slots"] + pool["used_slots"] == 8192
    # the pool's element type and bytes a token, as /get_server_info says them
    info = httpx.get(server.url + "/get_server_info", headers=headers).json()
    assert pool["dtype"] == info["kv_cache_dtype"] == "bfloat16"
    assert pool["bytes_per_slot"] == info["kv_pool"]["bytes_per_slot"] == 30 * 3 * 64 * 2 * 2
    assert stats["counters"]["num_cached_prompt_tokens"] > 0
    assert stats["latency"]["ttft"]["count"] >= 1 and stats["latency"]["e2e"]["p50"] > 0
    history = stats["history"]
    times = [s["t"] for s in history]
    assert len(times) >= 2 and times == sorted(set(times))
    assert max(s["tokens_per_s"] for s in history) > 0
    assert any(s["hit_rate"] for s in history if s["hit_rate"] is not None)
    newer = httpx.get(f"{server.url}/stats?since={history[-2]['t']}", headers=headers).json()
    assert [s["t"] for s in newer["history"]][:1] == [history[-1]["t"]]
    assert httpx.get(server.url + "/stats?since=soon", headers=headers).status_code == 400


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/dashboard"), ("GET", "/dashboard/static/dashboard.js"), ("GET", "/stats"),
    ("GET", "/cache_tree"), ("GET", "/cache_tree/node/1"), ("POST", "/cache_match"),
])
def test_everything_needs_the_key(server, method, path):
    url = server.url + path
    body = {"text": "hi"} if method == "POST" else None
    for headers in ({}, {"Authorization": "Bearer wrong"},
                    {"Authorization": "Basic " + base64.b64encode(b"u:wrong").decode()}):
        r = httpx.request(method, url, json=body, headers=headers)
        assert r.status_code == 401, (path, headers, r.status_code)
        assert "Basic" in r.headers["www-authenticate"]  # a browser asks for the key
    good = ({"Authorization": f"Bearer {API_KEY}"},
            {"Authorization": "Basic " + base64.b64encode(f"me:{API_KEY}".encode()).decode()})
    for headers in good:
        r = httpx.request(method, url, json=body, headers=headers)
        assert r.status_code in (200, 404), (path, r.status_code)  # node 1 may be gone
        assert r.status_code == 200 or path.startswith("/cache_tree/node/")
    assert httpx.get(server.url + "/health").status_code == 200  # the one open route


def test_page_files_are_self_contained(server):
    """The page and its files name no other origin: no CDN, no font service."""
    headers = server.headers
    page = httpx.get(server.url + "/dashboard", headers=headers)
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name in ("dashboard.js", "dashboard.css"):
        text = httpx.get(f"{server.url}/dashboard/static/{name}", headers=headers).text
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in text
    assert "https://" not in page.text and "http://" not in page.text.replace(
        "http://www.w3.org/2000/svg", "")
    r = httpx.get(server.url + "/dashboard/static/..%2Fhistory.py", headers=headers)
    assert r.status_code == 404


def test_cache_report_example(server):
    """examples/dashboard/cache_report.py reads the same endpoints and reports the prefix."""
    import subprocess

    script = Path(__file__).resolve().parents[2] / "examples" / "dashboard" / "cache_report.py"
    out = subprocess.run(
        [sys.executable, str(script), "--url", server.url, "--api-key", API_KEY,
         "--system", SYSTEM, "--prompt", "nothing like it"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "largest cached prefixes" in out.stdout and "hit rate" in out.stdout
    chat = next(line for line in out.stdout.splitlines() if line.startswith("chat:"))
    assert int(chat.split()[1]) > 30  # the system turn is cached
    assert "prompt: 0 of" in out.stdout
