"""`python -m sglang_like.disaggregation.switch_role --router URL --worker URL --to decode`:
change a PD worker's role behind a running sglang-router, without restarting it.

1. The worker leaves the router (`DELETE /workers/{id}`): no new requests reach it.
2. The worker drains and switches (`POST /switch_disaggregation_mode`): it waits until no
   transfer of its old role is in flight (requests already sent to it finish normally), then
   becomes a `--to` worker; the model stays loaded.
3. It joins the router again as the new type (`POST /workers`).

With `--api-key`, the key is sent to the worker and the router.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import httpx

_WAIT_S = 30.0


def _workers(client: httpx.Client, router: str) -> list[dict[str, Any]]:
    body = client.get(f"{router}/workers").raise_for_status().json()
    return body["workers"] if isinstance(body, dict) else body


def _find(client: httpx.Client, router: str, worker: str) -> dict[str, Any] | None:
    for w in _workers(client, router):
        if w.get("url", "").rstrip("/") == worker.rstrip("/"):
            return w
    return None


def switch_role(router: str, worker: str, to: str, bootstrap_port: int | None = None,
                drain_timeout: float = 60.0, api_key: str | None = None,
                admin_api_key: str | None = None) -> dict[str, Any]:
    """Do the three steps; returns the worker's answer to the switch. Raises RuntimeError
    naming the step that failed. The router gets `api_key`; the worker's switch route takes
    its admin key (and the worker must run with --enable-disaggregation-mode-switch)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    admin = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
    with httpx.Client(headers=headers, timeout=drain_timeout + 30) as client:
        entry = _find(client, router, worker)
        if entry is not None:
            wid = entry.get("id") or entry.get("worker_id")
            client.delete(f"{router}/workers/{wid}").raise_for_status()
            deadline = time.monotonic() + _WAIT_S
            while _find(client, router, worker) is not None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router still lists {worker} after {_WAIT_S:g} s")
                time.sleep(0.2)
        body: dict[str, Any] = {"mode": to, "drain_timeout": drain_timeout}
        if bootstrap_port is not None:
            body["bootstrap_port"] = bootstrap_port
        resp = client.post(f"{worker}/switch_disaggregation_mode", json=body, headers=admin)
        if resp.status_code != 200:
            raise RuntimeError(f"the worker did not switch ({resp.status_code}): {resp.text}")
        result = resp.json()
        join: dict[str, Any] = {"url": worker,
                                "worker_type": "regular" if to == "null" else to}
        if to == "prefill":
            join["bootstrap_port"] = result["bootstrap_port"]
        client.post(f"{router}/workers", json=join).raise_for_status()
        deadline = time.monotonic() + _WAIT_S
        while _find(client, router, worker) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not list {worker} again within {_WAIT_S:g} s")
            time.sleep(0.2)
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_like.disaggregation.switch_role",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--router", required=True, help="the sglang-router's URL")
    p.add_argument("--worker", required=True, help="the worker's URL, as the router knows it")
    p.add_argument("--to", required=True, choices=["prefill", "decode", "null"])
    p.add_argument("--bootstrap-port", type=int, default=None,
                   help="with --to prefill: its bootstrap port (default: the worker's)")
    p.add_argument("--drain-timeout", type=float, default=60.0)
    # keys from the environment, so that they stay off command lines (ps shows those)
    p.add_argument("--api-key", default=os.environ.get("SGLANG_LIKE_API_KEY"),
                   help="the router's key (default: $SGLANG_LIKE_API_KEY)")
    p.add_argument("--admin-api-key", default=os.environ.get("SGLANG_LIKE_ADMIN_API_KEY"),
                   help="the worker's admin key (default: $SGLANG_LIKE_ADMIN_API_KEY)")
    ns = p.parse_args(argv)
    try:
        result = switch_role(ns.router, ns.worker, ns.to, ns.bootstrap_port, ns.drain_timeout,
                             ns.api_key, ns.admin_api_key)
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"switch_role: {exc}", file=sys.stderr)
        return 1
    print(f"switch_role: {ns.worker} is now a {result['mode']} worker", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
