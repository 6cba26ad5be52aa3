"""The shape of a model: read from a Hugging Face config.json or from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.engine.local_attention import (
    GEMMA3_LOCAL_THETA,
    GEMMA3_PATTERN,
    LocalAttention,
    gemma3_from_hf,
    pattern_layers,
)
from splitserve.engine.v4_config import V4Config, v4_from_hf

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "mixtral",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_mtp",  # the MTP layer of a deepseek_v3 checkpoint (engine/spec/mtp.py)
    "deepseek_v4",
    "deepseek_v4_mtp",  # the MTP block of a deepseek_v4 checkpoint (engine/spec/mtp.py)
)


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
    scoring: str = "softmax"
    """DeepSeekMoE (``layers/deepseek_moe.py``): "softmax" (V2: groups ranked by their best
    expert), "sigmoid" (V3: a per-expert ``e_score_correction_bias`` added for the choice
    only, groups ranked by the sum of their two best) or "sqrtsoftplus" (V4: sqrt(softplus),
    the bias as V3's)."""
    num_groups: int = 1
    topk_groups: int = 1
    """The top_k experts come from the ``topk_groups`` best of ``num_groups`` groups."""
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0
    """The shared experts beside the routed ones, as one SwiGLU MLP of this width (0: none)."""
    hash_layers: tuple[int, ...] = ()
    """Layers whose experts are a fixed table of each token id's (V4's ``tid2eid``)."""
    swiglu_limit: float | None = None
    """V4: the gate clamped to at most this, the up projection to +-this, before SwiGLU."""

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError("moe top_k must be in [1, num_experts]")
        if self.scoring not in ("softmax", "sigmoid", "sqrtsoftplus"):
            raise ValueError(f"moe scoring {self.scoring!r}: softmax, sigmoid or sqrtsoftplus")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError("moe groups must divide the experts, topk_groups in [1, groups]")

    @property
    def deepseek(self) -> bool:
        """Routed like DeepSeekMoE (groups, sigmoid scores, scaling or shared experts)."""
        return (
            self.scoring != "softmax"
            or self.num_groups > 1
            or self.routed_scaling_factor != 1.0
            or self.shared_intermediate_size > 0
        )


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, ``layers/mla.py``): queries through a
    low-rank ``q_lora_rank`` path (None: one plain projection), keys and values from one
    ``kv_lora_rank`` latent per token plus a ``qk_rope_head_dim`` RoPE key shared by all
    heads; the cache keeps those two, ``latent_dim`` values a token and layer.
    ``rope_interleave``: the checkpoint's RoPE dimensions come in (even, odd) pairs."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


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
    mla: MLAConfig | None = None
    """Multi-head latent attention (DeepSeek); ``head_dim`` is then its RoPE part's."""
    mtp_layers: int = 0
    """Multi-token-prediction layers the checkpoint ships past the last decoder layer
    (DeepSeek-V3's and V4's ``num_nextn_predict_layers``; engine/spec/mtp.py)."""
    local_attention: LocalAttention | None = None
    """Layers with a sliding window of their own (Gemma 3's local layers). Unlike
    ``sliding_window`` (a window on every layer, which the engine does not build and so
    takes as the context's limit), these layers attend to their window at any length."""
    attention_scale: float | None = None
    """The softmax scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)."""
    final_logit_softcapping: float | None = None
    """Logits become cap * tanh(logits / cap) (Gemma, where its config sets it)."""
    v4: V4Config | None = None
    """DeepSeek-V4's compressed attention and hyper-connections (``models/deepseek_v4.py``)."""

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
        local = None
        if model_type == "gemma3_text":
            _check_gemma3(cfg)
            local, rope_theta, rope_scaling = gemma3_from_hf(cfg)
        v4 = v4_from_hf(cfg) if model_type == "deepseek_v4" else None
        if v4 is not None:  # the window is V4's own; the checkpoint has no dense MLP
            cfg = {**cfg, "sliding_window": None, "intermediate_size": cfg["moe_intermediate_size"]}
            rope_scaling = None
        mla = _mla_from_hf(cfg)
        if mla is not None:
            cfg = {**cfg, "head_dim": mla.qk_rope_head_dim, "num_key_value_heads": num_heads}
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
            if cfg.get("use_sliding_window", True) and local is None
            else None,
            moe=_moe_from_hf(model_type, cfg),
            qk_norm=model_type in QK_NORM_TYPES,
            mla=mla,
            mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0) if mla or v4 else 0,
            local_attention=local,
            attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if local else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            v4=v4,
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], has_output_tensor: bool) -> ModelConfig:
        arch = meta["general.architecture"]

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        head_dim = int(key("attention.key_length", hidden // num_heads))
        rope_scaling = None
        if key("rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        gemma = arch == "gemma3"
        local, scale = None, None
        if gemma:
            layers = pattern_layers(int(key("block_count")), GEMMA3_PATTERN)
            theta = float(key("rope.freq_base_swa", GEMMA3_LOCAL_THETA))
            local = LocalAttention(int(key("attention.sliding_window")), layers, theta)
            # llama.cpp's rule: the 27B (62 layers) scales by hidden / heads, the others by
            # head_dim, as their configs' query_pre_attn_scalar do.
            scalar = hidden // num_heads if int(key("block_count")) == 62 else head_dim
            scale = scalar**-0.5
        return cls(
            architecture="gemma3_text" if gemma else arch,
            vocab_size=int(key("vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings=not has_output_tensor,
            attention_bias=arch == "qwen2",
            rope_scaling=rope_scaling,
            qk_norm=gemma,
            local_attention=local,
            attention_scale=scale,
            final_logit_softcapping=key("final_logit_softcapping"),
        )


QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3_text"})
"""Families with an RMSNorm over each query and key head before rotary."""


def _check_gemma3(cfg: dict[str, Any]) -> None:
    """Gemma 3 settings this engine does not build: refused rather than served wrong."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("gemma3_text: attn_logit_softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("gemma3_text: use_bidirectional_attention is not supported")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError("gemma3_text: only the gelu_pytorch_tanh activation is supported")


def _mla_from_hf(cfg: dict[str, Any]) -> MLAConfig | None:
    if "kv_lora_rank" not in cfg:
        return None
    return MLAConfig(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        # V2's checkpoints are always interleaved; V3's say so (transformers' default True).
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def _deepseek_moe(cfg: dict[str, Any]) -> MoEConfig:
    """DeepSeekMoE: ``first_k_dense_replace`` dense layers, then routed and shared experts.
    V3 scores with a sigmoid and limits by groups always; V2 with a softmax, by groups only
    for ``topk_method: group_limited_greedy``, and never renormalizes (as transformers)."""
    v3 = cfg["model_type"] == "deepseek_v3"
    grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"
    return MoEConfig(
        num_experts=cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        renormalize=v3 and bool(cfg.get("norm_topk_prob", True)),
        dense_layers=tuple(
            range(min(cfg.get("first_k_dense_replace") or 0, cfg["num_hidden_layers"]))
        ),
        scoring="sigmoid" if v3 else "softmax",
        num_groups=(cfg.get("n_group") or 1) if grouped else 1,
        topk_groups=(cfg.get("topk_group") or 1) if grouped else 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        shared_intermediate_size=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
    )


def _v4_moe(cfg: dict[str, Any]) -> MoEConfig:
    """V4: every layer routed (``hash_moe`` layers by token id), one shared expert, the
    chosen scores always renormalized (as transformers)."""
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        hashed = cfg.get("num_hash_layers", 3)
        kinds = ["hash_moe"] * min(layers, hashed) + ["moe"] * max(0, layers - hashed)
    if (
        cfg.get("n_shared_experts", 1) != 1
        or cfg.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus"
    ):
        raise ValueError("deepseek_v4: one shared expert and sqrtsoftplus scoring only")
    return MoEConfig(
        num_experts=cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        renormalize=True,
        scoring="sqrtsoftplus",
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        shared_intermediate_size=cfg["moe_intermediate_size"],
        hash_layers=tuple(i for i, kind in enumerate(kinds[:layers]) if kind == "hash_moe"),
        swiglu_limit=float(cfg.get("swiglu_limit") or 0) or None,
    )


def _moe_from_hf(model_type: str, cfg: dict[str, Any]) -> MoEConfig | None:
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe(cfg)
    if model_type == "deepseek_v4":
        return _v4_moe(cfg)
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
