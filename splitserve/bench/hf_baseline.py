"""The baseline beside every engine number: transformers `generate` on the same inputs."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from splitserve.engine.loader import SHAPE_PREFIX, is_gguf, is_random_shape
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.shapes import shape_config


def load_hf_model(path: str, device: torch.device, dtype: torch.dtype) -> Any:
    """The same GGUF / HF directory through transformers, or a random model of a shape."""
    import transformers
    from transformers import AutoModelForCausalLM

    if is_random_shape(path):
        cfg = shape_config(path.removeprefix(SHAPE_PREFIX))
        config_name, model_name = _HF_CLASSES[cfg.architecture]
        config = getattr(transformers, config_name)(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling,
            tie_word_embeddings=cfg.tie_word_embeddings,
            **_moe_settings(cfg),
        )
        with torch.device(device):
            random_model: Any = getattr(transformers, model_name)(config)
        return random_model.to(dtype=dtype).eval()
    kwargs: dict[str, Any] = {"dtype": dtype}
    if is_gguf(path):
        kwargs["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(os.path.abspath(path))
    model: Any = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.to(device=device).eval()


_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def _moe_settings(cfg: ModelConfig) -> dict[str, Any]:
    """The MoE keys of a transformers config for a shape (none for a dense one)."""
    if cfg.moe is None:
        return {}
    settings = {"num_experts_per_tok": cfg.moe.top_k}
    if cfg.architecture == "mixtral":
        return settings | {"num_local_experts": cfg.moe.num_experts}
    if cfg.mla is not None:
        return settings | _deepseek_settings(cfg)
    return settings | {
        "num_experts": cfg.moe.num_experts,
        "moe_intermediate_size": cfg.moe.intermediate_size,
        "norm_topk_prob": cfg.moe.renormalize,
        "mlp_only_layers": list(cfg.moe.dense_layers),
    }


def _deepseek_settings(cfg: ModelConfig) -> dict[str, Any]:
    """DeepSeek's MLA and DeepSeekMoE keys of a transformers config for a shape."""
    moe, mla = cfg.moe, cfg.mla
    assert moe is not None and mla is not None
    return {
        "n_routed_experts": moe.num_experts,
        "moe_intermediate_size": moe.intermediate_size,
        "n_shared_experts": moe.shared_intermediate_size // moe.intermediate_size,
        "first_k_dense_replace": len(moe.dense_layers),
        "routed_scaling_factor": moe.routed_scaling_factor,
        "n_group": moe.num_groups,
        "topk_group": moe.topk_groups,
        "norm_topk_prob": moe.renormalize,
        "topk_method": "group_limited_greedy" if moe.num_groups > 1 else "greedy",
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_throughput(
    model: Any, prompts: list[list[int]], output_len: int, device: torch.device
) -> dict[str, float]:
    """Greedy generate of 1 token (prefill) and of output_len tokens; decode is the difference."""
    input_ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(input_ids)

    def generate(tokens: int) -> float:
        _sync(device)
        start = time.perf_counter()
        model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
        _sync(device)
        return time.perf_counter() - start

    generate(2)
    prefill_s = generate(1)
    total_s = generate(output_len)
    decode_s = max(total_s - prefill_s, 1e-9)
    return {
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": input_ids.numel() / prefill_s,
        "decode_s": decode_s,
        "decode_tokens_per_s": len(prompts) * (output_len - 1) / decode_s,
        "e2e_tokens_per_s": len(prompts) * output_len / total_s,
    }
