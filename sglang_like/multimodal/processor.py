"""Image preprocessing as each family's Hugging Face processor does it, and the prompt's image
tokens.

A prompt names each image with the family's placeholder (`<image>`; Gemma 3's
`<start_of_image>`); `ImagePrompter.build`
replaces the k-th placeholder by the k-th image's token text (LLaVA: one `<image>` per
embedding row; Idefics3 / SmolVLM: a grid of crops, each `<fake_token_around_image>
<row_r_col_c>` and its rows, then the global image; Gemma 3: its 256 soft tokens between
`<start_of_image>` and `<end_of_image>`), tokenizes the whole, and gives each image
token the image's pad value: an id past the vocabulary derived from the image's content hash.
The radix cache keys on these ids, so two images never share KV and the same image matches
itself (SGLang's pad values). Resizing runs through PIL on uint8 pixels with the file's
resample filter, so the pixels equal the Hugging Face PIL processor's. Torch-free.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from sglang_like.config import VisionConfig
from sglang_like.multimodal.images import content_hash

# pad ids live in [vocab, PAD_LIMIT): int32-safe for every table that holds token ids
PAD_LIMIT = 2**31 - 1
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_MAX_SIDE = 4096  # Idefics3's processor never resizes past 4k


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # float32 [crops, 3, H, W]
    text: str  # what replaces the image's placeholder in the prompt
    num_tokens: int  # image-token rows in `text`
    hash: int


@dataclass(frozen=True)
class ImageSpan:
    """One image of a tokenized prompt: its pad value, the runs (start, length) of prompt
    positions its embedding rows fill, in order, and its preprocessed pixels."""

    hash: int
    pad_value: int
    runs: list[tuple[int, int]]
    pixel_values: np.ndarray

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.runs)


def pad_value(image_hash: int, vocab_size: int) -> int:
    return vocab_size + image_hash % (PAD_LIMIT - vocab_size)


class _Preprocessor:
    def __init__(self, cfg: dict[str, Any], mean: tuple[float, ...], std: tuple[float, ...],
                 resample: int) -> None:
        self.resample = int(cfg.get("resample", resample))
        self.rescale = float(cfg.get("rescale_factor", 1 / 255)) if cfg.get(
            "do_rescale", True) else None
        norm = cfg.get("do_normalize", True)
        self.mean = np.array(cfg.get("image_mean", mean), dtype=np.float32) if norm else None
        self.std = np.array(cfg.get("image_std", std), dtype=np.float32) if norm else None

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        if image.size == (width, height):
            return image
        return image.resize((width, height), resample=self.resample)

    def _to_array(self, image: Image.Image) -> np.ndarray:
        x = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1).astype(np.float32)
        if self.rescale is not None:
            x = (x * self.rescale).astype(np.float32)
        if self.mean is not None:
            x = (x - self.mean[:, None, None]) / self.std[:, None, None]
        return x.astype(np.float32)


class ClipPreprocessor(_Preprocessor):
    """CLIPImageProcessor (LLaVA): shortest edge resized, centre crop; LlavaImageProcessor's
    `do_pad` first pads the picture to a square of the mean colour."""

    def __init__(self, cfg: dict[str, Any], vision: VisionConfig) -> None:
        super().__init__(cfg, _CLIP_MEAN, _CLIP_STD, Image.Resampling.BICUBIC)
        size = cfg.get("size", {"shortest_edge": vision.image_size})
        self.shortest = int(size["shortest_edge"]) if isinstance(size, dict) and (
            "shortest_edge" in size) else None
        self.fixed = (int(size["height"]), int(size["width"])) if isinstance(size, dict) and (
            "height" in size) else None
        if self.shortest is None and self.fixed is None:
            self.shortest = int(size) if isinstance(size, int) else vision.image_size
        crop = cfg.get("crop_size", vision.image_size) if cfg.get(
            "do_center_crop", "crop_size" in cfg) else None
        self.crop = None if crop is None else (
            (int(crop["height"]), int(crop["width"])) if isinstance(crop, dict)
            else (int(crop), int(crop)))
        self.do_pad = bool(cfg.get("do_pad", False))
        self.do_resize = bool(cfg.get("do_resize", True))

    def __call__(self, image: Image.Image) -> np.ndarray:
        if self.do_pad and image.width != image.height:
            side = max(image.size)
            color = tuple(int(m * 255) for m in (self.mean if self.mean is not None else (0,)))
            square = Image.new("RGB", (side, side), color if len(color) == 3 else (0, 0, 0))
            square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
            image = square
        if self.do_resize:
            if self.fixed is not None:
                image = self._resize(image, *self.fixed)
            else:
                w, h = image.size
                short, long = (w, h) if w <= h else (h, w)
                new_long = int(self.shortest * long / short)
                image = self._resize(image, *((new_long, self.shortest) if w <= h
                                              else (self.shortest, new_long)))
        x = self._to_array(image)
        if self.crop is not None:
            x = _center_crop(x, *self.crop)
        return x[None]


def _center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    _, h, w = x.shape
    if h < height or w < width:  # a picture smaller than the crop: zero-padded around it
        out = np.zeros((x.shape[0], max(h, height), max(w, width)), dtype=x.dtype)
        top, left = math.ceil((out.shape[1] - h) / 2), math.ceil((out.shape[2] - w) / 2)
        out[:, top:top + h, left:left + w] = x
        x, h, w = out, out.shape[1], out.shape[2]
    top, left = (h - height) // 2, (w - width) // 2
    return np.ascontiguousarray(x[:, top:top + height, left:left + width])


class Idefics3Preprocessor(_Preprocessor):
    """Idefics3ImageProcessor (SmolVLM): the longest edge resized to `size`, then up to
    multiples of the encoder's side, cut into side x side crops read row by row, and the whole
    picture resized to one more crop (the global image); no splitting: one square image."""

    def __init__(self, cfg: dict[str, Any], vision: VisionConfig) -> None:
        super().__init__(cfg, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), Image.Resampling.LANCZOS)
        self.longest = int((cfg.get("size") or {}).get("longest_edge", 4 * vision.image_size))
        self.side = int((cfg.get("max_image_size") or {}).get("longest_edge", vision.image_size))
        self.split = bool(cfg.get("do_image_splitting", True))
        self.do_resize = bool(cfg.get("do_resize", True))

    def grid(self, image: Image.Image) -> tuple[list[Image.Image], int, int]:
        """(crops then the global image, rows, cols); rows = cols = 0 when not split."""
        if self.do_resize:
            image = self._resize(image, *_fit_longest(image.height, image.width, self.longest))
        if not self.split:
            return [self._resize(image, self.side, self.side)], 0, 0
        image = self._resize(image, *_multiples(image.height, image.width, self.side))
        h, w = image.height, image.width
        if h <= self.side and w <= self.side:
            return [image], 0, 0
        rows, cols = (h - self.side) // self.side + 1, (w - self.side) // self.side + 1
        crops = [image.crop((c * self.side, r * self.side, (c + 1) * self.side,
                             (r + 1) * self.side)) for r in range(rows) for c in range(cols)]
        return crops + [self._resize(image, self.side, self.side)], rows, cols

    def __call__(self, image: Image.Image) -> np.ndarray:
        crops, _, _ = self.grid(image)
        return np.stack([self._to_array(c) for c in crops])


def _fit_longest(height: int, width: int, longest: int) -> tuple[int, int]:
    """Longest edge to `longest` keeping the aspect ratio, the other edge rounded up to even,
    then everything under 4k (Idefics3's rules)."""
    ratio = width / height
    if width >= height:
        width, height = longest, int(longest / ratio)
        height += height % 2
    else:
        height, width = longest, int(longest * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    if width >= height and width > _MAX_SIDE:
        width, height = _MAX_SIDE, int(_MAX_SIDE / ratio)
    elif height > width and height > _MAX_SIDE:
        height, width = _MAX_SIDE, int(_MAX_SIDE * ratio)
    return max(height, 1), max(width, 1)


def _multiples(height: int, width: int, side: int) -> tuple[int, int]:
    ratio = width / height
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / ratio) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * ratio) / side) * side
    return height, width


class ImagePrompter:
    """A served vision-language model's image side in the HTTP process: the placeholder users
    (and chat templates) write, the preprocessing, and the prompt expansion."""

    def __init__(self, vision: VisionConfig, preprocessor_cfg: dict[str, Any],
                 processor_cfg: dict[str, Any], vocab_size: int) -> None:
        self.vision = vision
        self.vocab_size = vocab_size
        self.placeholder = "<image>"
        if vision.family == "gemma3":
            if preprocessor_cfg.get("do_pan_and_scan"):
                raise ValueError("Gemma 3's pan-and-scan crops are not supported; set "
                                 "do_pan_and_scan false in the processor config")
            self.pre: Any = ClipPreprocessor(preprocessor_cfg, vision)
            self.tokens_per_crop = vision.tokens_per_image
            self.placeholder = "<start_of_image>"  # Gemma 3's boi token, as its users write
        elif vision.family == "llava":
            self.pre: Any = ClipPreprocessor(preprocessor_cfg, vision)
            crop = self.pre.crop or self.pre.fixed or (vision.image_size, vision.image_size)
            patches = (crop[0] // vision.patch_size) * (crop[1] // vision.patch_size)
            has_cls = vision.encoder == "clip"
            self.tokens_per_crop = patches + (1 if has_cls and vision.feature_select == "full"
                                              else 0)
        elif vision.family == "idefics3":
            self.pre = Idefics3Preprocessor(preprocessor_cfg, vision)
            self.tokens_per_crop = int(processor_cfg.get(
                "image_seq_len", vision.patches_per_side ** 2 // vision.scale_factor ** 2))
        else:
            raise ValueError(f"no image processor for the {vision.family!r} family")

    def process(self, image: Image.Image) -> ProcessedImage:
        if self.vision.family == "llava":
            pixels = self.pre(image)
            text = "<image>" * self.tokens_per_crop
        elif self.vision.family == "gemma3":
            pixels = self.pre(image)
            text = ("\n\n<start_of_image>" + "<image_soft_token>" * self.tokens_per_crop
                    + "<end_of_image>\n\n")
        else:
            crops, rows, cols = self.pre.grid(image)
            pixels = np.stack([self.pre._to_array(c) for c in crops])
            text = _idefics3_text(rows, cols, self.tokens_per_crop)
        return ProcessedImage(pixels, text, self.tokens_per_crop * pixels.shape[0],
                              content_hash(image))

    def build(self, text: str, images: list[Image.Image], encode: Any
              ) -> tuple[list[int], list[ImageSpan]]:
        """(prompt ids with each image's tokens set to its pad value, the images' spans);
        `encode` tokenizes a text as the engine tokenizes prompts."""
        parts = text.split(self.placeholder)
        if len(parts) - 1 != len(images):
            raise ValueError(f"the prompt has {len(parts) - 1} image placeholder(s) "
                             f"({self.placeholder!r}) for {len(images)} image(s)")
        done = [self.process(im) for im in images]
        ids = list(encode(parts[0] + "".join(p.text + rest
                                             for p, rest in zip(done, parts[1:], strict=True))))
        image_id = self.vision.image_token_id
        positions = [i for i, t in enumerate(ids) if t == image_id]
        if len(positions) != sum(p.num_tokens for p in done):
            raise ValueError(f"the prompt tokenizes to {len(positions)} image tokens where its "
                             f"images need {sum(p.num_tokens for p in done)}; is "
                             f"{self.placeholder!r} typed into the text?")
        spans, k = [], 0
        for p in done:
            mine = positions[k:k + p.num_tokens]
            k += p.num_tokens
            pad = pad_value(p.hash, self.vocab_size)
            for i in mine:
                ids[i] = pad
            spans.append(ImageSpan(p.hash, pad, _runs(mine), p.pixel_values))
        return ids, spans


def _idefics3_text(rows: int, cols: int, per_crop: int) -> str:
    image = "<image>" * per_crop
    glob = f"<fake_token_around_image><global-img>{image}<fake_token_around_image>"
    if rows == 0 and cols == 0:
        return glob
    grid = "".join("".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{image}"
                           for c in range(cols)) + "\n" for r in range(rows))
    return grid + "\n" + glob


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def load_prompter(model_path: str | None, vision: VisionConfig | None, vocab_size: int
                  ) -> ImagePrompter | None:
    """The prompter of a served model (None: it reads text only), from the folder's
    processor_config.json (and preprocessor_config.json, where older folders keep it)."""
    if vision is None:
        return None
    folder = model_path if model_path and os.path.isdir(model_path) else os.path.dirname(
        model_path or "")
    processor = _read(folder, "processor_config.json")
    # older folders keep the image processor's settings in a file of their own
    image = _read(folder, "preprocessor_config.json") or processor.get("image_processor") or {}
    return ImagePrompter(vision, image, processor, vocab_size)


def _read(folder: str, name: str) -> dict[str, Any]:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
