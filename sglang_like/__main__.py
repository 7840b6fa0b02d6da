"""`sglang-like` (or `python -m sglang_like`): `serve` over HTTP, `chat` in the terminal, or a
one-off `generate` from the shell."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

from sglang_like.config import QUANTIZATION_CHOICES, ServerArgs
from sglang_like.launch_server import ENV_API_KEY, add_speculative_arguments

_EXIT_BAD_INPUT = 2
_EXIT_ABORTED = 1
_ESCAPES = {"\\n": "\n", "\\t": "\t", "\\r": "\r", "\\\\": "\\"}
_DEFAULT_POOL_TOKENS = 8192


class UsageError(Exception):
    """Bad command-line input: printed as `error: ...` with exit status 2."""


def _prog() -> str:
    """The name the user typed: the console script, or `python -m sglang_like`."""
    return ("python -m sglang_like" if os.path.basename(sys.argv[0]) == "__main__.py"
            else "sglang-like")


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """What loads a model in this process (generate, chat)."""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model-path", default=None, help="the same as MODEL")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--quantization", default="auto", choices=list(QUANTIZATION_CHOICES),
                   help="weights: auto (CPU: int4/gguf/int8, CUDA: none), none (exact), int8, "
                   "int4, fp16, gguf (a GGUF file's matrices in their own types)")
    p.add_argument("--max-total-tokens", type=int, default=_DEFAULT_POOL_TOKENS,
                   help=f"KV pool size in tokens (default {_DEFAULT_POOL_TOKENS})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_prog(),
                                description="sglang-like: serve, chat, or generate from the shell.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", add_help=False,
                   help="serve over HTTP: serve [MODEL] [flags of sglang_like.launch_server]")
    g = sub.add_parser("generate", help="complete one prompt and print the text")
    _add_model_arguments(g)
    g.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    add_speculative_arguments(g, ServerArgs())
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--min-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", default=None)
    g.add_argument("--stop", nargs="+", default=None, metavar="S",
                   help="stop strings (\\n, \\t, \\r, \\\\ are unescaped)")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON",
                   help="constrain the output to a JSON schema (a file path or inline JSON)")
    g.add_argument("--regex", default=None, help="constrain the output to a regular expression")
    g.add_argument("--output-json", action="store_true",
                   help="print the whole result dict (text and meta_info) as JSON")
    c = sub.add_parser("chat", help="a streamed chat in the terminal, with history")
    _add_model_arguments(c)
    c.add_argument("--url", default=None, metavar="http://HOST:PORT",
                   help="chat with a running server (its /v1/chat/completions) instead of "
                   "loading the model here")
    c.add_argument("--api-key", default=None,
                   help=f"the server's key, with --url (default: ${ENV_API_KEY})")
    c.add_argument("--system", default=None, help="system message at the head of the chat")
    c.add_argument("--max-tokens", type=int, default=None, help="most tokens per reply")
    c.add_argument("--temperature", type=float, default=None)
    return p


def _unescape(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        pair = s[i:i + 2]
        if pair in _ESCAPES:
            out.append(_ESCAPES[pair])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _load_schema(value: str) -> str:
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--json-schema is neither a file nor valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise UsageError("--json-schema must be a JSON object (a JSON Schema)")
    return json.dumps(schema)


def sampling_params_from(ns: argparse.Namespace) -> dict[str, Any]:
    """The request's sampling params: only what was given, so the runtime's defaults apply."""
    names = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
             "repetition_penalty", "seed", "ignore_eos", "regex")
    params = {k: getattr(ns, k) for k in names if getattr(ns, k) is not None}
    if ns.stop:
        params["stop"] = [_unescape(s) for s in ns.stop]
    if ns.json_schema is not None:
        params["json_schema"] = _load_schema(ns.json_schema)
    return params


def _check_args(ns: argparse.Namespace, params: dict[str, Any]) -> None:
    from sglang_like.sampling_params import SamplingParams

    if not ns.prompt:
        raise UsageError("the prompt is empty")
    if ns.system is not None and not ns.chat:
        raise UsageError("--system needs --chat")
    try:
        SamplingParams.from_dict(params)  # fail before loading the model
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _model_path(ns: argparse.Namespace) -> str | None:
    """MODEL or --model-path (None: the default model), checked before anything loads."""
    if ns.model is not None and ns.model_path is not None:
        raise UsageError("give the model once: MODEL or --model-path")
    given, path = ("MODEL", ns.model) if ns.model is not None else ("--model-path", ns.model_path)
    if path is not None and not os.path.exists(path):
        raise UsageError(f"{given} {path!r} does not exist (a GGUF file or a Hugging Face "
                         "folder)")
    if ns.max_total_tokens < 2:
        raise UsageError("--max-total-tokens must be at least 2")
    return path


def _load_engine(ns: argparse.Namespace, model_path: str | None) -> Any:
    from sglang_like.engine import Engine

    try:
        return Engine(model_path=model_path, dtype=ns.dtype, device=ns.device,
                      quantization=ns.quantization, max_total_tokens=ns.max_total_tokens,
                      **{k: v for k, v in vars(ns).items() if k.startswith("speculative_")})
    except (ValueError, OSError) as exc:
        raise UsageError(f"cannot load the model: {exc}") from None


def _run(engine: Any, ns: argparse.Namespace, params: dict[str, Any]) -> int:
    kwargs: dict[str, Any] = {"sampling_params": params, "stream": ns.stream}
    if ns.chat:
        messages = [{"role": "system", "content": ns.system}] if ns.system else []
        messages.append({"role": "user", "content": ns.prompt})
        result = engine.chat(messages, **kwargs)
    else:
        result = engine.generate(ns.prompt, **kwargs)
    if ns.stream:
        last: dict | None = None
        for chunk in result:
            if not ns.output_json:
                sys.stdout.write(chunk["text"])
                sys.stdout.flush()
            last = chunk
        assert last is not None
        finish = last["meta_info"]["finish_reason"]
        if ns.output_json:
            print(json.dumps(last["meta_info"]))
        else:
            sys.stdout.write("\n")
    else:
        finish = result["meta_info"]["finish_reason"]
        print(json.dumps(result) if ns.output_json else result["text"])
    if finish and finish.get("type") == "abort":
        print(f"error: the request was aborted: {finish.get('message')}", file=sys.stderr)
        return _EXIT_ABORTED
    return 0


def generate_main(ns: argparse.Namespace) -> int:
    if ns.prompt == "-":
        ns.prompt = sys.stdin.read()
    params = sampling_params_from(ns)
    _check_args(ns, params)
    engine = _load_engine(ns, _model_path(ns))
    try:
        return _run(engine, ns, params)
    except ValueError as exc:  # what the engine rejects: too long, bad regex, ...
        raise UsageError(str(exc)) from None
    finally:
        engine.shutdown()


def serve_main(args: list[str]) -> int:
    if importlib.util.find_spec("sglang_like.launch_server") is None:
        raise UsageError("serving is not available: sglang_like.launch_server is missing")
    from sglang_like import launch_server

    if args and not args[0].startswith("-"):  # `serve MODEL [flags]`, as `vllm serve`
        if any(a == "--model-path" or a.startswith("--model-path=") for a in args[1:]):
            raise UsageError("give the model once: MODEL or --model-path")
        if not os.path.exists(args[0]):
            raise UsageError(f"MODEL {args[0]!r} does not exist (a GGUF file or a Hugging "
                             "Face folder)")
        args = ["--model-path", args[0], *args[1:]]
    return launch_server.main(args) or 0


def chat_main(ns: argparse.Namespace) -> int:
    from sglang_like.cli import EngineChat, HttpChat, chat_loop
    from sglang_like.sampling_params import SamplingParams

    if ns.max_tokens is not None and ns.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    local = {"max_new_tokens": ns.max_tokens, "temperature": ns.temperature}
    local = {k: v for k, v in local.items() if v is not None}
    try:
        SamplingParams.from_dict(local)  # the server checks the same ranges
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if ns.url is not None:
        if ns.model is not None or ns.model_path is not None:
            raise UsageError("--url chats with the server's own model: give no MODEL")
        params = {"max_tokens": ns.max_tokens, "temperature": ns.temperature}
        api_key = ns.api_key or os.environ.get(ENV_API_KEY)
        try:
            backend = HttpChat(ns.url, api_key, {k: v for k, v in params.items() if v is not None})
        except ValueError as exc:  # not a URL, no server there, refused
            raise UsageError(str(exc)) from None
        try:
            return chat_loop(backend, ns.system)
        finally:
            backend.close()
    engine = _load_engine(ns, _model_path(ns))
    try:
        return chat_loop(EngineChat(engine, local), ns.system)
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["serve"]:  # everything after `serve` belongs to launch_server, --help too
            return serve_main(argv[1:])
        ns = build_parser().parse_args(argv)  # argparse exits 2 on malformed options
        return chat_main(ns) if ns.command == "chat" else generate_main(ns)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
