"""Which model class serves a checkpoint's architecture."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.layers.expert_placement import ExpertParallel, GroupMember
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.models.deepseek_mtp import DeepseekMTP
from splitserve.engine.models.deepseek_v2 import DeepseekV2ForCausalLM
from splitserve.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from splitserve.engine.models.deepseek_v4_mtp import DeepseekV4MTP
from splitserve.engine.models.gemma3 import Gemma3ForCausalLM
from splitserve.engine.models.llama import LlamaForCausalLM
from splitserve.engine.models.mixtral import MixtralForCausalLM
from splitserve.engine.models.qwen3 import Qwen3ForCausalLM
from splitserve.engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV2ForCausalLM,
    "deepseek_v4": DeepseekV4ForCausalLM,
    "deepseek_mtp": DeepseekMTP,  # V3's MTP layer, the mtp drafter's model
    "deepseek_v4_mtp": DeepseekV4MTP,  # V4's MTP block, the mtp drafter's model
}


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[cfg.architecture]


def expert_parallel(
    config: EngineConfig, cfg: ModelConfig, member: GroupMember | None = None
) -> dict[str, Any]:
    """The model's keyword arguments for expert parallelism (none without it): this process's
    rank of ``member``'s group (default: the default torch.distributed group), with the
    config's placement."""
    if config.expert_parallel_size == 1:
        return {}
    import torch.distributed as dist

    if cfg.moe is None:
        raise ValueError("expert_parallel_size > 1 needs a mixture-of-experts model")
    size = config.expert_parallel_size
    if member is not None:
        if member.size != size:
            raise ValueError(f"expert_parallel_size {size} but a group of {member.size}")
        rank, group = member.rank, member.group
    elif not dist.is_initialized() or dist.get_world_size() != size:
        raise ValueError("expert parallelism needs torch.distributed initialized with its size")
    else:
        rank, group = dist.get_rank(), None
    if config.expert_slots is None:
        return {
            "ep": dataclasses.replace(
                ExpertParallel.contiguous(rank, size, cfg.moe.num_experts), group=group
            )
        }
    slots = torch.tensor(config.expert_slots)
    shares = config.expert_shares or tuple(tuple(1.0 for _ in row) for row in config.expert_slots)
    shares_t = torch.tensor(shares, dtype=torch.float64)
    return {"ep": ExpertParallel(rank, size, slots, shares_t, group)}
