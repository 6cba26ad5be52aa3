"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2): GQA, RoPE, SwiGLU, RMSNorm.

Q/K/V and gate/up projections are fused into one matmul each; ``load_weights`` maps the
Hugging Face names onto the fused slices. Each norm is applied by the projection after it
(``layers/linear.norm_linear``), which fuses them into one kernel at small batch on the GPU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from splitserve.engine.fp8_weights import SCALE_SUFFIX, fp8_copies
from splitserve.engine.kv_cache_spec import KVCacheGroup, KVCacheSpec
from splitserve.engine.layers.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.layers.linear import dense, linear, norm_linear
from splitserve.engine.layers.native_decode import NativeDecode
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.layers.rotary import RotaryEmbedding
from splitserve.engine.model_config import ModelConfig
from splitserve.kernels.fp8_quant import FP8


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.backend = backend
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kv_group = 0
        """The KV cache group whose tensor and block tables this layer reads."""

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (o_proj(attention(norm(x + residual))), x + residual)."""
        qkv, residual = self.project_qkv(x, residual, norm)
        group = meta.group(self.kv_group)
        out = self.backend.forward_qkv(qkv, positions, rotary, self.k_cache, self.v_cache, group)
        return linear(out.reshape(-1, self.q_size), self.o_proj), residual

    def project_qkv(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (q|k|v of norm(x + residual), x + residual)."""
        return norm_linear(x, residual, norm, self.qkv_proj)


class LlamaMLP(nn.Module):
    activation = "silu"
    """The gate's activation (the native decode stack runs "silu" and "gelu_tanh")."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (down(silu(gate) * up) of norm(x + residual), x + residual)."""
        act, residual = norm_linear(x, residual, norm, self.gate_up_proj, gated=True)
        return linear(act, self.down_proj), residual


class LlamaDecoderLayer(nn.Module):
    """Attention then MLP. Other families pass their own: ``mlp`` is called as
    (x, residual, norm) -> (output, residual), like ``LlamaMLP``."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        attention: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention or LlamaAttention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp or LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (MLP output, residual stream): the next norm adds them, fused on CUDA.

        ``x`` is the previous layer's MLP output (the embeddings at layer 0, residual None).
        """
        h, residual = self.self_attn(x, residual, self.input_layernorm, positions, rotary, meta)
        return self.mlp(h, residual, self.post_attention_layernorm)


class LlamaForCausalLM(nn.Module):
    graph_safe = True
    """A decode step reads nothing back to the host: it can be captured in a CUDA graph and
    overlapped with the next step's scheduling."""
    window_graphs = False
    """Decode steps in sliding-window KV cache groups run from the graphs' inputs too
    (``cuda_graphs.WindowGroup``): checked for DeepSeek-V4 only, so the others stay eager
    with window groups."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            self.build_layer(cfg, backend, index) for index in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = self.build_rotary(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.native_decode: NativeDecode | None = None
        """Set by the model runner where the whole layer stack runs natively for steps of
        decode tokens (CPU, GGUF blocks; ``layers/native_decode.py``)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Flat token ids [T] -> final hidden states [T, hidden].

        image_embeds: (rows, embeddings) that replace those rows' token embeddings (the
        image placeholders computed in this step, engine/vision/multimodal.py)."""
        x, residual = self.embed_tokens(input_ids), None
        if image_embeds is not None:
            rows, values = image_embeds
            x = x.index_copy(0, rows, values.to(x.dtype))
        if self.native_decode is not None and self.native_decode.takes(x, meta):
            x, residual = self.native_decode.run(x, positions, meta)
        else:
            for layer in self.layers:
                x, residual = layer(x, residual, positions, self.rotary, meta)
        return self.norm(x) if residual is None else self.norm.add_and_norm(x, residual)[0]

    def build_layer(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> nn.Module:
        """Decoder layer ``index``: the hook where other families put their attention or MLP."""
        return LlamaDecoderLayer(cfg, backend)

    def build_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        """The rotary tables the layers' attention reads (every position's cos and sin)."""
        return RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return dense(hidden, self.lm_head).float()

    def attention_layers(self) -> list[LlamaAttention]:
        return [m for m in self.modules() if isinstance(m, LlamaAttention)]

    def kv_cache_spec(self) -> KVCacheSpec:
        """What one token leaves in each layer's cache: K and V of every KV head."""
        cfg = self.config
        return KVCacheSpec(2, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)

    def kv_cache_groups(self) -> list[KVCacheGroup]:
        """The layers that share a block table: one group of every layer."""
        return [KVCacheGroup(self.kv_cache_spec(), tuple(range(self.config.num_layers)))]

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Points each attention layer at its slices of the runner's ``kv_cache``, shaped
        as ``kv_cache_spec`` says: every layer in one group."""
        every = KVCacheGroup(self.kv_cache_spec(), tuple(range(self.config.num_layers)))
        self.bind_kv_groups([kv_cache], [every])

    def bind_kv_groups(self, caches: list[torch.Tensor], groups: list[KVCacheGroup]) -> None:
        """Points each attention layer at its slices of its group's tensor (``caches[g]``
        for ``groups[g]``, K and V along its first axis)."""
        layers = self.attention_layers()
        for index, (cache, group) in enumerate(zip(caches, groups)):
            for position, layer in enumerate(group.layers):
                layers[layer].k_cache = cache[0, position]
                layers[layer].v_cache = cache[1, position]
                layers[layer].kv_group = index

    def weight_target(self, hf_name: str) -> tuple[str, int]:
        """A checkpoint tensor's Hugging Face name -> (our parameter, first row of its slice
        there): q/k/v land in qkv_proj, gate/up in gate_up_proj."""
        return fused_target(hf_name, self.config)

    def weight_targets(self, hf_name: str) -> list[tuple[str, int]]:
        """A checkpoint tensor's Hugging Face name -> where it goes: (our parameter, first row
        of its slice) for each copy, none for a tensor this model does not hold (an expert
        on another rank); a parameter of 3 or more dimensions counts rows of all but its
        last, flattened."""
        return [self.weight_target(hf_name)]

    def required_rows(self, name: str, param: torch.Tensor) -> int:
        """How many rows of ``param`` the checkpoint must fill (all of them here)."""
        return _rows(param)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        filled = dict.fromkeys(params, 0)
        fp8 = {name for name, param in params.items() if param.dtype == FP8}
        for hf_name, tensor in weights:
            if hf_name == "model.rope_freqs.weight":
                self.rotary.set_frequency_factors(tensor)
                continue
            if "rotary_emb" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for target, at in self.weight_targets(hf_name.removesuffix(SCALE_SUFFIX)):
                for name, offset, part in fp8_copies(hf_name, tensor, target, at, fp8):
                    filled[name] += _copy_rows(params[name], offset, part)
        missing = sorted(n for n, p in params.items() if filled[n] != self.required_rows(n, p))
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter of 3 or more dimensions as rows of its last: [E, R, C] -> [E * R, C]."""
    return tensor.flatten(0, -2) if tensor.dim() > 2 else tensor


def _rows(param: torch.Tensor) -> int:
    return _flat(param).shape[0]


def _copy_rows(param: torch.Tensor, offset: int, tensor: torch.Tensor) -> int:
    """Copies tensor's rows into param's rows [offset, offset + rows); returns rows."""
    source = _flat(tensor)
    _flat(param.data)[offset : offset + source.shape[0]].copy_(source.to(param.dtype))
    return source.shape[0]


_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
_FUSED_MLP = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def fused_target(hf_name: str, cfg: ModelConfig) -> tuple[str, int]:
    """HF tensor name -> (our parameter name, first row of its slice): q/k/v into qkv_proj,
    gate/up into gate_up_proj, other names as they are without ``model.``."""
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    if len(parts) >= 4 and parts[3] in _FUSED:
        target, index = _FUSED[parts[3]]
        sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        offset = (0, sizes[0], sizes[0] + sizes[1])[index]
        return ".".join([*parts[:2], "self_attn", target, parts[-1]]), offset
    if len(parts) >= 4 and parts[3] in _FUSED_MLP:
        target, index = _FUSED_MLP[parts[3]]
        return ".".join([*parts[:2], "mlp", target, parts[-1]]), index * cfg.intermediate_size
    return name, 0
