"""What the vision tests share: the tiny LLaVA model, test pictures, data URLs, chats."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.tiny_vlm import make_tiny_vlm


def tiny_vlm(directory: Path, tokenizer: Any) -> str:
    """`splitserve make-tiny-model` into directory (reusing the loaded SmolLM2 tokenizer)."""
    return make_tiny_vlm(directory, seed=0, tokenizer=tokenizer)


def picture(seed: int, size: tuple[int, int] = (40, 50)) -> Any:
    """A random RGB picture, the same for the same seed."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((*size, 3)) * 255).astype("uint8"))


def encoded(image: Any, fmt: str = "PNG", **options: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_chat(url: str, text: str = "What is in this picture?") -> list[dict[str, Any]]:
    """One user turn: text, then the image (the chat template puts `<image>` there)."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def hf_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same chat for transformers' processor: image parts become {"type": "image"}."""
    return [
        {
            **m,
            "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]],
        }
        for m in messages
    ]
