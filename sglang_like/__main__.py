"""`python -m sglang_like`: a one-off `generate` from the shell, or `serve` (the HTTP server)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

from sglang_like.config import QUANTIZATION_CHOICES, ServerArgs
from sglang_like.launch_server import add_speculative_arguments

_EXIT_BAD_INPUT = 2
_EXIT_ABORTED = 1
_ESCAPES = {"\\n": "\n", "\\t": "\t", "\\r": "\r", "\\\\": "\\"}
_DEFAULT_POOL_TOKENS = 8192


class UsageError(Exception):
    """Bad command-line input: printed as `error: ...` with exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_like",
                                description="sglang-like: generate from the shell, or serve.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt and print the text")
    g.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    g.add_argument("--model-path", default=None,
                   help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--quantization", default="auto", choices=list(QUANTIZATION_CHOICES),
                   help="weights: auto (CPU: int4/gguf/int8, CUDA: none), none (exact), int8, "
                   "int4, fp16, gguf (a GGUF file's matrices in their own types)")
    g.add_argument("--max-total-tokens", type=int, default=_DEFAULT_POOL_TOKENS,
                   help=f"KV pool size in tokens (default {_DEFAULT_POOL_TOKENS})")
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
    s = sub.add_parser("serve", add_help=False,
                       help="serve over HTTP (arguments go to sglang_like.launch_server)")
    s.add_argument("args", nargs=argparse.REMAINDER)
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
    if ns.model_path is not None and not os.path.exists(ns.model_path):
        raise UsageError(f"--model-path {ns.model_path!r} does not exist")
    if ns.max_total_tokens < 2:
        raise UsageError("--max-total-tokens must be at least 2")
    if ns.system is not None and not ns.chat:
        raise UsageError("--system needs --chat")
    try:
        SamplingParams.from_dict(params)  # fail before loading the model
    except ValueError as exc:
        raise UsageError(str(exc)) from None


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
    from sglang_like.engine import Engine

    try:
        engine = Engine(model_path=ns.model_path, dtype=ns.dtype, device=ns.device,
                        quantization=ns.quantization, max_total_tokens=ns.max_total_tokens,
                        **{k: v for k, v in vars(ns).items() if k.startswith("speculative_")})
    except (ValueError, OSError) as exc:
        raise UsageError(f"cannot load the model: {exc}") from None
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

    return launch_server.main(args) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # everything after `serve` belongs to launch_server, --help too
        try:
            return serve_main(argv[1:])
        except UsageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return _EXIT_BAD_INPUT
    ns = build_parser().parse_args(argv)  # argparse exits 2 on malformed options
    try:
        return generate_main(ns)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
