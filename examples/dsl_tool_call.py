"""A DSL program that calls a Python tool and continues: gen(tools=...) writes one JSON call,
constrained to the tools' schemas; call_tool runs it; the result goes back into the chat.

    python examples/dsl_tool_call.py                       # in-process, the default model
    python examples/dsl_tool_call.py --backend http --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse

import frontend_dsl as sgl


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def word_length(word: str) -> int:
    """The number of letters in a word."""
    return len(word)


TOOLS = [add, word_length]


@sgl.function
def assistant_with_tools(s, question, max_tokens):
    s += sgl.system(sgl.describe_tools(TOOLS))
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("call", tools=TOOLS, max_tokens=48, temperature=0))
    s["result"] = sgl.call_tool(s, "call")
    s += sgl.user(f"The tool returned {s['result']}. Now answer the question.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["local", "http"], default="local")
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.backend == "http":
        backend = sgl.RuntimeEndpoint(args.url)
    else:
        backend = sgl.Runtime(max_total_tokens=16384)
    try:
        state = assistant_with_tools.run(question="What is 123 plus 456?",
                                         max_tokens=args.max_tokens, backend=backend)
        name, arguments = state.tool_call("call")
        print(f"tool call: {name}({arguments})")
        print(f"tool result: {state['result']}")
        print(f"answer: {state['answer'].strip()}")
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
