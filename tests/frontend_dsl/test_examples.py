"""Every DSL example runs to completion on the in-process backend with a small token budget."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "dsl"
SCRIPTS = sorted(
    p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith(("_", "bench_"))
)

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


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script: str) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--backend", "local", "--max-tokens", "24"],
        capture_output=True, text=True, timeout=240, cwd=EXAMPLES,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for needle in EXPECTED[script]:
        assert needle in out.stdout, out.stdout
