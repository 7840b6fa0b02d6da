"""`python -m sglang_like.launch_router --dp-size N`: N replicas of launch_server on loopback and
the real sglang-router (PyPI `sglang-router`) in front of them.

Options this launcher does not know are each replica's server options (`--model-path`,
`--max-total-tokens`, ...); `--host` / `--port` are the router's, and every replica gets a free
port on 127.0.0.1. Replicas start together; once each answers /health the router starts, and
the launcher prints where it listens. SIGTERM / SIGINT: every child gets SIGTERM, and the
launcher exits when they are gone. A child that dies during startup is named, and the
launcher exits 1.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
# The router's defaults (60 s between checks, 30 s startup checks) are for clusters; one host's
# replicas are checked often, so a dead one is routed around within seconds.
_ROUTER_HEALTH_ARGS = ("--health-check-interval-secs", "3", "--health-failure-threshold", "2",
                       "--worker-startup-check-interval", "1")
# `python -m sglang_router.launch_router`, less 8 s: that module imports its Python mini load
# balancer, which imports the whole `sglang` package (when installed, as SGLang's frontend is
# in our test extra) for optional tracing. The Rust router needs none of it; an entry of None
# in sys.modules makes that import fail at once, and the router falls back as without sglang.
# The API key reaches the router in its environment and joins its argv inside the process:
# a command line is readable by every user of the machine (ps), an environment is not.
_ROUTER_KEY_ENV = "SGLANG_LIKE_ROUTER_API_KEY"
_ROUTER_MAIN = ("import os, runpy, sys; sys.modules['sglang'] = None; "
                f"key = os.environ.pop('{_ROUTER_KEY_ENV}', None); "
                "sys.argv += ['--api-key', key] if key else []; "
                "runpy.run_module('sglang_router.launch_router', run_name='__main__', "
                "alter_sys=True)")
# options whose value is a secret: the replicas get it in their environment instead
_SECRET_OPTIONS = ("--api-key", "--admin-api-key")
_POLL_S = 0.25
_KILL_GRACE_S = 30.0  # beyond --shutdown-timeout, before stragglers are SIGKILLed
_TAIL_LINES = 8  # of a dead child's output, repeated in the report of its exit


@dataclass
class Child:
    """One process this launcher started, in its own session (so its group can be killed)."""

    name: str
    url: str
    proc: subprocess.Popen
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))

    @property
    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def describe_exit(self) -> str:
        last = "".join(self.tail).rstrip()
        return f"{self.name} ({self.url}) exited with code {self.proc.returncode}" + (
            f"; its last output:\n{last}" if last else "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_like.launch_router", allow_abbrev=False,
        description="N server replicas on loopback behind the real sglang-router. Options not "
                    "listed here are passed to every replica (see launch_server --help).",
    )
    p.add_argument("--dp-size", type=int, default=1, help="number of replicas")
    p.add_argument("--pd-disaggregation", action="store_true",
                   help="prefill and decode workers (--prefill-size, --decode-size) behind the "
                        "router's PD mode instead of --dp-size regular replicas")
    p.add_argument("--prefill-size", type=int, default=1,
                   help="with --pd-disaggregation: prefill workers")
    p.add_argument("--decode-size", type=int, default=1,
                   help="with --pd-disaggregation: decode workers")
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--port", type=int, default=30000, help="the router's port")
    p.add_argument("--policy", default="cache_aware", choices=_POLICIES)
    p.add_argument("--worker-startup-timeout", type=float, default=600.0,
                   help="seconds each replica may take to answer /health")
    p.add_argument("--router-log-level", default="warn",
                   choices=["debug", "info", "warn", "error"])
    p.add_argument("--router-args", default="",
                   help="more sglang_router.launch_router options, as one shell-quoted string")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM (router and replicas)")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_command(port: int, server_argv: list[str], shutdown_timeout: float) -> list[str]:
    return [sys.executable, "-m", "sglang_like.launch_server", "--host", "127.0.0.1",
            "--port", str(port), "--shutdown-timeout", str(shutdown_timeout), *server_argv]


def router_command(ns: argparse.Namespace, worker_urls: list[str], prometheus_port: int,
                   api_key: str | None, pd: tuple[list[tuple[str, int]], list[str]] | None = None,
                   ) -> list[str]:
    """The real router on ns.host:ns.port; its metrics listener on loopback (its default is
    0.0.0.0:29000, which a second router on the host would collide with). `pd`: (prefill
    (url, bootstrap port) pairs, decode urls) for its --pd-disaggregation mode."""
    if pd is None:
        workers = ["--worker-urls", *worker_urls]
    else:
        workers = ["--pd-disaggregation"]
        for url, bootstrap_port in pd[0]:
            workers += ["--prefill", url, str(bootstrap_port)]
        for url in pd[1]:
            workers += ["--decode", url]
    cmd = [sys.executable, "-c", _ROUTER_MAIN, "--host", ns.host,
           "--port", str(ns.port), *workers, "--policy", ns.policy,
           *_ROUTER_HEALTH_ARGS, "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(prometheus_port), "--log-level", ns.router_log_level,
           "--shutdown-grace-period-secs", str(int(ns.shutdown_timeout))]
    # with an API key (router_env) the router asks clients for it and sends it to the workers
    return cmd + shlex.split(ns.router_args)


def router_env(api_key: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if api_key:
        env[_ROUTER_KEY_ENV] = api_key
    return env


def replica_env(dp_size: int, secrets: dict[str, str] | None = None) -> dict[str, str]:
    """The replicas share the host's cores: each gets its share as torch threads, unless
    OMP_NUM_THREADS is set (two replicas of 2 threads each on 2 cores spin against each other).
    `secrets`: keys and the PD secret, by their environment names (never on a command line)."""
    env = {**os.environ, **(secrets or {})}
    if "OMP_NUM_THREADS" not in env:
        num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, num_cores // dp_size))
    return env


def start_child(name: str, url: str, cmd: list[str],
                env: dict[str, str] | None = None) -> Child:
    """Start `cmd`; a thread relays its output prefixed with its name and keeps the tail."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True, env=env)
    child = Child(name, url, proc)
    threading.Thread(target=_relay, args=(child,), daemon=True, name=f"relay-{name}").start()
    return child


def _relay(child: Child) -> None:
    assert child.proc.stdout is not None
    for line in child.proc.stdout:
        child.tail.append(line)
        sys.stdout.write(f"[{child.name}] {line}")
        sys.stdout.flush()


def _is_ready(url: str, path: str, headers: dict[str, str], min_workers: int) -> bool:
    try:
        r = httpx.get(url + path, headers=headers, timeout=2.0)
    except httpx.HTTPError:
        return False
    if r.status_code != 200:
        return False
    if path == "/workers":  # the router's list; its /readiness logs each early 503 as an error
        try:
            workers = r.json().get("workers") or []
        except (ValueError, AttributeError):
            return False
        return sum(bool(w.get("is_healthy")) for w in workers) >= min_workers
    return True


def wait_ready(children: list[Child], path: str, stop: threading.Event, deadline: float,
               headers: dict[str, str] | None = None, min_workers: int = 0) -> str | None:
    """Poll each child's `path` until all answer 200; None, or why they did not."""
    pending = list(children)
    while pending:
        for child in list(pending):
            if not child.is_alive:
                return child.describe_exit()
            if _is_ready(child.url, path, headers or {}, min_workers):
                pending.remove(child)
        if not pending:
            return None
        if stop.is_set():
            return "stopped by a signal during startup"
        if time.monotonic() > deadline:
            return "not ready in time: " + ", ".join(f"{c.name} ({c.url})" for c in pending)
        stop.wait(_POLL_S)
    return None


def stop_all(children: list[Child], sig: int, timeout: float) -> None:
    """Send `sig` to each child, wait up to `timeout` s, then SIGKILL what is left; finally kill
    each child's process group, so no grandchild (a replica's engine process) outlives it."""
    for child in children:
        if child.is_alive:
            try:
                child.proc.send_signal(sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"sglang_like: {child.name} did not stop in {timeout:.0f}s; killing it",
                  flush=True)
    for child in children:
        try:
            os.killpg(child.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        child.proc.wait()


def replica_secrets(server_argv: list[str], pd: bool) -> tuple[list[str], dict[str, str],
                                                                 str | None]:
    """Check the replicas' options up front (argparse's usage error, exit 2); return them
    without any secret value, the secrets for their environment, and the API key the router
    needs. A PD cluster without a secret of its own gets a fresh random one: its workers then
    hear only each other on their bootstrap ports."""
    from sglang_like import launch_server as server

    args = server.server_args_from(server.build_parser().parse_args(server_argv))
    argv: list[str] = []
    skip = False
    for arg in server_argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _SECRET_OPTIONS:
            skip = "=" not in arg
            continue
        argv.append(arg)
    env: dict[str, str] = {}
    if args.api_key:  # a key file's path stays in argv: it is no secret
        env[server.ENV_API_KEY] = args.api_key
    if args.admin_api_key:
        env[server.ENV_ADMIN_API_KEY] = args.admin_api_key
    if pd:
        env[server.ENV_DISAGGREGATION_SECRET] = (args.disaggregation_secret
                                                 or secrets.token_hex(32))
    return argv, env, args.api_key


def _check(ns: argparse.Namespace) -> None:
    if ns.dp_size < 1:
        raise SystemExit("--dp-size must be at least 1")
    if ns.pd_disaggregation and (ns.prefill_size < 1 or ns.decode_size < 1):
        raise SystemExit("--prefill-size and --decode-size must be at least 1")
    if not 0 < ns.port < 65536:
        raise SystemExit("--port must be in 1..65535")
    if importlib.util.find_spec("sglang_router") is None:
        raise SystemExit("sglang-router is not installed: pip install sglang-router==0.3.2")


def _roles(ns: argparse.Namespace) -> list[tuple[str, list[str], int | None]]:
    """(name, extra server options, bootstrap port) of each worker to start."""
    if not ns.pd_disaggregation:
        return [("replica", [], None) for _ in range(ns.dp_size)]
    roles: list[tuple[str, list[str], int | None]] = []
    for _ in range(ns.prefill_size):
        port = free_port()
        roles.append(("prefill", ["--disaggregation-mode", "prefill",
                                  "--disaggregation-bootstrap-port", str(port)], port))
    roles += [("decode", ["--disaggregation-mode", "decode"], None)
              for _ in range(ns.decode_size)]
    return roles


def _supervise(router: Child, replicas: list[Child], stop: threading.Event) -> int:
    """Run until a signal (0), or until the router or every replica is gone (1)."""
    reported: set[str] = set()
    while not stop.wait(_POLL_S):
        if not router.is_alive:
            print(f"sglang_like: {router.describe_exit()}", flush=True)
            return 1
        for replica in replicas:
            if not replica.is_alive and replica.name not in reported:
                reported.add(replica.name)
                print(f"sglang_like: {replica.describe_exit()}\nsglang_like: the router routes "
                      "around it", flush=True)
        if len(reported) == len(replicas):
            print("sglang_like: every replica is gone; stopping", flush=True)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ns, server_argv = build_parser().parse_known_args(argv)
    _check(ns)
    server_argv, secret_env, api_key = replica_secrets(server_argv, ns.pd_disaggregation)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stop = threading.Event()
    received = [signal.SIGTERM]

    def on_signal(signum: int, frame: object) -> None:
        received[0] = signum
        stop.set()

    # Either signal reaches every child as SIGTERM: the servers treat both alike, and SIGINT
    # stops the router with a KeyboardInterrupt traceback out of its Python wrapper.

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    children: list[Child] = []
    try:
        roles = _roles(ns)
        ports = [free_port() for _ in roles]
        replicas = [
            start_child(f"{role} {i}", f"http://127.0.0.1:{port}",
                        replica_command(port, server_argv + extra, ns.shutdown_timeout),
                        replica_env(len(roles), secret_env))
            for i, (port, (role, extra, _)) in enumerate(zip(ports, roles, strict=True))
        ]
        children += replicas
        deadline = time.monotonic() + ns.worker_startup_timeout
        if (why := wait_ready(replicas, "/health", stop, deadline)) is not None:
            print(f"sglang_like: a replica did not start: {why}", flush=True)
            return 0 if stop.is_set() else 1
        urls = [r.url for r in replicas]
        pd = None
        if ns.pd_disaggregation:
            pd = ([(r.url, b) for r, (role, _, b) in zip(replicas, roles, strict=True)
                   if role == "prefill"],
                  [r.url for r, (role, _, _) in zip(replicas, roles, strict=True)
                   if role == "decode"])
        router = start_child("router", f"http://{ns.host}:{ns.port}",
                             router_command(ns, urls, free_port(), api_key, pd),
                             router_env(api_key))
        children.insert(0, router)  # stopped first: no new requests reach stopping replicas
        why = wait_ready([router], "/workers", stop, time.monotonic() + 120.0, headers,
                         min_workers=len(roles))
        if why is not None:
            print(f"sglang_like: the router did not start: {why}", flush=True)
            return 0 if stop.is_set() else 1
        shape = (f"{ns.prefill_size} prefill + {ns.decode_size} decode worker(s), PD mode"
                 if ns.pd_disaggregation else f"{ns.dp_size} replica(s)")
        print(f"sglang_like: sglang-router ({ns.policy}) listening on {router.url} in front of "
              f"{shape}: {' '.join(urls)}", flush=True)
        return _supervise(router, replicas, stop)
    finally:
        if children:
            print(f"sglang_like: stopping {len(children)} process(es) "
                  f"({signal.Signals(received[0]).name})", flush=True)
        stop_all(children, signal.SIGTERM, ns.shutdown_timeout + _KILL_GRACE_S)


if __name__ == "__main__":
    sys.exit(main())
