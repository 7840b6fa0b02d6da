"""Every DSL example runs to completion with a small token budget.

Each example loads nothing itself over HTTP, so all of them run against the one shared test
server (one model load); one of them also runs with the in-process backend (its own load).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "dsl"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))

# what each example must print (beyond exiting 0): a line proving its feature ran
EXPECTED = {
    "constrained_gen.py": ("legs:", "ip:", "person:"),
    "few_shot_qa.py": ("cached prompt tokens",),
    "fork_join.py": ("branch variables: [",),
    "multi_turn_chat.py": ("assistant:",),
    "react_agent.py": ("final answer:",),
    "select_choice.py": ("token_length_normalized:", "unconditional_likelihood_normalized:"),
}


def test_every_example_is_covered() -> None:
    assert SCRIPTS == sorted(EXPECTED)


def _run(script: str, *backend_args: str) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *backend_args, "--max-tokens", "12"],
        capture_output=True, text=True, timeout=240, cwd=EXAMPLES,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for needle in EXPECTED[script]:
        assert needle in out.stdout, out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_over_http(server_url: str, script: str) -> None:
    _run(script, "--backend", "http", "--url", server_url)


@pytest.mark.slow
def test_example_runs_in_process() -> None:
    _run("multi_turn_chat.py", "--backend", "local")


@pytest.mark.slow
def test_tool_call_example_runs_in_process() -> None:
    """examples/dsl_tool_call.py as documented: no arguments, the in-process default model."""
    script = EXAMPLES.parent / "dsl_tool_call.py"
    out = subprocess.run([sys.executable, str(script), "--max-tokens", "8"], capture_output=True,
                         text=True, timeout=240, cwd=script.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    for needle in ("tool call: ", "tool result: ", "answer: "):
        assert needle in out.stdout, out.stdout
