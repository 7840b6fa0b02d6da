"""`--cpu-pinning auto` (the default) on a real server: the engine loop's thread gets a core that
the engine's busy OpenMP workers and every thread of the HTTP process keep off; `off` pins
nothing. Each server claims in a folder of its own, so engines other tests left up do not
hold the cores."""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest

from sglang_like.utils.cpu_runtime import CLAIM_DIR_ENV

CPUS = set(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="pinning needs two allowed cores")


def _threads(pid: int) -> dict[int, tuple[set[int], int]]:
    """tid -> (allowed cores, user+system ticks so far)."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/task"):
        tid = int(name)
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[tid] = (os.sched_getaffinity(tid), int(fields[11]) + int(fields[12]))
        except (OSError, ProcessLookupError):
            continue  # it ended meanwhile
    return out


def _generate(url: str) -> None:
    r = httpx.post(url + "/generate", timeout=120, json={
        "text": "Count from one to fifty in words:",
        "sampling_params": {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 160


def test_auto_gives_the_loop_a_core_the_rest_keep_off(server_launcher: Any, tmp_path) -> None:
    server = server_launcher(env={CLAIM_DIR_ENV: str(tmp_path)})
    info = httpx.get(server.url + "/get_server_info", timeout=60).json()
    loop, engine_pid = info["loop_cpu"], info["engine_pid"]
    assert loop == min(CPUS)  # the first claim in an empty folder
    before = _threads(engine_pid)
    _generate(server.url)
    after = _threads(engine_pid)
    busy = {tid for tid, (_, ticks) in after.items()
            if ticks - before.get(tid, (None, 0))[1] >= 5}
    assert engine_pid in busy  # the loop's thread ran the steps, on any core it likes
    assert after[engine_pid][0] == CPUS
    workers = busy - {engine_pid}
    assert workers, "no OpenMP worker did any of the decode work"
    for tid in workers:
        assert loop not in after[tid][0], (tid, after[tid][0])
    for tid, (cores, _) in _threads(server.proc.pid).items():
        assert loop not in cores, ("HTTP thread", tid, cores)


def test_off_pins_nothing(server_launcher: Any, tmp_path) -> None:
    server = server_launcher("--cpu-pinning", "off", env={CLAIM_DIR_ENV: str(tmp_path)})
    info = httpx.get(server.url + "/get_server_info", timeout=60).json()
    assert info["loop_cpu"] is None
    _generate(server.url)
    for pid in (info["engine_pid"], server.proc.pid):
        assert all(cores == CPUS for cores, _ in _threads(pid).values())
    assert os.listdir(tmp_path) == []  # it claimed nothing
