"""Images inside a prompt: placeholder tokens whose input embeddings come from a vision encoder.

A prompt holds ``tokens_per_image`` copies of the image token id per image (as a Hugging Face
processor expands ``<image>``). The engine never sees pixels: each image arrives as an
``ImageInput`` (where its placeholders are, its content hash, its embeddings), and every step
that computes some of those positions, in whichever chunk or after whichever reused prefix,
takes the matching rows of the embeddings instead of the placeholder token's embedding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from splitserve.kvstore.hashing import ImageSpan


@dataclass
class ImageInput:
    """One image of a prompt. embeddings: [span.length, hidden], or None where only the
    block hashes matter (a decode worker adopting KV computed elsewhere)."""

    span: ImageSpan
    embeddings: torch.Tensor | None = None


def expand_image_tokens(
    token_ids: Sequence[int], image_token_id: int, tokens_per_image: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """Repeat each image token ``tokens_per_image`` times; returns the expanded ids and each
    image's (offset, length) in them, in prompt order."""
    expanded: list[int] = []
    spans: list[tuple[int, int]] = []
    for token in token_ids:
        if token == image_token_id:
            spans.append((len(expanded), tokens_per_image))
            expanded.extend([image_token_id] * tokens_per_image)
        else:
            expanded.append(token)
    return expanded, spans


def check_images(
    token_ids: Sequence[int],
    images: Sequence[ImageInput],
    image_token_id: int | None,
    hidden_size: int,
) -> None:
    """ValueError unless every image covers placeholder tokens only, in order, without
    overlap, with embeddings of its length (when it has any)."""
    if images and image_token_id is None:
        raise ValueError("this model does not accept images")
    previous_end = 0
    for image in images:
        span = image.span
        if span.length < 1 or span.offset < previous_end or span.end > len(token_ids):
            raise ValueError("image spans must be in order, inside the prompt, not overlapping")
        if any(t != image_token_id for t in token_ids[span.offset : span.end]):
            raise ValueError("an image span covers tokens other than the image token")
        shape = (span.length, hidden_size)
        if image.embeddings is not None and tuple(image.embeddings.shape) != shape:
            raise ValueError(f"image embeddings must have shape {shape}")
        previous_end = span.end
    placeholders = sum(1 for t in token_ids if t == image_token_id)
    if image_token_id is not None and placeholders != sum(i.span.length for i in images):
        raise ValueError("the prompt's image tokens do not match its images")


class WithImages(Protocol):
    """A request as the step's image positions see it (engine/request.py's Request fits)."""

    request_id: str
    images: list[ImageInput]


def touches_images(req: WithImages, start: int, end: int) -> bool:
    """Whether positions [start, end) of req include an image placeholder."""
    return any(i.span.offset < end and start < i.span.end for i in req.images)


def step_embeddings(
    segments: Sequence[tuple[int, WithImages, int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(flat rows, their embeddings) for the image positions of a step's segments.

    segments: (first flat row, request, start, end) for each request computing positions
    [start, end) of its sequence in this step. None when no image position is computed.
    """
    rows: list[int] = []
    values: list[torch.Tensor] = []
    for row, req, start, end in segments:
        for image in req.images:
            lo, hi = max(start, image.span.offset), min(end, image.span.end)
            if lo >= hi:
                continue
            if image.embeddings is None:
                raise ValueError(f"request {req.request_id}: image embeddings are missing")
            rows.extend(range(row + lo - start, row + hi - start))
            values.append(image.embeddings[lo - image.span.offset : hi - image.span.offset])
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    return index, torch.cat(values).to(device)
