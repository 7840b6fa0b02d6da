"""The runtime's tokenizer: a `tokenizers` (Rust) backend plus eos/bos ids and the chat template."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers

# Turn-ending tokens of common chat templates: when the template writes one of these after each
# turn, the model ends its answer with it, so it must stop generation even when the checkpoint's
# eos is another token (SmolLM2 GGUF: eos <|im_end|>; Qwen2: eos <|endoftext|>, turns <|im_end|>).
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
# ChatML models also end documents with <|endoftext|>; a chat model that emits it is done.
_CHATML_EXTRA_STOP = ("<|endoftext|>",)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def chat_stop_token_ids(chat_template: str | None, token_to_id: dict[str, int]) -> set[int]:
    """Ids of the turn-ending tokens the chat template writes (see _TURN_END_TOKENS)."""
    if not chat_template:
        return set()
    names = [t for t in _TURN_END_TOKENS if t in chat_template]
    if "<|im_end|>" in names:
        names.extend(_CHATML_EXTRA_STOP)
    return {token_to_id[n] for n in names if n in token_to_id}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    # HF's template filter: unlike jinja's built-in, no HTML escaping and non-ASCII kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers marks the assistant's text with it
    (for training masks); rendering writes the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


# Names a message's reasoning may come under; templates read `reasoning_content` (Qwen3, ...)
# or `thinking` (gpt-oss). transformers fills both from whichever is given.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: Any) -> Any:
    """A message as transformers hands it to the template: keys set to None dropped (templates
    test for a key, not for None: an OpenAI tool-call turn has content None), reasoning under
    both names templates read."""
    if not isinstance(message, dict):
        return message
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_KEYS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a Hugging Face chat template in a sandbox with HF's options and helpers."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids for one model, plus its stop ids and chat template.

    Special tokens written in the text (e.g. <|im_start|>) are always parsed as their ids;
    `add_special_tokens` only controls the BOS/EOS the backend's post-processor adds.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        special_tokens_map: dict[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.bos_token_id: int | None = bos_token_id
        self.chat_template: str | None = chat_template
        # Names the template may use: bos_token, eos_token, pad_token, unk_token.
        self.special_tokens_map: dict[str, str] = dict(special_tokens_map or {})
        self._template: jinja2.Template | None = None

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        decoder = self._backend.get_added_tokens_decoder()
        return frozenset(i for i, tok in decoder.items() if tok.special)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is out of range (vocab {self.vocab_size})")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.id_to_token(i) for i in ids]

    @cached_property
    def is_byte_level(self) -> bool:
        """True when decoding is concatenating token_bytes_list() and decoding UTF-8 (lossy)."""
        return _decoder_kind(self._backend) == "byte_level"

    def token_bytes_list(self) -> list[bytes]:
        """For each id, the raw bytes it decodes to; special tokens give their text's UTF-8."""
        return list(self.token_bytes)

    @cached_property
    def token_bytes(self) -> tuple[bytes, ...]:
        """token_bytes_list() as a shared, immutable tuple (built once)."""
        decoder_kind = _decoder_kind(self._backend)
        added = self._backend.get_added_tokens_decoder()
        byte_of_char = {c: b for b, c in bytes_to_unicode().items()}
        out: list[bytes] = []
        for i in range(self.vocab_size):
            token = self._backend.id_to_token(i)
            if token is None:
                out.append(b"")
            elif i in added:
                out.append(added[i].content.encode("utf-8"))
            elif decoder_kind == "byte_level":
                out.append(_byte_level_bytes(token, byte_of_char))
            elif decoder_kind == "metaspace":
                out.append(_metaspace_bytes(token))
            else:
                out.append(self._backend.decode([i]).encode("utf-8"))
        return tuple(out)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's Jinja chat template (as transformers does)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        context = {**self.special_tokens_map, **kwargs}
        try:
            return self._template.render(
                messages=[_template_message(m) for m in messages], tools=tools,
                documents=documents, add_generation_prompt=add_generation_prompt, **context,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc


def _decoder_kind(backend: tokenizers.Tokenizer) -> str:
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {p.get("type") for p in parts}
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types or "Metaspace" in types:
        return "metaspace"
    return "other"


def _byte_level_bytes(token: str, byte_of_char: dict[str, int]) -> bytes:
    if all(c in byte_of_char for c in token):
        return bytes(byte_of_char[c] for c in token)
    return token.encode("utf-8")


def _metaspace_bytes(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def tokenizer_files_exist(path: str) -> bool:
    """True when `path` is a folder holding a tokenizer.json."""
    return os.path.isfile(os.path.join(path, "tokenizer.json"))
