"""Speculative decoding benchmark: off / NGRAM / EAGLE-3 on the default model, one run.

    python -m benchmarks.bench_speculative                     # the table + PNG histogram
    python -m benchmarks.bench_speculative --batch-sizes 1 --workloads chat --max-new-tokens 64

Every config's engine runs at once (a process each) and each cell is measured by the configs
in turn, in `--repeats` rounds: a cell keeps its median tok/s and, as `x off`, the median of
the rounds' own ratios to off (the configs of a round measured seconds apart). Three
workloads of greedy chat requests: open chat, extracting fields of a given
document as JSON (copy-heavy), editing a given piece of code (copy-heavy). At batch 1 each
prompt runs alone and the column is decode tokens/s (completion tokens after the first over
the time after the first, streamed); at batch 8 and 32 the prompts are cycled to fill the
batch and the column is output tokens/s of the whole batch. Acceptance length is completion
tokens / spec_verify_ct (SGLang's). Speculation runs as users get it (`auto-disable` on:
the controller turns it off where it measured not to pay); `--always-speculate` shows the
raw cost. The acceptance-length histogram of every verify pass is drawn to a PNG.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from typing import Any

from tqdm import tqdm

from benchmarks.common import RESULTS_DIR, WORKLOADS, stream_decode_seconds
from sglang_like.speculative import DEFAULT_HEAD

CONFIGS = {
    "off": {},
    "NGRAM": {"speculative_algorithm": "NGRAM"},
    "EAGLE3": {"speculative_algorithm": "EAGLE3"},  # with NGRAM's branch grafted on (default)
    "EAGLE3-head": {"speculative_algorithm": "EAGLE3", "speculative_eagle_ngram_branch": False},
}
DEFAULT_CONFIGS = ["off", "NGRAM", "EAGLE3"]

def _stream_decode_rate(engine: Any, prompt: str, params: dict) -> tuple[int, int, float]:
    """(completion tokens, verify passes, decode seconds after the first token) of one
    streamed request."""
    last, seconds = stream_decode_seconds(engine, params, prompt=prompt)
    meta = last["meta_info"]
    return meta["completion_tokens"], meta["spec_verify_ct"], seconds


def _measure(engine: Any, prompts: list[str], batch: int, params: dict) -> dict:
    engine.flush_cache()
    if batch == 1:
        tokens = verifies = 0
        seconds = 0.0
        for p in prompts:
            n, v, s = _stream_decode_rate(engine, p, params)
            tokens += n
            verifies += v
            seconds += s
        decode_tokens = tokens - len(prompts)  # the first token of each is the prefill's
        rate = decode_tokens / max(seconds, 1e-9)
    else:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        t0 = time.perf_counter()
        outs = engine.generate(batch_prompts, params)
        seconds = time.perf_counter() - t0
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        verifies = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
        decode_tokens = tokens - batch
        rate = tokens / seconds
    return {"tok_s": rate, "tokens": tokens, "verifies": verifies,
            "accept": decode_tokens / verifies if verifies else None}


def run(args: argparse.Namespace) -> dict:
    """Every config's engine up at once (each in its own process: an idle one's OpenMP team
    sleeps, and measured no cost to the running one), each cell measured by every config in
    turn, `--repeats` rounds, the configs' order rotated per round. A cell's configs are then
    measured seconds apart, not the minutes a whole config's run takes: this machine's speed
    drifts by 10-40% over minutes, which a config measured after another inherited into its
    ratio. Each cell keeps its median over the rounds and `x off`, the median of the rounds'
    own ratios to off."""
    from sglang_like import Engine

    runs: dict[str, dict[str, list[dict]]] = {}
    cells = [(w, b) for w in args.workloads for b in args.batch_sizes]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    engines: dict[str, Any] = {}
    before: dict[str, collections.Counter] = {}
    hists: dict[str, collections.Counter] = {}
    try:
        for name in args.configs:
            engine = engines[name] = Engine(**_engine_kwargs(name, args))
            hello = engine.apply_chat_template([{"role": "user", "content": "Hello"}])
            engine.generate(hello, {"max_new_tokens": 8})  # warm-up
            before[name] = collections.Counter(engine.get_server_info()["spec_accept_lengths"])
        prompts = {w: [engines[args.configs[0]].apply_chat_template(
            [{"role": "user", "content": p}]) for p in WORKLOADS[w][: args.prompts]]
            for w in args.workloads}
        bar = tqdm(total=args.repeats * len(args.configs) * len(cells), unit="cell")
        for rnd in range(args.repeats):
            order = args.configs[rnd % len(args.configs):] + args.configs[: rnd % len(args.configs)]
            for w, b in cells:
                for name in order:
                    bar.set_description(f"{name} {w} b{b}")
                    runs.setdefault(f"{w}/b{b}", {}).setdefault(name, []).append(
                        _measure(engines[name], prompts[w], b, params))
                    bar.update()
        bar.close()
        for name, engine in engines.items():
            after = collections.Counter(engine.get_server_info()["spec_accept_lengths"])
            hists[name] = after - before[name]
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {"cells": summarize_cells(runs), "hists": {k: dict(v) for k, v in hists.items()},
            "args": vars(args)}


def summarize_cells(runs: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
    """Per cell and config: the round of median tok/s, with `x_off`, the median over the
    rounds of that round's tok/s over off's in the same round (None without off)."""
    out: dict[str, dict[str, dict]] = {}
    for cell, row in runs.items():
        base = row.get("off")
        out[cell] = {}
        for name, rs in row.items():
            kept = dict(sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2])
            if base is not None and name != "off":
                ratios = sorted(r["tok_s"] / o["tok_s"] for r, o in zip(rs, base, strict=True))
                kept["x_off"] = statistics.median(ratios)
                kept["x_off_rounds"] = ratios
            out[cell][name] = kept
    return out


def _engine_kwargs(name: str, args: argparse.Namespace) -> dict:
    kw = dict(CONFIGS[name], max_total_tokens=args.max_total_tokens,
              quantization=args.quantization)
    if name != "off" and args.always_speculate:
        kw["speculative_auto_disable"] = False
    if name.startswith("EAGLE3") and args.draft_model_path:
        kw["speculative_draft_model_path"] = args.draft_model_path
    if name.startswith("EAGLE3"):
        for key in ("num_steps", "eagle_topk", "num_draft_tokens"):
            if getattr(args, key) is not None:
                kw[f"speculative_{key}"] = getattr(args, key)
    if name == "NGRAM":
        for key, arg in (("num_draft_tokens", "ngram_draft_tokens"),
                         ("ngram_max_bfs_breadth", "ngram_breadth")):
            if getattr(args, arg, None) is not None:
                kw[f"speculative_{key}"] = getattr(args, arg)
    return kw


def _width(name: str) -> int:
    """A config's tok/s column: its header and a space."""
    return max(14, len(name) + 7)


def print_table(report: dict) -> None:
    names = report["args"]["configs"]
    head = f"{'workload':<12}{'batch':>6}"
    for n in names:
        head += f"{n + ' tok/s':>{_width(n)}}"
        head += "" if n == "off" else f"{'x off':>7}{'accept':>8}"
    print(head)
    for cell, row in report["cells"].items():
        w, b = cell.split("/b")
        line = f"{w:<12}{b:>6}"
        base = row.get("off", {}).get("tok_s")
        for n in names:
            r = row.get(n)
            if r is None:
                line += f"{'-':>{_width(n)}}" + ("" if n == "off" else f"{'-':>7}{'-':>8}")
                continue
            line += f"{r['tok_s']:>{_width(n)}.1f}"
            if n != "off":
                ratio = f"{r['x_off']:.2f}" if r.get("x_off") is not None else (
                    f"{r['tok_s'] / base:.2f}" if base else "-")
                acc = f"{r['accept']:.2f}" if r["accept"] else "-"
                line += f"{ratio:>7}{acc:>8}"
        print(line)


def draw_histogram(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hists = {k: v for k, v in report["hists"].items() if k != "off" and v}
    if not hists:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(hists)
    for i, (name, hist) in enumerate(hists.items()):
        lengths = sorted(int(k) for k in hist)
        total = sum(hist.values())
        ax.bar([x + i * width for x in lengths], [hist[k] / total for k in lengths], width,
               label=f"{name} (mean {sum(int(k) * v for k, v in hist.items()) / total:.2f})")
    ax.set_xlabel("tokens committed per decode forward (1 = plain decode or all drafts rejected)")
    ax.set_ylabel("fraction of forwards")
    ax.set_title("Acceptance length, default model, all workloads and batch sizes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_speculative",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS),
                   help="EAGLE3-head: the head's drafts alone (no NGRAM branch)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds over the configs (each cell's median kept)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--draft-model-path", default=None, help=f"default: {DEFAULT_HEAD}")
    p.add_argument("--num-steps", type=int, default=None,
                   help="EAGLE3 --speculative-num-steps (default: the engine's)")
    p.add_argument("--eagle-topk", type=int, default=None)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--ngram-draft-tokens", type=int, default=None,
                   help="NGRAM --speculative-num-draft-tokens (default: the engine's)")
    p.add_argument("--ngram-breadth", type=int, default=None,
                   help="NGRAM --speculative-ngram-max-bfs-breadth (default: the engine's)")
    p.add_argument("--always-speculate", action="store_true",
                   help="turn the controller off: speculate wherever a draft exists")
    p.add_argument("--out-dir", default=RESULTS_DIR)
    args = p.parse_args(argv)
    report = run(args)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "bench_speculative.json"), "w") as f:
        json.dump(report, f, indent=2)
    png = os.path.join(args.out_dir, "bench_speculative_accept.png")
    draw_histogram(report, png)
    print_table(report)
    print(f"\nverify passes by tokens committed: {report['hists']}")
    print(f"wrote {png} and bench_speculative.json in {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
