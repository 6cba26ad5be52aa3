"""Image content parts of chat requests: fetched or decoded, checked, hashed, in the API server.

Every image is refused here with a 400 (OpenAI error body) when it is not base64, not a
PNG / JPEG / WebP that decodes, larger than images.max_bytes or images.max_pixels, or one
too many (images.max_per_request). Remote http(s) URLs are fetched only from the hosts in
images.allowed_hosts (none by default), without following redirects, so a request cannot
make the server reach anything else. What passes goes to a vision worker as bytes plus the
content hash that keys its encoder cache and the prompt's block hashes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from splitserve.config import ImagesConfig
from splitserve.engine.vision.image_inputs import (
    ImageError,
    check_size,
    decode_image,
    image_hash,
    parse_data_url,
)
from splitserve.kvstore.hashing import ImageSpan
from splitserve.services.api.errors import APIError
from splitserve.services.messages import ImageData

PARAM = "messages"


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images: where their placeholders are, and what a vision worker encodes."""

    spans: list[ImageSpan]
    data: list[ImageData]


async def load_images(urls: list[str], limits: ImagesConfig) -> list[ImageData]:
    """Each URL's image bytes and content hash, in order; APIError 400 for a bad one."""
    if len(urls) > limits.max_per_request:
        raise APIError(
            400,
            f"{PARAM}: at most {limits.max_per_request} images per request, got {len(urls)}",
            param=PARAM,
            code="too_many_images",
        )
    return [await _load(i, url, limits) for i, url in enumerate(urls)]


async def _load(index: int, url: str, limits: ImagesConfig) -> ImageData:
    try:
        if url.startswith("data:"):
            data = parse_data_url(url, limits.max_bytes)
        else:
            data = await fetch(url, limits)
        picture = await asyncio.to_thread(decode_image, data, limits.max_pixels)
        return ImageData(await asyncio.to_thread(image_hash, picture), data)
    except ImageError as exc:
        raise APIError(400, f"{PARAM}: image {index}: {exc}", param=PARAM, code=exc.code) from exc


async def fetch(url: str, limits: ImagesConfig) -> bytes:
    """GET an http(s) image URL whose host is allowed; at most max_bytes are read."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ImageError("image URLs must be data:, http: or https: URLs", "invalid_url")
    host = (parts.hostname or "").lower()
    if host not in {h.lower() for h in limits.allowed_hosts}:
        raise ImageError(
            f"fetching images from {host or 'this URL'} is not allowed on this server "
            "(send the image as a base64 data: URL)",
            "image_url_not_allowed",
        )
    try:
        async with (
            httpx.AsyncClient(follow_redirects=False, timeout=limits.fetch_timeout_s) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise ImageError(
                    f"fetching the image failed with HTTP {response.status_code}",
                    "image_fetch_failed",
                )
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > limits.max_bytes:
                    break
    except httpx.HTTPError as exc:
        raise ImageError(
            f"fetching the image failed: {type(exc).__name__}", "image_fetch_failed"
        ) from exc
    check_size(bytes(data), limits.max_bytes)
    return bytes(data)
