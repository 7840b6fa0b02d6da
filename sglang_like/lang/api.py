"""SGLang's `sglang.lang.api` names: function, gen, select, roles, the default backend."""

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
from frontend_dsl.backends import Runtime

__all__ = [
    "Runtime", "assistant", "assistant_begin", "assistant_end", "flush_cache", "function",
    "gen", "gen_int", "gen_string", "get_default_backend", "get_server_info", "image", "select",
    "set_default_backend", "system", "system_begin", "system_end", "user", "user_begin",
    "user_end",
]
