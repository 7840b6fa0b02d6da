"""SGLang API corners against the recording fake: state["x"] = v, forks += lambda i: ...,
sglang_like.lang.*, global_config, token_usage, streamed meta_info, API speculative execution."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import frontend_dsl as sgl
import frontend_dsl.ir as dsl_ir
from frontend_dsl.interpreter import merge_stream_meta


def test_setitem_sets_a_variable(fake) -> None:
    @sgl.function
    def prog(s):
        s += "n=" + sgl.gen("n", max_tokens=3)

    state = prog.run(backend=fake(reply=lambda p, sp: "12"))
    state["n"] = int(state["n"])
    assert state["n"] == 12 and "n" in state
    state["fresh"] = [1, 2]
    assert state["fresh"] == [1, 2]
    assert state.text() == "n=12"  # setting a variable appends nothing


def test_forks_add_a_callable_per_branch_index(fake) -> None:
    contexts = ["alpha", "beta", "gamma"]

    @sgl.function
    def prog(s):
        s += "Facts:\n"
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += "Q:" + sgl.gen("a", max_tokens=2)

    backend = fake(reply=lambda p, sp: "ok")
    state = prog.run(backend=backend)
    assert state.text() == (
        "Facts:\nStatement 0: alpha\nStatement 1: beta\nStatement 2: gamma\nQ:ok")

    @sgl.function
    def per_branch_gen(s):
        forks = s.fork(2)
        forks += lambda i: f"[{i}]" + sgl.gen("x", max_tokens=2)
        forks.join()

    state = per_branch_gen.run(backend=fake(reply=lambda p, sp: p[-3:]))
    assert state["x"] == ["[0]", "[1]"]


def test_lang_modules_reexport_the_dsl() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import sglang_like as sgl\n"
        "from sglang_like.lang.ir import REGEX_INT, REGEX_FLOAT, REGEX_STR, SglGen\n"
        "from sglang_like.lang.api import gen, select, function, Runtime\n"
        "from sglang_like.lang.interpreter import ProgramState\n"
        "from sglang_like.lang.choices import token_length_normalized\n"
        "from sglang_like.lang.global_config import global_config\n"
        "from sglang_like.lang.backend.runtime_endpoint import RuntimeEndpoint\n"
        "import frontend_dsl, frontend_dsl.ir as ir\n"
        "assert (REGEX_INT, REGEX_FLOAT, REGEX_STR) == (ir.REGEX_INT, ir.REGEX_FLOAT, "
        "ir.REGEX_STR)\n"
        "assert SglGen is ir.Gen and gen is frontend_dsl.gen and sgl.gen is gen\n"
        "assert global_config is sgl.global_config and RuntimeEndpoint is sgl.RuntimeEndpoint\n"
        "assert ProgramState is frontend_dsl.ProgramState and Runtime is sgl.Runtime\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert dsl_ir.REGEX_INT  # the constants live in frontend_dsl.ir


def test_global_config_default_backend_is_set_default_backend(fake) -> None:
    backend = fake(reply=lambda p, sp: "x")
    try:
        sgl.set_default_backend(backend)
        assert sgl.global_config.default_backend is backend
        sgl.global_config.default_backend = None
        assert sgl.get_default_backend() is None
        sgl.global_config.default_backend = backend

        @sgl.function
        def prog(s):
            s += sgl.gen("a", max_tokens=1)

        assert prog.run()["a"] == "x"
        assert backend.endpoint is backend  # SGLang's `default_backend.endpoint`
    finally:
        sgl.set_default_backend(None)


def test_token_usage_counts_gen_calls_and_resets(fake) -> None:
    backend = fake(reply=lambda p, sp: "abc")

    @sgl.function
    def prog(s):
        s += "hello" + sgl.gen("a", max_tokens=3) + sgl.gen("b", max_tokens=3)

    prog.run(backend=backend)
    assert backend.token_usage.prompt_tokens == len("hello") + len("helloabc")
    assert backend.token_usage.completion_tokens == 6
    backend.token_usage.reset()
    assert (backend.token_usage.prompt_tokens, backend.token_usage.completion_tokens) == (0, 0)


def test_merge_stream_meta_concatenates_incremental_keys() -> None:
    first = ("", {"completion_tokens": 1, "output_token_logprobs": [[-1.0, 5, None]]})
    merged = merge_stream_meta(first, "hi", {"completion_tokens": 2,
                                             "output_token_logprobs": [[-2.0, 6, None]]})
    assert merged == ("hi", {"completion_tokens": 2,
                             "output_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None]]})
    assert merge_stream_meta(None, "a", {"k": 1}) == ("a", {"k": 1})


class _StreamingFake:
    """Chunks ("", "ab", "", "cd"): one logprob entry per chunk, cumulative completion_tokens."""

    @staticmethod
    def patch(backend: Any) -> None:
        def stream(body: dict[str, Any]) -> Iterator[dict[str, Any]]:
            for i, text in enumerate(["", "ab", "", "cd"]):
                yield {"text": text, "meta_info": {
                    "completion_tokens": i + 1, "output_token_logprobs": [[-0.5, i, None]]}}
        backend._request_stream = stream


def test_text_iter_with_meta_data_yields_nonempty_pieces(fake) -> None:
    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("answer", max_tokens=4, return_logprob=True)

    backend = fake()
    _StreamingFake.patch(backend)

    async def collect() -> list[tuple[str, dict]]:
        state = prog.run(backend=backend, stream=True)
        return [c async for c in state.text_async_iter("answer", return_meta_data=True)]

    chunks = asyncio.run(collect())
    assert [c[0] for c in chunks] == ["ab", "cd"]
    assert [c[1]["completion_tokens"] for c in chunks] == [2, 4]
    assert [len(c[1]["output_token_logprobs"]) for c in chunks] == [2, 2]
    state = prog.run(backend=backend)  # not streamed: one pair, the whole value
    assert list(state.text_iter("answer", return_meta_data=True)) == [
        ("<2>", state.get_meta_info("answer"))]
    with pytest.raises(ValueError, match="var_name"):
        state.text_iter(return_meta_data=True)


def _character(s):
    s += "Name:" + sgl.gen("name", stop="\n") + "\nJob:" + sgl.gen("job", stop="\n") + "\n"


def test_api_speculation_serves_consecutive_gens_from_one_call(fake) -> None:
    backend = fake(reply=lambda p, sp: " Ada\nJob: engineer\nAge: 36")
    state = sgl.function(num_api_spec_tokens=32)(_character).run(backend=backend)
    assert (state["name"], state["job"]) == (" Ada", " engineer")
    assert len(backend.generate_bodies) == 1
    body = backend.generate_bodies[0]["sampling_params"]
    assert "stop" not in body and body["max_new_tokens"] == 128  # max(run default, 32)
    assert state.text() == "Name: Ada\nJob: engineer\n"

    plain = fake(reply=lambda p, sp: " Ada\nJob: engineer\nAge: 36")
    sgl.function(_character).run(backend=plain)
    assert len(plain.generate_bodies) == 2
    assert backend.token_usage.prompt_tokens < plain.token_usage.prompt_tokens


def test_api_speculation_calls_again_when_the_text_diverges(fake) -> None:
    backend = fake(reply=lambda p, sp: " Ada\nRole: engineer\n")  # not "\nJob:"
    state = sgl.function(num_api_spec_tokens=16)(_character).run(backend=backend)
    assert state["name"] == " Ada"
    assert len(backend.generate_bodies) == 2  # the buffer was dropped at "\nJob:"
    assert state["job"] == " Ada"  # the fake's reply again, cut at its first stop
    with pytest.raises(ValueError, match="num_api_spec_tokens"):
        sgl.function(num_api_spec_tokens=0)


def test_api_speculation_leaves_constrained_gens_alone(fake) -> None:
    @sgl.function(num_api_spec_tokens=16)
    def prog(s):
        s += "n=" + sgl.gen_int("n", stop="\n") + "\nw=" + sgl.gen("w", stop="\n")

    backend = fake(reply=lambda p, sp: "7\nw=x\n")
    state = prog.run(backend=backend)
    assert state["n"] == "7\nw=x\n"  # the fake ignores the regex; the body carried it
    bodies = backend.generate_bodies
    assert "regex" in bodies[0]["sampling_params"] and "stop" in bodies[0]["sampling_params"]
    assert len(bodies) == 2


def test_seed_travels_from_gen_and_run_to_the_body(fake) -> None:
    @sgl.function
    def prog(s):
        s += sgl.gen("a", max_tokens=2, seed=7) + sgl.gen("b", max_tokens=2)

    backend = fake(reply=lambda p, sp: "x")
    prog.run(backend=backend, seed=3)
    assert [b["sampling_params"]["seed"] for b in backend.generate_bodies] == [7, 3]
