"""Image input on tiny seeded vision-language models (benchmarks/tiny_vlms.py) against
transformers: the preprocessing equals the family's Hugging Face processor, greedy output for
2 images x 2 questions equals transformers' (fp32), two images never share KV, the same image
is served from the cache, and bad input is refused with a message."""

from __future__ import annotations

import base64
import functools
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.tiny_vlms import build_gemma3, build_idefics3, build_llava, pictures
from sglang_like import Engine

from .spec_fakes import random_head

FAMILIES = ("llava-clip", "llava-siglip", "idefics3", "gemma3")
BUILD = {"llava-clip": lambda f: build_llava(f, "clip"),
         "llava-siglip": lambda f: build_llava(f, "siglip"),
         "idefics3": build_idefics3, "gemma3": build_gemma3}
QUESTIONS = ("What is in the picture?", "Describe the colours.")
NEW_TOKENS = 8


def _png(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, Any]]:
    """Each family's folder, its transformers model and processor."""
    import transformers

    out = {}
    for name in FAMILIES:
        folder = tmp_path_factory.mktemp(name)
        model = BUILD[name](folder)
        out[name] = (folder, model, transformers.AutoProcessor.from_pretrained(folder))
    return out


@pytest.fixture(scope="module")
def engines(built: dict[str, tuple[Path, Any, Any]]) -> dict[str, Engine]:
    made = {name: Engine(model_path=str(folder), dtype="float32", quantization="none",
                         max_total_tokens=4096, engine_in_process=True, random_seed=0)
            for name, (folder, _, _) in built.items()}
    yield made
    for engine in made.values():
        engine.shutdown()


def _prompt(question: str, n_images: int = 1, placeholder: str = "<image>") -> str:
    return (f"<|im_start|>user\n{placeholder * n_images}{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_preprocessing_and_prompt_ids_equal_the_hf_processor(
        family: str, built: dict[str, tuple[Path, Any, Any]], engines: dict[str, Engine]
) -> None:
    _, _, processor = built[family]
    engine = engines[family]
    prompter = engine.image_prompter
    pics = pictures()
    for pic in pics:
        ours = prompter.process(pic).pixel_values
        theirs = processor.image_processor(images=[pic], return_tensors="np")["pixel_values"]
        theirs = theirs.reshape(-1, *theirs.shape[-3:])[: ours.shape[0]]
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    text = _prompt("Two pictures?", 2, prompter.placeholder)
    ids, spans = prompter.build(text, pics[:2], engine.tokenizer.encode)
    want = processor(text=[text], images=pics[:2] if family.startswith("llava") else [pics[:2]],
                     return_tensors="np")["input_ids"][0].tolist()
    image_id = engine.model_config.vision.image_token_id
    assert [image_id if t >= engine.model_config.vocab_size else t for t in ids] == want
    assert len(spans) == 2 and spans[0].pad_value != spans[1].pad_value
    assert sum(s.num_tokens for s in spans) == want.count(image_id)


def _hf_greedy(model: Any, processor: Any, family: str, text: str, pic: Any) -> list[int]:
    inputs = processor(text=[text], images=[pic] if family.startswith("llava") else [[pic]],
                       return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_equals_transformers_for_two_images_and_two_questions(
        family: str, built: dict[str, tuple[Path, Any, Any]], engines: dict[str, Engine]
) -> None:
    _, model, processor = built[family]
    engine = engines[family]
    pics = pictures()[:2]
    outputs = {}
    for k, pic in enumerate(pics):
        for question in QUESTIONS:
            text = _prompt(question, 1, engine.image_prompter.placeholder)
            want = _hf_greedy(model, processor, family, text, pic)
            got = engine.generate(text, {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                         "ignore_eos": True}, image_data=_png(pic))
            assert got["output_ids"] == want, (family, k, question)
            outputs[k, question] = got["output_ids"]
    # the two pictures make the model say different things for at least one question
    assert any(outputs[0, q] != outputs[1, q] for q in QUESTIONS)


def test_two_images_share_no_kv_and_the_same_image_is_cached(
        engines: dict[str, Engine]) -> None:
    engine = engines["llava-clip"]
    engine.flush_cache()
    a, b = pictures(seed=7)[:2]
    text = _prompt("Which one?")
    first_image = engine.tokenizer.encode(text.split("<image>")[0]).__len__()
    sp = {"max_new_tokens": 2, "temperature": 0}
    engine.generate(text, sp, image_data=_png(a))
    other = engine.generate(text, sp, image_data=_png(b))
    # the text before the image is shared; nothing from the image on
    assert other["meta_info"]["cached_tokens"] <= first_image
    stats = engine.runner.encoder_cache.stats()
    again = engine.generate(text, sp, image_data=_png(a))
    assert again["meta_info"]["cached_tokens"] > first_image + 16  # past the 16 image rows
    # the image's KV came from the radix cache: its encoder output was not even looked up
    assert engine.runner.encoder_cache.stats()["misses"] == stats["misses"]


def test_the_encoder_runs_once_for_each_crop_of_an_image_across_requests(engines: dict[str, Engine]
                                                            ) -> None:
    engine = engines["idefics3"]
    engine.flush_cache()
    pic = pictures(seed=11)[0]
    before = engine.runner.encoder_cache.stats()
    for question in QUESTIONS:  # the radix cache shares only the text before the image
        engine.generate(_prompt(question), {"max_new_tokens": 1}, image_data=_png(pic))
    after = engine.runner.encoder_cache.stats()
    crops = engine.image_prompter.process(pic).pixel_values.shape[0]
    assert crops > 1 and after["misses"] - before["misses"] == crops  # each crop once


def test_bad_image_input_is_refused_with_a_message(engines: dict[str, Engine],
                                                   make_engine: Any) -> None:
    engine = engines["llava-clip"]
    sp = {"max_new_tokens": 1}
    text = _prompt("?")
    with pytest.raises(ValueError, match="not a readable image"):
        engine.generate(text, sp, image_data="data:image/png;base64," +
                        base64.b64encode(b"not a png").decode())
    with pytest.raises(ValueError, match="placeholder"):
        engine.generate(_prompt("?", 2), sp, image_data=_png(pictures()[0]))
    with pytest.raises(ValueError, match="local image paths are not allowed"):
        engine.generate(text, sp, image_data="/etc/passwd")
    with pytest.raises(ValueError, match="prompt logprobs cannot cover image positions"):
        engine.generate(text, sp, image_data=_png(pictures()[0]), return_logprob=True,
                        logprob_start_len=0)
    text_only = make_engine(engine_in_process=True)
    with pytest.raises(ValueError, match="reads text only"):
        text_only.generate(text, sp, image_data=_png(pictures()[0]))
    # the engine goes on
    assert engine.generate(text, sp, image_data=_png(pictures()[1]))["output_ids"]


def _counting(sizes: list[int], encode: Any, pixels: torch.Tensor) -> torch.Tensor:
    sizes.append(pixels.shape[0])
    return encode(pixels)


def _counting_trees(drafted: list[int], propose: Any, *args: Any, **kwargs: Any) -> Any:
    trees = propose(*args, **kwargs)
    drafted.append(sum(t is not None for t in trees))
    return trees


@pytest.mark.parametrize(("family", "chunk"), [("idefics3", 8), ("gemma3", 6)])
def test_chunked_prefill_through_images_and_ngram_speculation_keep_greedy_output(
        family: str, chunk: int, built: dict[str, tuple[Path, Any, Any]],
        engines: dict[str, Engine], tmp_path: Path) -> None:
    """Prefill chunks cut through images (Idefics3: 20 rows, 5 crops of 4, split across
    chunks; Gemma 3: chunks of 6 would end inside its first image's 4 two-way rows, which the
    scheduler keeps whole), and NGRAM and EAGLE-3 drafts over a prompt holding pad ids: each
    gives the plain engine's greedy tokens."""
    folder = built[family][0]
    pics = pictures()[:2]
    text = _prompt("Say it again and again and again and again.", 2,
                   engines[family].image_prompter.placeholder)
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    lp = {"return_logprob": True, "logprob_start_len": -1}
    want = engines[family].generate(text, sp, image_data=[_png(p) for p in pics], **lp)
    config = engines[family].model_config
    head = random_head(str(tmp_path / "head"), config.vocab_size, config.hidden_size,
                       config.num_hidden_layers)
    for knobs in ({"chunked_prefill_size": chunk},
                  {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
                  # a random head: every draft is verified (the controller may not switch it
                  # off) and rejected, over a prompt whose image positions the head reads
                  {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": head,
                   "speculative_auto_disable": False}):
        engine = Engine(model_path=str(folder), dtype="float32", quantization="none",
                        max_total_tokens=4096, engine_in_process=True, **knobs)
        sizes: list[int] = []
        encode = engine.runner.vision.encode
        engine.runner.vision.encode = functools.partial(_counting, sizes, encode)
        drafted: list[int] = []
        if engine.scheduler.drafter is not None:
            drafter = engine.scheduler.drafter
            drafter.propose = functools.partial(_counting_trees, drafted, drafter.propose)
        try:
            got = engine.generate(text, sp, image_data=[_png(p) for p in pics], **lp)
        finally:
            engine.shutdown()
        assert got["output_ids"] == want["output_ids"], knobs
        assert ("speculative_algorithm" in knobs) == (sum(drafted) > 0), drafted
        crops = [engines[family].image_prompter.process(p).pixel_values.shape[0] for p in pics]
        assert sum(sizes) == sum(crops)  # every crop encoded once
        if family == "idefics3" and "chunked_prefill_size" in knobs:
            # a chunk encodes the crops its rows come from, not the whole picture
            per = engines[family].image_prompter.tokens_per_crop
            assert max(sizes) <= chunk // per + 1 < max(crops), (sizes, crops)
        # and the same numbers: an image's two-way rows split across chunks would move them
        np.testing.assert_allclose(
            [t[0] for t in got["meta_info"]["output_token_logprobs"]],
            [t[0] for t in want["meta_info"]["output_token_logprobs"]], atol=2e-4)


def test_dsl_image_in_a_program_gens_and_selects(engines: dict[str, Engine],
                                                 tmp_path: Path) -> None:
    """sgl.image in a user turn: gen sees the image (the same tokens as the Engine call on
    the rendered prompt), select scores its choices with it; a local path is read by the
    client, a PIL image encoded."""
    import sglang_like as sgl

    engine = engines["llava-clip"]
    pic = pictures()[0]
    path = tmp_path / "pic.png"
    pic.save(path)
    backend = sgl.Runtime(engine=engine)

    @sgl.function
    def describe(s: Any, image: Any) -> None:
        s += sgl.user(sgl.image(image) + QUESTIONS[0])
        s += sgl.assistant(sgl.gen("answer", max_tokens=NEW_TOKENS, temperature=0,
                                   ignore_eos=True))
        s += sgl.user("Red or blue?")
        s += sgl.assistant(sgl.select("colour", ["red", "blue"]))

    want = engine.generate(_prompt(QUESTIONS[0]), {"max_new_tokens": NEW_TOKENS,
                                                   "temperature": 0, "ignore_eos": True},
                           image_data=_png(pic))["text"]
    for source in (str(path), pic):
        state = describe.run(image=source, backend=backend)
        assert state["answer"] == want
        assert state["colour"] in ("red", "blue")
    with pytest.raises(ValueError, match="takes no images"):
        describe.run(image=pic, backend=sgl.OpenAI("x", base_url="http://127.0.0.1:9"))


def test_image_sources_and_limits(tmp_path: Path) -> None:
    """Every accepted form gives the same pixels (and content hash); a JPEG's bare base64
    ("/9j/...") is an image, not a path; paths only under the allowed folder; caps hold."""
    from sglang_like.multimodal.images import ImageError, ImageLimits, content_hash, load_image

    pic = pictures()[2]
    png = io.BytesIO()
    pic.save(png, format="PNG")
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "p.png").write_bytes(png.getvalue())
    (tmp_path / "secret.png").write_bytes(png.getvalue())
    allowed = ImageLimits(allowed_local_path=str(tmp_path / "ok"))
    forms = [pic, png.getvalue(), base64.b64encode(png.getvalue()).decode(), _png(pic),
             str(tmp_path / "ok" / "p.png"), f"file://{tmp_path}/ok/p.png"]
    assert {content_hash(load_image(f, allowed)) for f in forms} == {content_hash(pic)}
    jpeg = io.BytesIO()
    pic.save(jpeg, format="JPEG")
    bare = base64.b64encode(jpeg.getvalue()).decode()
    assert bare.startswith("/9j/") and load_image(bare).size == pic.size
    for source, limits, message in (
            (str(tmp_path / "ok" / ".." / "secret.png"), allowed, "outside the allowed"),
            (str(tmp_path / "ok" / "p.png"), ImageLimits(), "not allowed"),
            (png.getvalue(), ImageLimits(max_bytes=100), "limit is 100"),
            (pic, ImageLimits(max_pixels=100), "pixels; the limit is 100"),
            (png.getvalue()[:60], ImageLimits(), "corrupt|not a readable"),
            ("data:text/plain;base64,aGVsbG8=", ImageLimits(), "not an image"),
            ("http://127.0.0.1:9/x.png", ImageLimits(fetch_timeout_s=2), "could not fetch")):
        with pytest.raises(ImageError, match=message):
            load_image(source, limits)


def test_image_urls_only_from_allowed_hosts_redirects_included() -> None:
    """--allowed-media-domains: a URL of another host is refused before any connection, and a
    redirect from an allowed host to another one is refused too (an SSRF guard)."""
    import http.server
    import threading

    from sglang_like.multimodal.images import ImageError, ImageLimits, load_image

    png = io.BytesIO()
    pictures()[0].save(png, format="PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/away":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{port}/pic.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(png.getvalue())))
            self.end_headers()
            self.wfile.write(png.getvalue())

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = httpd.server_address[1]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        only_ip = ImageLimits(allowed_domains=("127.0.0.1",))
        assert load_image(f"http://127.0.0.1:{port}/pic.png", only_ip).size == (70, 50)
        assert load_image(f"http://127.0.0.1:{port}/away").size == (70, 50)  # any host: follows
        with pytest.raises(ImageError, match="'localhost' are not allowed"):
            load_image(f"http://127.0.0.1:{port}/away", only_ip)
        with pytest.raises(ImageError, match="'example.org' are not allowed"):
            load_image("http://example.org/x.png", only_ip)
    finally:
        httpd.shutdown()
