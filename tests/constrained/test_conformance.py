"""Conformance: >= 30 regexes and JSON schemas x both backends, sampled from random logits."""

from __future__ import annotations

import json
import re
import zlib

import jsonschema
import pytest
import torch
from constrained_testlib import sample_masked  # noqa: I001

from constrained import GRAMMAR_BACKENDS, Grammar, GrammarBackend, InvalidGrammar

# The regexes SGLang's frontend sends for gen(dtype=int / float / bool / str).
SGLANG_INT = r"[-+]?[0-9]+[ \n]*"
SGLANG_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
SGLANG_BOOL = r"(True|False)"
SGLANG_STR = r"\"[\w\d\s]*\""
IPV4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"


def _obj(properties: dict, required: list[str] | None = None, **extra: object) -> dict:
    schema = {"type": "object", "properties": properties, **extra}
    schema["required"] = list(properties) if required is None else required
    return schema


REGEX_CASES: dict[str, str] = {
    "sglang_int": SGLANG_INT,
    "sglang_float": SGLANG_FLOAT,
    "sglang_bool": SGLANG_BOOL,
    "sglang_str": SGLANG_STR,
    "ipv4": IPV4,
    "a_star_b_opt_a": r"a*b?a",
    "decimal": r"-?[0-9]+\.[0-9]{1,3}",
    "optional_fraction": r"[0-9]{1,4}(\.5)?",
    "date": r"\d{4}-\d{2}-\d{2}",
    "email": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
    "choice": r"(apple|banana|cherry pie)",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "unicode_words": r"(café|naïve|日本語)( (café|naïve|日本語)){0,2}",
    "hex_color": r"#[0-9a-fA-F]{6}",
    "title_words": r"[A-Z][a-z]{0,10}( [A-Z][a-z]{0,10}){0,2}",
    "json_number": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
}

_STR = {"type": "string", "maxLength": 12}
SCHEMA_CASES: dict[str, dict] = {
    "any_object": {"type": "object"},
    "person": _obj({"name": {"type": "string"}, "age": {"type": "integer"}}),
    "nested": _obj(
        {"user": _obj({"id": {"type": "integer"}, "email": _STR}), "ok": {"type": "boolean"}}
    ),
    "array_min_max": _obj(
        {"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}}
    ),
    "enum": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "const": _obj({"kind": {"const": "point"}, "x": {"type": "integer"}}),
    "int_range": _obj({"n": {"type": "integer", "minimum": 10, "maximum": 99}}),
    "number_range": _obj({"p": {"type": "number", "minimum": 0, "maximum": 1}}),
    "decimal_number": _obj({"price": {"type": "number"}}),
    "string_pattern": _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    "string_lengths": _obj({"s": {"type": "string", "minLength": 2, "maxLength": 5}}),
    "any_of": _obj({"v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 6}]}}),
    "one_of": _obj({"v": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}}),
    "optional_props": _obj({"a": {"type": "integer"}, "b": _STR, "c": {"type": "boolean"}}, ["a"]),
    "bool_null": _obj({"flag": {"type": "boolean"}, "nothing": {"type": "null"}}),
    "array_of_objects": {
        "type": "array",
        "items": _obj({"id": {"type": "integer"}}),
        "maxItems": 3,
    },
    "nested_arrays": _obj(
        {
            "m": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            }
        }
    ),
    "exclusive_min": _obj({"k": {"type": "integer", "exclusiveMinimum": 0}}),
    "long_keys": _obj(
        {
            "the_first_rather_long_key": {"type": "integer"},
            "another_quite_long_key_name": {"type": "boolean"},
        }
    ),
}

CASES: list[tuple[str, str, str]] = [
    *(("regex", name, spec) for name, spec in REGEX_CASES.items()),
    *(("json", name, json.dumps(schema)) for name, schema in SCHEMA_CASES.items()),
]
NUM_SAMPLES = 1  # per jump-forward setting (off, on); CI runs on 2 shared cores


def is_valid(kind: str, spec: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    try:
        jsonschema.validate(json.loads(text), json.loads(spec))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_suite_is_big_enough() -> None:
    assert len(CASES) >= 30
    assert len(REGEX_CASES) >= 10 and len(SCHEMA_CASES) >= 15


def test_support_table(backends: dict[str, GrammarBackend]) -> None:
    """Prints which backend claims which case; xgrammar must claim every case."""
    lines = [f"{'case':28}" + "".join(f"{name:>12}" for name in GRAMMAR_BACKENDS)]
    for kind, name, spec in CASES:
        claims = {b: backends[b].supports(kind, spec) for b in GRAMMAR_BACKENDS}
        marks = "".join(f"{'yes' if c is True else 'refused':>12}" for c in claims.values())
        lines.append(f"{kind + ':' + name:28}{marks}")
        assert claims["xgrammar"] is True, name
    print("\n" + "\n".join(lines))


@pytest.mark.parametrize("backend_name", GRAMMAR_BACKENDS)
@pytest.mark.parametrize(("kind", "name", "spec"), CASES, ids=[c[1] for c in CASES])
def test_sampled_outputs_are_valid(
    backends: dict[str, GrammarBackend], backend_name: str, kind: str, name: str, spec: str
) -> None:
    backend = backends[backend_name]
    claim = backend.supports(kind, spec)
    compiled = backend.compile(kind, spec)
    if claim is not True:
        assert isinstance(compiled, InvalidGrammar) and claim in compiled.message
        return
    assert isinstance(compiled, Grammar), compiled
    generator = torch.Generator().manual_seed(zlib.crc32(f"{backend_name}/{name}".encode()))
    for sample_index in range(2 * NUM_SAMPLES):
        grammar = backend.compile(kind, spec)
        jump_forward = sample_index % 2 == 1
        sample = sample_masked(
            grammar, backend.tokenizer_info, generator, jump_forward=jump_forward
        )
        assert sample.is_terminated, f"no EOS within the cap: {sample.text!r}"
        assert grammar.is_terminated()
        assert is_valid(kind, spec, sample.text), f"jump_forward={jump_forward}: {sample.text!r}"
