"""A ReAct-style loop: the model picks an action with select(), writes the tool input under a
regex, a Python tool runs it, and the observation goes back into the prompt."""

from _common import make_backend, parse_args

import frontend_dsl as sgl

EXPR_REGEX = r"[1-9][0-9]{0,2} [-+*] [1-9][0-9]{0,2}"


def calculator(expression: str) -> int:
    """The tool: evaluate `a op b` exactly (no eval())."""
    left, op, right = expression.split(" ")
    a, b = int(left), int(right)
    return {"+": a + b, "-": a - b, "*": a * b}[op]


@sgl.function
def react(s, question, max_steps):
    s += ("Answer questions using a calculator.\n"
          "Question: What is 12 times 3?\nThought: I need to multiply.\n"
          "Action: calculate[12 * 3]\nObservation: 36\nAction: finish[36]\n\n")
    s += f"Question: {question}\n"
    for step in range(max_steps):
        s += "Thought:" + sgl.gen(f"thought_{step}", max_tokens=12, stop="\n", temperature=0)
        s += "\nAction: " + sgl.select(f"action_{step}", choices=["calculate", "finish"])
        if s[f"action_{step}"] == "finish":
            s += "[" + sgl.gen("answer", regex=r"-?[0-9]{1,7}", max_tokens=8) + "]\n"
            return s["answer"]
        s += "[" + sgl.gen(f"input_{step}", regex=EXPR_REGEX, max_tokens=12) + "]\n"
        s += f"Observation: {calculator(s[f'input_{step}'])}\n"
    return None


def main() -> None:
    args = parse_args(__doc__)
    backend = make_backend(args)
    state = react.run(question="What is 25 plus 17?", max_steps=2)
    print(state.text())
    print("final answer:", state.ret_value)
    backend.shutdown()


if __name__ == "__main__":
    main()
