"""Chat messages with image content parts -> the template's input and the pictures.

OpenAI-style parts are accepted: ``{"type": "text", "text": ...}``,
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` and, offline,
``{"type": "image", "image": <PIL image>}``. Every image part becomes ``{"type": "image"}``
for the chat template, which renders it as the model's image token.
"""

from __future__ import annotations

from typing import Any

from splitserve.engine.vision.image_inputs import ImageError, decode_image, parse_data_url


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages for the chat template, decoded RGB images in order of appearance)."""
    rendered: list[dict[str, Any]] = []
    images: list[Any] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            rendered.append(message)
            continue
        parts = []
        for part in content:
            if part.get("type") == "text":
                parts.append(part)
            else:
                images.append(_image_of(part))
                parts.append({"type": "image"})
        rendered.append({**message, "content": parts})
    return rendered, images


def _image_of(part: dict[str, Any]) -> Any:
    kind = part.get("type")
    if kind == "image":
        return part["image"].convert("RGB")
    if kind == "image_url":
        url = part["image_url"]["url"]
        if not url.startswith("data:"):
            raise ImageError("the offline API takes images as data: URLs", "invalid_url")
        return decode_image(parse_data_url(url))
    raise ValueError(f"unsupported content part type {kind!r}")
