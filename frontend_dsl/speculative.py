"""API speculative execution (`@function(num_api_spec_tokens=N)`): one call fills several gens.

A program like `"Name:" + gen("name", stop="\\n") + "\\nJob:" + gen("job", stop="\\n")` would
send one request per gen, each re-sending the whole prompt. With speculation, the first gen
asks for N tokens with its stop removed and keeps the continuation as a buffer; the gen takes
the buffer up to its first stop string, each literal text the program appends next is matched
against the buffer (a match consumes it, a mismatch drops it), and the next gen with a stop
again takes from the buffer, so the model is called again only when the buffer runs out or the
program's text diverges from what the model wrote.

Only unconstrained gens with a `stop`, n of 1 and no streaming are speculated; any other gen or
select runs as usual and drops the buffer. Backends with only a chat API (`is_chat_model`)
ignore speculation. A speculated value ends at its stop string or at the end of the buffer,
so it can be longer than that gen's own max_tokens when N is larger.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from frontend_dsl.ir import GenParams


def is_speculable(params: GenParams) -> bool:
    """Whether a gen with these (merged) params can be served from the speculated buffer."""
    return (params.stop is not None and params.stop != [] and params.regex is None
            and params.json_schema is None and params.dtype is None
            and params.n in (None, 1))


class ApiSpeculation:
    """The speculated continuation of one executor's text, and the rules that consume it."""

    def __init__(self, num_tokens: int) -> None:
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_api_spec_tokens must be a positive integer, not {num_tokens}")
        self.num_tokens = num_tokens
        self.buffer = ""
        self.num_backend_calls = 0
        self._meta: dict[str, Any] = {}

    def fill(self, text: str) -> None:
        """The program appended literal `text`: consume it from the buffer or drop the buffer."""
        if self.buffer.startswith(text):
            self.buffer = self.buffer[len(text):]
        else:
            self.buffer = ""

    def drop(self) -> None:
        self.buffer = ""

    def gen(self, backend: Any, prompt: str, params: GenParams) -> tuple[str, dict[str, Any]]:
        """The value of one speculable gen whose prompt is `prompt`."""
        if not self.buffer:
            spec_params = dataclasses.replace(
                params, stop=None,
                max_new_tokens=max(params.max_new_tokens or 0, self.num_tokens))
            self.buffer, self._meta = backend.generate(prompt, spec_params)
            self.num_backend_calls += 1
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop)
        found = [p for p in (self.buffer.find(s) for s in stops if s) if p >= 0]
        end = min(found) if found else len(self.buffer)
        value, self.buffer = self.buffer[:end], self.buffer[end:]
        return value, {**self._meta, "speculated": True}
