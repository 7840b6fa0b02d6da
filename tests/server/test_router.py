"""Two real workers (default model) behind the real sglang-router 0.3.2 (cache_aware), on
loopback: the native and OpenAI routes through it, the same answers as direct requests, cache
affinity per shared prefix, /flush_cache fanned out, a killed worker routed around; and
`python -m sglang_like.launch_router` itself (start, serve, SIGTERM; a replica that cannot
start). Greedy and a few new tokens each, to fit 2 cores.

The tests share one cluster and run in file order; the one that kills a worker is last.
"""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from router_cluster import info, kill_tree, sse_events, start_workers, this_folders_conftest

from sglang_like import launch_router

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                       reason="needs sglang-router==0.3.2 (the test extra)"),
]

_conftest = this_folders_conftest()

WORKER_ARGS = ("--max-total-tokens", "16384")
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
# Two long prefixes of different token lengths (about 300 and 340 tokens)
PREFIX_A = "Field notes on rivers. " + " ".join(
    f"River stone {i} rolls east with the water." for i in range(28))
PREFIX_B = "A travel log of mountains. " + " ".join(
    f"Mountain peak {i} rises above the clouds." for i in range(34))
GROUP_SIZE = 4


@dataclass
class Cluster:
    router_url: str
    router: launch_router.Child
    workers: list[Any]  # conftest.RealServer


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    workers = start_workers([WORKER_ARGS, WORKER_ARGS])
    port = _conftest.free_port()
    ns = launch_router.build_parser().parse_args(["--port", str(port)])
    cmd = launch_router.router_command(ns, [w.url for w in workers], _conftest.free_port(), None)
    router = launch_router.start_child("router", f"http://127.0.0.1:{port}", cmd)
    try:
        why = launch_router.wait_ready([router], "/workers", threading.Event(),
                                       time.monotonic() + 60, min_workers=2)
        assert why is None, why
        yield Cluster(router.url, router, workers)
    finally:
        launch_router.stop_all([router], signal.SIGTERM, 30)
        for worker in workers:
            _conftest.stop_real_server(worker, timeout=30)
            kill_tree(worker.proc.pid)



def _post(url: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    return httpx.post(url, json=body, timeout=timeout)



def _deltas(key: str, after: list[dict[str, Any]], before: list[dict[str, Any]]) -> list[int]:
    return [a[key] - b[key] for a, b in zip(after, before, strict=True)]




# ---- a. the routes through the router --------------------------------------------------------
def test_generate_stream_chat_and_openai_client(cluster: Cluster) -> None:
    url = cluster.router_url
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    plain = _post(url + "/generate", body)
    assert plain.status_code == 200, plain.text
    assert plain.json()["meta_info"]["completion_tokens"] == 8 and plain.json()["text"]

    streamed = _post(url + "/generate", {**body, "stream": True})
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert events[-1]["text"] == plain.json()["text"]
    assert events[-1]["output_ids"] == plain.json()["output_ids"]

    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
        temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens <= 8
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
        temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        out.choices[0].message.content)
    completion = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=4,
                                           temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens == 4

    # the router's /get_loads reads each worker's /get_load (-1 where it cannot)
    loads = httpx.get(url + "/get_loads", timeout=10).json()["workers"]
    assert sorted(load["worker"] for load in loads) == sorted(w.url for w in cluster.workers)
    assert all(load["load"] >= 0 for load in loads), loads


# ---- b. enriched bodies answer as direct ones -------------------------------------------------
def test_enriched_request_same_answer_as_direct(cluster: Cluster) -> None:
    body = {"text": "List three colors:", "sampling_params": GREEDY}
    routed = _post(cluster.router_url + "/generate", body).json()
    direct = _post(cluster.workers[0].url + "/generate", body).json()
    assert (routed["text"], routed["output_ids"]) == (direct["text"], direct["output_ids"])
    # a seeded sample: the router drops `seed` from sampling_params, passes `sampling_seed`
    sampled = {"text": "Once upon a time", "sampling_params": {
        "max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7}}
    routed = _post(cluster.router_url + "/generate", sampled).json()
    direct = _post(cluster.workers[1].url + "/generate", {**sampled, "sampling_params": {
        **sampled["sampling_params"], "sampling_seed": None, "seed": 7}}).json()
    assert routed["output_ids"] == direct["output_ids"]

    # the router sends max_completion_tokens (for max_tokens) and its own extra fields
    chat = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 6,
            "temperature": 0.0}
    routed = _post(cluster.router_url + "/v1/chat/completions", chat).json()
    direct = _post(cluster.workers[0].url + "/v1/chat/completions", chat).json()
    assert routed["choices"][0]["message"] == direct["choices"][0]["message"]
    assert routed["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
    assert routed["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] <= 6


# ---- c. cache affinity ---------------------------------------------------------------------
def test_concurrent_prefix_groups_each_stay_on_one_worker(cluster: Cluster) -> None:
    before = [info(w.url) for w in cluster.workers]
    prompts = [(group, prefix + f" Question {j}: what comes next?")
               for j in range(GROUP_SIZE) for group, prefix in (("A", PREFIX_A),
                                                                 ("B", PREFIX_B))]

    async def send_all() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(text: str) -> dict[str, Any]:
                r = await client.post(cluster.router_url + "/generate", json={
                    "text": text, "sampling_params": {**GREEDY, "max_new_tokens": 2}})
                assert r.status_code == 200, r.text
                return r.json()

            return await asyncio.gather(*(one(text) for _, text in prompts))

    results = asyncio.run(send_all())
    after = [info(w.url) for w in cluster.workers]
    group_tokens = {"A": 0, "B": 0}
    for (group, _), result in zip(prompts, results, strict=True):
        group_tokens[group] += result["meta_info"]["prompt_tokens"]
    assert group_tokens["A"] != group_tokens["B"]
    served = _deltas("num_prompt_tokens", after, before)
    cached = _deltas("num_cached_prompt_tokens", after, before)
    # each worker prefilled exactly one group's prompts
    assert sorted(served) == sorted(group_tokens.values()), (served, group_tokens)
    for num_served, num_cached, worker in zip(served, cached, after, strict=True):
        # 3 of the 4 prompts of a group reuse its ~300-token prefix
        assert num_cached / num_served > 0.6, (num_cached, num_served)
        assert worker["cache_hit_rate"] > 0


# ---- d. /flush_cache fans out ----------------------------------------------------------------
def test_flush_cache_through_router_empties_both(cluster: Cluster) -> None:
    assert all(info(w.url)["kv_pool"]["cached_slots"] > 0 for w in cluster.workers)
    r = httpx.post(cluster.router_url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert [info(w.url)["kv_pool"]["cached_slots"] for w in cluster.workers] == [0, 0]


# ---- e. a killed worker (last: the cluster is left with one) -----------------------------------
def test_killed_worker_is_routed_around(cluster: Cluster) -> None:
    # the worker that serves PREFIX_B now (a fresh probe puts it in the router's tree)
    before = [info(w.url)["num_prompt_tokens"] for w in cluster.workers]
    probe = _post(cluster.router_url + "/generate",
                  {"text": PREFIX_B + " Probe.", "sampling_params": {**GREEDY,
                                                                     "max_new_tokens": 1}})
    assert probe.status_code == 200
    grew = [info(w.url)["num_prompt_tokens"] > b
            for w, b in zip(cluster.workers, before, strict=True)]
    assert grew.count(True) == 1, grew
    victim, survivor = (cluster.workers[i] for i in ((0, 1) if grew[0] else (1, 0)))

    kill_tree(victim.proc.pid)
    victim.proc.wait(timeout=10)
    survivor_before = info(survivor.url)["num_prompt_tokens"]
    statuses: list[int] = []
    ok_prompt_tokens = 0
    consecutive_ok = 0
    killed_at = time.monotonic()
    deadline = killed_at + 40
    j = 0
    while consecutive_ok < 4 and time.monotonic() < deadline:
        j += 1
        try:
            r = _post(cluster.router_url + "/generate", {
                "text": PREFIX_B + f" After the kill {j}.",
                "sampling_params": {**GREEDY, "max_new_tokens": 1}}, timeout=30)
            statuses.append(r.status_code)
        except httpx.HTTPError:
            statuses.append(-1)
        print(f"{time.monotonic() - killed_at:.1f}s after the kill: {statuses[-1]}")
        if statuses[-1] == 200:
            consecutive_ok += 1
            ok_prompt_tokens += r.json()["meta_info"]["prompt_tokens"]
        else:
            consecutive_ok = 0
    errors = [s for s in statuses if s != 200]
    assert consecutive_ok == 4, statuses
    assert len(errors) <= 5, statuses
    # every answer came from the survivor
    assert info(survivor.url)["num_prompt_tokens"] - survivor_before == ok_prompt_tokens


# ---- the launcher ------------------------------------------------------------------------------
def test_launch_router_serves_and_stops_on_sigterm() -> None:
    port = _conftest.free_port()
    cmd = [sys.executable, "-m", "sglang_like.launch_router", "--dp-size", "1", "--port",
           str(port), "--max-total-tokens", "4096", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("sglang_like: "):
                break
        assert f"listening on http://127.0.0.1:{port}" in lines[-1], "".join(lines)[-3000:]
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert len(descendants) >= 2  # a replica and the router
        r = _post(f"http://127.0.0.1:{port}/generate",
                  {"text": "Hello", "sampling_params": {**GREEDY, "max_new_tokens": 2}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(descendants, timeout=5)
        assert not alive, alive
    finally:
        kill_tree(proc.pid)


def test_launch_router_names_a_replica_that_cannot_start(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    cmd = [sys.executable, "-m", "sglang_like.launch_router", "--dp-size", "2", "--port",
           str(_conftest.free_port()), "--model-path", str(missing)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "a replica did not start: replica" in out.stdout and "exited with code" in out.stdout
    assert str(missing) in out.stdout
