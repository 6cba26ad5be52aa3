"""Which attention backend a config names: the factory sits above the backends (attention.py
holds the interface and the torch backend, triton_attention.py the Triton one), and what
``auto`` (the default) picks for a device."""

from __future__ import annotations

from splitserve.engine.layers.attention import AttentionBackend, TorchAttention


def choose_backend(
    name: str, device_type: str, triton_available: bool, sliding_window: bool = False
) -> str:
    """The backend ``name`` stands for on a device: ``auto`` is the fastest correct one, the
    Triton kernels on CUDA where Triton is installed (7.6x the torch path on an H200 for
    SmolLM2, issue 46), torch elsewhere (CPU, Ascend, CUDA without Triton) and for models
    with sliding-window layers (Gemma 3: the Triton kernels have no window yet)."""
    if name != "auto":
        return name
    fast = device_type == "cuda" and triton_available and not sliding_window
    return "triton" if fast else "torch"


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    if name == "torch":
        return TorchAttention(num_heads, num_kv_heads, head_dim)
    if name == "triton":
        from splitserve.engine.layers.triton_attention import (
            TritonAttention,  # lazy: the package imports without Triton
        )

        return TritonAttention(num_heads, num_kv_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r} (available: torch, triton)")
