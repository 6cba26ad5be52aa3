"""Every decoder layer of a step of decode tokens in one native call (CPU, GGUF blocks).

A batch-1 decode step of SmolLM2 is 30 layers of 8 native calls each; made one by one through
the modules, the Python around them (module calls, shape checks, output tensors, ctypes
arguments) cost as much as the kernels. ``NativeDecode`` collects each layer's weight and
cache pointers once and hands the whole stack to ``splitserve_decode_layers``
(``kernels/native/decode.c``), which makes the very same native calls in the same order, so
the hidden states equal the module path's exactly (tests/test_native_decode.py).

It applies to Llama-family stacks (Llama, Qwen3 dense, Gemma 3) whose every projection is a
``BlockLinear`` without bias and whose attention is the torch backend on contiguous caches:
Qwen3's and Gemma's RMSNorms over each query and key head, Gemma's norms of the attention's and
the MLP's outputs, its GeGLU, and its sliding-window layers (their own KV cache group, rotary
tables and window) included. It runs steps of decode tokens only, with fewer rows than any
projection's measured switch to dequantized GEMMs; other steps take the modules. In
deterministic mode every step is decode rows (prompt chunks included) and the products
batch-invariant, so every step runs here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from splitserve.engine.layers.attention import AttentionMetadata, TorchAttention
from splitserve.engine.layers.block_linear import BlockLinear
from splitserve.kernels.native import decode as native
from splitserve.kernels.native.blocks import INVARIANT, ISAS, native_isa
from splitserve.kernels.native.build import load

L_COUNT = 4
"""Integers per layer (decode.c's L_GROUP, L_WINDOW, L_BLOCK, L_GELU)."""
ACTIVATIONS = ("silu", "gelu_tanh")
"""The gated MLPs decode.c runs (an MLP class's ``activation``), in its L_GELU numbering."""


class NativeDecode:
    def __init__(self, model: Any, layers: list[Any]) -> None:
        attn0, mlp0 = layers[0].self_attn, layers[0].mlp
        self.model, self.layers = model, layers
        self.hidden = attn0.o_proj.out_features
        self.heads, self.kv_heads, self.head_dim = (
            attn0.num_heads,
            attn0.num_kv_heads,
            attn0.head_dim,
        )
        self.intermediate = mlp0.down_proj.in_features
        self.eps = float(layers[0].input_layernorm.eps)
        self.scale = float(attn0.backend.scale)
        self.max_rows = min(
            [p.dequantize_from for p in self._projections() if p.dequantize_from is not None],
            default=1 << 30,
        )
        self.invariant = all(p.invariant for p in self._projections())
        """Batch-invariant block products (deterministic mode, ``batch_invariant.py``)."""
        self._cache_ptr = -1
        self._pointers = torch.empty(0, dtype=torch.int64)
        self._ints = torch.empty(0, dtype=torch.int64)
        self._types = torch.tensor([p.qtype for p in self._projections()], dtype=torch.int32)
        self._dims = torch.tensor(
            [self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
             len(layers)], dtype=torch.int64,
        )  # fmt: skip

    @classmethod
    def build(cls, model: nn.Module) -> NativeDecode | None:
        """The fast path for model, or None where it does not apply."""
        layers: list[Any] = list(getattr(model, "layers", []))
        if not layers or load() is None or not native.native_enabled():
            return None
        attn0 = layers[0].self_attn
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (
                getattr(attn, "qkv_proj", None),  # none in latent attention
                getattr(attn, "o_proj", None),  # none in DeepSeek-V4's
                getattr(mlp, "gate_up_proj", None),  # none in an MoE layer
                getattr(mlp, "down_proj", None),
            )
            if not all(isinstance(p, BlockLinear) for p in projections):
                return None
            if attn.k_cache.dtype != torch.float32:  # an FP8 cache (layers/fp8_kv.py)
                return None
            if (
                type(attn.backend) is not TorchAttention
                or attn.backend.scale != attn0.backend.scale
            ):
                return None
            if getattr(mlp, "activation", None) not in ACTIVATIONS or not all(
                norm.eps == layers[0].input_layernorm.eps and norm.weight.dtype == torch.float32
                for norm in _norms(layer)
            ):
                return None
        return cls(model, layers)

    def takes(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        rows = x.shape[0]
        return (
            native.native_enabled()
            and rows == meta.num_decode_tokens
            and not meta.prefills
            and rows < self.max_rows
        )

    def run(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, hidden] embeddings -> (last MLP output, residual stream)."""
        self._refresh_pointers()
        rows = x.shape[0]
        x = x.contiguous().clone()
        residual = torch.empty_like(x)
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        q_size = self.heads * self.head_dim
        scratch = x.new_empty(
            rows * (3 * self.hidden + width + q_size + 3 * self.intermediate) + q_size
        )
        held = []  # the step's int64 tensors, alive until the call returns
        groups = []
        for group in [meta, *meta.windows]:
            tables = group.decode_block_tables.to(torch.int64).contiguous()
            slots, lens = (
                t.to(torch.int64).contiguous()
                for t in (group.slot_mapping, group.decode_context_lens)
            )
            held += [tables, slots, lens]
            groups += [slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr()]
        addresses = torch.tensor(groups, dtype=torch.int64)
        positions = positions.to(torch.int64).contiguous()
        lib = load()
        assert lib is not None
        code = lib.splitserve_decode_layers(
            x.data_ptr(), residual.data_ptr(), rows, self._pointers.data_ptr(),
            self._ints.data_ptr(), self._types.data_ptr(), self._dims.data_ptr(),
            addresses.data_ptr(), self.eps, self.scale, positions.data_ptr(),
            scratch.data_ptr(), ISAS.index(native_isa()) | (INVARIANT if self.invariant else 0),
        )  # fmt: skip
        if code != 0:
            raise RuntimeError(f"splitserve_decode_layers failed ({code})")
        return x, residual

    def _projections(self) -> list[BlockLinear]:
        out = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        return out

    def _refresh_pointers(self) -> None:
        """Weight and cache addresses; rebuilt when the KV cache was (re)allocated."""
        first = self.layers[0].self_attn.k_cache
        if first.data_ptr() == self._cache_ptr:
            return
        pointers, ints = [], []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not (attn.k_cache.is_contiguous() and attn.v_cache.is_contiguous()):
                raise ValueError("the native decode path needs contiguous KV caches")
            rotary = getattr(layer, "rotary", None) or self.model.rotary
            tensors = (
                attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight,
                mlp.down_proj.weight, layer.input_layernorm.weight,
                _mlp_norm(layer).weight, attn.k_cache, attn.v_cache,
            )  # fmt: skip
            pointers += [t.data_ptr() for t in tensors]
            for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                pointers.append(0 if p.interleaved is None else p.interleaved.data_ptr())
            optional = (
                getattr(attn, "q_norm", None), getattr(attn, "k_norm", None),
                _output_norm(layer, "attention"), _output_norm(layer, "mlp"),
            )  # fmt: skip
            pointers += [0 if norm is None else norm.weight.data_ptr() for norm in optional]
            pointers += [rotary.cos.data_ptr(), rotary.sin.data_ptr()]
            window = attn.backend.sliding_window or 0
            ints += [
                attn.kv_group,
                window,
                attn.k_cache.shape[1],
                ACTIVATIONS.index(mlp.activation),
            ]
        self._pointers = torch.tensor(pointers, dtype=torch.int64)
        self._ints = torch.tensor(ints, dtype=torch.int64)
        self._cache_ptr = first.data_ptr()


def _mlp_norm(layer: Any) -> Any:
    """The norm before the MLP (Gemma 3 names it pre_feedforward_layernorm and gives the
    name post_attention_layernorm to the attention output's norm)."""
    return getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm


def _output_norm(layer: Any, kind: str) -> Any:
    """Gemma 3's norm of the attention's or the MLP's output, or None."""
    if getattr(layer, "pre_feedforward_layernorm", None) is None:
        return None
    return (
        layer.post_attention_layernorm if kind == "attention" else layer.post_feedforward_layernorm
    )


def _norms(layer: Any) -> list[Any]:
    attn = layer.self_attn
    norms = [layer.input_layernorm, _mlp_norm(layer), _output_norm(layer, "attention")]
    norms += [_output_norm(layer, "mlp"), getattr(attn, "q_norm", None)]
    norms.append(getattr(attn, "k_norm", None))
    return [norm for norm in norms if norm is not None]
