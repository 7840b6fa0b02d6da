"""Image inputs as users send them -> RGB pictures, with the limits a server needs.

An image arrives as a `data:` URL, bare base64 (SGLang's `image_data`), an http(s) URL
(fetched with a byte cap and a timeout), a local path or `file://` URL (only under a folder the
operator allowed, as vLLM's `--allowed-local-media-path`), raw bytes or a PIL image. Anything
wrong with it is an `ImageError` (a ValueError: the server's 400) saying what.
Torch-free: the HTTP process decodes and preprocesses; the engine only encodes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from PIL import Image

# PIL refuses pictures past ~179 Mpx by default (a decompression-bomb guard); ours is lower
# and checked from the header before any pixel is decoded
Image.MAX_IMAGE_PIXELS = None


class ImageError(ValueError):
    """An image the server cannot take: unreadable, too large, not allowed, or unfetchable."""


@dataclass(frozen=True)
class ImageLimits:
    """What one image may cost the server."""

    max_bytes: int = 20 << 20  # the encoded file
    max_pixels: int = 40_000_000  # width * height, read from the header before decoding
    fetch_timeout_s: float = 10.0
    allowed_local_path: str | None = None  # None: local files are refused
    # hosts an http(s) image may come from (redirects included); None: any
    allowed_domains: tuple[str, ...] | None = None


def load_image(source: Any, limits: ImageLimits | None = None) -> Image.Image:
    """An RGB image from any accepted form of `source`; ImageError otherwise."""
    limits = limits or ImageLimits()
    if isinstance(source, Image.Image):
        return _checked(source, limits)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), limits)
    if not isinstance(source, str) or not source:
        raise ImageError(f"an image must be a URL, base64 text or bytes, got "
                         f"{type(source).__name__}")
    if source.startswith("data:"):
        return _decode(_data_url(source), limits)
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return _decode(_fetch(source, limits), limits)
    inline = _base64_image(source)  # before paths: a JPEG's base64 starts with "/9j/"
    if inline is not None:
        return _decode(inline, limits)
    if scheme == "file" or os.path.isabs(source) or source.startswith(("./", "../", "~")):
        return _decode(_read_local(source, limits), limits)
    try:
        return _decode(base64.b64decode(source, validate=True), limits)
    except (binascii.Error, ValueError):
        raise ImageError("an image string must be a data: URL, an http(s) URL, a local path "
                         "or base64 of an image file") from None


def content_hash(image: Image.Image) -> int:
    """A 63-bit hash of the decoded pixels (and size): the same picture sent as PNG or as a
    data URL gets the same hash, so it shares encoder output and KV."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"RIFF", b"BM", b"II*\x00", b"MM\x00*")


def _base64_image(text: str) -> bytes | None:
    """The bytes of `text` when it is strict base64 of something starting like an image file
    (PNG, JPEG, GIF, WebP, BMP, TIFF); None otherwise."""
    if len(text) < 16 or len(text) % 4:
        return None
    try:
        head = base64.b64decode(text[:16], validate=True)
    except (binascii.Error, ValueError):
        return None
    if not head.startswith(_MAGIC):
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageError("a data: URL image must be base64 (data:image/...;base64,...)")
    if not header[5:].startswith("image/"):
        raise ImageError(f"a data: URL of type {header[5:-7] or 'none'!r} is not an image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL's base64 is malformed") from None


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a host the limits allow."""

    def __init__(self, limits: ImageLimits) -> None:
        self.limits = limits

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> Any:
        _check_host(newurl, self.limits)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _check_host(url: str, limits: ImageLimits) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise ImageError(f"an image URL must be http(s), not {parts.scheme or 'none'!r}")
    host = (parts.hostname or "").lower()
    if limits.allowed_domains is not None and host not in limits.allowed_domains:
        raise ImageError(f"image URLs from {host!r} are not allowed (the server takes them "
                         "from --allowed-media-domains only)")


def _fetch(url: str, limits: ImageLimits) -> bytes:
    _check_host(url, limits)
    request = urllib.request.Request(url, headers={"User-Agent": "sglang-like"})
    opener = urllib.request.build_opener(_CheckedRedirects(limits))
    try:
        with opener.open(request, timeout=limits.fetch_timeout_s) as resp:
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
                raise ImageError(f"the image at {url} is {int(declared)} bytes; the limit is "
                                 f"{limits.max_bytes}")
            data = resp.read(limits.max_bytes + 1)
    except ImageError:
        raise
    except Exception as exc:  # URLError, timeouts, HTTP errors: the caller's URL failed
        raise ImageError(f"could not fetch the image at {url}: {exc}") from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image at {url} is over the limit of {limits.max_bytes} bytes")
    return data


def _read_local(source: str, limits: ImageLimits) -> bytes:
    if limits.allowed_local_path is None:
        raise ImageError("local image paths are not allowed (the server takes them only under "
                         "--allowed-local-media-path)")
    path = urllib.parse.unquote(urllib.parse.urlsplit(source).path) if source.startswith(
        "file:") else os.path.expanduser(source)
    root = os.path.realpath(limits.allowed_local_path)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ImageError(f"the image path {source!r} is outside the allowed media folder")
    try:
        size = os.path.getsize(real)
        if size > limits.max_bytes:
            raise ImageError(f"the image file is {size} bytes; the limit is {limits.max_bytes}")
        with open(real, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ImageError(f"cannot read the image file {source!r}: {exc.strerror}") from None


def _decode(data: bytes, limits: ImageLimits) -> Image.Image:
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data))
    except Exception:
        raise ImageError("the image data is not a readable image file (PNG, JPEG, WebP, GIF, "
                         "BMP, ...)") from None
    return _checked(image, limits, decode=True)


def _checked(image: Image.Image, limits: ImageLimits, decode: bool = False) -> Image.Image:
    w, h = image.size
    if w < 1 or h < 1:
        raise ImageError(f"the image is {w}x{h} pixels")
    if w * h > limits.max_pixels:
        raise ImageError(f"the image is {w}x{h} = {w * h} pixels; the limit is "
                         f"{limits.max_pixels}")
    try:
        if decode:
            image.load()
        return _rgb(image)
    except Exception as exc:
        raise ImageError(f"the image file is corrupt: {exc}") from None


def _rgb(image: Image.Image) -> Image.Image:
    # transparent pixels over white, as the Hugging Face processors flatten them
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
