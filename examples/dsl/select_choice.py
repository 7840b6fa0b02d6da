"""select(): pick among choices by likelihood, all choices scored in one batched prefill."""

from _common import make_backend, parse_args

import frontend_dsl as sgl


@sgl.function
def classify(s, statement, method):
    s += f"Statement: {statement}\nIs the statement true or false? Answer: "
    s += sgl.select("verdict", choices=["true", "false"], choices_method=method)


def main() -> None:
    args = parse_args(__doc__)
    backend = make_backend(args)
    for method in ("token_length_normalized", "greedy_token_selection",
                   "unconditional_likelihood_normalized"):
        state = classify.run(statement="Paris is the capital of France.", method=method)
        scores = state.get_meta_info("verdict")["normalized_prompt_logprobs"]
        print(f"{method}: {state['verdict']}  (mean logprobs {[round(x, 3) for x in scores]})")
    backend.shutdown()


if __name__ == "__main__":
    main()
