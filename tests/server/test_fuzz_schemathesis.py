"""schemathesis fuzzes a real server (default model) from its own /openapi.json: valid and
invalid bodies for /generate, /v1/completions, /v1/chat/completions and /abort_request (and
over the fake engine every /v1/* route and /encode as well). No 5xx, no hang, answers that conform
to the document (status codes, content types, bodies; invalid data rejected; undeclared
methods 405), and afterwards the server still serves and every KV slot is back.

Two sources of bodies per operation: schemathesis' coverage phase (deterministic boundary and
type-violating bodies, and undeclared methods; only the invalid ones, which must cost nothing)
and hypothesis (random valid and invalid bodies from the schemas). The work of one valid body
is bounded: the server's --context-length 64 caps prompt plus completion per sequence (longer
prompts are 400s), and `_bound_work` cuts its batch and n to 2 each.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterable
from typing import Any

import httpx
import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)
from schemathesis.core.failures import FailureGroup

SERVER_ARGS = ("--context-length", "64", "--max-running-requests", "16",
               "--max-total-tokens", "8192")
FUZZED_PATHS = r"^/(generate|abort_request|encode|v1/.*)$"
# the real model fuzzes the generating routes every other API is a layer over; the layers'
# own routes (Responses, Anthropic, embeddings, ...) are fuzzed over the fake engine, whose
# answers cost nothing, and tested against the real model by their own tests
REAL_MODEL_PATHS = r"^/(generate|abort_request|v1/(completions|chat/completions))$"
MAX_EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 25}
# The same bodies on every run unless a seed is given (SGLANG_LIKE_FUZZ_SEED=<int>).
SEED = int(os.environ.get("SGLANG_LIKE_FUZZ_SEED", "0"))
MAX_PROMPTS, MAX_N = 2, 2  # a valid body's batch and n are cut to these (the work bound)
REQUEST_TIMEOUT_S = 60.0  # a body not answered within this counts as a hang
MAX_FAILURES_PER_PHASE = 3
# positive_data_acceptance is left out on purpose: a body valid by the JSON schema can still
# be refused with a 400 for what a JSON schema cannot say (the prompt is longer than the
# context in tokens, a token id is outside the vocabulary, min_new_tokens > max_new_tokens,
# two constraints at once, a regex that does not compile, 2.0 where an integer literal is
# wanted). Every 4xx must still be a documented code with the error body.
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
    unsupported_method,
]


class _Fuzz:
    """Sends cases, checks each answer, and keeps the statistics and the findings."""

    def __init__(self) -> None:
        self.session = requests.Session()
        self.statuses: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self.slowest = (0.0, "", "")  # seconds, operation, body
        self.failures: list[str] = []

    def send(self, case: schemathesis.Case, source: str) -> None:
        if case.meta.generation.mode is GenerationMode.POSITIVE:
            _bound_work(case.body)
        t0 = time.monotonic()
        try:
            response = case.call(session=self.session, timeout=REQUEST_TIMEOUT_S)
        except requests.Timeout:
            raise AssertionError(f"no answer within {REQUEST_TIMEOUT_S} s (a hang?): "
                                 f"{case.as_curl_command()}") from None
        elapsed = time.monotonic() - t0
        if elapsed > self.slowest[0]:
            self.slowest = (elapsed, case.operation.label, repr(case.body)[:500])
        key = f"{case.operation.label} {source} {case.meta.generation.mode.value}"
        self.statuses[key][response.status_code] += 1
        case.validate_response(response, checks=CHECKS)

    def run_cases(self, label: str, cases: Iterable[schemathesis.Case]) -> None:
        """Every case (the coverage phase's), collecting up to a few failures."""
        num_failed = 0
        for case in cases:
            try:
                self.send(case, "coverage")
            except (Exception, FailureGroup) as e:  # noqa: BLE001 - gather every finding
                self.failures.append(f"{label} (coverage): {e}")
                num_failed += 1
                if num_failed >= MAX_FAILURES_PER_PHASE:
                    return

    def run_hypothesis(self, operation: Any, mode: GenerationMode, num_examples: int) -> None:
        settings = hypothesis.settings(
            max_examples=num_examples, deadline=None, database=None,
            # no shrinking: it would resend many more bodies; the failure names its body
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )

        def one(case: schemathesis.Case) -> None:
            self.send(case, "fuzz")

        test = hypothesis.seed(SEED)(
            settings(hypothesis.given(case=operation.as_strategy(mode))(one)))
        try:
            test()
        except (Exception, FailureGroup) as e:  # noqa: BLE001 - gather every finding
            self.failures.append(f"{operation.label} (fuzz, {mode.value}): {e}")

    def summary(self) -> str:
        rows = [f"  {k}: {dict(sorted(v.items()))}" for k, v in sorted(self.statuses.items())]
        elapsed, label, body = self.slowest
        return f"slowest answer {elapsed:.1f} s: {label} {body}\n" + "\n".join(rows)


@pytest.mark.slow
def test_fuzz_openapi(server_launcher: Any) -> None:
    server = server_launcher(*SERVER_ARGS)
    fuzz = _fuzz(server.url, coverage_modes=[GenerationMode.NEGATIVE], paths=REAL_MODEL_PATHS)
    _assert_survived(server.url, fuzz)


def test_fuzz_openapi_fake_engine(fake_server_factory: Any) -> None:
    """The same over the fake engine (the HTTP layer alone, in seconds), with the coverage
    phase's valid bodies too: they are too many for the real model's budget."""
    server = fake_server_factory(step_s=0.0, context_length=64)
    fuzz = _fuzz(server.url, coverage_modes=list(GenerationMode))
    _assert_survived(server.url, fuzz)


def _fuzz(url: str, coverage_modes: list[GenerationMode], paths: str = FUZZED_PATHS) -> _Fuzz:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    schema = schema.include(path_regex=paths)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /generate", "POST /v1/completions", "POST /v1/chat/completions"
    }
    fuzz = _Fuzz()
    t0 = time.monotonic()
    for operation in operations:
        fuzz.run_cases(operation.label, schema.iter_coverage_cases(
            operation, generation_modes=coverage_modes,
            generation_config=schema.config.generation_for(operation=operation),
        ))
        has_body = bool(operation.get_request_payload_content_types())
        for mode, num_examples in MAX_EXAMPLES.items():
            if mode is GenerationMode.POSITIVE or has_body:  # no body: nothing to make invalid
                fuzz.run_hypothesis(operation, mode, num_examples)
    print(f"fuzzed for {time.monotonic() - t0:.0f} s; {fuzz.summary()}")
    return fuzz


def _assert_survived(url: str, fuzz: _Fuzz) -> None:
    """No finding; the server still answers; no request and no KV slot is left behind."""
    r = httpx.post(url + "/generate", timeout=30, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text
    info = _wait_idle(url)
    assert not fuzz.failures, "\n\n".join(fuzz.failures)
    assert info["kv_pool"]["used_slots"] == 0 and info["num_running_reqs"] == 0, info
    # the fuzz got past validation too: some valid bodies were generated for on each route
    for label in ("POST /generate", "POST /v1/completions", "POST /v1/chat/completions"):
        assert fuzz.statuses[f"{label} fuzz positive"][200] > 0, fuzz.summary()


def _bound_work(body: Any) -> None:
    """Cut a valid body to at most MAX_PROMPTS prompts and n <= MAX_N (it stays valid).
    Invalid bodies are not cut: they must be refused before any work."""
    if not isinstance(body, dict):
        return
    for key in ("text", "input_ids", "prompt", "rid", "sampling_params"):
        value = body.get(key)
        if isinstance(value, list) and value and isinstance(value[0], (str, list, dict)):
            del value[MAX_PROMPTS:]
    params = body.get("sampling_params")
    for one in [body, *(params if isinstance(params, list) else [params])]:
        if isinstance(one, dict) and isinstance(one.get("n"), int) and one["n"] > MAX_N:
            one["n"] = MAX_N


def _wait_idle(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        idle = info["kv_pool"]["used_slots"] == 0 and info["num_running_reqs"] == 0
        if idle or time.monotonic() > deadline:
            return info
        time.sleep(0.2)
