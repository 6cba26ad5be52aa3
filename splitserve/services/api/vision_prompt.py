"""A chat prompt with images: checks that this deployment takes them, and expands each image
token into the encoder's placeholder tokens with its content hash (as ``LLM.chat`` does)."""

from __future__ import annotations

from splitserve.engine.vision.multimodal import expand_image_tokens
from splitserve.kvstore.hashing import ImageSpan
from splitserve.services.api import serving as sv
from splitserve.services.api.errors import APIError
from splitserve.services.api.images import PromptImages, load_images
from splitserve.services.messages import ImageData


async def check_images(state: sv.ServerState, urls: list[str]) -> list[ImageData]:
    """The request's images, loaded and checked; 400 when there are images but the model or
    the deployment cannot take them."""
    if not urls:
        return []
    if state.vision is None:
        raise APIError(
            400,
            f"messages: the model `{state.model_name}` does not accept images",
            param="messages",
            code="images_not_supported",
        )
    if "vision" not in state.exchange.pool.pools():
        raise APIError(
            400,
            "messages: this deployment has no vision pool to encode images",
            param="messages",
            code="images_not_supported",
        )
    return await load_images(urls, state.config.images)


def with_images(
    state: sv.ServerState, prompt: list[int], images: list[ImageData]
) -> tuple[list[int], PromptImages]:
    """The prompt with each image token repeated tokens_per_image times, and the images."""
    assert state.vision is not None
    vision = state.vision
    ids, spans = expand_image_tokens(prompt, vision.image_token_id, vision.tokens_per_image)
    if len(spans) != len(images):
        raise APIError(
            400,
            f"messages: {len(images)} images but {len(spans)} image tokens in the prompt",
            param="messages",
            code="invalid_value",
        )
    image_spans = [
        ImageSpan(image.image_hash, offset, length)
        for image, (offset, length) in zip(images, spans)
    ]
    return ids, PromptImages(image_spans, images)
