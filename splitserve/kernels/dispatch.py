"""When the model's layers take the Triton kernels instead of their torch code.

The kernels run on CUDA tensors when Triton is installed; CPU tensors keep the torch code, so
CPU outputs stay bit-for-bit those of the references. ``set_kernels_enabled(False)`` turns the
kernels off (for A/B benchmarks and for debugging); ``set_kernels_on_cpu(True)`` sends CPU
tensors through them too, which under ``TRITON_INTERPRET=1`` is how the tests run the whole
model on the kernels without a GPU.
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch

_enabled = True
_on_cpu = False
_fused_small_batch = True


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def set_kernels_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def set_kernels_on_cpu(on_cpu: bool) -> None:
    global _on_cpu
    _on_cpu = on_cpu


def set_fused_small_batch(enabled: bool) -> None:
    """Whether small batches take the fused norm + projection kernel (A/B benchmarks)."""
    global _fused_small_batch
    _fused_small_batch = enabled


def fused_small_batch() -> bool:
    return _fused_small_batch


def use_kernels(x: torch.Tensor) -> bool:
    """True when ``x`` should go through the Triton kernels."""
    return (x.is_cuda or _on_cpu) and _enabled and triton_available()
