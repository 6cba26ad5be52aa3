"""The shape of a model: read from a Hugging Face config.json or from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "mixtral", "qwen3_moe")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: ``top_k`` of ``num_experts`` SwiGLU experts per token, chosen
    by a softmax router; ``renormalize`` rescales the chosen probabilities to sum to one
    (Mixtral always, Qwen3-MoE with ``norm_topk_prob``). Layers in ``dense_layers`` keep a
    dense MLP of the model's ``intermediate_size`` (Qwen3-MoE's ``mlp_only_layers``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError("moe top_k must be in [1, num_experts]")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    moe: MoEConfig | None = None
    qk_norm: bool = False
    """RMSNorm over each query and key head before rotary (Qwen3)."""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        if isinstance(rope_scaling, dict):
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling = None if rope_type == "default" else dict(rope_scaling)
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            rope_scaling=rope_scaling,
            sliding_window=cfg.get("sliding_window")
            if cfg.get("use_sliding_window", True)
            else None,
            moe=_moe_from_hf(model_type, cfg),
            qk_norm=model_type == "qwen3_moe",
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], has_output_tensor: bool) -> ModelConfig:
        arch = meta["general.architecture"]

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        rope_scaling = None
        if key("rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        return cls(
            architecture=arch,
            vocab_size=int(key("vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=int(key("attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings=not has_output_tensor,
            attention_bias=arch == "qwen2",
            rope_scaling=rope_scaling,
        )


def _moe_from_hf(model_type: str, cfg: dict[str, Any]) -> MoEConfig | None:
    if model_type == "mixtral":
        return MoEConfig(
            num_experts=cfg["num_local_experts"],
            top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["intermediate_size"],
            renormalize=True,
        )
    if model_type != "qwen3_moe":
        return None
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    dense |= {i for i in range(cfg["num_hidden_layers"]) if (i + 1) % step}
    return MoEConfig(
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        dense_layers=tuple(sorted(dense)),
    )


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
