"""Few-shot QA over a batch with run_batch: the shared few-shot prefix is cached once."""

import time

from _common import make_backend, parse_args

import frontend_dsl as sgl

EXAMPLES = (
    "Q: What is the capital of Italy?\nA: Rome\n\n"
    "Q: What is the capital of Japan?\nA: Tokyo\n\n"
    "Q: What is the capital of Canada?\nA: Ottawa\n\n"
)
QUESTIONS = ["France", "Germany", "Spain", "Egypt", "Brazil", "Kenya", "India", "Peru"]


@sgl.function
def few_shot_qa(s, country, max_tokens):
    s += EXAMPLES
    s += f"Q: What is the capital of {country}?\nA:"
    s += sgl.gen("answer", max_tokens=max_tokens, stop="\n", temperature=0)


def main() -> None:
    args = parse_args(__doc__, max_tokens=8)
    backend = make_backend(args)
    prefix = few_shot_qa.trace(max_tokens=args.max_tokens).static_prefix
    print(f"static prefix found by trace(): {prefix[:40]!r}... ({len(prefix)} chars)")
    t0 = time.perf_counter()
    states = few_shot_qa.run_batch(
        [{"country": c, "max_tokens": args.max_tokens} for c in QUESTIONS], progress_bar=True)
    elapsed = time.perf_counter() - t0
    for country, state in zip(QUESTIONS, states, strict=True):
        cached = state.get_meta_info("answer").get("cached_tokens")
        print(f"{country:>8}: {state['answer'].strip()!r}  (cached prompt tokens: {cached})")
    print(f"{len(QUESTIONS)} programs in {elapsed:.1f}s")
    backend.shutdown()


if __name__ == "__main__":
    main()
