"""Multi-turn chat: roles rendered with the model's own chat template."""

from _common import make_backend, parse_args

import frontend_dsl as sgl


@sgl.function
def multi_turn(s, question_1, question_2, max_tokens):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=max_tokens, temperature=0))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=max_tokens, temperature=0))


def main() -> None:
    args = parse_args(__doc__)
    backend = make_backend(args)
    state = multi_turn.run(question_1="What is the capital of France?",
                           question_2="And what is it famous for?", max_tokens=args.max_tokens)
    for m in state.messages():
        print(f"{m['role']:>9}: {m['content']}")
    backend.shutdown()


if __name__ == "__main__":
    main()
