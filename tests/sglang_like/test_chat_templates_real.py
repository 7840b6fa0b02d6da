"""Real chat templates (llama.cpp's models/templates, taken from the models' Hub repos) render
exactly as transformers renders them, and `--tool-call-parser auto` reads the calls they write.

The reference is transformers' own apply_chat_template(tokenize=False) over a
PreTrainedTokenizerFast holding the same template and special tokens; ours is
`Tokenizer.apply_chat_template`.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest

from sglang_like.function_call.parsers import get_parser
from sglang_like.function_call.tools import parse_tools
from sglang_like.model_loader import load_tokenizer
from sglang_like.tokenizer import Tokenizer

from ..llama_cpp_source import llama_cpp_tree

transformers = pytest.importorskip("transformers")

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city (°C)",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You are terse."}
CHAT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2? Ünïcödé 😀 \"quoted\" <b>"},
]
CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": "call12345", "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    CALL,
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
     "content": json.dumps({"temp": 21, "sky": "clear"})},
]

# template file -> (renders a system turn, renders without `tools`, knows tools, parser auto
# should pick for the calls the template writes; None: the template writes no call text).
TEMPLATES = {
    "meta-llama-Llama-3.1-8B-Instruct": (True, True, True, "llama3"),
    "meta-llama-Llama-3.2-3B-Instruct": (True, True, True, "llama3"),
    "meta-llama-Llama-3.3-70B-Instruct": (True, True, True, "llama3"),
    "Qwen-Qwen2.5-7B-Instruct": (True, True, True, "hermes"),
    "Qwen-Qwen3-0.6B": (True, True, True, "hermes"),
    "Qwen-QwQ-32B": (True, True, True, "hermes"),
    "Qwen3-Coder": (True, True, True, "hermes"),
    "Qwen3.5-4B": (True, True, True, "hermes"),
    "google-gemma-2-2b-it": (False, True, False, None),
    "microsoft-Phi-3.5-mini-instruct": (True, True, False, None),
    "mistralai-Mistral-Nemo-Instruct-2407": (True, True, True, "mistral"),
    "Mistral-Small-3.2-24B-Instruct-2506": (True, True, True, "mistral"),
    "mistralai-Ministral-3-14B-Reasoning-2512": (True, True, True, "mistral"),
    "unsloth-mistral-Devstral-Small-2507": (True, True, True, "mistral"),
    "HuggingFaceTB-SmolLM3-3B": (True, True, False, None),
    # Granite 3.3 writes no past calls; its instructions ask for <|tool_call|>[...] (granite)
    "ibm-granite-granite-3.3-2B-Instruct": (True, True, True, None),
    "ibm-granite-granite-4.0": (True, True, True, "hermes"),
    "ibm-granite-granite-4.1": (True, True, True, "hermes"),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": (True, False, True, "hermes"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": (True, False, True, "hermes"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": (True, True, False, None),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (True, True, False, None),
}


@functools.cache
def _backend():
    return load_tokenizer().backend


def _source(name: str) -> str:
    return (llama_cpp_tree() / "models" / "templates" / f"{name}.jinja").read_text(
        encoding="utf-8")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    _backend().save(str(path))
    return str(path)


def _pair(tokenizer_file: str, name: str) -> tuple[object, Tokenizer]:
    src = _source(name)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=tokenizer_file, chat_template=src, **SPECIALS)
    # the same variables reach both templates
    assert {k: hf.special_tokens_map[k] for k in SPECIALS} == SPECIALS
    assert set(hf.special_tokens_map) == set(SPECIALS)
    ours = Tokenizer(_backend(), chat_template=src, special_tokens_map=SPECIALS)
    return hf, ours


def _both(hf, ours: Tokenizer, messages, **kw) -> tuple[str, str]:
    want = hf.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kw)
    got = ours.apply_chat_template(copy.deepcopy(messages), **kw)
    return want, got


def test_every_family_template_is_shipped() -> None:
    present = {p.stem for p in (llama_cpp_tree() / "models" / "templates").glob("*.jinja")}
    assert set(TEMPLATES) <= present


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers(tokenizer_file, name: str, add_generation_prompt: bool) -> None:
    system, plain, knows_tools, _ = TEMPLATES[name]
    assert knows_tools == ("tools" in _source(name))
    hf, ours = _pair(tokenizer_file, name)
    chat = [SYSTEM, *CHAT] if system else CHAT
    cases = []
    if plain:
        cases.append((chat, None))
    if knows_tools:
        cases += [(chat, TOOLS), ([SYSTEM, *TOOL_CHAT] if system else TOOL_CHAT, TOOLS)]
    for messages, tools in cases:
        want, got = _both(hf, ours, messages, tools=tools,
                          add_generation_prompt=add_generation_prompt)
        assert got == want, (name, tools is not None)
        assert "Ünïcödé 😀" in got or messages is not chat  # not escaped away


def test_template_errors_are_errors_here_too(tokenizer_file) -> None:
    # Gemma 2 refuses a system turn with raise_exception; ours raises ValueError with its text.
    hf, ours = _pair(tokenizer_file, "google-gemma-2-2b-it")
    with pytest.raises(Exception, match="System role not supported"):
        hf.apply_chat_template([SYSTEM, *CHAT], tokenize=False)
    with pytest.raises(ValueError, match="System role not supported"):
        ours.apply_chat_template([SYSTEM, *CHAT])


def test_none_fields_and_reasoning_as_transformers(tokenizer_file) -> None:
    # transformers drops message keys set to None (an OpenAI tool-call turn has content None)
    # and hands a message's reasoning to the template as reasoning_content and thinking.
    hf, ours = _pair(tokenizer_file, "meta-llama-Llama-3.1-8B-Instruct")
    messages = [TOOL_CHAT[0], {**CALL, "content": None}, TOOL_CHAT[2]]
    want, got = _both(hf, ours, messages, tools=TOOLS, add_generation_prompt=True)
    assert got == want and "None" not in got
    hf, ours = _pair(tokenizer_file, "Qwen-Qwen3-0.6B")
    for key in ("reasoning_content", "reasoning", "thinking"):
        messages = [CHAT[0], {"role": "assistant", "content": "4", key: "2+2 is 4"}]
        want, got = _both(hf, ours, messages, add_generation_prompt=False)
        assert got == want and "<think>\n2+2 is 4\n</think>" in got, key


def test_auto_parser_for_granite_3() -> None:
    src = _source("ibm-granite-granite-3.3-2B-Instruct")
    assert "respond only with <|tool_call|> followed by a JSON list" in src
    assert get_parser("auto", src).name == "granite"


def test_generation_blocks_render_their_body(tokenizer_file) -> None:
    # {% generation %} marks assistant text for transformers' training masks (LFM2.5, Laguna).
    hf, ours = _pair(tokenizer_file, "LFM2.5-8B-A1B")
    want, got = _both(hf, ours, [SYSTEM, *CHAT], add_generation_prompt=False)
    assert got == want and "Hello! How can I help?" in got


@pytest.mark.parametrize("name", sorted(n for n, v in TEMPLATES.items() if v[3]))
def test_auto_parser_reads_the_calls_the_template_writes(name: str) -> None:
    """The template writes a past call in the model's own format (the text the model would
    generate); auto's parser must read it back as that call."""
    expected = TEMPLATES[name][3]
    src = _source(name)
    ours = Tokenizer(_backend(), chat_template=src, special_tokens_map=SPECIALS)
    # the assistant turn alone: its header is plain content to the parser, as the think block
    # some templates add (a generation prompt may differ from a past turn's header: QwQ)
    before = ours.apply_chat_template(TOOL_CHAT[:1], tools=TOOLS, add_generation_prompt=False)
    full = ours.apply_chat_template(TOOL_CHAT[:2], tools=TOOLS, add_generation_prompt=False)
    assert full.startswith(before)
    written = full[len(before):]
    parser = get_parser("auto", src)
    assert parser.name == expected
    content, calls = parser.parse(written, parse_tools(TOOLS))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})], written
