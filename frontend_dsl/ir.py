"""The program IR: plain-data expressions (text, gen, select, roles, var scopes) and GenParams."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# dtype -> regex. Integers and floats also stop at whitespace so the model cannot run on.
# A string holds no control characters (only the space), so it is a valid JSON / Python literal.
REGEX_INT = r"-?(0|[1-9][0-9]{0,17})"
REGEX_FLOAT = r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,10})?"
REGEX_BOOL = r"(True|False)"
MAX_STR_LEN = 200


def string_regex(max_len: int = MAX_STR_LEN) -> str:
    """A double-quoted string of at most `max_len` ASCII word characters and punctuation."""
    return rf"\"[0-9A-Za-z_ ,.!?'-]{{0,{max_len}}}\""


REGEX_STR = string_regex()

_DTYPE_REGEX: dict[Any, str] = {
    int: REGEX_INT, "int": REGEX_INT,
    float: REGEX_FLOAT, "float": REGEX_FLOAT,
    bool: REGEX_BOOL, "bool": REGEX_BOOL,
    str: REGEX_STR, "str": REGEX_STR,
}
_NUMERIC = (int, "int", float, "float")

CHOICES_METHODS = (
    "token_length_normalized",
    "greedy_token_selection",
    "unconditional_likelihood_normalized",
)


@dataclass(frozen=True)
class GenParams:
    """Sampling parameters of one gen() call; None means "not set here, use the run default".

    Travels intact from gen() to the backend, which turns it into a `/generate` body
    with `to_sampling_params()` and `logprob_options()`.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: Any = None
    regex: str | None = None
    json_schema: str | None = None

    def merged_with(self, defaults: GenParams) -> GenParams:
        """Fill every unset field of self from `defaults`."""
        changes = {
            f.name: getattr(defaults, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is None
        }
        return dataclasses.replace(self, **changes)

    def to_sampling_params(self) -> dict[str, Any]:
        """SGLang-native `sampling_params` (dtype resolved to a regex; unset fields left out)."""
        out: dict[str, Any] = {}
        for name in _SAMPLING_KEYS:
            value = getattr(self, name)
            if value is not None:
                out[name] = list(value) if isinstance(value, tuple) else value
        if self.dtype is not None:
            if self.dtype not in _DTYPE_REGEX:
                raise ValueError(f"unsupported dtype {self.dtype!r}; use int, float, str or bool")
            out["regex"] = _DTYPE_REGEX[self.dtype]
            if self.dtype in (str, "str") and self.max_new_tokens is not None:
                # an ASCII character never takes more than one token, so a string this long
                # and its two quotes always close within the token budget
                out["regex"] = string_regex(max(0, min(MAX_STR_LEN, self.max_new_tokens - 2)))
            out.pop("json_schema", None)
            if self.dtype in _NUMERIC:
                stops = [] if self.stop is None else [self.stop] if isinstance(
                    self.stop, str) else list(self.stop)
                out["stop"] = stops + [s for s in (" ", "\n") if s not in stops]
        return out

    def logprob_options(self) -> dict[str, Any]:
        """The top-level logprob fields of a `/generate` body that are set."""
        names = ("return_logprob", "logprob_start_len", "top_logprobs_num",
                 "return_text_in_logprobs")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


_SAMPLING_KEYS = (
    "max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "seed",
    "ignore_eos", "regex", "json_schema",
)

DEFAULT_GEN_PARAMS = GenParams(max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=-1)


# ---- expressions ------------------------------------------------------------------------------
class Expr:
    """Base of every DSL expression; `a + b` builds a Concat so `"Q: " + gen(...)` works."""

    def __add__(self, other: Any) -> Concat:
        return Concat([self, to_expr(other)])

    def __radd__(self, other: Any) -> Concat:
        return Concat([to_expr(other), self])


@dataclass
class Text(Expr):
    """Literal text appended to the state."""

    value: str


@dataclass
class Image(Expr):
    """An image at this point of the prompt (a vision-language model): the backend's image
    placeholder is appended to the text and the image goes with every later call."""

    source: Any  # a path, an http(s) or data: URL, base64 text, bytes or a PIL image


@dataclass
class Gen(Expr):
    """Generate text into variable `name` (None: anonymous); `tools` when it is a tool call."""

    name: str | None
    params: GenParams
    tools: list[Any] | None = None  # frontend_dsl.tools.Tool, kept for tool_call / call_tool


@dataclass
class Select(Expr):
    """Pick one of `choices` by likelihood and store it in `name`."""

    name: str | None
    choices: list[str]
    temperature: float = 0.0
    choices_method: str = "token_length_normalized"


@dataclass
class RoleBegin(Expr):
    """Open a chat role (system / user / assistant)."""

    role: str


@dataclass
class RoleEnd(Expr):
    """Close the open chat role."""

    role: str


@dataclass
class VarScopeBegin(Expr):
    """Start capturing appended text into variable `name`."""

    name: str


@dataclass
class VarScopeEnd(Expr):
    """Stop capturing text into variable `name`."""

    name: str


@dataclass
class Concat(Expr):
    """A sequence of expressions executed in order."""

    items: list[Expr] = field(default_factory=list)

    def __add__(self, other: Any) -> Concat:
        return Concat([*self.items, to_expr(other)])

    def __radd__(self, other: Any) -> Concat:
        return Concat([to_expr(other), *self.items])


def to_expr(value: Any) -> Expr:
    """Wrap a str (or anything printable) as Text; pass expressions through."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    if isinstance(value, (int, float, bool)):
        return Text(str(value))
    raise ValueError(f"cannot append a {type(value).__name__} to a program state")


def _role(role: str, expr: Any = None) -> Expr:
    """A whole `role` message: begin, `expr` (if any), end."""
    if expr is None:
        return Concat([RoleBegin(role), RoleEnd(role)])
    return Concat([RoleBegin(role), to_expr(expr), RoleEnd(role)])


def _schema_str(json_schema: Any) -> str | None:
    if json_schema is None or isinstance(json_schema, str):
        return json_schema
    if isinstance(json_schema, dict):
        return json.dumps(json_schema)
    if hasattr(json_schema, "model_json_schema"):  # a pydantic model class
        return json.dumps(json_schema.model_json_schema())
    raise ValueError("json_schema must be a dict, a JSON string or a pydantic model")
