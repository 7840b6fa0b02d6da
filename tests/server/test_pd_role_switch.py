"""A PD worker changes role under load, behind the real sglang-router, with the documented
command (`python -m sglang_like.disaggregation.switch_role`): two prefill workers and one
decode worker; one prefill worker becomes a decode worker while requests keep coming. No
request is lost, the model is not reloaded (same process), and the switched worker then
decodes requests that arrive with their KV."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from router_cluster import PDCluster, info, pd_cluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                       reason="needs sglang-router==0.3.2 (the test extra)"),
]

GREEDY = {"max_new_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[PDCluster]:
    with pd_cluster(2, 1, "--max-total-tokens", "8192",
                    "--enable-disaggregation-mode-switch") as c:
        yield c


def _router_workers(router: str) -> list[dict[str, Any]]:
    body = httpx.get(router + "/workers", timeout=10).json()
    return body["workers"] if isinstance(body, dict) else body


def test_role_switch_under_load_loses_no_request(cluster: PDCluster) -> None:
    switched = cluster.prefill[1]
    pid_before = info(switched.url)["engine_pid"]
    results: list[tuple[int, dict[str, Any] | str]] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        i = 0
        while not stop.is_set():
            text = f"Client {worker} asks question {i}: what is {i} plus {worker}?"
            try:
                resp = httpx.post(cluster.router_url + "/generate", timeout=120,
                                  json={"text": text, "sampling_params": GREEDY})
                results.append((resp.status_code, resp.json() if resp.status_code == 200
                                else resp.text))
            except httpx.HTTPError as exc:
                results.append((-1, repr(exc)))
            i += 1

    threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while len(results) < 6:
            assert time.monotonic() < deadline, "no load went through"
            time.sleep(0.1)
        cmd = [sys.executable, "-m", "sglang_like.disaggregation.switch_role", "--router",
               cluster.router_url, "--worker", switched.url, "--to", "decode"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "is now a decode worker" in done.stdout
        n_at_switch = len(results)
        computed_at_switch = info(switched.url)["num_computed_prompt_tokens"]
        # the load goes on until the new decode worker has served some of it
        deadline = time.monotonic() + 120
        while info(switched.url)["disaggregation"].get("num_received", 0) < 2:
            assert time.monotonic() < deadline, "the switched worker got no decode work"
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    failed = [r for r in results if r[0] != 200
              or r[1]["meta_info"]["finish_reason"]["type"] == "abort"]
    assert not failed, failed[:3]
    assert len(results) > n_at_switch
    after = info(switched.url)
    assert after["engine_pid"] == pid_before  # the same engine process: no reload
    assert after["disaggregation"]["mode"] == "decode"
    types = {w["url"]: w.get("worker_type") for w in _router_workers(cluster.router_url)}
    assert types[switched.url] == "decode", types
    # served by the switched worker as a decode worker: the same answer as a single worker
    text = "After the switch, the answer is"
    want = httpx.post(cluster.prefill[0].url + "/generate", timeout=60,
                      json={"text": text, "sampling_params": GREEDY}).json()
    got = httpx.post(cluster.router_url + "/generate", timeout=60,
                     json={"text": text, "sampling_params": GREEDY}).json()
    assert got["output_ids"] == want["output_ids"]
    # as a decode worker it computed no prompt token: they all came as KV
    assert info(switched.url)["num_computed_prompt_tokens"] == computed_at_switch
