"""Public DSL constructors (gen, select, roles), the @function decorator and the default backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The default-backend accessors live in global_config and _role in ir, so program.py and
# state.py reach them without importing this module (which imports program); the public
# two are re-exported here, where frontend_dsl and sglang_like.lang take them from.
from frontend_dsl.global_config import _backend_or_default
from frontend_dsl.global_config import get_default_backend as get_default_backend
from frontend_dsl.global_config import set_default_backend as set_default_backend
from frontend_dsl.ir import (
    CHOICES_METHODS,
    Expr,
    Gen,
    GenParams,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    _role,
    _schema_str,
)
from frontend_dsl.speculative import ApiSpeculation
from frontend_dsl.tools import as_tools, tool_call_schema


def flush_cache(backend: Any = None) -> bool:
    """Drop the backend's prefix (radix) cache."""
    return _backend_or_default(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict:
    """The backend's server info (KV pool, cache hit rate, queue lengths)."""
    return _backend_or_default(backend).get_server_info()


def function(func: Callable | None = None, *, num_api_spec_tokens: int | None = None) -> Any:
    """Decorate a generation program `def prog(s, ...)`; usable as @function or @function().

    `num_api_spec_tokens=N` turns on API speculative execution (see frontend_dsl.speculative):
    consecutive gens with stop strings are served from one N-token call where the model's
    text matches the program's.
    """
    from frontend_dsl.program import SglFunction

    if num_api_spec_tokens is not None:
        ApiSpeculation(num_api_spec_tokens)  # a bad N is a ValueError at decoration time
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    seed: int | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: Any = None,
    choices: list[str] | None = None,
    choices_method: str | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    tools: list[Any] | None = None,
) -> Expr:
    """Generate into variable `name`; with `choices=` this is select().

    `seed` fixes the sampling of this gen (same seed, same prompt: same text).
    `tools=[f, g, ...]` (functions or OpenAI tool dicts) makes this one tool call, JSON
    constrained; read it with `s.tool_call(name)`, run it with `call_tool(s, name)`
    (see frontend_dsl.tools).
    """
    if choices is not None:
        return select(name, choices, temperature=temperature or 0.0,
                      choices_method=choices_method or "token_length_normalized")
    tool_list = None
    if tools is not None:
        if name is None:
            raise ValueError("gen: tools= needs a variable name to store the call in")
        if regex is not None or json_schema is not None or dtype is not None:
            raise ValueError("gen: tools= sets the constraint; drop regex/json_schema/dtype")
        tool_list = as_tools(tools)
        json_schema = tool_call_schema(tool_list)
    if regex is not None and json_schema is not None:
        raise ValueError("gen: set at most one of regex and json_schema")
    if max_tokens is not None and max_tokens < 0:
        raise ValueError(f"gen: max_tokens must be >= 0, got {max_tokens}")
    params = GenParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n,
        stop=list(stop) if isinstance(stop, tuple) else stop,
        stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        seed=seed, ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex,
        json_schema=_schema_str(json_schema),
    )
    if dtype is not None:
        params.to_sampling_params()  # raises ValueError on an unknown dtype now, not later
    return Gen(name, params, tool_list)


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    """gen() constrained to an integer literal."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    """gen() constrained to a double-quoted string literal."""
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: str = "token_length_normalized",
) -> Expr:
    """Choose the most likely of `choices` (scored in one batched prefill) into `name`."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select: choices must be a non-empty list of strings")
    if choices_method not in CHOICES_METHODS:
        raise ValueError(f"select: choices_method must be one of {CHOICES_METHODS}")
    return Select(name, list(choices), temperature, choices_method)


def image(source: Any) -> Expr:
    """An image in the prompt, for a vision-language model (SGLang's `sgl.image`): a local
    path (read by the client and sent inline), an http(s) or data: URL, base64, bytes or a
    PIL image. Put it inside a role: `s += user(image("cat.png") + "What is this?")`."""
    return Image(source)


def system(expr: Any = None) -> Expr:
    """A system message holding `expr` (text or expressions)."""
    return _role("system", expr)


def user(expr: Any = None) -> Expr:
    """A user message holding `expr`."""
    return _role("user", expr)


def assistant(expr: Any = None) -> Expr:
    """An assistant message holding `expr` (usually a gen())."""
    return _role("assistant", expr)


def system_begin() -> Expr:
    """Open a system message."""
    return RoleBegin("system")


def system_end() -> Expr:
    """Close the system message."""
    return RoleEnd("system")


def user_begin() -> Expr:
    """Open a user message."""
    return RoleBegin("user")


def user_end() -> Expr:
    """Close the user message."""
    return RoleEnd("user")


def assistant_begin() -> Expr:
    """Open an assistant message."""
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    """Close the assistant message."""
    return RoleEnd("assistant")
