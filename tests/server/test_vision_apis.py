"""Images through the Anthropic, Ollama and OpenAI Responses APIs on a real server over a tiny
seeded LLaVA (benchmarks/tiny_vlms.py), with each API's official client: the greedy answer
and the prompt's token count equal SGLang's /generate on the same conversation rendered by the
model's own chat template (transformers') with the same image. Bad image requests are 400s
with a message; a text-only model refuses images naming itself."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
import transformers

from benchmarks.tiny_vlms import build_llava, pictures

QUESTION = "What is in the picture?"
TOKENS = 8
_IMAGE_THEN_QUESTION = [{"role": "user", "content": [{"type": "image"},
                                                     {"type": "text", "text": QUESTION}]}]


def _file_bytes(image: Any, kind: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=kind)
    return buf.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "pic1.png").write_bytes(_file_bytes(pictures()[1]))
    return folder


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llava")
    build_llava(folder)
    return folder


@pytest.fixture(scope="module")
def server(module_server_launcher: Any, llava_folder: Path, media: Path) -> Any:
    return module_server_launcher(
        "--model-path", str(llava_folder), "--dtype", "float32", "--quantization", "none",
        "--max-total-tokens", "4096", "--allowed-local-media-path", str(media))


@pytest.fixture(scope="module")
def prompt(llava_folder: Path) -> str:
    """The user turn "<image>QUESTION" through the model's chat template, by transformers."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(llava_folder)
    return tokenizer.apply_chat_template(_IMAGE_THEN_QUESTION, tokenize=False,
                                         add_generation_prompt=True)


def _expected(server: Any, text: str, image_url: str) -> tuple[str, int]:
    """(/generate's greedy text, the prompt's token count) for a text naming one image."""
    r = httpx.post(server.url + "/generate", timeout=120, json={
        "text": text, "image_data": image_url,
        "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"], "the oracle answered nothing: the comparisons would prove little"
    return out["text"], out["meta_info"]["prompt_tokens"]


def test_anthropic_image_blocks(server: Any, prompt: str, media: Path) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="none")
    png = _file_bytes(pictures()[0])
    want, num_prompt = _expected(server, prompt, "data:image/png;base64," + _b64(png))
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": _b64(png)}}
    messages = [{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}]
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": TOKENS, "messages": messages,
                              "extra_body": {"temperature": 0}}
    reply = client.messages.create(**kwargs)
    assert reply.content[0].text == want
    # the placeholder counts as the image's tokens, in usage and in count_tokens alike
    assert reply.usage.input_tokens == num_prompt
    counted = client.messages.count_tokens(model="m", messages=messages)
    assert counted.input_tokens == num_prompt
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == want and streamed.usage.input_tokens == num_prompt
    # a url source: here a local file under --allowed-local-media-path
    other_want, _ = _expected(server, prompt, f"file://{media}/pic1.png")
    assert other_want != want  # the picture decides the answer
    url_block = {"type": "image", "source": {"type": "url", "url": f"file://{media}/pic1.png"}}
    reply = client.messages.create(**{**kwargs, "messages": [
        {"role": "user", "content": [url_block, {"type": "text", "text": QUESTION}]}]})
    assert reply.content[0].text == other_want


def test_ollama_images(server: Any, prompt: str) -> None:
    client = ollama.Client(host=server.url)
    png, jpeg = _file_bytes(pictures()[0]), _file_bytes(pictures()[2], "JPEG")
    options = {"temperature": 0, "num_predict": TOKENS}
    want, num_prompt = _expected(server, prompt, "data:image/png;base64," + _b64(png))
    reply = client.chat(model="m", options=options, messages=[
        {"role": "user", "content": QUESTION, "images": [png]}])
    assert reply.message.content == want and reply.prompt_eval_count == num_prompt
    # a JPEG's base64 starts with "/": still an image, not a path; images before the prompt
    assert _b64(jpeg).startswith("/")
    want, num_prompt = _expected(server, prompt, "data:image/jpeg;base64," + _b64(jpeg))
    reply = client.generate(model="m", prompt=QUESTION, images=[_b64(jpeg)], options=options)
    assert reply.response == want and reply.prompt_eval_count == num_prompt
    assert reply.context is None  # its ids could not carry the image back
    want, _ = _expected(server, "<image>Describe.", "data:image/png;base64," + _b64(png))
    raw = client.generate(model="m", prompt="Describe.", images=[png], raw=True,
                          options=options)
    assert raw.response == want
    assert "vision" in client.show(client.list().models[0].model).capabilities


def test_responses_input_image(server: Any, prompt: str) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    url = "data:image/png;base64," + _b64(_file_bytes(pictures()[0]))
    want, num_prompt = _expected(server, prompt, url)
    first = client.responses.create(
        model="m", temperature=0, max_output_tokens=TOKENS, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": url, "detail": "auto"},
            {"type": "input_text", "text": QUESTION}]}])
    assert first.output_text == want and first.usage.input_tokens == num_prompt
    # the kept conversation carries the image into the next turn
    second = client.responses.create(model="m", max_output_tokens=2, input="And?",
                                     previous_response_id=first.id)
    assert second.status == "incomplete"
    assert second.usage.input_tokens > num_prompt + first.usage.output_tokens


def _anthropic(content: list[dict[str, Any]], role: str = "user", **body: Any) -> dict:
    return {"model": "m", "max_tokens": 2, "messages": [{"role": role, "content": content}],
            **body}


_PNG = "data:image/png;base64," + _b64(_file_bytes(pictures()[0]))
_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                      "data": _PNG.split(",", 1)[1]}}


@pytest.mark.parametrize("route,body,needle", [
    ("/v1/messages", _anthropic([{**_BLOCK, "source": {**_BLOCK["source"],
                                                       "media_type": "image/bmp"}}]),
     "media_type"),
    ("/v1/messages", _anthropic([{**_BLOCK, "source": {**_BLOCK["source"], "data": "eHg="}}]),
     "not a readable image"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": [
        {**_BLOCK, "source": {**_BLOCK["source"], "data": "eHg="}}]}]}, "not a readable image"),
    ("/v1/messages", _anthropic([_BLOCK], role="assistant"), "belong in user turns"),
    ("/v1/messages", _anthropic([{"type": "text", "text": "Hi"}], system=[_BLOCK]),
     "system prompt takes text blocks only"),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "Hi",
                                               "images": ["not base64!"]}]},
     "messages[0].images[0] is not base64"),
    ("/api/generate", {"model": "m", "prompt": "Hi", "images": [_BLOCK["source"]["data"]],
                       "context": [1, 2]}, "cannot be combined with context"),
    ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": _PNG, "detail": "high"}]}]}, "only auto"),
    ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file_1"}]}]}, "Files API"),
], ids=["media-type", "unreadable", "count-unreadable", "assistant-image", "system-image",
        "ollama-not-base64", "ollama-context", "detail", "file-id"])
def test_bad_image_requests_are_400(server: Any, route: str, body: dict, needle: str) -> None:
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == 400 and needle in r.text, r.text


def test_a_text_only_model_refuses_images_naming_it(real_server: Any) -> None:
    block = {**_BLOCK, "source": dict(_BLOCK["source"])}
    with pytest.raises(anthropic.BadRequestError, match="SmolLM2.*reads text only"):
        anthropic.Anthropic(base_url=real_server.url, api_key="none").messages.create(
            **_anthropic([block]))
    with pytest.raises(ollama.ResponseError, match="SmolLM2.*reads text only") as caught:
        ollama.Client(host=real_server.url).chat(model="m", messages=[
            {"role": "user", "content": QUESTION, "images": [_BLOCK["source"]["data"]]}])
    assert caught.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="SmolLM2.*reads text only"):
        openai.OpenAI(base_url=real_server.url + "/v1", api_key="none").responses.create(
            model="m", max_output_tokens=2, input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": _PNG, "detail": "auto"}]}])
