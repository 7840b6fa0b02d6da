"""What the cache holds, from a script: the JSON endpoints behind /dashboard.

    python examples/dashboard/cache_report.py [--url http://127.0.0.1:30000] [--api-key K]
        [--prompt "text to check"] [--system "a system prompt to check as a chat"]

Prints the pool and hit rate, the largest cached prefixes (detokenized), and, for a prompt,
how much of it a new request would reuse. Open http://127.0.0.1:30000/dashboard for the same
live, drawn.
"""

from __future__ import annotations

import argparse

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--top", type=int, default=5, help="how many prefixes to list")
    parser.add_argument("--prompt", default=None, help="a raw prompt to match")
    parser.add_argument("--system", default=None,
                        help="a system prompt to match as a chat (with a user turn 'hi')")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = httpx.Client(base_url=args.url, headers=headers, timeout=60)

    stats = client.get("/stats").json()
    pool, now = stats["kv_pool"], stats["now"] or {}
    rate = now.get("hit_rate_total")
    print(f"pool: {pool['free_slots']} free, {pool['evictable_slots']} cached, "
          f"{pool['used_slots']} in use of {pool['total_slots']} slots; "
          f"hit rate {'-' if rate is None else f'{100 * rate:.1f}%'}; "
          f"{stats['counters']['num_tree_nodes']} tree nodes")
    ttft = stats["latency"]["ttft"]
    if ttft:
        print(f"TTFT over the last minute: p50 {1000 * ttft['p50']:.0f} ms, "
              f"p99 {1000 * ttft['p99']:.0f} ms ({ttft['count']} requests)")

    tree = client.get("/cache_tree", params={"max_nodes": 200, "edge_tokens": 16}).json()
    nodes = sorted(tree["nodes"][1:], key=lambda n: -n["subtree_tokens"])[: args.top]
    print(f"largest cached prefixes ({tree['num_nodes']} nodes, {tree['total_tokens']} tokens):")
    for n in nodes:
        text = n["text"].replace("\n", "\\n")
        print(f"  node {n['id']:>6}: {n['tokens']:>5} tokens from position {n['start']:>5}, "
              f"{n['subtree_tokens']:>6} beneath, hits {n['hit_count']:>4}, {n['state']:<9} "
              f"{text[:48]!r}{'…' if n['text_truncated'] else ''}")

    bodies = []
    if args.prompt is not None:
        bodies.append(("prompt", {"text": args.prompt}))
    if args.system is not None:
        bodies.append(("chat", {"messages": [{"role": "system", "content": args.system},
                                             {"role": "user", "content": "hi"}]}))
    for label, body in bodies:
        m = client.post("/cache_match", json=body).json()
        where = (f"ends inside node {m['path'][-1]['id']}" if m["ends_inside"]
                 else f"ends at node {m['path'][-1]['id']}" if m["path"] else "nothing cached")
        print(f"{label}: {m['matched_tokens']} of {m['num_tokens']} tokens cached, a request "
              f"would reuse {m['reusable_tokens']} ({where})")


if __name__ == "__main__":
    main()
