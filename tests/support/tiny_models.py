"""Small random models of the Llama family, its MoE relatives (Mixtral, Qwen3-MoE) and
DeepSeek-V2/V3, saved as Hugging Face directories (safetensors) with SmolLM2's tokenizer, for
tests that need a real checkpoint that loads in a moment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}
BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
)


def tiny_model(
    tokenizer: Any, path: Path, family: str = "llama", seed: int = 0, **config: Any
) -> tuple[Any, str]:
    """(the transformers model, its directory): BASE's shape with ``config`` on top, weights
    drawn after ``torch.manual_seed(seed)``. Qwen2's q/k/v biases and the q/k norm weights of
    Qwen3-MoE, which transformers starts at zero and one, are drawn too, so that they change
    the outputs."""
    import transformers

    config_name, model_name = FAMILIES[family]
    torch.manual_seed(seed)
    settings = BASE | {"vocab_size": len(tokenizer)} | config
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**settings))
    model.eval()
    if family == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if family == "qwen3_moe":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    if family == "deepseek_v3":
        with torch.no_grad():
            for layer in model.model.layers[model.config.first_k_dense_replace :]:
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model, str(path)


def tiny_mixtral(tokenizer: Any, path: Path) -> tuple[Any, str]:
    """8 experts, top-2, renormalized router."""
    return tiny_model(
        tokenizer, path, "mixtral", seed=3, num_local_experts=8, num_experts_per_tok=2
    )


def tiny_qwen3_moe(tokenizer: Any, path: Path) -> tuple[Any, str]:
    """q/k norms, 8 experts of 48, top-3 without renormalization, layer 1 a dense MLP."""
    return tiny_model(
        tokenizer,
        path,
        "qwen3_moe",
        seed=4,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        head_dim=32,
        num_hidden_layers=3,
    )


DEEPSEEK = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
)


def tiny_deepseek_v2(tokenizer: Any, path: Path) -> tuple[Any, str]:
    """V2-Lite's layout: a plain q_proj, softmax router greedy over 8 experts (top-2, scaled
    by 1.5), 2 shared experts, layer 0 dense, YaRN rope with mscale 0.707."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
            "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}  # fmt: skip
    return tiny_model(
        tokenizer, path, "deepseek_v2", seed=5, **DEEPSEEK, q_lora_rank=None,
        n_shared_experts=2, topk_method="greedy", routed_scaling_factor=1.5,
        rope_parameters=yarn,
    )  # fmt: skip


def tiny_deepseek_v2_grouped(tokenizer: Any, path: Path) -> tuple[Any, str]:
    """V2's layout: the q low-rank path, the softmax router limited to 2 of 4 groups."""
    return tiny_model(
        tokenizer, path, "deepseek_v2", seed=6, **DEEPSEEK, q_lora_rank=24,
        n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
    )  # fmt: skip


def tiny_deepseek_v3(tokenizer: Any, path: Path) -> tuple[Any, str]:
    """V3's layout: the q low-rank path, sigmoid router with a random correction bias over
    8 experts in 4 groups (top-2 of 2 groups, renormalized, scaled by 2.5), a shared
    expert, interleaved YaRN rope whose mscale differs from mscale_all_dim."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
            "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0}  # fmt: skip
    return tiny_model(
        tokenizer, path, "deepseek_v3", seed=7, **DEEPSEEK, q_lora_rank=32,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        rope_parameters=yarn,
    )  # fmt: skip
