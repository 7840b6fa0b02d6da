"""Conformance through the Engine on the default model: regexes and JSON schemas x both backends.

One Engine per backend; every case runs 3 samples at temperature 1.0 plus one greedy sample,
all cases of a backend submitted as ONE batched generate call so they decode concurrently.
Every output that finished with "stop" must fullmatch its regex / validate against its schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import regex

from constrained import GRAMMAR_BACKENDS
from sglang_like import Engine

pytestmark = pytest.mark.slow  # the real default model

NUM_SAMPLES = 3  # at temperature 1.0, plus one greedy sample per case
# Regex answers may ramble digits at temperature 1.0 (checked as valid prefixes when cut);
# the JSON schemas bound their strings so every JSON sample finishes well inside its budget.
MAX_NEW_TOKENS = {"regex": 48, "json": 96}
IPV4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    req = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": req}


_NAME = {"type": "string", "maxLength": 16}

# name -> (kind, spec, what the user asks the model for)
CASES: dict[str, tuple[str, Any, str]] = {
    "int": ("regex", r"[-+]?[0-9]+", "How many legs does a spider have? Answer with a number."),
    "float": (
        "regex",
        r"[-+]?[0-9]*\.?[0-9]+",
        "What is the value of pi to two decimals? Answer with a number.",
    ),
    "ipv4": ("regex", IPV4, "Write the IP address of a home router."),
    "date": ("regex", r"\d{4}-\d{2}-\d{2}", "When did World War 2 end? Answer as YYYY-MM-DD."),
    "person_optional": (
        "json",
        _obj(
            {"name": _NAME, "age": {"type": "integer"}, "is_student": {"type": "boolean"}},
            required=["name", "age"],
        ),
        "Describe a person as a JSON object with name, age and optionally is_student.",
    ),
    "nested": (
        "json",
        _obj({"name": _NAME, "address": _obj({"city": _NAME, "country": _NAME})}),
        "Describe a company as JSON: its name and its address (city, country).",
    ),
    "array_min_max": (
        "json",
        _obj({"tags": {"type": "array", "items": _NAME, "minItems": 2, "maxItems": 3}}),
        "Give 2 or 3 tags for a blog post about cooking, as JSON with a tags list.",
    ),
    "enum": (
        "json",
        _obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}}),
        "Pick a t-shirt color and size, as JSON.",
    ),
    "int_range": (
        "json",
        _obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5}, "movie": _NAME}),
        "Rate a movie from 1 to 5 stars, as JSON with the rating and the movie title.",
    ),
    "string_pattern": (
        "json",
        _obj({"city": _NAME, "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}}),
        "Give a US city and its 5-digit postcode, as JSON.",
    ),
}


def spec_of(kind: str, spec: Any) -> str:
    """The spec as the grammar backend sees it (a schema as its JSON text)."""
    return spec if kind == "regex" else json.dumps(spec)


def constraint_params(kind: str, spec: Any) -> dict:
    return {"regex": spec} if kind == "regex" else {"json_schema": json.dumps(spec)}


def is_valid(kind: str, spec: Any, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    try:
        jsonschema.validate(json.loads(text), spec)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def is_valid_prefix(kind: str, spec: Any, text: str) -> bool:
    """A regex output cut by max_new_tokens must still be a prefix of some full match."""
    assert kind == "regex", "JSON cases are sized to finish; a cut JSON is a test-design bug"
    return regex.fullmatch(spec, text, partial=True) is not None


def chat_prompt(engine: Engine, kind: str, question: str) -> str:
    hint = "Reply with JSON only." if kind == "json" else "Reply with the answer only."
    return engine.apply_chat_template([{"role": "user", "content": f"{question} {hint}"}])


def run_cases(
    engine: Engine, cases: dict[str, tuple[str, Any, str]], num_samples: int = NUM_SAMPLES
) -> dict[str, list[dict]]:
    """All cases x (num_samples at temperature 1.0 + 1 greedy) in ONE batched generate call.

    The greedy output of each case is the last of its list.
    """
    prompts, params, names = [], [], []
    for name, (kind, spec, question) in cases.items():
        prompt = chat_prompt(engine, kind, question)
        for i in range(num_samples + 1):
            prompts.append(prompt)
            params.append(
                {
                    **constraint_params(kind, spec),
                    "max_new_tokens": MAX_NEW_TOKENS[kind],
                    "temperature": 0.0 if i == num_samples else 1.0,
                    "seed": 1000 + i,
                }
            )
            names.append(name)
    outputs = engine.generate(prompts, params)
    results: dict[str, list[dict]] = {name: [] for name in cases}
    for name, out in zip(names, outputs, strict=True):
        results[name].append(out)
    return results


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    eng = Engine(grammar_backend=request.param, max_total_tokens=16384)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def results(engine: Engine) -> dict[str, list[dict]]:
    """Every case, supported or not: a refused case must end alone with its reason."""
    out = run_cases(engine, CASES)
    _print_summary(engine, out)
    return out


def _finish_type(out: dict) -> str:
    return out["meta_info"]["finish_reason"]["type"]


def _print_summary(engine: Engine, results: dict[str, list[dict]]) -> None:
    backend = engine.server_args.grammar_backend
    print(f"\n{backend}: case             support  stop length valid")
    for name, outs in results.items():
        kind, spec, _ = CASES[name]
        claim = engine.grammar_backend.supports(kind, spec_of(kind, spec))
        stops = [o for o in outs if _finish_type(o) == "stop"]
        lengths = sum(_finish_type(o) == "length" for o in outs)
        valid = sum(is_valid(kind, spec, o["text"]) for o in stops)
        print(
            f"{backend}: {name:16} {'yes' if claim is True else 'refused':>8} "
            f"{len(stops):5} {lengths:6} {valid:3}/{len(stops)}"
        )


@pytest.mark.parametrize("name", list(CASES))
def test_output_conforms(engine: Engine, results: dict[str, list[dict]], name: str) -> None:
    kind, spec, _ = CASES[name]
    outs = results[name]
    assert len(outs) == NUM_SAMPLES + 1
    claim = engine.grammar_backend.supports(kind, spec_of(kind, spec))
    if claim is not True:
        for out in outs:  # refused cases end alone, with the backend's reason
            reason = out["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and claim in reason["message"], reason
            assert out["output_ids"] == []
        return
    for out in outs:
        text, reason = out["text"], out["meta_info"]["finish_reason"]
        assert reason["type"] in ("stop", "length"), reason
        if reason["type"] == "stop":
            assert reason["matched"] in engine.eos_token_ids, reason
            assert is_valid(kind, spec, text), f"{name}: {text!r} does not conform"
        else:
            assert is_valid_prefix(kind, spec, text), f"{name}: {text!r} is no valid prefix"
    if kind == "json":  # bounded schemas: every sample, greedy included, must finish
        assert all(_finish_type(o) == "stop" for o in outs), [o["text"] for o in outs]


def test_samples_at_temperature_one_differ(results: dict[str, list[dict]]) -> None:
    """The batch really sampled: across the free-form cases, sampled texts are not all equal."""
    texts = [o["text"] for name in ("person_optional", "nested") for o in results[name][:-1]]
    assert len(set(texts)) > 1, texts


# ---- a bad grammar inside a batch of good requests -----------------------------------------
BAD_SPECS: dict[str, dict] = {
    "unbalanced_regex": {"regex": "(ab"},
    "schema_not_json": {"json_schema": "{not json"},
    "schema_bad_type": {"json_schema": json.dumps({"type": "frobnicate"})},
}


def test_bad_grammar_fails_alone_in_batch(engine: Engine) -> None:
    kind, spec, question = CASES["enum"]
    good = {
        **constraint_params(kind, spec),
        "max_new_tokens": MAX_NEW_TOKENS[kind],
        "temperature": 0.0,
    }
    prompt = chat_prompt(engine, kind, question)
    params = [good, *({**p, "max_new_tokens": 16} for p in BAD_SPECS.values()), good]
    outs = engine.generate([prompt] * len(params), params)
    for out in (outs[0], outs[-1]):
        assert _finish_type(out) == "stop", out["meta_info"]
        assert is_valid(kind, spec, out["text"])
    assert outs[0]["text"] == outs[-1]["text"]  # greedy: the bad neighbours changed nothing
    for bad_name, out in zip(BAD_SPECS, outs[1:-1], strict=True):
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort", (bad_name, reason)
        assert reason["message"], bad_name
        assert out["text"] == "" and out["output_ids"] == []
    info = engine.get_server_info()
    assert info["kv_pool"]["used_slots"] == 0, info["kv_pool"]
    assert info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0


@pytest.mark.parametrize("bad_name", list(BAD_SPECS))
def test_bad_grammar_alone_raises_value_error(engine: Engine, bad_name: str) -> None:
    with pytest.raises(ValueError, match=r"\S"):
        engine.generate("Hi", {**BAD_SPECS[bad_name], "max_new_tokens": 4})
    assert engine.get_server_info()["kv_pool"]["used_slots"] == 0
