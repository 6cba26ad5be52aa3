"""Public model shapes served with random weights (``shape:<name>``): benchmarks at a real
model's size without its checkpoint, and test-sized models for end-to-end tests.

``shape:<name>?layers=N`` takes the shape's first N decoder layers (a few full-width layers of
a model too large for one device)."""

from __future__ import annotations

import dataclasses
from typing import Any

from splitserve.engine.model_config import MLAConfig, ModelConfig, MoEConfig
from splitserve.engine.v4_config import Rope, V4Config


def _shape(**fields: Any) -> ModelConfig:
    base: dict[str, Any] = {
        "architecture": "llama",
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "max_position_embeddings": 8192,
    }
    return ModelConfig(**{**base, **fields})


SHAPES = {
    # Test-sized: serves end to end on a CPU in a moment (tests/test_shape_serving.py).
    "tiny-llama": _shape(
        max_position_embeddings=2048,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # Test-sized MoE: 8 experts, top-2 (tests/test_moe_engine.py).
    "tiny-mixtral": _shape(
        architecture="mixtral",
        max_position_embeddings=2048,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=96, renormalize=True),
    ),
    "smollm2-135m": _shape(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama3-8b": _shape(
        max_position_embeddings=131072,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # Mixtral-8x7B-v0.1: 8 experts, top-2, renormalized.
    "mixtral-8x7b": _shape(
        architecture="mixtral",
        max_position_embeddings=32768,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=14336, renormalize=True),
    ),
    # Qwen3-30B-A3B: 128 experts of 768, top-8, renormalized; q/k norms.
    "qwen3-30b-a3b": _shape(
        architecture="qwen3_moe",
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        moe=MoEConfig(num_experts=128, top_k=8, intermediate_size=768, renormalize=True),
        qk_norm=True,
    ),
}

_DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
}
SHAPES |= {
    # Test-sized DeepSeek-V3: MLA, 8 experts in 4 groups (top-2 of 2 groups), a shared
    # expert, the first layer dense, an MTP layer (tests/test_deepseek_engine.py).
    "tiny-deepseek-v3": _shape(
        architecture="deepseek_v3",
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        moe=MoEConfig(8, 2, 32, True, (0,), "sigmoid", 4, 2, 2.5, 32),
        mla=MLAConfig(32, 32, 16, 16, 24),
        mtp_layers=1,
    ),
    # DeepSeek-V2-Lite: no q low-rank path, 64 experts of 1408, top-6, 2 shared.
    "deepseek-v2-lite": _shape(
        architecture="deepseek_v2",
        rms_norm_eps=1e-6,
        max_position_embeddings=163840,
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        num_layers=27,
        num_heads=16,
        num_kv_heads=16,
        head_dim=64,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        rope_scaling={**_DEEPSEEK_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        moe=MoEConfig(64, 6, 1408, False, (0,), shared_intermediate_size=2 * 1408),
        mla=MLAConfig(None, 512, 128, 64, 128),
    ),
    # DeepSeek-V3 (and R1, V3.1): 256 experts of 2048 in 8 groups, top-8 of 4 groups,
    # a shared expert, 3 dense layers, one MTP layer. ``shape:deepseek-v3?layers=4``: the
    # first 4 layers (loader.py).
    "deepseek-v3": _shape(
        architecture="deepseek_v3",
        rms_norm_eps=1e-6,
        max_position_embeddings=163840,
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_layers=61,
        num_heads=128,
        num_kv_heads=128,
        head_dim=64,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        rope_scaling={**_DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
        moe=MoEConfig(256, 8, 2048, True, (0, 1, 2), "sigmoid", 8, 4, 2.5, 2048),
        mla=MLAConfig(1536, 512, 128, 64, 128),
        mtp_layers=1,
    ),
}


def _v4(kinds: tuple[str, ...], **fields: Any) -> V4Config:
    base: dict[str, Any] = {"hc_iters": 20, "hc_eps": 1e-6, "main_rope": Rope(10000.0)}
    return V4Config(layer_kinds=kinds, **{**base, **fields})


_V4_FLASH_KINDS = ("hca", "hca", *("csa" if i % 2 else "hca" for i in range(41)))
SHAPES |= {
    # Test-sized DeepSeek-V4: sliding, CSA and HCA layers, 2 streams, a hash-routed layer.
    "tiny-deepseek-v4": _shape(
        architecture="deepseek_v4",
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        moe=MoEConfig(8, 2, 32, True, (), "sqrtsoftplus", 1, 1, 1.5, 32, (0,), 3.0),
        v4=_v4(
            ("sliding", "csa", "hca", "csa"),
            head_dim=32,
            rope_dim=8,
            q_lora_rank=24,
            window=8,
            csa_rate=4,
            hca_rate=8,
            o_groups=2,
            o_lora_rank=16,
            index_heads=16,
            index_head_dim=16,
            index_topk=3,
            hc_mult=2,
            compress_rope=Rope(160000.0),
        ),
    ),
    # DeepSeek-V4-Flash as transformers' default config describes it: 43 layers (2 HCA,
    # then CSA and HCA alternating), 256 experts of 2048, top-6, the first 3 hash-routed,
    # 4 streams, one MTP layer; the compress rope without YaRN. ``?layers=N`` as V3's.
    "deepseek-v4-flash": _shape(
        architecture="deepseek_v4",
        rms_norm_eps=1e-6,
        max_position_embeddings=1048576,
        vocab_size=129280,
        hidden_size=4096,
        intermediate_size=2048,
        num_layers=43,
        num_heads=64,
        num_kv_heads=1,
        head_dim=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        mtp_layers=1,
        moe=MoEConfig(256, 6, 2048, True, (), "sqrtsoftplus", 1, 1, 1.5, 2048, (0, 1, 2), 10.0),
        v4=_v4(
            _V4_FLASH_KINDS,
            head_dim=512,
            rope_dim=64,
            q_lora_rank=1024,
            window=128,
            csa_rate=4,
            hca_rate=128,
            o_groups=8,
            o_lora_rank=1024,
            index_heads=64,
            index_head_dim=128,
            index_topk=512,
            hc_mult=4,
            compress_rope=Rope(160000.0),
        ),
    ),
}


def shape_config(name: str) -> ModelConfig:
    """A shape by name, with an optional ``?layers=N`` suffix (N at most the shape's)."""
    base, _, query = name.partition("?")
    if base not in SHAPES:
        raise ValueError(f"unknown shape {base!r}; known: {', '.join(SHAPES)}")
    config = SHAPES[base]
    if not query:
        return config
    key, _, value = query.partition("=")
    if key != "layers" or not value.isdigit() or not 0 < int(value) <= config.num_layers:
        raise ValueError(
            f"shape option {query!r}: only layers=N, N in [1, {config.num_layers}], is known"
        )
    layers = int(value)
    moe, v4 = config.moe, config.v4
    if moe is not None:
        dense = tuple(i for i in moe.dense_layers if i < layers)
        hashed = tuple(i for i in moe.hash_layers if i < layers)
        moe = dataclasses.replace(moe, dense_layers=dense, hash_layers=hashed)
    if v4 is not None:
        v4 = dataclasses.replace(v4, layer_kinds=v4.layer_kinds[:layers])
    return dataclasses.replace(config, num_layers=layers, moe=moe, v4=v4)
