"""`sglang_like.lang`: the DSL under the module paths SGLang programs import (`sglang.lang.*`).

Every name here is re-exported from `frontend_dsl`, so `from sglang.lang.ir import REGEX_INT`
becomes `from sglang_like.lang.ir import REGEX_INT` and nothing else in a program changes.
Modules: ir (expressions, GenParams, dtype regexes), api (gen, select, roles, function),
interpreter (ProgramState), chat_template, choices, global_config, backend.runtime_endpoint.
"""
