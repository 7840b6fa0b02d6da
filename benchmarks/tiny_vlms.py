"""Tiny seeded vision-language models saved as Hugging Face folders (weights, config, processor,
tokenizer, chat template): what tests/sglang_like/test_vision.py compares with transformers.

Each is built from transformers' own config classes: a 2-layer CLIP or SigLIP encoder over
32x32 pictures of 8x8 patches, the family's projector, and a 2-layer hidden-64 Llama reading
the default model's tokenizer with the family's image tokens added; its processor is the
family's Hugging Face processor (the PIL one), saved with it. Random pictures of a few sizes
exercise resizing, cropping and (Idefics3) splitting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.tiny_families import (
    FAMILIES,
    SHARED,
    default_tokenizer_json,
    peak,
    randomize,
)

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              image_size=32, patch_size=8)
# SmolVLM's and LLaVA's chat templates, as their folders ship them in spirit: an image part
# becomes the placeholder, text parts are written out
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# the same with Gemma 3's image placeholder, its begin-of-image token
GEMMA3_TEMPLATE = CHAT_TEMPLATE.replace("<image>", "<start_of_image>")

IDEFICS3_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                   + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])


def pictures(seed: int = 0) -> list[Image.Image]:
    """Random pictures: landscape, portrait, square, and one smaller than a crop."""
    rng = np.random.RandomState(seed)
    sizes = [(70, 50), (40, 90), (64, 64), (20, 24)]
    return [Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8)) for w, h in sizes]


def _tokenizer(folder: Path, extra: list[str], **named: str) -> Any:
    import transformers

    text, _ = default_tokenizer_json()
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|endoftext|>",
        eos_token="<|im_end|>", extra_special_tokens=named or None)
    if extra:
        tok.add_special_tokens({"additional_special_tokens": extra})
    return tok


def _text_config(vocab: int) -> Any:
    import transformers

    return transformers.LlamaConfig(vocab_size=vocab, **SHARED)


def build_llava(folder: Path, encoder: str = "clip") -> Any:
    """LLaVA over a CLIP (feature layer -2, class token dropped: llava-1.5's settings) or a
    SigLIP encoder (last layer, every patch); the transformers model, eval mode."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(folder, ["<image>"])
    torch.manual_seed(4321)
    if encoder == "clip":
        vision = transformers.CLIPVisionConfig(**VISION, hidden_act="quick_gelu")
        image_proc = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        layer, select, extra = -2, "default", 1
    else:
        vision = transformers.SiglipVisionConfig(**VISION)
        image_proc = transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32})
        layer, select, extra = -1, "full", 0
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=_text_config(len(tok)),
        image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=layer,
        vision_feature_select_strategy=select, projector_hidden_act="gelu")
    model = transformers.LlavaForConditionalGeneration(config).eval()
    processor = transformers.LlavaProcessor(
        image_processor=image_proc, tokenizer=tok, patch_size=8,
        vision_feature_select_strategy=select, num_additional_image_tokens=extra,
        chat_template=CHAT_TEMPLATE)
    return _finish(model, processor, folder, tok)


def build_idefics3(folder: Path) -> Any:
    """Idefics3 (SmolVLM's architecture): SigLIP over 32x32 crops, pixel shuffle by 2 (4 tokens
    a crop), pictures split into a grid of crops up to 64 pixels a side plus the global one."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(folder, IDEFICS3_TOKENS)
    torch.manual_seed(4322)
    config = transformers.Idefics3Config(
        vision_config=transformers.Idefics3VisionConfig(**VISION),
        text_config=_text_config(len(tok)), scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"))
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    image_proc = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = transformers.Idefics3Processor(image_processor=image_proc, tokenizer=tok,
                                               image_seq_len=4, chat_template=CHAT_TEMPLATE)
    return _finish(model, processor, folder, tok)


def build_gemma3(folder: Path) -> Any:
    """Gemma 3 (Gemma3ForConditionalGeneration): SigLIP over 32x32 pictures, its 16 patches
    average-pooled to 4 tokens, the text model tiny_families' Gemma 3 (sliding and global
    layers, a window of 8: shorter than an image's tokens plus its markers)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(folder, [], boi_token="<start_of_image>", eoi_token="<end_of_image>",
                     image_token="<image_soft_token>")
    gemma3 = next(f for f in FAMILIES if f.name == "gemma3")
    torch.manual_seed(4323)
    config = transformers.Gemma3Config(
        text_config=SHARED | gemma3.config | {"vocab_size": len(tok)}, vision_config=VISION,
        mm_tokens_per_image=4, boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tok.image_token_id)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers starts the projection at zero: images would be blank
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    image_proc = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = transformers.Gemma3Processor(image_processor=image_proc, tokenizer=tok,
                                             image_seq_length=4, chat_template=GEMMA3_TEMPLATE)
    return _finish(model, processor, folder, tok, GEMMA3_TEMPLATE)


def _finish(model: Any, processor: Any, folder: Path, tok: Any,
            template: str = CHAT_TEMPLATE) -> Any:
    randomize(model)
    # a few steps of text training give the language model the peaked logits a trained one
    # has (see tiny_families.peak); the image side stays random
    peak(model, tok.encode("The capital of France is Paris. Rain falls soft on the roof."))
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model.generation_config.eos_token_id = None  # like our ignore_eos
    return model
