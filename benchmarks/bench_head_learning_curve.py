"""What more training buys the EAGLE-3 head: acceptance against the data it was trained on.

    python -m benchmarks.bench_head_learning_curve                  # every head in git history
    python -m benchmarks.bench_head_learning_curve --heads DIR ...  # or these folders

Each head the project shipped is in git history (every commit that changed the shipped
head's weights); each was continued from the one before, so its card lists the data of every
run in its lineage. For each head: the training tokens of its lineage (the sum of the
card's "N tokens in all" lines), then tokens per verify on the speculative bench's
prompts (greedy, every step drafting the default 3-token chain, `--max-new-tokens` each,
one request at a time). Then a least-squares line of acceptance over log10(tokens), per
workload, over the heads from `--fit-from` tokens on, and the data that line puts at the
acceptance the issue asks for (`--goal`). Table printed, curve drawn to
`--out-dir`/head_learning_curve.png.

A line over log(data) is the usual shape of such curves over a decade or two; read its
extrapolation as an order of magnitude, not a promise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

from tqdm import tqdm

from benchmarks.common import REPO_ROOT, RESULTS_DIR, WORKLOADS

HEAD_DIR = "sglang_like/speculative/heads/smollm2-135m-instruct-eagle3"
_TOKENS = re.compile(r"(\d+) tokens in all")


def lineage_tokens(card: str) -> int:
    """Training tokens of a head and every head it was continued from (its card keeps each
    run's data line)."""
    return sum(int(m) for m in _TOKENS.findall(card))


def heads_from_git(repo: str, into: str) -> list[tuple[str, str]]:
    """(label, folder) of every shipped head in the history of `repo`, oldest first."""
    log = subprocess.run(
        ["git", "-C", repo, "log", "--reverse", "--format=%h", "--",
         f"{HEAD_DIR}/model.safetensors"], check=True, capture_output=True, text=True)
    out = []
    for commit in log.stdout.split():
        folder = os.path.join(into, commit)
        os.makedirs(folder, exist_ok=True)
        for name in ("config.json", "model.safetensors", "README.md"):
            blob = subprocess.run(["git", "-C", repo, "show", f"{commit}:{HEAD_DIR}/{name}"],
                                  check=True, capture_output=True).stdout
            with open(os.path.join(folder, name), "wb") as f:
                f.write(blob)
        out.append((commit, folder))
    return out


def acceptance(path: str, workloads: list[str], max_new_tokens: int) -> dict[str, float]:
    """Tokens per verify of the head at `path` per workload (greedy, speculating every step)."""
    from sglang_like import Engine

    engine = Engine(engine_in_process=True, max_total_tokens=16384,
                    speculative_algorithm="EAGLE3", speculative_draft_model_path=path,
                    speculative_auto_disable=False)
    try:
        out = {}
        for w in workloads:
            tokens = verifies = 0
            for q in WORKLOADS[w]:
                prompt = engine.apply_chat_template([{"role": "user", "content": q}])
                meta = engine.generate(prompt, {"max_new_tokens": max_new_tokens,
                                                "temperature": 0})["meta_info"]
                # the first token is the prefill's; the rest came from verifies
                tokens += meta["completion_tokens"] - 1
                verifies += meta["spec_verify_ct"]
            out[w] = tokens / max(verifies, 1)
        return out
    finally:
        engine.shutdown()


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """(slope, intercept) of the least-squares line; None below two distinct xs."""
    n = len(xs)
    if n < 2 or max(xs) == min(xs):
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_head_learning_curve",
        description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs="*", default=None,
                    help="head folders (with their cards); default: every head in git history")
    ap.add_argument("--workloads", nargs="+", default=["chat", "extraction", "code"])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--goal", type=float, default=2.5)
    ap.add_argument("--fit-from", type=float, default=5e5,
                    help="fit over heads trained on at least this many tokens")
    ap.add_argument("--out-dir", default=RESULTS_DIR)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        if args.heads:
            heads = [(os.path.basename(os.path.normpath(h)), h) for h in args.heads]
        else:
            heads = heads_from_git(REPO_ROOT, tmp)
        rows = []
        for label, path in tqdm(heads, unit="head"):
            with open(os.path.join(path, "README.md"), encoding="utf-8") as f:
                tokens = lineage_tokens(f.read())
            rows.append({"head": label, "tokens": tokens,
                         "accept": acceptance(path, args.workloads, args.max_new_tokens)})
    rows.sort(key=lambda r: r["tokens"])

    print(f"\ntokens per verify (3-token chain, greedy, {args.max_new_tokens} new tokens, "
          "one request at a time)")
    print(f"{'head':<10}{'train tokens':>14}" + "".join(f"{w:>12}" for w in args.workloads))
    for r in rows:
        print(f"{r['head']:<10}{r['tokens']:>14,}"
              + "".join(f"{r['accept'][w]:>12.2f}" for w in args.workloads))
    fits = {}
    used = [r for r in rows if r["tokens"] >= args.fit_from]
    print(f"\nline over log10(tokens), heads from {args.fit_from:,.0f} tokens ({len(used)}):")
    for w in args.workloads:
        line = fit_line([math.log10(r["tokens"]) for r in used], [r["accept"][w] for r in used])
        if line is None:
            print(f"  {w}: too few heads to fit")
            continue
        slope, icpt = line
        need = 10 ** ((args.goal - icpt) / slope) if slope > 0 else math.inf
        fits[w] = {"per_decade": slope, "intercept": icpt, "tokens_for_goal": need}
        print(f"  {w:<11} +{slope:.3f} tokens/verify per 10x data; {args.goal} at "
              + (f"~{need:.1e} tokens ({need / used[-1]['tokens']:.0f}x the last head's)"
                 if math.isfinite(need) else "never (not rising)"))
    os.makedirs(args.out_dir, exist_ok=True)
    report = {"rows": rows, "fits": fits, "args": vars(args)}
    with open(os.path.join(args.out_dir, "head_learning_curve.json"), "w",
              encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    draw(report, os.path.join(args.out_dir, "head_learning_curve.png"))
    return 0


def draw(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, args = report["rows"], report["args"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["tokens"] for r in rows]
    for w in args["workloads"]:
        ax.plot(xs, [r["accept"][w] for r in rows], "o-", label=w)
        fit = report["fits"].get(w)
        if fit:
            lo = math.log10(args["fit_from"])
            hi = max(math.log10(max(xs)) + 1, math.log10(min(fit["tokens_for_goal"], 1e12)))
            grid = [10 ** (lo + (hi - lo) * i / 50) for i in range(51)]
            ax.plot(grid, [fit["intercept"] + fit["per_decade"] * math.log10(g) for g in grid],
                    "--", color=ax.lines[-1].get_color(), alpha=0.5)
    ax.axhline(args["goal"], color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (the head's lineage)")
    ax.set_ylabel("tokens per verify (3-token chain, greedy)")
    ax.set_title("Shipped EAGLE-3 head: acceptance against its training data")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
