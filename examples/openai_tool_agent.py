"""A ReAct agent over OpenAI tool calling: the model calls Python tools through
/v1/chat/completions (`tools`, `tool_calls`, `role: tool` results) until it can answer.

    python examples/openai_tool_agent.py            # starts a server on a free port, then stops it
    python examples/openai_tool_agent.py --url http://127.0.0.1:30000   # use a running server

The loop: the first step must call a tool (`tool_choice="required"`: the default 135M model
seldom decides to on its own), later steps let the model choose (`"auto"`), and the last one
asks for the answer (`"none"`). Every call's arguments are generated under the tool's JSON
schema, so they always parse.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
from typing import Any

import openai
from server_client import start_server


def add(a: int, b: int) -> int:
    return a + b


def multiply(a: int, b: int) -> int:
    return a * b


CAPITALS = {"france": "Paris", "italy": "Rome", "japan": "Tokyo", "peru": "Lima"}


def capital_of(country: str) -> str:
    return CAPITALS.get(country.strip().lower(), "unknown")


FUNCTIONS = {"add": add, "multiply": multiply, "capital_of": capital_of}
INTS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": INTS}},
    {"type": "function", "function": {"name": "multiply",
                                      "description": "Multiply two integers",
                                      "parameters": INTS}},
    {"type": "function", "function": {
        "name": "capital_of", "description": "The capital city of a country",
        "parameters": {"type": "object", "properties": {"country": {"type": "string"}},
                       "required": ["country"]}}},
]


def run_agent(client: openai.OpenAI, question: str, max_steps: int, max_tokens: int) -> str:
    messages: list[Any] = [
        {"role": "system", "content": "You answer questions. Use the tools for facts and sums."},
        {"role": "user", "content": question},
    ]
    for step in range(max_steps + 1):
        choice = "required" if step == 0 else ("none" if step == max_steps else "auto")
        response = client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, tool_choice=choice,
            temperature=0, max_tokens=max_tokens,
        )
        message = response.choices[0].message
        if not message.tool_calls:
            return (message.content or "").strip()
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            result = FUNCTIONS[call.function.name](**args)
            print(f"tool call: {call.function.name}({json.dumps(args)}) -> {result!r}")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"result": result})})
    return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server; default: start one")
    p.add_argument("--question", default="What is the capital of Japan?")
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    proc = None
    url = args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = start_server(port)
        url = f"http://127.0.0.1:{port}"
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        answer = run_agent(client, args.question, args.max_steps, args.max_tokens)
        print("final answer:", answer)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
