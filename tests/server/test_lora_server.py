"""Multi-LoRA over HTTP (issue #50), on one real server with the default model: SGLang's
`lora_path` on /generate (a name, a list per prompt, streamed), OpenAI's `model` naming an
adapter (vLLM's bare name, SGLang's `base:adapter`), /load_lora_adapter and
/unload_lora_adapter, /v1/models, bad adapters refused with nothing changed, LRU eviction,
and load/unload while 16 streams run. The admin key on the two routes is checked over the
fake engine (the middleware is the same; no second model needed).

The adapters are seeded random PEFT ones (tests/sglang_like/lora_reference.py), made strong
enough that greedy output on them parts from the base model's within a few tokens.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.sglang_like.lora_reference import random_adapter

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
MAX_RANK = 16
MAX_LOADED = 4
# 5x the helper's default update: at its default, 12 greedy tokens of PROMPT on the int4 base
# did not part from the base model's
STRENGTH = 0.1
BASE = "SmolLM2-135M-Instruct"  # the served name of the default model


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Adapter folders: two good ones (ranks 4 and 8), and four the server must refuse (the
    bad ones are edited copies of `a`: PEFT writes each in seconds, copies cost nothing)."""
    root = tmp_path_factory.mktemp("lora")
    out = {"a": random_adapter(str(root / "a"), rank=4, seed=1, strength=STRENGTH),
           "b": random_adapter(str(root / "b"), rank=8, seed=2, strength=STRENGTH),
           "missing": str(root / "no-such-folder")}
    out["dora"] = _edited(out["a"], root / "dora", config={"use_dora": True})
    # one lora_A one column short: an adapter made for another model
    out["misfit"] = _edited(out["a"], root / "misfit", tensors=lambda k, t: (
        t[:, :-1] if "layers.0.self_attn.q_proj.lora_A" in k else t))
    # every A and B repeated along the rank: 4 x 8 = 32, above --max-lora-rank
    repeat = 2 * MAX_RANK // 4
    out["big"] = _edited(out["a"], root / "big", config={"r": 2 * MAX_RANK}, tensors=lambda k, t: (
        t.repeat(repeat, 1) if "lora_A" in k else t.repeat(1, repeat)))
    return out


def _edited(source: str, dest: Path, config: dict[str, Any] | None = None,
            tensors: Any = None) -> str:
    """A copy of the adapter folder `source` with config keys set and tensors changed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    cfg_path = dest / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **(config or {})}))
    if tensors is not None:
        weights = dest / "adapter_model.safetensors"
        save_file({k: tensors(k, t).contiguous() for k, t in load_file(str(weights)).items()},
                  str(weights))
    return str(dest)


@pytest.fixture(scope="module")
def server(module_server_launcher: Any, folders: dict[str, str]) -> Any:
    pinned_b = json.dumps({"lora_name": "b", "lora_path": folders["b"], "pinned": True})
    # deterministic inference: a prompt's greedy tokens do not depend on what else is in the
    # batch, so a request alone, in a mixed batch and streamed must all agree
    return module_server_launcher(
        "--lora-paths", f"a={folders['a']}", pinned_b, "--max-lora-rank", str(MAX_RANK),
        "--max-loaded-loras", str(MAX_LOADED), "--max-total-tokens", "2048",
        "--max-running-requests", "32", "--enable-deterministic-inference")


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)


def generate(server: Any, **body: Any) -> httpx.Response:
    body.setdefault("sampling_params", GREEDY)
    return httpx.post(server.url + "/generate", json=body, timeout=120)


def text_on(server: Any, lora: str | None, prompt: str = PROMPT) -> str:
    r = generate(server, text=prompt, **({"lora_path": lora} if lora else {}))
    assert r.status_code == 200, r.text
    return r.json()["text"]


def admin(server: Any, route: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/{route}", json=body, timeout=120)


def model_ids(server: Any) -> list[str]:
    return [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]]


def engine_adapters(server: Any) -> dict[str, dict[str, Any]]:
    info = httpx.get(server.url + "/get_server_info", timeout=10).json()
    return {a["name"]: a for a in info["lora_adapters"]}


def stream_native(server: Any, body: dict[str, Any]) -> dict[int, str]:
    """The final text of each index of a streamed /generate."""
    texts: dict[int, str] = {}
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                texts[event.get("index", 0)] = event["text"]
    return texts


# ---- picking an adapter per request ---------------------------------------------------------
def test_lora_path_and_openai_model_pick_the_same_adapter(server: Any,
                                                          client: openai.OpenAI) -> None:
    base, on_a, on_b = text_on(server, None), text_on(server, "a"), text_on(server, "b")
    assert len({base, on_a, on_b}) == 3, (base, on_a, on_b)

    # SGLang's batch forms: one entry per prompt, null for the base; streamed per index too
    r = generate(server, text=[PROMPT] * 3, lora_path=[None, "a", "b"])
    assert [x["text"] for x in r.json()] == [base, on_a, on_b], r.text
    assert [x["text"] for x in generate(server, text=[PROMPT] * 2,
                                        lora_path=[None, None]).json()] == [base, base]
    assert generate(server, text=PROMPT, lora_path=["a"]).json()["text"] == on_a
    assert stream_native(server, {"text": [PROMPT] * 3, "sampling_params": GREEDY,
                                  "lora_path": ["b", None, "a"]}) == {0: on_b, 1: base, 2: on_a}

    # OpenAI: the adapter's name (vLLM), `base:adapter` (SGLang), the base model's name, or
    # SGLang's lora_path field; the answer names the model asked for
    def complete(model: str, **extra: Any) -> Any:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True, **extra})

    for model, want in (("a", on_a), (f"{BASE}:a", on_a), ("b", on_b), (BASE, base)):
        answer = complete(model)
        assert (answer.choices[0].text, answer.model) == (want, model), model
    assert complete(BASE, lora_path="b").choices[0].text == on_b
    assert complete("a", lora_path="b").choices[0].text == on_a  # the model field comes first
    # a model name that is neither the base nor an adapter runs on the base, as before LoRA
    assert complete("gpt-4o").choices[0].text == base

    def chat(model: str) -> str:
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Describe a cat."}], max_tokens=12,
            temperature=0, extra_body={"ignore_eos": True})
        return answer.choices[0].message.content

    assert chat("b") == chat(f"{BASE}:b") != chat(BASE)


def test_unknown_adapter_is_refused_naming_it(server: Any, client: openai.OpenAI) -> None:
    for body in ({"text": PROMPT, "lora_path": "nope"},
                 {"text": [PROMPT, PROMPT], "lora_path": ["a", "nope"]},
                 {"text": PROMPT, "lora_path": "nope", "stream": True}):
        r = generate(server, **body)
        assert r.status_code == 400 and "'nope'" in r.json()["error"]["message"], r.text
    r = generate(server, text=[PROMPT, PROMPT], lora_path=["a"])
    assert r.status_code == 400 and "lora_path" in r.text, r.text
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model=f"{BASE}:nope", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.chat.completions.create(model=f"{BASE}:nope", max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="nope"):
        client.completions.create(model=BASE, prompt=PROMPT, max_tokens=2,
                                  extra_body={"lora_path": "nope"})


# ---- loading and unloading -------------------------------------------------------------------
def test_load_serve_unload(server: Any, folders: dict[str, str], client: openai.OpenAI) -> None:
    r = admin(server, "load_lora_adapter", lora_name="c", lora_path=folders["a"])
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["success"] is True and answer["error_message"] is None
    assert answer["loaded_adapters"] == {"a": folders["a"], "b": folders["b"], "c": folders["a"]}
    assert answer["adapter"]["name"] == "c" and answer["adapter"]["rank"] == 4
    assert answer["evicted"] == []
    models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [BASE, "a", "b", "c"]
    assert models[0]["parent"] is None
    assert {(m["parent"], m["root"]) for m in models[1:]} == {(BASE, folders["a"]),
                                                              (BASE, folders["b"])}
    # the same weights under another name answer the same
    assert text_on(server, "c") == text_on(server, "a")
    assert client.completions.create(model="c", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text == (
        text_on(server, "a"))
    for name, why in (("c", "already loaded"), (BASE, "served model's own name")):
        r = admin(server, "load_lora_adapter", lora_name=name, lora_path=folders["b"])
        assert r.status_code == 400 and why in r.json()["error_message"], r.text

    r = admin(server, "unload_lora_adapter", lora_name="c")
    assert r.status_code == 200, r.text
    assert r.json()["loaded_adapters"] == {"a": folders["a"], "b": folders["b"]}
    assert r.json()["adapter"]["in_flight"] == 0
    assert model_ids(server) == [BASE, "a", "b"]
    r = generate(server, text=PROMPT, lora_path="c")
    assert r.status_code == 400 and "'c'" in r.json()["error"]["message"], r.text
    with pytest.raises(openai.NotFoundError, match="'c'"):
        client.completions.create(model=f"{BASE}:c", prompt=PROMPT, max_tokens=2)
    r = admin(server, "unload_lora_adapter", lora_name="c")  # SGLang answers 400 here too
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert "'c'" in r.json()["error"]["message"]


def test_bad_adapters_are_refused_and_change_nothing(server: Any,
                                                     folders: dict[str, str]) -> None:
    before = (model_ids(server), engine_adapters(server))
    cases = {"missing": "not a folder", "dora": "DoRA", "misfit": "do not fit",
             "big": f"above --max-lora-rank {MAX_RANK}"}
    for kind, why in cases.items():
        r = admin(server, "load_lora_adapter", lora_name="bad", lora_path=folders[kind])
        assert r.status_code == 400, (kind, r.text)
        answer = r.json()
        assert answer["success"] is False and why in answer["error_message"], (kind, answer)
        assert answer["error"]["message"] == answer["error_message"]
    for body in ({"lora_name": "bad"}, {"lora_name": "", "lora_path": folders["a"]},
                 {"lora_name": "x" * 300, "lora_path": folders["a"]}, {"lora_name": 5}):
        r = admin(server, "load_lora_adapter", **body)
        assert r.status_code == 400 and r.json()["success"] is False, (body, r.text)
    assert (model_ids(server), engine_adapters(server)) == before
    assert generate(server, text=PROMPT, lora_path="bad").status_code == 400


def test_loading_past_max_loaded_evicts_the_least_recently_used(
        server: Any, folders: dict[str, str], client: openai.OpenAI) -> None:
    loaded = [admin(server, "load_lora_adapter", lora_name=name, lora_path=folders["a"])
              for name in ("c", "d")]
    assert [r.json()["evicted"] for r in loaded] == [[], []]
    text_on(server, "a")  # used last: "c" is now the least recently used (b is pinned)
    text_on(server, "d")
    r = admin(server, "load_lora_adapter", lora_name="e", lora_path=folders["b"])
    assert r.status_code == 200 and r.json()["evicted"] == ["c"], r.text
    assert model_ids(server) == [BASE, "a", "b", "d", "e"]
    assert generate(server, text=PROMPT, lora_path="c").status_code == 400
    with pytest.raises(openai.NotFoundError, match="'c'"):
        client.completions.create(model=f"{BASE}:c", prompt=PROMPT, max_tokens=2)
    for name in ("d", "e"):
        assert admin(server, "unload_lora_adapter", lora_name=name).status_code == 200
    assert model_ids(server) == [BASE, "a", "b"]


# ---- under load --------------------------------------------------------------------------------
def test_load_and_unload_while_16_streams_run(server: Any, folders: dict[str, str]) -> None:
    """16 streams (OpenAI and native) on the base, a, b and c; while they run, d is loaded and
    used, c unloaded. Every stream ends with its finish reason, the ones on c too (they were
    admitted first); requests naming c after the unload get a clear 400/404; afterwards the
    server is healthy, every KV slot is back and no adapter is held."""
    assert admin(server, "load_lora_adapter", lora_name="c",
                 lora_path=folders["b"]).status_code == 200
    models = [BASE, "a", "b", "c"]
    new_tokens = 64  # long enough that the streams on c are still running at its unload

    async def run() -> tuple[list[str], dict[str, Any]]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                     timeout=120)
        http = httpx.AsyncClient(base_url=server.url, timeout=120)

        async def openai_stream(model: str) -> tuple[Any, Any]:
            stream = await aclient.completions.create(
                model=model, prompt=PROMPT, max_tokens=new_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            return stream, None

        async def native_stream(lora: str) -> tuple[Any, Any]:
            body = {"text": PROMPT, "stream": True, "sampling_params": {
                **GREEDY, "max_new_tokens": new_tokens}}
            if lora != BASE:
                body["lora_path"] = lora
            request = http.build_request("POST", "/generate", json=body)
            response = await http.send(request, stream=True)
            assert response.status_code == 200, await response.aread()
            return None, response

        async def finish(opened: tuple[Any, Any]) -> str:
            stream, response = opened
            if stream is not None:
                reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
                return reasons[-1]
            events = [line async for line in response.aiter_lines() if line.startswith("data")]
            await response.aclose()
            assert events[-1] == "data: [DONE]", events[-3:]
            return json.loads(events[-2][6:])["meta_info"]["finish_reason"]["type"]

        # the streams are open (each admitted and prefilled) before the adapters change
        opened = await asyncio.gather(*[
            openai_stream(models[i % 4]) if i % 2 else native_stream(models[i % 4])
            for i in range(16)])
        tasks = [asyncio.ensure_future(finish(o)) for o in opened]
        changes = await asyncio.gather(
            http.post("/load_lora_adapter", json={"lora_name": "d", "lora_path": folders["a"]}),
            http.post("/unload_lora_adapter", json={"lora_name": "c"}))
        assert [r.status_code for r in changes] == [200, 200], [r.text for r in changes]
        assert changes[1].json()["adapter"]["in_flight"] > 0  # c went while streams used it
        late = {"native c": await http.post("/generate", json={
            "text": PROMPT, "lora_path": "c", "sampling_params": GREEDY})}
        try:
            await aclient.completions.create(model=f"{BASE}:c", prompt=PROMPT, max_tokens=2,
                                             stream=True)
        except openai.NotFoundError as e:
            late["openai c"] = e.response
        late["native d"] = await http.post("/generate", json={
            "text": PROMPT, "lora_path": "d", "sampling_params": GREEDY})
        reasons = await asyncio.gather(*tasks)
        await http.aclose()
        await aclient.close()
        return reasons, late

    reasons, late = asyncio.run(run())
    assert reasons == ["length"] * 16, reasons
    assert late["native c"].status_code == 400 and "'c'" in late["native c"].text
    assert late["openai c"].status_code == 404
    assert late["native d"].status_code == 200, late["native d"].text
    assert late["native d"].json()["text"] == text_on(server, "a")

    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 30
    while True:
        info = httpx.get(server.url + "/get_server_info", timeout=10).json()
        if (info["kv_pool"]["used_slots"] == 0 and info["num_running_reqs"] == 0) or (
                time.monotonic() > deadline):
            break
        time.sleep(0.2)
    assert info["kv_pool"]["used_slots"] == 0 and info["num_running_reqs"] == 0, info
    assert {a["name"]: a["in_flight"] for a in info["lora_adapters"]} == {"a": 0, "b": 0, "d": 0}
    assert admin(server, "unload_lora_adapter", lora_name="d").status_code == 200


# ---- the admin key, over the fake engine -------------------------------------------------------
def test_lora_routes_need_the_admin_key(fake_server_factory: Any) -> None:
    keyed = fake_server_factory(api_key="user-key", admin_api_key="admin-key")
    for route, body in (("/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
                        ("/unload_lora_adapter", {"lora_name": "x"})):
        assert httpx.post(keyed.url + route, json=body).status_code == 401
        r = httpx.post(keyed.url + route, json=body,
                       headers={"Authorization": "Bearer user-key"})
        assert r.status_code == 403 and "admin API key" in r.text, r.text
        r = httpx.post(keyed.url + route, json=body,
                       headers={"Authorization": "Bearer admin-key"})
        # past the key: this engine serves no adapters, which the route says
        assert r.status_code == 400 and "LoRA is not enabled" in r.json()["error_message"]


def test_naming_an_adapter_on_a_server_without_lora(fake_server: Any) -> None:
    """Refused at the edge, before any work, whatever the engine behind the server."""
    for path, body in (("/generate", {"text": "hi", "lora_path": "x"}),
                       ("/generate", {"text": ["hi", "ho"], "lora_path": [None, "x"]}),
                       ("/v1/completions", {"prompt": "hi", "lora_path": "x"})):
        r = httpx.post(fake_server.url + path, json=body)
        assert r.status_code == 400 and "LoRA is not enabled" in r.text, (path, r.text)
    r = httpx.post(fake_server.url + "/v1/completions", json={"model": "fake-model:x",
                                                               "prompt": "hi"})
    assert r.status_code == 404 and "LoRA is not enabled" in r.text, r.text
    # nulls and the base model's name are no adapter: served as before
    assert httpx.post(fake_server.url + "/generate", json={
        "text": ["hi", "ho"], "lora_path": [None, None]}).status_code == 200
    models = httpx.get(fake_server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["fake-model"]
