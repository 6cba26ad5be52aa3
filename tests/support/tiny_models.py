"""Small random models of the Llama family and its MoE relatives (Mixtral, Qwen3-MoE), saved
as Hugging Face directories (safetensors) with SmolLM2's tokenizer, for tests that need a real
checkpoint that loads in a moment."""

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
