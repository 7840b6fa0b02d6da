"""Helpers of the tests that put real servers (default model) behind the real sglang-router
on loopback (test_router.py, test_pd_*.py), and the PD cluster: prefill and decode workers
behind its --pd-disaggregation mode."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from sglang_like import launch_router


def this_folders_conftest() -> Any:
    """tests/server/conftest.py as pytest loaded it (start_real_server, free_port, ...)."""
    path = str(Path(__file__).with_name("conftest.py"))
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == path:
            return module
    raise RuntimeError(f"{path} is not loaded")


@dataclass
class PDCluster:
    router_url: str
    router: launch_router.Child
    prefill: list[Any]  # conftest.RealServer
    bootstrap_ports: list[int]
    decode: list[Any]


def kill_tree(pid: int) -> None:
    """SIGKILL a worker with every process it started and its process group."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start_workers(arg_lists: list[tuple[str, ...]]) -> list[Any]:
    """Real servers, one per argument list, started together, each with its share of the
    cores as torch threads (as launch_router sets them); all or none (the started ones are
    killed if one fails)."""
    conftest = this_folders_conftest()
    num = len(arg_lists)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = launch_router.replica_env(num)["OMP_NUM_THREADS"]
    try:
        with ThreadPoolExecutor(num) as pool:
            starts = [pool.submit(conftest.start_real_server, *a, new_session=True)
                      for a in arg_lists]
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    workers = [s.result() for s in starts if s.exception() is None]
    if len(workers) < num:
        for worker in workers:
            kill_tree(worker.proc.pid)
        raise next(s.exception() for s in starts if s.exception() is not None)
    return workers


@contextmanager
def pd_cluster(num_prefill: int, num_decode: int, *worker_args: str) -> Iterator[PDCluster]:
    conftest = this_folders_conftest()
    num = num_prefill + num_decode
    ports = [conftest.free_port() for _ in range(num_prefill)]
    workers = start_workers(
        [(*worker_args, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
          str(p)) for p in ports]
        + [(*worker_args, "--disaggregation-mode", "decode")] * num_decode)
    prefill, decode = workers[:num_prefill], workers[num_prefill:]
    port = conftest.free_port()
    ns = launch_router.build_parser().parse_args(["--port", str(port)])
    cmd = launch_router.router_command(
        ns, [], conftest.free_port(), None,
        pd=([(w.url, p) for w, p in zip(prefill, ports, strict=True)], [w.url for w in decode]))
    router = launch_router.start_child("router", f"http://127.0.0.1:{port}", cmd)
    try:
        why = launch_router.wait_ready([router], "/workers", threading.Event(),
                                       time.monotonic() + 60, min_workers=num)
        assert why is None, why
        yield PDCluster(router.url, router, prefill, ports, decode)
    finally:
        launch_router.stop_all([router], signal.SIGTERM, 30)
        for worker in workers:
            conftest.stop_real_server(worker, timeout=30)
            kill_tree(worker.proc.pid)


def info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/get_server_info", timeout=30).json()


def sse_events(text: str) -> list[Any]:
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-300:]
    return [json.loads(line) for line in lines[:-1]]
