"""Build a `Tokenizer` from a Hugging Face folder: tokenizer.json + configs + chat template."""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as Backend

from sglang_like.tokenizer import Tokenizer, chat_stop_token_ids

_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def read_json(path: str) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file does not exist."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _chat_template(path: str, tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = os.path.join(path, "chat_template.jinja")  # transformers >= 4.50 layout
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    if template is None:  # a processor's own file (vision-language folders: SmolVLM, LLaVA)
        template = read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    return template


def load_hf_tokenizer(path: str) -> Tokenizer:
    """A `Tokenizer` from `path`/tokenizer.json; stop ids merge every config's eos."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise ValueError(f"no tokenizer.json in {path!r}")
    backend = Backend.from_file(file)
    tok_config = read_json(os.path.join(path, "tokenizer_config.json"))
    model_config = read_json(os.path.join(path, "config.json"))
    gen_config = read_json(os.path.join(path, "generation_config.json"))

    names = {k: t for k in _TOKEN_NAMES if (t := _token_text(tok_config.get(k))) is not None}
    template = _chat_template(path, tok_config)
    stop_ids = chat_stop_token_ids(template, backend.get_vocab(with_added_tokens=True))
    stop_ids.update(_as_id_list(gen_config.get("eos_token_id")))
    stop_ids.update(_as_id_list(model_config.get("eos_token_id")))
    if "eos_token" in names and (eos_id := backend.token_to_id(names["eos_token"])) is not None:
        stop_ids.add(eos_id)

    bos_id = backend.token_to_id(names["bos_token"]) if "bos_token" in names else None
    if bos_id is None and model_config.get("bos_token_id") is not None:
        bos_id = int(model_config["bos_token_id"])
    return Tokenizer(
        backend,
        eos_token_ids=stop_ids,
        bos_token_id=bos_id,
        chat_template=template,
        special_tokens_map=names,
    )
