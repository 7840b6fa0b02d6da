"""How fast any copying drafter could make batch-1 decode on this machine: a ceiling.

    python -m benchmarks.bench_spec_ceiling [--workloads extraction code chat] [--max-depth 5]
                                            [--rounds 3]

NGRAM-style drafters (and EAGLE's copied branch) continue the text after an earlier place
where the request's last token appeared: in its own prompt and output, or in an earlier
request's. This script prices the best such drafter there could be, on the speculative
bench's prompts, with step costs measured on this machine in the same run:

1. An in-process engine decodes each workload's prompts one at a time (greedy, NGRAM drafting
   every step, `--max-depth` tokens deep), and every step's cost is recorded by its row count
   (the speculation controller's own measure: the step less its drafting, so the verify
   rows, the tree walk and the scheduler's Python are in), and the forward alone beside it.
   A line through the medians by row count prices a step of r rows (one row, and a row more).
2. The clairvoyant drafter is replayed over the same outputs: at each step it knows the
   future, looks at every earlier place the last token appeared (the request's own tokens,
   and the earlier requests of the workload, as NGRAM's tables hold them), and drafts exactly
   the longest continuation there that the target will accept (up to `--max-depth`), so it
   never pays for a rejected row. Its step costs what a step of that many rows measured.

The ceiling is plain decoding's time (one-row steps) over the clairvoyant's; "forward only"
prices both with the forward alone, as if every line of Python around it were free. The
NGRAM columns are the real drafter in the same run (drafting every step, the controller off:
`bench_speculative` measures it as users run it). Each round is priced by its own steps (the
machine's speed drifts between rounds); the table gives the rounds' median and range.
A target above the ceiling cannot be met by a copying drafter here; only cheaper verify rows
(a faster machine's matmuls) or better drafts from elsewhere (a draft model) can move it.
The table is also written to `--out` (bench_results/spec_ceiling.json).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import numpy as np
from tqdm import tqdm

from benchmarks.common import RESULTS_DIR, WORKLOADS


def _agreement(text: np.ndarray, last: int, future: np.ndarray, max_depth: int,
               end: int) -> int:
    """The longest run of `future` (up to max_depth) that follows an occurrence of `last` in
    text[:end - 1] and continues inside text[:end]."""
    starts = np.flatnonzero(text[: end - 1] == last) + 1  # where a continuation starts
    if starts.size == 0 or future.size == 0:
        return 0
    depth = min(max_depth, future.size)
    best = 0
    for k in range(depth):  # grow the agreement one token at a time over the survivors
        inside = starts + k < end
        starts = starts[inside]
        if starts.size == 0:
            break
        starts = starts[text[starts + k] == future[k]]
        if starts.size == 0:
            break
        best = k + 1
    return best


def clairvoyant(prompt_ids: list[list[int]], output_ids: list[list[int]], max_depth: int
                ) -> list[int]:
    """Per decode step of each request in turn (the first output token is the prefill's), the
    tokens the clairvoyant copying drafter gets accepted: the earlier requests' texts (prompt
    and output) and the request's own tokens so far are where it may copy from."""
    history: list[np.ndarray] = []
    accepted: list[int] = []
    for prompt, out in zip(prompt_ids, output_ids, strict=True):
        seq = np.asarray(prompt + out, dtype=np.int64)
        i = len(prompt) + 1
        while i < len(seq):
            future = seq[i: i + max_depth]
            last = int(seq[i - 1])
            k = _agreement(seq, last, future, max_depth, i)
            for text in history:
                if k == future.size:
                    break
                k = max(k, _agreement(text, last, future, max_depth, text.size))
            accepted.append(k)
            i += k + 1
        history.append(seq)
    return accepted


def _cost_line(samples: dict[int, list[float]]) -> tuple[float, float]:
    """(a one-row step's seconds, what each row more adds): a line through the median cost
    of each row count, weighted by how many steps measured it (a count seen a few times, as
    NGRAM's 2- and 4-row trees are, moves it little; a verify's rows are matmul rows, whose
    time grows in step with their number up to the kernels' 8 rows a pass)."""
    pts = [(r, statistics.median(v), len(v)) for r, v in samples.items() if v]
    n = sum(w for _, _, w in pts)
    mr = sum(r * w for r, _, w in pts) / n
    mc = sum(c * w for _, c, w in pts) / n
    var = sum(w * (r - mr) ** 2 for r, _, w in pts)
    slope = sum(w * (r - mr) * (c - mc) for r, c, w in pts) / var if var else 0.0
    return mc - slope * (mr - 1), slope


def _price(steps_rows: list[int], line: tuple[float, float]) -> float:
    """Seconds of steps of these row counts."""
    one, per_row = line
    return sum(one + per_row * (r - 1) for r in steps_rows)


def _judge(log: list[tuple[str, int, float, float, float]],
           outs: dict[str, list[tuple[list[int], list[int], int]]], max_depth: int) -> dict:
    """One round: the step's cost line, NGRAM as run and the clairvoyant's ceiling."""
    by_rows: dict[str, dict[int, list[float]]] = {"step": collections.defaultdict(list),
                                                  "forward": collections.defaultdict(list)}
    for _, rows, _, less_drafting, forward in log:
        by_rows["step"][rows].append(less_drafting)
        by_rows["forward"][rows].append(forward)
    steps, fwd = _cost_line(by_rows["step"]), _cost_line(by_rows["forward"])
    workloads = {}
    for w, runs in outs.items():
        tokens = sum(len(o) - 1 for _, o, _ in runs)  # decode tokens (the first is prefill's)
        verifies = sum(v for _, _, v in runs)
        # NGRAM as run (its drafting included) against one-row steps for the same tokens
        ngram_s = sum(s for lw, _, s, _, _ in log if lw == w)
        rows = [k + 1 for k in clairvoyant([i for i, _, _ in runs], [o for _, o, _ in runs],
                                           max_depth)]
        workloads[w] = {"decode_tokens": tokens, "ngram_accept": tokens / verifies,
                        "ngram_x": tokens * steps[0] / ngram_s,
                        "clairvoyant_accept": sum(rows) / len(rows),
                        "ceiling_x": tokens * steps[0] / _price(rows, steps),
                        "ceiling_forward_x": tokens * fwd[0] / _price(rows, fwd)}
    return {"step_s": steps, "forward_s": fwd, "workloads": workloads,
            "by_rows": {r: (statistics.median(v), len(v))
                        for r, v in sorted(by_rows["step"].items())}}


def main(argv: list[str] | None = None) -> None:
    from sglang_like import Engine

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_spec_ceiling", description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["extraction", "code", "chat"],
                    choices=list(WORKLOADS))
    ap.add_argument("--max-depth", type=int, default=5,
                    help="draft tokens a step, both drafters (NGRAM's default is 5)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3,
                    help="each a pass over the workloads, priced by its own step costs")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "spec_ceiling.json"))
    args = ap.parse_args(argv)

    engine = Engine(engine_in_process=True, speculative_algorithm="NGRAM",
                    speculative_auto_disable=False,
                    speculative_num_steps=args.max_depth,
                    speculative_num_draft_tokens=args.max_depth + 1)
    sched = engine._client.core.scheduler
    # per decode step: (workload, rows, the step, the step less its drafting, the forward)
    log: list[tuple[str, int, float, float, float]] = []
    current: dict = {"workload": None}
    record = sched.spec_controller.record_forward

    def record_forward(num_rows: int, seconds: float) -> None:
        current["rows"], current["less_drafting"] = num_rows, seconds
        record(num_rows, seconds)

    def timed(fn):
        def run(batch, *a, **k):
            t0 = time.perf_counter()
            out = fn(batch, *a, **k)
            current["forward"] = time.perf_counter() - t0
            return out
        return run

    step = sched.step

    def timed_step():
        current["rows"] = None
        t0 = time.perf_counter()
        out = step()
        seconds = time.perf_counter() - t0
        rows = current["rows"]
        if current["workload"] and rows is not None and rows <= args.max_depth + 1:
            log.append((current["workload"], rows, seconds, current["less_drafting"],
                        current["forward"]))
        return out

    sched.spec_controller.record_forward = record_forward
    sched.runner.forward = timed(sched.runner.forward)
    sched.runner.forward_greedy = timed(sched.runner.forward_greedy)
    sched.step = timed_step
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    rounds: list[dict] = []
    try:
        hello = engine.apply_chat_template([{"role": "user", "content": "Hello"}])
        engine.generate(hello, {"max_new_tokens": 16})  # warm-up
        prompts = {w: [engine.tokenizer.encode(engine.apply_chat_template(
            [{"role": "user", "content": p}])) for p in WORKLOADS[w]] for w in args.workloads}
        for _ in tqdm(range(args.rounds), unit="round"):
            log.clear()
            outs: dict[str, list[tuple[list[int], list[int], int]]] = {}
            for w in args.workloads:
                engine.flush_cache()  # the bench's cells start with no earlier texts either
                outs[w] = []
                for ids in prompts[w]:
                    current["workload"] = w
                    o = engine.generate(input_ids=ids, sampling_params=params)
                    current["workload"] = None
                    outs[w].append((ids, o["output_ids"], o["meta_info"]["spec_verify_ct"]))
            rounds.append(_judge(list(log), outs, args.max_depth))
    finally:
        engine.shutdown()

    for i, r in enumerate(rounds):
        (one, per_row), (f_one, f_per_row) = r["step_s"], r["forward_s"]
        print(f"round {i + 1}: a step {1e3 * one:.2f} ms, {1e3 * per_row:.3f} ms a row more "
              f"({per_row / one:.2f} of it); the forward alone {1e3 * f_one:.2f} ms, "
              f"{1e3 * f_per_row:.3f} ms a row more; step ms by rows (median, steps): "
              + ", ".join(f"{k}: {1e3 * v:.2f} ({n})" for k, (v, n) in r["by_rows"].items()))
    print(f"\nmax depth {args.max_depth}, {args.rounds} rounds: the median of the rounds "
          "(min .. max)")
    cols = ("ngram_accept", "ngram_x", "clairvoyant_accept", "ceiling_x", "ceiling_forward_x")
    names = ("NGRAM acc", "NGRAM x (as run)", "clairvoyant acc", "ceiling x",
             "ceiling x (forward only)")
    print(f"{'workload':<11} " + " ".join(f"{n:>24}" for n in names))
    summary = {}
    for w in args.workloads:
        summary[w] = {}
        cells = []
        for c in cols:
            vals = [r["workloads"][w][c] for r in rounds]
            summary[w][c] = statistics.median(vals)
            cells.append(f"{statistics.median(vals):.2f} ({min(vals):.2f} .. {max(vals):.2f})")
        print(f"{w:<11} " + " ".join(f"{c:>24}" for c in cells))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"max_depth": args.max_depth, "median": summary, "rounds": rounds}, f,
                  indent=1)


if __name__ == "__main__":
    main()
