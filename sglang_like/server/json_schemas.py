"""JSON-schema facts for the OpenAPI document that the request checks enforce in code.

Pydantic validates the types; ranges, "not empty" and "exactly one of" are checked by
protocol.py and `SamplingParams.validate` with their own 400 messages. The annotations here
put the same rules into the models' JSON schemas without changing validation, so the document
says what the server accepts (a test holds the ranges to SamplingParams at their bounds).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StrictInt, TypeAdapter, WithJsonSchema

from sglang_like.sampling_params import (
    MAX_DRY_BREAKER_CHARS,
    MAX_DRY_BREAKERS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

_MAX_TOKENS = 1 << 20

# SamplingParams.validate's ranges, per field (added to the field's JSON type).
SAMPLING_RANGES: dict[str, dict[str, Any]] = {
    "max_new_tokens": {"minimum": 0, "maximum": _MAX_TOKENS},
    "min_new_tokens": {"minimum": 0, "maximum": _MAX_TOKENS},
    "temperature": {"minimum": 0, "maximum": 100},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1, "maximum": 1 << 30}]},
    "min_p": {"minimum": 0, "maximum": 1},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "n": {"minimum": 1, "maximum": 128},
    "seed": {"minimum": -(1 << 63), "maximum": (1 << 63) - 1},
    "dry_multiplier": {"minimum": 0, "maximum": 100},
    "dry_base": {"minimum": 1, "maximum": 100},
    "dry_allowed_length": {"minimum": 1, "maximum": _MAX_TOKENS},
    "dry_penalty_last_n": {"minimum": -1, "maximum": 1 << 30},
    "dry_sequence_breakers": {"maxItems": MAX_DRY_BREAKERS, "items": {
        "type": "string", "minLength": 1, "maxLength": MAX_DRY_BREAKER_CHARS}},
    "xtc_probability": {"minimum": 0, "maximum": 1},
    "xtc_threshold": {"minimum": 0, "maximum": 1},
}
_NON_EMPTY_STR = {"type": "string", "minLength": 1}
_TOKEN_ID = {"type": "integer", "minimum": 0}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": _TOKEN_ID}
_STOP_STR = {**_NON_EMPTY_STR, "maxLength": MAX_STOP_CHARS}
_STOP = {"anyOf": [_STOP_STR, {"type": "array", "items": _STOP_STR,
                               "maxItems": MAX_STOP_STRINGS}]}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}

NonEmptyStr = Annotated[str, WithJsonSchema(_NON_EMPTY_STR)]
TokenId = Annotated[StrictInt, WithJsonSchema(_TOKEN_ID)]
TokenIds = Annotated[list[StrictInt], WithJsonSchema(_TOKEN_IDS)]
_IMAGE_URL_PART = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {"type": {"const": "image_url"}, "image_url": {
        "type": "object", "required": ["url"],
        "properties": {"url": _NON_EMPTY_STR, "detail": {"const": "auto"}}}},
}
# an image as /generate's image_data takes it: a data: or http(s) URL, base64, a local path
ImageData = Annotated[str, WithJsonSchema(_NON_EMPTY_STR)]
TextParts = Annotated[
    list[dict[str, Any]],
    WithJsonSchema({"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_URL_PART]}})
]
# OpenAI's `stop`: "" and [] mean none; a listed stop string must not be empty.
OpenAIStop = Annotated[str | list[str], WithJsonSchema(
    {"anyOf": [{"type": "string"}, {"type": "array", "items": _NON_EMPTY_STR}]}
)]


def documented(default: Any, **schema: Any) -> Any:
    """A field default whose JSON schema also carries `schema` (e.g. minimum, maxItems).

    Keywords like minimum / minLength / minItems constrain only values of their own JSON type,
    so they can sit beside a union's anyOf (null, or the other shapes, stay valid).
    """
    return Field(default, json_schema_extra=schema)


def exactly_one_of(a: str, b: str) -> dict[str, Any]:
    """A model-level schema: `a` or `b` is given (not null), never both."""

    def only(name: str, other: str) -> dict[str, Any]:
        return {"required": [name], "properties": {
            name: {"not": {"type": "null"}}, other: {"type": "null"}}}

    return {"oneOf": [only(a, b), only(b, a)]}


def sampling_params_schema(ignored: tuple[str, ...], unsupported: tuple[str, ...],
                           aliases: dict[str, str] | None = None) -> dict:
    """`sampling_params` as the server checks it: SamplingParams' fields with their ranges,
    each nullable (null: the default), `ignored` keys taken, `unsupported` ones only unset,
    each `aliases` key another name for the field it maps to."""
    props = TypeAdapter(SamplingParams).json_schema()["properties"]
    for name, prop in props.items():
        kinds = [k for k in prop.pop("anyOf", [prop]) if k != {"type": "null"}]
        if name == "stop":
            kinds = [_STOP]
        elif name == "stop_token_ids":
            kinds = [{"type": "array", "items": _TOKEN_ID, "maxItems": MAX_STOP_TOKEN_IDS}]
        kinds = [{k: v for k, v in kind.items() if k not in ("default", "title")}
                 for kind in kinds]
        if len(kinds) == 1:
            kinds[0] = {**kinds[0], **SAMPLING_RANGES.get(name, {})}
        props[name] = {"title": prop.get("title", name), "default": prop.get("default"),
                       "anyOf": [*kinds, {"type": "null"}]}
    for alias, name in (aliases or {}).items():
        props[alias] = {**props[name], "title": alias, "description": f"another name for {name}"}
    for key in ignored:
        props[key] = {"description": "accepted and ignored"}
    for key in unsupported:
        props[key] = {"description": "not supported: accepted only when unset",
                      "enum": [None, "", [], {}]}
    return {
        "title": "SamplingParams", "type": "object", "properties": props,
        "additionalProperties": False,
        "description": "SGLang's sampling parameters. Also checked: min_new_tokens <= "
                       "max_new_tokens; at most one of regex, json_schema, json_object, ebnf",
    }
