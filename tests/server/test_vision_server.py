"""Image input through a real server on a tiny seeded LLaVA (benchmarks/tiny_vlms.py): the
official openai client's image_url parts (data: URLs, an http URL fetched by the server, a
local path under --allowed-local-media-path), SGLang's /generate image_data, JSON about an
image, n > 1 and streaming, image and text requests batched together; greedy output equals
transformers'. A text-only model and bad images answer 400 with a message."""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import http.server
import io
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from benchmarks.tiny_vlms import build_llava, pictures

QUESTION = "What is in the picture?"
PROMPT = f"<|im_start|>user\n<image>{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
TOKENS = 8


def _png_bytes(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(image: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(_png_bytes(image)).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    for k, pic in enumerate(pictures()[:2]):
        (folder / f"pic{k}.png").write_bytes(_png_bytes(pic))
    return folder


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    import transformers

    folder = tmp_path_factory.mktemp("llava")
    model = build_llava(folder)
    return folder, model, transformers.AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def server(module_server_launcher: Any, llava: tuple[Path, Any, Any], media: Path) -> Any:
    return module_server_launcher(
        "--model-path", str(llava[0]), "--dtype", "float32", "--quantization", "none",
        "--max-total-tokens", "4096", "--allowed-local-media-path", str(media))


@pytest.fixture(scope="module")
def image_host(media: Path) -> Any:
    """A loopback HTTP server handing out the media folder's pictures."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _hf_greedy(llava: tuple[Path, Any, Any], pic: Any) -> list[int]:
    _, model, processor = llava
    inputs = processor(text=[PROMPT], images=[pic], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _generate(server: Any, **body: Any) -> httpx.Response:
    body.setdefault("sampling_params", {"max_new_tokens": TOKENS, "temperature": 0,
                                        "ignore_eos": True})
    return httpx.post(server.url + "/generate", json=body, timeout=120)


def _chat(server: Any, url: str, **kwargs: Any) -> Any:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    return client.chat.completions.create(
        model="x", max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": QUESTION}]}], **kwargs)


def test_generate_image_data_equals_transformers(server: Any, llava: Any) -> None:
    for pic in pictures()[:2]:
        r = _generate(server, text=PROMPT, image_data=_data_url(pic))
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == _hf_greedy(llava, pic)


def test_openai_image_url_forms_give_the_same_answer(server: Any, image_host: str,
                                                     media: Path) -> None:
    pic = pictures()[0]
    want = _generate(server, text=PROMPT, image_data=_data_url(pic)).json()["text"]
    for url in (_data_url(pic), f"{image_host}/pic0.png", f"file://{media}/pic0.png",
                str(media / "pic0.png")):
        assert _chat(server, url).choices[0].message.content == want, url
    stream = _chat(server, f"{image_host}/pic0.png", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want


def test_json_about_an_image_n_2_and_mixed_batches(server: Any) -> None:
    pic = pictures()[1]
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}},
              "required": ["colour"]}
    reply = openai.OpenAI(base_url=server.url + "/v1", api_key="none").chat.completions.create(
        model="x", n=2, max_tokens=40, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(pic)}},
            {"type": "text", "text": "Colour as JSON?"}]}])
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert isinstance(json.loads(choice.message.content)["colour"], str)
    # image and text-only requests running together answer as they do alone
    alone_image = _generate(server, text=PROMPT, image_data=_data_url(pic)).json()["text"]
    alone_text = _generate(server, text="The capital of France is").json()["text"]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_generate, server, text=PROMPT, image_data=_data_url(pic))
                   if k % 2 else pool.submit(_generate, server, text="The capital of France is")
                   for k in range(6)]
        texts = [f.result().json()["text"] for f in futures]
    assert texts == [alone_image if k % 2 else alone_text for k in range(6)]


def test_bad_images_are_400_with_a_message(server: Any, image_host: str, tmp_path: Path
                                           ) -> None:
    cases = {
        "not a readable image": "data:image/png;base64," + base64.b64encode(b"xx").decode(),
        "could not fetch": f"{image_host}/missing.png",
        "outside the allowed media folder": str(tmp_path / "x.png"),
        "image placeholder": None,  # two placeholders, one image
    }
    for message, image in cases.items():
        text = PROMPT.replace("<image>", "<image><image>") if image is None else PROMPT
        r = _generate(server, text=text, image_data=image or _data_url(pictures()[0]))
        assert r.status_code == 400 and message in r.text, (message, r.text)
    with pytest.raises(openai.BadRequestError, match="only auto"):
        openai.OpenAI(base_url=server.url + "/v1", api_key="none").chat.completions.create(
            model="x", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _data_url(pictures()[0]),
                                                    "detail": "high"}}]}])
    assert _generate(server, text=PROMPT, image_data=_data_url(pictures()[0])).status_code == 200


def test_a_text_only_model_refuses_images_naming_it(real_server: Any) -> None:
    r = _generate(real_server, text=PROMPT, image_data=_data_url(pictures()[0]))
    assert r.status_code == 400 and "reads text only" in r.text and "SmolLM2" in r.text
    with pytest.raises(openai.BadRequestError, match="reads text only"):
        _chat(real_server, _data_url(pictures()[0]))


def test_the_dashboard_shows_an_image_as_one_mark(server: Any) -> None:
    pic = pictures()[0]
    assert _generate(server, text=PROMPT, image_data=_data_url(pic)).status_code == 200
    tree = httpx.get(server.url + "/cache_tree", params={"edge_tokens": 64}, timeout=30).json()
    texts = [n.get("text", "") for n in tree["nodes"]]
    marks = [t for t in texts if "[image " in t]
    assert marks, texts
    # the whole image (16 embedding rows: 4x4 patches, the class token dropped) is one mark
    # beside the prompt's text around it
    assert any("16 tokens]" in t and QUESTION[:10] in t for t in marks), marks
