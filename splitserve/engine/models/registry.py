"""Which model class serves a checkpoint's architecture."""

from __future__ import annotations

from splitserve.engine.model_config import ModelConfig
from splitserve.engine.models.llama import LlamaForCausalLM
from splitserve.engine.models.mixtral import MixtralForCausalLM
from splitserve.engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[cfg.architecture]
