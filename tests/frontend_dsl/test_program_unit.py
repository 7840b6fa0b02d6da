"""Interpreter semantics against the recording fake backend: roles, gen, fork, scopes, batch."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

import frontend_dsl as sgl
from frontend_dsl.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, string_regex

SYS = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"


@sgl.function
def chat_call_form(s, q):
    s += sgl.user(q)
    s += sgl.assistant(sgl.gen("a", max_tokens=5))


@sgl.function
def chat_begin_end_form(s, q):
    s += sgl.user_begin() + q + sgl.user_end()
    s += sgl.assistant_begin()
    s += sgl.gen("a", max_tokens=5)
    s += sgl.assistant_end()


@sgl.function
def chat_with_form(s, q):
    with s.user():
        s += q
    with s.assistant():
        s += sgl.gen("a", max_tokens=5)


@pytest.mark.parametrize("program", [chat_call_form, chat_begin_end_form, chat_with_form])
def test_role_forms_render_the_same_prompt(fake, program) -> None:
    backend = fake()
    state = program.run(q="Hi?", backend=backend)
    prompt = f"{SYS}<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    assert backend.bodies[0]["text"] == prompt
    assert state["a"] == f"<{len(prompt)}>"
    assert state.text() == prompt + state["a"] + "<|im_end|>\n"
    assert state.messages() == [{"role": "user", "content": "Hi?"},
                                {"role": "assistant", "content": state["a"]}]


def test_explicit_system_replaces_default_and_multi_turn(fake) -> None:
    @sgl.function
    def prog(s):
        s += sgl.system("Be brief.")
        for turn in ("one", "two"):
            s += sgl.user(turn)
            s += sgl.assistant(sgl.gen(f"r_{turn}", max_tokens=3))

    backend = fake()
    state = prog.run(backend=backend)
    assert "SmolLM" not in state.text()
    assert state.text().startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user",
                                                     "assistant"]
    second = backend.bodies[1]["text"]
    assert second.endswith("<|im_start|>user\ntwo<|im_end|>\n<|im_start|>assistant\n")
    assert state["r_one"] in second


def test_nested_roles_are_an_error(fake) -> None:
    @sgl.function
    def prog(s):
        s += sgl.user_begin()
        s += sgl.assistant_begin()

    with pytest.raises(ValueError, match="inside role"):
        prog.run(backend=fake())


def test_gen_params_merge_run_defaults(fake) -> None:
    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("x", max_tokens=7, stop=["\n"], top_k=5)
        s += sgl.gen("y")

    backend = fake()
    prog.run(backend=backend, max_new_tokens=11, temperature=0.0)
    first, second = (b["sampling_params"] for b in backend.bodies)
    assert first["max_new_tokens"] == 7 and first["stop"] == ["\n"] and first["top_k"] == 5
    assert first["temperature"] == 0.0
    assert second["max_new_tokens"] == 11 and "stop" not in second


@pytest.mark.parametrize(
    ("make", "regex", "extra_stops"),
    [
        (lambda: sgl.gen_int("v"), REGEX_INT, [" ", "\n"]),
        (lambda: sgl.gen("v", dtype=float), REGEX_FLOAT, [" ", "\n"]),
        (lambda: sgl.gen("v", dtype=bool), REGEX_BOOL, None),
        (lambda: sgl.gen_string("v"), string_regex(126), None),  # fits the 128-token default
        (lambda: sgl.gen_string("v", max_tokens=500), REGEX_STR, None),
        (lambda: sgl.gen_string("v", max_tokens=1), string_regex(0), None),
        (lambda: sgl.gen("v", regex=r"[ab]+"), r"[ab]+", None),
    ],
)
def test_dtype_becomes_regex(fake, make, regex, extra_stops) -> None:
    @sgl.function
    def prog(s):
        s += "n = " + make()

    backend = fake()
    prog.run(backend=backend)
    sp = backend.bodies[0]["sampling_params"]
    assert sp["regex"] == regex
    assert sp.get("stop") == extra_stops


@pytest.mark.parametrize(("value", "ok"), [("42", True), ("-7", True), ("4.2", False),
                                           ("x", False)])
def test_int_regex_matches_integers_only(value, ok) -> None:
    assert bool(re.fullmatch(REGEX_INT, value)) is ok


def test_bad_gen_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError):
        sgl.gen("x", dtype=list)
    with pytest.raises(ValueError):
        sgl.gen("x", regex="a", json_schema={"type": "string"})
    with pytest.raises(ValueError):
        sgl.select("x", choices=[])


def test_json_schema_dict_is_sent_as_string(fake) -> None:
    @sgl.function
    def prog(s):
        s += sgl.gen("j", json_schema={"type": "object"})

    backend = fake()
    prog.run(backend=backend)
    assert backend.bodies[0]["sampling_params"]["json_schema"] == '{"type": "object"}'


def test_fork_join_gathers_lists_and_runs_branches_concurrently(fake) -> None:
    @sgl.function
    def prog(s):
        s += "Root."
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" Branch {i}:" + sgl.gen("idea", max_tokens=4)
        forks.join()
        s += " Done."

    backend = fake(delay_s=0.3)
    t0 = time.perf_counter()
    state = prog.run(backend=backend)
    elapsed = time.perf_counter() - t0
    assert state.text() == "Root. Done."
    assert state["idea"] == [f"<{len(f'Root. Branch {i}:')}>" for i in range(3)]
    assert len(state.get_meta_info("idea")) == 3
    assert backend.bodies[0] == {"text": "Root.", "sampling_params": {"max_new_tokens": 0}}
    assert backend.max_in_flight == 3
    assert elapsed < 0.3 * 3  # the three 0.3 s branch requests overlapped


def test_forks_plus_equals_and_concat_join(fake) -> None:
    @sgl.function
    def prog(s):
        s += "P"
        forks = s.fork(2)
        forks += "-x"
        forks += ["1", "2"]
        forks.join("concate_and_append")

    assert prog.run(backend=fake()).text() == "P-x1-x2"


def test_var_scope_and_copy(fake) -> None:
    @sgl.function
    def prog(s):
        s += "a"
        with s.var_scope("mid"):
            s += "b" + sgl.gen("g", max_tokens=2)
        s += "c"

    state = prog.run(backend=fake())
    assert state["mid"] == "b" + state["g"]
    dup = state.copy()
    dup += "more"
    assert dup.text() == state.text() + "more"
    assert state.text().endswith("c")


def test_bind_and_ret_value(fake) -> None:
    @sgl.function
    def prog(s, a, b):
        s += a + b
        return a

    bound = prog.bind(a="x")
    state = bound.run(b="y", backend=fake())
    assert state.text() == "xy" and state.ret_value == "x"
    with pytest.raises(ValueError):
        prog.bind(nope=1)


def test_run_batch_keeps_order_and_warms_the_static_prefix(fake) -> None:
    @sgl.function
    def few_shot(s, question):
        s += "Q: 1+1?\nA: 2\n"
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=3)

    delays = {"q0": 0.2, "q1": 0.0, "q2": 0.1, "q3": 0.0}

    def reply(prompt: str, sp: dict) -> str:
        question = prompt.split("Q: ")[-1][:2]
        time.sleep(delays[question])  # later items finish first
        return question

    backend = fake(reply=reply)
    states = few_shot.run_batch([{"question": q} for q in delays], num_threads=4,
                                progress_bar=True, backend=backend)
    assert [s["answer"] for s in states] == list(delays)
    warm = backend.bodies[0]
    assert warm == {"text": "Q: 1+1?\nA: 2\nQ: ", "sampling_params": {"max_new_tokens": 0}}
    assert all(b["text"].startswith(warm["text"]) for b in backend.bodies[1:])
    assert len(backend.bodies) == 1 + len(delays)


def test_run_batch_reports_errors_per_item(fake) -> None:
    @sgl.function
    def prog(s, n):
        if n == 1:
            raise ValueError("bad item")
        s += str(n)

    states = prog.run_batch([{"n": 0}, {"n": 1}, {"n": 2}], backend=fake())
    assert [type(s.error()) for s in states] == [type(None), ValueError, type(None)]
    assert states[2].text() == "2"


def test_streaming_text_iter_and_async_iter(fake) -> None:
    @sgl.function
    def prog(s):
        s += "Tell:" + sgl.gen("story", max_tokens=20)

    backend = fake(reply=lambda p, sp: "once upon a time", delay_s=0.02)
    state = prog.run(backend=backend, stream=True)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1 and "".join(pieces) == "once upon a time"
    assert backend.bodies[0]["stream"] is True
    assert state["story"] == "once upon a time"

    async def collect() -> list[str]:
        st = prog.run(backend=backend, stream=True)
        return [c async for c in st.text_async_iter()]

    assert "".join(asyncio.run(collect())) == "Tell:once upon a time"


def test_trace_yields_structure_without_a_model() -> None:
    @sgl.function
    def prog(s, topic):
        s += sgl.system("Sys.")
        s += sgl.user("Write about " + topic)
        forks = s.fork(2)
        forks += sgl.assistant(sgl.gen("draft", max_tokens=4))
        forks.join()
        s += sgl.select("pick", choices=["A", "B"])

    traced = prog.trace()
    assert traced.static_prefix == (
        "<|im_start|>system\nSys.<|im_end|>\n<|im_start|>user\nWrite about ")
    assert traced.kinds() == [
        "role_begin", "text", "role_end", "role_begin", "text", "role_end", "fork",
        "role_begin", "gen", "role_end", "role_begin", "gen", "role_end", "join", "select"]
    assert traced.gen_names == ["draft", "draft", "pick"]


def test_no_backend_is_a_clear_error() -> None:
    @sgl.function
    def prog(s):
        s += "x"

    sgl.set_default_backend(None)
    with pytest.raises(ValueError, match="no backend"):
        prog.run()


def test_default_backend_is_used(fake) -> None:
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("g", max_tokens=1)

    backend = fake()
    sgl.set_default_backend(backend)
    try:
        assert prog()["g"] == "<1>"
        assert sgl.flush_cache() is False  # the fake keeps no cache
    finally:
        sgl.set_default_backend(None)


def test_run_batch_treats_batch_constant_arguments_as_static(fake) -> None:
    @sgl.function
    def prog(s, intro, question, budget):
        s += intro + " Q: " + question + sgl.gen("a", max_tokens=budget)

    backend = fake()
    prog.run_batch([{"intro": "Same.", "question": q, "budget": 3} for q in ("x", "y")],
                   backend=backend)
    assert backend.bodies[0] == {"text": "Same. Q: ", "sampling_params": {"max_new_tokens": 0}}
