"""frontend_dsl: SGLang's frontend language (programs, gen, select, roles, fork) and its backends.

Importable without torch: the in-process `Runtime` imports `sglang_like.engine` only when built.

Public names:
    function            decorator turning `def prog(s, ...)` into a runnable program (SglFunction)
    gen, gen_int, gen_string, select
                        generation expressions appended with `s += ...`
    image               an image in the prompt (vision-language models)
    system, user, assistant, *_begin, *_end
                        chat-role expressions; role text comes from the model's chat template
    RuntimeEndpoint     backend over the SGLang-native HTTP API
    Runtime             backend on the engine in this process
    OpenAI              backend on any /v1/chat/completions server
    set_default_backend, flush_cache, get_server_info
    Tool, ToolCall, call_tool, describe_tools
                        tool calling: gen(name, tools=[...]), s.tool_call(name), call_tool(s, name)
    global_config       process-wide settings (its default_backend is set_default_backend's)
    token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized
                        select()'s choices_method names, spelled as SGLang exports them
    ProgramState, ProgramStateGroup, SglFunction, TracedProgram, GenParams, ChatTemplate
"""

from frontend_dsl.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    image,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from frontend_dsl.backends import Backend, OpenAI, Runtime, RuntimeEndpoint
from frontend_dsl.backends.base import TokenUsage
from frontend_dsl.chat_template import ChatTemplate, template_from_jinja
from frontend_dsl.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from frontend_dsl.global_config import GlobalConfig, global_config
from frontend_dsl.ir import GenParams
from frontend_dsl.program import SglFunction
from frontend_dsl.state import ProgramState, ProgramStateGroup
from frontend_dsl.tools import Tool, ToolCall, call_tool, describe_tools
from frontend_dsl.tracer import TracedProgram

__all__ = [
    "Backend",
    "ChatTemplate",
    "GenParams",
    "GlobalConfig",
    "OpenAI",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "SglFunction",
    "TokenUsage",
    "Tool",
    "ToolCall",
    "TracedProgram",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "call_tool",
    "describe_tools",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "image",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "template_from_jinja",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
