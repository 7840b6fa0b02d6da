"""OpenAI tool calling: tool definitions, model-family call formats, and the per-request plan
(prompt, constraint, reading the answer) that /v1/chat/completions follows.

Public names:
- Tool, ToolCall, ToolChoice: a function tool, a call the model made, what tool_choice allows.
- ToolPlan: one request's tools: template messages, sampling constraint, reading the answer.
- ToolCallParser, get_parser, TOOL_CALL_PARSERS: a family's call format, chosen by name.
- ToolCallStream: reads calls out of an answer as it streams.
"""

from sglang_like.function_call.parsers import (
    TOOL_CALL_PARSERS,
    ToolCallParser,
    ToolCallStream,
    get_parser,
)
from sglang_like.function_call.plan import ToolPlan
from sglang_like.function_call.tools import Tool, ToolCall, ToolChoice

__all__ = [
    "TOOL_CALL_PARSERS",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolCallStream",
    "ToolChoice",
    "ToolPlan",
    "get_parser",
]
