"""The shape of a vision-language model's image side, read from a LLaVA-style config.json.

The text side is an ordinary ``ModelConfig`` (its ``text_config``); this holds what the
vision encoder, the projector and the prompt expansion need: the ViT's shape, which hidden
layer feeds the projector, and how many placeholder tokens one image takes in the prompt.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

VISION_MODEL_TYPES = ("llava",)


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    feature_layer: int
    """The hidden state the projector reads: k >= 0 after k layers, -1 the last, -2 ..."""
    select_strategy: str
    """"default" drops the CLS position, "full" keeps it."""
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int

    def __post_init__(self) -> None:
        if self.image_token_id < 0:
            raise ValueError("a vision-language config needs image_token_id")
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {self.select_strategy}")
        if self.hidden_act not in ("quick_gelu", "gelu"):
            raise ValueError(f"unsupported vision hidden_act {self.hidden_act!r}")
        if self.projector_act != "gelu":
            raise ValueError(f"unsupported projector_hidden_act {self.projector_act!r}")
        if not -self.num_layers - 1 <= self.feature_layer <= self.num_layers:
            raise ValueError(f"vision_feature_layer {self.feature_layer} is out of range")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens per image: one per patch, plus CLS under "full"."""
        return self.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def layers_to_run(self) -> int:
        """Encoder layers whose output feeds the projector (hidden state 0 is the input)."""
        layer = self.feature_layer
        return layer if layer >= 0 else self.num_layers + 1 + layer

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> VisionConfig:
        vision, text = cfg["vision_config"], cfg["text_config"]
        feature_layer = cfg.get("vision_feature_layer", -2)
        if not isinstance(feature_layer, int):
            raise ValueError("a list of vision_feature_layer values is not supported")
        return cls(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_layers=vision["num_hidden_layers"],
            num_heads=vision["num_attention_heads"],
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            num_channels=vision.get("num_channels", 3),
            layer_norm_eps=vision.get("layer_norm_eps", 1e-5),
            hidden_act=vision.get("hidden_act", "quick_gelu"),
            feature_layer=feature_layer,
            select_strategy=cfg.get("vision_feature_select_strategy", "default"),
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            text_hidden_size=text["hidden_size"],
            image_token_id=int(cfg.get("image_token_id", cfg.get("image_token_index", -1))),
        )


def read_hf_config(path: str) -> dict[str, Any] | None:
    """config.json of a Hugging Face directory (None for GGUF files and random shapes)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        config: dict[str, Any] = json.load(f)
    return config


def load_vision_config(path: str) -> VisionConfig | None:
    """The image side of the model at ``path``, or None for a text-only model."""
    cfg = read_hf_config(path)
    if cfg is None or cfg.get("model_type") not in VISION_MODEL_TYPES:
        return None
    return VisionConfig.from_hf(cfg)
