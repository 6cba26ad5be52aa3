"""CLIP-style image preprocessing: resize the shortest edge, center-crop, rescale, normalize.

Reads the model directory's preprocessor_config.json (what transformers' CLIPImageProcessor
writes) and reproduces its Pillow path: bicubic resize of the uint8 image, then float math.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessor:
    shortest_edge: int
    crop_height: int
    crop_width: int
    resample: int = 3
    rescale_factor: float = 1 / 255
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    def __post_init__(self) -> None:
        if max(self.crop_height, self.crop_width) > self.shortest_edge:
            raise ValueError("a crop larger than the resized shortest edge is not supported")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ImageProcessor:
        size, crop = cfg.get("size", {}), cfg.get("crop_size", {})
        edge = size.get("shortest_edge", size.get("height", 224))
        return cls(
            shortest_edge=edge,
            crop_height=crop.get("height", edge),
            crop_width=crop.get("width", edge),
            resample=cfg.get("resample", 3),
            rescale_factor=cfg.get("rescale_factor", 1 / 255),
            mean=tuple(cfg.get("image_mean", CLIP_MEAN)),
            std=tuple(cfg.get("image_std", CLIP_STD)),
        )

    def __call__(self, images: Sequence[Any]) -> torch.Tensor:
        """RGB PIL images -> pixel values [images, 3, crop_height, crop_width] (float32)."""
        return torch.stack([self._one(image) for image in images])

    def _one(self, image: Any) -> torch.Tensor:
        width, height = image.size
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        size = (new_short, new_long) if width <= height else (new_long, new_short)
        resized = image.resize(size, resample=self.resample)
        top = (size[1] - self.crop_height) // 2
        left = (size[0] - self.crop_width) // 2
        pixels = np.asarray(resized, dtype=np.float32)
        pixels = pixels[top : top + self.crop_height, left : left + self.crop_width]
        scaled = pixels * np.float32(self.rescale_factor)
        mean, std = np.array(self.mean, np.float32), np.array(self.std, np.float32)
        normalized = ((scaled - mean) / std).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(normalized.transpose(2, 0, 1)))


def load_image_processor(path: str) -> ImageProcessor:
    """From preprocessor_config.json, or the ``image_processor`` of processor_config.json
    (where transformers 5 writes it)."""
    legacy = os.path.join(path, "preprocessor_config.json")
    if os.path.isfile(legacy):
        with open(legacy) as f:
            return ImageProcessor.from_hf(json.load(f))
    with open(os.path.join(path, "processor_config.json")) as f:
        return ImageProcessor.from_hf(json.load(f)["image_processor"])
