"""Which attention backend a config names: the factory sits above the backends (attention.py
holds the interface and the torch backend, triton_attention.py the Triton one)."""

from __future__ import annotations

from splitserve.engine.layers.attention import AttentionBackend, TorchAttention


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    if name == "torch":
        return TorchAttention(num_heads, num_kv_heads, head_dim)
    if name == "triton":
        from splitserve.engine.layers.triton_attention import (
            TritonAttention,  # lazy: the package imports without Triton
        )

        return TritonAttention(num_heads, num_kv_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r} (available: torch, triton)")
