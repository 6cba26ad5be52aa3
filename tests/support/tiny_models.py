"""Small random models of the Llama family, its MoE relatives (Mixtral, Qwen3-MoE) and
DeepSeek-V2/V3/V4, saved as Hugging Face directories (safetensors) with SmolLM2's tokenizer, for
tests that need a real checkpoint that loads in a moment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
}
CALM = {"initializer_range": 0.05}
"""Weights for tolerance tests of rounding: at BASE's 0.3 every layer amplifies a rounding."""
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
    drawn after ``torch.manual_seed(seed)``. Qwen2's q/k/v biases and the norm weights of Qwen3
    (its q/k norms) and Gemma 3 (all of them), which transformers starts at zero or one, are
    drawn too, so that they change the outputs."""
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
    if family in ("qwen3", "qwen3_moe"):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    if family == "gemma3_text":
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(-0.5, 0.5)
    if family == "deepseek_v3":
        with torch.no_grad():
            for layer in model.model.layers[model.config.first_k_dense_replace :]:
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    if family == "deepseek_v4":
        _draw_v4_extras(model)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model, str(path)


TINY_KV_BYTES = 64 << 20
"""A tiny model's KV pool: room for tens of thousands of tokens. The default 1 GiB is 100,000
blocks and more of a tiny model, each an object the block manager makes at start (0.3 s)."""


def tiny_llm(path: str, tokenizer: Any, **engine_args: Any) -> LLM:
    """An LLM on a checkpoint saved with SmolLM2's tokenizer (``tiny_model``), given that
    tokenizer as loaded once for the session instead of loading it again (0.3 s), and a KV
    pool of TINY_KV_BYTES unless ``engine_args`` size it."""
    engine_args.setdefault("kv_cache_bytes", TINY_KV_BYTES)
    engine = LLMEngine(EngineConfig(model=path, **engine_args), tokenizer=tokenizer)
    return LLM.from_engine(engine)


def tiny_mixtral(tokenizer: Any, path: Path) -> tuple[Any, str]:
    """8 experts, top-2, renormalized router."""
    return tiny_model(
        tokenizer, path, "mixtral", seed=3, num_local_experts=8, num_experts_per_tok=2
    )


def tiny_qwen3_moe(tokenizer: Any, path: Path, **config: Any) -> tuple[Any, str]:
    """q/k norms, 8 experts of 48, top-3 without renormalization, layer 1 a dense MLP;
    ``config`` on top."""
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
        **config,
    )


def tiny_qwen3(tokenizer: Any, path: Path) -> tuple[Any, str]:
    """Qwen3 dense: q/k norms, GQA 4:2, no biases, untied head."""
    return tiny_model(tokenizer, path, "qwen3", seed=8, head_dim=32, num_hidden_layers=3)


def tiny_gemma3(tokenizer: Any, path: Path, window: int = 8) -> tuple[Any, str]:
    """Gemma 3's layout at test size: 7 layers (local but for layer 5), a sliding window of
    ``window``, local and global rope bases 10,000 and 50,000 (the global ones linearly
    scaled by 2), query_pre_attn_scalar 48, final logits softcapped at 30, tied embeddings,
    every norm weight drawn."""
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
    }
    return tiny_model(
        tokenizer, path, "gemma3_text", seed=9, num_hidden_layers=7, head_dim=32,
        num_key_value_heads=1, sliding_window=window, rope_parameters=rope,
        query_pre_attn_scalar=48, final_logit_softcapping=30.0, tie_word_embeddings=False,
    )  # fmt: skip


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


def tiny_deepseek_v3(tokenizer: Any, path: Path, **config: Any) -> tuple[Any, str]:
    """V3's layout: the q low-rank path, sigmoid router with a random correction bias over
    8 experts in 4 groups (top-2 of 2 groups, renormalized, scaled by 2.5), a shared
    expert, interleaved YaRN rope whose mscale differs from mscale_all_dim; ``config`` on
    top (DEEPSEEK's sizes among them)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
            "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0}  # fmt: skip
    settings = DEEPSEEK | dict(
        q_lora_rank=32, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        rope_parameters=yarn,
    )  # fmt: skip
    return tiny_model(tokenizer, path, "deepseek_v3", seed=7, **(settings | config))


V4_LAYERS = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]


def tiny_deepseek_v4(tokenizer: Any, path: Path, seed: int = 10) -> tuple[Any, str]:
    """V4's layout at test size: a sliding layer, two CSA layers (4 tokens an entry, the
    indexer's best 3 of them) and an HCA layer (8 tokens an entry), a window of 8, 2
    hyper-connection streams, 4 heads of 32 with a rope part of 8, the output in 2 groups,
    the first layer's experts hashed from the token id and the others top-2 of 8, SwiGLU
    clipped at 3. The indexer has 16 heads: with few, a query often scores several entries
    exactly 0 (every head's ReLU at 0) and transformers' own cached and uncached runs then
    break the tie differently."""
    return tiny_model(
        tokenizer, path, "deepseek_v4", seed=seed, num_hidden_layers=4, num_key_value_heads=1,
        head_dim=32, q_lora_rank=24, partial_rotary_factor=0.25, intermediate_size=32,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        layer_types=V4_LAYERS, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8, hc_mult=2, o_groups=2, o_lora_rank=16, index_n_heads=16,
        index_head_dim=16, index_topk=3, swiglu_limit=3.0,
    )  # fmt: skip


def _draw_v4_extras(model: Any) -> None:
    """The parameters transformers starts at zero or one (or a zero table) drawn, so that
    they change the outputs: sinks, the compressors' position biases, the routers' biases and
    hash tables, the hyper-connections' bases and scales, the norms."""
    experts = model.config.n_routed_experts
    with torch.no_grad():
        for name, param in model.named_parameters():
            last = name.rsplit(".", 1)[-1]
            if last in ("sinks", "position_bias", "base", "hc_base"):
                param.normal_(0, 0.5)
            elif last in ("scale", "hc_scale") or name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                gate.tid2eid.copy_(torch.randint(0, experts, gate.tid2eid.shape))
            else:
                gate.e_score_correction_bias.uniform_(-0.3, 0.3)
