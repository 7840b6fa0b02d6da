"""Shared command line for the DSL examples: --backend local|http --url URL --max-tokens N."""

from __future__ import annotations

import argparse
from typing import Any

import frontend_dsl as sgl


def parse_args(description: str, max_tokens: int = 32) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--backend", choices=["local", "http"], default="local",
                        help="local: the engine in this process; http: a running server")
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="server for --backend http")
    parser.add_argument("--model-path", default=None, help="local backend: model (default model)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    return parser.parse_args()


def make_backend(args: argparse.Namespace) -> Any:
    """Build the chosen backend and make it the default for sgl programs."""
    if args.backend == "http":
        backend = sgl.RuntimeEndpoint(args.url)
    else:
        backend = sgl.Runtime(model_path=args.model_path, max_total_tokens=16384)
    sgl.set_default_backend(backend)
    return backend
