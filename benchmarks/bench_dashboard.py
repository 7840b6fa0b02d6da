"""What watching the cache costs, and how the dashboard copes with a 10,000-node tree.

    python -m benchmarks.bench_dashboard                 # default model, ~3 minutes on 2 cores
    python -m benchmarks.bench_dashboard --nodes 2000 --stream-tokens 128    # quicker

Three parts, one run:

1. Snapshot cost by tree size, on a RadixCache alone (no model): the loop-thread time of one
   `/cache_tree` walk, and the JSON size, for 100 / 1,000 / 10,000 nodes.
2. A real server (default model, its own process): a tree of `--nodes` nodes is built with
   real requests, then one stream decodes `--stream-tokens` tokens under each of three
   watchers, interleaved and repeated: nobody (only the server's own 1 Hz sampler), the page
   open in headless Chromium (1 Hz /stats, /cache_tree every 2 s), and a script hammering
   /stats + /cache_tree?max_nodes=10000 ten times a second. Per watcher: tokens/s, ITL
   p50/p99, and the loop time the engine spent on dashboard RPCs per decode step (the engine
   counts it: `dashboard_busy_s`).
3. The page itself on that tree: /cache_tree latency and bytes, and the browser's render time
   of the tree for 500 / 2,000 / 10,000 shown nodes.

Draws the ITL distributions per watcher to `--plot` (PNG). Needs Debian's Chromium at
`--chromium` and Playwright (the test extra) for the browser parts; without them those rows
say so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common import (
    RESULTS_DIR,
    free_port,
    launch_server_cmd,
    percentile,
    start_server,
    stop_server,
)

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
STREAM_PROMPT = "Write a long story about a lighthouse keeper and the sea."


# ---- 1. snapshot cost on a tree alone ----------------------------------------------------
def _tree_of(num_leaves: int) -> Any:
    from radix_cache import KVSlotAllocator, RadixCache

    cache = RadixCache(KVSlotAllocator(num_leaves * 16 + 16))
    groups = max(num_leaves // 100, 1)
    for i in range(num_leaves):
        seq = [300 + i % groups, 1000 + i // groups, *range(20000, 20010)]
        slots = cache.allocator.alloc(len(seq))
        cached = cache.insert(seq, slots)
        cache.allocator.free(slots[:cached])
    return cache


def bench_snapshot(sizes: list[int]) -> list[dict[str, Any]]:
    """The engine's part (the walk into rows, on its loop thread) and the HTTP side's (rows to
    node dicts), timed apart; the size of the JSON a script gets (without text)."""
    from radix_cache.snapshot import expand, snapshot

    rows = []
    for leaves in sizes:
        cache = _tree_of(leaves)
        for max_nodes in (500, 10_000):
            loop, http = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                snap = snapshot(cache, max_nodes=max_nodes, rows=True)
                t1 = time.perf_counter()
                nodes = expand(snap)
                http.append(time.perf_counter() - t1)
                loop.append(t1 - t0)
            rows.append({"nodes": cache.num_nodes, "max_nodes": max_nodes,
                         "loop_ms": 1000 * statistics.median(loop),
                         "http_ms": 1000 * statistics.median(http),
                         "kib": len(json.dumps(nodes)) / 1024})
    return rows


# ---- 2. a real server --------------------------------------------------------------------
def start_dashboard_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    """Our server on a free loopback port with `extra` options: (process, URL)."""
    port = free_port()
    return start_server(launch_server_cmd(port, *extra), port)


def build_tree(url: str, num_nodes: int, batch: int = 64) -> int:
    """About `num_nodes` nodes from real requests: 4-token prompts under 1% shared heads."""
    groups = max(num_nodes // 100, 1)
    seqs = [[300 + i % groups, 1000 + i // groups, 20000 + i % 20000, 45000 + i % 1000]
            for i in range(num_nodes - groups)]
    with httpx.Client(timeout=600) as client:
        for start in tqdm(range(0, len(seqs), batch), desc="building the tree", unit="batch"):
            r = client.post(url + "/generate", json={
                "input_ids": seqs[start:start + batch],
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
            r.raise_for_status()
        return client.get(url + "/stats").json()["counters"]["num_tree_nodes"]


def stream_once(url: str, tokens: int) -> list[float]:
    """One streamed greedy decode; the gaps between chunks, per token (seconds)."""
    body = {"text": STREAM_PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    gaps: list[float] = []
    last_t, last_n = None, 0
    with httpx.stream("POST", url + "/generate", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            n = json.loads(line[6:])["meta_info"]["completion_tokens"]
            now = time.perf_counter()
            if last_t is not None and n > last_n:
                gaps += [(now - last_t) / (n - last_n)] * (n - last_n)
            if n > last_n:
                last_t, last_n = now, n
    return gaps


class Hammer:
    """A script polling /stats and the whole tree ten times a second."""

    def __init__(self, url: str) -> None:
        self.url, self._stop = url, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Hammer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                client.get(self.url + "/stats")
                client.get(self.url + "/cache_tree?max_nodes=10000")
                self._stop.wait(0.1)


class Browser:
    """The dashboard open in headless Chromium for the duration of a `with`."""

    def __init__(self, url: str, chromium: str) -> None:
        self.url, self.chromium = url, chromium

    def __enter__(self) -> Browser:
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=self.chromium,
                                                args=CHROMIUM_ARGS)
        self.page = self.browser.new_page(viewport={"width": 1400, "height": 1400})
        self.page.goto(self.url + "/dashboard")
        self.page.wait_for_selector("#tree .node", timeout=60_000)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.browser.close()
        self._pw.stop()


def _counters(url: str) -> dict[str, float]:
    """The engine's counters now (/stats would give the sampler's, up to a second old)."""
    return httpx.get(url + "/get_server_info", timeout=60).json()


def bench_watchers(url: str, tokens: int, repeats: int, chromium: str | None
                   ) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    watchers: dict[str, Any] = {"nobody": None, "hammer 10 Hz": lambda: Hammer(url)}
    if chromium:
        watchers["page open"] = lambda: Browser(url, chromium)
    stream_once(url, 8)  # warm-up
    gaps: dict[str, list[float]] = {name: [] for name in watchers}
    busy: dict[str, list[float]] = {name: [] for name in watchers}
    steps: dict[str, list[float]] = {name: [] for name in watchers}
    runs = [(r, name) for r in range(repeats) for name in watchers]
    for _, name in tqdm(runs, desc="streams under each watcher", unit="stream"):
        make = watchers[name]
        watcher = make() if make else None
        if watcher is not None:
            watcher.__enter__()
            time.sleep(2.0)  # its first polls are in flight
        try:
            before = _counters(url)
            gaps[name] += stream_once(url, tokens)
            after = _counters(url)
        finally:
            if watcher is not None:
                watcher.__exit__(None, None, None)
        busy[name].append(after["dashboard_busy_s"] - before["dashboard_busy_s"])
        steps[name].append(after["num_forward_steps"] - before["num_forward_steps"])
    rows = []
    for name, g in gaps.items():
        rows.append({
            "watcher": name, "tokens": len(g), "tok_s": len(g) / sum(g),
            "itl_p50_ms": 1000 * percentile(g, 50), "itl_p99_ms": 1000 * percentile(g, 99),
            "busy_us_per_step": 1e6 * sum(busy[name]) / max(sum(steps[name]), 1),
        })
    return rows, gaps


# ---- 3. the page on a big tree ------------------------------------------------------------
def _poll(page: Any, script: str, timeout_s: float = 120.0) -> None:
    """Wait until `script` is true (the page's CSP forbids wait_for_function's eval)."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(script):
        if time.monotonic() > deadline:
            raise TimeoutError(script)
        time.sleep(0.05)


def bench_page(url: str, chromium: str | None) -> list[dict[str, Any]]:
    rows = []
    for i, max_nodes in enumerate((500, 2000, 10_000)):
        t0 = time.perf_counter()
        # a new edge_tokens each time: a fresh snapshot, not the engine's cached one
        r = httpx.get(f"{url}/cache_tree?max_nodes={max_nodes}&edge_tokens={20 + i}",
                      timeout=120)
        http_ms = 1000 * (time.perf_counter() - t0)
        body = r.json()
        row = {"max_nodes": max_nodes, "shown": body["shown_nodes"], "http_ms": http_ms,
               "snapshot_ms": body["snapshot_ms"], "kib": len(r.content) / 1024,
               "render_ms": None, "click_ms": None}
        if chromium:
            with Browser(url, chromium) as b:
                page = b.page
                page.select_option("#max-nodes", str(max_nodes))
                _poll(page, "document.getElementById('tree').dataset.shownNodes == "
                            f"'{body['shown_nodes']}'")
                row["render_ms"] = float(page.get_attribute("#tree", "data-render-ms"))
                page.check("#tree-pause")  # no re-render under the click
                time.sleep(0.1)
                node = page.query_selector_all("#tree .node")[-1]
                t0 = time.perf_counter()
                node.click()
                page.wait_for_selector("#node-text", timeout=60_000)
                row["click_ms"] = 1000 * (time.perf_counter() - t0)
        rows.append(row)
    return rows


# ---- report --------------------------------------------------------------------------------
def plot(gaps: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, g in gaps.items():
        g = sorted(1000 * x for x in g)
        ax.plot(g, [(i + 1) / len(g) for i in range(len(g))], label=name)
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of tokens")
    ax.set_title("One stream's ITL while the cache is watched")
    ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_dashboard", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000, help="tree size to build")
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--plot", default=os.path.join(RESULTS_DIR, "dashboard_itl.png"))
    parser.add_argument("--server-args", default="--max-total-tokens 131072",
                        help="extra launch_server arguments")
    args = parser.parse_args(argv)
    chromium = args.chromium if os.path.exists(args.chromium) else None
    try:
        import playwright  # noqa: F401
    except ImportError:
        chromium = None
    if chromium is None:
        print("(no Chromium / Playwright: the browser rows are left out)")

    print("\n## Snapshot of a RadixCache alone: the walk (engine loop) and the expansion into "
          "node dicts (HTTP process)")
    print(f"{'nodes':>8} {'max_nodes':>10} {'loop ms':>8} {'HTTP ms':>8} {'JSON KiB':>10}")
    for row in bench_snapshot([100, 1000, 10_000]):
        print(f"{row['nodes']:>8} {row['max_nodes']:>10} {row['loop_ms']:>8.2f} "
              f"{row['http_ms']:>8.2f} {row['kib']:>10.0f}")

    proc, url = start_dashboard_server(args.server_args.split())
    try:
        nodes = build_tree(url, args.nodes)
        rows, gaps = bench_watchers(url, args.stream_tokens, args.repeats, chromium)
        page_rows = bench_page(url, chromium)
    finally:
        stop_server(proc)

    print(f"\n## One stream of {args.stream_tokens} tokens on a server holding {nodes} tree "
          f"nodes, by who watches ({args.repeats} streams each, interleaved)")
    base = rows[0]["tok_s"]
    print(f"{'watcher':<14} {'tok/s':>7} {'vs nobody':>10} {'ITL p50 ms':>11} "
          f"{'ITL p99 ms':>11} {'dashboard µs/step':>18}")
    for row in rows:
        print(f"{row['watcher']:<14} {row['tok_s']:>7.1f} {row['tok_s'] / base:>9.2f}x "
              f"{row['itl_p50_ms']:>11.1f} {row['itl_p99_ms']:>11.1f} "
              f"{row['busy_us_per_step']:>18.0f}")

    print(f"\n## The page on the {nodes}-node tree")
    print(f"{'max_nodes':>10} {'shown':>6} {'HTTP ms':>8} {'snapshot ms':>12} {'KiB':>6} "
          f"{'render ms':>10} {'click ms':>9}")
    for row in page_rows:
        render = "–" if row["render_ms"] is None else f"{row['render_ms']:.0f}"
        click = "–" if row["click_ms"] is None else f"{row['click_ms']:.0f}"
        print(f"{row['max_nodes']:>10} {row['shown']:>6} {row['http_ms']:>8.0f} "
              f"{row['snapshot_ms']:>12.1f} {row['kib']:>6.0f} {render:>10} {click:>9}")
    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    plot(gaps, args.plot)
    print(f"\nITL distributions drawn to {args.plot}")


if __name__ == "__main__":
    main()
