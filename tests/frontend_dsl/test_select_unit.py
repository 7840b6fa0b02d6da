"""select(): request shape (one batched scoring request) and the three choices methods."""

from __future__ import annotations

import pytest

import frontend_dsl as sgl
from frontend_dsl.choices import choice_token_logprobs, decide

# The fake scores character-tokens: "a" -1.0; a first "b" -0.5, each further "b" -3.0;
# unconditionally "a" -0.1 and "b" -3.0. So normalized -> "a", greedy first token -> "bbbb",
# unconditional-normalized -> "bbbb" (its later tokens are as likely with or without context).
CHOICES = ["a", "bbbb"]


@pytest.mark.parametrize(
    ("method", "expected", "num_requests"),
    [
        ("token_length_normalized", "a", 2),
        ("greedy_token_selection", "bbbb", 2),
        ("unconditional_likelihood_normalized", "bbbb", 3),
    ],
)
def test_select_methods_and_request_shape(fake, method, expected, num_requests) -> None:
    @sgl.function
    def prog(s):
        s += "Pick: " + sgl.select("c", choices=CHOICES, choices_method=method) + "."

    backend = fake()
    state = prog.run(backend=backend)
    assert state["c"] == expected
    assert state.text() == f"Pick: {expected}."
    assert len(backend.bodies) == num_requests
    warm, scoring = backend.bodies[:2]
    assert warm == {"text": "Pick: ", "sampling_params": {"max_new_tokens": 0}}
    assert scoring == {
        "text": ["Pick: a", "Pick: bbbb"],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": len("Pick: ") - 2,
    }
    meta = state.get_meta_info("c")
    assert [len(lp) for lp in meta["input_token_logprobs"]] == [1, 4]
    if num_requests == 3:
        assert backend.bodies[2]["input_ids"] == [[ord("a")], [ord("b")] * 4]


def test_gen_with_choices_is_select(fake) -> None:
    @sgl.function
    def prog(s):
        s += "X" + sgl.gen("c", choices=CHOICES)

    backend = fake()
    assert prog.run(backend=backend)["c"] == "a"
    assert isinstance(backend.bodies[1]["text"], list)


@pytest.mark.parametrize(
    ("entries", "choice", "expected_len"),
    [
        ([[-1, 1, "x"], [-1, 2, " ye"], [-1, 3, "s"]], " yes", 2),
        ([[-1, 1, "x"], [-1, 2, ": y"], [-1, 3, "es"]], "yes", 2),  # token straddles boundary
        ([[-1, 1, None], [-1, 2, None], [-1, 3, None]], "yes", 1),  # no texts: fallback count
    ],
)
def test_choice_tokens_are_found_from_the_end(entries, choice, expected_len) -> None:
    assert len(choice_token_logprobs(entries, choice, fallback_count=1)) == expected_len


def test_decide_rejects_unknown_method() -> None:
    with pytest.raises(ValueError):
        decide("nope", ["a"], [[[-1.0, 1, "a"]]])
