"""LLaVA's image side: CLIP vision tower + two-layer MLP projector into the text model's
embedding space. The text side is the Llama family (models/llama.py), which takes the
projected rows in place of the image placeholder tokens' embeddings.

Weights load from a Hugging Face LLaVA directory (its vision tower and projector tensors,
named as ``loader.vlm_part`` reads them); the tower's layers past the selected feature layer and
its post-layernorm never feed the projector, so they are not built and their weights skipped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.loader import vlm_part
from splitserve.engine.models.clip_vision import CLIPVisionTower
from splitserve.engine.vision.config import VisionConfig

_MODULES = {"vision": "vision_tower", "projector": "multi_modal_projector"}


class LlavaProjector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        hidden, text = cfg.hidden_size, cfg.text_hidden_size
        self.linear_1 = nn.Linear(hidden, text, bias=cfg.projector_bias)
        self.linear_2 = nn.Linear(text, text, bias=cfg.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class LlavaVisionEncoder(nn.Module):
    """Pixels [images, 3, size, size] -> embeddings [images, tokens_per_image, text hidden]."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = CLIPVisionTower(cfg)
        self.multi_modal_projector = LlavaProjector(cfg)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        features = self.vision_tower(pixels)
        if self.config.select_strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            part, inner = vlm_part(hf_name)
            if part == "text":
                continue
            name = f"{_MODULES[part]}.{inner}"
            if name in params:
                params[name].copy_(tensor.to(params[name].dtype))
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} vision tensors: {missing[:3]}")
