"""Image bytes -> a checked, decoded picture and its content hash.

Shared by the API server (which refuses bad images with a 400 before any worker sees them),
the vision workers (which decode again and must survive anything) and the offline ``LLM``.
Only PNG, JPEG and WebP are accepted; the pixel bound is checked from the header, before the
pixels are decoded, so a decompression bomb is refused without being expanded.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from typing import Any

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP")
DEFAULT_MAX_PIXELS = 16_000_000
MAX_ASPECT_RATIO = 100
"""Resizing the shortest edge of a 1 x 10^7 strip would make a huge picture: refused."""
DATA_URL_TYPES = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",
    "image/webp": "WEBP",
}


class ImageError(ValueError):
    """An image that cannot be used; the message says why (it is shown to the client).

    code: a short machine-readable reason (invalid_base64, unsupported_format, ...)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def parse_data_url(url: str, max_bytes: int | None = None) -> bytes:
    """``data:image/png;base64,...`` -> the image bytes (ImageError on anything else)."""
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:") or not header.endswith(";base64"):
        raise ImageError("image data URLs must be data:<image type>;base64,<data>", "invalid_url")
    mime = header.removeprefix("data:").removesuffix(";base64").lower()
    if mime not in DATA_URL_TYPES:
        supported = ", ".join(sorted(set(DATA_URL_TYPES.values())))
        raise ImageError(
            f"unsupported image type {mime!r} (supported: {supported})", "unsupported_format"
        )
    if max_bytes is not None and len(payload) * 3 // 4 > max_bytes + 3:
        raise ImageError(
            f"the image is larger than the limit of {max_bytes} bytes", "image_too_large"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError("the image data is not valid base64", "invalid_base64") from exc
    check_size(data, max_bytes)
    return data


def check_size(data: bytes, max_bytes: int | None) -> None:
    if max_bytes is not None and len(data) > max_bytes:
        raise ImageError(
            f"the image is larger than the limit of {max_bytes} bytes", "image_too_large"
        )
    if not data:
        raise ImageError("the image is empty", "invalid_image")


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Any:
    """Decode PNG, JPEG or WebP bytes into an RGB PIL image, checking the pixel bound first."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=None)
            if image.format not in SUPPORTED_FORMATS:
                supported = ", ".join(SUPPORTED_FORMATS)
                raise ImageError(
                    f"unsupported image format {image.format} (supported: {supported})",
                    "unsupported_format",
                )
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(
                    f"the image has {width}x{height} pixels, more than the limit of {max_pixels}",
                    "image_too_large",
                )
            if max(width, height) > MAX_ASPECT_RATIO * max(min(width, height), 1):
                raise ImageError(
                    f"the image's aspect ratio exceeds {MAX_ASPECT_RATIO}:1", "invalid_image"
                )
            image.load()
            return image.convert("RGB")
    except ImageError:
        raise
    except Exception as exc:  # Pillow raises many types for corrupt data; all mean the same.
        raise ImageError("the image could not be decoded", "invalid_image") from exc


def image_hash(image: Any) -> str:
    """Content hash of a decoded RGB image: the same pixels have the same hash, whichever
    file format carried them."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode}:{image.width}x{image.height};".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
