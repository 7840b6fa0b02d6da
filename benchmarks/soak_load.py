"""A hostile mix of HTTP clients for soaks and storms (bench_soak, the server storm test).

    python -m benchmarks.soak_load --url http://127.0.0.1:30000 [--duration-s 60]

Each action is what some real user does: a plain or constrained /generate, n=2, an OpenAI
chat or completion through the official `openai` client (retries off, so statuses are the
server's own), a stream whose client goes away at a random point, a request aborted by its
rid, an oversized prompt, a hostile body. Every action records what came back; an action that
gets no answer within its deadline is recorded as such ("no answer"), never waited on forever.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

ACTIONS = {  # name -> weight in the mix
    "generate": 6, "constrained": 3, "n2": 2, "chat": 3, "completion": 2, "stream": 2,
    "stream_drop": 4, "abort": 2, "oversized": 1, "hostile": 3,
}
_TOPICS = ["the sea", "a lighthouse", "bread", "prime numbers", "a red fox", "the moon",
           "winter", "a clock", "rivers", "tea"]
_REGEX = "(yes|no|maybe), because [a-z ]{1,20}\\."
_SCHEMA = {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 12},
                                            "score": {"type": "integer"}},
           "required": ["topic", "score"]}


Outcome = tuple[int, str | None, str | None]  # (HTTP status, finish type, message)


@dataclass
class Record:
    """One action's outcome: `status` is the HTTP status (0: no answer or transport error)."""

    action: str
    start: float  # seconds since the load began
    latency: float
    status: int
    # the request's finish reason type ("stop", "length", "abort") when one came back
    finish: str | None = None
    message: str | None = None  # an abort's or an error's message
    retries: int = 0  # reconnects after a connection reset before any answer

    @property
    def is_internal_abort(self) -> bool:
        """Ended by a fault inside the runtime: an abort in the body (native API), or a 500
        with the message (OpenAI API, whose finish reasons cannot say why)."""
        internal = (self.message or "").startswith("internal error")
        return internal and (self.finish == "abort" or self.status == 500)

    @property
    def is_injected_fault(self) -> bool:
        return self.is_internal_abort and "InjectedFault" in (self.message or "")


def fault_numbers(message: str | None) -> set[int]:
    """The injected faults (`#N`) a record's message names: one, or one per item that a
    different fault ended."""
    return {int(n) for n in re.findall(r"InjectedFault: injected \w+ fault #(\d+)",
                                        message or "")}


def hostile_bodies(context_length: int) -> list[tuple[str, str, Any]]:
    """(path, description, body) of bad requests a careless or malicious client sends; each
    must get a 4xx with a message (a str body is sent as raw bytes)."""
    return [
        ("/generate", "not JSON", "{not json"),
        ("/generate", "a JSON list", "[1, 2, 3]"),
        ("/generate", "no prompt", {"sampling_params": {"max_new_tokens": 4}}),
        ("/generate", "max_new_tokens negative", {"text": "hi", "sampling_params":
                                                  {"max_new_tokens": -5}}),
        ("/generate", "temperature a string", {"text": "hi", "sampling_params":
                                               {"temperature": "hot"}}),
        ("/generate", "top_p 7", {"text": "hi", "sampling_params": {"top_p": 7}}),
        ("/generate", "bad regex", {"text": "hi", "sampling_params": {"regex": "(unclosed"}}),
        ("/generate", "bad json schema", {"text": "hi", "sampling_params":
                                          {"json_schema": "{\"type\": 12}"}}),
        ("/generate", "token id out of vocab", {"input_ids": [10**9]}),
        ("/generate", "n huge", {"text": "hi", "sampling_params": {"n": 10**6}}),
        ("/v1/chat/completions", "no messages", {"model": "x", "messages": []}),
        ("/v1/chat/completions", "role unknown", {"model": "x", "messages":
                                                  [{"role": "wizard", "content": "hi"}]}),
        ("/v1/chat/completions", "max_tokens past context", {
            "model": "x", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 10 * context_length}),
        ("/v1/completions", "logprobs 1000", {"model": "x", "prompt": "hi", "logprobs": 1000}),
        ("/v1/completions", "prompt a dict", {"model": "x", "prompt": {"a": 1}}),
        ("/v1/completions", "deep nesting", {"model": "x", "prompt": "hi",
                                             "stop": json.loads("[" * 60 + "]" * 60)}),
    ]


def _openai_message(e: Any) -> str:
    """The server's own error message (the client's str adds "Error code: N - ...")."""
    body = getattr(e, "body", None)
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return str(getattr(e, "message", e))


# Transport errors that happen before any answer when a pooled connection was reset.
_RESETS = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class LoadMix:
    """Drives one server at `url` with the action mix; `records` collects every outcome."""

    def __init__(self, url: str, context_length: int, seed: int = 0,
                 deadline_s: float = 120.0, model: str = "default",
                 actions: dict[str, int] | None = None) -> None:
        import openai

        self.actions = dict(actions or ACTIONS)
        unknown = [a for a in self.actions if not hasattr(self, f"_{a}")]
        if unknown:
            raise ValueError(f"unknown actions {unknown}")

        self.url = url.rstrip("/")
        self.context_length = context_length
        self.deadline_s = deadline_s
        self.records: list[Record] = []
        self._rng = random.Random(seed)
        self._t0 = time.monotonic()
        self._hostile_bodies = hostile_bodies(context_length)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(deadline_s, connect=10.0),
                                         limits=httpx.Limits(max_connections=1024))
        self._openai = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none",
                                          max_retries=0, timeout=deadline_s)
        self._model = model
        self._seq = 0

    async def aclose(self) -> None:
        await self._client.aclose()
        await self._openai.close()

    # ---- driving ---------------------------------------------------------------------------
    async def run_for(self, seconds: float, concurrency: int) -> None:
        """`concurrency` clients, each doing one random action after another, for `seconds`."""
        stop_at = time.monotonic() + seconds

        async def client() -> None:
            while time.monotonic() < stop_at:
                await self.one(self._pick())

        await asyncio.gather(*(client() for _ in range(concurrency)))

    async def run_count(self, num_actions: int, concurrency: int) -> None:
        """`num_actions` random actions, at most `concurrency` at a time."""
        sem = asyncio.Semaphore(concurrency)

        async def guarded(name: str) -> None:
            async with sem:
                await self.one(name)

        await asyncio.gather(*(guarded(self._pick()) for _ in range(num_actions)))

    async def burst(self, num_requests: int) -> list[Record]:
        """`num_requests` /generate calls at once (a flash crowd: 429s expected). Each asks
        for 32 tokens: calls as short as the mix's are served about as fast as a client on the
        same two cores opens their connections, so the server's waiting queue may never
        fill."""
        return list(await asyncio.gather(*(self.one("burst") for _ in range(num_requests))))

    def _pick(self) -> str:
        names = list(self.actions)
        return self._rng.choices(names, weights=[self.actions[n] for n in names])[0]

    async def one(self, action: str) -> Record:
        """Run one action with its deadline and record the outcome."""
        start = time.monotonic()
        self._seq += 1
        seed = self._rng.getrandbits(32)
        retries = 0
        while True:
            attempt = time.monotonic()
            try:
                status, finish, message = await asyncio.wait_for(
                    getattr(self, f"_{action}")(random.Random(seed), self._seq),
                    self.deadline_s + 5)
            except asyncio.TimeoutError:
                status, finish, message = 0, None, f"no answer within {self.deadline_s:.0f} s"
            except (httpx.HTTPError, OSError) as e:
                # A kept-alive connection the server closed just as it was reused fails at
                # once, before any answer; clients retry that (the official one does), and
                # so do we, twice. Anything else is the server's answer to the request.
                lost = isinstance(e, _RESETS) and time.monotonic() - attempt < 5
                if lost and retries < 2:
                    retries += 1
                    continue
                status, finish, message = 0, None, f"transport: {type(e).__name__}: {e}"
            break
        record = Record(action, start - self._t0, time.monotonic() - start, status, finish,
                        message, retries)
        self.records.append(record)
        return record

    # ---- actions: each returns (status, finish type, message) ------------------------------
    def _prompt(self, rng: random.Random) -> str:
        return f"Write one sentence about {rng.choice(_TOPICS)}."

    async def _post(self, path: str, body: Any) -> tuple[int, Any]:
        if isinstance(body, str):
            r = await self._client.post(self.url + path, content=body.encode(),
                                        headers={"content-type": "application/json"})
        else:
            r = await self._client.post(self.url + path, json=body)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    @staticmethod
    def _native_outcome(status: int, data: Any) -> Outcome:
        if status != 200:
            err = data.get("error", {}) if isinstance(data, dict) else {}
            return status, None, (err.get("message") if isinstance(err, dict) else str(data))
        items = data if isinstance(data, list) else [data]
        reasons = [i["meta_info"]["finish_reason"] for i in items]
        # each item's own: the samples of n = 2 are requests of their own, which two faults
        # in different steps can end
        aborts = list(dict.fromkeys(r.get("message") or "" for r in reasons
                                    if r["type"] == "abort"))
        if aborts:
            return status, "abort", " | ".join(aborts)
        return status, reasons[0]["type"], None

    async def _generate(self, rng: random.Random, seq: int,
                        max_new_tokens: int | None = None) -> Outcome:
        body = {"text": self._prompt(rng), "sampling_params": {
            "temperature": 0, "max_new_tokens": max_new_tokens or rng.randint(1, 8)}}
        return self._native_outcome(*await self._post("/generate", body))

    async def _burst(self, rng: random.Random, seq: int) -> Outcome:
        return await self._generate(rng, seq, max_new_tokens=32)

    async def _constrained(self, rng: random.Random, seq: int) -> Outcome:
        sp: dict[str, Any] = {"temperature": 0, "max_new_tokens": 24}
        if rng.random() < 0.5:
            sp["regex"] = _REGEX
        else:
            sp["json_schema"] = json.dumps(_SCHEMA)
        body = {"text": self._prompt(rng), "sampling_params": sp}
        return self._native_outcome(*await self._post("/generate", body))

    async def _n2(self, rng: random.Random, seq: int) -> Outcome:
        body = {"text": self._prompt(rng), "sampling_params": {
            "temperature": 0.8, "max_new_tokens": 6, "n": 2, "seed": seq}}
        return self._native_outcome(*await self._post("/generate", body))

    async def _openai_call(self, create: Any, **kwargs: Any) -> Outcome:
        """One call of the official client (retries off): its status, finish, message."""
        import openai

        try:
            resp = await create(model=self._model, temperature=0, **kwargs)
        except openai.APIStatusError as e:
            return e.status_code, None, _openai_message(e)
        except openai.APIConnectionError as e:
            raise httpx.RemoteProtocolError(f"openai client: {e}") from e
        return 200, resp.choices[0].finish_reason, None

    async def _chat(self, rng: random.Random, seq: int) -> Outcome:
        return await self._openai_call(
            self._openai.chat.completions.create, max_tokens=rng.randint(1, 8),
            messages=[{"role": "user", "content": self._prompt(rng)}])

    async def _completion(self, rng: random.Random, seq: int) -> Outcome:
        return await self._openai_call(self._openai.completions.create,
                                       prompt=self._prompt(rng), max_tokens=rng.randint(1, 8))

    async def _stream_drop(self, rng: random.Random, seq: int) -> Outcome:
        """A long stream whose client gives up after a random number of events."""
        body = {"text": self._prompt(rng), "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": 256, "ignore_eos": True}}
        keep = rng.randint(0, 12)
        async with self._client.stream("POST", self.url + "/generate", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return self._native_outcome(r.status_code, r.json())
            seen = 0
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                reason = json.loads(line[5:])["meta_info"]["finish_reason"]
                if reason is not None:  # ended before the client left (an abort, say)
                    return 200, reason["type"], reason.get("message")
                seen += 1
                if seen > keep:
                    break  # the client goes away: the server must abort and free it
        return 200, "dropped", None

    async def _stream(self, rng: random.Random, seq: int) -> Outcome:
        """A short stream read to its end."""
        body = {"text": self._prompt(rng), "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": rng.randint(1, 8)}}
        reason = None
        async with self._client.stream("POST", self.url + "/generate", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return self._native_outcome(r.status_code, r.json())
            async for line in r.aiter_lines():
                if line.startswith("data:") and line.strip() != "data: [DONE]":
                    reason = json.loads(line[5:])["meta_info"]["finish_reason"] or reason
        if reason is None:
            return 200, None, "the stream ended without a finish reason"
        return 200, reason["type"], reason.get("message")

    async def _abort(self, rng: random.Random, seq: int) -> Outcome:
        rid = f"soak-abort-{seq}-{rng.getrandbits(32):08x}"
        body = {"text": self._prompt(rng), "rid": rid, "sampling_params": {
            "temperature": 0, "max_new_tokens": 128, "ignore_eos": True}}
        task = asyncio.ensure_future(self._post("/generate", body))
        try:
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            await self._post("/abort_request", {"rid": rid})
            return self._native_outcome(*await task)
        finally:
            task.cancel()

    async def _oversized(self, rng: random.Random, seq: int) -> Outcome:
        body = {"text": "word " * (self.context_length + 50),
                "sampling_params": {"max_new_tokens": 4}}
        return self._native_outcome(*await self._post("/generate", body))

    async def _hostile(self, rng: random.Random, seq: int) -> Outcome:
        path, what, body = rng.choice(self._hostile_bodies)
        status, data = await self._post(path, body)
        err = data.get("error", {}) if isinstance(data, dict) else {}
        message = err.get("message") if isinstance(err, dict) else None
        return status, None, f"{what}: {message}"


async def _drive(args: argparse.Namespace) -> list[Record]:
    mix = LoadMix(args.url, args.context_length, seed=args.seed)
    try:
        await mix.run_for(args.duration_s, args.concurrency)
    finally:
        await mix.aclose()
    return mix.records


def main(argv: list[str] | None = None) -> int:
    """Drive a running server with the mix and print the statuses per action; exit 1 on a
    request with no answer or a 5xx that is not an injected fault's."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak_load",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="a running server")
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=8, help="clients looping actions")
    ap.add_argument("--context-length", type=int, default=1024,
                    help="the server's (oversized prompts go past it)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    records = asyncio.run(_drive(args))
    by_action: dict[str, Counter] = {}
    for r in records:
        by_action.setdefault(r.action, Counter())[r.status] += 1
    print(f"{len(records)} actions in {args.duration_s:.0f} s")
    for action, statuses in sorted(by_action.items()):
        print(f"  {action:<12}" + ", ".join(f"{k} x {v}" for k, v in sorted(statuses.items())))
    bad = [r for r in records
           if r.status == 0 or (r.status >= 500 and not r.is_injected_fault)]
    for r in bad[:5]:
        print(f"  {r.action}: {r.status} {r.message}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
