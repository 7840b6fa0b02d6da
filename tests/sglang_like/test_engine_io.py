"""Prompt tokenization and input normalization at the engine's edge."""

from __future__ import annotations

import pytest

from sglang_like.engine_core.io import _stop_holdback, encode_prompt, prepare_inputs


class _BosTokenizer:
    """Adds BOS (id 1) like a Llama tokenizer's post-processor; '<s>' in text is also BOS."""

    bos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [1] if text.startswith("<s>") else []
        ids += [ord(c) for c in text.removeprefix("<s>")]
        return ([1] if add_special_tokens else []) + ids


@pytest.mark.parametrize(
    ("text", "want"),
    [("hi", [1, 104, 105]), ("<s>hi", [1, 104, 105])],  # BOS added once, never twice
)
def test_raw_prompts_get_one_bos(text, want):
    assert encode_prompt(_BosTokenizer(), text) == want


@pytest.mark.parametrize(
    ("text", "stops", "held"),
    [("abc\n", ["\n\n"], 1), ("abc", ["\n\n"], 0), ("say EN", ["END", "x"], 2), ("", ["a"], 0)],
)
def test_stream_holds_back_a_possible_stop_prefix(text, stops, held):
    assert _stop_holdback(text, stops) == held


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": None, "input_ids": None}, "exactly one"),
        ({"prompt": "a", "input_ids": [1]}, "exactly one"),
        ({"prompt": 5, "input_ids": None}, "string"),
        ({"prompt": ["a", "b"], "input_ids": None, "sampling_params": [{}]}, "sampling_params"),
        ({"prompt": ["a", "b"], "input_ids": None, "rid": ["x"]}, "rids"),
    ],
)
def test_bad_input_shapes(kwargs, message):
    args = {"sampling_params": None, "rid": None, **kwargs}
    with pytest.raises(ValueError, match=message):
        prepare_inputs(_BosTokenizer(), args["prompt"], args["input_ids"],
                       args["sampling_params"], args["rid"])


def test_lists_and_rids_line_up():
    items, is_batch = prepare_inputs(_BosTokenizer(), ["a", "b"], None, {"n": 1}, "base")
    assert is_batch and [rid for _, _, rid in items] == ["base-0", "base-1"]
    assert [ids for ids, _, _ in items] == [[1, 97], [1, 98]]
    items, is_batch = prepare_inputs(_BosTokenizer(), None, [5, 6], None, None)
    assert not is_batch and items == [([5, 6], None, None)]
