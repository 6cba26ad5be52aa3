"""Python doors to ``decode.c``: RMSNorm (+ residual), SiLU-and-mul, and rotary + K/V write +
paged attention for decode tokens, on float32 CPU tensors; and to ``prefill.c``: causal
attention of a prefill chunk.

The torch code each replaces is the reference (``engine/layers/norm.py``, ``activation.py``,
``attention.py`` with ``rotary.py``); tests/test_native_kernels.py compares them.
``set_native_enabled(False)`` sends the engine back to the torch code (A/B benchmarks).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from splitserve.kernels.native.build import load

_enabled = True


def set_native_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def native_enabled() -> bool:
    return _enabled


def use_native(x: torch.Tensor) -> bool:
    """Whether x's op takes the native kernels: float32 on the CPU, built, enabled."""
    return _enabled and x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None


def set_attention_lanes(lanes: int) -> None:
    """The decode attention's vector width: 8 or 16 floats, or 0 (the default) for 16 where
    the CPU has AVX-512. Both give the same bits (the tests compare them)."""
    if lanes not in (0, 8, 16):
        raise ValueError(f"lanes must be 0, 8 or 16, not {lanes}")
    ctypes.c_int.in_dll(_lib(), "splitserve_attention_lanes").value = lanes


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not built")
    return lib


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); residual None: x alone."""
    x = x.contiguous()
    k = x.shape[-1]
    out, summed = torch.empty_like(x), torch.empty_like(x)
    res = 0 if residual is None else residual.contiguous().data_ptr()
    _lib().splitserve_add_rms_norm(
        x.data_ptr(),
        res,
        weight.data_ptr(),
        eps,
        x.numel() // k,
        k,
        out.data_ptr(),
        summed.data_ptr(),
    )
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated(x, "splitserve_silu_and_mul")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated(x, "splitserve_gelu_tanh_and_mul")


def _gated(x: torch.Tensor, kernel: str) -> torch.Tensor:
    """x [..., 2I] = gate | up -> [..., I]: the activation of gate times up (float32)."""
    x = x.contiguous()
    half = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], half)
    getattr(_lib(), kernel)(x.data_ptr(), x.numel() // x.shape[-1], half, out.data_ptr())
    return out


def decode_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_heads: int,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
) -> None:
    """Decode rows: qkv [B, (H + 2 Hkv) D] before rotary; writes rotated k and v to the caches
    [blocks, block_size, Hkv, D] at slots, and attention over each row's context (its last
    ``window`` tokens where given) to out [B, H, D] (contiguous)."""
    _, block_size, kv_heads, dim = k_cache.shape
    tables = block_tables.to(torch.int64).contiguous()
    ints = [t.to(torch.int64).contiguous() for t in (positions, slots, context_lens)]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
        raise ValueError("decode_attention needs contiguous caches and output")
    code = _lib().splitserve_decode_attention(
        qkv.contiguous().data_ptr(), qkv.shape[0], num_heads, kv_heads, dim,
        ints[0].data_ptr(), cos.data_ptr(), sin.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), block_size,
        ints[1].data_ptr(), tables.data_ptr(), tables.shape[1], ints[2].data_ptr(),
        scale, window or 0, out.data_ptr(),
    )  # fmt: skip
    if code != 0:
        raise MemoryError("decode_attention: no scratch memory")


@cache
def prefill_pays() -> bool:
    """Whether prefill.c's kernel is the faster one here: on a CPU with AVX-512 (on Zen 5 it
    took 0.5 ms for SmolLM2's 256-token prompt a layer, against torch's flash kernel's 1.7); not
    on an AVX2-only one, where it took 0.81 s for 1,000 tokens against torch's 0.05 (Zen 2:
    its 16-lane vectors run as pairs of 8 there), so torch's attention takes those."""
    lib = load()
    return lib is not None and int(lib.splitserve_best_isa()) >= 2


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """Causal attention of a chunk's queries q [L, H, D], at positions T - L to T - 1 of their
    sequence, over its keys and values k, v [T, Hkv, D] -> [L, H, D]; None where the tensors
    are not float32 of these shapes, or for a shape prefill.c does not take (D not a multiple
    of 16 or above 256, more than 8 query heads per KV head)."""
    (length, heads, dim), (context, kv_heads, _) = q.shape, k.shape
    if (
        k.shape != v.shape
        or k.shape[2] != dim
        or not q.dtype == k.dtype == v.dtype == torch.float32
    ):
        return None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    code = _lib().splitserve_prefill_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), length, context, heads, kv_heads, dim,
        scale, out.data_ptr(),
    )  # fmt: skip
    if code == -2:
        raise MemoryError("prefill_attention: no scratch memory")
    return out if code == 0 else None
