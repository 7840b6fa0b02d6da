"""Fork into 3 branches that run concurrently (sharing the prefix's KV), then join."""

from _common import make_backend, parse_args

import frontend_dsl as sgl


@sgl.function
def tips(s, topic, max_tokens):
    s += f"Here are three tips about {topic}.\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=max_tokens, stop="\n", temperature=0.7)
    forks.join()
    s += "Summary of the tips:\n"
    for i, tip in enumerate(s["tip"]):
        s += f"{i + 1}.{tip}\n"


def main() -> None:
    args = parse_args(__doc__, max_tokens=16)
    backend = make_backend(args)
    state = tips.run(topic="staying healthy", max_tokens=args.max_tokens)
    print(state.text())
    print("branch variables:", state["tip"])
    backend.shutdown()


if __name__ == "__main__":
    main()
