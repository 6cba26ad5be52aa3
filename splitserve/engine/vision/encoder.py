"""The image side of a vision-language model on one device: pictures in, embeddings out.

The offline ``LLM`` and the vision workers use it; prefill and decode engines never load it
(they take the embeddings it produced). Loads only the vision tower and projector tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from splitserve.engine.loader import iter_weights, load_model_config
from splitserve.engine.models.llava import LlavaVisionEncoder
from splitserve.engine.vision.config import VisionConfig, load_vision_config
from splitserve.engine.vision.image_processor import load_image_processor


class VisionEncoder:
    def __init__(self, path: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
        config = load_vision_config(path)
        if config is None:
            raise ValueError(f"{path} is not a vision-language model")
        self.config: VisionConfig = config
        self.processor = load_image_processor(path)
        self.device = torch.device(device)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with self.device:
                self.model = LlavaVisionEncoder(config)
        finally:
            torch.set_default_dtype(previous)
        self.model.load_weights(iter_weights(path, load_model_config(path)))
        self.model.eval()

    @property
    def tokens_per_image(self) -> int:
        return self.config.tokens_per_image

    @torch.inference_mode()
    def encode(self, images: Sequence[Any]) -> list[torch.Tensor]:
        """RGB PIL images -> one [tokens_per_image, text hidden] tensor each."""
        if not images:
            return []
        pixels = self.processor(images).to(self.device)
        return list(self.model(pixels).unbind(0))
